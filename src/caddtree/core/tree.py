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
from typing import TYPE_CHECKING

import numpy as np

from ..util.checks import check_int, is_number
from ..util.errors import InvalidInputError
from .candidates import Candidates, DraftInput, DraftRows, TopK, topk_log_probs

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
    "verification_rows",
]


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
            drafter's top-1; -1 for a node copied from the context), int64 ``[n]``. Used for
            analysis and rendering only.
        copied: whether each node's estimate is a copy's from the context (larger than the
            drafter's), bool ``[n]``; ``None`` for a tree of drafted nodes alone
            (:mod:`caddtree.core.merged`).
    """

    token_ids: np.ndarray
    parents: np.ndarray
    depths: np.ndarray
    log_probs: np.ndarray
    ranks: np.ndarray | None = None
    copied: np.ndarray | None = None

    def __post_init__(self) -> None:
        for name in ("token_ids", "parents", "depths", "ranks"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, np.asarray(value, dtype=np.int64).reshape(-1))
        object.__setattr__(
            self, "log_probs", np.asarray(self.log_probs, dtype=np.float64).reshape(-1)
        )
        if self.copied is not None:
            object.__setattr__(self, "copied", np.asarray(self.copied, dtype=bool).reshape(-1))
        n = self.token_ids.shape[0]
        for name in ("parents", "depths", "log_probs", "ranks", "copied"):
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

    def head(self, count: int) -> DraftTree:
        """The first ``count`` nodes (all of them if there are no more): in best-first order
        every node's parent comes before it, so they form a tree."""
        if len(self) <= count:
            return self
        fields = ("token_ids", "parents", "depths", "log_probs", "ranks", "copied")
        cut = {f: getattr(self, f)[:count] for f in fields if getattr(self, f) is not None}
        return replace(self, **cut)

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


def verification_rows(nodes: Sequence[int]) -> list[int]:
    """The rows that the bonus token and ``nodes`` (an accepted path) occupy in a verification
    over ``[bonus] + nodes``: row 0 is the bonus, node ``k`` is row ``k + 1``."""
    return [0, *(int(k) + 1 for k in nodes)]


# --------------------------------------------------------------------------------------------------
# The one best-first expansion
# --------------------------------------------------------------------------------------------------


def _expand(
    cands: Candidates, max_nodes: int, denominators: Sequence[float] | None = None
) -> DraftTree:
    """One request's best-first expansion (:func:`_expand_many` with one request)."""
    return _expand_many([cands], max_nodes, denominators)[0]


def _expand_many(
    requests: Sequence[Candidates],
    max_nodes: int,
    denominators: Sequence[float] | None = None,
    base: float | None = None,
) -> list[DraftTree]:
    """Best-first expansion over the prefixes of several requests' drafts at once, in
    non-increasing prefix probability across all of them; one tree per request.

    Pops at most ``max_nodes`` prefixes in all. With ``denominators`` (the round's cost with
    ``n = 0 .. max_nodes`` nodes in all: ``draft_cost + verify_cost(n)`` for one request), it also
    stops at the first ``n`` where ``theta*(n+1) <= theta*(n)``, ``theta*(n) = (R + Phi(n)) /
    denominators[n]`` for ``R`` requests (``base`` instead, where given) and ``Phi`` the mass of
    the ``n`` prefixes taken (Algorithm 1, Eq. stopping; for several requests, the joint budget: each request's
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
    rows, heap = _first_frontier(requests)
    counts = [0] * len(requests)  # nodes taken per request (the next node's index)
    heappush, heappop, heapreplace, exp = heapq.heappush, heapq.heappop, heapq.heapreplace, math.exp
    cost_aware = denominators is not None
    phi = 0.0
    rows_worth = float(len(requests)) if base is None else base
    theta_prev = rows_worth / denominators[0] if cost_aware else 0.0
    n = 0
    while heap and n < max_nodes:
        item = heap[0]
        score = -item[0]
        if cost_aware:
            delta = exp(score)
            theta_new = (rows_worth + phi + delta) / denominators[n + 1]
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


def _first_frontier(
    requests: Sequence[Candidates],
) -> tuple[list[list[list[float] | None]], list[tuple[float, int, float, int, int, int]]]:
    """Each request's rows (its first read, the others ``None`` until the expansion reaches
    them) and the heap of their first candidates (:func:`_expand_many`'s entries)."""
    rows: list[list[list[float] | None]] = []
    heap: list[tuple[float, int, float, int, int, int]] = []
    for r, cands in enumerate(requests):
        rows.append([None] * cands.depth)  # lists of log-probabilities, read when first reached
        first = rows[r][0] = cands.row(0)
        if first:
            heap.append((-first[0], r, 0.0, -1, 1, 0))
    heapq.heapify(heap)
    return rows, heap


def _tree(cands: Candidates, popped: list[tuple[float, int, float, int, int, int]]) -> DraftTree:
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


def build_ddtree(draft_logits: DraftInput, budget: int) -> DraftTree:
    """DDTree: the ``budget`` prefixes with the largest prefix probability (Eq. phistar).

    ``draft_logits`` is ``[L, V]`` logits (torch or numpy) or a :class:`TopK`. The tree is built
    best-first and is prefix-closed. If fewer than ``budget`` prefixes exist (tiny vocabularies, or a
    :class:`TopK` with few candidates), the tree holds all of them.
    """
    budget = check_int("budget", budget, minimum=0)
    return _expand(Candidates(draft_logits), budget)


def build_chain(draft_logits: DraftInput) -> DraftTree:
    """The DFlash chain: the top-1 token at each of the ``L`` positions."""
    cands = Candidates(draft_logits, max_rank=1)
    return _expand(cands, cands.depth)


def build_caddtree(
    draft_logits: DraftInput,
    cost_model: CostModel,
    context_length: int,
    max_budget: int = 1024,
) -> DraftTree:
    """CaDDTree (Algorithm 1): the tree that maximises surrogate throughput ``theta*(n)``.

    Expands best-first and stops at the first ``n`` where ``theta*(n+1) <= theta*(n)``, or at
    ``max_budget`` nodes. The result equals ``build_ddtree(draft_logits, n*)`` with ``n* = len(tree)``.
    Under a convex verification cost (every :class:`~caddtree.core.cost.ConvexCostModel`) it is the
    throughput-optimal tree (Corollaries 1 and 2).

    ``context_length`` is the number of tokens already in the target's KV cache when the tree is
    verified; it selects the verification-cost curve.
    """
    max_budget = check_int("max_budget", max_budget, minimum=0)
    context_length = check_int("context_length", context_length, minimum=0)
    denominators = cost_model.round_cost_table(context_length, max_budget)
    return _expand(Candidates(draft_logits), max_budget, denominators.tolist())


def build_joint_caddtrees(
    draft_logits: Sequence[DraftInput],
    round_costs: Sequence[float],
    max_nodes: int = 1024,
    *,
    calibration: float = 1.0,
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

    ``calibration`` (``kappa > 0``) is how many tokens a unit of the drafter's prefix mass is
    worth: the surrogate is ``sum_i (1 + kappa Phi_i(n_i)) / round_costs[n]``, for a drafter
    whose ``Phi`` over- (``kappa < 1``) or under-states what the target accepts. It is the same
    rule with ``R / kappa`` bonus rows, so the order of the prefixes and the optimality argument
    are unchanged; only where the total stops moves.
    """
    max_nodes = check_int("max_nodes", max_nodes, minimum=0)
    if not (is_number(calibration) and math.isfinite(calibration) and calibration > 0):
        raise InvalidInputError(f"calibration must be a positive number, got {calibration!r}")
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
    requests = [Candidates(logits) for logits in draft_logits]
    base = len(requests) / float(calibration)
    return _expand_many(requests, max_nodes, costs[: max_nodes + 1].tolist(), base)


def surrogate_throughput(
    draft_logits: DraftInput, cost_model: CostModel, context_length: int, max_budget: int
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
