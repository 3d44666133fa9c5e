"""Lazy re-exports: a package that offers names from its submodules without importing them all.

``__getattr__, __dir__ = lazy_exports(__name__, {"name": "submodule", ...})`` in a package's
``__init__`` makes ``from package import name`` (and ``package.name``) import only the submodule
that defines ``name``, on first use: ``import caddtree`` loads no torch, ``from caddtree.bench
import run_bench`` does not load the report, reading prompts does not import the trainer.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Collection, Mapping
from typing import Any

__all__ = ["lazy_exports"]


def lazy_exports(
    package: str, exports: Mapping[str, str], submodules: Collection[str] = ()
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The module ``__getattr__`` and ``__dir__`` of ``package`` (its ``__name__``): a name of
    ``exports`` is taken from the submodule it maps to, imported then; a name of ``submodules`` is
    that submodule itself (``caddtree.hf`` without ``import caddtree.hf``). Any other name raises
    :class:`AttributeError`, as for any module."""

    def __getattr__(name: str) -> Any:
        if name in submodules:
            return importlib.import_module(f"{package}.{name}")
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(f"{package}.{module}"), name)

    def __dir__() -> list[str]:
        return sorted({*vars(sys.modules[package]), *exports, *submodules})

    return __getattr__, __dir__
