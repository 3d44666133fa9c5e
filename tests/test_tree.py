"""Draft-tree construction: validity, DDTree optimality, CaDDTree's stopping rule (Theorem 1)."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from caddtree import (
    ConvexCostModel,
    DraftTree,
    InvalidInputError,
    TopK,
    build_caddtree,
    build_chain,
    build_ddtree,
    surrogate_throughput,
    topk_log_probs,
)
from caddtree.core.cost import PiecewiseLinearCurve


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(axis=1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=1, keepdims=True))


def all_prefixes(logits: np.ndarray) -> dict[tuple[int, ...], float]:
    """Brute force: every prefix (token sequence of depth 1..L) and its log prefix probability."""
    lp = log_softmax(logits)
    L, V = lp.shape
    out = {}
    for d in range(1, L + 1):
        for seq in itertools.product(range(V), repeat=d):
            out[seq] = float(sum(lp[i, t] for i, t in enumerate(seq)))
    return out


def node_sequences(tree: DraftTree) -> list[tuple[int, ...]]:
    return [tuple(int(tree.token_ids[j]) for j in tree.path(i)) for i in range(len(tree))]


def random_logits(rng: np.random.Generator, L: int, V: int) -> np.ndarray:
    return rng.normal(0.0, rng.uniform(0.5, 4.0), size=(L, V))


small_shapes = st.tuples(st.integers(1, 4), st.integers(1, 5), st.integers(0, 2**31 - 1))


# ---- validity -----------------------------------------------------------------------------------


def assert_valid(tree: DraftTree, logits: np.ndarray) -> None:
    tree.validate()
    n = len(tree)
    assert tree.token_ids.shape == tree.parents.shape == tree.depths.shape == tree.log_probs.shape
    # parents come before children
    assert (tree.parents < np.arange(n)).all()
    # depths consistent
    for i in range(n):
        p = tree.parents[i]
        assert tree.depths[i] == (1 if p < 0 else tree.depths[p] + 1)
    # selection order: non-increasing prefix probability
    assert (np.diff(tree.log_probs) <= 1e-12).all()
    # log_probs are the true log prefix probabilities; the set of sequences is prefix-closed
    lp = log_softmax(logits)
    seqs = node_sequences(tree)
    assert len(set(seqs)) == n
    for seq, logp in zip(seqs, tree.log_probs):
        assert logp == pytest.approx(sum(lp[i, t] for i, t in enumerate(seq)), abs=1e-9)
        assert seq[:-1] == () or seq[:-1] in set(seqs)


@settings(max_examples=150, deadline=None)
@given(small_shapes, st.integers(0, 40))
def test_ddtree_is_valid_and_optimal(shape, budget):
    """DDTree returns the top-`budget` prefixes: checked against brute-force enumeration."""
    L, V, seed = shape
    logits = random_logits(np.random.default_rng(seed), L, V)
    tree = build_ddtree(logits, budget)
    assert_valid(tree, logits)
    everything = all_prefixes(logits)
    assert len(tree) == min(budget, len(everything))
    best = np.sort(np.array(list(everything.values())))[::-1][: len(tree)]
    # the multiset of selected prefix probabilities is the top-n one (Eq. phistar)
    np.testing.assert_allclose(np.sort(tree.log_probs)[::-1], best, atol=1e-9)
    assert tree.phi == pytest.approx(float(np.exp(best).sum()), abs=1e-9)


def test_ddtree_matches_for_torch_numpy_and_topk_inputs():
    rng = np.random.default_rng(3)
    logits = rng.normal(size=(6, 50)).astype(np.float32)
    a = build_ddtree(logits, 30)
    b = build_ddtree(torch.from_numpy(logits), 30)
    c = build_ddtree(topk_log_probs(logits, 30), 30)
    for t in (b, c):
        np.testing.assert_array_equal(a.token_ids, t.token_ids)
        np.testing.assert_array_equal(a.parents, t.parents)
        np.testing.assert_allclose(a.log_probs, t.log_probs, atol=1e-5)


def test_topk_restricts_candidates():
    """With a precomputed top-K, the tree only uses those K candidates per position."""
    rng = np.random.default_rng(4)
    logits = rng.normal(size=(3, 20))
    tk = topk_log_probs(logits, 2)
    tree = build_ddtree(tk, 100)
    assert len(tree) == 2 + 4 + 8
    assert (tree.ranks < 2).all()
    assert set(tree.token_ids.tolist()) <= set(tk.token_ids.ravel().tolist())


def test_chain_is_top1_per_position():
    rng = np.random.default_rng(5)
    logits = rng.normal(size=(7, 30))
    chain = build_chain(logits)
    assert len(chain) == 7
    np.testing.assert_array_equal(chain.token_ids, logits.argmax(axis=1))
    np.testing.assert_array_equal(chain.parents, np.arange(-1, 6))
    np.testing.assert_array_equal(chain.depths, np.arange(1, 8))
    np.testing.assert_allclose(chain.log_probs, np.cumsum(log_softmax(logits).max(axis=1)))


def test_budget_zero_and_empty_tree():
    tree = build_ddtree(np.zeros((3, 4)), 0)
    assert len(tree) == 0 and tree.phi == 0.0
    mask = DraftTree.empty().visibility_mask()
    assert mask.shape == (1, 1) and mask.all()
    assert DraftTree.empty().children(-1).size == 0


# ---- structure helpers ---------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(small_shapes, st.integers(1, 40))
def test_visibility_mask_is_ancestor_relation(shape, budget):
    L, V, seed = shape
    tree = build_ddtree(random_logits(np.random.default_rng(seed), L, V), budget)
    mask = tree.visibility_mask()
    n = len(tree)
    expected = np.zeros((n + 1, n + 1), dtype=bool)
    expected[:, 0] = True
    for i in range(n):
        for j in tree.path(i):
            expected[i + 1, j + 1] = True
    np.testing.assert_array_equal(mask, expected)


def test_children_and_child_lookup():
    rng = np.random.default_rng(6)
    tree = build_ddtree(rng.normal(size=(4, 6)), 40)
    seen = []
    for node in range(-1, len(tree)):
        kids = tree.children(node)
        assert (tree.parents[kids] == node).all()
        assert list(kids) == sorted(kids)
        for k in kids:
            assert tree.child_with_token(node, int(tree.token_ids[k])) == k
        seen.extend(kids.tolist())
    assert sorted(seen) == list(range(len(tree)))
    absent = next(
        t for t in range(1000) if t not in set(tree.token_ids[tree.children(-1)].tolist())
    )
    assert tree.child_with_token(-1, absent) == -1
    with pytest.raises(IndexError):
        tree.children(len(tree))


def test_validate_rejects_malformed_trees():
    with pytest.raises(InvalidInputError, match="parent"):
        DraftTree([1, 2], [1, -1], [2, 1], [0.0, 0.0]).validate()
    with pytest.raises(InvalidInputError, match="depth"):
        DraftTree([1, 2], [-1, 0], [1, 3], [0.0, 0.0]).validate()
    with pytest.raises(InvalidInputError, match="same token"):
        DraftTree([1, 1], [-1, -1], [1, 1], [0.0, 0.0]).validate()
    with pytest.raises(InvalidInputError, match="entries"):
        DraftTree([1, 2], [-1], [1, 1], [0.0, 0.0])


# ---- bad input -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "logits, message",
    [
        (np.zeros(5), "shape"),
        (np.zeros((0, 5)), "shape"),
        (np.array([[np.nan, 1.0]]), "NaN"),
        (np.zeros((2, 3), dtype=np.int64), "floating"),
    ],
)
def test_bad_logits_give_clear_errors(logits, message):
    with pytest.raises(InvalidInputError, match=message):
        build_ddtree(logits, 4)


def test_bad_torch_logits_and_budget():
    with pytest.raises(InvalidInputError, match="shape"):
        build_ddtree(torch.zeros(3), 4)
    with pytest.raises(InvalidInputError, match="NaN"):
        build_ddtree(torch.full((2, 3), float("nan")), 4)
    for budget in (-1, 2.5, True, "8"):
        with pytest.raises(InvalidInputError, match="budget"):
            build_ddtree(np.zeros((2, 3)), budget)
    with pytest.raises(InvalidInputError, match="sorted"):
        TopK(np.array([[-2.0, -1.0]]), np.array([[0, 1]]))


# ---- CaDDTree: Algorithm 1 and Theorem 1 ------------------------------------------------------------


def random_convex_cost(
    rng: np.random.Generator, max_n: int, context_lengths=(0,)
) -> ConvexCostModel:
    curves = {}
    for length in context_lengths:
        nodes = np.unique(
            np.concatenate(([0, max_n], rng.integers(1, max_n, size=rng.integers(1, 6))))
        )
        slopes = np.sort(rng.exponential(rng.choice([1e-5, 1e-3, 3e-2]), size=nodes.size - 1))
        values = rng.uniform(0.001, 0.05) + np.concatenate(
            ([0.0], np.cumsum(slopes * np.diff(nodes)))
        )
        curves[length] = PiecewiseLinearCurve(nodes, values)
    return ConvexCostModel(curves, draft_cost=rng.uniform(1e-4, 0.05))


def brute_force_theta(logits: np.ndarray, model, context_length: int, max_n: int) -> np.ndarray:
    deltas = np.sort(np.exp(np.array(list(all_prefixes(logits).values()))))[::-1]
    phi = np.concatenate(([0.0], np.cumsum(deltas)))[: max_n + 1]
    n = np.arange(phi.size)
    return (1.0 + phi) / (model.draft_cost + model.verify_cost(n, context_length))


@settings(max_examples=200, deadline=None)
@given(small_shapes, st.integers(0, 2**31 - 1), st.integers(1, 60))
def test_caddtree_stops_at_global_argmax_under_convex_cost(shape, cost_seed, max_budget):
    """Theorem 1 / Corollary 1: the greedy stopping rule finds argmax_n theta*(n)."""
    L, V, seed = shape
    logits = random_logits(np.random.default_rng(seed), L, V)
    model = random_convex_cost(np.random.default_rng(cost_seed), max_n=64)
    tree = build_caddtree(logits, model, context_length=0, max_budget=max_budget)
    theta = brute_force_theta(logits, model, 0, max_budget)
    n_star = len(tree)
    # n* maximises theta* over every n <= max_budget (ties within round-off allowed)
    assert theta[n_star] >= theta.max() * (1 - 1e-12)
    # and it is the first such maximiser that the stopping rule can reach
    assert (np.diff(theta[: n_star + 1]) > -1e-15 * theta.max()).all()
    # the tree is DDTree's tree of the same size
    ref = build_ddtree(logits, n_star)
    np.testing.assert_array_equal(tree.token_ids, ref.token_ids)
    np.testing.assert_array_equal(tree.parents, ref.parents)
    np.testing.assert_array_equal(tree.depths, ref.depths)
    np.testing.assert_allclose(tree.log_probs, ref.log_probs)


def test_caddtree_on_large_vocab_agrees_with_surrogate_curve():
    rng = np.random.default_rng(11)
    logits = torch.from_numpy(rng.normal(0, 3, size=(15, 5000)).astype(np.float32))
    for length in (0, 300, 5000):
        model = random_convex_cost(rng, max_n=512, context_lengths=(0, 1000, 4000))
        tree = build_caddtree(logits, model, length, max_budget=512)
        theta = surrogate_throughput(logits, model, length, 512)
        assert len(tree) == int(np.argmax(theta))
        assert 0 < len(tree) <= 512


def test_caddtree_grows_with_cheaper_verification():
    """A smaller marginal verification cost can only allow a larger tree."""
    rng = np.random.default_rng(12)
    logits = rng.normal(0, 2, size=(8, 40))
    sizes = []
    for slope in (1e-2, 1e-3, 1e-4, 1e-5, 0.0):
        n = np.array([0, 10, 1000])
        model = ConvexCostModel({0: PiecewiseLinearCurve(n, 0.01 + slope * n)}, draft_cost=0.01)
        sizes.append(len(build_caddtree(logits, model, 0, max_budget=300)))
    assert sizes == sorted(sizes)
    assert sizes[-1] == 300  # free verification: grow to the cap


def test_caddtree_rejects_bad_arguments():
    model = random_convex_cost(np.random.default_rng(0), 16)
    with pytest.raises(InvalidInputError, match="context_length"):
        build_caddtree(np.zeros((2, 3)), model, -5)
    with pytest.raises(InvalidInputError, match="max_budget"):
        build_caddtree(np.zeros((2, 3)), model, 0, max_budget=-1)


# ---- lazy candidate reading (issue 10): the same trees as from fully sorted rows -----------------


def reference_topk(logits: np.ndarray) -> TopK:
    """Every token of every position, log-softmax in float64, sorted by value then token id."""
    x = np.asarray(logits, dtype=np.float64)
    m = x.max(axis=1, keepdims=True)
    logp = x - (m + np.log(np.exp(x - m).sum(axis=1, keepdims=True)))
    ids = np.stack([np.lexsort((np.arange(x.shape[1]), -row)) for row in logp])
    return TopK(np.take_along_axis(logp, ids, axis=1), ids)


def assert_same_tree(a, b):
    assert np.array_equal(a.token_ids, b.token_ids)
    assert np.array_equal(a.parents, b.parents)
    assert np.array_equal(a.depths, b.depths)
    np.testing.assert_allclose(a.log_probs, b.log_probs, rtol=0, atol=1e-12)


@settings(max_examples=120, deadline=None)
@given(
    depth=st.integers(1, 6),
    vocab=st.integers(1, 60),
    levels=st.integers(1, 6),
    budget=st.integers(0, 200),
    first_k=st.sampled_from([1, 2, 3, 32]),
    seed=st.integers(0, 10**6),
)
def test_lazy_reading_builds_the_reference_trees(depth, vocab, levels, budget, first_k, seed):
    """Logits drawn from a few levels, so ties are everywhere (within a row and between prefixes);
    a small first read forces the widening path."""
    import caddtree.core.candidates as candidates_module

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(candidates_module, "FIRST_K", first_k)
        check_lazy_against_reference(depth, vocab, levels, budget, seed)


def check_lazy_against_reference(depth, vocab, levels, budget, seed):
    rng = np.random.default_rng(seed)
    logits = rng.integers(0, levels, size=(depth, vocab)).astype(np.float64) * 0.7
    ref = reference_topk(logits)
    assert_same_tree(build_ddtree(logits, budget), build_ddtree(ref, budget))
    assert_same_tree(build_chain(logits), build_chain(ref))
    n = np.arange(0, 257, 8)
    cost = ConvexCostModel.fit({0: (n, 0.01 + 0.0004 * n + 1e-6 * n**2)}, draft_cost=0.003)
    assert_same_tree(
        build_caddtree(logits, cost, 0, max_budget=budget),
        build_caddtree(ref, cost, 0, max_budget=budget),
    )
    # the torch path normalises with torch's logsumexp, whose last bits may differ from numpy's:
    # where prefix scores tie exactly, either tied prefix is right; the scores must agree
    via_torch, expected = build_ddtree(torch.tensor(logits), budget), build_ddtree(ref, budget)
    via_torch.validate()
    np.testing.assert_allclose(via_torch.log_probs, expected.log_probs, rtol=0, atol=1e-12)


def test_widening_reads_only_what_the_expansion_reaches():
    from caddtree.core.candidates import FIRST_K, Candidates
    from caddtree.core.tree import _expand

    logits = np.random.default_rng(0).normal(size=(8, 5000))
    logits[0] *= 0.01  # a flat first position: a big tree goes deep into its candidates
    cands = Candidates(logits)
    tree = _expand(cands, 300)
    assert len(tree) == 300
    read = cands._k
    assert read[0] > FIRST_K  # widened where the expansion went past the first read
    assert all(k in (0, FIRST_K) or k > FIRST_K for k in read)
    assert min(read) <= FIRST_K  # and not everywhere: confident positions stay narrow
    assert_same_tree(tree, build_ddtree(reference_topk(logits), 300))


def test_rows_of_ties_are_read_until_something_is_usable():
    logits = np.zeros((2, 100))  # every token ties: the first read has nothing strictly better
    tree = build_ddtree(logits, 3)
    assert tree.token_ids.tolist() == [0, 1, 2] and tree.depths.tolist() == [1, 1, 1]


@settings(max_examples=60, deadline=None)
@given(
    extra=st.integers(0, 2 * 128),
    k=st.sampled_from([1, 2, 5, 32]),
    levels=st.sampled_from([3, 50, 0]),
    spike=st.sampled_from(["none", "tail", "head", "mostly-inf"]),
    dtype=st.sampled_from([np.float32, np.float64]),
    seed=st.integers(0, 10**6),
)
def test_chunked_selection_finds_the_k_largest(extra, k, levels, spike, dtype, seed):
    """The chunk-max selection returns exactly the ``k`` largest values, at indices holding
    them: with ties (few levels), the best entries in the short last chunk, rows of -inf."""
    from caddtree.core.logit_rows import CHUNK, top_candidates

    vocab = 8 * 32 * CHUNK + extra  # large enough for the chunked path at every k drawn
    rng = np.random.default_rng(seed)
    row = rng.normal(size=vocab) * 3
    if levels:
        row = np.round(row * levels / 10)
    if spike == "tail":
        row[-1 - extra // 2] = 100.0
    elif spike == "head":
        row[:k] = 100.0
    elif spike == "mostly-inf":
        row[:] = -math.inf
        row[rng.integers(0, vocab, 3)] = 1.0
    row = row.astype(dtype)
    vals, ids = top_candidates(row, k)
    np.testing.assert_array_equal(np.sort(vals), np.sort(row)[-k:])
    np.testing.assert_array_equal(row[ids], vals)
    assert len(set(ids.tolist())) == k and ids.min() >= 0 and ids.max() < vocab


def test_torch_rows_on_the_cpu_are_read_like_numpy_rows():
    """float32, bfloat16 and float64 tensors give the trees of the same logits in numpy."""
    logits = np.random.default_rng(5).normal(size=(6, 40_000)) * 2
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        t = torch.tensor(logits).to(dtype)
        expected = build_ddtree(t.double().numpy(), 60)
        got = build_ddtree(t, 60)
        assert np.array_equal(got.token_ids, expected.token_ids)
        assert np.array_equal(got.parents, expected.parents)
        np.testing.assert_allclose(got.log_probs, expected.log_probs, atol=1e-4)


# ---- the joint budget of a batch (issue 32) -------------------------------------------------------


def _batch_costs(max_nodes: int, base: float, per_node: float, bend: float) -> np.ndarray:
    """A convex, increasing round cost for n = 0 .. max_nodes nodes in all."""
    n = np.arange(max_nodes + 1, dtype=np.float64)
    return base + per_node * n + bend * n**2


def _phi(logits: np.ndarray, n: int) -> float:
    tree = build_ddtree(logits, n)
    return float(np.exp(tree.log_probs).sum()) if len(tree) else 0.0


def _batch_theta(split, phis, costs, kappa: float = 1.0) -> float:
    """The batch surrogate of ``split`` nodes per request: (B + kappa sum Phi_i(n_i)) / cost(sum
    n_i)."""
    return (len(split) + kappa * sum(p[k] for p, k in zip(phis, split))) / costs[sum(split)]


def test_the_joint_budget_of_one_request_is_caddtree():
    from caddtree.core.tree import build_joint_caddtrees

    rng = np.random.default_rng(3)
    model = ConvexCostModel(
        {0: PiecewiseLinearCurve([0, 8, 64], [0.01, 0.012, 0.05])}, draft_cost=0.004
    )
    for _ in range(5):
        logits = rng.normal(0, 2.5, size=(5, 40))
        alone = build_caddtree(logits, model, 0, max_budget=48)
        (joint,) = build_joint_caddtrees([logits], model.round_cost_table(0, 48), 48)
        assert joint.token_ids.tolist() == alone.token_ids.tolist()
        assert joint.parents.tolist() == alone.parents.tolist()


def test_the_joint_budget_is_the_best_split_of_the_best_total():
    """Brute force over every split of every total: no other choice of per-request node counts
    has a higher batch surrogate, and each request's tree is its DDTree of that size."""
    from caddtree.core.tree import build_joint_caddtrees

    rng = np.random.default_rng(7)
    for trial in range(6):
        batch = 2 + trial % 2
        drafts = [rng.normal(0, 1.0 + i, size=(4, 12)) for i in range(batch)]
        max_nodes = 9
        costs = _batch_costs(max_nodes, 1.0, 0.05 * (1 + trial), 0.01 * trial)
        trees = build_joint_caddtrees(drafts, costs, max_nodes)
        sizes = [len(t) for t in trees]
        for tree, logits in zip(trees, drafts):
            reference = build_ddtree(logits, len(tree))
            assert tree.token_ids.tolist() == reference.token_ids.tolist()
        phis = [[_phi(d, k) for k in range(max_nodes + 1)] for d in drafts]

        best = max(
            _batch_theta(split, phis, costs)
            for split in itertools.product(range(max_nodes + 1), repeat=batch)
            if sum(split) <= max_nodes
        )
        assert _batch_theta(sizes, phis, costs) == pytest.approx(best, rel=1e-12), (trial, sizes)
        assert _batch_theta(sizes, phis, costs) >= batch / costs[0]  # never below batched AR


