"""The rows of one call of the lean runtime (:class:`Rows`): which sequences, in which cache
slots, after how many entries, under which mask; and the inputs each attention path takes of
them (:mod:`caddtree.runtime.lean`, :mod:`caddtree.runtime.compiled`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from ..core.tree import DraftTree
from ..util.errors import InvalidInputError
from .verifier import tree_position_ids

__all__ = ["Rows", "tree_rows"]


@dataclass
class Rows:
    """The rows of one :meth:`LeanTarget.forward` call: ``len(slots)`` sequences, the rows of
    each consecutive. Build it with :meth:`single` or :meth:`batch`.

    * ``tokens``, ``positions`` [N]: token ids and rotary positions of every row;
    * ``slots``, ``starts``, ``counts``: per sequence, its cache slot, the cache entries before its
      rows (they are written at ``start .. start + count - 1``) and how many rows it has;
    * ``mask``: [B, 1, n_max, L] boolean (True: may attend), or ``None`` where no mask is needed
      (one row per sequence, each seeing all its ``start + 1`` keys, all of one length);
    * ``causal``: a single sequence with no cache before it and causal rows (SDPA's own mask).
    """

    tokens: torch.Tensor
    positions: torch.Tensor
    slots: list[int]
    starts: list[int]
    counts: list[int]
    mask: torch.Tensor | None
    causal: bool = False
    write_index: tuple[torch.Tensor, torch.Tensor] | None = None  # (slot, cache entry) per row
    padded_index: torch.Tensor | None = None  # row -> b * n_max + j, for several sequences

    _grouped: torch.Tensor | None = field(default=None, repr=False)
    _attention: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)

    def cache_entries(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Per row, the cache slot and entry its keys and values are written at [N] each, as
        tensors of their own (not views into another: a compiled graph is guarded on its inputs'
        storage offsets, so one sequence and several must give it the same kind of tensor)."""
        if self.write_index is not None:
            return self.write_index[0].clone(), self.write_index[1].clone()
        n, device = self.tokens.shape[0], self.tokens.device
        entries = torch.arange(self.starts[0], self.starts[0] + n, device=device)
        return torch.full((n,), self.slots[0], dtype=torch.long, device=device), entries

    def attention_inputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``mask`` [N, L] and ``seqs`` [B, 3] of
        :func:`~caddtree.runtime.kernels.tree_attention_batch` for these rows (for one sequence,
        ``mask`` is :func:`~caddtree.runtime.kernels.tree_attention`'s), made once per call.
        ``seqs`` has two entries at least (a lone sequence gets an empty one after it), so that
        its size is never specialised in a compiled graph."""
        if self._attention is None:
            n, device = self.tokens.shape[0], self.tokens.device
            if self.mask is None:
                mask = torch.ones((n, self.length), dtype=torch.bool, device=device)
            elif len(self.slots) == 1:
                mask = self.mask[0, 0]
            else:
                b, _, n_max, length = self.mask.shape
                mask = self.mask.view(b * n_max, length)[self.padded_index]
            spans = zip(self.slots, self.starts, self.counts)
            seqs = [(slot, count, start + count) for slot, start, count in spans]
            seqs += [(self.slots[0], 0, 1)] * (2 - len(seqs))
            self._attention = mask, torch.tensor(seqs, dtype=torch.long)
        return self._attention

    def grouped_mask(self, groups: int) -> torch.Tensor | None:
        """The mask for ``groups`` query heads stacked per key/value head (row ``g * n_max + i``
        is row ``i``'s), made once per call; a one-row mask broadcasts as it is."""
        if self.mask is None or self.n_max == 1 or groups == 1:
            return self.mask
        if self._grouped is None:
            self._grouped = self.mask.repeat(1, 1, groups, 1)
        return self._grouped

    @property
    def length(self) -> int:
        """Keys attended over: the longest sequence's cache entries plus rows."""
        return max(s + c for s, c in zip(self.starts, self.counts))

    @property
    def n_max(self) -> int:
        return max(self.counts)

    @classmethod
    def single(
        cls,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        start: int,
        visibility: np.ndarray | None,
        slot: int = 0,
    ) -> Rows:
        """One sequence's ``tokens`` after ``start`` cache entries; ``visibility`` [n, n] says
        which rows see which (``None``: causal, as a prompt)."""
        n = int(tokens.shape[0])
        if n == 1:
            return cls(tokens, positions, [slot], [start], [1], None)
        if visibility is None and start == 0:
            return cls(tokens, positions, [slot], [start], [n], None, causal=True)
        mask = torch.ones((1, 1, n, start + n), dtype=torch.bool)
        mask[0, 0, :, start:] = _visibility(visibility, n)
        return cls(tokens, positions, [slot], [start], [n], mask.to(tokens.device))

    @classmethod
    def batch(
        cls,
        sequences: Sequence[tuple[int, int, Sequence[int], Sequence[int], np.ndarray | None]],
        device: torch.device | str,
    ) -> Rows:
        """Several sequences, each ``(slot, start, tokens, positions, visibility)`` as in
        :meth:`single`; slots must differ."""
        if len(sequences) == 1:
            slot, start, tokens, positions, visibility = sequences[0]
            ids = torch.as_tensor(np.asarray([tokens, positions], dtype=np.int64)).to(device)
            return cls.single(ids[0], ids[1], start, visibility, slot)
        slots = [int(s[0]) for s in sequences]
        if len(set(slots)) != len(slots):
            raise InvalidInputError(f"each sequence of a call needs its own cache slot: {slots}")
        starts = [int(s[1]) for s in sequences]
        counts = [len(s[2]) for s in sequences]
        if min(counts) < 1:
            raise InvalidInputError("every sequence of a call needs at least one row")
        n_max, length = max(counts), max(s + c for s, c in zip(starts, counts))
        mask = np.zeros((len(sequences), 1, n_max, length), dtype=bool)
        for b, (start, count, seq) in enumerate(zip(starts, counts, sequences)):
            mask[b, 0, :count, :start] = True
            mask[b, 0, :count, start : start + count] = _visibility(seq[4], count)
            mask[b, 0, count:, 0] = True  # padding rows: any one key, never read
        row_b = np.repeat(np.arange(len(sequences)), counts)
        row_j = np.concatenate([np.arange(c) for c in counts])
        flat = np.stack(
            (
                np.concatenate([np.asarray(s[2], dtype=np.int64) for s in sequences]),
                np.concatenate([np.asarray(s[3], dtype=np.int64) for s in sequences]),
                np.asarray(slots, dtype=np.int64)[row_b],
                np.asarray(starts, dtype=np.int64)[row_b] + row_j,
                row_b * n_max + row_j,
            )
        )
        flat_t = torch.from_numpy(flat).to(device)
        uniform = n_max == 1 and len(set(starts)) == 1
        return cls(
            flat_t[0],
            flat_t[1],
            slots,
            starts,
            counts,
            None if uniform else torch.from_numpy(mask).to(device),
            write_index=(flat_t[2], flat_t[3]),
            padded_index=flat_t[4],
        )


def _visibility(visibility: np.ndarray | torch.Tensor | None, n: int) -> torch.Tensor:
    if visibility is None:
        return torch.ones((n, n), dtype=torch.bool).tril_()
    visible = torch.as_tensor(np.asarray(visibility, dtype=bool))
    if visible.shape != (n, n):
        raise InvalidInputError(f"a visibility of shape {tuple(visible.shape)} for {n} rows")
    return visible


def tree_rows(
    slot: int, start: int, bonus: int, tree: DraftTree
) -> tuple[int, int, list[int], list[int], np.ndarray | None]:
    """One sequence of a verification call (for :meth:`Rows.batch`): ``[bonus] + tree`` after ``start`` cache entries."""
    tokens = [int(bonus), *(int(t) for t in tree.token_ids)]
    positions = tree_position_ids(tree, start).tolist()
    return slot, start, tokens, positions, tree.visibility_mask() if len(tree) else None
