"""One drafter pass for several sequences (caddtree.models.batch_proposer) drafts what the
drafter module's own forward drafts for each sequence over its whole context: float64, sequences
of other lengths in slots out of order, over several passes, with slots joining (reset) and the
cache growing."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from caddtree import InvalidInputError
from caddtree.models.batch_proposer import BatchProposer, DraftCall
from caddtree.models.dflash import draft_lm_head
from caddtree.models.proposer import DFlashProposer
from tiny_models import new_drafter, qwen3_target


@pytest.fixture(scope="module")
def pair():
    target = qwen3_target()
    return target, new_drafter(target)


def features(drafter, rows: int, seed: int) -> torch.Tensor:
    width = drafter.fc.in_features
    return torch.randn(
        rows, width, generator=torch.Generator().manual_seed(seed), dtype=torch.float64
    )


def module_draft(
    target, drafter, bonus: int, context: torch.Tensor, size: int | None = None
) -> torch.Tensor:
    """The drafter module's forward over the whole ``context`` [T, k*H] (no cache), then the
    block ``[bonus, MASK, ..]`` of ``size`` positions (the drafter's block size by default)
    right after it: the draft logits of positions 1 .. size-1."""
    size = size or drafter.block_size
    block = torch.tensor([[bonus] + [drafter.mask_token_id] * (size - 1)])
    with torch.no_grad():
        hidden = drafter(
            target.get_input_embeddings()(block),
            context[None],
            torch.arange(context.shape[0] + size)[None],
        )
        head = draft_lm_head(target.get_output_embeddings(), drafter.draft_token_ids)
        return head(hidden[0, 1:])


@pytest.mark.parametrize("at_once", [False, True])
def test_each_sequence_of_a_pass_drafts_what_the_module_drafts_over_its_context(pair, at_once):
    """Projected on demand, or every block's positions in one call (``project_at_once``, the
    choice where the AMX tile unit makes rows almost free)."""
    target, drafter = pair
    batched = BatchProposer(drafter, target, slots=4)
    batched.project_at_once = at_once
    history = {slot: features(drafter, 0, 0) for slot in range(4)}
    rng = np.random.default_rng(0)
    active = [2, 0, 3]
    for step in range(6):
        if step == 3:  # slot 1 joins, slot 0 leaves and a new request takes it
            active = [1, 3, 2, 0]
            batched.reset(0)
            history[0] = history[0][:0]
        calls = [
            DraftCall(
                slot,
                int(rng.integers(0, 90)),
                features(
                    drafter,
                    9 if step == 0 or (step == 3 and slot in (0, 1)) else int(rng.integers(1, 5)),
                    10 * step + slot,
                ),
            )
            for slot in active
        ]
        ours = batched.propose(calls)
        assert all((d.projected == d.shape[0]) == at_once for d in ours)
        for call, draft in zip(calls, ours):
            history[call.slot] = torch.cat([history[call.slot], call.features])
            expected = module_draft(target, drafter, call.bonus, history[call.slot])
            torch.testing.assert_close(draft.rows(), expected, rtol=1e-10, atol=1e-10)
            assert batched.lengths[call.slot] == history[call.slot].shape[0]
    assert batched.capacity >= max(batched.lengths)


def test_a_shorter_block_drafts_what_the_module_drafts_for_that_block(pair):
    """``propose(calls, positions=[q_1, ..])`` runs call ``i``'s block with ``q_i`` positions
    (the batch decoder's: as deep as its tree can reach): each sequence's logits are the
    module's for its own ``q_i``-block, and the context the pass appends is the same whatever
    the sizes."""
    target, drafter = pair
    batched = BatchProposer(drafter, target, slots=2)
    seen = {slot: features(drafter, 0, 0) for slot in range(2)}
    for step, q in enumerate((2, 5, drafter.block_size, 3)):
        calls = [
            DraftCall(slot, 3 * step + slot, features(drafter, 2 + slot, step)) for slot in (1, 0)
        ]
        sizes = [q, max(2, q - 1)]  # each call its own block size
        for call, draft, size in zip(calls, batched.propose(calls, sizes), sizes):
            seen[call.slot] = torch.cat([seen[call.slot], call.features])
            assert draft.shape[0] == size - 1
            expected = module_draft(target, drafter, call.bonus, seen[call.slot], size)
            torch.testing.assert_close(draft.rows(), expected, rtol=1e-10, atol=1e-10)
    for sizes in ([1, 3], [drafter.block_size + 1, 3], [2.5, 3], [3]):
        with pytest.raises(InvalidInputError, match="positions per block"):
            batched.propose(calls, sizes)


def test_the_single_sequence_proposer_is_the_one_slot_pass(pair):
    """DFlashProposer drafts through BatchProposer's pass: over passes, as the module does."""
    target, drafter = pair
    alone = DFlashProposer(drafter, target)
    seen = features(drafter, 0, 0)
    for step, rows in enumerate((7, 1, 3)):
        new = features(drafter, rows, step)
        seen = torch.cat([seen, new])
        ours = alone.propose(step + 5, new[None]).rows()
        torch.testing.assert_close(ours, module_draft(target, drafter, step + 5, seen))
    assert alone.context_length == seen.shape[0] == 11
    assert alone.packed_layers() == 0  # float64: nothing is packed


def test_a_pass_grows_the_cache_and_refuses_repeated_slots(pair):
    target, drafter = pair
    batched = BatchProposer(drafter, target, slots=2)
    short, long = features(drafter, 10, 2), features(drafter, 300, 1)
    batched.propose([DraftCall(1, 4, short)])
    assert batched.capacity == 256
    ours = batched.propose([DraftCall(1, 5, long)])[0]  # grows, carrying the 10 entries over
    whole = torch.cat([short, long])
    torch.testing.assert_close(ours.rows(), module_draft(target, drafter, 5, whole))
    assert batched.capacity >= 310 + drafter.block_size
    with pytest.raises(InvalidInputError, match="distinct slots"):
        batched.propose([DraftCall(0, 1, long[:1]), DraftCall(0, 2, long[:1])])


def test_in_bfloat16_a_sequence_drafts_the_same_bits_alone_or_in_a_pass(pair):
    """With caddtree's kernels (one attention call for every block of a pass), each sequence's
    draft logits are the bits a pass of that sequence alone gives."""
    from caddtree.runtime import kernels

    if not kernels.kernel_available():
        pytest.skip("needs caddtree's kernels (AVX512-BF16 or AVX2, and g++)")
    target, drafter = (m.to(torch.bfloat16) for m in copy.deepcopy(pair))
    together, alone = BatchProposer(drafter, target, slots=3), BatchProposer(drafter, target, 3)
    assert together.fused_attention
    calls = [
        DraftCall(slot, 7 * slot + 1, features(drafter, 3 + 2 * slot, slot).bfloat16())
        for slot in (2, 0, 1)
    ]
    for draft, call in zip(together.propose(calls), calls):
        torch.testing.assert_close(draft.rows(), alone.propose([call])[0].rows(), rtol=0, atol=0)
