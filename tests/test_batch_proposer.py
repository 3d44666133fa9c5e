"""One drafter pass for several sequences (caddtree.models.batch_proposer) drafts what the
single-sequence proposer drafts for each alone: float64, sequences of other lengths in slots out
of order, over several passes, with slots joining (reset) and the cache growing."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from caddtree import InvalidInputError
from caddtree.models.batch_proposer import BatchProposer, DraftCall
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


def test_each_sequence_of_a_pass_drafts_as_it_would_alone(pair):
    target, drafter = pair

    batched = BatchProposer(drafter, target, slots=4)
    alone = {slot: DFlashProposer(drafter, target) for slot in range(4)}
    rng = np.random.default_rng(0)
    active = [2, 0, 3]
    for step in range(6):
        if step == 3:  # slot 1 joins, slot 0 leaves and a new request takes it
            active = [1, 3, 2, 0]
            batched.reset(0)
            alone[0].reset()
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
        for call, draft in zip(calls, ours):
            theirs = alone[call.slot].propose(call.bonus, call.features[None])
            torch.testing.assert_close(draft.rows(), theirs.rows(), rtol=1e-10, atol=1e-10)
            assert batched.lengths[call.slot] == alone[call.slot].context_length
    assert batched.capacity >= max(batched.lengths)


def test_a_pass_grows_the_cache_and_refuses_repeated_slots(pair):
    target, drafter = pair
    batched = BatchProposer(drafter, target, slots=2)
    alone = DFlashProposer(drafter, target)
    long = features(drafter, 300, 1)  # past the first 256 entries
    ours = batched.propose([DraftCall(1, 5, long)])[0]
    torch.testing.assert_close(ours.rows(), alone.propose(5, long[None]).rows())
    assert batched.capacity >= 300 + drafter.block_size
    with pytest.raises(InvalidInputError, match="distinct slots"):
        batched.propose([DraftCall(0, 1, long[:1]), DraftCall(0, 2, long[:1])])
