"""Draft trees from two sources at once: the drafter's marginals and copies from the context
(:mod:`caddtree.core.copies`), on one scale.

A node's estimate is a product along its path of conditionals: for a node that carries token ``t``
at depth ``d``, the larger of the drafter's ``q_d(t)`` and, where the node continues a copied
continuation, the copy's estimate (:attr:`~caddtree.core.copies.CopyTrie.log_conditional`). A
token that the drafter and a copy both propose below one parent is one node with the larger
estimate. Without copies every estimate is the drafter's prefix probability ``pi_s``, so the trees
are those of :mod:`caddtree.core.tree`.

Every conditional is at most 1, so a child's estimate never exceeds its parent's, and taking
nodes best-first (largest estimate first) gives, for every ``n``, the ``n`` nodes of largest
estimates, as a prefix-closed tree: ``Phi(n)``, their sum, is the largest any tree of ``n`` nodes
has. The cost-aware stop (Algorithm 1's) and the joint budget of a batch therefore apply unchanged,
with the same optimality under a convex verification cost (see :mod:`caddtree.core.tree`).

The expansion keeps, for every node taken, a cursor over its children in non-increasing
conditional order (its copied children by estimate, merged with the drafter's candidates at the
next depth, which skip the copied tokens); the heap holds each node's next child. A child whose
depth's row is not read yet enters with its parent's estimate (an upper bound) and is read when it
reaches the top, as in :func:`caddtree.core.tree._expand_many`.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence

import numpy as np

from .candidates import Candidates
from .copies import CopyTrie
from .tree import DraftTree

__all__ = ["MergedSource", "build_copies", "build_merged"]

_UNREAD, _COPY, _DRAFT = 0, 1, 2


class MergedSource:
    """One request's two sources: the drafter's candidates (``None``: copies only) with the
    target id of each draft id (``to_target``; ``None``: the same ids), and the copy trie
    (``None``: none this round). ``depth``: the deepest a node may be."""

    def __init__(
        self,
        cands: Candidates | None,
        trie: CopyTrie | None,
        to_target: np.ndarray | None = None,
        depth: int | None = None,
    ) -> None:
        self.cands, self.trie, self.to_target = cands, trie, to_target
        deepest = cands.depth if cands is not None else max(trie.depths) if trie else 0
        self.depth = deepest if depth is None else min(depth, deepest)
        self._inverse: dict[int, int] | None = None
        # per slot (0: the root, k + 1: node k): estimate, depth, trie node (-1: none), cursors
        self.score, self.level, self.on_trie = [0.0], [0], [0 if trie else -1]
        self.copy_kids: list[list[tuple[float, int, int, bool]] | None] = [None]
        self.copy_at, self.rank, self.skip = [0], [0], [frozenset()]
        self.nodes: list[tuple[int, int, int, float, int, bool]] = []  # token, parent, depth, ...

    # ---- the drafter's side ---------------------------------------------------------------------

    def _log_q(self, depth: int, token: int) -> float:
        """The drafter's log-probability of target token ``token`` at ``depth``."""
        if self.cands is None:
            return -math.inf
        draft_id = token if self.to_target is None else self._draft_id(token)
        return -math.inf if draft_id < 0 else self.cands.log_prob(depth - 1, draft_id)

    def _draft_id(self, token: int) -> int:
        if self._inverse is None:
            self._inverse = _inverse_map(self.to_target)
        return self._inverse.get(token, -1)

    def _target(self, draft_id: int) -> int:
        return draft_id if self.to_target is None else int(self.to_target[draft_id])

    def _draft_next(self, slot: int) -> tuple[float, int] | None:
        """The drafter's next child of ``slot`` (log q, rank), past the copied tokens."""
        if self.cands is None:
            return None
        i, rank = self.level[slot], self.rank[slot]
        values, ids = self.cands.values[i], self.cands.ids[i]  # lists grown in place by widen
        while True:
            if rank >= len(values):
                if not self.cands.widen(i):
                    self.rank[slot] = rank
                    return None
            elif self._target(ids[rank]) in self.skip[slot]:
                rank += 1
            else:
                self.rank[slot] = rank
                return values[rank], rank

    # ---- one slot's children --------------------------------------------------------------------

    def read(self, slot: int) -> None:
        """Read what ``slot``'s children need: the drafter's row at their depth, and the copied
        children with their estimates (the larger of the copy's and the drafter's)."""
        depth = self.level[slot] + 1
        if self.cands is not None:
            self.cands.row(depth - 1)
        kids: list[tuple[float, int, int, bool]] = []
        v = self.on_trie[slot]
        for token, child in self.trie.children[v].items() if v >= 0 else ():
            copied, drafted = self.trie.log_conditional[child], self._log_q(depth, token)
            kids.append((max(copied, drafted), token, child, copied > drafted))
        kids.sort(key=lambda kid: -kid[0])
        self.copy_kids[slot] = kids
        self.skip[slot] = frozenset(kid[1] for kid in kids)

    def is_read(self, slot: int) -> bool:
        return self.copy_kids[slot] is not None

    def next_child(self, slot: int) -> tuple[float, int] | None:
        """The log conditional of ``slot``'s next child and its source (``_COPY``, ``_DRAFT``)."""
        kids, at = self.copy_kids[slot], self.copy_at[slot]
        copied = kids[at][0] if at < len(kids) else None
        drafted = self._draft_next(slot)
        if copied is None and drafted is None:
            return None
        if drafted is None or (copied is not None and copied >= drafted[0]):
            return copied, _COPY
        return drafted[0], _DRAFT

    def take(self, slot: int, source: int) -> int:
        """Take ``slot``'s next child from ``source`` as a node; its slot."""
        if source == _COPY:
            cond, token, child, copied = self.copy_kids[slot][self.copy_at[slot]]
            self.copy_at[slot] += 1
            rank = -1
        else:
            rank = self.rank[slot]
            cond = self.cands.values[self.level[slot]][rank]
            token, child, copied = self._target(self.cands.ids[self.level[slot]][rank]), -1, False
            self.rank[slot] = rank + 1
        score, depth = self.score[slot] + cond, self.level[slot] + 1
        self.nodes.append((token, slot - 1, depth, score, rank, copied))
        self.score.append(score)
        self.level.append(depth)
        self.on_trie.append(child)
        self.copy_kids.append(None)
        self.copy_at.append(0)
        self.rank.append(0)
        self.skip.append(frozenset())
        return len(self.score) - 1

    def has_children(self, slot: int) -> bool:
        return self.level[slot] < self.depth

    def tree(self) -> DraftTree:
        if not self.nodes:
            return DraftTree.empty()
        tokens, parents, depths, scores, ranks, copied = zip(*self.nodes)
        return DraftTree(tokens, parents, depths, scores, ranks, np.array(copied, dtype=bool))


