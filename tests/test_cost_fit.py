"""The convex cost fit never fails on valid measurements and reaches the exact optimum.

The reference optimum is computed independently of the fit: the fit's feasible set is the cone
``{f : G f >= 0}`` (G of Eq. convex-reg), and the projection onto a polyhedral cone is the
projection onto the subspace ``{G_S f = 0}`` of one subset ``S`` of its constraints, so the
closest feasible one of those projections, over every subset, is the exact answer.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from caddtree import ConvexCostModel
from caddtree.core.cost import PiecewiseLinearCurve
from caddtree.core.cost_fit import FIT_METHODS, fit_sorted, validate_points

PROFILED_COUNTS = np.array([0, 1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128], dtype=np.float64)

# Two profiles on which the fit's earlier Clarabel-only solve (tolerances 1e-12, 500 iterations)
# stopped short and raised: 5% noise on a smooth curve (MaxIterations), and a small dip
# (InsufficientProgress); found by a seeded sweep of 16,000 random profiles.
SOLVER_STOPS_SHORT = [
    (
        [0.0, 2.0, 8.0, 16.0, 32.0, 64.0, 96.0],
        [
            0.010063471020726833,
            0.009710992150114195,
            0.011041516374564036,
            0.011545418517726929,
            0.01401280508569956,
            0.01661347709747794,
            0.021907822033305307,
        ],
    ),
    (
        [0.0, 2.0, 4.0, 16.0, 48.0],
        [
            0.010380133309443594,
            0.011112688679912743,
            0.010235303267170433,
            0.012344204959249903,
            0.015046448571358,
        ],
    ),
]


def constraint_rows(x: np.ndarray) -> np.ndarray:
    """G of Eq. convex-reg (unnormalised): f_0 >= 0, f_1 - f_0 >= 0, one convexity row per knot."""
    m, h = x.size, np.diff(x)
    g = np.zeros((m, m))
    g[0, 0] = 1.0
    g[1, 0], g[1, 1] = -1.0, 1.0
    for i in range(1, m - 1):
        a, b = 1.0 / h[i - 1], 1.0 / h[i]
        g[i + 1, i - 1 : i + 2] = [a, -(a + b), b]
    return g


def exact_fit(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """The least-squares projection of ``y`` onto the constraint cone, by trying every face."""
    g = constraint_rows(x)
    scale = float(np.abs(y).max()) or 1.0
    tol = 1e-9 * scale * float(np.abs(g).max())
    best, best_sse = None, np.inf
    for k in range(x.size + 1):
        for subset in itertools.combinations(range(x.size), k):
            gs = g[list(subset)]
            f = y - gs.T @ np.linalg.solve(gs @ gs.T, gs @ y) if k else y.copy()
            sse = float(((y - f) ** 2).sum())
            if sse < best_sse and (g @ f >= -tol).all():
                best, best_sse = f, sse
    return best


def assert_valid_curve(x: np.ndarray, f: np.ndarray) -> None:
    assert np.isfinite(f).all()
    assert PiecewiseLinearCurve(x, f).is_convex_nondecreasing(rtol=1e-9)
    assert f[0] >= 0


def sse(y: np.ndarray, f: np.ndarray) -> float:
    return float(((y - f) ** 2).sum())


def random_profile(rng: np.random.Generator, kind: int) -> tuple[np.ndarray, np.ndarray]:
    """One random profile of the kind ``kind`` (0-7): noisy smooth curves, spikes, non-convex
    shapes, tiny and huge scales, flat and near-degenerate data."""
    m = int(rng.integers(3, 13))
    pool = PROFILED_COUNTS if kind % 2 == 0 else np.arange(0.0, 600.0)
    x = np.sort(rng.choice(pool, size=m, replace=False))
    smooth = 0.01 + 1e-4 * x + 2e-7 * x**2
    if kind == 0:
        y = smooth * (1 + 0.05 * rng.standard_normal(m))
    elif kind == 1:
        y = smooth * (1 + 0.3 * rng.standard_normal(m))
        y[rng.integers(m)] *= rng.uniform(2, 20)  # one point hit by a burst of load
    elif kind == 2:
        y = smooth * 10 ** rng.uniform(-10, 4) * (1 + 0.2 * rng.standard_normal(m))
    elif kind == 3:
        y = 0.02 * (1 + 1e-12 * rng.standard_normal(m))  # flat up to round-off
    elif kind == 4:
        y = 0.05 - 1e-4 * x + 1e-3 * rng.standard_normal(m)  # falling: the fit must flatten it
    elif kind == 5:
        y = np.sqrt(x + 1) * 1e-3 * (1 + 0.1 * rng.standard_normal(m))  # concave
    elif kind == 6:
        y = np.abs(rng.standard_normal(m)) * 10 ** rng.uniform(-8, 3)  # no shape at all
    else:
        y = np.where(rng.random(m) < 0.3, 0.0, smooth)  # some zero latencies
    return x, np.abs(y)


def test_sweep_of_random_profiles_never_fails_and_is_always_valid():
    rng = np.random.default_rng(20261127)
    methods = set()
    for t in range(4000):
        x, y = random_profile(rng, t % 8)
        x, y = validate_points(0, x, y)
        fit = fit_sorted(x, y)
        assert fit.method in FIT_METHODS
        methods.add(fit.method)
        assert_valid_curve(x, fit.values)
    assert methods == {"as-measured", "active-set"}


def test_matches_the_exact_optimum_on_small_random_profiles():
    rng = np.random.default_rng(7)
    for t in range(800):
        x, y = random_profile(rng, t % 8)
        x, y = validate_points(0, x[:7], y[:7]) if x.size >= 3 else (x, y)
        f, reference = fit_sorted(x, y).values, exact_fit(x, y)
        floor = 1e-12 * float(y @ y)
        assert sse(y, f) <= sse(y, reference) * (1 + 1e-6) + floor, (x, y)


@settings(max_examples=300, deadline=None)
@given(
    counts=st.lists(st.integers(0, 512), min_size=3, max_size=7, unique=True),
    data=st.data(),
)
def test_any_valid_measurements_get_the_exact_optimum(counts, data):
    values = data.draw(
        st.lists(
            st.floats(0.0, 1e6, allow_nan=False, allow_infinity=False),
            min_size=len(counts),
            max_size=len(counts),
        )
    )
    x, y = validate_points(0, counts, values)
    fit = fit_sorted(x, y)
    assert_valid_curve(x, fit.values)
    floor = 1e-12 * float(y @ y)
    assert sse(y, fit.values) <= sse(y, exact_fit(x, y)) * (1 + 1e-6) + floor


@pytest.mark.parametrize("case", range(len(SOLVER_STOPS_SHORT)))
def test_profiles_that_stop_the_interior_point_solver_short_are_fitted(case):
    import clarabel
    from scipy import sparse

    x, y = (np.asarray(v) for v in SOLVER_STOPS_SHORT[case])
    # the case still defeats the strict interior-point solve the fit once relied on alone
    g = constraint_rows(x)
    g = g / np.linalg.norm(g, axis=1, keepdims=True)
    settings_ = clarabel.DefaultSettings()
    settings_.verbose = False
    settings_.tol_gap_abs = settings_.tol_gap_rel = settings_.tol_feas = 1e-12
    settings_.max_iter = 500
    ys = y / np.abs(y).max()
    solver = clarabel.DefaultSolver(
        sparse.csc_matrix(2.0 * np.eye(x.size)),
        -2.0 * ys,
        sparse.csc_matrix(-g),
        np.zeros(x.size),
        [clarabel.NonnegativeConeT(x.size)],
        settings_,
    )
    assert not str(solver.solve().status).endswith("Solved")

    fit = fit_sorted(x, y)
    assert fit.method == "active-set"
    assert_valid_curve(x, fit.values)
    assert sse(y, fit.values) <= sse(y, exact_fit(x, y)) * (1 + 1e-6)


def test_the_fallbacks_give_valid_curves(monkeypatch):
    """Where the exact solve fails, Clarabel's projected iterate serves; where that fails too, the
    projection of the measurements does."""
    from caddtree.core import cost_fit

    x, y = (np.asarray(v) for v in SOLVER_STOPS_SHORT[0])
    monkeypatch.setattr(cost_fit, "_active_set_fit", lambda x, ys: None)
    fit = fit_sorted(x, y)
    assert fit.method == "interior-point"
    assert_valid_curve(x, fit.values)
    assert sse(y, fit.values) <= sse(y, exact_fit(x, y)) * (1 + 1e-5)

    monkeypatch.setattr(cost_fit, "_interior_point_fit", lambda x, ys: None)
    fit = fit_sorted(x, y)
    assert fit.method == "projection"
    assert_valid_curve(x, fit.values)


def test_the_cost_model_records_how_each_curve_was_fitted(tmp_path):
    x, y = SOLVER_STOPS_SHORT[0]
    convex = [0.01, 0.011, 0.013, 0.018]
    model = ConvexCostModel.fit({0: (x, y), 256: ([0, 8, 16, 32], convex)}, 0.002)
    assert model.metadata["fit_methods"] == {"0": "active-set", "256": "as-measured"}
    path = tmp_path / "cost.json"
    model.save(path)
    from caddtree import load_cost_model

    assert load_cost_model(path).metadata["fit_methods"] == model.metadata["fit_methods"]
