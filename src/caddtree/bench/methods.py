"""The methods ``caddtree bench`` runs: a label (``ddtree-16``, ``caddtree-cv2``, ``ar-float32``)
names what decodes, with which budget, cost model and dtype.

The label names themselves (:data:`~caddtree.bench.results.AR_DTYPES`,
:data:`~caddtree.bench.results.ABLATIONS`) belong to the results schema
(:mod:`caddtree.bench.results`), which the report reads too.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

from ..util.errors import InvalidInputError
from .results import ABLATIONS, AR_DTYPES

__all__ = [
    "DEFAULT_BUDGETS",
    "DEFAULT_METHODS",
    "MethodSpec",
    "default_ar_dtypes",
    "parse_methods",
    "variant_cost_model",
]

DEFAULT_BUDGETS = (16, 32, 64, 128, 256, 512, 1024)

DEFAULT_METHODS = ("ar", "dflash", "ddtree", "caddtree")
"""``--methods`` when it is not given; :func:`default_ar_dtypes` adds plain decoding in another
dtype to it."""


@dataclass(frozen=True)
class MethodSpec:
    """One benchmarked method: ``label`` names it in the results (``ddtree-16``, ``caddtree-cv2``,
    ``ar-float32``), ``family`` is the decoding method, ``budget`` DDTree's node budget,
    ``variant`` the CaDDTree cost-model ablation (``None`` = the cost model as profiled), ``dtype``
    the dtype of the target copy plain decoding runs in (``ar-<dtype>``; ``None`` = the run's
    dtype)."""

    label: str
    family: str
    budget: int | None = None
    variant: str | None = None
    dtype: str | None = None
    lookup: bool = False  # copies from the context join the trees (``<label>+lookup``)

    @property
    def needs_cost_model(self) -> bool:
        return self.family == "caddtree"


def parse_methods(
    methods: Iterable[str],
    budgets: Sequence[int] = DEFAULT_BUDGETS,
    ablations: bool = False,
    lookup: bool = False,
) -> list[MethodSpec]:
    """Method specs from names: ``ar``, ``ar-<dtype>`` (plain decoding of a copy of the target in
    that dtype, see :data:`AR_DTYPES`; ``ar-fp32`` is labelled ``ar-float32``), ``dflash``,
    ``ddtree`` (one per budget in ``budgets``), ``ddtree-<B>``, ``caddtree``,
    ``caddtree-<variant>`` (see :data:`ABLATIONS`) and ``lookup`` (prompt-lookup decoding); a
    DDTree or CaDDTree name ending in ``+lookup`` takes copies from the context into its trees,
    and ``lookup=True`` makes every one of them do so. ``ablations=True`` adds every CaDDTree
    variant. AR comes first (``ar`` itself, then the other dtypes), duplicates are dropped."""
    for b in budgets:
        if isinstance(b, bool) or not isinstance(b, int) or b < 1:
            raise InvalidInputError(f"DDTree budgets must be positive integers, got {b!r}")
    specs: dict[str, MethodSpec] = {}

    def add_spec(spec: MethodSpec, copies: bool = False) -> None:
        if (copies or lookup) and spec.family in ("ddtree", "caddtree"):
            spec = replace(spec, label=f"{spec.label}+lookup", lookup=True)
        specs.setdefault(spec.label, spec)

    names = list(methods)
    if ablations:
        names += [f"caddtree-{v}" for v in ABLATIONS]
    if not names:
        raise InvalidInputError("no methods to benchmark")
    for name in names:
        key = str(name).strip().lower()
        base = key.removesuffix("+lookup")
        copies = base != key and base.split("-")[0] in ("ddtree", "caddtree")
        key = base if copies else key
        add = partial(add_spec, copies=copies)
        if key in ("ar", "dflash", "caddtree", "lookup"):
            add(MethodSpec(key, key))
        elif key.startswith("ar-") and key[3:] in AR_DTYPES:
            dtype = AR_DTYPES[key[3:]]
            add(MethodSpec(f"ar-{dtype}", "ar", dtype=dtype))
        elif key == "ddtree":
            for b in budgets:
                add(MethodSpec(f"ddtree-{b}", "ddtree", budget=int(b)))
        elif key.startswith("ddtree-") and key[7:].isdigit() and int(key[7:]) > 0:
            add(MethodSpec(f"ddtree-{int(key[7:])}", "ddtree", budget=int(key[7:])))
        elif key.startswith("caddtree-") and key[9:] in ABLATIONS:
            add(MethodSpec(key, "caddtree", variant=key[9:]))
        else:
            raise InvalidInputError(
                f"unknown method {name!r}; use ar, ar-<dtype> (a dtype in "
                f"{', '.join(sorted(set(AR_DTYPES.values())))}), dflash, ddtree, ddtree-<budget>, "
                f"caddtree, caddtree-<variant> with a variant in {', '.join(ABLATIONS)}, or "
                "lookup; a ddtree or caddtree name may end in +lookup"
            )
    return sorted(specs.values(), key=lambda s: (s.family != "ar", s.label != "ar"))


def default_ar_dtypes(dtype: str, device_type: str) -> list[str]:
    """The dtypes of the plain-decoding baselines that the default ``--methods`` adds next to
    ``ar`` for a run in ``dtype`` (a canonical name, e.g. ``"bfloat16"``) on ``device_type``:
    the rule of :func:`caddtree.api.ar_baseline_dtypes`, which ``generate --compare-ar`` uses."""
    from ..util.devices import ar_baseline_dtypes, dtype_name

    return [dtype_name(d) for d in ar_baseline_dtypes(dtype, device_type)[1:]]


def variant_cost_model(cost_model: Any, variant: str | None) -> Any:
    """The cost model a CaDDTree variant decodes with."""
    from ..core.cost import ConstantCostModel

    if variant is None:
        return cost_model
    if variant == "constant":
        try:
            return ConstantCostModel.from_cost_model(cost_model)
        except (AttributeError, TypeError):
            raise InvalidInputError(
                "the constant-cost ablation needs a profiled cost model (per-context curves)"
            ) from None
    draft, verify = ABLATIONS[variant]
    return cost_model.scaled(draft=draft, verify=verify)
