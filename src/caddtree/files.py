"""Writing files atomically: through a temporary file in the same folder, then a rename, so a
crash or Ctrl-C never leaves half a file where a complete one was (or is expected).

The file ends with the permissions a plain ``open(path, "w")`` would give it: those of the file it
replaces, or for a new file ``0o666`` less the process's umask. (``tempfile.mkstemp`` alone makes
every file private to its owner, which breaks a cache or a results folder shared between users.)
"""

from __future__ import annotations

import os
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path

__all__ = ["atomic_write", "atomic_write_text", "current_umask", "new_file_mode"]


def current_umask() -> int:
    """The process's umask, read without changing it where the system allows (Linux), so other
    threads never see a temporarily different umask."""
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)  # elsewhere: the only portable way to read it is to set it
    os.umask(mask)
    return mask


def new_file_mode(path: str | os.PathLike[str]) -> int:
    """The permission bits ``open(path, "w")`` would leave ``path`` with: its current ones when it
    exists, else ``0o666`` less the umask."""
    try:
        return stat.S_IMODE(os.stat(path).st_mode)
    except OSError:
        return 0o666 & ~current_umask()


def atomic_write(path: str | os.PathLike[str], write: Callable[[str], object]) -> Path:
    """Create ``path``'s folder, call ``write(tmp)`` to fill a temporary file beside it, then
    rename that over ``path`` with the mode of :func:`new_file_mode`. On any error the temporary
    file goes and ``path`` is untouched."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        os.chmod(tmp, new_file_mode(path))
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def atomic_write_text(path: str | os.PathLike[str], text: str) -> Path:
    """:func:`atomic_write` of UTF-8 ``text``."""
    return atomic_write(path, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))
