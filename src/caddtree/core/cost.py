"""The cost of one decoding round: drafting ``C_d`` and verification ``C_v(n; l)`` (paper §3.6).

Symbols:

* ``draft_cost`` = ``C_d`` - seconds for one drafter forward pass (one block).
* ``verify_cost(n, l)`` = ``C_v(n; l)`` - seconds for one target forward pass over the bonus token
  plus a tree of ``n`` nodes, with ``l`` tokens already in the target's KV cache.

:class:`ConvexCostModel` stores, for each profiled context length ``L_j``, a piecewise-linear curve
``C_v(.; L_j)`` through knots at the profiled node counts. The curves come from the convex,
non-decreasing least-squares fit of Eq. convex-reg (:mod:`caddtree.core.cost_fit`); the
metadata's ``fit_methods`` says how each curve was reached.

Evaluation rules (documented and tested):

* in ``n``, between knots: linear. Above the last knot: linear with the last segment's slope, which
  keeps the curve convex and non-decreasing. Below the first knot: constant at the first knot's
  value (a flat start is convex and non-decreasing, and verifying fewer nodes never costs more).
* in ``l``, between profiled context lengths: linear interpolation of the two neighbouring curves
  (Eq. cv-interp), which keeps convexity and monotonicity in ``n``.
* in ``l``, outside the profiled range: **clamp** to the nearest profiled curve. Extrapolating with
  a negative weight on a curve could break convexity (and so Corollary 2), and clamping never
  invents costs that were not measured; profile up to the longest context you serve.

Files are versioned JSON (:meth:`CostModel.save`, :func:`load_cost_model`); never pickle. The
torch files published with the paper's code are read with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import numpy as np

from ..util.errors import CostModelError
from .cost_fit import FitQuality, fit_quality_of, fit_sorted, validate_points

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "ConstantCostModel",
    "ConvexCostModel",
    "CostModel",
    "PiecewiseLinearCurve",
    "cost_model_from_dict",
    "load_cost_model",
]

FORMAT_NAME = "caddtree.cost_model"
FORMAT_VERSION = 1


# --------------------------------------------------------------------------------------------------
# One curve C_v(.; L_j)
# --------------------------------------------------------------------------------------------------


class PiecewiseLinearCurve:
    """A piecewise-linear function of ``n`` through knots ``(node_counts[i], values[i])``.

    Constant below the first knot, linear with the last slope above the last knot.
    """

    def __init__(self, node_counts: Sequence[float], values: Sequence[float]):
        x = np.asarray(node_counts, dtype=np.float64).reshape(-1)
        y = np.asarray(values, dtype=np.float64).reshape(-1)
        if x.shape != y.shape or x.size == 0:
            raise CostModelError(
                f"a cost curve needs as many values as node counts (got {x.size} and {y.size})"
            )
        if not (np.isfinite(x).all() and np.isfinite(y).all()):
            raise CostModelError("a cost curve contains NaN or infinite values")
        if (y < 0).any():
            raise CostModelError(
                f"a cost curve has a negative verification cost ({y.min():g} s); costs are "
                "durations: re-profile, or fix the file"
            )
        if x.size > 1 and (np.diff(x) <= 0).any():
            raise CostModelError("a cost curve's node counts must be strictly increasing")
        self.node_counts = x
        self.values = y
        self._slope_right = float((y[-1] - y[-2]) / (x[-1] - x[-2])) if x.size > 1 else 0.0
        self._dense = np.zeros(0)

    def __call__(self, n: Any) -> np.ndarray:
        n = np.asarray(n, dtype=np.float64)
        out = np.interp(n, self.node_counts, self.values)
        right = n > self.node_counts[-1]
        if right.any():
            out = np.where(
                right, self.values[-1] + self._slope_right * (n - self.node_counts[-1]), out
            )
        return out

    def dense(self, max_n: int) -> np.ndarray:
        """Values at ``n = 0 .. max_n`` (cached; read-only)."""
        if self._dense.shape[0] < max_n + 1:
            self._dense = self(np.arange(max(max_n + 1, 2 * self._dense.shape[0])))
            self._dense.setflags(write=False)
        return self._dense[: max_n + 1]

    def is_convex_nondecreasing(self, rtol: float = 1e-9) -> bool:
        if self.values.size < 2:
            return True
        slopes = np.diff(self.values) / np.diff(self.node_counts)
        tol = rtol * max(float(np.abs(self.values).max()), 1e-30)
        return bool(slopes[0] >= -tol and (np.diff(slopes) >= -tol).all())


# --------------------------------------------------------------------------------------------------
# Cost models
# --------------------------------------------------------------------------------------------------


MIN_DRAFT_COST = 1e-9
"""The smallest ``C_d`` accepted, in seconds (a nanosecond: no drafter pass is faster). Below it
the throughput ``(1 + phi) / (C_d + C_v)`` of a model whose verification costs nothing overflows to
infinity, and every tree would come out empty."""


def _check_draft_cost(draft_cost: Any) -> float:
    try:
        value = float(draft_cost)
    except (TypeError, ValueError):
        raise CostModelError(
            f"draft_cost must be a number of seconds, got {draft_cost!r}"
        ) from None
    if not math.isfinite(value) or value < MIN_DRAFT_COST:
        raise CostModelError(
            f"draft_cost must be a positive, finite number of seconds (at least "
            f"{MIN_DRAFT_COST:g}), got {value!r}"
        )
    return value


def _check_context_length(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise CostModelError(f"context lengths must be non-negative integers, got {value!r}")
    return int(value)


NOISY_R2 = 0.9
"""A verification-cost fit with R² below this was probably disturbed by other work: the timings
of a quiet machine fit a convex curve far better."""

NOISY_INVERSION = 0.1
"""A shorter context whose fitted verification cost exceeds a longer context's by more than this
fraction (at some node count) was probably measured during a slow spell: a causal model attends
to more keys in the longer context, so its cost does not fall. Such a curve misleads CaDDTree,
which reads a too-high cost at short contexts as cheap extra nodes (docs/profiling.md)."""


class CostModel(ABC):
    """What one decoding round costs, in seconds.

    Subclasses define :meth:`verify_cost_table`; everything else follows from it.
    """

    draft_cost: float
    """``C_d``: seconds for one drafter forward pass."""

    @abstractmethod
    def verify_cost_table(self, context_length: int, max_n: int) -> np.ndarray:
        """``C_v(n; context_length)`` for ``n = 0 .. max_n`` as a float64 array."""

    def verify_cost(self, n: Any, context_length: int) -> Any:
        """``C_v(n; l)``: seconds to verify a tree of ``n`` nodes (plus the bonus token) at context
        length ``l``. ``n`` may be an integer (returns a float) or an array (returns an array)."""
        arr = np.asarray(n)
        if arr.size == 0:
            return np.zeros(arr.shape)
        if (arr < 0).any() or not np.issubdtype(arr.dtype, np.integer):
            raise CostModelError(f"node counts must be non-negative integers, got {n!r}")
        table = self.verify_cost_table(context_length, int(arr.max()))
        out = table[arr]
        return float(out) if out.ndim == 0 else out

    def round_cost_table(self, context_length: int, max_n: int) -> np.ndarray:
        """``C_d + C_v(n; l)`` for ``n = 0 .. max_n``: the denominator of ``theta*(n)``.

        Checked here, where every policy reads costs, so that a subclass (or a model edited after
        loading) with a zero, negative or non-finite cost fails with a :class:`CostModelError`
        instead of dividing by zero or silently building empty trees.
        """
        try:
            draft = _check_draft_cost(self.draft_cost)
        except CostModelError:
            raise CostModelError(
                f"{type(self).__name__}.draft_cost is {self.draft_cost!r}; C_d must be a positive, "
                f"finite number of seconds (at least {MIN_DRAFT_COST:g})"
            ) from None
        verify = np.asarray(self.verify_cost_table(context_length, max_n), dtype=np.float64)
        if verify.shape != (max_n + 1,) or not np.isfinite(verify).all() or (verify < 0).any():
            raise CostModelError(
                f"{type(self).__name__}.verify_cost_table({context_length}, {max_n}) must give "
                f"{max_n + 1} finite, non-negative costs in seconds (C_v >= 0)"
            )
        return draft + verify

    @abstractmethod
    def scaled(self, draft: float = 1.0, verify: float = 1.0) -> CostModel:
        """A copy with ``C_d`` multiplied by ``draft`` and ``C_v`` by ``verify`` (paper Table 3)."""

    @abstractmethod
    def to_dict(self) -> dict[str, Any]:
        """The JSON-serialisable form written by :meth:`save`."""

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the model as versioned JSON, atomically (a crash never leaves half a file)."""
        from ..util.files import atomic_write_text

        return atomic_write_text(path, json.dumps(self.to_dict(), indent=1) + "\n")


