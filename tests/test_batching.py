"""Several requests decoded together (caddtree.engine.batching): each one's output is its own.

Float64 tiny models: with requests of every method joining and leaving between rounds, at batch
sizes 1 to 4, every greedy output equals plain greedy decoding token for token, a stop token ends
a request where it ends alone, and a sampled request draws the same tokens in a batch as alone.
"""

from __future__ import annotations

from collections import deque

import numpy as np
import pytest
import torch

from caddtree import ConvexCostModel, InvalidInputError
from caddtree.core.cost import PiecewiseLinearCurve
from caddtree.core.sampling import Sampler
from caddtree.core.tree import DraftTree
from caddtree.engine import joint_budget
from caddtree.engine.batching import BatchDecoder, GenerationRequest
from caddtree.engine.decoding import make_policy
from caddtree.runtime.lean import LeanTarget
from sampling_checks import hf_generate
from tiny_models import FEATURE_LAYER_IDS

COST = ConvexCostModel({0: PiecewiseLinearCurve([0, 8, 64], [0.01, 0.012, 0.05])}, 0.004)
POLICIES = [
    ("ar", {}),
    ("dflash", {}),
    ("ddtree", {"budget": 4}),
    ("caddtree", {"cost_model": COST, "max_budget": 24}),
    ("ddtree", {"budget": 16}),
]
PROMPTS = [[5, 17, 3, 44, 8], [70, 2, 2, 9, 31, 12, 60, 1, 0, 33], [11], [40, 41, 42], [7, 7]]


def decoder(qwen3, drafter, max_batch: int) -> BatchDecoder:
    return BatchDecoder(
        LeanTarget(qwen3, FEATURE_LAYER_IDS), drafter, max_batch=max_batch, capacity=64
    )


def requests(lengths: list[int]) -> list[GenerationRequest]:
    return [
        GenerationRequest(prompt, make_policy(method, **kwargs), n)
        for prompt, (method, kwargs), n in zip(PROMPTS, POLICIES, lengths)
    ]


@pytest.mark.parametrize("max_batch", [1, 2, 3, 4])
def test_every_request_is_plain_greedy_decoding_whatever_the_batch(qwen3, drafter, max_batch):
    lengths = [14, 22, 9, 30, 17]  # they finish at different rounds, and later ones join then
    done = decoder(qwen3, drafter, max_batch).run(requests(lengths))
    assert len(done) == len(PROMPTS)
    for request in done:
        reference = hf_generate(qwen3, list(request.prompt_ids), request.max_new_tokens)
        assert request.output == reference, request.policy.name
        assert request.stop_reason == "max_new_tokens"
    drafted = [r for r in done if r.policy.needs_drafter]
    assert sum(r.accepted for r in drafted) > 0  # trees were really verified in the batch


def test_requests_join_and_leave_between_rounds(qwen3, drafter):
    batch = decoder(qwen3, drafter, 3)
    first, second, third = requests([6, 20, 12])[:3]
    batch.add(first)
    batch.add(second)
    finished = []
    while first.stop_reason is None:
        finished += batch.step()
    assert first in finished and batch.running == [second]
    batch.add(third)  # joins a batch whose other request is mid-generation
    while batch.running:
        finished += batch.step()
    for request in (first, second, third):
        assert request.output == hf_generate(
            qwen3, list(request.prompt_ids), request.max_new_tokens
        )


def test_a_stop_token_ends_a_request_where_it_ends_alone(qwen3, drafter):
    prompt = PROMPTS[0]
    free = hf_generate(qwen3, prompt, 30)
    position = next(i for i in range(6, 30) if free[i] not in free[:i])
    stop = free[position]
    ddtree = make_policy("ddtree", budget=8)
    stopping = GenerationRequest(prompt, ddtree, 30, stop_token_ids=frozenset({stop}))
    other = GenerationRequest(PROMPTS[1], ddtree, 30)
    decoder(qwen3, drafter, 2).run([stopping, other])
    assert stopping.output == free[: position + 1] and stopping.stop_reason == "stop_token"
    assert other.output == hf_generate(qwen3, PROMPTS[1], 30)


