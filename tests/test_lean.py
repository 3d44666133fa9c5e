"""The lean runtime computes what transformers computes.

Its logits and feature-layer outputs are compared with transformers' forward (through
:class:`TreeVerifier`) on the tiny Llama and Qwen3 targets: float64 to rounding, float32 within
1e-4 relative, for one row, tree masks, several sequences in one call, and across cache
compaction, truncation and growth. The lossless decoding tests run on both runtimes
(``verifier_type`` in conftest.py).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from caddtree import InvalidInputError, SpeculativeGenerator
from caddtree.core.profiling import profiling_tree
from caddtree.core.tree import DraftTree, verification_rows
from caddtree.models import TreeVerifier
from caddtree.runtime import lean
from caddtree.runtime.lean import LeanTarget, LeanVerifier, Rows, lean_unsupported
from tiny_models import VOCAB, llama_target, new_drafter, qwen3_target

TARGETS = {"qwen3": qwen3_target, "llama": llama_target}
# layer 3 is the last one: transformers' last hidden state is the final norm's output
LAYERS = (0, 2, 3)
TOLERANCE = {torch.float64: dict(rtol=1e-10, atol=1e-10), torch.float32: dict(rtol=1e-4, atol=1e-5)}


@pytest.fixture(scope="module", params=[(k, d) for k in TARGETS for d in TOLERANCE], ids=str)
def model(request):
    kind, dtype = request.param
    return TARGETS[kind]("sdpa").to(dtype)


def tree(seed: int, budget: int = 10) -> DraftTree:
    return profiling_tree(budget, 4, VOCAB, seed=seed)


def prompt(seed: int, length: int = 9) -> list[int]:
    return np.random.default_rng(seed).integers(0, VOCAB, length).tolist()


def deep_path(t: DraftTree) -> list[int]:
    """An accepted path to the deepest node of ``t`` (its node indices, from the root down;
    ``[]`` for an empty tree)."""
    if not len(t):
        return []
    path = [int(np.argmax(t.depths))]
    while t.parents[path[-1]] >= 0:
        path.append(int(t.parents[path[-1]]))
    return path[::-1]


def assert_same(ours, theirs, dtype):
    torch.testing.assert_close(ours, theirs, **TOLERANCE[dtype])


def test_logits_and_features_equal_transformers_through_a_generation(model):
    """Prefill, tree verifications, compactions of branching paths, a lone bonus and truncation,
    on both runtimes side by side."""
    dtype = model.dtype
    ours, theirs = LeanVerifier(model, LAYERS), TreeVerifier(model, LAYERS)
    for v in (ours, theirs):
        v.reset(reserve=64)
    for a, b in zip(ours.prefill(prompt(0)), theirs.prefill(prompt(0))):
        assert_same(a, b, dtype)
    for seed in range(4):
        t = tree(seed) if seed != 2 else DraftTree.empty()
        for a, b in zip(ours.verify(7 + seed, t), theirs.verify(7 + seed, t)):
            assert_same(a, b, dtype)
        path = deep_path(t)
        assert_same(ours.commit(path), theirs.commit(path), dtype)
    assert (
        ours.context_length
        == theirs.context_length
        == 9 + sum(1 + len(deep_path(tree(s))) for s in (0, 1, 3)) + 1
    )
    for v in (ours, theirs):
        v.truncate(11)
    for a, b in zip(ours.verify(3, tree(9)), theirs.verify(3, tree(9))):
        assert_same(a, b, dtype)


def test_a_lone_row_is_answered_without_a_mask_and_equals_transformers(model):
    ours, theirs = LeanVerifier(model, ()), TreeVerifier(model, ())
    for v in (ours, theirs):
        v.reset()
        v.prefill(prompt(1, 20))
    for token in (4, 50):
        a, b = ours.verify(token, DraftTree.empty()), theirs.verify(token, DraftTree.empty())
        assert a[0].shape == (1, VOCAB) and a[1].shape == (1, 0)
        assert_same(a[0], b[0], model.dtype)
        ours.commit([])
        theirs.commit([])


def test_the_cache_grows_past_its_reserve_and_keeps_its_entries(model, monkeypatch):
    monkeypatch.setattr(lean, "_MIN_CAPACITY", 16)
    ours, theirs = LeanVerifier(model, LAYERS), TreeVerifier(model, LAYERS)
    ours.reset(reserve=1)
    theirs.reset()
    assert ours.target.capacity == 16
    long = prompt(2, 30)
    ours.prefill(long[:10])
    theirs.prefill(long[:10])
    for a, b in zip(ours.prefill(long[10:]), theirs.prefill(long[10:])):  # grows: 30 > 16
        assert_same(a, b, model.dtype)
    grown = ours.target.capacity
    assert grown >= 30
    while ours.context_length <= grown:  # verifications that outgrow the cache again
        t = tree(5)
        for a, b in zip(ours.verify(1, t), theirs.verify(1, t)):
            assert_same(a, b, model.dtype)
        ours.commit(deep_path(t))
        theirs.commit(deep_path(t))
    assert ours.target.capacity > grown


def test_several_sequences_in_one_call_equal_each_alone(model):
    """Three sequences of other lengths, in slots out of order, with a tree, a lone bonus and a
    prompt continuation in one call: each one's logits and features are those of transformers
    verifying it alone, and a later call sees each slot's own cache."""
    dtype = model.dtype
    runtime = LeanTarget(model, LAYERS)
    runtime.reserve(4, 80)
    contexts = {2: prompt(3, 12), 0: prompt(4, 5), 3: prompt(5, 20)}
    references = {}
    for slot, context in contexts.items():
        rows = Rows.batch([(slot, 0, context, list(range(len(context))), None)], "cpu")
        runtime.forward(rows)
        references[slot] = TreeVerifier(model, LAYERS)
        references[slot].reset()
        references[slot].prefill(context)
    t = tree(7)
    more = prompt(6, 3)
    calls = [
        (
            2,
            12,
            [9, *t.token_ids],
            (12 + np.concatenate(([0], t.depths))).tolist(),
            t.visibility_mask(),
        ),
        (0, 5, [4], [5], None),
        (3, 20, more, [20, 21, 22], None),
    ]
    rows = Rows.batch(calls, "cpu")
    logits, features = runtime.forward(rows)
    offset = 0
    expected = {2: references[2].verify(9, t), 0: references[0].verify(4, DraftTree.empty())}
    expected[3] = references[3].prefill(more)
    for slot, _, tokens, _, _ in calls:
        n = len(tokens)
        want_logits, want_features = expected[slot]
        if slot == 3:  # a prefill returns its last row's logits
            assert_same(logits[offset + n - 1], want_logits, dtype)
            assert_same(features[offset : offset + n], want_features[0], dtype)
        else:
            assert_same(logits[offset : offset + n], want_logits, dtype)
            assert_same(features[offset : offset + n], want_features, dtype)
        offset += n
    # the accepted path of slot 2 compacted in place; then one row each, no mask needed
    path = deep_path(t)
    runtime.compact(2, 12, verification_rows(path))
    references[2].commit(path)
    references[0].commit([])
    lengths = {2: 12 + len(verification_rows(path)), 0: 6, 3: 23}
    rows = Rows.batch([(s, lengths[s], [s + 1], [lengths[s]], None) for s in (3, 2, 0)], "cpu")
    logits, _ = runtime.forward(rows)
    assert_same(logits[1], references[2].verify(3, DraftTree.empty())[0][0], dtype)
    assert_same(logits[2], references[0].verify(1, DraftTree.empty())[0][0], dtype)