class _CurvesPerContext(CostModel):
    """Shared machinery: one :class:`PiecewiseLinearCurve` per profiled context length,
    interpolated linearly in ``l`` (Eq. cv-interp) and clamped outside the profiled range."""

    type_name = ""

    def __init__(
        self,
        curves: Mapping[int, PiecewiseLinearCurve],
        draft_cost: float,
        metadata: Mapping[str, Any] | None = None,
    ):
        if not curves:
            raise CostModelError("a cost model needs at least one context length")
        items = sorted((_check_context_length(k), v) for k, v in curves.items())
        self.context_lengths = [k for k, _ in items]
        self.curves = [v for _, v in items]
        self.draft_cost = _check_draft_cost(draft_cost)
        self.metadata = dict(metadata or {})

    def verify_cost_table(self, context_length: int, max_n: int) -> np.ndarray:
        ls = self.context_lengths
        if context_length <= ls[0]:
            return self.curves[0].dense(max_n)
        if context_length >= ls[-1]:
            return self.curves[-1].dense(max_n)
        j = int(np.searchsorted(ls, context_length, side="right")) - 1
        alpha = (context_length - ls[j]) / (ls[j + 1] - ls[j])
        return (1.0 - alpha) * self.curves[j].dense(max_n) + alpha * self.curves[j + 1].dense(max_n)

    def _curve_dicts(self) -> list[dict[str, Any]]:
        return [
            {
                "context_length": length,
                "node_counts": [int(v) for v in curve.node_counts],
                "verify_cost": curve.values.tolist(),
            }
            for length, curve in zip(self.context_lengths, self.curves)
        ]

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT_NAME,
            "version": FORMAT_VERSION,
            "type": self.type_name,
            "units": "seconds",
            "draft_cost": self.draft_cost,
            "curves": self._curve_dicts(),
            "metadata": self.metadata,
        }

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(draft_cost={self.draft_cost * 1e3:.3f} ms, "
            f"context_lengths={self.context_lengths})"
        )