_INVERSES: dict[int, tuple[np.ndarray, dict[int, int]]] = {}


def _inverse_map(to_target: np.ndarray) -> dict[int, int]:
    """The draft id of each target id of ``to_target``, built once per map (a drafter's)."""
    cached = _INVERSES.get(id(to_target))
    if cached is not None and cached[0] is to_target:
        return cached[1]
    if len(_INVERSES) >= 8:
        _INVERSES.clear()
    inverse = {int(t): i for i, t in enumerate(to_target.tolist())}
    _INVERSES[id(to_target)] = (to_target, inverse)
    return inverse


def build_merged(
    sources: Sequence[MergedSource],
    max_nodes: int,
    denominators: Sequence[float] | None = None,
    base: float | None = None,
) -> list[DraftTree]:
    """Best-first expansion over the merged nodes of every source at once (one tree each, in
    target ids): at most ``max_nodes`` in all; with ``denominators`` (the round's cost with ``n``
    nodes in all) it stops at the first ``n`` where ``theta*(n+1) <= theta*(n)``, ``theta*(n) =
    (R + Phi(n)) / denominators[n]`` for ``R`` sources (``base`` instead, where given), as
    :func:`caddtree.core.tree._expand_many` does for the drafter's nodes alone."""
    if max_nodes <= 0:
        return [DraftTree.empty() for _ in sources]
    heap = [(-0.0, r, 0, _UNREAD) for r, s in enumerate(sources) if s.has_children(0)]
    heapq.heapify(heap)
    cost_aware = denominators is not None
    worth = float(len(sources)) if base is None else base
    phi, n = 0.0, 0
    theta_prev = worth / denominators[0] if cost_aware else 0.0
    while heap and n < max_nodes:
        neg, r, slot, source = heap[0]
        if cost_aware:
            theta_new = (worth + phi + math.exp(-neg)) / denominators[n + 1]
            if theta_new <= theta_prev:  # Eq. stopping: theta*(n+1) <= theta*(n)
                break
        s = sources[r]
        if source == _UNREAD:  # the bound reached the top: read, then re-sort its real key
            s.read(slot)
            _replace_top(heap, s, r, slot)
            continue
        if cost_aware:
            phi, theta_prev = phi + math.exp(-neg), theta_new
        child = s.take(slot, source)
        _replace_top(heap, s, r, slot)
        if s.has_children(child):
            heapq.heappush(heap, (neg, r, child, _UNREAD))
        n += 1
    return [s.tree() for s in sources]


def _replace_top(heap: list, s: MergedSource, r: int, slot: int) -> None:
    """Put ``slot``'s next child in the place of the heap's top entry (``slot``'s last)."""
    found = s.next_child(slot)
    if found is None:
        heapq.heappop(heap)
        return
    entry = (-(s.score[slot] + found[0]), r, slot, found[1])
    heapq.heapreplace(heap, entry)


def build_copies(
    trie: CopyTrie | None, max_nodes: int, denominators: Sequence[float] | None = None
) -> DraftTree:
    """:func:`build_merged` of ``trie``'s copies alone, without the heap: every copied node's
    estimate is known up front, so the best-first order is the nodes sorted by estimate (a child's
    is below its parent's, so every prefix of that order is a tree) and the cost-aware stop is the
    first ``n`` where ``theta*(n+1) <= theta*(n)``, ``theta*(n) = (1 + Phi(n)) / denominators[n]``.
    Nodes of equal estimates come in the order the trie holds them."""
    if trie is None or not len(trie) or max_nodes <= 0:
        return DraftTree.empty()
    parents, cond = trie.parents, trie.log_conditional
    score = [0.0] * len(trie.tokens)
    for v in range(1, len(score)):  # a node's parent comes before it in the trie
        score[v] = score[parents[v]] + cond[v]
    order = sorted(range(1, len(score)), key=lambda v: -score[v])[:max_nodes]
    if denominators is not None:
        phi = np.concatenate(([0.0], np.cumsum(np.exp([score[v] for v in order]))))
        theta = (1.0 + phi) / np.asarray(denominators[: len(order) + 1])
        falls = np.flatnonzero(theta[1:] <= theta[:-1])
        order = order[: falls[0]] if falls.size else order
    place = {v: i for i, v in enumerate(order)}
    return DraftTree(
        [trie.tokens[v] for v in order],
        [place.get(parents[v], -1) for v in order],
        [trie.depths[v] for v in order],
        [score[v] for v in order],
        np.full(len(order), -1),
        np.ones(len(order), dtype=bool),
    )
