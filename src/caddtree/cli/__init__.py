"""The ``caddtree`` command line.

Every sub-command turns a :class:`~caddtree.util.errors.CaddtreeError` into a one-line message on
stderr and exit status 2, never a traceback.

One module per sub-command group, each with ``register(sub)`` (its parser, options and handler):
:mod:`~caddtree.cli.tree_demo`, :mod:`~caddtree.cli.generate`, :mod:`~caddtree.cli.profile`,
:mod:`~caddtree.cli.train` (``train-drafter``), :mod:`~caddtree.cli.bench` (``bench`` and
``report``) and :mod:`~caddtree.cli.serve` (a pass-through to :mod:`caddtree.serve`). None of them
imports torch at module level: ``caddtree --help`` and ``tree-demo`` answer without it, and
everything slow is imported inside :func:`main`, where Ctrl-C is caught.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence

from ..util.logs import run_command
from . import bench, generate, profile, serve, train, tree_demo

Handler = Callable[[argparse.Namespace], int]

# the sub-commands, in the order `caddtree --help` lists them
_COMMANDS = (tree_demo, generate, profile, train, bench, serve)


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="caddtree",
        description="Lossless speculative decoding with cost-aware diffusion draft trees.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for command in _COMMANDS:
        command.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one sub-command. Everything heavy (torch, transformers) is imported in here, after
    ``caddtree.cli`` itself has loaded, so a Ctrl-C during start-up ends as any other one does:
    "caddtree: interrupted" and exit status 130, no traceback (:func:`caddtree.util.logs.run_command`).
    """

    def command() -> int:
        args = _build_parser().parse_args(argv)
        handler: Handler = args.handler
        return handler(args)

    return run_command(command)