class ConvexCostModel(_CurvesPerContext):
    """Convex, non-decreasing piecewise-linear ``C_v(.; L_j)`` per profiled context length."""

    type_name = "convex"

    def __init__(
        self,
        curves: Mapping[int, PiecewiseLinearCurve],
        draft_cost: float,
        fit_quality: Mapping[int, FitQuality] | None = None,
        metadata: Mapping[str, Any] | None = None,
    ):
        super().__init__(curves, draft_cost, metadata)
        for length, curve in zip(self.context_lengths, self.curves):
            if not curve.is_convex_nondecreasing():
                raise CostModelError(
                    f"the verification-cost curve at context length {length} is not convex and "
                    "non-decreasing in n; fit it with ConvexCostModel.fit"
                )
        self.fit_quality: dict[int, FitQuality] = dict(fit_quality or {})

    @classmethod
    def fit(
        cls,
        measurements: Mapping[int, tuple[Sequence[float], Sequence[float]]],
        draft_cost: float,
        metadata: Mapping[str, Any] | None = None,
    ) -> ConvexCostModel:
        """Fit one convex, non-decreasing curve per context length (Eq. convex-reg).

        Args:
            measurements: context length -> (node counts, latencies in seconds), one latency per
                distinct node count (at least 3 of them), e.g. medians over trials.
            draft_cost: ``C_d`` in seconds.
            metadata: free-form JSON-serialisable facts to keep with the model (device, model...).

        The fit quality (R², RMSE) per context length is in :attr:`fit_quality` and
        :meth:`fit_report`; ``metadata["fit_methods"]`` names, per context length, which of
        :data:`~caddtree.core.cost_fit.FIT_METHODS` produced its curve.
        """
        if not isinstance(measurements, Mapping) or not measurements:
            raise CostModelError(
                "measurements must be a non-empty mapping: context length -> (node counts, latencies)"
            )
        draft_cost = _check_draft_cost(draft_cost)
        curves: dict[int, PiecewiseLinearCurve] = {}
        quality: dict[int, FitQuality] = {}
        methods: dict[str, str] = {}
        for length, pair in measurements.items():
            length = _check_context_length(length)
            if not isinstance(pair, (tuple, list)) or len(pair) != 2:
                raise CostModelError(
                    f"context length {length}: expected a pair (node counts, latencies)"
                )
            x, y = validate_points(length, pair[0], pair[1])
            fit = fit_sorted(x, y)
            curves[length] = PiecewiseLinearCurve(x, fit.values)
            quality[length] = fit_quality_of(y, fit.values)
            methods[str(length)] = fit.method
        return cls(curves, draft_cost, quality, {**(metadata or {}), "fit_methods": methods})

    @property
    def worst_r2(self) -> float:
        """The lowest R² of the per-context-length fits (1.0 without any; NaN counts as -inf)."""
        worst = min((q.r2 for q in self.fit_quality.values()), default=1.0)
        return worst if worst == worst else -math.inf

    @property
    def context_inversion(self) -> float:
        """How far a shorter context's fitted cost rises above a longer context's, at worst, as a
        fraction of the longer one's (at the node counts both curves were fitted over); 0.0 when
        the cost never falls as the context grows. See :data:`NOISY_INVERSION`."""
        worst = 0.0
        for i, short in enumerate(self.curves):
            for long in self.curves[i + 1 :]:
                top = min(short.node_counts[-1], long.node_counts[-1])
                xs = np.union1d(short.node_counts, long.node_counts)
                xs = xs[xs <= top]
                longer = np.maximum(long(xs), 1e-12)
                worst = max(worst, float(np.max((short(xs) - longer) / longer)))
        return worst

    @property
    def noisy(self) -> bool:
        """Whether a fit is below :data:`NOISY_R2`, or a shorter context costs more than a longer
        one beyond :data:`NOISY_INVERSION`: the timings were probably disturbed."""
        return self.worst_r2 < NOISY_R2 or self.context_inversion > NOISY_INVERSION

    @property
    def quality(self) -> tuple[bool, float]:
        """A sort key, higher for the better of two profiles of the same pair: not noisy first,
        then the lowest R² less the context inversion."""
        return (not self.noisy, self.worst_r2 - self.context_inversion)

    def noise_warning(self, remedy: str) -> str | None:
        """The one warning about noisy timings (``None`` when the fits are fine), ending with
        ``remedy``: what the caller can do about it."""
        if not self.noisy:
            return None
        found = []
        if self.worst_r2 < NOISY_R2:
            found.append(f"R2 down to {self.worst_r2:.2f}")
        if self.context_inversion > NOISY_INVERSION:
            found.append(
                f"a shorter context measured up to {self.context_inversion:.0%} slower to verify "
                "than a longer one"
            )
        return (
            f"the timings were noisy ({'; '.join(found)}); another process may have been using "
            f"the machine. The fit is convex and usable; {remedy}"
        )

    def fit_report(self) -> str:
        """A small text table of R², RMSE and max error (ms) per context length."""
        lines = [f"{'context':>8} {'points':>6} {'R2':>8} {'RMSE ms':>9} {'max err ms':>10}"]
        for length in self.context_lengths:
            q = self.fit_quality.get(length)
            if q is None:
                lines.append(f"{length:>8} {'-':>6} {'-':>8} {'-':>9} {'-':>10}")
            else:
                lines.append(
                    f"{length:>8} {q.num_points:>6} {q.r2:>8.4f} {q.rmse * 1e3:>9.3f} "
                    f"{q.max_abs_error * 1e3:>10.3f}"
                )
        return "\n".join(lines)

    def scaled(self, draft: float = 1.0, verify: float = 1.0) -> ConvexCostModel:
        if not (verify > 0 and math.isfinite(verify)):
            raise CostModelError(f"the verification scale must be positive, got {verify!r}")
        curves = {
            length: PiecewiseLinearCurve(c.node_counts, c.values * verify)
            for length, c in zip(self.context_lengths, self.curves)
        }
        meta = dict(self.metadata, scaled={"draft": draft, "verify": verify})
        # the measurements scale with the curves: R2 stays, the errors (in seconds) scale
        quality = {
            length: replace(q, rmse=q.rmse * verify, max_abs_error=q.max_abs_error * verify)
            for length, q in self.fit_quality.items()
        }
        return ConvexCostModel(curves, self.draft_cost * draft, quality, meta)

    def to_dict(self) -> dict[str, Any]:
        out = super().to_dict()
        for entry in out["curves"]:
            q = self.fit_quality.get(entry["context_length"])
            if q is not None:
                entry["fit"] = asdict(q)
        return out


