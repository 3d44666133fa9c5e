"""Tree policies: how a round's draft tree is chosen (:class:`TreePolicy`), one per method.

========  ===================  ==================================================
method    policy               tree per round
========  ===================  ==================================================
ar        :class:`NoTree`      empty: the target verifies only the bonus token
dflash    :class:`Chain`       the drafter's top-1 token at each position
ddtree    :class:`Budget`      the top-``budget`` prefixes (Eq. phistar)
caddtree  :class:`CostAware`   the top-``n*`` prefixes, ``n*`` by Algorithm 1
lookup    :class:`Lookup`      a chain copied from the context (no drafter)
========  ===================  ==================================================

With ``lookup`` (DDTree and CaDDTree), copies from the request's context
(:class:`ContextCopies`) join the drafter's nodes on one scale (:mod:`caddtree.core.merged`).
:func:`build_tree` builds a round's tree of any policy.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import numpy as np

from ..core.candidates import Candidates
from ..core.copies import ContextIndex, CopyRates, CopyTrie, copy_trie
from ..core.merged import MergedSource, build_copies, build_merged
from ..core.tree import DraftTree, build_caddtree, build_chain, build_ddtree
from ..util.checks import DEFAULT_DDTREE_BUDGET, check_int, check_method
from ..util.errors import InvalidInputError

if TYPE_CHECKING:  # pragma: no cover
    from ..core.candidates import DraftInput
    from ..core.cost import CostModel
    from ..models.drafts import DraftLogits

__all__ = [
    "LOOKUP_TOKENS",
    "Budget",
    "Chain",
    "ContextCopies",
    "CostAware",
    "DraftChoice",
    "DraftGate",
    "Lookup",
    "NoTree",
    "TreePolicy",
    "build_tree",
    "chain_tree",
    "COPY_REACH",
    "copy_depth",
    "make_policy",
]


class TreePolicy(Protocol):
    """Chooses the draft tree of a round from the drafter's logits. ``reserve_nodes`` is how
    many tree nodes a call reserves cache room for after the output (a tree may still be larger:
    the cache then grows); ``reach`` how deep its trees can go (``None``: as deep as the
    draft), so a batched drafter pass drafts no deeper than that. With ``lookup``, the round's
    copies from the context (:class:`ContextCopies`) join the drafter's nodes: ``limits`` gives
    the merged expansion its most nodes and, for a cost-aware stop, the round's cost per size
    (:func:`caddtree.core.merged.build_merged`)."""

    name: str
    needs_drafter: bool
    reserve_nodes: int
    reach: int | None
    lookup: bool

    def build(self, draft_logits: DraftInput, context_length: int) -> DraftTree: ...

    def limits(
        self, context_length: int, drafting: bool = True
    ) -> tuple[int, list[float] | None]: ...


@dataclass(frozen=True)
class NoTree:
    """Plain autoregressive decoding: no drafter, an empty tree."""

    name: str = "ar"
    needs_drafter: bool = False
    reserve_nodes: int = 0
    reach: int | None = 0
    lookup: bool = False

    def build(self, draft_logits: DraftInput, context_length: int) -> DraftTree:
        return DraftTree.empty()

    def limits(self, context_length: int, drafting: bool = True) -> tuple[int, list[float] | None]:
        return 0, None


COPY_REACH = 32
"""The deepest a copied branch goes in a tree the drafter's nodes join (copied nodes need no
drafter position, so they may go past the drafter's block)."""


def copy_depth(policy: TreePolicy, room: int) -> int:
    """How deep a round's copies go: no deeper than the output has ``room`` for, and at most
    :data:`COPY_REACH` beside a drafter, or method ``lookup``'s chain."""
    return min(room, COPY_REACH if policy.needs_drafter else policy.reserve_nodes)


LOOKUP_TOKENS = 10
"""The most tokens method ``lookup`` copies a round (transformers' ``prompt_lookup_num_tokens``
default)."""


@dataclass(frozen=True)
class Lookup:
    """Prompt-lookup decoding: no drafter; the tree is one chain copied from the context (the
    continuation most of the suffix's recent occurrences share, the newest on a tie), at most
    :data:`LOOKUP_TOKENS` deep."""

    name: str = "lookup"
    needs_drafter: bool = False
    reserve_nodes: int = LOOKUP_TOKENS
    reach: int | None = 0
    lookup: bool = True

    def build(self, draft_logits: DraftInput, context_length: int) -> DraftTree:
        return DraftTree.empty()

    def limits(self, context_length: int, drafting: bool = True) -> tuple[int, list[float] | None]:
        return LOOKUP_TOKENS, None


