"""The cached cost model: one profiling per cache entry, and noisy fits re-measured once."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from caddtree import ConvexCostModel, load_cost_model
from caddtree.api import SpeculativeGenerator


def fitted(noise: float, seed: int) -> ConvexCostModel:
    """A cost model fitted to linear timings with ``noise`` (relative) added: R2 falls with it."""
    rng = np.random.default_rng(seed)
    nodes = [1, 2, 4, 8, 16, 32, 64]
    measurements = {}
    for length in (16, 64):
        clean = 0.01 + 0.001 * np.asarray(nodes, dtype=float)
        measurements[length] = (
            nodes,
            list(clean * np.exp(noise * rng.standard_normal(len(nodes)))),
        )
    return ConvexCostModel.fit(measurements, draft_cost=0.002)


@pytest.fixture
def generator(tiny_pair_dirs):
    target, draft = tiny_pair_dirs
    return SpeculativeGenerator.from_pretrained(target, draft, dtype="float64", device="cpu")


def test_two_first_runs_at_once_profile_once(generator, tmp_path, monkeypatch):
    calls = []

    def slow_profile(**kwargs):
        calls.append(threading.get_ident())
        time.sleep(0.5)  # long enough for the other caller to arrive while this one measures
        return fitted(0.0, 0)

    monkeypatch.setattr(generator, "profile", slow_profile)
    results = [None, None]

    def first_use(i):
        results[i] = generator.cached_cost_model(tmp_path)

    threads = [threading.Thread(target=first_use, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1  # the second caller waited and read the first one's result
    files = list(tmp_path.glob("cost-*.json"))
    assert len(files) == 1
    for model in results:
        assert model.draft_cost == pytest.approx(load_cost_model(files[0]).draft_cost)


def test_a_noisy_fit_is_measured_again_and_the_better_one_kept(
    generator, tmp_path, monkeypatch, caplog
):
    noisy, clean = fitted(0.8, 1), fitted(0.0, 2)
    assert min(q.r2 for q in noisy.fit_quality.values()) < 0.9
    queue = [noisy, clean]
    monkeypatch.setattr(generator, "profile", lambda **kwargs: queue.pop(0))
    model = generator.cached_cost_model(tmp_path)
    assert queue == []  # measured twice
    assert min(q.r2 for q in model.fit_quality.values()) > 0.99
    assert "measuring once more" in caplog.text and "measured twice" not in caplog.text
    saved = load_cost_model(next(tmp_path.glob("cost-*.json")))
    assert min(q.r2 for q in saved.fit_quality.values()) > 0.99


def test_a_profile_whose_short_context_costs_more_is_measured_again(
    generator, tmp_path, monkeypatch, caplog
):
    n = [0, 1, 2, 4, 8, 16, 32]
    line = 0.048 + 1e-3 * np.asarray(n)
    inverted = ConvexCostModel.fit({0: (n, line + 0.02), 256: (n, line)}, draft_cost=0.004)
    clean = ConvexCostModel.fit({0: (n, line), 256: (n, line + 0.002)}, draft_cost=0.004)
    queue = [inverted, clean]
    monkeypatch.setattr(generator, "profile", lambda **kwargs: queue.pop(0))
    model = generator.cached_cost_model(tmp_path)
    assert queue == [] and "42% slower to verify" in caplog.text
    assert model.context_inversion == 0.0
    saved = load_cost_model(next(tmp_path.glob("cost-*.json")))
    assert saved.verify_cost(0, 0) == pytest.approx(0.048, rel=1e-4)


def test_a_fit_that_stays_noisy_is_kept_with_a_warning(generator, tmp_path, monkeypatch, caplog):
    first, second = fitted(0.8, 1), fitted(0.9, 3)
    queue = [first, second]
    monkeypatch.setattr(generator, "profile", lambda **kwargs: queue.pop(0))
    model = generator.cached_cost_model(tmp_path)
    best = max(min(q.r2 for q in m.fit_quality.values()) for m in (first, second))
    assert min(q.r2 for q in model.fit_quality.values()) == pytest.approx(best)
    assert "measured twice" in caplog.text


def test_a_clean_fit_is_measured_once(generator, tmp_path, monkeypatch, caplog):
    queue = [fitted(0.0, 0), fitted(0.0, 1)]
    monkeypatch.setattr(generator, "profile", lambda **kwargs: queue.pop(0))
    generator.cached_cost_model(tmp_path)
    assert len(queue) == 1
    assert "measuring once more" not in caplog.text


def test_the_library_logs_and_prints_nothing_itself(
    generator, tmp_path, monkeypatch, capsys, caplog
):
    """Library code reports through `logging` (the CLI shows it as `caddtree: ...` lines); with
    no handler configured, an info message reaches neither stdout nor stderr."""
    import logging

    monkeypatch.setattr(generator, "profile", lambda **kwargs: fitted(0.0, 0))
    generator.cached_cost_model(tmp_path)  # profiles and saves
    capsys.readouterr()
    logger = logging.getLogger("caddtree")
    monkeypatch.setattr(logger, "handlers", [])
    monkeypatch.setattr(logger, "propagate", True)
    with caplog.at_level(logging.INFO, logger="caddtree"):
        generator.cached_cost_model(tmp_path)  # reads the cache: an info message
    assert any("profiled earlier" in r.getMessage() for r in caplog.records)
    assert all(r.name.startswith("caddtree.") for r in caplog.records)
    out, err = capsys.readouterr()
    assert out == "" and "profiled earlier" not in err


def test_another_attention_implementation_is_profiled_anew(generator, tmp_path, monkeypatch):
    """Verification costs depend on the attention implementation: a cost model profiled under
    one is not reused under another, and is reused when it comes back."""
    calls = []
    monkeypatch.setattr(generator, "profile", lambda **kw: calls.append(1) or fitted(0.0, 0))
    model = generator.target
    try:
        generator.cached_cost_model(tmp_path)
        model.set_attn_implementation("sdpa")
        generator.cached_cost_model(tmp_path)
        model.set_attn_implementation("caddtree_sdpa")
        generator.cached_cost_model(tmp_path)
    finally:
        model.set_attn_implementation("caddtree_sdpa")
    assert len(calls) == 2
    assert len(list(tmp_path.glob("cost-*.json"))) == 2


def test_a_moved_drafter_reuses_the_profile_and_other_weights_do_not(
    generator, tmp_path, monkeypatch
):
    """A second clone or virtual environment holds the packaged drafter at another path: the
    profile is the drafter's (by its weights), not its path's."""
    import torch

    calls = []
    monkeypatch.setattr(generator, "profile", lambda **kw: calls.append(1) or fitted(0.0, 0))
    generator.cached_cost_model(tmp_path)
    monkeypatch.setitem(generator.source, "draft", "/another/clone/smollm2-135m-dflash")
    generator.cached_cost_model(tmp_path)
    assert len(calls) == 1
    weight = generator.drafter.fc.weight
    with torch.no_grad():
        weight.add_(1.0)
        try:
            generator.cached_cost_model(tmp_path)
        finally:
            weight.sub_(1.0)
    assert len(calls) == 2