@pytest.mark.parametrize("lookup", [False, True])
def test_a_sampled_request_draws_the_same_tokens_in_a_batch_as_alone(qwen3, drafter, lookup):
    """Whatever its trees (copies' estimates pooled with other requests' differ from alone)."""

    def sampled(seed: int) -> GenerationRequest:
        policy = make_policy("ddtree", budget=6, lookup=lookup)
        return GenerationRequest(PROMPTS[1], policy, 24, sampler=Sampler(1.0, seed=seed))

    alone = decoder(qwen3, drafter, 1).run([sampled(3)])[0].output
    crowd = requests([10, 18, 7, 25])
    together = decoder(qwen3, drafter, 4).run([crowd[0], sampled(3), *crowd[1:]])
    (mine,) = [r for r in together if r.sampler.do_sample]
    assert mine.output == alone
    assert len(set(alone)) > 1


def test_each_request_drafts_as_deep_as_its_tree_can_reach(qwen3, drafter):
    """A drafter pass gives each request a block of ``1 + d`` positions, ``d`` the deepest its
    next tree can go: its budget (DDTree, CaDDTree's max_budget), the tokens it still needs, and
    the drafter's block; a DFlash chain reads the whole block."""
    batch = decoder(qwen3, drafter, 5)
    seen = []
    propose = batch.proposer.propose

    def spy(calls, sizes):
        by_slot = {r.slot: r.request for r in batch._running}
        for call, size in zip(calls, sizes):
            request = by_slot[call.slot]
            left = request.max_new_tokens - len(request.output) - 1
            seen.append((request.policy.reach, left, size))
        return propose(calls, sizes)

    batch.proposer.propose = spy
    done = batch.run(requests([8, 20, 9, 30, 17]))
    block = drafter.block_size
    assert {reach for reach, _, _ in seen} == {None, 4, 24, 16}
    for reach, left, size in seen:
        assert size == min(block, 1 + min(left, block if reach is None else reach))
    assert any(size < block for _, _, size in seen)
    for request in done:
        assert request.output == hf_generate(
            qwen3, list(request.prompt_ids), request.max_new_tokens
        )


def test_bad_requests_are_refused(qwen3, drafter):
    batch = decoder(qwen3, None, 1)
    with pytest.raises(InvalidInputError, match="needs a drafter"):
        batch.add(GenerationRequest([1, 2], make_policy("dflash"), 4))
    with pytest.raises(InvalidInputError, match="more than the 64"):
        batch.add(GenerationRequest([1] * 40, make_policy("ar"), 40))
    with pytest.raises(InvalidInputError, match="empty"):
        batch.add(GenerationRequest([], make_policy("ar"), 4))
    batch.add(GenerationRequest([1, 2], make_policy("ar"), 4))
    with pytest.raises(InvalidInputError, match="full"):
        batch.add(GenerationRequest([3], make_policy("ar"), 4))


@pytest.mark.parametrize("lookup", [False, True], ids=["drafts", "drafts-and-copies"])
@pytest.mark.parametrize("max_batch", [2, 4])
def test_the_joint_budget_keeps_every_request_lossless(qwen3, drafter, max_batch, lookup):
    """CaDDTree requests whose trees come from one joint budget (with copies from each one's
    context too, or not): still plain greedy decoding. A request left alone (the batch draining)
    builds its own CaDDTree tree."""
    target = LeanTarget(qwen3, FEATURE_LAYER_IDS)
    batch = BatchDecoder(
        target, drafter, max_batch=max_batch, capacity=64, joint_cost_model=COST, joint_max_nodes=24
    )
    caddtree = make_policy("caddtree", cost_model=COST, max_budget=24, lookup=lookup)
    lengths = [14, 22, 9, 44, 12]
    todo = [GenerationRequest(p, caddtree, n) for p, n in zip(PROMPTS, lengths)]
    seen, rounds = [], []
    original, step = batch.joint.trees, batch.step

    def spy(drafts, lengths, tries=()):
        trees = original(drafts, lengths, tries)
        seen.append((len(batch.running), trees))
        return trees

    batch.joint.trees = spy
    batch.step = lambda: rounds.append(len(batch.running)) or step()
    done = batch.run(todo)
    for request in done:
        reference = hf_generate(qwen3, list(request.prompt_ids), request.max_new_tokens)
        assert request.output == reference
    assert set(rounds) == set(range(1, max_batch + 1))
    assert {running for running, _ in seen} == set(range(2, max_batch + 1))  # joint: 2 or more
    # the joint trees were verified
    assert any(sum(len(t) for t in trees) > 0 for _, trees in seen)
    copied = sum(s.copied_accepted for r in done for s in r.round_stats)
    assert (copied > 0) == lookup  # copies were accepted in joint rounds where they were asked


