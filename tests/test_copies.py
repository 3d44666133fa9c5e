"""Drafts copied from the context (caddtree.core.copies) and trees merged from the drafter and the
copies (caddtree.core.merged): the index finds what followed the text's last tokens, the rates
learn from verified rounds, and the merged best-first expansion equals brute force over the union
of nodes, with the cost-aware stop still at the best size under a convex cost."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from caddtree.core import copies
from caddtree.core.candidates import Candidates
from caddtree.core.copies import ContextIndex, CopyRates, CopyTrie, copy_trie
from caddtree.core.merged import MergedSource, build_copies, build_merged
from caddtree.core.tree import build_ddtree


def test_the_index_finds_the_newest_occurrences_of_the_longest_suffix():
    tokens = [1, 2, 3, 9, 1, 2, 3, 7, 1, 2, 3]
    index = ContextIndex(tokens)
    match, found = index.continuations(depth=3)
    assert match == 3 and [f.tolist() for f in found] == [[7, 1, 2], [9, 1, 2]]
    # the continuation stops at the end of the text
    assert [f.tolist() for f in ContextIndex([5, 6, 5]).continuations(4)[1]] == [[6, 5]]
    assert ContextIndex([1, 2, 3]).continuations(4) == (0, [])
    assert ContextIndex([4]).continuations(4) == (0, [])
    # grown a few tokens at a time, it finds the same
    grown = ContextIndex()
    for start in range(0, len(tokens), 3):
        grown.extend(tokens[start : start + 3])
    assert np.array_equal(grown._keys[:, : len(tokens)], index._keys[:, : len(tokens)])
    assert [f.tolist() for f in grown.continuations(3)[1]] == [[7, 1, 2], [9, 1, 2]]


def test_hash_matches_are_checked_token_by_token(monkeypatch):
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 6, 300).tolist()
    honest = ContextIndex(tokens).continuations(5)
    monkeypatch.setattr(
        copies, "_MULTIPLIER", np.uint64(0)
    )  # every n-gram hashes as its last token
    colliding = ContextIndex(tokens).continuations(5)
    assert honest[0] == colliding[0] and len(honest[1]) == len(colliding[1])
    assert all(np.array_equal(a, b) for a, b in zip(honest[1], colliding[1]))


def test_the_index_memory_grows_with_the_text_only():
    index = ContextIndex(range(5000))
    assert index._keys.nbytes + index._tokens.nbytes <= 2 * 5000 * 8 * (1 + copies.MAX_ORDER)


def test_a_trie_shares_common_prefixes_and_prices_them():
    trie = CopyTrie(match=2)
    for continuation in ([5, 6, 7], [5, 6, 8], [5, 9]):
        trie.add(continuation)
    assert len(trie) == 5 and trie.counts[:3] == [3, 3, 2]
    rates = CopyRates(default=0.5, strength=1.0)
    trie.price(rates)
    five, six = trie.children[0][5], trie.children[trie.children[0][5]][6]
    assert trie.log_conditional[five] == pytest.approx(math.log(0.5))
    assert trie.log_conditional[six] == pytest.approx(math.log(0.5 * 2 / 3))
    assert [trie.tokens[v] for v in trie.chain()] == [5, 6, 8]  # the newer of the tied ones


def test_rates_learn_from_verified_rounds_and_pool_across_requests():
    pooled = CopyRates(default=0.3, strength=4.0)
    mine, other = CopyRates(prior=pooled), CopyRates(prior=pooled)
    trie = copy_trie(ContextIndex([1, 2, 3, 4, 1, 2]), mine, depth=4)
    assert [trie.tokens[v] for v in trie.chain()] == [3, 4, 1, 2]
    mine.observe(trie, [3, 4, 9])  # two accepted, then the target parted at depth 3
    assert mine.trials[2, 1:4].tolist() == [1, 1, 1] and mine.hits[2, 1:4].tolist() == [1, 1, 0]
    assert pooled.trials[2, 1:4].tolist() == [1, 1, 1]
    assert mine.rate(2, 1) == pytest.approx((1 + 4 * pooled.rate(2, 1)) / 5)
    assert pooled.rate(2, 1) == pytest.approx((1 + 4 * 0.3) / 5)
    assert other.rate(2, 1) == pytest.approx(pooled.rate(2, 1))  # learnt through the pool
    mine.observe(None, [1])  # a round without copies counts nothing
    assert mine.trials.sum() == 3


# ---- merged trees against brute force ----------------------------------------------------------


def random_case(rng, vocab, depth, branches):
    logits = rng.normal(size=(depth, vocab)) * 2
    trie = CopyTrie(match=int(rng.integers(1, 4)))
    for _ in range(branches):
        trie.add(rng.integers(0, vocab, int(rng.integers(1, depth + 1))).tolist())
    trie.log_conditional = [0.0] + np.log(rng.uniform(0.01, 0.99, len(trie))).tolist()
    return logits, trie


def brute_force(logits, trie, to_target=None):
    """Every node of depth <= L (as a path of target tokens: the drafter's vocabulary mapped by
    ``to_target``, and the copies' tokens) with a finite merged estimate, best first."""
    depth, vocab = logits.shape
    log_q = logits - np.log(np.exp(logits).sum(1, keepdims=True))
    targets = range(vocab) if to_target is None else to_target.tolist()
    draft_of = {int(t): d for d, t in enumerate(targets)}
    tokens = sorted(set(draft_of) | set(trie.tokens[1:]))
    scored = []
    for d in range(1, depth + 1):
        for path in itertools.product(tokens, repeat=d):
            score, node = 0.0, 0
            for i, t in enumerate(path):
                child = trie.children[node].get(t) if node is not None else None
                copied = trie.log_conditional[child] if child is not None else -math.inf
                drafted = log_q[i, draft_of[t]] if t in draft_of else -math.inf
                score, node = score + max(copied, drafted), child
            if score > -math.inf:
                scored.append((score, path))
    scored.sort(key=lambda item: -item[0])
    return scored


def tree_paths(tree):
    return [tuple(int(tree.token_ids[k]) for k in tree.path(i)) for i in range(len(tree))]


@pytest.mark.parametrize("seed", range(40))
def test_the_merged_expansion_is_brute_force_best_first(seed):
    rng = np.random.default_rng(seed)
    vocab, depth = int(rng.integers(2, 5)), int(rng.integers(1, 4))
    logits, trie = random_case(rng, vocab, depth, int(rng.integers(1, 4)))
    scored = brute_force(logits, trie)
    n = int(rng.integers(1, len(scored) + 1))
    (tree,) = build_merged([MergedSource(Candidates(logits), trie)], n)
    tree.validate()
    assert tree_paths(tree) == [path for _, path in scored[:n]]
    assert np.allclose(tree.log_probs, [score for score, _ in scored[:n]])
    on_trie = [trie_node(trie, path) for path in tree_paths(tree)]
    for k, node in enumerate(on_trie):  # copied: on the trie, with the copy's estimate the larger
        drafted = logits[len(tree.path(k)) - 1]
        log_q = drafted[tree.token_ids[k]] - np.log(np.exp(drafted).sum())
        expected = node is not None and trie.log_conditional[node] > log_q
        assert bool(tree.copied[k]) == expected
        assert (tree.ranks[k] == -1) == (node is not None)


def trie_node(trie, path):
    node = 0
    for t in path:
        node = trie.children[node].get(t)
        if node is None:
            return None
    return node


def test_a_draft_vocabulary_and_copies_meet_in_target_ids():
    rng = np.random.default_rng(7)
    to_target = np.array([10, 3, 7])  # draft id -> target id; target 5 is outside the draft
    logits = rng.normal(size=(2, 3))
    trie = CopyTrie(match=2)
    trie.add([5, 3])
    trie.add([7, 10])
    trie.log_conditional = [0.0] + np.log(rng.uniform(0.2, 0.9, len(trie))).tolist()
    scored = brute_force(logits, trie, to_target)
    (tree,) = build_merged([MergedSource(Candidates(logits), trie, to_target)], 8)
    assert tree_paths(tree) == [path for _, path in scored[:8]]
    assert 5 in tree.token_ids.tolist() and set(tree.token_ids.tolist()) <= {10, 3, 7, 5}


@pytest.mark.parametrize("seed", range(5))
def test_without_copies_the_merged_tree_is_ddtrees(seed):
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(5, 30))
    for budget in (1, 7, 40):
        (merged,) = build_merged([MergedSource(Candidates(logits), None)], budget)
        plain = build_ddtree(logits, budget)
        assert tree_paths(merged) == tree_paths(plain)
        assert np.allclose(merged.log_probs, plain.log_probs) and not merged.copied.any()


