"""The batch cost model (caddtree.engine.batch_cost): C_v over a round's total nodes per batch
size and context, C_d per batch size, profiled on the tiny float64 pair; interpolated between
batch sizes; saved, loaded and cached; priced by the joint budget, which stays lossless; and
`caddtree profile --batch`."""

from __future__ import annotations

import io
import json
from contextlib import redirect_stderr, redirect_stdout

import numpy as np
import pytest

from caddtree import ConvexCostModel
from caddtree.api import SpeculativeGenerator
from caddtree.cli import main
from caddtree.engine.batch_cost import BatchCostModel, profile_batch_cost_model
from caddtree.engine.batching import BatchDecoder, GenerationRequest
from caddtree.engine.decoding import make_policy
from caddtree.models.batch_proposer import BatchProposer
from caddtree.profiles import batch_sizes
from caddtree.runtime.lean import LeanTarget
from caddtree.util.errors import CostModelError, InvalidInputError
from sampling_checks import hf_generate
from test_profiling import assert_convex_nondecreasing, profile_argv
from tiny_models import FEATURE_LAYER_IDS


def linear_model(per_node: float, draft: float) -> ConvexCostModel:
    nodes = [0, 8, 64]
    curves = {n: (nodes, [0.01 + per_node * k + 1e-5 * n for k in nodes]) for n in (0, 100)}
    return ConvexCostModel.fit(curves, draft_cost=draft)


@pytest.fixture(scope="module")
def profiled(qwen3, drafter):
    target = LeanTarget(qwen3, FEATURE_LAYER_IDS)
    proposer = BatchProposer(drafter, qwen3, 3)
    model = profile_batch_cost_model(
        target,
        proposer,
        batches=(1, 3),
        node_counts=(0, 3, 9, 24),
        context_lengths=(0, 20),
        trials=1,
        warmup=1,
        progress=False,
    )
    return target, model


def test_a_profile_fits_a_convex_curve_per_batch_size_and_context(profiled):
    target, model = profiled
    assert model.batches == [1, 3] and target.slots == 0  # the cache was let go
    for per_batch in model.models.values():
        assert per_batch.context_lengths == [1, 20]  # a round follows at least one token
        assert 0 < per_batch.draft_cost < 10
        for curve in per_batch.curves:
            assert curve.node_counts.tolist() == [0, 3, 9, 24]
            assert_convex_nondecreasing(curve.node_counts, curve.values)
    assert sorted(model.metadata["raw"]) == ["1", "3"]


def test_batch_sizes_between_profiled_ones_are_interpolated():
    model = BatchCostModel({1: linear_model(1e-3, 0.002), 4: linear_model(4e-3, 0.005)})
    one, four = (model.verify_cost_table(b, 50, 64) for b in (1, 4))
    two = model.verify_cost_table(2, 50, 64)
    np.testing.assert_allclose(two, one + (four - one) / 3)
    assert model.draft_cost(2) == pytest.approx(0.003)
    np.testing.assert_allclose(model.verify_cost_table(9, 50, 64), four)  # the largest's
    np.testing.assert_allclose(model.round_cost_table(4, 50, 64), four + 0.005)
    assert_convex_nondecreasing(np.arange(65), two)
    assert batch_sizes(8) == [1, 2, 4, 8] and batch_sizes(6) == [1, 2, 4, 6]
    assert batch_sizes(1) == [1]


def test_it_saves_and_loads_back_and_refuses_other_files(profiled, qwen3, drafter, tmp_path):
    _, model = profiled
    path = model.save(tmp_path / "batch.json")
    loaded = BatchCostModel.load(path)
    assert loaded.batches == model.batches
    np.testing.assert_allclose(
        loaded.round_cost_table(2, 10, 30), model.round_cost_table(2, 10, 30)
    )
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"format": "caddtree.cost_model"}))
    with pytest.raises(CostModelError, match="not a caddtree batch cost model"):
        BatchCostModel.load(other)
    data = json.loads(path.read_text())
    data["batches"]["1"]["curves"] = []
    other.write_text(json.dumps(data))
    with pytest.raises(CostModelError, match=r"batch 1\).*non-empty list"):
        BatchCostModel.load(other)
    with pytest.raises(InvalidInputError, match=r"batch sizes must be 1 \.\. 2"):
        profile_batch_cost_model(profiled[0], BatchProposer(drafter, qwen3, 2), batches=[3])