class ConstantCostModel(_CurvesPerContext):
    """The paper's ablation (Table 2): ``C_v(n; l) = C_v(0; l)`` for every ``n``.

    With a constant verification cost ``theta*`` always increases, so CaDDTree grows every tree to
    ``max_budget``.
    """

    type_name = "constant"

    def __init__(
        self,
        base_costs: Mapping[int, float],
        draft_cost: float,
        metadata: Mapping[str, Any] | None = None,
    ):
        curves = {
            length: PiecewiseLinearCurve([0.0], [float(c)]) for length, c in base_costs.items()
        }
        for length, curve in curves.items():
            if curve.values[0] < 0:
                raise CostModelError(f"context length {length}: negative verification cost")
        super().__init__(curves, draft_cost, metadata)

    @classmethod
    def from_cost_model(cls, model: _CurvesPerContext) -> ConstantCostModel:
        """Freeze ``model``'s ``C_v(0; L_j)`` at each of its profiled context lengths."""
        base = {length: float(model.verify_cost(0, length)) for length in model.context_lengths}
        return cls(base, model.draft_cost, dict(model.metadata, ablation="constant"))

    @property
    def base_costs(self) -> dict[int, float]:
        return {length: float(c.values[0]) for length, c in zip(self.context_lengths, self.curves)}

    def scaled(self, draft: float = 1.0, verify: float = 1.0) -> ConstantCostModel:
        base = {length: c * verify for length, c in self.base_costs.items()}
        return ConstantCostModel(base, self.draft_cost * draft, self.metadata)