def test_a_calibrated_joint_budget_is_the_best_split_for_its_surrogate():
    """With a calibration kappa (tokens per unit of prefix mass), brute force over every split
    finds no higher (B + kappa sum Phi_i) / cost; a smaller kappa never takes more nodes."""
    from caddtree.core.tree import build_joint_caddtrees

    rng = np.random.default_rng(13)
    for trial in range(4):
        batch, max_nodes = 2 + trial % 2, 8
        drafts = [rng.normal(0, 1.5 + i, size=(4, 10)) for i in range(batch)]
        costs = _batch_costs(max_nodes, 1.0, 0.04 * (1 + trial), 0.005 * trial)
        phis = [[_phi(d, k) for k in range(max_nodes + 1)] for d in drafts]
        totals = []
        for kappa in (1.4, 1.0, 0.75, 0.4):
            trees = build_joint_caddtrees(drafts, costs, max_nodes, calibration=kappa)
            sizes = [len(t) for t in trees]
            best = max(
                _batch_theta(split, phis, costs, kappa)
                for split in itertools.product(range(max_nodes + 1), repeat=batch)
                if sum(split) <= max_nodes
            )
            assert _batch_theta(sizes, phis, costs, kappa) == pytest.approx(best, rel=1e-12)
            totals.append(sum(sizes))
        assert totals == sorted(totals, reverse=True), totals
    with pytest.raises(InvalidInputError, match="calibration must be a positive number"):
        build_joint_caddtrees(drafts, costs, max_nodes, calibration=0.0)


def test_the_joint_budget_grows_with_cheaper_nodes_and_refuses_bad_costs():
    from caddtree.core.tree import build_joint_caddtrees

    rng = np.random.default_rng(11)
    drafts = [rng.normal(0, 3.0, size=(6, 30)) for _ in range(4)]
    steep = build_joint_caddtrees(drafts, _batch_costs(64, 1.0, 0.3, 0.0), 64)
    flat = build_joint_caddtrees(drafts, _batch_costs(64, 1.0, 0.001, 0.0), 64)
    assert sum(map(len, steep)) < sum(map(len, flat))
    assert build_joint_caddtrees([], [1.0], 0) == []
    with pytest.raises(InvalidInputError, match="one cost for each total"):
        build_joint_caddtrees(drafts, [1.0, 2.0], 5)
    with pytest.raises(InvalidInputError, match="finite and positive"):
        build_joint_caddtrees(drafts, [1.0, -2.0], 1)
