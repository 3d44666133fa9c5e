"""Checkpoint locations and loading errors, for the target and the drafter alike: a location that
cannot load is refused before any hub request, and what a damaged or foreign checkpoint raises
becomes one :class:`~caddtree.util.errors.CheckpointError` line."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import torch

from ..util.errors import CaddtreeError, CheckpointError

__all__ = ["check_model_location", "checkpoint_errors", "hub_offline"]

_TRUE = ("1", "on", "yes", "true")


def hub_offline() -> bool:
    """Whether ``HF_HUB_OFFLINE`` (or the older ``TRANSFORMERS_OFFLINE``) is set, read now: a
    program may set it after transformers was imported, which then no longer reads it."""
    return any(
        os.environ.get(name, "").strip().lower() in _TRUE
        for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    )


def check_model_location(
    location: str | os.PathLike[str], what: str, filename: str = "config.json"
) -> None:
    """Refuse at once a model location that cannot load, before transformers asks the hub.

    ``location`` is a local directory or a hub id. A missing one is refused with "no such
    directory" when it looks local (an existing file, a path starting with ``.``, ``/`` or ``~``,
    or one whose first folder exists here), or when ``HF_HUB_OFFLINE`` is set and the hub cache does
    not hold ``filename`` of that id; otherwise transformers would spend half a minute on retries
    and then report a network problem. ``what`` names the model in the message ("the target model").
    """
    text = os.fspath(location)
    path = Path(text).expanduser()
    if path.is_dir():
        return
    if path.exists():
        raise CheckpointError(
            f"cannot load {what} {text!r}: it is a file; give the model's directory (config.json "
            "and weights) or a hub id"
        )
    first = path.parts[0] if path.parts else ""
    looks_local = (
        text.startswith((".", "/", "~", os.sep))
        or path.is_absolute()
        or (len(path.parts) > 1 and Path(first).exists())
    )
    if looks_local:
        raise CheckpointError(f"cannot load {what} {text!r}: no such directory")
    if hub_offline():
        from huggingface_hub import try_to_load_from_cache

        try:
            cached = try_to_load_from_cache(text, filename)
        except ValueError:  # not a valid hub id either
            cached = None
        if not isinstance(cached, str):
            raise CheckpointError(
                f"cannot load {what} {text!r}: no such directory, and HF_HUB_OFFLINE is set, so "
                "the hub is not asked (the local hub cache does not hold it)"
            )


@contextlib.contextmanager
def checkpoint_errors(what: str, location: str | os.PathLike[str]) -> Iterator[None]:
    """Turn what transformers, safetensors and the JSON reader raise on a damaged or foreign
    checkpoint (truncated weights, a malformed config.json, a field of the wrong type) into one
    :class:`CheckpointError` line naming ``what`` and ``location``; errors caddtree raised on
    purpose pass through unchanged."""
    from safetensors import SafetensorError

    try:  # a config.json field of the wrong type (huggingface_hub >= 0.35 validates configs)
        from huggingface_hub.errors import StrictDataclassError
    except ImportError:  # pragma: no cover - older huggingface_hub
        StrictDataclassError = ValueError  # noqa: N806

    try:
        yield
    except (CaddtreeError, torch.OutOfMemoryError):
        raise
    except (
        OSError,
        ValueError,
        TypeError,
        KeyError,
        AttributeError,
        IndexError,
        RuntimeError,
        ArithmeticError,
        SafetensorError,
        StrictDataclassError,
    ) as exc:
        detail = " ".join(line.strip() for line in str(exc).splitlines() if line.strip())
        detail = detail or type(exc).__name__
        if len(detail) > 300:
            detail = detail[:297] + "..."
        hint = ""
        if isinstance(exc, SafetensorError):
            hint = "; the weights file is damaged or cut short: copy or download it again"
        raise CheckpointError(
            f"cannot load {what} {os.fspath(location)!r}: {detail} ({type(exc).__name__}){hint}"
        ) from None
