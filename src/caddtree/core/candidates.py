"""The drafter's candidates at each position of a draft, read as the tree expansion reaches them.

:class:`TopK` holds precomputed top-K log-probabilities; :func:`topk_log_probs` makes one from
logits; :class:`DraftRows` is the protocol of rows computed on demand (a drafter that projects a
position to the vocabulary only when the expansion first reaches it); :class:`Candidates` reads
any of these, a torch tensor or a numpy array, row by row, as :mod:`caddtree.core.tree` expands.
Pure numpy (torch only for rows that are torch tensors).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, Union, runtime_checkable

import numpy as np

from ..util.checks import check_int
from ..util.errors import InvalidInputError
from .logit_rows import chunk_maxima, chunked, logsumexp, top_candidates

if TYPE_CHECKING:
    import torch

__all__ = ["FIRST_K", "Candidates", "DraftInput", "DraftRows", "TopK", "topk_log_probs"]


# --------------------------------------------------------------------------------------------------
# Inputs: per-position top-K log-probabilities
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TopK:
    """The drafter's top-``K`` candidates at each of ``L`` positions.

    ``log_probs[i, k]`` is ``log q_{i+1}`` of the ``k``-th most likely token ``token_ids[i, k]``;
    each row is sorted in non-increasing order. Log-probabilities are normalised over the whole
    vocabulary, not over the ``K`` kept candidates.
    """

    log_probs: np.ndarray  # float64 [L, K]
    token_ids: np.ndarray  # int64 [L, K]

    def __post_init__(self) -> None:
        lp = np.asarray(self.log_probs, dtype=np.float64)
        ids = np.asarray(self.token_ids, dtype=np.int64)
        if lp.ndim != 2 or lp.shape != ids.shape:
            raise InvalidInputError(
                "TopK needs log_probs and token_ids of the same shape [L, K]; got "
                f"{tuple(lp.shape)} and {tuple(ids.shape)}"
            )
        if lp.shape[0] < 1 or lp.shape[1] < 1:
            raise InvalidInputError(
                f"TopK needs at least one position and one candidate; got {lp.shape}"
            )
        if np.isnan(lp).any() or (lp > 1e-6).any():
            raise InvalidInputError(
                "TopK log_probs must be log-probabilities (<= 0, no NaN); check the draft logits "
                "for NaN or pass raw logits instead"
            )
        if lp.shape[1] > 1 and (np.diff(lp, axis=1) > 1e-12).any():
            raise InvalidInputError("TopK log_probs must be sorted in non-increasing order per row")
        object.__setattr__(self, "log_probs", lp)
        object.__setattr__(self, "token_ids", ids)

    @property
    def depth(self) -> int:
        """``L``: the number of drafted positions."""
        return int(self.log_probs.shape[0])

    @property
    def k(self) -> int:
        """``K``: candidates kept per position."""
        return int(self.log_probs.shape[1])


def topk_log_probs(draft_logits: np.ndarray | torch.Tensor, k: int) -> TopK:
    """Log-softmax over the vocabulary, then the top-``k`` tokens of every position.

    ``draft_logits`` is ``[L, V]`` (a torch tensor on any device, or a numpy array). The vocabulary-
    wide work (log-softmax and top-k) runs where the tensor lives; only ``[L, k]`` values come back.
    ``k`` is capped at ``V``.
    """
    if isinstance(draft_logits, TopK):
        return draft_logits
    k = check_int("k", k)
    if _is_torch_tensor(draft_logits):
        import torch

        if draft_logits.ndim != 2 or draft_logits.shape[0] < 1 or draft_logits.shape[1] < 1:
            raise InvalidInputError(
                f"draft logits must have shape [L, V] with L, V >= 1; got {tuple(draft_logits.shape)}"
            )
        k = min(int(k), int(draft_logits.shape[1]))
        with torch.no_grad():
            logp = torch.log_softmax(draft_logits.float(), dim=-1)
            values, indices = torch.topk(logp, k, dim=-1)
        return TopK(values.double().cpu().numpy(), indices.cpu().numpy())

    logits = np.asarray(draft_logits)
    if logits.ndim != 2 or logits.shape[0] < 1 or logits.shape[1] < 1:
        raise InvalidInputError(
            f"draft logits must have shape [L, V] with L, V >= 1; got {tuple(logits.shape)}"
        )
    if not np.issubdtype(logits.dtype, np.floating):
        raise InvalidInputError(f"draft logits must be floating point, got dtype {logits.dtype}")
    logits = logits.astype(np.float64, copy=False)
    k = min(int(k), logits.shape[1])
    m = logits.max(axis=1, keepdims=True)
    lse = m + np.log(np.exp(logits - m).sum(axis=1, keepdims=True))
    if k < logits.shape[1]:
        idx = np.argpartition(-logits, k - 1, axis=1)[:, :k]
    else:
        idx = np.broadcast_to(np.arange(logits.shape[1]), logits.shape).copy()
    vals = np.take_along_axis(logits, idx, axis=1)
    order = np.argsort(-vals, axis=1, kind="stable")
    idx = np.take_along_axis(idx, order, axis=1)
    vals = np.take_along_axis(vals, order, axis=1) - lse
    if np.isnan(vals).any():
        raise InvalidInputError("draft logits contain NaN")
    return TopK(vals, idx)


def _is_torch_tensor(x: Any) -> bool:
    mod = type(x).__module__
    return mod.startswith("torch") and hasattr(x, "detach")


@runtime_checkable
class DraftRows(Protocol):
    """Draft logits ``[L, V]`` whose rows are computed on demand.

    The tree builders read position ``i + 1`` through ``row(i)`` (a 1D torch tensor on any device,
    or a numpy array) the first time the expansion reaches that depth, and at most once per build
    (they keep what they read). ``rows()`` returns all ``L`` rows at once, ``[L, V]``; the chain,
    which needs every position, asks for that instead. ``shape`` is ``(L, V)``.
    """

    shape: tuple[int, int]

    def row(self, i: int) -> Any: ...

    def rows(self) -> Any: ...


def _is_draft_rows(x: Any) -> bool:
    """Whether ``x`` is :class:`DraftRows`, checked by its methods: ``isinstance`` against a
    runtime-checkable protocol costs tens of microseconds, once or twice a drafted round."""
    return callable(getattr(x, "row", None)) and callable(getattr(x, "rows", None))


DraftInput = Union[TopK, DraftRows, np.ndarray, "torch.Tensor"]
"""What the tree builders read draft logits from: a :class:`TopK`, rows computed on demand
(:class:`DraftRows`, e.g. :class:`~caddtree.models.drafts.DraftLogits`), or logits ``[L, V]``
as a numpy array or a torch tensor on any device."""


# --------------------------------------------------------------------------------------------------
# Candidates per position, read lazily
# --------------------------------------------------------------------------------------------------

FIRST_K = 32
"""Candidates read per position at first; a position is widened (x4) only when the expansion
reaches its last usable candidate."""


class Candidates:
    """The drafter's candidates at each position, in the expansion's order, read on demand.

    Row ``i`` lists the tokens of position ``i + 1`` by non-increasing log-probability, ties broken
    by the lower token id, with ``log q`` normalised over the whole vocabulary (one logsumexp per
    row; no log-softmax is materialised). A row is read the first time the expansion reaches its
    depth, from a top-``k`` with ``k = FIRST_K``; it is widened (``k`` four times larger, up to the
    vocabulary) when the expansion asks for a candidate past the usable ones. Usable are the
    candidates strictly more likely than the ``k``-th: those are the same whatever ``k`` (ties at
    the cut could be any of the tied tokens), so a tree never depends on how far a row was read.

    ``values[i]`` and ``ids[i]`` are Python lists, grown in place, so references stay valid.
    ``draft_logits`` may be :class:`DraftRows`: a row is then computed only when it is first read.
    """

    def __init__(self, draft_logits: DraftInput, max_rank: int | None = None) -> None:
        self.max_rank = max_rank  # candidates beyond this rank are never needed (the chain: 1)
        if isinstance(draft_logits, TopK):
            self._row, self.depth, self.vocab = None, draft_logits.depth, draft_logits.k
            k = draft_logits.k if max_rank is None else min(max_rank, draft_logits.k)
            self.values = draft_logits.log_probs[:, :k].tolist()
            self.ids = draft_logits.token_ids[:, :k].tolist()
            self._k = [self.vocab] * self.depth  # nothing more to read
            return
        if _is_torch_tensor(draft_logits):
            shape = tuple(draft_logits.shape)
        elif _is_draft_rows(draft_logits):
            shape = tuple(draft_logits.shape)
            if max_rank == 1:  # the chain reads every position: all rows in one go
                draft_logits = draft_logits.rows()
        else:
            draft_logits = np.asarray(draft_logits)
            shape = draft_logits.shape
            if not np.issubdtype(draft_logits.dtype, np.floating):
                raise InvalidInputError(
                    f"draft logits must be floating point, got dtype {draft_logits.dtype}"
                )
        if len(shape) != 2 or shape[0] < 1 or shape[1] < 1:
            raise InvalidInputError(
                f"draft logits must have shape [L, V] with L, V >= 1; got {shape}"
            )
        # position i + 1's logits (torch or numpy), computed on demand for DraftRows
        self._row = draft_logits.row if _is_draft_rows(draft_logits) else draft_logits.__getitem__
        self.depth, self.vocab = int(shape[0]), int(shape[1])
        self.values = [[] for _ in range(self.depth)]
        self.ids = [[] for _ in range(self.depth)]
        self._k = [0] * self.depth
        self._lse = [0.0] * self.depth
        self._dense: list[np.ndarray | None] = [None] * self.depth  # CPU rows as read, by numpy

    def row(self, i: int) -> list[float]:
        """The usable log-probabilities of position ``i + 1`` (read on first use)."""
        if self._k[i] == 0:
            self._read(i, FIRST_K if self.max_rank is None else self.max_rank + 1)
            if not self.values[i]:
                self.widen(i)  # every candidate read so far ties with the k-th: read on
        return self.values[i]

    def widen(self, i: int) -> bool:
        """Read more candidates of position ``i + 1``; ``False`` when there are no more."""
        if self.max_rank is not None and len(self.values[i]) >= self.max_rank:
            return False
        before = len(self.values[i])
        while self._k[i] < self.vocab:
            self._read(i, 4 * self._k[i])
            if len(self.values[i]) > before:
                return True
        return False

    def _read(self, i: int, k: int) -> None:
        k = min(k, self.vocab)
        first = self._k[i] == 0
        row = self._row(i)
        if _is_torch_tensor(row):
            import torch  # loaded already: the row is a tensor
        if _is_torch_tensor(row) and row.device.type != "cpu":
            with torch.no_grad():
                row = row.float() if row.dtype != torch.float64 else row
                if first:
                    self._lse[i] = float(torch.logsumexp(row, 0))
                    self._check_finite(i)
                vals, idx = torch.topk(row, k)
            vals, idx = vals.double().cpu().numpy(), idx.cpu().numpy()
        else:
            # CPU rows are read with numpy, in place: its reductions and exp run on the calling
            # thread with little overhead per call (a parallel torch reduction over one row
            # waits on a descheduled helper thread whenever the machine is busy)
            if _is_torch_tensor(row):
                row = row.detach()
                if row.dtype not in (torch.float32, torch.float64):
                    row = row.float()  # half-precision logits are normalised in float32
                row = row.numpy()
            row = np.asarray(row)
            if row.dtype not in (np.float32, np.float64):
                row = row.astype(np.float64)
            row = self._dense[i] = np.ascontiguousarray(row)
            maxima = chunk_maxima(row) if chunked(self.vocab, k) else None
            if first:
                self._lse[i] = logsumexp(row, None if maxima is None else maxima.max())
                self._check_finite(i)
            vals, idx = top_candidates(row, k, maxima)
            vals = vals.astype(np.float64)
        order = np.lexsort((idx, -vals))  # by value, then by token id
        vals, idx = vals[order], idx[order]
        usable = k if k >= self.vocab else int(np.count_nonzero(vals > vals[-1]))
        if self.max_rank is not None:
            usable = min(usable, self.max_rank)
        have = len(self.values[i])
        self._k[i] = k
        self.values[i].extend((vals[have:usable] - self._lse[i]).tolist())
        self.ids[i].extend(idx[have:usable].tolist())

    def _check_finite(self, i: int) -> None:
        # the max of a row with a NaN is NaN, so one check on the normaliser covers the row
        if not math.isfinite(self._lse[i]):
            raise InvalidInputError(
                "draft logits contain NaN or infinity (or a row with no finite logit)"
            )

    def log_prob(self, i: int, token: int) -> float:
        """``log q`` of ``token`` at position ``i + 1``, whether or not it is among the candidates
        read (``-inf`` for a token outside a :class:`TopK`'s)."""
        values = self.row(i)
        if self._row is None:  # TopK: only its candidates are known
            ids = self.ids[i]
            return values[ids.index(token)] if token in ids else -math.inf
        dense = self._dense[i]
        row = dense if dense is not None else self._row(i)
        return float(row[token]) - self._lse[i]

    def token_ids(self, depths: np.ndarray, ranks: np.ndarray) -> np.ndarray:
        """Token id of the ``ranks[j]``-th candidate at depth ``depths[j]``."""
        ids = self.ids
        return np.array([ids[d - 1][r] for d, r in zip(depths.tolist(), ranks.tolist())], np.int64)