# --------------------------------------------------------------------------------------------------
# Files
# --------------------------------------------------------------------------------------------------


def load_cost_model(path: str | os.PathLike[str]) -> CostModel:
    """Read a cost model written by :meth:`CostModel.save`, or a torch file published with the
    paper's code (a dict with ``type``, ``context_lengths``, ``node_counts``, ``fitted_curves``,
    ``draft_cost``; read with ``torch.load(weights_only=True)``, never full unpickling).

    Raises :class:`~caddtree.util.errors.CostModelError` with a message naming the problem when the
    file is missing, does not parse, or holds inconsistent data.
    """
    path = Path(path)
    if not path.is_file():
        raise CostModelError(f"cost-model file not found: {path}")
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise CostModelError(
            f"cannot read the cost-model file {path}: {exc.strerror or exc}"
        ) from None
    head = raw.lstrip()[:1]
    if head == b"{":
        try:
            data = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CostModelError(f"{path} is not valid JSON: {exc}") from None
        except RecursionError:
            raise CostModelError(
                f"{path} is not a cost model: its JSON is nested too deeply"
            ) from None
        return cost_model_from_dict(data, path)
    if raw[:2] == b"PK" or raw[:1] == b"\x80":  # torch zip archive, or legacy torch pickle stream
        return _from_published_torch(path)
    raise CostModelError(
        f"{path} is neither a caddtree JSON cost model nor a torch cost-model file; "
        "create one with `caddtree profile` or ConvexCostModel.fit(...).save(path)"
    )


