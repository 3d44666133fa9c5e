"""``caddtree serve``: an OpenAI-compatible HTTP server for speculative decoding (optional extra).

Install it with ``pip install 'caddtree[serve]'`` (FastAPI and uvicorn); importing this package
without them raises :class:`~caddtree.util.errors.MissingDependencyError`.

* :func:`main` (``argv`` -> exit status) and :func:`add_arguments` (the options): the command;
* :func:`build_app`: the FastAPI app around a loaded :class:`~caddtree.api.SpeculativeGenerator`;
* modules: ``app`` (endpoints), ``protocol`` (request checks, response shapes), ``engine`` (the
  bounded queue and the single generation worker), ``metrics`` (Prometheus text), ``server``
  (loading and running).
"""

from __future__ import annotations

import importlib.util

from ..util.errors import MissingDependencyError

_missing = [name for name in ("fastapi", "uvicorn") if importlib.util.find_spec(name) is None]
if _missing:
    raise MissingDependencyError(
        f"caddtree serve needs {' and '.join(_missing)}: pip install 'caddtree[serve]'"
    )

from .app import build_app  # noqa: E402
from .server import add_arguments, load_generator, main  # noqa: E402

__all__ = ["add_arguments", "build_app", "load_generator", "main"]
