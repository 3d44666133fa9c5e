"""Writing files atomically: through a temporary file in the same folder, then a rename, so a
crash or Ctrl-C never leaves half a file where a complete one was (or is expected)."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path

__all__ = ["atomic_write", "atomic_write_text"]


def atomic_write(path: str | os.PathLike[str], write: Callable[[str], object]) -> Path:
    """Create ``path``'s folder, call ``write(tmp)`` to fill a temporary file beside it, then
    rename that over ``path``. On any error the temporary file goes and ``path`` is untouched."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def atomic_write_text(path: str | os.PathLike[str], text: str) -> Path:
    """:func:`atomic_write` of UTF-8 ``text``."""
    return atomic_write(path, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))
