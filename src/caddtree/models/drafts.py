"""Draft logits of one drafter pass, projected to the vocabulary only where a tree reaches
(:class:`DraftLogits`): what every proposer returns."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from ..core.tree import DraftTree
from ..util.checks import is_int
from ..util.errors import InvalidInputError

__all__ = ["PROJECTION_STEPS", "DraftLogits"]


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