@pytest.mark.parametrize("max_batch", [1, 3])
def test_requests_with_copies_from_their_context_are_plain_greedy_decoding(
    qwen3, drafter, max_batch
):
    """Lookup alone, and copies merged into DDTree's and CaDDTree's trees, in a batch that
    requests join and leave: each request is still plain greedy decoding, with its own index."""
    policies = [
        make_policy("lookup"),
        make_policy("ddtree", budget=6, lookup=True),
        make_policy("caddtree", cost_model=COST, max_budget=24, lookup=True),
        make_policy("ar"),
        make_policy("lookup"),
    ]
    lengths = [24, 30, 19, 12, 27]
    todo = [GenerationRequest(p, q, n) for p, q, n in zip(PROMPTS, policies, lengths)]
    batch = decoder(qwen3, drafter, max_batch)
    drafted, propose = [], batch.proposer.propose

    def spy(calls, sizes):  # which requests each drafter pass drafted for
        by_slot = {r.slot: r.request for r in batch._running}
        drafted.append({id(by_slot[c.slot]) for c in calls})
        return propose(calls, sizes)

    batch.proposer.propose = spy
    done = batch.run(todo)
    for request in done:
        reference = hf_generate(qwen3, list(request.prompt_ids), request.max_new_tokens)
        assert request.output == reference, request.policy.name
    copied = [sum(s.copied_accepted for s in r.round_stats) for r in done if r.policy.lookup]
    assert sum(copied) > 0
    # the CaDDTree request's draft gate left the drafter out of some of its rounds, not all
    (cadd,) = [r for r in done if r.policy.name == "caddtree"]
    passes = sum(id(cadd) in slots for slots in drafted)
    assert 0 < passes < cadd.rounds


def joint_decoder(target, drafter, max_batch):
    """A batch decoder with a joint CaDDTree budget over trees of up to 24 nodes in all."""
    return BatchDecoder(
        LeanTarget(target, FEATURE_LAYER_IDS),
        drafter,
        max_batch=max_batch,
        capacity=80,
        joint_cost_model=COST,
        joint_max_nodes=24,
    )


@pytest.mark.parametrize("draft_cost", [0.0, 1.0])
def test_a_joint_batch_skips_drafting_where_it_cannot_pay(qwen3, drafter, draft_cost, monkeypatch):
    """Where a drafter pass costs more than any tree can win back, joint rounds decode plainly
    without drafting (for a few rounds, then try again); the drafter still receives every
    committed token's features when it drafts again, so outputs stay plain greedy decoding.
    Without the margin drafting must win by, a free drafter pass is never skipped (a round with
    no nodes ties with plain decoding)."""
    monkeypatch.setattr(joint_budget, "_DRAFT_MARGIN", 1.0)
    batch = joint_decoder(qwen3, drafter, 3)
    batch.joint._draft_cost = lambda sequences, rows: draft_cost  # the timed cost, made exact
    batch.joint._misses.remember = lambda *measured: None  # and nothing measured beside it
    passes = []
    propose = batch.proposer.propose
    batch.proposer.propose = lambda calls, q=None: passes.append(len(calls)) or propose(calls, q)
    caddtree = make_policy("caddtree", cost_model=COST, max_budget=24)
    done = batch.run([GenerationRequest(p, caddtree, 40) for p in PROMPTS[:3]])
    for request in done:
        assert request.output == hf_generate(qwen3, list(request.prompt_ids), 40)
    rounds = max(r.rounds for r in done)
    if draft_cost == 0.0:  # every round drafts but a last one with one token left
        assert len(passes) >= rounds - 1
    else:
        assert len(passes) <= rounds // (joint_budget._SKIP_ROUNDS + 1) + 1


def test_a_joint_batch_calibrates_and_drafts_as_deep_as_its_trees_went(qwen3, drafter):
    """The joint budget weighs the drafter's prefix mass by the acceptance its verified trees
    showed (``calibration``: accepted nodes over prefix mass, with a prior of 4 at face value),
    and drafts a margin past the deepest node of its recent rounds."""
    batch = joint_decoder(qwen3, drafter, 3)
    assert batch.calibration == 1.0 and batch.joint.reach() is None
    sizes = []
    propose = batch.proposer.propose
    batch.proposer.propose = lambda calls, q: (
        sizes.append((batch.joint.reach(), q)) or propose(calls, q)
    )
    caddtree = make_policy("caddtree", cost_model=COST, max_budget=24)
    done = batch.run([GenerationRequest(p, caddtree, 30) for p in PROMPTS[:3]])
    for request in done:
        assert request.output == hf_generate(qwen3, list(request.prompt_ids), 30)
    trees = [s for r in done for s in r.round_stats if s.budget]
    mass, accepted = sum(s.phi for s in trees), sum(s.accepted for s in trees)
    assert 0 < len(trees) <= joint_budget._CALIBRATION_TREES
    assert batch.calibration == pytest.approx((accepted + 4.0) / (mass + 4.0))
    assert len(sizes) > 1 and sizes[0][0] is None  # the first pass drafts whole blocks
    for reach, q in sizes[1:]:
        assert reach is not None and all(size <= reach + 1 for size in q)
    deepest = max(batch.joint._depths)
    assert batch.joint.reach() == deepest + joint_budget._DEPTH_MARGIN


