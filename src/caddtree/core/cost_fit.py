"""The convex, non-decreasing least-squares fit of a verification-cost curve (Eq. convex-reg).

:func:`fit_convex_nondecreasing` fits values at the profiled node counts that are convex and
non-decreasing in ``n``: exactly, as non-negative least squares over a hinge basis, with Clarabel's
QP and a plain projection behind it so that valid measurements always get a valid curve;
:class:`FitQuality` says how well the fit matches the measurements. :class:`~caddtree.core.cost.ConvexCostModel.fit` runs it once per profiled
context length.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..util.errors import CostModelError

__all__ = [
    "FIT_METHODS",
    "ConvexFit",
    "FitQuality",
    "fit_convex_nondecreasing",
    "fit_quality_of",
    "fit_sorted",
    "hinge_basis",
    "validate_points",
]


@dataclass(frozen=True)
class FitQuality:
    """How well a fitted curve matches its measurements (latencies in seconds)."""

    r2: float
    rmse: float
    max_abs_error: float
    num_points: int


def validate_points(
    context_length: Any, node_counts: Any, latencies: Any
) -> tuple[np.ndarray, np.ndarray]:
    """The measurements of one context length as float64 arrays sorted by node count, or a
    :class:`~caddtree.util.errors.CostModelError` naming what is wrong with them."""
    where = f"context length {context_length!r}"
    try:
        x = np.asarray(node_counts, dtype=np.float64).reshape(-1)
        y = np.asarray(latencies, dtype=np.float64).reshape(-1)
    except (TypeError, ValueError) as exc:
        raise CostModelError(
            f"{where}: node counts and latencies must be numbers ({exc})"
        ) from None
    if x.size != y.size:
        raise CostModelError(
            f"{where}: {x.size} node counts but {y.size} latencies; give one latency per node count"
        )
    if x.size < 3:
        raise CostModelError(
            f"{where}: {x.size} measurement(s); a convex fit needs at least 3 distinct node counts"
        )
    if not np.isfinite(x).all() or not np.isfinite(y).all():
        raise CostModelError(f"{where}: measurements contain NaN or infinite values; re-profile")
    if (x < 0).any() or (x != np.round(x)).any():
        raise CostModelError(f"{where}: node counts must be non-negative integers")
    if (y < 0).any():
        raise CostModelError(f"{where}: negative latency {y.min():g} s; latencies are durations")
    order = np.argsort(x, kind="stable")
    x, y = x[order], y[order]
    dup = x[1:][np.diff(x) == 0]
    if dup.size:
        raise CostModelError(
            f"{where}: node count {int(dup[0])} appears more than once; "
            "pass one value per node count (for example the median of repeated trials)"
        )
    return x, y


def fit_convex_nondecreasing(node_counts: Any, latencies: Any) -> np.ndarray:
    """Least-squares fit of values at ``node_counts`` that are convex and non-decreasing in ``n``.

    Solves Eq. convex-reg,

        min_f  sum_i (y_i - f_i)^2
        s.t.   f_0 >= 0,  f_1 - f_0 >= 0,
               (f_{i+1} - f_i) / h_i - (f_i - f_{i-1}) / h_{i-1} >= 0,

    with ``x`` sorted and ``h_i = x_{i+1} - x_i``. Returns the fitted values in the order of sorted
    node counts (see :func:`fit_sorted` for how). Data that already satisfy the constraints are
    returned as they are (they are the unique optimum, with zero residual).
    """
    x, y = validate_points("(unnamed)", node_counts, latencies)
    return fit_sorted(x, y).values


FIT_METHODS = ("as-measured", "active-set", "interior-point", "projection")
"""How :func:`fit_sorted` can reach its curve, in the order it tries them: the measurements
themselves (already convex and non-decreasing), the exact active-set solution, Clarabel's iterate
projected onto the constraints, and the projection of the measurements alone (always valid, not
optimal)."""


@dataclass(frozen=True)
class ConvexFit:
    """The fitted values of :func:`fit_sorted` and which of :data:`FIT_METHODS` produced them."""

    values: np.ndarray
    method: str


def _clean_convex(x: np.ndarray, f: np.ndarray) -> np.ndarray:
    """The nearest curve to ``f`` with the slopes made non-negative and non-decreasing (a running
    maximum) and ``f_0 >= 0``: valid for any finite ``f``, and ``f`` itself where ``f`` is valid up
    to round-off."""
    slopes = np.maximum.accumulate(np.maximum(np.diff(f) / np.diff(x), 0.0))
    out = np.empty_like(f)
    out[0] = max(f[0], 0.0)
    out[1:] = out[0] + np.cumsum(slopes * np.diff(x))
    return out


def hinge_basis(x: np.ndarray) -> np.ndarray:
    """Columns ``1, x - x_0, (x - x_1)_+, ..., (x - x_{m-2})_+`` at the sorted knots ``x``, each of
    unit norm: the curves of the constraint set are exactly their combinations with non-negative
    weights (a start value, a first slope, and one slope increase per interior knot)."""
    cols = np.stack([np.ones_like(x), x - x[0]] + [np.maximum(x - k, 0.0) for k in x[1:-1]], 1)
    norms = np.linalg.norm(cols, axis=0)
    return cols / np.where(norms > 0, norms, 1.0)


def _active_set_fit(x: np.ndarray, ys: np.ndarray) -> np.ndarray | None:
    """The exact fit of the scaled measurements ``ys``: non-negative least squares over
    :func:`hinge_basis` (Lawson-Hanson, a finite active-set method), or ``None`` where the solver
    fails or its answer does not pass the optimality (KKT) check."""
    from scipy.optimize import nnls

    basis = hinge_basis(x)
    try:
        weights, _ = nnls(basis, ys, maxiter=50 * basis.shape[1])
    except (RuntimeError, ValueError, np.linalg.LinAlgError):
        return None
    fitted = basis @ weights
    gradient = basis.T @ (ys - fitted)  # where a weight may grow, the error would fall
    tol = 1e-9 * max(float(np.linalg.norm(ys)), 1e-300)
    if not np.isfinite(fitted).all() or (gradient > tol).any():
        return None
    if (np.abs(gradient[weights > 0]) > tol).any():
        return None
    return fitted


def _interior_point_fit(x: np.ndarray, ys: np.ndarray) -> np.ndarray | None:
    """The same problem as :func:`_active_set_fit` as a QP for Clarabel (minimise
    ``|B w - ys|^2`` over ``w >= 0``): its solution, its last iterate where it stops short of its
    tolerances, or ``None`` where it gives nothing finite."""
    import clarabel
    from scipy import sparse

    basis = hinge_basis(x)
    m = basis.shape[1]
    settings = clarabel.DefaultSettings()
    settings.verbose = False
    try:
        solver = clarabel.DefaultSolver(
            sparse.csc_matrix(np.triu(2.0 * basis.T @ basis)),
            -2.0 * basis.T @ ys,
            sparse.csc_matrix(-np.eye(m)),  # -w + s = 0 with s >= 0
            np.zeros(m),
            [clarabel.NonnegativeConeT(m)],
            settings,
        )
        fitted = basis @ np.asarray(solver.solve().x, dtype=np.float64)
    except Exception:  # noqa: BLE001 - any solver failure falls through to the projection
        return None
    return fitted if np.isfinite(fitted).all() else None


def fit_sorted(x: np.ndarray, y: np.ndarray) -> ConvexFit:
    """:func:`fit_convex_nondecreasing` of measurements already checked by
    :func:`validate_points`; never fails on them.

    Measurements that already satisfy the constraints are their own fit. Otherwise the exact
    solution comes from non-negative least squares over :func:`hinge_basis`, accepted only where it
    passes the optimality check; failing that, Clarabel's iterate (converged or not) and the
    projection of the measurements are both made valid with :func:`_clean_convex` and the one
    closer to the measurements is kept. :attr:`ConvexFit.method` says which.
    """
    slopes = np.diff(y) / np.diff(x)
    if y[0] >= 0 and slopes[0] >= 0 and (np.diff(slopes) >= 0).all():
        return ConvexFit(y.copy(), "as-measured")
    scale = float(np.abs(y).max()) or 1.0
    ys = y / scale
    exact = _active_set_fit(x, ys)
    if exact is not None:
        return ConvexFit(_clean_convex(x, exact) * scale, "active-set")
    candidates = [(_clean_convex(x, ys), "projection")]
    approximate = _interior_point_fit(x, ys)
    if approximate is not None:
        candidates.insert(0, (_clean_convex(x, approximate), "interior-point"))
    f, method = min(candidates, key=lambda c: float(((ys - c[0]) ** 2).sum()))
    return ConvexFit(f * scale, method)


def fit_quality_of(y: np.ndarray, f: np.ndarray) -> FitQuality:
    """R², RMSE and the largest error of the fitted values ``f`` against the measurements ``y``."""
    resid = y - f
    ss_res = float(resid @ resid)
    ss_tot = float(((y - y.mean()) ** 2).sum())
    if ss_tot > 0:
        r2 = 1.0 - ss_res / ss_tot
    else:
        r2 = 1.0 if ss_res <= 1e-30 else float("nan")
    return FitQuality(
        r2=r2,
        rmse=math.sqrt(ss_res / y.size),
        max_abs_error=float(np.abs(resid).max()),
        num_points=int(y.size),
    )
