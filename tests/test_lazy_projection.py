"""The drafter's projection on demand: trees built from :class:`DraftLogits` equal trees built from
the full logits for every policy, and only the positions the expansion reached are projected."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from caddtree import ConvexCostModel, InvalidInputError, build_caddtree, build_chain, build_ddtree
from caddtree.core.cost import PiecewiseLinearCurve
from caddtree.core.tree import DraftRows
from caddtree.engine.decoding import decode, make_policy
from caddtree.models import DFlashProposer, TreeVerifier
from caddtree.models.drafts import PROJECTION_STEPS, DraftLogits
from tiny_models import FEATURE_LAYER_IDS, new_drafter


def exact_head(rng: np.random.Generator, hidden_size: int, vocab: int) -> torch.nn.Linear:
    """A head with weights in {-1, 0, 1}: on integer hidden states every logit is an exact small
    integer, so projecting one row or a whole block gives the same bits (and ties are common)."""
    head = torch.nn.Linear(hidden_size, vocab, bias=False).to(torch.float64)
    with torch.no_grad():
        head.weight.copy_(torch.from_numpy(rng.integers(-1, 2, size=(vocab, hidden_size))))
    return head.requires_grad_(False)


def assert_same_tree(a, b):
    assert np.array_equal(a.token_ids, b.token_ids)
    assert np.array_equal(a.parents, b.parents)
    assert np.array_equal(a.depths, b.depths)
    assert np.array_equal(a.log_probs, b.log_probs)


COST = ConvexCostModel.fit(
    {0: (np.arange(0, 257, 8), 0.01 + 0.0004 * np.arange(0, 257, 8))}, draft_cost=0.003
)

step_schedules = st.sampled_from([(), (1,), (1, 1, 1, 1, 1, 1, 1), (2,), (1, 3)])


@settings(max_examples=150, deadline=None)
@given(
    depth=st.integers(1, 7),
    vocab=st.integers(1, 40),
    budget=st.integers(0, 120),
    steps=step_schedules,
    seed=st.integers(0, 10**6),
)
def test_lazy_rows_build_the_trees_of_the_full_logits(depth, vocab, budget, steps, seed):
    rng = np.random.default_rng(seed)
    hidden = torch.from_numpy(rng.integers(0, 3, size=(depth, 4)).astype(np.float64))
    head = exact_head(rng, 4, vocab)
    full = head(hidden)

    def lazy() -> DraftLogits:
        return DraftLogits(hidden, head, steps)

    assert isinstance(lazy(), DraftRows)
    rows = lazy()
    tree = build_ddtree(rows, budget)
    assert_same_tree(tree, build_ddtree(full, budget))
    check_projected(rows, tree, steps)
    rows = lazy()
    tree = build_caddtree(rows, COST, 0, max_budget=budget)
    assert_same_tree(tree, build_caddtree(full, COST, 0, max_budget=budget))
    check_projected(rows, tree, steps)
    rows = lazy()
    assert_same_tree(build_chain(rows), build_chain(full))
    assert rows.projected == depth and rows.calls == 1  # the chain: one projection


def check_projected(rows: DraftLogits, tree, steps) -> None:
    """One position per projection: the tree's depth, and at most one position past it (that of
    a deepest node's child, read when that child reached the top of the heap). Projections of
    several positions at once may run ahead of the tree, but never past what their steps allow."""
    depth = rows.shape[0]
    if rows.calls <= len(steps) and set(steps[: rows.calls]) <= {1}:
        assert rows.projected == rows.calls
        if len(tree):
            assert tree.max_depth <= rows.projected <= min(depth, tree.max_depth + 1)
        else:  # nothing, or only position 1 (the cost-aware rule took no node)
            assert rows.projected <= 1
    else:
        assert rows.projected == min(depth, sum(steps[: rows.calls])) or rows.projected == depth
    assert len(tree) == 0 or rows.projected >= tree.max_depth


def confident_logits(depth: int, vocab: int) -> tuple[torch.Tensor, torch.nn.Linear]:
    """Hidden states and a head whose position ``i`` puts almost all its mass on token ``i``."""
    hidden = torch.eye(depth, dtype=torch.float64)
    head = torch.nn.Linear(depth, vocab, bias=False).to(torch.float64).requires_grad_(False)
    with torch.no_grad():
        head.weight.zero_()
        head.weight[:depth, :depth] = 20.0 * torch.eye(depth, dtype=torch.float64)
    return hidden, head


@pytest.mark.parametrize("budget", [1, 2, 3, 5])
def test_a_chain_shaped_tree_projects_only_its_depth(budget):
    hidden, head = confident_logits(8, 30)
    rows = DraftLogits(hidden, head, steps=(1,) * 8)
    tree = build_ddtree(rows, budget)
    assert tree.depths.tolist() == list(range(1, budget + 1))  # a chain: one node per depth
    assert rows.projected == budget  # not one position more: the last child was never read
    assert rows.calls == budget
    assert_same_tree(tree, build_ddtree(head(hidden), budget))


def test_the_cost_aware_rule_can_stop_before_reading_the_next_position():
    hidden, head = confident_logits(8, 30)
    # verifying one node is cheap, a second one is not
    steep = ConvexCostModel(
        {0: PiecewiseLinearCurve([0, 1, 2, 64], [0.01, 0.011, 0.5, 31.5])}, draft_cost=0.01
    )
    rows = DraftLogits(hidden, head, steps=(1,) * 8)
    tree = build_caddtree(rows, steep, 0, max_budget=64)
    assert len(tree) == 1
    assert rows.projected == 1  # the bound on the child at depth 2 already failed the rule
    assert_same_tree(tree, build_caddtree(head(hidden), steep, 0, max_budget=64))


def test_default_schedule_projects_two_positions_then_the_rest():
    hidden, head = confident_logits(8, 30)
    for budget in (1, 2):  # one node reads position 1, two nodes position 2: one projection
        rows = DraftLogits(hidden, head)
        build_ddtree(rows, budget)
        assert rows.projected == 2 and rows.calls == 1
    rows = DraftLogits(hidden, head)
    build_ddtree(rows, 3)  # a third depth: the rest of the block in a second projection
    assert rows.projected == 8 and rows.calls == 2
    assert torch.equal(rows.rows(), torch.cat([head(hidden[:2]), head(hidden[2:])]))


def test_draft_logits_slicing_and_errors():
    hidden, head = confident_logits(6, 30)
    rows = DraftLogits(hidden, head)[:4]
    assert rows.shape == (4, 30)
    assert torch.equal(rows.rows(), head(hidden[:4]))
    with pytest.raises(InvalidInputError, match="before reading"):
        rows[:2]
    with pytest.raises(InvalidInputError, match="leading slice"):
        DraftLogits(hidden, head)[1:3]
    with pytest.raises(IndexError):
        DraftLogits(hidden, head).row(6)
    with pytest.raises(InvalidInputError, match="steps"):
        DraftLogits(hidden, head, steps=(0,))


# ---- the proposer ----------------------------------------------------------------------------------


def test_draft_logits_project_on_demand_what_one_projection_gives(qwen3):
    drafter = new_drafter(qwen3)
    features = torch.randn(
        1,
        5,
        drafter.fc.in_features,
        dtype=torch.float64,
        generator=torch.Generator().manual_seed(0),
    )
    full = DFlashProposer(drafter, qwen3).propose(3, features).rows()
    lazy = DFlashProposer(drafter, qwen3).propose(3, features)
    assert lazy.projected == 0 and lazy.shape == tuple(full.shape)
    position_one = lazy.row(0)  # a first few positions: another matmul shape, same to rounding
    torch.testing.assert_close(position_one, full[0], rtol=0, atol=1e-12)
    assert lazy.projected == PROJECTION_STEPS[0] < lazy.shape[0]
    torch.testing.assert_close(lazy.rows(), full, rtol=0, atol=1e-12)
    untouched = DFlashProposer(drafter, qwen3).propose(3, features)
    assert torch.equal(untouched.rows(), full)  # projected in one go: the same logits exactly


@pytest.mark.parametrize("method", ["ddtree", "caddtree", "dflash"])
def test_decoding_projects_only_what_its_trees_reached(qwen3, method):
    drafter = new_drafter(qwen3)
    proposer = DFlashProposer(drafter, qwen3)
    proposer.projection_steps = (1,) * drafter.block_size  # one position per projection
    kwargs = {"ddtree": {"budget": 1}, "caddtree": {"cost_model": COST, "max_budget": 8}}
    result = decode(
        TreeVerifier(qwen3, FEATURE_LAYER_IDS),
        [5, 17, 3, 44],
        make_policy(method, **kwargs.get(method, {})),
        proposer=proposer,
        max_new_tokens=20,
    )
    block = drafter.block_size - 1
    projected = []
    for r in result.stats.per_round:
        assert 0 <= r.projected <= block
        if r.projected == 0:  # no draft: the last round, with room for the bonus token only
            assert r.budget == 0 and r.project_s == 0
        assert 0 <= r.project_s <= r.draft_s
        assert 0 <= r.forward_s <= r.verify_s
        assert r.draft_s + r.tree_s + r.verify_s <= r.round_s
        projected.append(r.projected)
    assert projected[0] >= 1
    if method == "ddtree":  # one node: position 1 only, never the rest of the block
        assert set(projected) <= {0, 1}
    if method == "dflash":  # the chain reads the whole block (the last rounds may be shorter)
        assert projected[0] == block