def cost_model_from_dict(data: Any, path: Path | str) -> CostModel:
    """The cost model of a parsed JSON document ``data`` (as :meth:`CostModel.to_dict` made it),
    checked; ``path`` names where it came from in the errors."""

    def bad(msg: str) -> CostModelError:
        return CostModelError(f"{path}: {msg}")

    if not isinstance(data, dict) or data.get("format") != FORMAT_NAME:
        raise bad(f'not a caddtree cost model (expected "format": "{FORMAT_NAME}")')
    version = data.get("version")
    if version != FORMAT_VERSION:
        raise bad(
            f"cost-model format version {version!r} is not supported (this caddtree reads "
            f"version {FORMAT_VERSION}); re-profile or upgrade caddtree"
        )
    kind = data.get("type")
    curves_data = data.get("curves")
    if not isinstance(curves_data, list) or not curves_data:
        raise bad('"curves" must be a non-empty list')
    try:
        curves: dict[int, PiecewiseLinearCurve] = {}
        quality: dict[int, FitQuality] = {}
        for entry in curves_data:
            length = _check_context_length(entry["context_length"])
            if length in curves:
                raise CostModelError(f"context length {length} appears twice")
            curves[length] = PiecewiseLinearCurve(entry["node_counts"], entry["verify_cost"])
            if isinstance(entry.get("fit"), dict):
                quality[length] = FitQuality(**entry["fit"])
        draft_cost = data.get("draft_cost")
        metadata = data.get("metadata") or {}
        if kind == "convex":
            return ConvexCostModel(curves, draft_cost, quality, metadata)
        if kind == "constant":
            base = {length: float(c.values[0]) for length, c in curves.items()}
            return ConstantCostModel(base, draft_cost, metadata)
    except CostModelError as exc:
        raise bad(str(exc)) from None
    except (KeyError, TypeError, ValueError) as exc:
        raise bad(f"malformed curve entry ({type(exc).__name__}: {exc})") from None
    raise bad(f'unknown cost-model type {kind!r} (expected "convex" or "constant")')


def _from_published_torch(path: Path) -> CostModel:
    import torch

    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # a damaged file fails in many ways: IndexError, BadZipFile, ...
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CostModelError(
            f"{path}: cannot read it as a torch cost-model file with weights_only=True ({first}). "
            "caddtree never unpickles arbitrary objects; convert the file to caddtree JSON."
        ) from None

    def bad(msg: str) -> CostModelError:
        return CostModelError(f"{path}: {msg}")

    def plain(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return v.tolist()
        return v

    if not isinstance(data, dict):
        raise bad(f"expected a dict, found {type(data).__name__}")
    missing = [k for k in ("type", "fitted_curves", "draft_cost") if k not in data]
    if missing:
        raise bad(
            f"missing key(s) {missing}; expected type, context_lengths, node_counts, "
            "fitted_curves, draft_cost"
        )
    if data["type"] != "convex":
        raise bad(f'unsupported cost-model type {data["type"]!r} (only "convex" is published)')
    fitted = data["fitted_curves"]
    if not isinstance(fitted, dict) or not fitted:
        raise bad("fitted_curves must be a non-empty dict: context length -> list of seconds")
    node_counts = plain(data.get("node_counts"))
    curves: dict[int, PiecewiseLinearCurve] = {}
    refit = []
    try:
        for key, values in fitted.items():
            length = _check_context_length(int(plain(key)))
            y = np.asarray(plain(values), dtype=np.float64).reshape(-1)
            if node_counts is not None and len(node_counts) == y.size:
                x = np.asarray(node_counts, dtype=np.float64)  # values paired with node_counts
            else:
                x = np.arange(y.size, dtype=np.float64)  # list indexed by node count
            curve = PiecewiseLinearCurve(x, y)
            if not curve.is_convex_nondecreasing(rtol=1e-6):
                x, y = validate_points(length, x, y)
                curve = PiecewiseLinearCurve(x, fit_sorted(x, y).values)
                refit.append(length)
            curves[length] = curve
        model = ConvexCostModel(
            curves, plain(data["draft_cost"]), metadata={"source": str(path), "format": "torch"}
        )
    except CostModelError as exc:
        raise bad(str(exc)) from None
    except (TypeError, ValueError) as exc:
        raise bad(f"malformed fitted_curves ({exc})") from None
    if refit:
        warnings.warn(
            f"{path}: the curves at context lengths {refit} were not convex and non-decreasing; "
            "caddtree re-fitted them (Eq. convex-reg)",
            stacklevel=2,
        )
    return model
