"""A large file sent in pieces, each with its SHA-256, and put back together where it is needed.

A machine that takes at most a few tens of MB per command (the GPU machine of
:mod:`caddtree.train.oneshot`) receives a file larger than that over several commands:
:func:`split_file` cuts it into pieces and writes a manifest (each piece's name, size and SHA-256,
and the whole file's); each command carries one piece, and :func:`stash_pieces` checks it against
the manifest and copies it to a folder that outlives the command; :func:`assemble_file` joins
them and checks the whole. A piece that is missing or differs is named, with what to send again.

Nothing here imports torch: stashing a piece takes a fraction of a second.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from ..util.errors import InvalidInputError

__all__ = [
    "MANIFEST",
    "Manifest",
    "assemble_file",
    "find_pieces",
    "read_manifest",
    "sha256_of",
    "split_file",
    "stash_pieces",
    "travelling_bytes",
]

MANIFEST = "manifest.json"
_CHUNK = 1 << 20


def sha256_of(path: Path) -> str:
    """The SHA-256 of the file at ``path``, in hex."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(_CHUNK), b""):
            digest.update(block)
    return digest.hexdigest()


@dataclass(frozen=True)
class Manifest:
    """What a file's pieces are: its name, size and SHA-256, and each piece's in order."""

    name: str
    size: int
    sha256: str
    pieces: tuple[dict, ...]  # {"name", "size", "sha256"}

    def to_json(self) -> str:
        payload = {"name": self.name, "size": self.size, "sha256": self.sha256}
        payload["pieces"] = list(self.pieces)
        return json.dumps(payload, indent=1) + "\n"


def read_manifest(path: Path) -> Manifest:
    """The manifest at ``path``, checked for the fields :func:`split_file` writes."""
    try:
        raw = json.loads(Path(path).read_text(encoding="utf-8"))
        pieces = tuple(
            {"name": str(p["name"]), "size": int(p["size"]), "sha256": str(p["sha256"])}
            for p in raw["pieces"]
        )
        manifest = Manifest(str(raw["name"]), int(raw["size"]), str(raw["sha256"]), pieces)
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise InvalidInputError(
            f"cannot read the pieces' manifest {path} ({err}); make it again with the "
            "`prepare` step on the machine that has the whole file"
        ) from err
    if sum(p["size"] for p in pieces) != manifest.size or not pieces:
        raise InvalidInputError(f"the manifest {path} does not add up to its file's size")
    return manifest