@dataclass(frozen=True)
class Chain:
    """DFlash: the drafter's top-1 token at every position."""

    name: str = "dflash"
    needs_drafter: bool = True
    reserve_nodes: int = DEFAULT_DDTREE_BUDGET
    reach: int | None = None
    lookup: bool = False

    def build(self, draft_logits: DraftInput, context_length: int) -> DraftTree:
        return build_chain(draft_logits)

    def limits(self, context_length: int, drafting: bool = True) -> tuple[int, list[float] | None]:
        return 0, None


@dataclass(frozen=True)
class Budget:
    """DDTree: the ``budget`` most probable prefixes."""

    budget: int
    name: str = "ddtree"
    needs_drafter: bool = True
    lookup: bool = False

    @property
    def reserve_nodes(self) -> int:
        return self.budget

    @property
    def reach(self) -> int:
        return self.budget  # a tree of n nodes is at most n deep

    def build(self, draft_logits: DraftInput, context_length: int) -> DraftTree:
        return build_ddtree(draft_logits, self.budget)

    def limits(self, context_length: int, drafting: bool = True) -> tuple[int, list[float] | None]:
        return self.budget, None


@dataclass(frozen=True)
class CostAware:
    """CaDDTree: the size that maximises surrogate throughput under ``cost_model``."""

    cost_model: CostModel
    max_budget: int = 1024
    name: str = "caddtree"
    needs_drafter: bool = True
    lookup: bool = False
    gate: bool = False  # each round, draft only where drafting pays (DraftGate)
    # the last costs read, by (context length, drafting): a round reads them up to three times
    _costs: dict = field(default_factory=dict, init=False, compare=False, repr=False)

    @property
    def reserve_nodes(self) -> int:
        return self.max_budget

    @property
    def reach(self) -> int:
        return self.max_budget

    def build(self, draft_logits: DraftInput, context_length: int) -> DraftTree:
        return build_caddtree(draft_logits, self.cost_model, context_length, self.max_budget)

    def limits(self, context_length: int, drafting: bool = True) -> tuple[int, list[float] | None]:
        """The most nodes and the round's cost per size (without the drafter's pass where it
        does not run)."""
        key = (context_length, drafting)
        costs = self._costs.get(key)
        if costs is None:
            table = self.cost_model.round_cost_table(context_length, self.max_budget)
            if not drafting:
                table = table - self.cost_model.draft_cost
            if len(self._costs) >= 4:
                self._costs.clear()
            costs = self._costs[key] = table.tolist()
        return self.max_budget, costs


def make_policy(
    method: str,
    *,
    budget: int | None = None,
    cost_model: CostModel | None = None,
    max_budget: int = 1024,
    lookup: bool = False,
    gate: bool | None = None,
) -> TreePolicy:
    """The tree policy of ``method`` (one of :data:`METHODS`), with a clear error for missing or
    meaningless arguments. ``lookup``: DDTree's and CaDDTree's trees take copies from the
    context too (method ``lookup`` always does, alone). ``gate``: CaDDTree runs the drafter only
    in rounds where it pays (:class:`DraftGate`); ``False`` drafts every round, as the paper's
    Algorithm 1 does; ``None``: with copies only (where a round of copies alone is the other
    choice)."""
    check_method(method)
    if lookup and method not in ("ddtree", "caddtree", "lookup"):
        raise InvalidInputError(
            f"lookup adds copies from the context to the trees of ddtree and caddtree, not of "
            f"{method!r}; use one of those, or method 'lookup' for copies alone"
        )
    if gate and method != "caddtree":
        raise InvalidInputError(f"the draft gate decides CaDDTree's rounds, not {method!r}'s")
    if method == "ddtree":
        if budget is None:
            raise InvalidInputError("method 'ddtree' needs a node budget (e.g. budget=64)")
        check_int("the ddtree budget", budget)
        return Budget(int(budget), lookup=bool(lookup))
    if budget is not None:
        raise InvalidInputError(f"a node budget only applies to method 'ddtree', not {method!r}")
    if method == "caddtree":
        if cost_model is None:
            raise InvalidInputError(
                "method 'caddtree' needs a cost model: pass cost_model= (a CostModel or a file from "
                "`caddtree profile` / ConvexCostModel.fit(...).save())"
            )
        return CostAware(
            cost_model,
            check_int("max_budget", max_budget),
            lookup=bool(lookup),
            gate=bool(lookup if gate is None else gate),
        )
    return {"dflash": Chain, "lookup": Lookup}.get(method, NoTree)()


