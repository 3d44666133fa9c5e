"""Shared plumbing for the figures that ``caddtree profile`` and ``caddtree report`` draw.

matplotlib is optional (the ``plot`` extra); :func:`pyplot` imports it with the non-interactive
Agg backend, so figures render on headless machines, and says how to install it when it is absent.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from .errors import MissingDependencyError
from .files import atomic_write

__all__ = ["pyplot", "save_figure"]


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the Agg backend, or a clear error naming the extra to install."""
    try:
        import matplotlib
    except ImportError:
        raise MissingDependencyError(
            "plotting needs matplotlib: pip install 'caddtree[plot]' (or pip install matplotlib)"
        ) from None
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: str | os.PathLike[str]) -> Path:
    """Write ``fig`` to ``path`` atomically (a half-written image never replaces a good one), close
    it, and return the path. The format follows the suffix (``.png``, ``.pdf``, ``.svg``)."""
    path = Path(path)
    fmt = path.suffix.lstrip(".") or None  # the temporary file's name has no useful suffix
    try:
        return atomic_write(
            path, lambda tmp: fig.savefig(tmp, format=fmt, dpi=150, bbox_inches="tight")
        )
    finally:
        pyplot().close(fig)