def split_file(source: Path, pieces_dir: Path, manifest_path: Path, piece_bytes: int) -> Manifest:
    """Cut ``source`` into as few pieces of at most ``piece_bytes`` as it takes, of about equal
    size, in ``pieces_dir`` (named ``NAME.01``, ``NAME.02``, ...) and write their manifest to
    ``manifest_path``. Pieces left there from an earlier split of this file are removed first."""
    if piece_bytes < 1:
        raise InvalidInputError(f"a piece must hold at least one byte, got {piece_bytes}")
    source = Path(source)
    size = source.stat().st_size
    count = max(1, -(-size // piece_bytes))
    piece_bytes = max(1, -(-size // count))
    pieces_dir.mkdir(parents=True, exist_ok=True)
    for old in pieces_dir.glob(f"{source.name}.*"):
        old.unlink()
    pieces = []
    with open(source, "rb") as fh:
        index = 1
        while block := fh.read(piece_bytes):
            name = f"{source.name}.{index:02d}"
            (pieces_dir / name).write_bytes(block)
            pieces.append(
                {"name": name, "size": len(block), "sha256": hashlib.sha256(block).hexdigest()}
            )
            index += 1
    manifest = Manifest(source.name, source.stat().st_size, sha256_of(source), tuple(pieces))
    manifest_path.parent.mkdir(parents=True, exist_ok=True)
    manifest_path.write_text(manifest.to_json(), encoding="utf-8")
    return manifest


def find_pieces(manifest: Manifest, folders: Sequence[Path]) -> dict[str, Path]:
    """Each piece of ``manifest`` found whole (its size and SHA-256 right) in ``folders``, the
    first folder first; pieces that are missing or differ are left out."""
    found: dict[str, Path] = {}
    for piece in manifest.pieces:
        for folder in folders:
            path = Path(folder) / piece["name"]
            if _whole(path, piece["size"], piece["sha256"]):
                found[piece["name"]] = path
                break
    return found


def _whole(path: Path, size: int, sha256: str) -> bool:
    """Whether ``path`` is a file of that size and SHA-256 (the size is checked first)."""
    return path.is_file() and path.stat().st_size == size and sha256_of(path) == sha256


def stash_pieces(manifest: Manifest, carried: Path, stash: Path) -> dict[str, list[str]]:
    """Copy the pieces carried in ``carried`` that are whole into ``stash`` (each written under
    a temporary name, then renamed), and say which are stashed, which were carried but differ,
    and which are still missing."""
    stash.mkdir(parents=True, exist_ok=True)
    good = find_pieces(manifest, [carried])
    damaged = [
        p["name"]
        for p in manifest.pieces
        if (carried / p["name"]).is_file() and p["name"] not in good
    ]
    for name, path in good.items():
        if find_pieces(_only(manifest, name), [stash]):
            continue
        partial = stash / f"{name}.partial"
        shutil.copyfile(path, partial)
        os.replace(partial, stash / name)
    have = find_pieces(manifest, [stash])
    missing = [p["name"] for p in manifest.pieces if p["name"] not in have]
    return {"stashed": sorted(have), "damaged": damaged, "missing": missing}


def _only(manifest: Manifest, name: str) -> Manifest:
    piece = next(p for p in manifest.pieces if p["name"] == name)
    return Manifest(manifest.name, piece["size"], piece["sha256"], (piece,))


def assemble_file(manifest: Manifest, folders: Sequence[Path], destination: Path) -> Path:
    """Join the pieces of ``manifest`` found in ``folders`` into ``destination`` and check the
    whole file's size and SHA-256. A file already there that checks out is kept."""
    destination = Path(destination)
    if _whole(destination, manifest.size, manifest.sha256):
        return destination
    found = find_pieces(manifest, folders)
    missing = [p["name"] for p in manifest.pieces if p["name"] not in found]
    if missing:
        where = ", ".join(str(f) for f in folders)
        raise InvalidInputError(
            f"pieces of {manifest.name} missing or damaged in {where}: {', '.join(missing)}; "
            "send each again in a command that carries it (the `stash` step) before this one"
        )
    partial = destination.with_name(destination.name + ".partial")
    destination.parent.mkdir(parents=True, exist_ok=True)
    with open(partial, "wb") as out:
        for piece in manifest.pieces:
            with open(found[piece["name"]], "rb") as fh:
                shutil.copyfileobj(fh, out, _CHUNK)
    if sha256_of(partial) != manifest.sha256:
        partial.unlink()
        raise InvalidInputError(
            f"the joined {manifest.name} has another SHA-256 than its manifest's although every "
            "piece checked out: the manifest was written for another split; run `prepare` again"
        )
    os.replace(partial, destination)
    return destination


def travelling_bytes(repo: Path, also: Iterable[Path] = ()) -> int:
    """The bytes a command sends from the git checkout ``repo``: its tracked files and the
    untracked ones git does not ignore, plus the files under ``also`` (carried folders)."""
    listing = subprocess.run(
        ["git", "-C", str(repo), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        capture_output=True,
        check=True,
    ).stdout.decode()
    total = 0
    for name in filter(None, set(listing.split("\0"))):
        path = Path(repo) / name
        if path.is_file() and not path.is_symlink():
            total += path.stat().st_size
    for folder in also:
        total += sum(p.stat().st_size for p in Path(folder).rglob("*") if p.is_file())
    return total
