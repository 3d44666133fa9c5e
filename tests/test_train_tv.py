"""The drafter's loss with the target's distribution (L1 = 2 TV, LK), on the tiny target: the stored
top-k and the terms agree with float64 references from the full distributions, gradients flow and
training lowers the L1, the feature cache keeps the target's rows, the options are checked, and
the evaluation logs acceptance per block position."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file

from caddtree.cli import main
from caddtree.train import features as feature_module
from caddtree.train.data import TrainingData
from caddtree.train.loss import (
    LK_FLOOR,
    AnchorBlockLoss,
    _position_figures,
    distribution_terms,
    lk_term,
)
from caddtree.train.targets import TopKSpec
from caddtree.train.trainer import train_drafter
from tiny_models import (
    FEATURE_LAYER_IDS,
    VOCAB,
    new_drafter,
    train_config,
)

LAYERS = list(FEATURE_LAYER_IDS)
DRAFT_IDS = torch.tensor(sorted(set(range(0, VOCAB, 3)) | set(range(1, 40))))


config = train_config


def reference_l1_and_accept(p_full: torch.Tensor, log_q: torch.Tensor, draft_ids: torch.Tensor):
    """Brute force, float64: sum |p - q| and sum min(p, q) over the whole vocabulary, with the
    drafter's q (over the draft ids) zero elsewhere."""
    q_full = torch.zeros_like(p_full)
    q_full[..., draft_ids] = log_q.exp().to(p_full.dtype)
    return (p_full - q_full).abs().sum(-1), torch.minimum(p_full, q_full).sum(-1)


def stored_topk(p_full: torch.Tensor, draft_ids: torch.Tensor, k: int) -> dict:
    """What the feature pass stores for the full distributions ``p_full`` (exact, float64)."""
    p_draft = p_full[..., draft_ids]
    probs, ids = p_draft.topk(k, dim=-1)
    outside = 1 - p_draft.sum(-1)
    return {"ids": ids, "probs": probs, "rest": 1 - outside - probs.sum(-1), "outside": outside}


def test_l1_terms_equal_the_full_distributions_when_k_covers_the_draft_vocabulary():
    gen = torch.Generator().manual_seed(5)
    n = 64
    # peaked and flat rows, for the target and the drafter alike
    scale = torch.linspace(0.3, 6.0, n, dtype=torch.float64)[:, None]
    p_full = torch.softmax(scale * torch.randn(n, VOCAB, generator=gen, dtype=torch.float64), -1)
    q_logits = scale.flip(0) * torch.randn(n, len(DRAFT_IDS), generator=gen, dtype=torch.float64)
    log_q = torch.log_softmax(q_logits, -1)
    want_l1, want_accept = reference_l1_and_accept(p_full, log_q, DRAFT_IDS)

    full = distribution_terms(log_q, **stored_topk(p_full, DRAFT_IDS, len(DRAFT_IDS)))
    torch.testing.assert_close(full["l1"], want_l1, rtol=0, atol=1e-12)
    torch.testing.assert_close(full["accept"], want_accept, rtol=0, atol=1e-12)
    assert (full["slack"] < 1e-12).all()
    assert want_l1.min() > 0.05 and want_l1.max() > 1.0  # the rows differ, some a lot

    # with a few ids stored, the rest of the draft vocabulary is one lump: l1 can only shrink,
    # by at most twice the slack, and acceptance can only grow, by at most the slack
    few = distribution_terms(log_q, **stored_topk(p_full, DRAFT_IDS, 4))
    assert (few["l1"] <= want_l1 + 1e-12).all()
    assert (few["l1"] >= want_l1 - 2 * few["slack"] - 1e-12).all()
    assert (few["accept"] >= want_accept - 1e-12).all()
    assert (few["accept"] <= want_accept + few["slack"] + 1e-12).all()
    assert (few["l1"] < want_l1 - 1e-3).any()  # the lump does hide some differences


