"""Several requests decoded together: one target forward per round verifies every request's tree.

:class:`BatchDecoder` keeps up to ``max_batch`` requests in the lean runtime's cache slots
(:class:`~caddtree.models.lean.LeanTarget`). Requests join between rounds (:meth:`BatchDecoder.add`
prefills one and chooses its first token) and leave when they finish (:meth:`BatchDecoder.step`
returns them and frees their slots): continuous batching. Each round

1. drafts for every request that drafts, all in **one** drafter pass
   (:class:`~caddtree.models.batch_proposer.BatchProposer`: each request's block sees only its
   own drafter cache slot, and is as deep as its tree can reach), and builds each request's tree
   with its own policy (AR, DFlash, DDTree, CaDDTree), or all of them with one joint budget;
2. verifies all the trees in **one** target forward (:meth:`LeanTarget.forward` of
   :class:`~caddtree.models.lean.Rows`: each request's rows see only its own cache and tree);
3. walks each request's tree with its own sampler, stops it where plain decoding would stop, and
   compacts its accepted path into its slot.

A request's output does not depend on what else is in the batch: its rows see nothing of the
others', and its sampler draws from its own generator. At temperature 0 it is plain greedy
decoding's output token for token (float64 on the test models), as for :func:`caddtree.engine.decoding.
decode`, which stays the single-request loop with every analysis hook.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch

from ..core.cost import CostModel
from ..core.sampling import TokenContext, greedy_choices, plain_greedy, walk_tree
from ..core.tree import DraftTree, build_joint_caddtrees, verification_rows
from ..models.batch_proposer import BatchProposer, DraftCall
from ..models.drafts import DraftLogits
from ..models.lean import LeanTarget, Rows
from ..models.rows import tree_rows
from ..util.checks import check_int
from ..util.errors import InvalidInputError
from .batch_cost import BatchCostModel
from .decoding import RoundStats, stop_point
from .requests import GenerationRequest

__all__ = ["BatchDecoder", "GenerationRequest"]

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


@dataclass(eq=False)
class _Running:
    """A request in a slot: where its context ends, its next bonus token and the features of
    its newest tokens (for the drafter, which keeps its context in the same slot)."""

    request: GenerationRequest
    slot: int
    length: int
    bonus: int
    features: list[torch.Tensor]  # in order; joined only when the drafter reads them
    context: TokenContext | None


class BatchDecoder:
    """Continuous batching of :class:`GenerationRequest` s over ``target`` (see the module
    docstring).

    Args:
        target: the lean runtime of the target model (its feature layers the drafter's).
        drafter: a DFlash drafter for requests whose policy drafts (``None``: AR only).
        max_batch: requests decoded at once (cache slots).
        capacity: the most positions one request may fill (prompt, output and its largest tree).
        progress: show a progress line while the compiled runtime's batch graph compiles.
    """

    def __init__(
        self,
        target: LeanTarget,
        drafter: object | None = None,
        *,
        max_batch: int,
        capacity: int,
        joint_cost_model: CostModel | BatchCostModel | None = None,
        joint_max_nodes: int = 256,
        progress: bool = False,
    ) -> None:
        self.target, self.drafter = target, drafter
        self.joint_cost_model, self.joint_max_nodes = joint_cost_model, joint_max_nodes
        self.max_batch = check_int("max_batch", max_batch, minimum=1)
        self.capacity = check_int("capacity", capacity, minimum=2)
        target.compile_batch(self.max_batch, progress)
        target.reserve(self.max_batch, self.capacity)
        self.proposer = (
            BatchProposer(drafter, target.model, self.max_batch) if drafter is not None else None
        )
        self._free = list(range(self.max_batch))
        # drafter pass seconds, by sequences and block rows
        self._draft_times: dict[tuple[int, int], deque[float]] = {}
        self._joint_depths: deque[int] = deque(maxlen=_DEPTH_ROUNDS)  # deepest node per round
        self._skip = (0, 0)  # (batch size, rounds left) that decode without drafting
        self._slower: dict[
            int, int
        ] = {}  # by batch size: measured judgements in a row against drafting
        # (batch size, drafted) -> (tokens committed, seconds) of recent joint rounds
        self._rates: dict[tuple[int, bool], deque[tuple[int, float]]] = {}
        # (prefix mass, nodes accepted) of recently verified trees, for the calibration
        self._verified: deque[tuple[float, int]] = deque(maxlen=_CALIBRATION_TREES)
        self._misses = _CostMisses()
        self._modelled = (0.0, 0)  # the last joint round's modelled seconds and drafting requests
        self._running: list[_Running] = []

    @property
    def calibration(self) -> float:
        """Tokens the target accepts per unit of the drafter's prefix mass ``Phi``, over the
        recent trees this decoder verified (the joint budget's ``kappa``,
        :func:`~caddtree.core.tree.build_joint_caddtrees`): a drafter's marginals are seldom
        calibrated (the built-in one's trees are accepted about 3/4 as often as their ``Phi``
        says). Acceptance belongs to the drafter and the target, not to the batch, so trees of
        every batch size count; before there are many, a prior of ``Phi`` at face value weighs in."""
        mass = sum(phi for phi, _ in self._verified)
        accepted = sum(count for _, count in self._verified)
        return (accepted + _CALIBRATION_PRIOR) / (mass + _CALIBRATION_PRIOR)

    @property
    def running(self) -> list[GenerationRequest]:
        """The requests decoding now, in the order they joined."""
        return [r.request for r in self._running]

    def has_room(self) -> bool:
        """Whether a request can join now (a slot is free). The decoder is not thread-safe: one
        thread adds, steps and reads it."""
        return bool(self._free)

    def add(self, request: GenerationRequest) -> GenerationRequest:
        """Prefill ``request`` in a free slot and choose its first token. A request that is done
        at once (one token wanted, or a stop token first) is returned finished, slot freed."""
        prompt = [int(t) for t in request.prompt_ids]
        check_int("max_new_tokens", request.max_new_tokens)
        if not prompt:
            raise InvalidInputError("the prompt is empty; give at least one token")
        if not self._free:
            raise InvalidInputError(f"the batch is full ({self.max_batch} requests); wait")
        if request.policy.needs_drafter and self.drafter is None:
            raise InvalidInputError(f"method {request.policy.name!r} needs a drafter")
        room = len(prompt) + request.max_new_tokens + 1
        if room > self.capacity:
            raise InvalidInputError(
                f"the prompt ({len(prompt)} tokens) and max_new_tokens "
                f"({request.max_new_tokens}) need {room} positions, more than the "
                f"{self.capacity} of a slot"
            )
        if self.target.slots < self.max_batch:  # someone let the cache go: room again
            self.target.reserve(self.max_batch, self.capacity)
        slot = self._free.pop(0)
        request.started = time.perf_counter()
        try:
            running = self._prefill(request, prompt, slot)
        except BaseException:
            self._free.insert(0, slot)  # a failed prefill gives its slot back
            raise
        self._commit_tokens(running, [running.bonus])
        request.prefill_s = time.perf_counter() - request.started
        self._running.append(running)
        if request.stop_reason is not None:
            self._leave(running)
        return request

    def _prefill(self, request: GenerationRequest, prompt: list[int], slot: int) -> _Running:
        """Run ``prompt`` into ``slot`` and choose the first token."""
        sampler = request.sampler
        context = None
        if sampler.needs_context or request.stopping_criteria:
            context = TokenContext(prompt, len(prompt) + request.max_new_tokens, self.target.device)
        rows = Rows.batch([(slot, 0, prompt, range(len(prompt)), None)], self.target.device)
        logits, features = self.target.forward(rows, slice(len(prompt) - 1, len(prompt)))
        bonus = sampler.choose(logits[-1], context.ids() if context is not None else None)
        if self.proposer is not None:
            self.proposer.reset(slot)
        return _Running(request, slot, len(prompt), bonus, [features], context)

    def step(self) -> list[GenerationRequest]:
        """One round for every running request; returns the ones that finished in it."""
        if not self._running:
            return []
        start = time.perf_counter()
        drafts = self._drafts()
        joint = self._joint_trees(drafts)
        trees = joint or [self._tree(r, d) for r, d in zip(self._running, drafts)]
        # a tree fits what is left of its slot (the best-first order's first nodes: still a tree)
        trees = [
            _first_nodes(t, self.capacity - r.length - 1) for r, t in zip(self._running, trees)
        ]
        rows = Rows.batch(
            [tree_rows(r.slot, r.length, r.bonus, t) for r, t in zip(self._running, trees)],
            self.target.device,
        )
        drafted = time.perf_counter()
        logits, features = self.target.forward(rows)
        forward_s = time.perf_counter() - drafted
        finished, offset, committed, batch = [], 0, 0, len(self._running)
        greedy = any(plain_greedy(r.request.sampler) for r in self._running)
        choices = greedy_choices(logits).tolist() if greedy else None  # one call for all rows
        moves = []  # every request's accepted path, compacted in one go
        try:
            for running, tree in zip(list(self._running), trees):
                n = len(tree) + 1
                rows = slice(offset, offset + n)
                chosen = choices and choices[rows]
                moves.append(self._walk(running, tree, logits[rows], features[rows], chosen))
                offset += n
                stats = running.request.round_stats[-1]
                if stats.budget:
                    self._verified.append((stats.phi, stats.accepted))
                stats.draft_s, stats.forward_s = drafted - start, forward_s
                stats.round_s = stats.verify_s = time.perf_counter() - drafted
                committed += stats.committed
                if running.request.stop_reason is not None:
                    self._leave(running)
                    finished.append(running.request)
        finally:  # the walked requests' caches match their lengths, whatever happened after
            self.target.compact_many([m for m in moves if m is not None])
        if joint is not None:
            seconds = time.perf_counter() - start
            self._remember_rate(batch, drafts, committed, seconds)
            self._misses.remember(*self._modelled, seconds)
        return finished

    def _remember_rate(
        self, batch: int, drafts: list[DraftLogits | None], tokens: int, seconds: float
    ) -> None:
        """Keep a joint round's tokens and time, by batch size and whether it drafted."""
        drafted = any(d is not None for d in drafts)
        kept = self._rates.setdefault((batch, drafted), deque(maxlen=_RATE_ROUNDS))
        kept.append((tokens, seconds))

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

    def drop(self, request: GenerationRequest) -> None:
        """End a running ``request`` now (a cancelled one): its slot is freed, its output kept,
        its ``stop_reason`` is ``"cancelled"``."""
        for running in self._running:
            if running.request is request:
                request.stop_reason = "cancelled"
                self._leave(running)
                return

    def _leave(self, running: _Running) -> None:
        self._running.remove(running)
        self._free.append(running.slot)
        request = running.request
        request.wall_s = time.perf_counter() - request.started

    def run(self, requests: Iterable[GenerationRequest]) -> list[GenerationRequest]:
        """Decode ``requests`` to the end, each joining as soon as a slot is free."""
        waiting, done = list(requests), []
        while waiting or self._running:
            while waiting and self._free:
                request = self.add(waiting.pop(0))
                if request.stop_reason is not None:
                    done.append(request)
            done.extend(self.step())
        return done

    # ---- a round's steps, per request --------------------------------------------------------

    def _drafts(self) -> list[DraftLogits | None]:
        """Every running request's draft logits for this round, from one drafter pass (``None``
        for a request that does not draft now: its policy does not, or one token is left)."""
        wanted = {}
        joint_reach = self._joint_reach() if self._joint_round() else None
        for running in self._running:
            request = running.request
            max_depth = request.max_new_tokens - len(request.output) - 1
            for reach in (getattr(request.policy, "reach", None), joint_reach):
                max_depth = max_depth if reach is None else min(max_depth, reach)
            if request.policy.needs_drafter and max_depth > 0:
                wanted[running.slot] = max_depth
        if not wanted or self._skipping():
            return [None] * len(self._running)
        calls = [
            DraftCall(r.slot, r.bonus, _joined(r.features))
            for r in self._running
            if r.slot in wanted
        ]
        # each block as deep as its tree can reach: the positions past that nobody reads
        sizes = [min(self.proposer.block_size, 1 + wanted[c.slot]) for c in calls]
        began = time.perf_counter()
        drafted = dict(zip(wanted, self.proposer.propose(calls, sizes)))
        for running in self._running:
            if running.slot in wanted:  # the drafter has these features now
                running.features = []
        key = (len(calls), sum(sizes))
        times = self._draft_times.setdefault(key, deque(maxlen=_DRAFT_TIMES))
        times.append(time.perf_counter() - began)
        return [
            drafted[r.slot][: wanted[r.slot]] if r.slot in wanted else None for r in self._running
        ]

    def _joint_round(self) -> bool:
        """Whether this round's trees come from one joint budget: a ``joint_cost_model``, two or
        more running requests, all CaDDTree ones (:meth:`_joint_trees`)."""
        running = self._running
        return (
            self.joint_cost_model is not None
            and len(running) > 1
            and all(r.request.policy.name == "caddtree" for r in running)
        )

    def _joint_reach(self) -> int | None:
        """How deep a joint round drafts: :data:`_DEPTH_MARGIN` past the deepest node of the last
        :data:`_DEPTH_ROUNDS` joint rounds that drafted (the whole block before there are any).
        Trees that reach that depth widen it again by the margin."""
        if not self._joint_depths:
            return None
        return max(self._joint_depths) + _DEPTH_MARGIN

    def _skipping(self) -> bool:
        """Whether this round skips drafting (:meth:`_judge_drafting`): only joint rounds of the
        batch size that was judged, for the rounds left."""
        batch, left = self._skip
        if left <= 0 or batch != len(self._running) or self.joint_cost_model is None:
            return False
        self._skip = (batch, left - 1)
        return all(r.request.policy.name == "caddtree" for r in self._running)

    def _tree(self, running: _Running, draft: DraftLogits | None) -> DraftTree:
        if draft is None:
            return DraftTree.empty()
        return draft.in_target_ids(running.request.policy.build(draft, running.length))

    def _joint_trees(self, drafts: list[DraftLogits | None]) -> list[DraftTree] | None:
        """Every request's tree from one joint budget (:func:`~caddtree.core.tree.
        build_joint_caddtrees`), when the decoder has a ``joint_cost_model`` and two or more
        running requests, all CaDDTree ones; ``None`` otherwise. A request alone builds its own
        CaDDTree tree (what the joint budget of one request is), priced by its own cost model:
        the one-sequence model of the path it runs on, without the batch's skipping rules.

        A round of ``B`` requests with ``n`` nodes in all is priced by the measured batch cost
        model (:class:`~caddtree.engine.batch_cost.BatchCostModel`: ``C_v(n; B, context)`` at the
        mean context), or, given a one-sequence model, as one sequence's verification with
        ``B - 1 + n`` nodes (the other requests' bonus rows counted as nodes); plus the drafter
        pass of ``B`` sequences as this decoder has timed it (the median of its last passes of
        that size; before three of them, the model's)."""
        model = self.joint_cost_model
        if not self._joint_round():  # one request alone: its own CaDDTree is the joint one
            return None
        present = [d for d in drafts if d is not None]
        verify = self._verify_costs(model)
        if not present:  # batched plain decoding: nothing to choose
            self._modelled = (float(verify[0]), 0)
            return [DraftTree.empty() for _ in drafts]
        misses = self._misses
        # each block's rows: its bonus and the positions drafted after it
        rows = sum(d.shape[0] + 1 for d in present)
        modelled = verify + self._draft_cost(len(present), rows, model)
        costs = modelled + misses.plain_s + len(present) * misses.per_draft_s
        kappa = self.calibration
        chosen = build_joint_caddtrees(present, costs, self.joint_max_nodes, calibration=kappa)
        self._modelled = (float(modelled[sum(len(t) for t in chosen)]), len(present))
        # did it pay? how deep did it go?
        self._judge_drafting(chosen, costs, float(verify[0]) + misses.plain_s, kappa)
        self._joint_depths.append(max((int(t.depths.max()) for t in chosen if len(t)), default=0))
        built = iter(chosen)
        return [
            d.in_target_ids(next(built)) if d is not None else DraftTree.empty() for d in drafts
        ]

    def _verify_costs(self, model: CostModel | BatchCostModel) -> np.ndarray:
        """Modelled seconds to verify the running requests' bonus rows and ``n = 0 ..
        joint_max_nodes`` tree nodes in all, at their mean context."""
        batch = len(self._running)
        context = sum(r.length for r in self._running) // batch
        if isinstance(model, BatchCostModel):
            return model.verify_cost_table(batch, context, self.joint_max_nodes)
        table = model.round_cost_table(context, batch - 1 + self.joint_max_nodes)
        return table[batch - 1 :] - model.draft_cost

    def _judge_drafting(
        self, trees: list[DraftTree], costs: np.ndarray, plain_cost: float, kappa: float
    ) -> None:
        """After a joint round that drafted: whether the next :data:`_SKIP_ROUNDS` rounds of this
        batch size decode plainly without drafting (then the drafter is tried again). Once rounds
        of both kinds have been timed at this batch size, the measured tokens per second decide
        (the cost model's surrogate can misjudge both acceptance and this engine's costs), and
        each time in a row they find drafting not :data:`_DRAFT_MARGIN` faster the window doubles
        (up to 16 times), so a batch size where drafting never pays spends ever fewer rounds
        trying it; before, the cost model does: skip when the round's surrogate (its prefix mass
        at the decoder's :attr:`calibration` ``kappa``), drafting included, is not
        :data:`_DRAFT_MARGIN` above batched plain decoding's without a drafter pass
        (``len(requests) / plain_cost``). Where
        drafting cannot pay (large batches on a few cores), the batch runs at batched AR's speed
        instead of paying for drafts it verifies none of."""
        batch = len(self._running)
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

    def _draft_cost(self, sequences: int, rows: int, model: CostModel | BatchCostModel) -> float:
        """Seconds of a drafter pass of ``sequences`` sequences with ``rows`` block rows in
        all: the median of the last timed ones (of the nearest block rows timed three times with
        as many sequences), or before there are any, ``model``'s (a one-sequence model's for each
        sequence; whole blocks)."""
        timed = self._draft_times.get((sequences, rows), ())
        if len(timed) < 3:  # the nearest block rows timed with as many sequences, if any
            near = [k for k, v in self._draft_times.items() if k[0] == sequences and len(v) >= 3]
            if near:
                timed = self._draft_times[min(near, key=lambda k: abs(k[1] - rows))]
        if len(timed) >= 3:
            return float(np.median(timed))
        if isinstance(model, BatchCostModel):
            return model.draft_cost(sequences)
        return sequences * model.draft_cost

    def _walk(
        self,
        running: _Running,
        tree: DraftTree,
        logits: torch.Tensor,
        features: torch.Tensor,
        choices: list[int] | None,
    ) -> tuple[int, int, list[int]] | None:
        """Walk ``running``'s tree and commit what it accepts; returns the cache move of its
        accepted path (:meth:`~caddtree.models.lean.LeanTarget.compact_many`), ``None`` for a
        request that is done."""
        request = running.request
        nodes, next_bonus = walk_tree(tree, logits, request.sampler, running.context, choices)
        tokens = [int(tree.token_ids[k]) for k in nodes] + [next_bonus]
        request.rounds += 1
        request.accepted += len(nodes)
        before = len(request.output)
        self._commit_tokens(running, tokens)
        request.round_stats.append(
            RoundStats(
                context_length=running.length,
                budget=len(tree),
                accepted=len(nodes),
                committed=len(request.output) - before,
                draft_s=0.0,
                tree_s=0.0,
                verify_s=0.0,
                phi=tree.phi,
                path=nodes,
            )
        )
        if request.stop_reason is not None:
            return None
        rows = verification_rows(nodes)
        move = (running.slot, running.length, rows)
        running.length += len(rows)
        accepted = features[torch.tensor(rows, device=features.device)]
        # the drafter has not seen them yet: kept (with any of rounds it skipped) until it has
        running.features = [*running.features, accepted] if request.policy.needs_drafter else []
        running.bonus = next_bonus
        return move

    def _commit_tokens(self, running: _Running, tokens: list[int]) -> None:
        """Append the tokens the output keeps (up to a stop token, a stopping criterion or the
        length) and say whether the request is done (``stop_reason``)."""
        request = running.request
        room = request.max_new_tokens - len(request.output)
        stops, criteria = set(request.stop_token_ids), request.stopping_criteria
        keep, reason = stop_point(tokens, room, stops, criteria, running.context)
        request.output.extend(tokens[:keep])
        if running.context is not None and reason is None:
            running.context.commit(tokens[:keep])
        request.stop_reason = reason


class _CostMisses:
    """What the cost model leaves out of this decoder's joint rounds, as measured: the seconds a
    plain round takes beyond its modelled cost (the round's bookkeeping), and, per drafting
    request, what a round that drafts takes beyond that (building and walking its tree, its
    context rows in the drafter pass, ...). Both are medians of recent rounds of any batch size
    (0 before there are a few), so a batch size met for the first time is priced with them."""

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


def _joined(chunks: list[torch.Tensor]) -> torch.Tensor:
    return chunks[0] if len(chunks) == 1 else torch.cat(chunks)


def _first_nodes(tree: DraftTree, count: int) -> DraftTree:
    """The first ``count`` nodes of ``tree`` (all of them if it has no more): in best-first order
    every node's parent comes before it, so they form a tree."""
    if len(tree) <= count:
        return tree
    return DraftTree(
        tree.token_ids[:count],
        tree.parents[:count],
        tree.depths[:count],
        tree.log_probs[:count],
        tree.ranks[:count],
    )