def test_outside_joint_rounds_a_caddtree_request_drafts_as_deep_as_it_can(qwen3, drafter):
    """The joint rounds' depth only bounds joint rounds: with a DDTree request in the batch the
    trees are each request's own, and a CaDDTree request drafts as deep as its own budget."""
    batch = joint_decoder(qwen3, drafter, 3)
    caddtree = make_policy("caddtree", cost_model=COST, max_budget=24)
    for prompt in PROMPTS[:2]:
        batch.add(GenerationRequest(prompt, caddtree, 60))
    for _ in range(3):
        batch.step()
    assert all(len(r.output) < 60 - drafter.block_size for r in batch.running)
    assert batch.joint.reach() is not None and batch.joint.reach() + 1 < drafter.block_size
    batch.add(GenerationRequest(PROMPTS[2], make_policy("ddtree", budget=4), 20))
    seen = []
    propose = batch.proposer.propose
    batch.proposer.propose = lambda calls, q: seen.extend(q) or propose(calls, q)
    batch.step()
    assert seen == [drafter.block_size, drafter.block_size, 5]


def test_what_the_cost_model_leaves_out_is_measured():
    """The seconds a joint round takes beyond its modelled cost: a plain round's, and per
    drafting request what a drafting round takes beyond that; medians, 0 before three."""
    misses = joint_budget._CostMisses()
    misses.remember(0.010, 0, 0.012)
    assert misses.plain_s == 0.0 and misses.per_draft_s == 0.0
    for seconds in (0.011, 0.013):
        misses.remember(0.010, 0, seconds)
    assert misses.plain_s == pytest.approx(0.002)
    for seconds in (0.030, 0.026, 0.034):  # 4 requests drafting, modelled at 0.020 s
        misses.remember(0.020, 4, seconds)
    assert misses.per_draft_s == pytest.approx((0.030 - 0.020 - 0.002) / 4)
    for _ in range(40):  # a model that overprices drafting: never a negative overhead
        misses.remember(0.050, 4, 0.030)
    assert misses.per_draft_s == 0.0


def test_measured_rates_decide_whether_a_joint_batch_drafts(qwen3, drafter):
    """Once joint rounds that drafted and rounds that did not have both been timed at a batch
    size, the faster kind wins (drafting by a margin), whatever the cost model's surrogate
    says; before, the surrogate decides. Rounds are timed by the decoder itself."""
    batch = joint_decoder(qwen3, drafter, 2)
    caddtree = make_policy("caddtree", cost_model=COST, max_budget=24)
    for prompt in PROMPTS[:2]:
        batch.add(GenerationRequest(prompt, caddtree, 30))
    batch.step()
    assert sum(len(kept) for kept in batch.joint._rates.values()) == 1  # the round was timed
    assert batch.joint._measured_rates(2) is None  # one kind only: not enough to compare
    dear = np.full(30, 10.0)  # a surrogate that says drafting never pays
    for drafted, seconds in ((True, 1.0), (False, 2.0)):  # drafting measured twice as fast
        batch.joint._rates[(2, drafted)] = deque([(4, seconds)] * 4)
    batch.joint._skip = (0, 0)
    batch.joint._judge(2, [DraftTree.empty()] * 2, dear, plain_cost=0.001, kappa=1.0)
    assert batch.joint._skip == (0, 0)
    batch.joint._rates[(2, False)] = deque([(4, 0.5)] * 4)  # now plain rounds are faster
    windows = []
    for _ in range(7):  # each judgement in a row against drafting doubles the window, up to 16x
        batch.joint._judge(2, [DraftTree.empty()] * 2, np.full(30, 1e-3), 10.0, kappa=1.0)
        windows.append(batch.joint._skip[1])
    assert batch.joint._skip[0] == 2
    assert windows == [joint_budget._SKIP_ROUNDS * k for k in (1, 2, 4, 8, 16, 16, 16)]
    batch.joint._rates[(2, False)] = deque([(4, 2.0)] * 4)  # drafting faster again: back to 1x
    batch.joint._judge(2, [DraftTree.empty()] * 2, dear, plain_cost=0.001, kappa=1.0)
    batch.joint._rates[(2, False)] = deque([(4, 0.5)] * 4)
    batch.joint._judge(2, [DraftTree.empty()] * 2, np.full(30, 1e-3), 10.0, kappa=1.0)
    assert batch.joint._skip == (2, joint_budget._SKIP_ROUNDS)
    # drafting measured faster, but by less than the margin it must win by: not enough
    batch.joint._skip, batch.joint._slower[2] = (0, 0), 0
    batch.joint._rates[(2, True)] = deque([(4, 1.0)] * 4)
    batch.joint._rates[(2, False)] = deque([(4, 1.02)] * 4)
    assert batch.joint._measured_rates(2)[0] > batch.joint._measured_rates(2)[1]
    batch.joint._judge(2, [DraftTree.empty()] * 2, dear, plain_cost=0.001, kappa=1.0)
    assert batch.joint._skip == (2, joint_budget._SKIP_ROUNDS)