def test_the_lk_term_is_the_cross_entropy_at_a_one_token_target():
    gen = torch.Generator().manual_seed(6)
    log_q = torch.log_softmax(torch.randn(8, 20, generator=gen, dtype=torch.float64), -1)
    labels = torch.randint(20, (8,), generator=gen)
    one_token = {
        "ids": labels[:, None],
        "probs": torch.ones(8, 1, dtype=torch.float64),
        "rest": torch.zeros(8, dtype=torch.float64),
        "outside": torch.zeros(8, dtype=torch.float64),
    }
    lk = lk_term(distribution_terms(log_q, **one_token)["accept"])
    ce = torch.nn.functional.cross_entropy(log_q, labels, reduction="none")
    torch.testing.assert_close(lk, ce, rtol=0, atol=1e-12)
    # no shared mass: the floor keeps it finite
    floor = lk_term(torch.tensor([0.0, 1.0]))
    assert floor.tolist() == pytest.approx([-math.log(LK_FLOOR), 0.0])


def test_stored_rows_are_the_targets_next_token_distribution(target, data):
    few = TrainingData(data.sequences[:10], data.prompt_lengths[:10])
    spec = TopKSpec.make(10_000, DRAFT_IDS, VOCAB)  # k is cut to the draft vocabulary
    assert spec.k == len(DRAFT_IDS)
    feats, rows = feature_module.compute_features_and_targets(
        target, few, LAYERS, spec, max_batch_tokens=64, progress=False
    )
    plain = feature_module.compute_features(target, few, LAYERS, progress=False)
    assert all(torch.allclose(a, b, rtol=0, atol=1e-10) for a, b in zip(feats, plain))
    in_draft = torch.zeros(VOCAB, dtype=torch.bool)
    in_draft[DRAFT_IDS] = True
    for i, (seq, P) in enumerate(zip(few.sequences, few.prompt_lengths)):
        with torch.no_grad():
            p_full = torch.softmax(target(seq[None]).logits[0, P:-1], -1)  # predicting P+1 ..
        assert rows.counts[i] == len(seq) - 1 - P
        probs, ids = (rows.samples[name][i] for name in ("probs", "ids"))
        assert ids.dtype == torch.int16 and probs.dtype == torch.float16
        want = p_full[torch.arange(len(p_full))[:, None], DRAFT_IDS[ids.long()]]
        torch.testing.assert_close(probs.double(), want, rtol=1e-3, atol=1e-7)
        outside = 1 - p_full[:, DRAFT_IDS].sum(-1)
        torch.testing.assert_close(rows.samples["outside"][i].double(), outside, atol=1e-6, rtol=0)
        assert (rows.samples["rest"][i] < 1e-3).all()
        # the row's argmax is the greedy label wherever the draft vocabulary holds it
        labels = seq[P + 1 :]
        held = in_draft[labels]
        assert held.any() and torch.equal(DRAFT_IDS[ids[held, 0].long()], labels[held])


def batch_reference(loss, target, data, sample_ids, anchors):
    """The block positions' drafter log-distributions and the target's full distributions (both
    float64, brute force), with their validity mask and position weights."""
    hidden, _, in_range = loss._block_hidden(sample_ids, anchors)
    with torch.no_grad():
        log_q = torch.log_softmax(loss.lm_head(hidden.double()), -1)
    p_full = torch.zeros((*in_range.shape, VOCAB), dtype=torch.float64)
    for r, (i, anc) in enumerate(zip(sample_ids, anchors)):
        with torch.no_grad():
            probs = torch.softmax(target(data.sequences[i][None]).logits[0], -1)
        for j, a in enumerate(anc.tolist()):
            for k in range(in_range.shape[-1]):
                if in_range[r, j, k]:
                    p_full[r, j, k] = probs[a + k]  # predicting token a + k + 1
    weights = loss.position_weights.expand(in_range.shape).double()
    return log_q, p_full, in_range, weights


