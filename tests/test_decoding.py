"""The decoding loop is lossless: every method reproduces plain greedy decoding token for token
(float64, tiny models), sampling keeps the target's distribution, and acceptance is never cut short.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from caddtree import ConstantCostModel, ConvexCostModel, InvalidInputError
from caddtree.core.cost import PiecewiseLinearCurve
from caddtree.core.sampling import Sampler
from caddtree.engine.decoding import Proposer, decode, make_policy
from caddtree.models import DFlashProposer, TreeVerifier
from oracle import OracleProposer, decode_with
from sampling_checks import (
    assert_first_token_marginals,
    ddtree_first_tokens,
    hf_generate,
    sharp_qwen3,
)
from tiny_models import FEATURE_LAYER_IDS, MAX_POSITIONS, VOCAB, llama_target, new_drafter

PROMPTS = [[5, 17, 3, 44, 8], [70, 2, 2, 9, 31, 12, 60, 1, 0, 33], [11]]


def cost_models():
    flat = ConvexCostModel(
        {0: PiecewiseLinearCurve([0, 8, 64], [0.01, 0.01, 0.05])}, draft_cost=0.004
    )
    steep = ConvexCostModel(
        {0: PiecewiseLinearCurve([0, 1, 64], [0.01, 0.012, 0.5])}, draft_cost=0.02
    )
    return [flat, steep, ConstantCostModel({0: 0.01}, draft_cost=0.01)]


POLICIES = [
    ("ar", {}),
    ("dflash", {}),
    ("ddtree", {"budget": 1}),
    ("ddtree", {"budget": 4}),
    ("ddtree", {"budget": 16}),
    ("ddtree", {"budget": 64}),
    *[("caddtree", {"cost_model": m, "max_budget": 48}) for m in cost_models()],
    # copies from the context: alone, and merged into the drafter's trees
    ("lookup", {}),
    ("ddtree", {"budget": 4, "lookup": True}),
    *[("caddtree", {"cost_model": m, "max_budget": 48, "lookup": True}) for m in cost_models()],
]


def run(model, prompt, method, kwargs, proposer, max_new_tokens, stops=(), **options):
    """Decode with :func:`decode_with`; ``stops`` are stop token ids."""
    return decode_with(
        model, prompt, method, kwargs, proposer, max_new_tokens, stop_token_ids=stops, **options
    )


@pytest.mark.parametrize("drafter_kind", ["dflash", "noisy-oracle", "oracle"])
@pytest.mark.parametrize("prompt", PROMPTS, ids=["p5", "p10", "p1"])
def test_greedy_equals_ar_for_every_method(qwen3, drafter, prompt, drafter_kind, verifier_type):
    n_new = 30
    reference = hf_generate(qwen3, prompt, n_new, do_sample=False)
    assert len(reference) == n_new
    for method, kwargs in POLICIES:
        if drafter_kind == "dflash":
            proposer = DFlashProposer(drafter, qwen3)
        else:
            proposer = OracleProposer(
                qwen3, prompt, mode="noisy" if "noisy" in drafter_kind else "onehot"
            )
        result = run(qwen3, prompt, method, kwargs, proposer, n_new, verifier_type=verifier_type)
        assert result.token_ids == reference, (method, kwargs)
        stats = result.stats
        assert stats.new_tokens == n_new and stats.stop_reason == "max_new_tokens"
        assert sum(r.committed for r in stats.per_round) + 1 == n_new
        if method == "ar":
            assert stats.tau == 1.0 and stats.budget_mean == 0.0
        if drafter_kind == "oracle" and method in ("dflash", "ddtree"):
            # the oracle's drafts are always right: every round accepts the whole chain it drafted
            depth = min(kwargs.get("budget", 5), 5)
            assert [r.accepted for r in stats.per_round[:-1]] == [depth] * (stats.rounds - 1)


def test_greedy_equals_ar_on_llama(verifier_type):
    model = llama_target()
    drafter = new_drafter(model, seed=5)
    for prompt in PROMPTS[:2]:
        reference = hf_generate(model, prompt, 25, do_sample=False)
        for method, kwargs in POLICIES:
            proposer = DFlashProposer(drafter, model) if method != "ar" else None
            result = run(model, prompt, method, kwargs, proposer, 25, verifier_type=verifier_type)
            assert result.token_ids == reference


def test_stop_token_in_the_middle_of_a_tree(qwen3, verifier_type):
    prompt = PROMPTS[0]
    free = hf_generate(qwen3, prompt, 30, do_sample=False)
    # a stop token that first appears well inside the output, so it lands inside an accepted path
    position = next(i for i in range(6, 30) if free[i] not in free[:i])
    stop = free[position]
    reference = hf_generate(qwen3, prompt, 30, do_sample=False, eos_token_id=stop)
    assert reference == free[: position + 1]
    cut_inside_tree = []
    for method, kwargs in POLICIES:
        proposer = OracleProposer(qwen3, prompt) if method != "ar" else None
        result = run(
            qwen3, prompt, method, kwargs, proposer, 30, stops={stop}, verifier_type=verifier_type
        )
        assert result.token_ids == reference, (method, kwargs)
        assert result.stats.stop_reason == "stop_token"
        last = result.stats.per_round[-1]
        cut_inside_tree.append(last.accepted + 1 > last.committed)
    # for some methods the oracle drafted past the stop token: it was hit inside an accepted path
    assert any(cut_inside_tree)


@pytest.mark.parametrize("max_new_tokens", [1, 2, 3, 6, 7, 13])
def test_max_new_tokens_boundary(qwen3, max_new_tokens, verifier_type):
    prompt = PROMPTS[1]
    reference = hf_generate(qwen3, prompt, max_new_tokens, do_sample=False)
    for method, kwargs in POLICIES:
        proposer = OracleProposer(qwen3, prompt) if method != "ar" else None
        trees = []
        result = run(
            qwen3,
            prompt,
            method,
            kwargs,
            proposer,
            max_new_tokens,
            trees=trees,
            verifier_type=verifier_type,
        )
        assert result.token_ids == reference, (method, kwargs)
        # never drafts a node that could not be committed: a round that starts with `produced`
        # tokens out (the prefill's token included) commits at most max_new_tokens - produced,
        # so its tree holds nodes at most max_new_tokens - produced - 1 deep
        produced = 1
        for tree, r in trees:
            deepest = int(tree.depths.max()) if len(tree) else 0
            assert deepest <= max_new_tokens - produced - 1, (method, kwargs, produced)
            produced += r.committed
        assert produced == len(reference)
        if method not in ("ar", "lookup") and max_new_tokens >= 7:
            # the check has teeth: somewhere a tree was cut short by the limit, not by the policy
            assert any(len(t) for t, _ in trees)


def test_acceptance_is_not_cut_short(qwen3, verifier_type):
    """A drafter whose drafts are always right reaches the maximum acceptance length B."""
    prompt = PROMPTS[0]
    block = 6
    n_new = 1 + 4 * block  # the prefill token, then four full rounds
    for method, kwargs in [
        ("dflash", {}),
        ("ddtree", {"budget": 8}),
        # (the gate off: every round drafts, where the gate would weigh the tiny models' times)
        *[("caddtree", {"cost_model": m, "gate": False}) for m in cost_models()[:1]],
    ]:
        proposer = OracleProposer(qwen3, prompt, block)
        result = run(qwen3, prompt, method, kwargs, proposer, n_new, verifier_type=verifier_type)
        assert result.token_ids == hf_generate(qwen3, prompt, n_new, do_sample=False)
        assert [r.accepted for r in result.stats.per_round] == [block - 1] * 4
        assert result.stats.tau == block


@pytest.mark.parametrize(
    ("policy", "prompt", "least"),
    [
        (("ddtree", {}), [5, 17, 3], 300),
        # a prompt whose likely continuation (13, 24) the context already holds after 5 17 3
        (("lookup", {}), [5, 17, 3, 13, 24, 13, 5, 17, 3], 300),
        (("ddtree", {"lookup": True}), [5, 17, 3, 13, 24, 13, 5, 17, 3], 300),
    ],
    ids=["ddtree", "lookup", "ddtree-lookup"],
)
def test_sampling_is_lossless(verifier_type, policy, prompt, least):
    """At temperature 1 the first three generated tokens are distributed as the target's.

    The first token comes from the prefill; the second and third come from walking a DDTree built
    from the target's own marginals (copies from the context merged in, or copies alone), so many
    samples are accepted deep in the tree. Each token's marginal is compared with the exact one by
    a chi-square test at alpha = 1e-3 (three tests: a false-failure rate below 0.3% for a random
    seed; the seed is fixed, so the outcome is too).
    """
    # random tiny models predict nearly the same distribution in every context; a sharper lm_head
    # makes the target's choices depend on the context, so sampling from a wrong row would show.
    qwen3 = sharp_qwen3()
    n = 1200
    counts, accepted = ddtree_first_tokens(qwen3, prompt, n, verifier_type, 1000, policy)
    assert accepted > least  # the tree walk is really exercised

    with torch.no_grad():
        p1 = torch.softmax(qwen3(torch.tensor([prompt])).logits[0, -1], -1)
        seqs = torch.tensor([[*prompt, a] for a in range(VOCAB)])
        p2_given = torch.softmax(qwen3(seqs).logits[:, -1], -1)  # [a, b]
        seqs3 = torch.tensor([[*prompt, a, b] for a in range(VOCAB) for b in range(VOCAB)])
        p3_given = torch.cat(
            [torch.softmax(qwen3(chunk).logits[:, -1], -1) for chunk in seqs3.split(2048)]
        )
    p2 = p1 @ p2_given
    p3 = (p1[:, None] * p2_given).reshape(-1) @ p3_given
    assert_first_token_marginals(counts, [p1, p2, p3])


def test_sampler_top_p_keeps_the_nucleus():
    sampler = Sampler(1.0, top_p=0.6, seed=0)
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=torch.float64))
    probs = sampler.probabilities(logits)  # float32, as transformers computes them
    assert probs.dtype == torch.float32
    np.testing.assert_allclose(probs.numpy(), [0.625, 0.375, 0.0, 0.0], rtol=1e-6)
    assert {sampler.choose(logits) for _ in range(200)} == {0, 1}


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"method": "beam"}, "unknown method"),
        ({"method": "ddtree"}, "needs a node budget"),
        ({"method": "ddtree", "budget": 0}, "positive integer"),
        ({"method": "dflash", "budget": 8}, "only applies"),
        ({"method": "caddtree"}, "needs a cost model"),
        ({"method": "dflash", "lookup": True}, "lookup adds copies .* not of 'dflash'"),
        ({"method": "ar", "lookup": True}, "method 'lookup' for copies alone"),
        ({"method": "lookup", "budget": 4}, "only applies"),
    ],
)
def test_policy_errors(kwargs, message):
    with pytest.raises(InvalidInputError, match=message):
        make_policy(**kwargs)


def test_decode_errors(qwen3, drafter):
    verifier = TreeVerifier(qwen3, FEATURE_LAYER_IDS)
    for bad in (0, -3):
        with pytest.raises(InvalidInputError, match="max_new_tokens"):
            decode(verifier, [1, 2], make_policy("ar"), max_new_tokens=bad)
    with pytest.raises(InvalidInputError, match="shorten the prompt"):
        decode(verifier, list(range(MAX_POSITIONS + 1)), make_policy("ar"), max_new_tokens=1)
    with pytest.raises(InvalidInputError, match="lower max_new_tokens"):
        decode(verifier, [1, 2, 3], make_policy("ar"), max_new_tokens=MAX_POSITIONS)
    with pytest.raises(InvalidInputError, match="needs a drafter"):
        decode(verifier, [1, 2, 3], make_policy("dflash"), max_new_tokens=4)
    with pytest.raises(InvalidInputError, match="temperature"):
        Sampler(-1.0)


def test_rounds_with_an_empty_caddtree_still_record_the_drafters_confidence(qwen3, drafter):
    """A round where the cost rule keeps no node (n = 0) had a draft: its confidence (position
    1's largest probability) is recorded, not NaN, so Fig. 1's analysis keeps those rounds."""
    # the first node costs more than it can ever return, so every tree is empty
    prohibitive = ConvexCostModel(
        {0: PiecewiseLinearCurve([0, 1, 64], [0.01, 10.0, 700.0])}, draft_cost=0.01
    )
    prompt = PROMPTS[0]
    result = run(
        qwen3,
        prompt,
        "caddtree",
        {"cost_model": prohibitive, "max_budget": 16},
        DFlashProposer(drafter, qwen3),
        8,
    )
    rounds = result.stats.per_round
    assert rounds and all(r.budget == 0 for r in rounds)
    assert result.token_ids == hf_generate(qwen3, prompt, 8, do_sample=False)
    # the same drafter, with a tree: node 0's probability is the confidence of the same round
    first_with_tree = run(
        qwen3, prompt, "ddtree", {"budget": 4}, DFlashProposer(drafter, qwen3), 8
    ).stats.per_round[0]
    assert 0 < rounds[0].confidence <= 1
    assert rounds[0].confidence == pytest.approx(first_with_tree.confidence, rel=1e-9)
    produced = 1  # a round drafts only while two or more tokens are still to come
    for r in rounds:
        drafted = 8 - produced - 1 > 0
        assert (0 < r.confidence <= 1) if drafted else math.isnan(r.confidence), produced
        produced += r.committed


def test_the_dflash_proposer_and_the_oracle_are_proposers(qwen3, drafter):
    assert isinstance(DFlashProposer(drafter, qwen3), Proposer)
    assert isinstance(OracleProposer(qwen3, PROMPTS[0]), Proposer)
    assert not isinstance(object(), Proposer)


def test_a_raised_context_window_lets_generation_run_past_the_models_window(caplog):
    """The window (max_position_embeddings) refuses a generation that would pass it, naming the
    way out; a raised context_window lets it run (with a warning), still equal to plain decoding
    past the trained positions, and with the cache written in place (caddtree.models.kvcache)."""
    from caddtree.api import SpeculativeGenerator

    target = llama_target()
    gen = SpeculativeGenerator(target, None, new_drafter(target))
    prompt = [3, 9, 27, 14, 5]
    tokens = MAX_POSITIONS + 20 - len(prompt)
    with pytest.raises(InvalidInputError, match="--context-window"):
        gen.generate(prompt, "ddtree", budget=8, max_new_tokens=tokens)
    with caplog.at_level("WARNING", logger="caddtree.api"):
        gen.set_context_window(MAX_POSITIONS + 20)
    assert f"past the {MAX_POSITIONS} positions this model was trained for" in caplog.text
    ar = gen.generate(prompt, "ar", max_new_tokens=tokens, stop_token_ids=())
    dd = gen.generate(prompt, "ddtree", budget=8, max_new_tokens=tokens, stop_token_ids=())
    assert len(ar.token_ids) == tokens and dd.token_ids == ar.token_ids
    for bad in (0, 1, 2.5, "64"):
        with pytest.raises(InvalidInputError, match="context_window"):
            gen.set_context_window(bad)


def test_copies_from_the_context_are_accepted_and_counted(qwen3, drafter):
    """On an output that repeats itself, copied nodes are accepted (lookup alone, and merged into
    CaDDTree's trees), and the statistics count them within the accepted tokens."""
    prompt = PROMPTS[0]
    reference = hf_generate(qwen3, prompt, 40, do_sample=False)
    for method, kwargs in [("lookup", {}), ("caddtree", {"cost_model": cost_models()[0]})]:
        result = run(
            qwen3, prompt, method, {**kwargs, "lookup": True}, DFlashProposer(drafter, qwen3), 40
        )
        stats = result.stats
        assert result.token_ids == reference
        assert 0 < stats.copied_accepted_tokens <= stats.accepted_tokens
        assert stats.copied_accepted_tokens <= stats.copied_tokens
        total = sum(r.committed for r in stats.per_round)
        assert stats.copied_share == pytest.approx(stats.copied_accepted_tokens / total)
        assert all(r.copied_accepted <= min(r.accepted, r.copied) for r in stats.per_round)
        if method == "lookup":
            assert stats.tau > 1 and stats.accepted_tokens == stats.copied_accepted_tokens
        else:  # the random drafter helps little: the gate leaves it out of some rounds only
            alone = [math.isnan(r.confidence) and not r.projected for r in stats.per_round]
            assert any(alone) and not all(alone)


def test_rounds_without_the_drafter_hand_it_their_features_later(qwen3, drafter):
    """Where the gate leaves the drafter out, the features of those rounds' tokens wait: each
    pass extends the drafter's context exactly to the target's."""
    from caddtree.models import TreeVerifier
    from tiny_models import FEATURE_LAYER_IDS

    verifier = TreeVerifier(qwen3, FEATURE_LAYER_IDS)
    proposer = DFlashProposer(drafter, qwen3)
    real, seen = proposer.propose, []

    def propose(bonus, features):
        seen.append(proposer.context_length + features.shape[1] == verifier.context_length)
        return real(bonus, features)

    proposer.propose = propose
    policy = make_policy("caddtree", cost_model=cost_models()[0], lookup=True)
    result = decode(verifier, PROMPTS[0], policy, proposer=proposer, max_new_tokens=50)
    assert result.token_ids == hf_generate(qwen3, PROMPTS[0], 50, do_sample=False)
    assert seen and all(seen) and len(seen) < result.stats.rounds  # some rounds skipped it


def test_the_draft_gate_skips_drafting_only_where_copies_promise_more_and_explores():
    from caddtree.engine.policies import DraftGate

    gate = DraftGate()  # a batch's: drafted rounds by their modelled cost
    assert not gate.skip(1e9)  # nothing measured yet: draft
    for _ in range(DraftGate.WARM - 1):
        gate.observe(3, 0.01)  # drafting delivers 300 tokens a second
        assert not gate.skip(1e9)  # too few drafted rounds measured yet
    gate.observe(3, 0.01)
    assert not gate.skip(299.0) and gate.skip(301.0)
    assert not gate.skip(0.0)  # a round that drafts ends the run of skipped ones

    def run_of(choice: bool, theta: float) -> int:
        n = 0
        while gate.skip(theta) == choice:
            n += 1
        return n

    # after `interval` rounds in a row without the drafter, one drafts to measure it again; where
    # the copies still win after it, the interval doubles, up to MAX_EXPLORE
    runs = [run_of(True, 1e9) for _ in range(5)]
    assert runs == [8, 16, 32, 64, 64] and DraftGate.EXPLORE == 8 and DraftGate.MAX_EXPLORE == 64
    gate.observe(30, 0.01)  # the exploring round delivered a lot: drafting wins again
    assert not gate.skip(1000.0) and gate.interval == DraftGate.EXPLORE
    # a batch's gate never leaves the drafter out to explore: such a round would go unmeasured
    assert all(not gate.skip(1000.0) for _ in range(3 * DraftGate.MAX_EXPLORE))


@pytest.mark.parametrize("lookup", [False, True])
def test_caddtree_with_the_gate_equals_plain_decoding(
    qwen3, drafter, verifier_type, lookup, monkeypatch
):
    """Rounds with and without the drafter mixed (the gate's choices forced to alternate after
    its warm-up): the drafter reads the features of the rounds it skipped, and the output is
    plain decoding's."""
    from caddtree.engine.policies import DraftGate

    calls = []

    def alternate(self, theta):
        calls.append(theta)
        return len(self.drafted) >= DraftGate.WARM and len(calls) % 2 == 0

    monkeypatch.setattr(DraftGate, "skip", alternate)
    for prompt in PROMPTS:
        reference = hf_generate(qwen3, prompt, 30, do_sample=False)
        kwargs = {"cost_model": cost_models()[0], "gate": True, "lookup": lookup}
        proposer = DFlashProposer(drafter, qwen3)
        result = run(qwen3, prompt, "caddtree", kwargs, proposer, 30, verifier_type=verifier_type)
        assert result.token_ids == reference
        drafted = sum(r.draft_s > 0 for r in result.stats.per_round)
        assert 0 < drafted < result.stats.rounds


def test_the_gate_belongs_to_caddtree():
    with pytest.raises(InvalidInputError, match="CaDDTree"):
        make_policy("ddtree", budget=8, gate=True)
    assert make_policy("caddtree", cost_model=cost_models()[0]).gate is False
    assert make_policy("caddtree", cost_model=cost_models()[0], lookup=True).gate is True


def test_a_measured_gate_weighs_both_choices_in_wall_time():
    """One request decoding alone: the model says plain rounds deliver 200 tokens a second and
    drafted ones deliver 3 tokens in 10 ms (300/s), not clearly more; measured, plain rounds take
    a quarter of the modelled time (800/s): the gate leaves the drafter out. Where plain rounds
    take their modelled time it drafts, and where drafting is clearly ahead (DOUBT times the
    model's plain rounds) no plain round is spent measuring them."""
    from caddtree.engine.policies import DraftGate

    def choices(theta: float, measured_plain: float, rounds: int) -> list[bool]:
        gate, out = DraftGate(measured=True), []
        for _ in range(rounds):
            skip = gate.skip(theta)
            out.append(skip)
            if skip:
                gate.observe_plain(1 / theta, measured_plain)
            else:
                gate.observe(3, 0.01)
        return out

    warm, after = DraftGate.WARM, 2 * DraftGate.WARM
    fast = choices(200.0, 0.25 / 200, after + 4)
    assert fast[:after] == [False] * warm + [True] * warm and all(fast[after:])
    # plain rounds as slow as modelled: drafting wins, and after `interval` drafted rounds in a
    # row one round leaves the drafter out again (drafting is not DOUBT times ahead)
    explore = DraftGate.EXPLORE
    slow = [False] * warm + [True] * warm + [False] * explore + [True] + [False] * 4
    assert choices(200.0, 1 / 200, len(slow)) == slow
    assert DraftGate.DOUBT * 100.0 <= 300.0
    assert not any(choices(100.0, 0.25 / 100, after + DraftGate.EXPLORE + 4))
