"""Loading the model pair a command names: what ``caddtree generate``, ``caddtree profile`` and
``caddtree serve`` share (the options, :func:`add_pair_arguments`, and the loading).

:func:`load_pair` takes the built-in pair when neither model is given
(:func:`caddtree.defaults.resolve_model_pair`), loads it as a
:class:`~caddtree.api.SpeculativeGenerator`, and for ``method="caddtree"`` without a cost model
obtains the one profiled once for this machine and cached
(:meth:`~caddtree.api.SpeculativeGenerator.cached_cost_model`): no silent fallback to another
method. Run the cheap argument checks first: the first use of the built-in target converts it
(tens of seconds), and loading any model takes a while.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from .api import SpeculativeGenerator
    from .cost import CostModel

__all__ = ["add_pair_arguments", "load_pair"]


def add_pair_arguments(parser: Any) -> None:
    """The options that name the model pair, as :func:`load_pair` takes them: ``--target``,
    ``--draft``, ``--dtype`` and ``--device`` (on an ``argparse`` parser)."""
    parser.add_argument(
        "--target", help="target model: a local directory or hub id (default: built-in SmolLM2)"
    )
    parser.add_argument("--draft", help="DFlash drafter: a local directory or hub id")
    parser.add_argument(
        "--dtype", default="auto", help="auto, float32, bfloat16, float16 or float64"
    )
    parser.add_argument(
        "--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda if available)"
    )


def load_pair(
    target: str | os.PathLike[str] | None,
    draft: str | os.PathLike[str] | None,
    *,
    dtype: Any = "auto",
    device: Any = None,
    cost_model: CostModel | str | os.PathLike[str] | None = None,
    method: str | None = None,
    with_drafter: bool = True,
) -> SpeculativeGenerator:
    """The generator of ``target`` and ``draft`` (both ``None``: the built-in pair, in bfloat16 for
    ``dtype="auto"``), without its drafter unless ``with_drafter``. For ``method="caddtree"`` its
    cost model is ``cost_model``, else the cached one for this machine (profiled on first use).
    ``generator.source`` names the models loaded."""
    from .api import SpeculativeGenerator
    from .defaults import resolve_model_pair

    target, draft, dtype = resolve_model_pair(target, draft, dtype)
    gen = SpeculativeGenerator.from_pretrained(
        target,
        draft if with_drafter else None,
        dtype=dtype,
        device=device,
        cost_model=cost_model,
    )
    if method == "caddtree" and gen.cost_model is None:
        # no silent fallback: profile this machine once (cached), and say so
        gen.cost_model = gen.cached_cost_model()
    return gen