@pytest.mark.parametrize("k", [len(DRAFT_IDS), 6])
def test_the_l1_loss_and_its_acceptance_figures_against_full_distributions(target, data, k):
    drafter = new_drafter(target, num_layers=1, draft_token_ids=DRAFT_IDS.tolist()).float()
    few = TrainingData(data.sequences[:6], data.prompt_lengths[:6])
    spec = TopKSpec.make(k, drafter.draft_token_ids, VOCAB)
    feats, rows = feature_module.compute_features_and_targets(
        target, few, LAYERS, spec, progress=False
    )
    cfg = config(ce_weight=0.0, l1_weight=1.0, target_topk=k)
    loss = AnchorBlockLoss(drafter, target, feats, few, cfg, torch.device("cpu"), rows)
    sample_ids = [0, 3, 5]
    anchors = [torch.tensor([few.prompt_lengths[i], len(few.sequences[i]) - 3]) for i in sample_ids]
    value, stats = loss.batch_loss(sample_ids, None, anchors)
    log_q, p_full, in_range, w = batch_reference(loss, target, few, sample_ids, anchors)
    l1, accept = reference_l1_and_accept(p_full[in_range], log_q[in_range], DRAFT_IDS)
    want = (w[in_range] * l1).sum() / w[in_range].sum()
    count = in_range.sum((0, 1))
    assert torch.equal(stats["by_position"]["count"], count)
    positions = torch.zeros(in_range.shape, dtype=torch.float64)
    positions[in_range] = accept
    got_accept = stats["by_position"]["accept"].double()
    if k == len(DRAFT_IDS):  # the whole draft vocabulary: the exact L1 (up to float16 storage)
        assert abs(value.item() - want.item()) < 2e-3
        torch.testing.assert_close(
            got_accept, positions.sum((0, 1)), atol=2e-3 * count.max().item(), rtol=0
        )
    else:  # a lower bound on L1, within twice the slack; acceptance within the slack above
        slack = stats["by_position"]["slack"].double()
        assert value.item() <= want.item() + 2e-3
        assert value.item() >= want.item() - 2 * slack.sum() / count.sum() - 2e-3
        assert (got_accept >= positions.sum((0, 1)) - 2e-3).all()
        assert (got_accept <= positions.sum((0, 1)) + slack + 2e-3).all()
        assert slack.sum() > 0


def test_gradients_flow_and_a_few_steps_lower_the_l1_and_lk_terms(target, data):
    spec = TopKSpec.make(8, DRAFT_IDS, VOCAB)
    feats, rows = feature_module.compute_features_and_targets(
        target, data, LAYERS, spec, progress=False
    )
    for weights in (dict(l1_weight=1.0), dict(lk_weight=1.0)):
        drafter = new_drafter(target, num_layers=1, draft_token_ids=DRAFT_IDS.tolist()).float()
        cfg = config(ce_weight=0.0, **weights)
        loss = AnchorBlockLoss(drafter, target, feats, data, cfg, torch.device("cpu"), rows)
        anchors = loss._random_anchors(torch.tensor([0, 1, 2]), torch.Generator().manual_seed(0))
        optimizer = torch.optim.Adam(drafter.parameters(), lr=3e-3)
        values = []
        for _ in range(20):
            optimizer.zero_grad()
            value, _ = loss.batch_loss([0, 1, 2], None, anchors)
            value.backward()
            grads = [p.grad for p in drafter.parameters() if p.grad is not None]
            assert len(grads) == len(list(drafter.parameters()))
            assert all(g.isfinite().all() for g in grads) and sum(g.abs().sum() for g in grads) > 0
            optimizer.step()
            values.append(value.item())
        assert values[-1] < 0.85 * values[0], (weights, values)