def test_requests_made_by_the_generator_decode_as_generate_does(tiny_pair_dirs):
    """``SpeculativeGenerator.request`` is what ``generate`` decodes: in a batch, requests with
    stop strings, a repetition penalty, sampling seeds and other methods give ``generate``'s
    tokens and stop reasons."""
    from caddtree import SpeculativeGenerator

    target, draft = tiny_pair_dirs
    gen = SpeculativeGenerator.from_pretrained(target, draft, dtype="float64", device="cpu")
    gen.cost_model = COST
    prompt = gen.encode("hello there")
    free = gen.generate(prompt, "ar", max_new_tokens=30, stop_token_ids=()).token_ids
    # two tokens of the output that decode to visible characters (not the unknown token)
    stop = next(
        text
        for text in (gen.tokenizer.decode(free[i : i + 2]) for i in range(6, 20))
        if len(text) == 2 and "<" not in text
    )
    settings = [
        {"method": "ddtree", "budget": 6, "stop": [stop], "stop_token_ids": ()},
        {"method": "caddtree", "repetition_penalty": 1.3, "stop_token_ids": ()},
        {"method": "ddtree", "budget": 4, "temperature": 1.0, "seed": 11, "top_k": 20},
        {"method": "dflash", "max_new_tokens": 9},
        {"method": "ar", "temperature": 0.8, "seed": 5},
    ]
    wanted = [{"max_new_tokens": 24, **s} for s in settings]
    batch = BatchDecoder(gen.verifier.target, gen.drafter, max_batch=3, capacity=64)
    requests = [gen.request(prompt, **kwargs) for kwargs in wanted]
    assert len(batch.run(requests)) == len(wanted)
    for kwargs, request in zip(wanted, requests):
        reference = gen.generate(prompt, **kwargs)
        assert request.output == reference.token_ids, kwargs
        assert request.stop_reason == reference.stats.stop_reason, kwargs
    assert requests[0].stop_reason == "stop_string"


