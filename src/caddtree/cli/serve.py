"""``caddtree serve``: a pass-through to :mod:`caddtree.serve` (the optional ``serve`` extra), which
parses its own options."""

from __future__ import annotations

import argparse


def serve(args: argparse.Namespace) -> int:
    """`caddtree serve`: see :func:`caddtree.serve.main`."""
    from ..serve import main as serve_main  # MissingDependencyError without the serve extra

    return serve_main(args.serve_args)


def register(sub: argparse._SubParsersAction) -> None:
    """Add this sub-command's parser to ``sub``."""
    # The server's options live in caddtree.serve, which needs the optional fastapi and uvicorn:
    # its arguments pass through untouched (`caddtree serve --help` prints its own help).
    p = sub.add_parser(
        "serve",
        help="serve the models with an OpenAI-compatible HTTP API (pip install 'caddtree[serve]')",
        add_help=False,
        prefix_chars="\0",
    )
    p.add_argument("serve_args", nargs="*")
    p.set_defaults(handler=serve)