def test_one_row_per_sequence_at_equal_lengths_needs_no_mask(model):
    runtime = LeanTarget(model, ())
    runtime.reserve(2, 32)
    for slot in (0, 1):
        ids = prompt(10 + slot, 8)
        runtime.forward(Rows.batch([(slot, 0, ids, list(range(8)), None)], "cpu"))
    rows = Rows.batch([(0, 8, [5], [8], None), (1, 8, [6], [8], None)], "cpu")
    assert rows.mask is None
    logits, _ = runtime.forward(rows)
    for slot, token in ((0, 5), (1, 6)):
        reference = TreeVerifier(model, ())
        reference.reset()
        reference.prefill([*prompt(10 + slot, 8), token])
        alone = reference.model(torch.tensor([[*prompt(10 + slot, 8), token]])).logits[0, -1]
        assert_same(logits[slot], alone, model.dtype)


def test_bad_calls_are_refused(qwen3):
    runtime = LeanTarget(qwen3, ())
    runtime.reserve(1, 16)
    with pytest.raises(InvalidInputError, match="own cache slot"):
        Rows.batch([(0, 0, [1], [0], None), (0, 1, [2], [1], None)], "cpu")
    with pytest.raises(InvalidInputError, match="reserve"):
        runtime.forward(Rows.batch([(0, 0, list(range(300)), list(range(300)), None)], "cpu"))
    with pytest.raises(InvalidInputError, match="visibility"):
        Rows.batch([(0, 0, [1, 2], [0, 1], np.ones((3, 3), bool))], "cpu")


