"""The library's log as the ``caddtree`` commands show it: ``caddtree: message`` lines on stderr.

The library logs through :mod:`logging` under the ``caddtree`` logger (model conversion, profiling,
cached cost models) and never configures logging itself; the command line and ``caddtree serve``
call :func:`install_log_handler` so that a person sees those messages.
"""

from __future__ import annotations

import logging
import sys

__all__ = ["StderrLines", "install_log_handler"]


class StderrLines(logging.Handler):
    """The command line's view of the library's log: ``caddtree: message`` on stderr, written to
    whatever ``sys.stderr`` is when the record is emitted."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            prefix = "caddtree: warning: " if record.levelno >= logging.WARNING else "caddtree: "
            sys.stderr.write(prefix + self.format(record) + "\n")
            sys.stderr.flush()
        except Exception:  # noqa: BLE001 - logging must never end the program
            self.handleError(record)


def install_log_handler() -> None:
    """Show the library's info messages and warnings (once, however often ``main`` runs)."""
    root = logging.getLogger("caddtree")
    if not any(isinstance(h, StderrLines) for h in root.handlers):
        root.addHandler(StderrLines())
    root.setLevel(logging.INFO)
