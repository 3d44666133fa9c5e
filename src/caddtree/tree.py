"""Draft-tree construction from a block-diffusion drafter's per-position marginals.

Notation (paper, Sections 2.2-3.5). The drafter produces marginals ``q_i`` for the ``L`` positions
after the bonus token ``b`` (Eq. marginals). A node ``s = (s_1, ..., s_d)`` of a draft tree is the
depth-``d`` token sequence ``(b, s_1, ..., s_d)``. Its *prefix probability* is

    pi_s = prod_{i <= d} q_i(s_i)                                           (Eq. prefix-prob)

and the surrogate expected acceptance of a tree is ``phi(T) = sum_{s in T} pi_s`` (Eq. surrogate).
Sorting all prefix probabilities as ``delta_1 >= delta_2 >= ...`` gives the best value for a tree of
``n`` nodes, ``phi*(n) = delta_1 + ... + delta_n`` (Eq. phistar), reached by the top-``n`` prefixes.

Every policy here is the same best-first expansion (a max-heap over log prefix probabilities that
pops prefixes in non-increasing ``delta`` and pushes the popped node's next sibling and first child);
they differ only in when the expansion stops:

* :func:`build_ddtree` - DDTree: after a fixed ``budget`` of nodes.
* :func:`build_caddtree` - CaDDTree (Algorithm 1): at the first ``n`` where the surrogate throughput

      theta*(n) = (1 + phi*(n)) / (draft_cost + verify_cost(n; l))          (Eq. per-round)

  stops increasing, i.e. ``theta*(n + 1) <= theta*(n)``. For a verification cost that is convex in
  ``n`` this ``n*`` is the global maximiser of ``theta*`` (Theorem 1, Corollaries 1 and 2).
* :func:`build_chain` - the DFlash chain: the top-1 token at every position (the same expansion
  restricted to one candidate per position).

This module is pure numpy: no model code. Draft logits may be given as a torch tensor (any device),
a numpy array, precomputed top-K log-probabilities (:class:`TopK`), or rows computed on demand
(:class:`DraftRows`, e.g. a drafter that projects a position to the vocabulary only when the
expansion first reaches it).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import cached_property
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np

from .checks import check_int
from .errors import InvalidInputError
from .rows import chunk_maxima, chunked, logsumexp, top_candidates

if TYPE_CHECKING:  # pragma: no cover
    from .cost import CostModel

__all__ = [
    "DraftRows",
    "DraftTree",
    "TopK",
    "build_caddtree",
    "build_chain",
    "build_ddtree",
    "build_joint_caddtrees",
    "surrogate_throughput",
    "topk_log_probs",
]


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


def topk_log_probs(draft_logits: Any, k: int) -> TopK:
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


# --------------------------------------------------------------------------------------------------
# Candidates per position, read lazily
# --------------------------------------------------------------------------------------------------

FIRST_K = 32
"""Candidates read per position at first; a position is widened (x4) only when the expansion
reaches its last usable candidate."""


class _Candidates:
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

    def __init__(self, draft_logits: Any, max_rank: int | None = None) -> None:
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
        elif isinstance(draft_logits, DraftRows):
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
        self._row = getattr(draft_logits, "row", None) or draft_logits.__getitem__
        self.depth, self.vocab = int(shape[0]), int(shape[1])
        self.values = [[] for _ in range(self.depth)]
        self.ids = [[] for _ in range(self.depth)]
        self._k = [0] * self.depth
        self._lse = [0.0] * self.depth

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
            row = np.ascontiguousarray(row)
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

    def token_ids(self, depths: np.ndarray, ranks: np.ndarray) -> np.ndarray:
        """Token id of the ``ranks[j]``-th candidate at depth ``depths[j]``."""
        ids = self.ids
        return np.array([ids[d - 1][r] for d, r in zip(depths.tolist(), ranks.tolist())], np.int64)


# --------------------------------------------------------------------------------------------------
# The tree
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class DraftTree:
    """A prefix-closed draft tree hanging below the bonus token (the root, which is not a node).

    Nodes are stored in the order they were selected, so parents come before their children and,
    for trees built here, ``log_probs`` is non-increasing.

    Attributes:
        token_ids: token of each node, int64 ``[n]``.
        parents: index of each node's parent node, or ``-1`` for a child of the root, int64 ``[n]``.
        depths: depth of each node, 1-based (a child of the root has depth 1), int64 ``[n]``.
        log_probs: log prefix probability ``log pi_s`` of each node, float64 ``[n]``.
        ranks: rank of each node's token among the drafter's candidates at its depth (0 = the
            drafter's top-1), int64 ``[n]``. Used for analysis and rendering only.
    """

    token_ids: np.ndarray
    parents: np.ndarray
    depths: np.ndarray
    log_probs: np.ndarray
    ranks: np.ndarray | None = None

    def __post_init__(self) -> None:
        for name in ("token_ids", "parents", "depths", "ranks"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, np.asarray(value, dtype=np.int64).reshape(-1))
        object.__setattr__(
            self, "log_probs", np.asarray(self.log_probs, dtype=np.float64).reshape(-1)
        )
        n = self.token_ids.shape[0]
        for name in ("parents", "depths", "log_probs", "ranks"):
            value = getattr(self, name)
            if value is not None and value.shape[0] != n:
                raise InvalidInputError(
                    f"DraftTree.{name} has {value.shape[0]} entries but token_ids has {n}"
                )

    @classmethod
    def empty(cls) -> DraftTree:
        """The tree with no nodes (plain autoregressive decoding verifies only the bonus token)."""
        z = np.zeros(0, dtype=np.int64)
        return cls(z, z, z, np.zeros(0), z)

    def __len__(self) -> int:
        return int(self.token_ids.shape[0])

    def __repr__(self) -> str:
        depth = int(self.depths.max()) if len(self) else 0
        return f"DraftTree(nodes={len(self)}, depth={depth}, phi={self.phi:.4f})"

    @property
    def phi(self) -> float:
        """Surrogate expected acceptance ``phi(T) = sum of prefix probabilities`` (Eq. surrogate)."""
        return float(np.exp(self.log_probs).sum())

    @property
    def max_depth(self) -> int:
        return int(self.depths.max()) if len(self) else 0

    def map_tokens(self, table: np.ndarray) -> DraftTree:
        """The same tree with every token id ``t`` replaced by ``table[t]`` (draft vocabulary ids
        to target ids)."""
        return replace(self, token_ids=np.asarray(table)[self.token_ids])

    # ---- structure ------------------------------------------------------------------------------

    def validate(self) -> None:
        """Raise :class:`InvalidInputError` unless the tree is well formed.

        Checks: parents precede children, depths are parent depth + 1 (1 below the root), and no
        two children of one parent carry the same token (so a path is identified by its tokens).
        """
        n = len(self)
        idx = np.arange(n)
        if ((self.parents < -1) | (self.parents >= idx)).any():
            raise InvalidInputError("every parent index must be -1 or an earlier node")
        parent_depth = np.where(self.parents >= 0, self.depths[np.maximum(self.parents, 0)], 0)
        if n and not np.array_equal(self.depths, parent_depth + 1):
            raise InvalidInputError("every depth must be its parent's depth + 1 (1 below the root)")
        keys = set(zip(self.parents.tolist(), self.token_ids.tolist()))
        if len(keys) != n:
            raise InvalidInputError("two children of the same parent carry the same token")

    def visibility_mask(self) -> np.ndarray:
        """Ancestor visibility over ``[root] + nodes`` as a boolean ``[n+1, n+1]`` matrix.

        ``mask[i, j]`` is True where row ``i`` may attend to column ``j``: ``j`` is ``i`` itself or an
        ancestor of ``i``. Index 0 is the root (the bonus token); node ``k`` is index ``k + 1``.
        """
        n = len(self)
        mask = np.zeros((n + 1, n + 1), dtype=bool)
        mask[:, 0] = True
        rows = np.arange(1, n + 1)
        anc = rows.copy()  # 1-based index into [root] + nodes; 0 is the root
        parents1 = np.concatenate(([0], self.parents + 1))  # parent of 1-based index, root -> 0
        # Walk every node up to the root at once; a tree has at most max_depth levels.
        for _ in range(self.max_depth):
            live = anc > 0
            if not live.any():
                break
            mask[rows[live], anc[live]] = True
            anc = parents1[anc]
        mask[0, 0] = True
        return mask

    @cached_property
    def _children_csr(self) -> tuple[np.ndarray, np.ndarray]:
        # children of parent p (p = -1 for the root) are order[start[p+1]:start[p+2]], in node order.
        n = len(self)
        order = np.argsort(self.parents + 1, kind="stable")
        counts = np.bincount(self.parents + 1, minlength=n + 1)
        start = np.concatenate(([0], np.cumsum(counts)))
        return order, start

    def children(self, node: int) -> np.ndarray:
        """Indices of the children of ``node`` (``-1`` for the root), in selection order."""
        if not -1 <= node < len(self):
            raise IndexError(f"node {node} is not in a tree of {len(self)} nodes")
        order, start = self._children_csr
        return order[start[node + 1] : start[node + 2]]

    @cached_property
    def _child_index(self) -> dict[tuple[int, int], int]:
        return {
            (p, t): i
            for i, (p, t) in enumerate(zip(self.parents.tolist(), self.token_ids.tolist()))
        }

    def child_with_token(self, node: int, token: int) -> int:
        """Index of the child of ``node`` (``-1`` = root) that carries ``token``, or ``-1`` if none."""
        return self._child_index.get((int(node), int(token)), -1)

    def path(self, node: int) -> list[int]:
        """Node indices from depth 1 down to ``node`` (inclusive)."""
        out: list[int] = []
        parents = self.parents
        while node >= 0:
            out.append(int(node))
            node = int(parents[node])
        return out[::-1]


# --------------------------------------------------------------------------------------------------
# The one best-first expansion
# --------------------------------------------------------------------------------------------------


def _expand(
    cands: _Candidates, max_nodes: int, denominators: Sequence[float] | None = None
) -> DraftTree:
    """One request's best-first expansion (:func:`_expand_many` with one request)."""
    return _expand_many([cands], max_nodes, denominators)[0]


def _expand_many(
    requests: Sequence[_Candidates], max_nodes: int, denominators: Sequence[float] | None = None
) -> list[DraftTree]:
    """Best-first expansion over the prefixes of several requests' drafts at once, in
    non-increasing prefix probability across all of them; one tree per request.

    Pops at most ``max_nodes`` prefixes in all. With ``denominators`` (the round's cost with
    ``n = 0 .. max_nodes`` nodes in all: ``draft_cost + verify_cost(n)`` for one request), it also
    stops at the first ``n`` where ``theta*(n+1) <= theta*(n)``, ``theta*(n) = (R + Phi(n)) /
    denominators[n]`` for ``R`` requests and ``Phi`` the probability mass of the ``n`` prefixes
    taken (Algorithm 1, Eq. stopping; for several requests, the joint budget: each request's
    prefix masses are non-increasing in its own best-first order, so taking the most probable
    prefix of any request next gives, for every ``n``, the largest ``Phi`` any split of ``n``
    nodes among the requests could have). Without ``denominators`` it is DDTree's fixed budget.

    A heap entry is ``(-score, request, parent_score, parent, depth, rank)``: the prefix made of
    the parent node's path (in that request's tree) plus the ``rank``-th candidate at position
    ``depth``. Accepting it replaces it by its next sibling (``rank + 1``) and pushes its first
    child (rank 0 at ``depth + 1``), so the heap only ever holds the frontier of the best-first
    order.

    Positions are read from a request's candidates only when the expansion reaches them, and only
    as far as it goes. The first child pushed at a depth not read yet enters with rank ``-1`` and
    its parent's score, an upper bound on its own (``log q <= 0``); that depth is read only when
    the bound reaches the top of the heap (and, for the cost-aware rule, only if the bound does
    not already stop the expansion). An entry's bound never sorts after its true key, so the order
    in which nodes are accepted, and the trees, are those of reading every depth up front.
    """
    popped: list[list[tuple[float, int, float, int, int, int]]] = [[] for _ in requests]
    if max_nodes <= 0:
        return [DraftTree.empty() for _ in requests]
    rows: list[list[list[float] | None]] = []
    heap: list[tuple[float, int, float, int, int, int]] = []
    for r, cands in enumerate(requests):
        rows.append([None] * cands.depth)  # lists of log-probabilities, read when first reached
        first = rows[r][0] = cands.row(0)
        if first:
            heap.append((-first[0], r, 0.0, -1, 1, 0))
    heapq.heapify(heap)
    counts = [0] * len(requests)  # nodes taken per request (the next node's index)
    heappush, heappop, heapreplace, exp = heapq.heappush, heapq.heappop, heapq.heapreplace, math.exp
    cost_aware = denominators is not None
    phi = 0.0
    theta_prev = len(requests) / denominators[0] if cost_aware else 0.0
    n = 0
    while heap and n < max_nodes:
        item = heap[0]
        score = -item[0]
        if cost_aware:
            delta = exp(score)
            theta_new = (len(requests) + phi + delta) / denominators[n + 1]
            if theta_new <= theta_prev:  # Eq. stopping: theta*(n+1) <= theta*(n)
                break
        _, r, pscore, parent, depth, rank = item
        request_rows = rows[r]
        if rank < 0:  # a first child at a depth not read yet: read it, re-sort the child
            row = request_rows[depth - 1]
            if row is None:
                row = request_rows[depth - 1] = requests[r].row(depth - 1)
            if row:
                heapreplace(heap, (-(pscore + row[0]), r, pscore, parent, depth, 0))
            else:
                heappop(heap)
            continue
        if cost_aware:
            phi += delta
            theta_prev = theta_new
        popped[r].append(item)
        sibling = rank + 1
        row = request_rows[depth - 1]
        if sibling < len(row) or (requests[r].widen(depth - 1) and sibling < len(row)):
            heapreplace(heap, (-(pscore + row[sibling]), r, pscore, parent, depth, sibling))
        else:
            heappop(heap)
        if depth < len(request_rows):
            child_row = request_rows[depth]
            if child_row is None:  # depth + 1 not read yet: an upper bound for now (see above)
                heappush(heap, (-score, r, score, counts[r], depth + 1, -1))
            elif child_row:
                heappush(heap, (-(score + child_row[0]), r, score, counts[r], depth + 1, 0))
        counts[r] += 1
        n += 1
    return [_tree(cands, taken) for cands, taken in zip(requests, popped)]


def _tree(cands: _Candidates, popped: list[tuple[float, int, float, int, int, int]]) -> DraftTree:
    """The tree of the heap entries ``popped`` (in the order taken) from ``cands``."""
    if not popped:
        return DraftTree.empty()
    cols = np.fromiter(popped, dtype=_HEAP_ENTRY, count=len(popped))
    depths, ranks = cols["depth"], cols["rank"]
    return DraftTree(cands.token_ids(depths, ranks), cols["parent"], depths, -cols["neg"], ranks)


_HEAP_ENTRY = np.dtype(
    [
        ("neg", "f8"),
        ("request", "i8"),
        ("pscore", "f8"),
        ("parent", "i8"),
        ("depth", "i8"),
        ("rank", "i8"),
    ]
)


def build_ddtree(draft_logits: Any, budget: int) -> DraftTree:
    """DDTree: the ``budget`` prefixes with the largest prefix probability (Eq. phistar).

    ``draft_logits`` is ``[L, V]`` logits (torch or numpy) or a :class:`TopK`. The tree is built
    best-first and is prefix-closed. If fewer than ``budget`` prefixes exist (tiny vocabularies, or a
    :class:`TopK` with few candidates), the tree holds all of them.
    """
    budget = check_int("budget", budget, minimum=0)
    return _expand(_Candidates(draft_logits), budget)


def build_chain(draft_logits: Any) -> DraftTree:
    """The DFlash chain: the top-1 token at each of the ``L`` positions."""
    cands = _Candidates(draft_logits, max_rank=1)
    return _expand(cands, cands.depth)


def build_caddtree(
    draft_logits: Any,
    cost_model: CostModel,
    context_length: int,
    max_budget: int = 1024,
) -> DraftTree:
    """CaDDTree (Algorithm 1): the tree that maximises surrogate throughput ``theta*(n)``.

    Expands best-first and stops at the first ``n`` where ``theta*(n+1) <= theta*(n)``, or at
    ``max_budget`` nodes. The result equals ``build_ddtree(draft_logits, n*)`` with ``n* = len(tree)``.
    Under a convex verification cost (every :class:`~caddtree.cost.ConvexCostModel`) it is the
    throughput-optimal tree (Corollaries 1 and 2).

    ``context_length`` is the number of tokens already in the target's KV cache when the tree is
    verified; it selects the verification-cost curve.
    """
    max_budget = check_int("max_budget", max_budget, minimum=0)
    context_length = check_int("context_length", context_length, minimum=0)
    denominators = cost_model.round_cost_table(context_length, max_budget)
    return _expand(_Candidates(draft_logits), max_budget, denominators.tolist())


def build_joint_caddtrees(
    draft_logits: Sequence[Any], round_costs: Sequence[float], max_nodes: int = 1024
) -> list[DraftTree]:
    """CaDDTree's joint budget over a batch of requests verified in one forward: one tree each.

    ``round_costs[n]`` is the batch round's cost with ``n`` tree nodes in all, besides every
    request's bonus row (``C_d(B) + C_v(B + n; l_1 .. l_B)``), for ``n = 0 .. max_nodes``. The
    trees maximise the batch surrogate ``sum_i (1 + Phi_i(n_i)) / round_costs[sum_i n_i]``: the
    requests' prefixes are taken together in non-increasing prefix probability (for every total
    ``n`` the most probable ``n`` prefixes, however they fall among the requests), and the total
    grows while the surrogate does (Algorithm 1's stopping rule, optimal when ``round_costs`` is
    convex, as for one request). ``n = 0`` is batched plain decoding: every request still verifies
    its bonus row, so the surrogate is never below batched AR's. Each tree equals
    :func:`build_ddtree` of its request with ``len(tree)`` nodes.
    """
    max_nodes = check_int("max_nodes", max_nodes, minimum=0)
    costs = np.asarray(round_costs, dtype=np.float64)
    if costs.ndim != 1 or costs.shape[0] < max_nodes + 1:
        raise InvalidInputError(
            f"round_costs needs one cost for each total of 0 .. {max_nodes} nodes, got "
            f"{costs.shape[0] if costs.ndim == 1 else tuple(costs.shape)}"
        )
    if not (np.isfinite(costs).all() and (costs > 0).all()):
        raise InvalidInputError("round_costs must be finite and positive")
    if not draft_logits:
        return []
    requests = [_Candidates(logits) for logits in draft_logits]
    return _expand_many(requests, max_nodes, costs[: max_nodes + 1].tolist())


def surrogate_throughput(
    draft_logits: Any, cost_model: CostModel, context_length: int, max_budget: int
) -> np.ndarray:
    """``theta*(n)`` for ``n = 0 .. max_budget`` (Eq. decomposition), by brute force.

    Meant for analysis and tests; :func:`build_caddtree` never evaluates the whole curve.
    Entries past the number of existing prefixes repeat the last ``phi*``.
    """
    max_budget = check_int("max_budget", max_budget, minimum=0)
    tree = build_ddtree(draft_logits, max_budget)
    phi = np.concatenate(([0.0], np.cumsum(np.exp(tree.log_probs))))
    if phi.shape[0] < max_budget + 1:
        phi = np.concatenate((phi, np.full(max_budget + 1 - phi.shape[0], phi[-1])))
    return (1.0 + phi) / cost_model.round_cost_table(context_length, max_budget)
