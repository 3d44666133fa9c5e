"""The proposer side of the DFlash drafter: one drafter pass per decoding round, and its logits.

:class:`DFlashProposer` is the proposer of docs/design.md's round (the
:class:`~caddtree.engine.decoding.Proposer` protocol): it keeps the drafter's KV cache of context features
and returns the draft logits of the block after the bonus token. :class:`DraftLogits` holds them
lazily: a position is projected through the output head (the target's lm_head, or the rows of a
draft vocabulary: :func:`~caddtree.models.dflash.draft_lm_head`) only when a tree reaches it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

import numpy as np
import torch
from torch import nn
from transformers import DynamicCache, PreTrainedModel

from ..core.tree import DraftTree
from ..util.checks import is_int
from ..util.errors import CheckpointError, InvalidInputError
from .dflash import DFlashDraftModel, check_drafter_fits_target, draft_lm_head
from .target import compact_cache

__all__ = ["PROJECTION_STEPS", "DFlashProposer", "DraftLogits"]


PROJECTION_STEPS = (2,)
"""Positions per projection of :class:`DraftLogits`, in order; once used up, the rest in one call.
Two first: every tree of more than one node reads positions 1 and 2 (the first node's child is
the next prefix the expansion looks at), so they cost one projection, not two; a tree that goes
deeper costs one more, for the rest of the block."""


class DraftLogits:
    """The draft logits of one block, ``[L, V]``, projected to the vocabulary on demand, and the
    map from their vocabulary to the target's.

    Holds the final hidden states of one drafter pass over the ``L`` drafted positions, ``[L, H]``,
    and the output ``head`` (the target's lm_head, or the draft-vocabulary head of
    :func:`draft_lm_head`). It is a :class:`caddtree.core.candidates.DraftRows`: the tree builders
    call :meth:`row` when the expansion first reaches a depth, so positions the tree never reaches
    are never projected; :meth:`rows` projects the whole block at once (the chain, which reads
    every position).

    A projection reads the whole head from memory however few rows it computes, so one row costs
    far more than ``1 / L`` of the block's projection. Positions are therefore projected in a few
    calls, in order: ``steps[0]`` rows the first time position 1 is needed, ``steps[1]`` rows when
    the first position past those is needed, ..., and every remaining position at once after the
    last step (default :data:`PROJECTION_STEPS`). ``steps=(1,) * L`` projects one position at a
    time; ``steps=()`` the whole block at the first read. :meth:`precomputed` wraps logits that are
    already projected (a proposer that computes them some other way).

    ``token_map`` (numpy int64 ``[V]``, or ``None`` when the head scores the target's own
    vocabulary) is the target id of each draft id; :meth:`in_target_ids` maps a tree built from
    these logits to the target's ids.

    Attributes:
        projected: how many positions have been projected so far (always the first ones).
        project_s: wall seconds spent projecting, with the device synchronised.
        calls: how many projections that took.
    """

    def __init__(
        self,
        hidden: torch.Tensor,
        head: nn.Linear | None,
        steps: Sequence[int] = PROJECTION_STEPS,
        token_map: np.ndarray | None = None,
    ) -> None:
        if hidden.ndim != 2:
            raise InvalidInputError(f"hidden states must be [L, H], got {tuple(hidden.shape)}")
        if any(not is_int(k) or k < 1 for k in steps):
            raise InvalidInputError(f"projection steps must be positive integers, got {steps!r}")
        self.hidden, self.head, self.steps, self.token_map = hidden, head, tuple(steps), token_map
        vocab = hidden.shape[1] if head is None else head.weight.shape[0]
        self.shape = (int(hidden.shape[0]), int(vocab))
        self.projected = 0
        self.project_s = 0.0
        self._rows: list[torch.Tensor] = []  # one [V] view per projected position
        self._chunks: list[torch.Tensor] = []  # the projections' outputs, in order
        if head is None:  # already projected
            self._chunks, self._rows, self.projected = [hidden], list(hidden.unbind(0)), len(hidden)

    @classmethod
    def precomputed(cls, logits: torch.Tensor, token_map: np.ndarray | None = None) -> DraftLogits:
        """Logits ``[L, V]`` computed already (nothing left to project)."""
        return cls(torch.as_tensor(logits), None, (), token_map)

    @property
    def calls(self) -> int:
        return len(self._chunks) if self.head is not None else 0

    def __getitem__(self, index: slice) -> DraftLogits:
        """The first positions only (``logits[:n]``), before anything is projected."""
        if not isinstance(index, slice) or index.start not in (None, 0) or index.step is not None:
            raise InvalidInputError("DraftLogits only takes a leading slice, logits[:n]")
        if self.head is None:
            return DraftLogits.precomputed(self.hidden[index], self.token_map)
        if self.projected:
            raise InvalidInputError("slice DraftLogits before reading any row")
        return DraftLogits(self.hidden[index], self.head, self.steps, self.token_map)

    def row(self, i: int) -> torch.Tensor:
        """The logits of position ``i + 1``, ``[V]``, projecting up to it if needed."""
        if not 0 <= i < self.shape[0]:
            raise IndexError(f"position {i} of a block of {self.shape[0]}")
        while i >= self.projected:
            calls = self.calls
            size = self.steps[calls] if calls < len(self.steps) else self.shape[0]
            self._project(min(self.projected + size, self.shape[0]))
        return self._rows[i]

    def rows(self) -> torch.Tensor:
        """Every position's logits, ``[L, V]``: what is left is projected in one call."""
        if self.projected < self.shape[0]:
            self._project(self.shape[0])
        return self._chunks[0] if len(self._chunks) == 1 else torch.cat(self._chunks)

    def confidence(self) -> float:
        """The drafter's largest position-1 probability."""
        row = self.row(0).detach().double()
        return math.exp(float(row.max() - torch.logsumexp(row, 0)))

    def in_target_ids(self, tree: DraftTree) -> DraftTree:
        """``tree`` (built from these logits) with its draft ids mapped to the target's ids."""
        if self.token_map is None or not len(tree):
            return tree
        return tree.map_tokens(self.token_map)

    @torch.no_grad()
    def _project(self, end: int) -> None:
        t0 = time.perf_counter()
        chunk = self.head(self.hidden[self.projected : end])
        if chunk.device.type == "cuda":
            torch.cuda.synchronize(chunk.device)
        self.project_s += time.perf_counter() - t0
        self._chunks.append(chunk)
        self._rows.extend(chunk.unbind(0))
        self.projected = end


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
    """

    def __init__(self, drafter: DFlashDraftModel, target_model: PreTrainedModel) -> None:
        check_drafter_fits_target(drafter, target_model.config)
        self.drafter = drafter
        self.embed_tokens = target_model.get_input_embeddings()
        lm_head = target_model.get_output_embeddings()
        if self.embed_tokens is None or lm_head is None:
            raise CheckpointError("the target model must have input embeddings and an lm_head")
        ids = drafter.draft_token_ids
        self.lm_head = draft_lm_head(lm_head, ids)
        #: target id of each draft id (numpy int64 [K]), or ``None`` with the full vocabulary
        self.token_map = None if ids is None else ids.cpu().numpy()
        #: how :meth:`propose`'s logits are projected (see :class:`DraftLogits`)
        self.projection_steps: tuple[int, ...] = PROJECTION_STEPS
        self.reset()

    @property
    def block_size(self) -> int:
        return self.drafter.block_size

    @property
    def target_layer_ids(self) -> tuple[int, ...]:
        """The target layers whose features :meth:`propose` expects, in order."""
        return self.drafter.target_layer_ids

    @property
    def context_length(self) -> int:
        """How many committed tokens the drafter's cache holds."""
        return self._context_length

    def reset(self) -> None:
        """Empty the drafter's cache (call before a new prompt)."""
        self.cache = DynamicCache()  # context keys/values of every drafter layer
        self._context_length = 0

    def crop(self, context_length: int) -> None:
        """Keep only the first ``context_length`` cached context tokens."""
        if not is_int(context_length) or not 0 <= context_length <= self._context_length:
            raise InvalidInputError(
                f"cannot crop the drafter's context of {self._context_length} tokens "
                f"to {context_length!r}"
            )
        compact_cache(self.cache, context_length)
        self._context_length = context_length

    @torch.no_grad()
    def propose(self, bonus_token: int, new_context_features: torch.Tensor) -> DraftLogits:
        """Draft logits ``[B-1, V]`` for the ``B - 1`` positions after ``bonus_token`` (see the
        class doc), as :class:`DraftLogits`: projected per position on demand."""
        drafter = self.drafter
        weight = drafter.fc.weight
        features = new_context_features
        if (
            features.ndim != 3
            or features.shape[0] != 1
            or features.shape[2] != drafter.fc.in_features
        ):
            raise InvalidInputError(
                f"new_context_features must have shape [1, t, {drafter.fc.in_features}], "
                f"got {tuple(features.shape)}"
            )
        start = self._context_length + features.shape[1]
        block = torch.full(
            (1, self.block_size), drafter.mask_token_id, dtype=torch.long, device=weight.device
        )
        block[0, 0] = int(bonus_token)
        positions = torch.arange(
            self._context_length, start + self.block_size, device=weight.device
        )
        hidden = drafter(
            noise_embedding=self.embed_tokens(block.to(self.embed_tokens.weight.device)).to(weight),
            target_hidden=features.to(weight),
            position_ids=positions.unsqueeze(0),
            past_key_values=self.cache,
        )
        compact_cache(self.cache, start)  # drop the block's keys/values
        self._context_length = start
        return DraftLogits(
            hidden[0, 1:].to(self.lm_head.weight),
            self.lm_head,
            self.projection_steps,
            self.token_map,
        )