def test_copies_alone_make_a_tree_without_a_drafter():
    trie = CopyTrie(match=3)
    trie.add([4, 5, 6])
    trie.add([4, 8])
    trie.price(CopyRates(default=0.6))
    (tree,) = build_merged([MergedSource(None, trie)], 10)
    assert sorted(tree_paths(tree)) == [(4,), (4, 5), (4, 5, 6), (4, 8)]
    assert tree.copied.all() and (np.diff(tree.log_probs) <= 1e-12).all()


@pytest.mark.parametrize("seed", range(30))
def test_a_tree_of_copies_alone_is_the_merged_expansions_without_a_drafter(seed):
    rng = np.random.default_rng(300 + seed)
    trie = CopyTrie(match=int(rng.integers(1, 40)))
    for _ in range(int(rng.integers(1, 5))):
        trie.add(rng.integers(0, 3, int(rng.integers(1, 9))).tolist())
    trie.price(CopyRates(default=float(rng.uniform(0.2, 0.95))))
    slopes = np.sort(rng.uniform(0.0, 0.5, len(trie)))
    costs = (1.0 + np.concatenate(([0.0], np.cumsum(slopes)))).tolist()
    every = build_copies(trie, len(trie)).log_probs
    ties = len(set(np.round(every, 12))) < len(trie)
    for max_nodes, denominators in (
        (len(trie), None),
        (int(rng.integers(1, 6)), None),
        (len(trie), costs),
    ):
        (merged,) = build_merged([MergedSource(None, trie)], max_nodes, denominators)
        alone = build_copies(trie, max_nodes, denominators)
        assert len(alone) == len(merged) and math.isclose(alone.phi, merged.phi)
        assert (np.diff(alone.log_probs) <= 0).all() and alone.copied.all()
        # a tree: every node's parent comes before it and carries its path's prefix
        paths = tree_paths(alone)
        assert all(path[:-1] in paths[:i] or len(path) == 1 for i, path in enumerate(paths))
        if not ties:  # the same nodes
            assert sorted(paths) == sorted(tree_paths(merged))
    assert len(build_copies(None, 5)) == 0 and len(build_copies(trie, 0)) == 0