def test_training_with_dsparks_mix_lowers_the_l1(target, data, tmp_path):
    cfg = config(
        steps=200,
        learning_rate=1e-2,
        ce_weight=0.1,
        l1_weight=0.9,
        draft_vocab_coverage=0.9,
        eval_every=50,
        eval_fraction=0.25,  # 10 held-out samples: the held-out figures' trend is not noise
    )
    train_drafter(target, data, tmp_path, cfg, resume=False, progress=False, stop_token_ids=[1])
    log = [json.loads(line) for line in (tmp_path / "train_log.jsonl").read_text().splitlines()]
    first = sum(e["train_l1"] for e in log[:10]) / 10
    last = sum(e["train_l1"] for e in log[-10:]) / 10
    # this random tiny target is hard to match (its acceptance starts near 0.45 per position)
    assert last < first - 0.05, (first, last)
    assert all(e["loss"] == pytest.approx(0.1 * e["train_ce"] + 0.9 * e["train_l1"]) for e in log)
    evals = [e for e in log if "eval_l1" in e]
    assert len(evals) == 4 and evals[-1]["eval_l1"] < evals[0]["eval_l1"]
    # the learning curve of acceptance per block position: position 1 gains
    assert evals[-1]["eval_accept_by_position"][0] > evals[0]["eval_accept_by_position"][0]


def test_per_position_figures_are_logged(target, data, tmp_path):
    train_drafter(target, data, tmp_path / "ce", config(steps=20), resume=False, progress=False)
    log = [json.loads(x) for x in (tmp_path / "ce" / "train_log.jsonl").read_text().splitlines()]
    evals = [e for e in log if "eval_loss" in e]
    assert [e["step"] for e in evals] == [10, 20]
    for e in evals:  # a CE run logs the greedy figure only, next to the figures of before
        assert len(e["eval_top1_by_position"]) == 5
        assert all(0 <= x <= 1 for x in e["eval_top1_by_position"])
        assert "eval_accept_by_position" not in e and "eval_tree_tau" in e
    assert "train_l1" not in log[0]
    cfg = config(steps=20, target_topk=16)  # CE, with the target's top-k for the figures
    train_drafter(target, data, tmp_path / "topk", cfg, resume=False, progress=False)
    lines = (tmp_path / "topk" / "train_log.jsonl").read_text().splitlines()
    evals = [e for e in map(json.loads, lines) if "eval_loss" in e]
    for e in evals:
        assert len(e["eval_accept_by_position"]) == 5
        assert all(0 < x < 1 for x in e["eval_accept_by_position"])
        assert 0 <= e["eval_accept_slack"] < 1 and e["eval_ce"] == pytest.approx(e["eval_loss"])


def test_position_figures_pool_the_batches():
    def batch(count, top1, accept, slack):
        by_position = {
            "count": torch.tensor(count),
            "top1": torch.tensor(top1),
            "accept": torch.tensor(accept, dtype=torch.float64),
            "slack": torch.tensor(slack, dtype=torch.float64),
        }
        return {"by_position": by_position, "ce": 2.0, "l1": 1.0}

    figures = _position_figures(
        [
            batch([4, 2], [3, 1], [2.0, 1.0], [0.4, 0.0]),
            batch([4, 0], [1, 0], [1.0, 0.0], [0.2, 0.0]),
        ]
    )
    assert figures["eval_top1_by_position"] == [0.5, 0.5]
    assert figures["eval_accept_by_position"] == [3.0 / 8, 0.5]
    assert figures["eval_accept_slack"] == pytest.approx(0.6 / 10)


