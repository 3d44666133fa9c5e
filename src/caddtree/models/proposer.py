"""The proposer side of the DFlash drafter for one sequence: one drafter pass per decoding round.

:class:`DFlashProposer` is the proposer of docs/design.md's round (the
:class:`~caddtree.engine.decoding.Proposer` protocol): it keeps the drafter's KV cache of context
features and returns the draft logits of the block after the bonus token, as
:class:`~caddtree.models.drafts.DraftLogits` (re-exported here), which holds them lazily: a
position is projected through the output head (the target's lm_head, or the rows of a draft
vocabulary: :func:`~caddtree.models.dflash.draft_lm_head`) only when a tree reaches it. The pass
itself is :class:`~caddtree.models.batch_proposer.BatchProposer`'s, with one slot.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from ..util.checks import is_int
from ..util.errors import InvalidInputError
from .batch_proposer import BatchProposer, DraftCall
from .dflash import DFlashDraftModel
from .drafts import PROJECTION_STEPS, DraftLogits

__all__ = ["PROJECTION_STEPS", "DFlashProposer", "DraftLogits"]


class DFlashProposer:
    """Runs the drafter once per decoding round (the proposer of docs/design.md's round).

    Protocol, for a target whose KV cache holds the ``start`` committed tokens ``x_0 .. x_{start-1}``
    and a bonus token ``b`` (the target's choice after them, not yet in any cache):

    1. ``propose(b, new_context_features)`` where ``new_context_features`` [1, t, k*H] are the
       target's context features of the committed tokens the drafter has not seen yet, i.e. of
       positions ``context_length .. start-1`` (so ``t = start - context_length``):

       * after prefill: the features of the whole prompt (``TreeVerifier.prefill``), ``t = T``;
       * after a verified round: the features of the bonus and the accepted nodes, exactly what
         ``TreeVerifier.commit`` returns.

       The drafter appends their keys/values (positions ``context_length .. start-1``) to its
       cache and runs the block ``[b, MASK x (B-1)]`` at positions ``start .. start+B-1``. It
       returns the draft logits of block positions ``1 .. B-1`` through the target's lm_head,
       [B-1, V]: row ``i`` is the drafter's marginal ``q_{i+1}`` for position ``start + 1 + i``.
       With a draft vocabulary the logits are over the ``K`` draft ids, [B-1, K], and
       ``token_map`` translates draft ids to target ids. The block's keys/values are dropped
       again, so afterwards ``context_length == start``. The logits come as :class:`DraftLogits`,
       which projects a position only when a tree reaches it and carries ``token_map``.
    2. ``crop(length)`` cuts the cached context back to its first ``length`` tokens (to roll back,
       or to restart drafting from an earlier committed length); the next ``propose`` must then
       pass the features from position ``length`` on.
    3. ``reset()`` forgets everything (a new prompt).

    The pass is :class:`~caddtree.models.batch_proposer.BatchProposer`'s with one slot: the
    lean runtime's arithmetic and a static cache, the drafter's weights fused and packed when the
    proposer is made (``pack``; make a new proposer after changing them).
    """

    def __init__(
        self, drafter: DFlashDraftModel, target_model: PreTrainedModel, *, pack: bool = True
    ) -> None:
        #: the pass itself: :class:`~caddtree.models.batch_proposer.BatchProposer`, one slot
        self.passes = BatchProposer(drafter, target_model, 1, pack=pack)
        self.drafter = drafter
        self.lm_head = self.passes.lm_head
        #: target id of each draft id (numpy int64 [K]), or ``None`` with the full vocabulary
        self.token_map = self.passes.token_map

    @property
    def block_size(self) -> int:
        return self.drafter.block_size

    @property
    def target_layer_ids(self) -> tuple[int, ...]:
        """The target layers whose features :meth:`propose` expects, in order."""
        return self.drafter.target_layer_ids

    def packed_layers(self) -> int:
        """How many of the pass's (fused) linear layers are packed."""
        return self.passes.packed_layers()

    @property
    def projection_steps(self) -> tuple[int, ...]:
        """How :meth:`propose`'s logits are projected (see :class:`DraftLogits`)."""
        return self.passes.projection_steps

    @projection_steps.setter
    def projection_steps(self, steps: tuple[int, ...]) -> None:
        self.passes.projection_steps = tuple(steps)

    @property
    def context_length(self) -> int:
        """How many committed tokens the drafter's cache holds."""
        return self.passes.lengths[0]

    def reset(self) -> None:
        """Empty the drafter's cache (call before a new prompt)."""
        self.passes.reset(0)

    def crop(self, context_length: int) -> None:
        """Keep only the first ``context_length`` cached context tokens."""
        if not is_int(context_length) or not 0 <= context_length <= self.context_length:
            raise InvalidInputError(
                f"cannot crop the drafter's context of {self.context_length} tokens "
                f"to {context_length!r}"
            )
        self.passes.lengths[0] = int(context_length)

    def propose(self, bonus_token: int, new_context_features: torch.Tensor) -> DraftLogits:
        """Draft logits ``[B-1, V]`` for the ``B - 1`` positions after ``bonus_token`` (see the
        class doc), as :class:`DraftLogits`: projected per position on demand."""
        features = new_context_features
        width = self.drafter.fc.in_features
        if features.ndim != 3 or features.shape[0] != 1 or features.shape[2] != width:
            raise InvalidInputError(
                f"new_context_features must have shape [1, t, {width}], got {tuple(features.shape)}"
            )
        return self.passes.propose([DraftCall(0, int(bonus_token), features[0])])[0]