@pytest.mark.parametrize("seed", range(30))
def test_the_cost_aware_stop_is_the_best_size_under_a_convex_cost(seed):
    rng = np.random.default_rng(100 + seed)
    logits, trie = random_case(rng, int(rng.integers(2, 5)), int(rng.integers(1, 4)), 3)
    scored = brute_force(logits, trie)
    max_nodes = len(scored)
    slopes = np.sort(rng.uniform(0.0, 0.5, max_nodes))  # non-decreasing: a convex cost
    costs = 1.0 + float(rng.uniform(0, 2)) + np.concatenate(([0.0], np.cumsum(slopes)))
    phi = np.concatenate(([0.0], np.cumsum(np.exp([s for s, _ in scored]))))
    # kappa: tokens accepted per unit of mass (the batch's calibration); the stop weighs 1 + kappa Phi
    kappa = float(rng.choice([1.0, 0.4, 2.5]))
    theta = (1.0 + kappa * phi) / costs
    best = int(np.argmax(theta))
    source = MergedSource(Candidates(logits), trie)
    (tree,) = build_merged([source], max_nodes, costs.tolist(), 1.0 / kappa)
    assert len(tree) == best and math.isclose(theta[len(tree)], theta.max())


def test_joint_trees_take_the_best_nodes_of_all_requests():
    rng = np.random.default_rng(3)
    cases = [random_case(rng, 3, 2, 2) for _ in range(3)]
    union = sorted(
        ((s, r) for r, (logits, trie) in enumerate(cases) for s, _ in brute_force(logits, trie)),
        key=lambda item: -item[0],
    )
    sources = [MergedSource(Candidates(logits), trie) for logits, trie in cases]
    trees = build_merged(sources, 9)
    per_request = [sum(1 for _, r in union[:9] if r == k) for k in range(3)]
    assert [len(t) for t in trees] == per_request


