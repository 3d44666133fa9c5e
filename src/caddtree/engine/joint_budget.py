"""The joint tree budget of a batch of CaDDTree requests (:class:`JointBudget`): one budget of
nodes over every request's tree, priced by the batch's verification and drafting costs, with what
the decoder's rounds teach it: how well the drafter's prefix mass predicts acceptance
(``calibration``), how deep the trees go (``reach``), what the cost model leaves out, and whether
drafting pays at this batch size at all (``skip_round``).

:class:`~caddtree.engine.batching.BatchDecoder` calls it at named points of a round: ``applies``
and ``skip_round`` before proposing, ``reach`` for the blocks' depth, ``time_draft`` after the
drafter's pass, ``trees`` to build, ``observe_tree`` for each walked tree and ``observe_round``
after the round.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import numpy as np

from ..core.candidates import Candidates
from ..core.copies import CopyTrie
from ..core.cost import CostModel
from ..core.merged import MergedSource, build_merged
from ..core.tree import DraftTree, build_joint_caddtrees
from ..models.drafts import DraftLogits
from .batch_cost import BatchCostModel
from .policies import TreePolicy

__all__ = ["JointBudget"]

_DRAFT_TIMES = 16  # drafter passes remembered per batch size, for the joint budget's pricing
_SKIP_ROUNDS = 8  # rounds without drafting after a joint round where drafting did not pay
_RATE_ROUNDS = 16  # joint rounds remembered per batch size and kind, for the measured rates
_MAX_BACKOFF = 4  # skip windows double while drafting keeps measuring slower, up to 16x
_CALIBRATION_TREES = 256  # drafted trees remembered for the drafter's calibration
_CALIBRATION_PRIOR = 4.0  # prefix mass at calibration 1 counted before any tree is verified
_DEPTH_ROUNDS = 16  # joint rounds whose deepest node sets how deep the next ones draft
_DEPTH_MARGIN = 2  # positions drafted past the deepest node of those rounds
# Drafting must beat plain rounds by this much to go on. Its costs outside its own rounds do not
# show in them: requests drafted at different speeds fall out of step and the batch thins out as
# they finish one by one, and the first pass after a pause reads every token since (docs/server.md,
# "Where a batched round's time goes", for what it changed).
_DRAFT_MARGIN = 1.05


class JointBudget:
    """The joint budget of a batch's CaDDTree trees (see the module docstring), priced by
    ``cost_model`` (a :class:`~caddtree.engine.batch_cost.BatchCostModel`, or a one-sequence
    model; ``None``: no joint rounds) over at most ``max_nodes`` nodes in all."""

    def __init__(self, cost_model: CostModel | BatchCostModel | None, max_nodes: int) -> None:
        self.cost_model, self.max_nodes = cost_model, max_nodes
        # drafter pass seconds, by sequences and block rows
        self._draft_times: dict[tuple[int, int], deque[float]] = {}
        self._depths: deque[int] = deque(maxlen=_DEPTH_ROUNDS)  # deepest node per joint round
        self._skip = (0, 0)  # (batch size, rounds left) that decode without drafting
        self._slower: dict[int, int] = {}  # by batch size: judgements in a row against drafting
        # (batch size, drafted) -> (tokens committed, seconds) of recent joint rounds
        self._rates: dict[tuple[int, bool], deque[tuple[int, float]]] = {}
        # (prefix mass, nodes accepted) of recently verified trees, for the calibration
        self._verified: deque[tuple[float, int]] = deque(maxlen=_CALIBRATION_TREES)
        self._misses = _CostMisses()
        self._modelled = (0.0, 0)  # the last joint round's modelled seconds and drafting requests

    @property
    def calibration(self) -> float:
        """Tokens the target accepts per unit of the drafter's prefix mass ``Phi``, over the
        recent trees verified (``kappa`` of :func:`~caddtree.core.tree.build_joint_caddtrees`): a
        drafter's marginals are seldom calibrated. Acceptance belongs to the drafter and the
        target, not to the batch, so trees of every batch size count; before there are many, a
        prior of ``Phi`` at face value weighs in."""
        mass = sum(phi for phi, _ in self._verified)
        accepted = sum(count for _, count in self._verified)
        return (accepted + _CALIBRATION_PRIOR) / (mass + _CALIBRATION_PRIOR)

    def applies(self, policies: Sequence[TreePolicy]) -> bool:
        """Whether a round of requests with ``policies`` takes its trees from the joint budget:
        a cost model, two or more requests, all CaDDTree ones (a request alone builds its own
        CaDDTree tree, which is what the joint budget of one request is)."""
        return (
            self.cost_model is not None
            and len(policies) > 1
            and all(p.name == "caddtree" for p in policies)
        )

    def reach(self) -> int | None:
        """How deep a joint round drafts: :data:`_DEPTH_MARGIN` past the deepest node of the last
        :data:`_DEPTH_ROUNDS` joint rounds (the whole block before there are any)."""
        return max(self._depths) + _DEPTH_MARGIN if self._depths else None

    def skip_round(self, policies: Sequence[TreePolicy]) -> bool:
        """Count one round of a batch with ``policies`` against the skip window (rounds of the
        batch size :meth:`_judge` judged), and say whether it skips drafting: joint rounds in
        the window do."""
        batch, left = self._skip
        if left <= 0 or batch != len(policies) or self.cost_model is None:
            return False
        self._skip = (batch, left - 1)
        return all(p.name == "caddtree" for p in policies)

    def time_draft(self, sequences: int, rows: int, seconds: float) -> None:
        """A drafter pass of ``sequences`` sequences and ``rows`` block rows took ``seconds``."""
        key = (sequences, rows)
        self._draft_times.setdefault(key, deque(maxlen=_DRAFT_TIMES)).append(seconds)

    def trees(
        self,
        drafts: list[DraftLogits | None],
        lengths: list[int],
        tries: Sequence[CopyTrie | None] = (),
    ) -> list[DraftTree]:
        """Every request's tree (in target ids) from one budget over all of them
        (:func:`~caddtree.core.tree.build_joint_caddtrees`), for requests whose contexts hold
        ``lengths`` tokens and that drafted ``drafts`` (``None``: no draft this round), with
        their copies from the context where ``tries`` holds some (a copy's node is priced like a
        drafted one: :func:`~caddtree.core.merged.build_merged`).

        A round of ``B`` requests with ``n`` nodes in all is priced by the batch cost model
        (``C_v(n; B, context)`` at the mean context), or, with a one-sequence model, as one
        sequence's verification of ``B - 1 + n`` nodes; plus the drafter pass of ``B`` sequences
        as timed here (:meth:`_draft_cost`) and what the cost model leaves out (measured)."""
        tries = list(tries) or [None] * len(drafts)
        present = [d for d in drafts if d is not None]
        verify = self._verify_costs(len(lengths), sum(lengths) // len(lengths))
        if not present and not any(tries):  # batched plain decoding: nothing to choose
            self._modelled = (float(verify[0]), 0)
            return [DraftTree.empty() for _ in drafts]
        misses = self._misses
        rows = sum(d.shape[0] + 1 for d in present)  # each block's bonus and drafted positions
        modelled = verify + (self._draft_cost(len(present), rows) if present else 0.0)
        costs = modelled + misses.plain_s + len(present) * misses.per_draft_s
        kappa = self.calibration
        chosen = _joint_trees(drafts, tries, costs, self.max_nodes, kappa)
        self._modelled = (float(modelled[sum(len(t) for t in chosen)]), len(present))
        if present:
            self._judge(len(drafts), chosen, costs, float(verify[0]) + misses.plain_s, kappa)
        self._depths.append(max((int(t.depths.max()) for t in chosen if len(t)), default=0))
        return chosen

    def observe_tree(self, phi: float, accepted: int) -> None:
        """A verified tree of prefix mass ``phi`` had ``accepted`` nodes accepted."""
        self._verified.append((phi, accepted))

    def observe_round(self, batch: int, drafted: bool, tokens: int, seconds: float) -> None:
        """A joint round of ``batch`` requests (``drafted`` or not) committed ``tokens`` in
        ``seconds``: its rate, and what its modelled cost left out."""
        kept = self._rates.setdefault((batch, drafted), deque(maxlen=_RATE_ROUNDS))
        kept.append((tokens, seconds))
        self._misses.remember(*self._modelled, seconds)

    # ---- pricing and judging --------------------------------------------------------------------

    def _verify_costs(self, batch: int, context: int) -> np.ndarray:
        """Modelled seconds to verify ``batch`` bonus rows and ``n = 0 .. max_nodes`` tree nodes
        in all, at ``context``."""
        model = self.cost_model
        if isinstance(model, BatchCostModel):
            return model.verify_cost_table(batch, context, self.max_nodes)
        table = model.round_cost_table(context, batch - 1 + self.max_nodes)
        return table[batch - 1 :] - model.draft_cost

    def _draft_cost(self, sequences: int, rows: int) -> float:
        """Seconds of a drafter pass of ``sequences`` sequences with ``rows`` block rows in all:
        the median of the last timed ones (of the nearest block rows timed three times with as
        many sequences), or before there are any, the cost model's (a one-sequence model's for
        each sequence; whole blocks)."""
        timed = self._draft_times.get((sequences, rows), ())
        if len(timed) < 3:  # the nearest block rows timed with as many sequences, if any
            near = [k for k, v in self._draft_times.items() if k[0] == sequences and len(v) >= 3]
            if near:
                timed = self._draft_times[min(near, key=lambda k: abs(k[1] - rows))]
        if len(timed) >= 3:
            return float(np.median(timed))
        if isinstance(self.cost_model, BatchCostModel):
            return self.cost_model.draft_cost(sequences)
        return sequences * self.cost_model.draft_cost

    def _measured_rates(self, batch: int) -> tuple[float, float] | None:
        """Tokens per second of this batch size's recent joint rounds that drafted and of those
        that did not, once there are a few of each (``None`` before)."""
        rates = []
        for drafted in (True, False):
            kept = self._rates.get((batch, drafted), ())
            if len(kept) < 4:
                return None
            rates.append(sum(t for t, _ in kept) / sum(s for _, s in kept))
        return rates[0], rates[1]

    def _judge(
        self,
        batch: int,
        trees: list[DraftTree],
        costs: np.ndarray,
        plain_cost: float,
        kappa: float,
    ) -> None:
        """After a joint round of ``batch`` requests that drafted: whether the next
        :data:`_SKIP_ROUNDS` rounds of this batch size decode plainly without drafting. Once
        rounds of both kinds have been timed at this batch size, the measured tokens per second
        decide, and each time in a row they find drafting not :data:`_DRAFT_MARGIN` faster the
        window doubles (up to 16 times); before, the cost model does: skip when the round's
        surrogate (its prefix mass at ``kappa``), drafting included, is not
        :data:`_DRAFT_MARGIN` above batched plain decoding's (``batch / plain_cost``). Where
        drafting cannot pay (large batches on a few cores), the batch runs at batched AR's speed
        instead of paying for drafts it verifies none of."""
        measured = self._measured_rates(batch)
        if measured is not None:  # both kinds of round measured: the faster one wins
            if measured[1] * _DRAFT_MARGIN > measured[0]:  # in a row, a window twice as long
                streak = self._slower.get(batch, 0)
                self._skip = (batch, _SKIP_ROUNDS << min(streak, _MAX_BACKOFF))
                self._slower[batch] = streak + 1
            else:
                self._slower[batch] = 0
            return
        nodes = sum(len(t) for t in trees)
        drafted = (batch + kappa * sum(t.phi for t in trees)) / costs[nodes]
        if drafted < _DRAFT_MARGIN * batch / plain_cost:
            self._skip = (batch, _SKIP_ROUNDS)


def _joint_trees(
    drafts: list[DraftLogits | None],
    tries: list[CopyTrie | None],
    costs: np.ndarray,
    max_nodes: int,
    kappa: float,
) -> list[DraftTree]:
    """The trees of one joint budget, in target ids: the drafter's alone, or merged with the
    copies where there are any (the same rule: ``R / kappa`` bonus rows)."""
    if not any(tries):
        present = [d for d in drafts if d is not None]
        built = iter(build_joint_caddtrees(present, costs, max_nodes, calibration=kappa))
        return [
            d.in_target_ids(next(built)) if d is not None else DraftTree.empty() for d in drafts
        ]
    sources = [
        MergedSource(Candidates(d) if d is not None else None, trie, getattr(d, "token_map", None))
        for d, trie in zip(drafts, tries)
    ]
    taking = sum(1 for d, trie in zip(drafts, tries) if d is not None or trie is not None)
    return build_merged(sources, max_nodes, costs[: max_nodes + 1].tolist(), taking / kappa)


class _CostMisses:
    """What the cost model leaves out of the joint rounds, as measured: the seconds a plain round
    takes beyond its modelled cost (the round's bookkeeping), and, per drafting request, what a
    round that drafts takes beyond that (building and walking its tree, its context rows in the
    drafter pass, ...). Both are medians of recent rounds of any batch size (0 before there are
    a few), so a batch size met for the first time is priced with them."""

    def __init__(self) -> None:
        self._plain: deque[float] = deque(maxlen=_RATE_ROUNDS)
        self._per_draft: deque[float] = deque(maxlen=2 * _RATE_ROUNDS)

    @property
    def plain_s(self) -> float:
        return float(np.median(self._plain)) if len(self._plain) >= 3 else 0.0

    @property
    def per_draft_s(self) -> float:
        if len(self._per_draft) < 3:
            return 0.0
        return max(0.0, float(np.median(self._per_draft)))

    def remember(self, modelled: float, drafting: int, seconds: float) -> None:
        if drafting:
            self._per_draft.append((seconds - modelled - self.plain_s) / drafting)
        else:
            self._plain.append(seconds - modelled)
