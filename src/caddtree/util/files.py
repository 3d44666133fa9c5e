"""Writing files and directories atomically: through a temporary sibling, then a rename, so a
crash or Ctrl-C never leaves half a file (or half a directory) where a complete one was or is
expected.

The file ends with the permissions a plain ``open(path, "w")`` would give it: those of the file it
replaces, or for a new file ``0o666`` less the process's umask. (``tempfile.mkstemp`` alone makes
every file private to its owner, which breaks a cache or a results folder shared between users.)
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import stat
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from .errors import CaddtreeError

__all__ = [
    "atomic_directory",
    "atomic_write",
    "atomic_write_text",
    "packed_path",
    "read_packed",
    "write_packed",
    "current_umask",
    "new_file_mode",
    "replace_directory",
]

logger = logging.getLogger(__name__)

STALE_BUILD_SECONDS = 6 * 3600
"""A build directory left this long by :func:`atomic_directory` belongs to a process that died."""


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


# ---- xz-packed files ----------------------------------------------------------------------------

XZ = ".xz"


def packed_path(path: str | os.PathLike[str]) -> Path | None:
    """The file that holds ``path``: ``path`` itself, else ``path.xz`` (the compressed copy that
    is committed in its place), else None. Where both are there, the newer one: a run
    directory's plain file normally grew from its ``.xz``; an ``.xz`` copied in later is newer,
    and is read with a warning that names the plain file it passes over."""
    path = Path(path)
    packed = path.with_name(path.name + XZ)
    if not packed.is_file():
        return path if path.is_file() else None
    if not path.is_file() or path.stat().st_mtime >= packed.stat().st_mtime:
        return path if path.is_file() else packed
    logger.warning("%s is newer than %s beside it: reading the .xz", packed, path.name)
    return packed


def read_packed(path: str | os.PathLike[str]) -> bytes | None:
    """The bytes of :func:`packed_path` (decompressed where it ends with ``.xz``); None when
    neither file exists. A damaged ``.xz`` is a :class:`CaddtreeError` that names it."""
    import lzma

    found = packed_path(path)
    if found is None:
        return None
    raw = found.read_bytes()
    if not found.name.endswith(XZ):
        return raw
    try:
        return lzma.decompress(raw)
    except lzma.LZMAError as exc:
        raise CaddtreeError(
            f"{found} is not a complete xz file ({exc}): copy it again, or remove it"
        ) from None


def write_packed(path: str | os.PathLike[str], data: bytes) -> Path:
    """:func:`atomic_write` of ``data``, compressed with xz where ``path`` ends with ``.xz``."""
    import lzma

    path = Path(path)
    if path.name.endswith(XZ):
        data = lzma.compress(data, preset=9)
    return atomic_write(path, lambda tmp: Path(tmp).write_bytes(data))


# ---- directories --------------------------------------------------------------------------------


def _build_prefix(final: Path) -> str:
    return f".{final.name}.tmp-"


def _new_build_dir(final: Path) -> Path:
    """A fresh, empty sibling of ``final`` to build in (``os.mkdir`` honours the umask, where
    ``tempfile.mkdtemp`` would make it private to this user)."""
    tmp = final.parent / f"{_build_prefix(final)}{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    return tmp


def _remove_stale_builds(final: Path) -> None:
    cutoff = time.time() - STALE_BUILD_SECONDS
    for path in final.parent.glob(_build_prefix(final) + "*"):
        with contextlib.suppress(OSError):
            if path.stat().st_mtime < cutoff:
                shutil.rmtree(path, ignore_errors=True)


def atomic_directory(
    final: str | os.PathLike[str],
    build: Callable[[Path], None],
    *,
    is_complete: Callable[[Path], bool] | None = None,
) -> Path:
    """Create directory ``final`` by calling ``build(tmp)`` on a fresh sibling directory ``tmp``
    and renaming it to ``final`` only when ``build`` returns (a cache entry built once).

    If ``build`` raises (or the process dies), ``final`` does not appear: the partial directory is
    removed (a killed build's leftover is removed by a later call once it is hours old). If
    ``final`` is already complete (``is_complete``, default: it exists), nothing is built. Builds
    of one ``final`` take turns under a file lock, so two processes never both spend the time; the
    second finds the first one's directory and returns it.
    """
    from filelock import FileLock

    final = Path(final)
    complete = is_complete or Path.is_dir
    if complete(final):
        return final
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CaddtreeError(
            f"cannot create the cache directory {final.parent}: {exc.strerror or exc}. Set "
            "CADDTREE_CACHE to a writable directory."
        ) from None
    with FileLock(str(final.parent / f".{final.name}.lock")):
        if complete(final):  # built by another process while we waited
            return final
        _remove_stale_builds(final)
        if final.exists():  # an incomplete directory under the final name (not made by us)
            shutil.rmtree(final)
        tmp = _new_build_dir(final)
        try:
            build(tmp)
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return final


def previous_directory(final: str | os.PathLike[str]) -> Path:
    """Where :func:`replace_directory` keeps the previous ``final`` while it swaps in the new."""
    final = Path(final)
    return final.with_name(final.name + ".old")


def replace_directory(final: str | os.PathLike[str], build: Callable[[Path], None]) -> Path:
    """Replace directory ``final`` (or create it) with what ``build(tmp)`` writes into a fresh
    sibling ``tmp`` (a training checkpoint, saved again and again).

    The previous ``final`` stays whole until the new one is in place: it is renamed to
    :func:`previous_directory` first, and removed only after the new one has its name, so a crash
    between the two renames leaves the previous one there (:func:`recover_directory` puts it back).
    If ``build`` raises, ``final`` is untouched.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = _new_build_dir(final)
    try:
        build(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = previous_directory(final)
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
    tmp.rename(final)
    shutil.rmtree(old, ignore_errors=True)
    return final


def recover_directory(final: str | os.PathLike[str]) -> bool:
    """Put back the previous ``final`` if :func:`replace_directory` was interrupted between its
    two renames; returns whether it did."""
    final, old = Path(final), previous_directory(final)
    if final.exists() or not old.is_dir():
        return False
    old.rename(final)
    return True