def test_the_joint_budget_priced_by_it_stays_lossless(qwen3, drafter, profiled):
    _, model = profiled
    decoder = BatchDecoder(
        LeanTarget(qwen3, FEATURE_LAYER_IDS),
        drafter,
        max_batch=3,
        capacity=64,
        joint_cost_model=model,
        joint_max_nodes=24,
    )
    prompts = [[5, 17, 3, 44, 8], [70, 2, 2, 9, 31], [11, 4], [40, 41, 42]]
    policy = make_policy("caddtree", cost_model=model.models[1], max_budget=24)
    done = decoder.run([GenerationRequest(p, policy, 16) for p in prompts])
    for request in done:
        assert request.output == hf_generate(qwen3, list(request.prompt_ids), 16)


def test_the_generator_caches_its_batch_model(tiny_pair_dirs, tmp_path, monkeypatch):
    target, draft = tiny_pair_dirs
    gen = SpeculativeGenerator.from_pretrained(
        target, draft, dtype="float64", device="cpu", runtime="lean"
    )
    calls = []
    real = profile_batch_cost_model

    def small(target, proposer, batches):
        calls.append(batches)
        grid = {"node_counts": (0, 2, 6), "context_lengths": (0, 8), "trials": 1}
        return real(target, proposer, batches=batches, progress=False, **grid)

    monkeypatch.setattr("caddtree.engine.batch_cost.profile_batch_cost_model", small)
    first = gen.cached_batch_cost_model(3, cache_dir=tmp_path)
    second = gen.cached_batch_cost_model(3, cache_dir=tmp_path)
    assert calls == [[1, 2, 3]] and second.batches == first.batches == [1, 2, 3]
    assert len(list(tmp_path.glob("batch-cost-*.json"))) == 1
    assert gen.generate([5, 6, 7], "ar", max_new_tokens=4).token_ids  # the verifier still works


def test_profile_batch_writes_the_batch_model_beside_the_cost_model(tiny_pair_dirs, tmp_path):
    out = tmp_path / "cost.json"
    argv = profile_argv(
        tiny_pair_dirs,
        *("--runtime", "lean", "--context-lengths", "0", "16", "--node-counts", "0", "2", "8"),
        *("--trials", "1", "--warmup", "1", "--out", str(out), "--batch", "2"),
    )
    stdout, stderr = io.StringIO(), io.StringIO()
    with redirect_stdout(stdout), redirect_stderr(stderr):
        assert main(argv) == 0, stderr.getvalue()
    model = BatchCostModel.load(tmp_path / "cost.batch.json")
    assert model.batches == [1, 2]
    assert "batch 2: C_d" in stdout.getvalue() and "cost.batch.json" in stdout.getvalue()


def test_the_server_sizes_its_batch_and_prices_joint_rounds_with_the_batch_model():
    """`caddtree serve`: `--max-batch auto` takes the batch size whose plain rounds measure the
    most tokens per second (1 on transformers' runtime); a joint budget on the lean runtimes
    without --cost-model is priced by the batch cost model; a given cost model, per-request
    budgets or one request at a time keep the one-sequence model."""
    import argparse
    from types import SimpleNamespace

    from caddtree.serve.server import AUTO_MAX_BATCH, _batching

    # plain rounds of 1, 2, 4, 8 requests: 10, 11, 13, 30 ms: 4 at a time is the fastest
    model = BatchCostModel(
        {
            b: ConvexCostModel.fit({0: ([0, 8, 64], [t, t * 2, t * 4])}, 0.001)
            for b, t in ((1, 0.010), (2, 0.011), (4, 0.013), (8, 0.030))
        },
        {"context_lengths": [0]},
    )
    assert model.best_batch(0) == 4
    asked = []

    def cached(n):
        asked.append(n)
        return model

    gen = SimpleNamespace(runtime="compiled", drafter=object(), cached_batch_cost_model=cached)

    def args(**kw):
        return argparse.Namespace(
            **{"max_batch": "auto", "batch_budget": "joint", "cost_model": None, **kw}
        )

    assert _batching(gen, args()) == (4, model) and asked == [AUTO_MAX_BATCH]
    assert _batching(gen, args(max_batch=8)) == (8, model) and asked[-1] == 8
    for kw in ({"max_batch": 1}, {"batch_budget": "per-request"}, {"cost_model": object()}):
        assert _batching(gen, args(**{"max_batch": 3, **kw}))[1] is None
    gen.runtime = "transformers"
    assert _batching(gen, args()) == (1, None)
