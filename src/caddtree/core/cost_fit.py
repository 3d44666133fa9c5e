"""The convex, non-decreasing least-squares fit of a verification-cost curve (Eq. convex-reg).

:func:`fit_convex_nondecreasing` fits values at the profiled node counts that are convex and
non-decreasing in ``n``, as a sparse QP solved with Clarabel; :class:`FitQuality` says how well the
fit matches the measurements. :class:`~caddtree.core.cost.ConvexCostModel.fit` runs it once per profiled
context length.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..util.errors import CostModelError

__all__ = [
    "FitQuality",
    "fit_convex_nondecreasing",
    "fit_quality_of",
    "fit_sorted",
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

    as a sparse QP with Clarabel (``x`` sorted, ``h_i = x_{i+1} - x_i``). Returns the fitted values
    in the order of sorted node counts. Data that already satisfy the constraints are returned as
    they are (they are the unique optimum, with zero residual).
    """
    x, y = validate_points("(unnamed)", node_counts, latencies)
    return fit_sorted(x, y)


def _clean_convex(x: np.ndarray, f: np.ndarray) -> np.ndarray:
    """Remove round-off violations of the constraints left by the interior-point solver."""
    slopes = np.maximum.accumulate(np.maximum(np.diff(f) / np.diff(x), 0.0))
    out = np.empty_like(f)
    out[0] = max(f[0], 0.0)
    out[1:] = out[0] + np.cumsum(slopes * np.diff(x))
    return out


def fit_sorted(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """:func:`fit_convex_nondecreasing` of measurements already checked by
    :func:`validate_points`."""
    import clarabel
    from scipy import sparse

    m = x.size
    h = np.diff(x)
    slopes = np.diff(y) / h
    if y[0] >= 0 and slopes[0] >= 0 and (np.diff(slopes) >= 0).all():
        return y.copy()

    scale = float(np.abs(y).max()) or 1.0
    ys = y / scale
    # Rows of G with G f >= 0: f_0 >= 0; f_1 - f_0 >= 0; one convexity row per interior knot.
    rows, cols, vals = [0, 1, 1], [0, 0, 1], [1.0, -1.0, 1.0]
    for i in range(1, m - 1):
        r = i + 1
        a, b = 1.0 / h[i - 1], 1.0 / h[i]
        rows += [r, r, r]
        cols += [i - 1, i, i + 1]
        vals += [a, -(a + b), b]
    # Normalise each row so the constraint scales are comparable whatever the node spacing.
    G = sparse.csr_matrix((vals, (rows, cols)), shape=(m, m))
    norms = np.sqrt(np.asarray(G.multiply(G).sum(axis=1)).ravel())
    G = sparse.diags(1.0 / norms) @ G
    # Clarabel: minimise 1/2 f'Pf + q'f  s.t.  A f + s = b, s in cone. Here A = -G, b = 0, s >= 0.
    P = sparse.csc_matrix(2.0 * sparse.identity(m, format="csc"))
    q = -2.0 * ys
    A = sparse.csc_matrix(-G)
    b = np.zeros(m)
    settings = clarabel.DefaultSettings()
    settings.verbose = False
    settings.tol_gap_abs = 1e-12
    settings.tol_gap_rel = 1e-12
    settings.tol_feas = 1e-12
    settings.max_iter = 500
    solver = clarabel.DefaultSolver(P, q, A, b, [clarabel.NonnegativeConeT(m)], settings)
    solution = solver.solve()
    status = str(solution.status)
    if not status.endswith("Solved"):  # Solved or AlmostSolved
        raise CostModelError(f"the convex cost fit did not converge (Clarabel status: {status})")
    return _clean_convex(x, np.asarray(solution.x, dtype=np.float64) * scale)


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