def build_tree(
    policy: TreePolicy,
    draft: DraftLogits | None,
    context_length: int,
    trie: CopyTrie | None = None,
) -> DraftTree:
    """The round's tree of ``policy`` from ``draft`` (empty without one) and, where the policy
    takes them, the copies of ``trie``, in target ids."""
    if trie is not None and policy.lookup:
        if policy.name == "lookup":
            return chain_tree(trie)
        cands = Candidates(draft) if draft is not None else None
        source = MergedSource(cands, trie, draft.token_map if draft is not None else None)
        max_nodes, costs = policy.limits(context_length)
        return build_merged([source], max_nodes, costs)[0]
    if draft is None:
        return DraftTree.empty()
    return draft.in_target_ids(policy.build(draft, context_length))


def chain_tree(trie: CopyTrie) -> DraftTree:
    """The chain of ``trie`` (:meth:`~caddtree.core.copies.CopyTrie.chain`) as a tree."""
    nodes = trie.chain()
    scores = np.cumsum([trie.log_conditional[v] for v in nodes])
    count = len(nodes)
    return DraftTree(
        [trie.tokens[v] for v in nodes],
        np.arange(count) - 1,
        np.arange(1, count + 1),
        scores,
        np.full(count, -1),
        np.ones(count, dtype=bool),
    )


class DraftGate:
    """Whether a CaDDTree round runs the drafter at all: not when the round's tree without it
    (copies from the context alone, or nothing: a plain round) promises more tokens per second
    than the last :data:`RECENT` rounds that drafted delivered (a drafter's rounds accept 0 to a
    few tokens each, so a short record would follow a bad stretch).

    Where ``measured`` (one request decoding alone), both sides are in wall time: the rounds that
    drafted by their tokens over their measured seconds, the round without the drafter by its
    surrogate ``(1 + Phi(n)) / C_v(n)`` rescaled by how long such rounds took against what the
    cost model said (over the last :data:`RECENT` of them). So a cost model that misprices one
    kind of round against the other (a drafter pass takes the caches its verification wanted; the
    machine was busier when it was profiled) cannot keep the drafter running where plain rounds
    are faster. The first :data:`WARM` rounds draft, the next :data:`WARM` do not (to measure
    both), unless drafting delivers :data:`DOUBT` times the model's plain rounds or more;
    elsewhere (a batch, whose rounds have no per-request time) the drafted rounds count by their
    modelled cost and the model's surrogate stands as it is.

    After ``interval`` rounds in a row of one choice, one round takes the other, so that what it
    delivers stays measured (a round without the drafter only where drafting is not
    :data:`DOUBT` times ahead, and only where rounds are measured); where that round does not
    change the choice the interval doubles (from :data:`EXPLORE` up to :data:`MAX_EXPLORE`), so a
    losing choice costs ever fewer rounds."""

    WARM = 2
    EXPLORE = 8
    MAX_EXPLORE = 64
    RECENT = 64
    DOUBT = 2.0  # drafting this many times ahead by the model is ahead: no plain rounds to measure

    def __init__(self, measured: bool = False) -> None:
        self.measured = measured
        self.drafted: deque[tuple[int, float]] = deque(maxlen=self.RECENT)  # (tokens, seconds)
        self.plain: deque[tuple[float, float]] = deque(maxlen=self.RECENT)  # (modelled, measured)
        self.streak = 0  # rounds in a row of the last choice
        self.last = False  # the last choice: skip the drafter
        self.interval = self.EXPLORE
        self.exploring: bool | None = None  # the choice an exploring round went against

    def skip(self, theta_alone: float) -> bool:
        if len(self.drafted) < self.WARM:
            return False
        rate = sum(t for t, _ in self.drafted) / sum(s for _, s in self.drafted)
        scale = sum(m for _, m in self.plain) / sum(c for c, _ in self.plain) if self.plain else 1
        theta = theta_alone / scale
        doubt = rate < self.DOUBT * theta  # is drafting not clearly ahead?
        if self.measured and len(self.plain) < self.WARM:
            return self._chose(doubt)  # then measure rounds without the drafter first
        choice = theta >= rate
        if self.exploring is not None:  # the round after one that explored
            same = choice == self.exploring
            self.interval = min(2 * self.interval, self.MAX_EXPLORE) if same else self.EXPLORE
            self.exploring = None
        elif (
            choice == self.last and self.streak >= self.interval and (choice or self._unsure(doubt))
        ):
            self.exploring, choice = choice, not choice
        return self._chose(choice)

    def _unsure(self, doubt: bool) -> bool:
        """Whether a round without the drafter is worth measuring: drafting is not clearly
        ahead, and its time is measured (in a batch it would go unmeasured)."""
        return doubt and self.measured

    def _chose(self, choice: bool) -> bool:
        self.streak = self.streak + 1 if choice == self.last else 1
        self.last = choice
        return choice

    def observe(self, tokens: int, seconds: float) -> None:
        """A round that drafted committed ``tokens`` in ``seconds`` (measured, or modelled)."""
        self.drafted.append((tokens, seconds))

    def observe_plain(self, modelled: float, measured: float) -> None:
        """A round without the drafter took ``measured`` seconds where the model said ``modelled``."""
        self.plain.append((modelled, measured))


