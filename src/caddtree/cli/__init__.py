"""The ``caddtree`` command line.

Every sub-command turns a :class:`~caddtree.errors.CaddtreeError` into a one-line message on
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
import contextlib
import os
import signal
import sys
from collections.abc import Callable, Sequence

from ..errors import CaddtreeError
from ..logs import install_log_handler
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


def _quiet_broken_pipe() -> int:
    """Exit quietly after the reader of our output went away (``caddtree ... | head``), as Unix
    tools do: point stdout and stderr at /dev/null, so that the interpreter's final flush does not
    raise again, and return the status of a process ended by SIGPIPE (see the Python
    documentation's note on SIGPIPE)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    for stream in (sys.stdout, sys.stderr):
        # not every stream is a real file (e.g. under a test)
        with contextlib.suppress(OSError, ValueError, AttributeError):
            os.dup2(devnull, stream.fileno())
    os.close(devnull)
    return 128 + getattr(signal, "SIGPIPE", 13)


def main(argv: Sequence[str] | None = None) -> int:
    """Run one sub-command. Everything heavy (torch, transformers) is imported in here, after
    ``caddtree.cli`` itself has loaded, so a Ctrl-C during start-up ends as any other one does:
    "caddtree: interrupted" and exit status 130, no traceback."""
    install_log_handler()
    try:
        parser = _build_parser()
        args = parser.parse_args(argv)
        handler: Handler = args.handler
        status = handler(args)
        sys.stdout.flush()  # a closed pipe is reported here, not at interpreter exit
        return status
    except CaddtreeError as exc:
        print(f"caddtree: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("caddtree: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return _quiet_broken_pipe()