def test_the_feature_cache_keeps_the_targets_rows(target, data, tmp_path, monkeypatch):
    computed = []
    real_both = feature_module.compute_features_and_targets
    real_plain = feature_module.compute_features

    def both(target, data, layer_ids, topk, **kw):
        computed.append(("rows", len(data.sequences)))
        return real_both(target, data, layer_ids, topk, **kw)

    def plain(target, data, layer_ids, **kw):
        computed.append(("plain", len(data.sequences)))
        return real_plain(target, data, layer_ids, **kw)

    monkeypatch.setattr(feature_module, "compute_features_and_targets", both)
    monkeypatch.setattr(feature_module, "compute_features", plain)
    path = tmp_path / "features.safetensors"
    spec = TopKSpec.make(8, DRAFT_IDS, VOCAB)
    first = TrainingData(data.sequences[:12], data.prompt_lengths[:12])

    def cached(d, topk=spec):
        return feature_module.cached_pass(target, d, LAYERS, path, False, topk)

    cached(first)
    feats, rows = cached(data)  # appended samples: only they are computed
    assert computed == [("rows", 12), ("rows", 28)]
    _, fresh = real_both(target, data, LAYERS, spec, progress=False)
    assert rows.counts == fresh.counts and len(rows) == 40
    assert torch.equal(rows.rows["ids"], fresh.rows["ids"])
    for name in ("probs", "rest", "outside"):
        torch.testing.assert_close(rows.rows[name], fresh.rows[name], rtol=1e-3, atol=1e-6)
    loaded = feature_module.load_targets(path)
    assert all(torch.equal(loaded.rows[n], rows.rows[n]) for n in rows.rows)
    assert cached(data)[1].counts == rows.counts and len(computed) == 2  # all cached now

    cached(data, TopKSpec.make(4, DRAFT_IDS, VOCAB))  # another k: computed afresh
    assert computed[-1] == ("rows", 40)
    # a cache made without the rows is never used for a loss that needs them
    feature_module.cached_pass(target, data, LAYERS, path, False)
    assert len(computed) == 3  # a run without rows uses the features of a cache with them
    path.unlink()
    feature_module.cached_pass(target, first, LAYERS, path, False)
    assert computed[-1] == ("plain", 12) and feature_module.load_targets(path) is None
    again, rows = cached(data)
    assert computed[-1] == ("rows", 40) and rows.counts == fresh.counts
    assert len(again) == 40
    # without rows wanted, a cache with them grows as features only (its rows are dropped)
    grown = TrainingData(data.sequences + data.sequences[:2], data.prompt_lengths * 2)
    grown.prompt_lengths = grown.prompt_lengths[:42]
    feature_module.cached_pass(target, grown, LAYERS, path, False)
    assert computed[-1] == ("plain", 2) and feature_module.load_targets(path) is None


def test_an_interrupted_feature_pass_resumes_after_its_last_saved_part(
    target, data, tmp_path, monkeypatch
):
    """The cache is saved after every part of PART_SAMPLES samples: a pass stopped in its third
    part keeps the first two, and the next call computes only the rest, to the same result."""
    monkeypatch.setattr(feature_module, "PART_SAMPLES", 16)
    real = feature_module.compute_features_and_targets
    calls = []

    def failing_third(target, d, layer_ids, topk, **kw):
        calls.append(len(d.sequences))
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(target, d, layer_ids, topk, **kw)

    monkeypatch.setattr(feature_module, "compute_features_and_targets", failing_third)
    path = tmp_path / "features.safetensors"
    spec = TopKSpec.make(8, DRAFT_IDS, VOCAB)
    with pytest.raises(KeyboardInterrupt):
        feature_module.cached_pass(target, data, LAYERS, path, False, spec)
    assert calls == [16, 16, 8] and len(feature_module.load_features(path)) == 32
    feats, rows = feature_module.cached_pass(target, data, LAYERS, path, False, spec)
    assert calls == [16, 16, 8, 8]  # only the last 8 samples again
    fresh_feats, fresh = real(target, data, LAYERS, spec, progress=False)
    assert len(feats) == 40 and rows.counts == fresh.counts
    for got, want in zip(feats, fresh_feats):
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-5)
    assert torch.equal(rows.rows["ids"], fresh.rows["ids"])