def test_the_compiled_batch_graph_decodes_each_request_as_it_decodes_alone():
    """bfloat16 on the compiled runtime, where caddtree's kernels give a row the same bits
    whatever is beside it: the batch graph, compiled once when the decoder starts, verifies every
    round of three requests at a time (trees and lone rows of several sequences, requests joining
    and leaving), and each request's tokens equal plain decoding's of it alone on the
    one-sequence graphs."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    from caddtree.runtime import compiled, kernels
    from test_packing import make_gen

    if not kernels.kernel_available():
        pytest.skip("the batch graph needs caddtree's kernels (AVX512-BF16 or AVX2, and g++)")
    gen = make_gen(torch.bfloat16, runtime="compiled")
    lengths = [14, 22, 9, 30, 17]
    alone = [
        gen.generate(p, "ar", max_new_tokens=n, stop_token_ids=()).token_ids
        for p, n in zip(PROMPTS, lengths)
    ]
    target = gen.verifier.target
    batch = BatchDecoder(target, gen.drafter, max_batch=3, capacity=64)
    assert set(target.compiled._known) >= {"batch", "batch row"}  # compiled at the start
    calls = []
    run_batch = target.compiled._batch_call
    target.compiled._batch_call = lambda *args: calls.append(args[3]) or run_batch(*args)
    done = batch.run(requests(lengths))
    for request in done:
        assert request.output == alone[PROMPTS.index(list(request.prompt_ids))], request.policy.name
    assert any(len(rows.slots) > 1 and max(rows.counts) > 1 for rows in calls)  # trees batched
    # no recompile: one graph for lone rows, one for the rest, whose guards (checked again here)
    # pass for one sequence's tree as for several sequences'
    target.compiled._checked.clear()
    calls.clear()
    (lone,) = batch.run([GenerationRequest(PROMPTS[1], make_policy("ddtree", budget=4), 12)])
    assert any(len(rows.slots) == 1 and rows.counts[0] > 1 for rows in calls)
    assert lone.output == gen.generate(PROMPTS[1], "ar", max_new_tokens=12).token_ids
    assert len(_debug_get_cache_entry_list(compiled._batch_layers.__code__)) == 2


def test_a_failed_prefill_gives_its_slot_back(qwen3, drafter, monkeypatch):
    batch = decoder(qwen3, drafter, 1)

    def broken(*args, **kwargs):
        raise RuntimeError("the prefill failed")

    monkeypatch.setattr(batch, "_prefill", broken)
    with pytest.raises(RuntimeError, match="prefill failed"):
        batch.add(GenerationRequest([1, 2], make_policy("ar"), 4))
    monkeypatch.undo()
    assert batch.has_room()
    (done,) = batch.run([GenerationRequest([1, 2], make_policy("ar"), 4)])
    assert done.output == hf_generate(qwen3, [1, 2], 4)


def test_sampled_tokens_in_a_batch_are_distributed_as_the_processed_target():
    """2,000 sampled requests of three tokens, four at a time with requests joining as others
    leave, through DDTree trees drafted in one pass for the batch: each token's marginal against
    the exact one under transformers' processors with the right context, chi-square at
    alpha = 1e-3 (the check of tests/test_sampling.py, which also rejects two wrong
    distributions). Each request samples with its own seeded generator."""
    import numpy as np

    from sampling_checks import (
        MARGINAL_PROMPT,
        MARGINAL_SETTINGS,
        assert_three_token_marginals,
        marginal_target,
    )
    from tiny_models import new_drafter

    vocab = 16
    model = marginal_target(vocab)
    drafter = new_drafter(model, mask_token_id=vocab - 1, target_layer_ids=[0])
    batch = BatchDecoder(LeanTarget(model, [0]), drafter, max_batch=4, capacity=32)
    policy = make_policy("ddtree", budget=vocab)
    todo = [
        GenerationRequest(MARGINAL_PROMPT, policy, 3, sampler=Sampler(**MARGINAL_SETTINGS, seed=i))
        for i in range(2000)
    ]
    counts = np.zeros((3, vocab))
    done = batch.run(todo)
    for request in done:
        for k, token in enumerate(request.output):
            counts[k, token] += 1
    assert len(done) == 2000 and counts.sum() == 3 * 2000
    assert sum(r.accepted for r in done) > 500  # tree rows, not only bonus rows, were sampled
    assert_three_token_marginals(model, MARGINAL_PROMPT, counts, Sampler(**MARGINAL_SETTINGS))


@pytest.mark.parametrize("method", ["ddtree", "caddtree"])
def test_batched_round_statistics_add_up_as_a_single_requests_do(qwen3, drafter, method):
    """Every batched round's statistics keep engine/stats.py's rule: ``round_s`` covers
    ``draft_s + tree_s + verify_s`` and ``verify_s`` covers ``forward_s``; the tree build
    (own trees, or the joint budget's) is timed on its own."""
    batch = joint_decoder(qwen3, drafter, 3)
    settings = {"budget": 6} if method == "ddtree" else {"cost_model": COST, "max_budget": 24}
    policy = make_policy(method, **settings)
    done = batch.run([GenerationRequest(p, policy, 20) for p in PROMPTS[:3]])
    stats = [s for r in done for s in r.round_stats]
    assert len(stats) >= 3
    for s in stats:
        assert s.round_s >= s.draft_s + s.tree_s + s.verify_s - 1e-9
        assert s.verify_s >= s.forward_s > 0 and min(s.draft_s, s.tree_s) >= 0
    assert any(s.tree_s > 0 for s in stats if s.budget)
    assert all(s.round_s > s.verify_s for s in stats if s.budget)  # the draft and tree count