@dataclass
class DraftChoice:
    """A CaDDTree request's choice, each round, of running the drafter or not (its
    :class:`DraftGate`), and the modelled cost of the round it chose, for the gate to learn from."""

    gate: DraftGate
    drafted_cost: float | None = None
    alone_cost: float | None = None

    @classmethod
    def start(cls, policy: TreePolicy, measured: bool) -> DraftChoice | None:
        """The choice of a request of ``policy`` (CaDDTree's, unless its gate is off; ``None``
        for the others)."""
        return cls(DraftGate(measured)) if getattr(policy, "gate", False) else None

    def alone(self, policy: TreePolicy, trie: CopyTrie | None, context_length: int):
        """The round's tree without the drafter (``trie``'s copies, or empty) where the gate leaves
        the drafter out; ``None`` when the drafter runs."""
        self.drafted_cost = self.alone_cost = None
        max_nodes, costs = policy.limits(context_length, drafting=False)
        tree = build_copies(trie, max_nodes, costs)
        if not self.gate.skip((1.0 + tree.phi) / max(costs[len(tree)], 1e-12)):
            return None
        self.alone_cost = costs[len(tree)]
        return tree

    def note_draft(self, policy: TreePolicy, context_length: int, tree: DraftTree | None) -> None:
        """Remember the round's modelled cost where it drafted ``tree`` (``None``: it did not)."""
        if tree is not None:
            self.drafted_cost = policy.limits(context_length)[1][len(tree)]

    def observe(self, tokens: int, seconds: float | None = None) -> None:
        """The round committed ``tokens`` in ``seconds`` (``None``: unmeasured, as in a batch)."""
        if self.drafted_cost is not None:
            self.gate.observe(tokens, self.drafted_cost if seconds is None else seconds)
        elif self.alone_cost is not None and seconds is not None:
            self.gate.observe_plain(self.alone_cost, seconds)
        self.drafted_cost = self.alone_cost = None


@dataclass
class ContextCopies:
    """One request's copies from its context: the index of its prompt and output (the bonus
    token last), its acceptance rates (pooled into ``rates.prior``) and the round's trie."""

    index: ContextIndex
    rates: CopyRates
    trie: CopyTrie | None = None

    @classmethod
    def start(cls, tokens: Sequence[int], pooled: CopyRates | None) -> ContextCopies:
        return cls(ContextIndex(tokens), CopyRates(prior=pooled))

    def propose(self, depth: int) -> CopyTrie | None:
        """The round's trie, at most ``depth`` deep."""
        self.trie = copy_trie(self.index, self.rates, depth)
        return self.trie

    def commit(self, chosen: Sequence[int], kept: Sequence[int]) -> None:
        """Learn from the target's ``chosen`` tokens below the bonus; add the ``kept`` ones."""
        self.rates.observe(self.trie, chosen)
        self.index.extend(kept)