def test_resume_with_the_l1_loss_is_identical_and_checks_its_settings(target, data, tmp_path):
    cfg = dict(steps=10, save_every=4, eval_every=5, ce_weight=0.1, l1_weight=0.9)
    train_drafter(target, data, tmp_path / "straight", config(**cfg), resume=False, progress=False)
    resumed = tmp_path / "resumed"
    train_drafter(target, data, resumed, config(**cfg), progress=False, stop_after=6)
    for other, named in (
        (dict(cfg, l1_weight=0.5), "l1_weight: saved 0.9, now 0.5"),
        (dict(cfg, target_topk=16), "target_topk: saved 32, now 16"),
        (dict(cfg, l1_weight=0.0, target_topk=32), "l1_weight: saved 0.9, now 0.0"),
    ):
        with pytest.raises(ValueError, match=named):
            train_drafter(target, data, resumed, config(**other), progress=False)
    # the default top-k, given explicitly, is the same run
    train_drafter(target, data, resumed, config(**cfg, target_topk=32), progress=False)
    a = load_file(tmp_path / "straight" / "checkpoint" / "model.safetensors")
    b = load_file(resumed / "checkpoint" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    def log(run):
        lines = (run / "train_log.jsonl").read_text().splitlines()
        return [{k: v for k, v in json.loads(x).items() if k != "step_s"} for x in lines]

    assert log(tmp_path / "straight") == log(resumed) and len(log(resumed)) == 10
    assert "eval_accept_by_position" in log(resumed)[4]


def test_a_checkpoint_from_before_the_options_resumes_as_cross_entropy(target, data, tmp_path):
    train_drafter(
        target, data, tmp_path, config(steps=4, save_every=2), progress=False, stop_after=2
    )
    state_path = tmp_path / "checkpoint" / "trainer_state.json"
    state = json.loads(state_path.read_text())
    for name in ("ce_weight", "l1_weight", "lk_weight", "target_topk"):
        del state["config"][name]
    state_path.write_text(json.dumps(state))
    assert train_drafter(target, data, tmp_path, config(steps=4), progress=False)["step"] == 4


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--l1-weight", "-0.5"], "l1_weight (--l1-weight) must be a number >= 0, got -0.5"),
        (["--lk-weight", "nan"], "lk_weight (--lk-weight) must be a number >= 0, got nan"),
        (["--ce-weight", "0"], "the loss has no term"),
        (["--l1-weight", "0.9", "--target-topk", "0"], "the L1 and LK terms need the target"),
        (["--target-topk", "-2"], "target_topk (--target-topk) must be an integer >= 0"),
    ],
)
def test_loss_options_are_checked_before_any_work(capsys, tmp_path, extra, message):
    argv = ["train-drafter", "--output", str(tmp_path / "run"), "--target", str(tmp_path / "no")]
    assert main([*argv, *extra]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and not (tmp_path / "run").exists()


def test_loss_options_parse_into_the_config():
    from caddtree.cli import _build_parser
    from caddtree.cli.train import _train_config

    argv = ["train-drafter", "--output", "x", "--ce-weight", "0.1", "--l1-weight", "0.9"]
    config = _train_config(_build_parser().parse_args(argv))
    assert (config.ce_weight, config.l1_weight, config.lk_weight) == (0.1, 0.9, 0.0)
    assert config.target_topk is None and config.topk() == 32
    default = _train_config(_build_parser().parse_args(["train-drafter", "--output", "x"]))
    assert (default.ce_weight, default.l1_weight, default.lk_weight, default.topk()) == (
        1.0,
        0.0,
        0.0,
        0,
    )
    argv = ["train-drafter", "--output", "x", "--lk-weight", "1", "--target-topk", "64"]
    assert _train_config(_build_parser().parse_args(argv)).topk() == 64
    with pytest.raises(SystemExit):  # argparse's own error, naming the option and the value
        _build_parser().parse_args(["train-drafter", "--output", "x", "--l1-weight", "lots"])