@pytest.mark.parametrize("seed", range(4))
def test_the_merged_expansion_reads_past_the_first_candidates(seed):
    """A vocabulary above the candidates read at first (FIRST_K = 32): rows are widened as the
    expansion goes, and the order is still brute force's."""
    rng = np.random.default_rng(500 + seed)
    logits, trie = random_case(rng, 40, 2, 3)
    scored = brute_force(logits, trie)
    n = 600
    (tree,) = build_merged([MergedSource(Candidates(logits), trie)], n)
    assert tree_paths(tree) == [path for _, path in scored[:n]]
    assert sum(1 for k in range(n) if tree.depths[k] == 1) > 32  # past the first read


def test_a_topk_draft_gives_no_mass_outside_its_candidates():
    from caddtree.core.candidates import TopK

    log_q = np.log(np.array([[0.5, 0.3], [0.6, 0.2]]))
    topk = TopK(log_q, np.array([[4, 2], [1, 4]]))
    trie = CopyTrie(match=1)
    trie.add([7, 1])  # 7 is outside the drafter's candidates; 1 is its top-1 at depth 2
    trie.log_conditional = [0.0, math.log(0.4), math.log(0.1)]
    (tree,) = build_merged([MergedSource(Candidates(topk), trie)], 10)
    nodes = dict(zip(tree_paths(tree), tree.log_probs.tolist()))
    assert nodes[(7,)] == pytest.approx(math.log(0.4))  # the copy's alone
    assert nodes[(7, 1)] == pytest.approx(math.log(0.4 * 0.6))  # the drafter's larger
    assert nodes[(4,)] == pytest.approx(math.log(0.5)) and (9,) not in nodes


def test_the_prior_trusts_longer_matches_and_later_tokens_more():
    from caddtree.core.copies import match_class, prior_rate

    lengths = (1, 2, 3, 4, 7, 8, 15, 16, 31, 32, 100)
    assert [match_class(m) for m in lengths] == [1, 2, 3, 4, 4, 5, 5, 6, 6, 7, 7]
    for depth in (1, 2, 5):
        rates = [prior_rate(m, depth) for m in lengths]
        assert rates == sorted(rates) and len(set(rates)) == 7
    assert prior_rate(2, 1) < prior_rate(2, 2) < prior_rate(2, 3) == prior_rate(2, 9) < 1
    assert CopyRates().rate(40, 1) == pytest.approx(prior_rate(40, 1))
    # a request learns per class: hits at long matches leave short ones where they were
    rates = CopyRates()
    for _ in range(20):
        rates._count(40, 1, True)
        rates._count(2, 1, False)
    assert rates.rate(33, 1) > prior_rate(33, 1) and rates.rate(2, 1) < prior_rate(2, 1)
    assert rates.rate(5, 1) == pytest.approx(prior_rate(5, 1))


def test_the_index_keeps_the_occurrences_of_the_longest_match_and_measures_it():
    # "7 1 2 3" occurred once after a long shared run and later after a different token
    shared = [20, 21, 22, 23, 24, 25, 26, 27, 28, 29]
    tokens = [*shared, 1, 2, 3, 40, 41, 9, 1, 2, 3, 50, 51, 8, *shared, 1, 2, 3]
    match, found = ContextIndex(tokens).continuations(depth=2)
    assert match == 13 and [f.tolist() for f in found] == [[40, 41]]
    # matches of one class keep the newest first; a match stops at the text's start
    match, found = ContextIndex([5, 1, 2, 6, 1, 2, 7, 1, 2]).continuations(depth=1)
    assert match == 2 and [f.tolist() for f in found] == [[7], [6]]
    match, found = ContextIndex([1, 2, 1, 2]).continuations(depth=1)
    assert match == 2 and [f.tolist() for f in found] == [[1]]