def test_unsupported_models_keep_transformers_forward(caplog):
    gelu = llama_target(hidden_act="gelu")
    assert "activation" in lean_unsupported(gelu)
    assert lean_unsupported(qwen3_target()) is None
    gen = SpeculativeGenerator(gelu, None, new_drafter(gelu), runtime="auto")
    assert gen.runtime == "transformers" and type(gen.verifier) is TreeVerifier
    with pytest.raises(InvalidInputError, match="runtime 'lean' cannot run this target"):
        SpeculativeGenerator(gelu, None, None, runtime="lean")
    with pytest.raises(InvalidInputError, match="unknown runtime"):
        SpeculativeGenerator(gelu, None, None, runtime="fast")


def test_the_generator_picks_the_lean_runtime_and_both_decode_alike(qwen3, drafter):
    lean = SpeculativeGenerator(qwen3, None, drafter)
    plain = SpeculativeGenerator(qwen3, None, drafter, runtime="transformers")
    assert lean.runtime == "lean" and isinstance(lean.verifier, LeanVerifier)
    assert plain.runtime == "transformers"
    for method, kwargs in (("ar", {}), ("ddtree", {"budget": 6})):
        a = lean.generate([5, 17, 3], method=method, max_new_tokens=20, **kwargs)
        b = plain.generate([5, 17, 3], method=method, max_new_tokens=20, **kwargs)
        assert a.token_ids == b.token_ids


def test_packing_that_would_not_fit_in_memory_is_skipped_with_a_warning(monkeypatch, caplog):
    model = qwen3_target().to(torch.float32)
    assert LeanTarget(model, ()).layers[0].qkv.packed is not None
    from caddtree.runtime import packing

    monkeypatch.setattr(packing, "available_memory", lambda: 1000)
    with caplog.at_level("WARNING", logger="caddtree.runtime.packing"):
        runtime = LeanTarget(model, ())
    assert "not packing" in caplog.text
    assert all(layer.qkv.packed is None for layer in runtime.layers)


def test_auto_picks_the_lean_runtime_on_the_cpu_only(qwen3):
    """On another device ``auto`` keeps transformers' forward (lean is asked for by name there)."""
    from caddtree.loading import runtime_choice

    assert SpeculativeGenerator(qwen3, None, None).runtime == "lean"
    assert runtime_choice("auto", "cpu", None) == "auto"  # lean, compiled where that wins
    assert runtime_choice("auto", "cuda", None) == "transformers"
    assert runtime_choice("lean", "cuda", None) == "lean"
    assert runtime_choice("compiled", "cuda", None) == "compiled"
    assert runtime_choice("auto", "cpu", "its activation is gelu") == "transformers"
    assert runtime_choice("transformers", "cpu", None) == "transformers"
    for runtime in ("lean", "compiled"):
        with pytest.raises(
            InvalidInputError, match=f"runtime '{runtime}' cannot run this target: why"
        ):
            runtime_choice(runtime, "cpu", "why")


def test_compacting_several_slots_at_once_moves_what_one_at_a_time_moves():
    """compact_many (a batch round's accepted paths, one gather and scatter per cache tensor)
    leaves every slot as compact() of each slot in turn does: paths, prefixes and no move."""
    model = qwen3_target("sdpa")
    once, each = (LeanTarget(model, LAYERS) for _ in range(2))
    for target in (once, each):
        target.reserve(3, 40)
        for cache in target.keys + target.values:
            cache.copy_(torch.randn(cache.shape, generator=torch.Generator().manual_seed(1)))
    moves = [(0, 5, [0, 2, 5]), (1, 9, [0, 1, 2]), (2, 3, [0, 4, 6, 7])]
    path = once.values[-1][2, :, [3, 7, 9, 10]].clone()  # slot 2's accepted entries
    untouched = once.keys[1][1].clone()  # slot 1's path is a prefix: nothing moves
    once.compact_many(moves)
    for move in moves:
        each.compact(*move)
    for a, b in zip(once.keys + once.values, each.keys + each.values):
        assert torch.equal(a, b)
    assert torch.equal(once.values[-1][2, :, 3:7], path)
    assert torch.equal(once.keys[1][1], untouched)
