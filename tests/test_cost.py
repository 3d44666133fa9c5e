"""The cost model: convex fit (Eq. convex-reg), interpolation (Eq. cv-interp), files."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.optimize import minimize

import caddtree
from caddtree import (
    ConstantCostModel,
    ConvexCostModel,
    CostModelError,
    build_caddtree,
    load_cost_model,
)
from caddtree.core.cost import PiecewiseLinearCurve
from caddtree.core.cost_fit import fit_convex_nondecreasing


def is_convex_nondecreasing(x: np.ndarray, f: np.ndarray, tol: float) -> bool:
    slopes = np.diff(f) / np.diff(x)
    return bool(slopes[0] >= -tol and (np.diff(slopes) >= -tol).all())


def noisy_latencies(rng, n, base=0.02, slope=2e-5, quad=3e-8, noise=5e-4):
    return base + slope * n + quad * n**2 + rng.normal(0, noise, n.size) + 0.0


# ---- fitting -------------------------------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**31 - 1), st.integers(3, 40))
def test_fit_is_convex_and_monotone_on_noisy_data(seed, m):
    rng = np.random.default_rng(seed)
    n = np.unique(rng.integers(0, 1025, size=m))
    if n.size < 3:
        n = np.array([0, 5, 9])
    y = np.abs(noisy_latencies(rng, n, noise=rng.choice([1e-5, 1e-3, 1e-2])))
    f = fit_convex_nondecreasing(n, y)
    # feasible up to float round-off of recomputing slopes from values (relative 1e-12)
    assert f[0] >= 0
    assert is_convex_nondecreasing(n, f, tol=1e-12 * np.abs(np.diff(f) / np.diff(n)).max())
    # a fit never wanders far from data of this shape
    assert np.sqrt(((f - y) ** 2).mean()) <= np.sqrt(((y - y.mean()) ** 2).mean()) + 1e-12


def test_fit_is_the_least_squares_optimum():
    """Cross-check Clarabel's solution against scipy's SLSQP on the same constrained problem."""
    rng = np.random.default_rng(1)
    n = np.array([0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32])
    y = 0.01 + 1e-3 * np.sin(n / 3.0) + rng.normal(0, 1e-3, n.size) + 1e-4 * n
    f = fit_convex_nondecreasing(n, y)
    h = np.diff(n)
    cons = [{"type": "ineq", "fun": lambda v: v[0]}, {"type": "ineq", "fun": lambda v: v[1] - v[0]}]
    for i in range(1, n.size - 1):
        cons.append(
            {
                "type": "ineq",
                "fun": lambda v, i=i: (v[i + 1] - v[i]) / h[i] - (v[i] - v[i - 1]) / h[i - 1],
            }
        )
    y_ms = y * 1e3  # SLSQP is happier with values of order one
    ref = minimize(
        lambda v: ((v - y_ms) ** 2).sum(),
        x0=np.full(n.size, y_ms.mean()),
        jac=lambda v: 2 * (v - y_ms),
        constraints=cons,
        method="SLSQP",
        options={"ftol": 1e-14, "maxiter": 2000},
    )
    assert ref.success, ref.message
    ours, theirs = ((f * 1e3 - y_ms) ** 2).sum(), ((ref.x - y_ms) ** 2).sum()
    assert ours <= theirs * (1 + 1e-6)
    np.testing.assert_allclose(f * 1e3, ref.x, atol=1e-5)
    # optimality of a projection: (y - f) . (g - f) <= 0 for every feasible g
    for _ in range(200):
        slopes = np.sort(rng.exponential(1e-3, n.size - 1))
        g = rng.uniform(0, 0.02) + np.concatenate(([0.0], np.cumsum(slopes * h)))
        assert (y - f) @ (g - f) <= 1e-12
    # the data is not convex, so the fit must differ from it
    assert np.abs(f - y).max() > 1e-4


def test_already_convex_data_is_recovered_exactly():
    n = np.array([0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024])
    y = 0.02 + np.maximum(0, n - 16) * 1e-5 + (n / 1024.0) ** 2 * 1e-3
    model = ConvexCostModel.fit({0: (n, y)}, draft_cost=0.005)
    np.testing.assert_array_equal(model.verify_cost(n, 0), y)
    q = model.fit_quality[0]
    assert q.r2 == 1.0 and q.rmse == 0.0 and q.num_points == n.size


def test_fit_quality_is_reported_per_context_length():
    rng = np.random.default_rng(2)
    n = np.arange(0, 257, 8)
    meas = {0: (n, noisy_latencies(rng, n)), 2048: (n, noisy_latencies(rng, n, base=0.03))}
    model = ConvexCostModel.fit(meas, draft_cost=0.004)
    assert set(model.fit_quality) == {0, 2048}
    for length, (x, y) in meas.items():
        f = model.verify_cost(x, length)
        q = model.fit_quality[length]
        ss_res = ((y - f) ** 2).sum()
        assert q.r2 == pytest.approx(1 - ss_res / ((y - y.mean()) ** 2).sum())
        assert q.rmse == pytest.approx(np.sqrt(ss_res / y.size))
        assert 0.9 < q.r2 <= 1.0
    report = model.fit_report()
    assert "R2" in report and "2048" in report and f"{model.fit_quality[0].r2:.4f}" in report


@pytest.mark.parametrize(
    "measurements, message",
    [
        ({}, "non-empty"),
        ({0: ([1, 2, 3], [0.1, float("nan"), 0.3])}, "NaN or infinite"),
        ({0: ([1, 2, 3], [0.1, float("inf"), 0.3])}, "NaN or infinite"),
        ({0: ([1, 2, 3], [0.1, -0.2, 0.3])}, "negative latency"),
        ({0: ([1, 2], [0.1, 0.2])}, "at least 3"),
        ({0: ([1, 2, 2, 3], [0.1, 0.2, 0.2, 0.3])}, "node count 2 appears more than once"),
        ({0: ([1, 2, 3], [0.1, 0.2])}, "one latency per node count"),
        ({0: ([1, 2.5, 3], [0.1, 0.2, 0.3])}, "integers"),
        ({-1: ([1, 2, 3], [0.1, 0.2, 0.3])}, "non-negative integers"),
        ({0: [1, 2, 3]}, "pair"),
        ({0: (["a", 2, 3], [0.1, 0.2, 0.3])}, "must be numbers"),
    ],
)
def test_bad_measurements_give_clear_errors(measurements, message):
    with pytest.raises(CostModelError, match=message):
        ConvexCostModel.fit(measurements, draft_cost=0.01)


@pytest.mark.parametrize("draft_cost", [0, -1.0, float("nan"), "fast"])
def test_bad_draft_cost(draft_cost):
    with pytest.raises(CostModelError, match="draft_cost"):
        ConvexCostModel.fit({0: ([0, 1, 2], [0.1, 0.2, 0.3])}, draft_cost=draft_cost)


def test_non_convex_curves_are_refused():
    with pytest.raises(CostModelError, match="not convex"):
        ConvexCostModel({0: PiecewiseLinearCurve([0, 1, 2], [0.0, 1.0, 1.5])}, draft_cost=0.1)


# ---- evaluation: interpolation and extrapolation -----------------------------------------------------


def two_curve_model() -> ConvexCostModel:
    a = PiecewiseLinearCurve([1, 10, 100], [0.010, 0.012, 0.040])
    b = PiecewiseLinearCurve([1, 50, 100], [0.020, 0.025, 0.060])
    return ConvexCostModel({1000: a, 3000: b}, draft_cost=0.005)


def test_evaluation_rules_in_n():
    m = two_curve_model()
    # between knots: linear
    assert m.verify_cost(5, 1000) == pytest.approx(0.010 + 4 / 9 * 0.002)
    # below the first knot: constant
    assert m.verify_cost(0, 1000) == pytest.approx(0.010)
    # above the last knot: the last slope
    assert m.verify_cost(200, 1000) == pytest.approx(0.040 + 100 * (0.028 / 90))
    assert isinstance(m.verify_cost(3, 1000), float)
    assert m.verify_cost(np.array([0, 5]), 1000).shape == (2,)
    with pytest.raises(CostModelError, match="node counts"):
        m.verify_cost(-1, 0)


def test_interpolation_in_context_length_and_clamping():
    m = two_curve_model()
    n = np.arange(0, 300)
    a, b = m.verify_cost(n, 1000), m.verify_cost(n, 3000)
    # Eq. cv-interp at alpha = 0.25
    np.testing.assert_allclose(m.verify_cost(n, 1500), 0.75 * a + 0.25 * b)
    # documented rule outside the profiled range: clamp to the nearest curve
    np.testing.assert_array_equal(m.verify_cost(n, 0), a)
    np.testing.assert_array_equal(m.verify_cost(n, 10**6), b)
    np.testing.assert_allclose(m.round_cost_table(2000, 299), m.draft_cost + 0.5 * (a + b))


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**31 - 1), st.integers(0, 9000))
def test_interpolated_costs_stay_convex_and_monotone(seed, length):
    rng = np.random.default_rng(seed)
    n = np.arange(0, 1025, 32)
    meas = {cl: (n, noisy_latencies(rng, n, base=0.01 + cl * 1e-6)) for cl in (0, 2048, 8192)}
    table = ConvexCostModel.fit(meas, draft_cost=0.01).verify_cost_table(length, 2000)
    assert is_convex_nondecreasing(np.arange(table.size), table, tol=1e-15)


# ---- other models ------------------------------------------------------------------------------------


def test_constant_model_makes_caddtree_use_the_whole_budget():
    conv = two_curve_model()
    const = ConstantCostModel.from_cost_model(conv)
    assert const.base_costs == {1000: pytest.approx(0.010), 3000: pytest.approx(0.020)}
    np.testing.assert_allclose(const.verify_cost(np.arange(50), 2000), 0.015)
    logits = np.random.default_rng(0).normal(size=(6, 30))
    assert len(build_caddtree(logits, const, 2000, max_budget=200)) == 200
    assert len(build_caddtree(logits, conv, 2000, max_budget=200)) < 200


def test_scaled_models():
    m = two_curve_model()
    s = m.scaled(draft=0.5, verify=2.0)
    assert s.draft_cost == pytest.approx(0.0025)
    np.testing.assert_allclose(
        s.verify_cost(np.arange(120), 2000), 2 * m.verify_cost(np.arange(120), 2000)
    )
    c = ConstantCostModel({0: 0.01}, 0.02).scaled(draft=2.0, verify=0.5)
    assert (c.draft_cost, c.verify_cost(10, 0)) == (pytest.approx(0.04), pytest.approx(0.005))


# ---- files -------------------------------------------------------------------------------------------


def test_json_round_trip(tmp_path):
    rng = np.random.default_rng(3)
    n = np.arange(0, 129, 4)
    meas = {0: (n, noisy_latencies(rng, n)), 4096: (n, noisy_latencies(rng, n, base=0.05))}
    model = ConvexCostModel.fit(meas, draft_cost=0.0042, metadata={"device": "cpu"})
    path = model.save(tmp_path / "sub" / "cost.json")
    assert sorted(p.name for p in path.parent.iterdir()) == ["cost.json"]  # no temp file left
    data = json.loads(path.read_text())
    assert data["format"] == "caddtree.cost_model" and data["version"] == 1
    loaded = caddtree.load_cost_model(path)
    assert isinstance(loaded, ConvexCostModel)
    assert loaded.draft_cost == model.draft_cost
    assert loaded.metadata == {
        "device": "cpu",
        "fit_methods": {"0": "active-set", "4096": "active-set"},
    }
    assert loaded.fit_quality == model.fit_quality
    for length in (0, 100, 4096, 9000):
        np.testing.assert_array_equal(
            loaded.verify_cost_table(length, 300), model.verify_cost_table(length, 300)
        )
    const = ConstantCostModel.from_cost_model(model)
    again = load_cost_model(const.save(tmp_path / "const.json"))
    assert isinstance(again, ConstantCostModel) and again.base_costs == const.base_costs


@pytest.mark.parametrize(
    "content, message",
    [
        ("{not json", "not valid JSON"),
        ('{"format": "other"}', "not a caddtree cost model"),
        ('{"format": "caddtree.cost_model", "version": 99}', "version 99"),
        (
            '{"format": "caddtree.cost_model", "version": 1, "type": "convex", "curves": []}',
            "non-empty",
        ),
        (
            '{"format": "caddtree.cost_model", "version": 1, "type": "convex", "draft_cost": 0.1,'
            ' "curves": [{"context_length": 0}]}',
            "malformed",
        ),
        (
            '{"format": "caddtree.cost_model", "version": 1, "type": "magic", "draft_cost": 0.1,'
            ' "curves": [{"context_length": 0, "node_counts": [0], "verify_cost": [0.1]}]}',
            "unknown cost-model type",
        ),
        ("just some text", "neither"),
    ],
)
def test_bad_cost_model_files(tmp_path, content, message):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(CostModelError, match=message):
        load_cost_model(path)


def test_missing_file(tmp_path):
    with pytest.raises(CostModelError, match="not found"):
        load_cost_model(tmp_path / "nope.json")


@pytest.mark.parametrize("indexing", ["by_node_count", "paired", "tensor_values"])
def test_published_torch_format(tmp_path, indexing):
    n = np.arange(0, 65)
    curves = {0: 0.01 + 1e-4 * n + 1e-7 * n**2, 1024: 0.02 + 2e-4 * n + 1e-7 * n**2}
    if indexing == "by_node_count":
        payload = {
            "type": "convex",
            "context_lengths": [0, 1024],
            "node_counts": list(range(1, 65)),
            "fitted_curves": {k: v.tolist() for k, v in curves.items()},
            "draft_cost": 0.003,
        }
    elif indexing == "paired":
        payload = {
            "type": "convex",
            "context_lengths": [0, 1024],
            "node_counts": list(range(0, 65, 8)),
            "fitted_curves": {str(k): v[::8].tolist() for k, v in curves.items()},
            "draft_cost": 0.003,
        }
    else:
        payload = {
            "type": "convex",
            "context_lengths": torch.tensor([0, 1024]),
            "node_counts": torch.arange(0, 65),
            "fitted_curves": {k: torch.tensor(v) for k, v in curves.items()},
            "draft_cost": torch.tensor(0.003),
        }
    path = tmp_path / "cost_model.pt"
    torch.save(payload, path)
    model = load_cost_model(path)
    assert isinstance(model, ConvexCostModel)
    assert model.draft_cost == pytest.approx(0.003)
    assert model.context_lengths == [0, 1024]
    at = np.arange(0, 65, 8) if indexing == "paired" else np.arange(65)
    for length, values in curves.items():
        np.testing.assert_allclose(model.verify_cost(at, length), values[at], rtol=1e-12)


class NotAllowed:
    def __init__(self):
        self.value = 1


def test_torch_file_with_arbitrary_objects_is_refused(tmp_path):
    path = tmp_path / "evil.pt"
    torch.save({"type": "convex", "payload": NotAllowed()}, path)
    with pytest.raises(CostModelError, match="weights_only"):
        load_cost_model(path)


def test_published_torch_file_with_missing_keys(tmp_path):
    path = tmp_path / "partial.pt"
    torch.save({"type": "convex", "draft_cost": 0.1}, path)
    with pytest.raises(CostModelError, match="fitted_curves"):
        load_cost_model(path)


def test_negative_verification_costs_are_refused_at_load(tmp_path):
    # convex and non-decreasing, but below zero: every tree would look free of charge... or worse
    curve = {"context_length": 0, "node_counts": [0, 8, 16], "verify_cost": [-0.03, -0.02, -0.01]}
    data = {"format": "caddtree.cost_model", "version": 1, "type": "convex", "draft_cost": 0.01}
    path = tmp_path / "negative.json"
    path.write_text(json.dumps({**data, "curves": [curve]}))
    with pytest.raises(CostModelError, match="negative verification cost"):
        load_cost_model(path)
    with pytest.raises(CostModelError, match="negative verification cost"):
        PiecewiseLinearCurve([0, 1], [0.01, -0.01])


class _UserCostModel(caddtree.CostModel):
    """A user's own cost model, written without the library's validation."""

    def __init__(self, draft_cost, verify):
        self.draft_cost = draft_cost
        self._verify = verify

    def verify_cost_table(self, context_length, max_n):
        return np.full(max_n + 1, self._verify, dtype=np.float64)

    def scaled(self, draft=1.0, verify=1.0):
        return _UserCostModel(self.draft_cost * draft, self._verify * verify)

    def to_dict(self):
        return {}


@pytest.mark.parametrize(
    "draft_cost, verify, message",
    [
        (0.0, 0.0, "C_d must be a positive"),  # a zero round cost: used to be ZeroDivisionError
        (0.0, 0.01, "C_d must be a positive"),
        (-0.01, 0.05, "C_d must be a positive"),
        (float("nan"), 0.05, "C_d must be a positive"),
        (0.01, -0.02, "C_v >= 0"),  # used to make every tree empty, silently
        (0.01, float("inf"), "C_v >= 0"),
    ],
)
def test_bad_costs_are_refused_where_trees_are_built(draft_cost, verify, message):
    logits = torch.randn(7, 50, generator=torch.Generator().manual_seed(0))
    model = _UserCostModel(draft_cost, verify)
    with pytest.raises(CostModelError, match=message):
        build_caddtree(logits, model, context_length=10, max_budget=32)
    with pytest.raises(CostModelError, match=message):
        caddtree.core.tree.surrogate_throughput(logits, model, 10, 32)


def test_a_valid_user_cost_model_builds_trees():
    logits = torch.randn(7, 50, generator=torch.Generator().manual_seed(0))
    tree = build_caddtree(logits, _UserCostModel(0.01, 0.02), context_length=10, max_budget=32)
    assert len(tree) == 32  # a flat verification cost: every extra node is free, up to the cap


def test_a_scaled_model_reports_the_fit_quality_of_its_own_curves():
    rng = np.random.default_rng(5)
    n = np.arange(0, 65, 4)
    model = ConvexCostModel.fit({0: (n, noisy_latencies(rng, n))}, draft_cost=0.004)
    scaled = model.scaled(verify=3.0)
    before, after = model.fit_quality[0], scaled.fit_quality[0]
    assert after.r2 == pytest.approx(before.r2)  # a scale changes no relative error
    assert after.rmse == pytest.approx(3.0 * before.rmse)
    assert after.max_abs_error == pytest.approx(3.0 * before.max_abs_error)
    # the same as fitting measurements three times as large
    refit = ConvexCostModel.fit({0: (n, 3.0 * noisy_latencies(np.random.default_rng(5), n))}, 0.004)
    assert after.rmse == pytest.approx(refit.fit_quality[0].rmse, rel=1e-4)


# ---- found by the property-based suite of issue 14 (tests/test_robustness.py) --------------------


@pytest.mark.parametrize("content", [b"\x80", b"PK\x03\x04", b"\x80\x02}q\x00."], ids=repr)
def test_a_damaged_torch_cost_model_file_is_a_cost_model_error(tmp_path, content):
    """A one-byte b"\\x80" file made torch.load raise a bare IndexError."""
    path = tmp_path / "cost.pt"
    path.write_bytes(content)
    with pytest.raises(CostModelError, match="cannot read it as a torch cost-model file"):
        load_cost_model(path)


def test_a_vanishing_draft_cost_is_refused(tmp_path):
    """C_d = 2e-311 s with a free verification made theta overflow to infinity: empty trees."""
    n = np.array([0, 8, 64])
    model = ConvexCostModel.fit({0: (n, 0.01 + 1e-4 * n)}, draft_cost=0.003)
    data = model.to_dict()
    data["draft_cost"] = 2.2e-311
    data["curves"][0]["verify_cost"] = [0.0, 0.0, 0.0]
    path = tmp_path / "cost.json"
    path.write_text(json.dumps(data))
    with pytest.raises(CostModelError, match=r"at least 1e-09"):
        load_cost_model(path)
    with pytest.raises(CostModelError, match=r"at least 1e-09"):
        _UserCostModel(1e-300, 0.0).round_cost_table(0, 8)


def test_the_noise_warning_lives_on_the_cost_model():
    n = np.arange(0, 65, 8)
    clean = ConvexCostModel.fit({0: (n, 0.01 + 1e-4 * n)}, draft_cost=0.004)
    assert clean.worst_r2 == pytest.approx(1.0) and not clean.noisy
    assert clean.noise_warning("rerun") is None
    wobbly = 0.01 + 1e-4 * n + np.where(np.arange(n.size) % 2, 4e-3, 0.0)
    noisy = ConvexCostModel.fit({0: (n, 0.01 + 1e-4 * n), 64: (n, wobbly)}, draft_cost=0.004)
    assert noisy.worst_r2 == pytest.approx(noisy.fit_quality[64].r2) and noisy.worst_r2 < 0.9
    warning = noisy.noise_warning("rerun on a quiet machine")
    assert f"R2 down to {noisy.worst_r2:.2f}" in warning and warning.endswith("quiet machine")


def test_a_shorter_context_that_costs_more_is_noise():
    """A causal model's verification does not get cheaper with more context: a profile whose
    short-context curve lies far above a longer one's was disturbed, however well each fits."""
    n = np.arange(0, 65, 8)
    ok = ConvexCostModel.fit({0: (n, 0.040 + 1e-3 * n), 256: (n, 0.042 + 1e-3 * n)}, 0.004)
    assert ok.context_inversion == 0.0 and not ok.noisy and ok.noise_warning("rerun") is None
    # within 10%: timing noise between contexts, not a disturbed profile
    close = ConvexCostModel.fit({0: (n, 0.044 + 1e-3 * n), 256: (n, 0.042 + 1e-3 * n)}, 0.004)
    assert close.context_inversion == pytest.approx(0.002 / 0.042, rel=1e-4) and not close.noisy
    # like the profile that made CaDDTree overbuy on GSM8K: context 0 from 67 ms, 256 from 48
    bad = ConvexCostModel.fit(
        {0: (n, 0.067 + 0.62e-3 * n), 256: (n, 0.048 + 0.96e-3 * n), 512: (n, 0.063 + 1e-3 * n)},
        0.004,
    )
    assert bad.worst_r2 > 0.99 and bad.context_inversion == pytest.approx(0.019 / 0.048, rel=1e-4)
    assert bad.noisy
    warning = bad.noise_warning("measuring once more")
    assert "R2" not in warning and "up to 40% slower to verify than a longer one" in warning
    assert ok.quality > close.quality > bad.quality
