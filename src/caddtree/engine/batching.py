"""Several requests decoded together: one target forward per round verifies every request's tree.

:class:`BatchDecoder` keeps up to ``max_batch`` requests in the lean runtime's cache slots
(:class:`~caddtree.runtime.lean.LeanTarget`). Requests join between rounds (:meth:`BatchDecoder.add`
prefills one and chooses its first token) and leave when they finish (:meth:`BatchDecoder.step`
returns them and frees their slots): continuous batching. Each round

1. drafts for every request that drafts, all in **one** drafter pass
   (:class:`~caddtree.models.batch_proposer.BatchProposer`: each request's block sees only its
   own drafter cache slot, and is as deep as its tree can reach), and builds each request's tree
   with its own policy (AR, DFlash, DDTree, CaDDTree), or all of them with one joint budget;
2. verifies all the trees in **one** target forward (:meth:`LeanTarget.forward` of
   :class:`~caddtree.runtime.lean.Rows`: each request's rows see only its own cache and tree);
3. walks each request's tree with its own sampler, stops it where plain decoding would stop, and
   compacts its accepted path into its slot.

A request's output does not depend on what else is in the batch: its rows see nothing of the
others', and its sampler draws from its own generator. At temperature 0 it is plain greedy
decoding's output token for token (float64 on the test models), as for :func:`caddtree.engine.decoding.
decode`, which stays the single-request loop with every analysis hook.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from ..core.copies import CopyRates, CopyTrie
from ..core.cost import CostModel
from ..core.sampling import TokenContext, greedy_choices, plain_greedy, walk_tree
from ..core.tree import DraftTree, verification_rows
from ..models.batch_proposer import BatchProposer, DraftCall
from ..models.drafts import DraftLogits
from ..runtime.lean import LeanTarget, Rows
from ..runtime.rows import tree_rows
from ..util.checks import check_int
from ..util.errors import InvalidInputError
from .batch_cost import BatchCostModel
from .decoding import RoundStats, check_prompt, stop_point
from .joint_budget import JointBudget
from .policies import ContextCopies, DraftChoice, build_tree, copy_depth
from .requests import GenerationRequest

__all__ = ["BatchDecoder", "GenerationRequest"]


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
    copies: ContextCopies | None = None  # its copies from the context (lookup)
    choice: DraftChoice | None = None  # with copies, CaDDTree's choice to draft or not
    alone: DraftTree | None = None  # this round's tree of copies alone, where the gate chose it

    def copy_trie(self) -> CopyTrie | None:
        """This round's copies (lookup), as deep as its policy and what is left of its output
        allow (:func:`~caddtree.engine.policies.copy_depth`)."""
        if self.copies is None:
            return None
        request = self.request
        return self.copies.propose(
            copy_depth(request.policy, request.max_new_tokens - len(request.output) - 1)
        )

    def copies_suffice(self) -> bool:
        """Whether this round leaves the drafter out: the copies alone promise more than its
        drafted rounds have delivered (:class:`~caddtree.engine.policies.DraftGate`)."""
        choice = self.choice  # a batch's requests have one with copies only
        self.alone = None
        if choice is not None:
            self.alone = choice.alone(self.request.policy, self.copies.trie, self.length)
        return self.alone is not None

    def walk(
        self,
        tree: DraftTree,
        logits: torch.Tensor,
        features: torch.Tensor,
        choices: list[int] | None,
    ) -> tuple[int, int, list[int]] | None:
        """Walk this request's verified tree and commit what it accepts; returns the cache move
        of its accepted path (:meth:`~caddtree.runtime.lean.LeanTarget.compact_many`), ``None``
        for a request that is done."""
        running, request = self, self.request
        nodes, next_bonus = walk_tree(tree, logits, request.sampler, running.context, choices)
        tokens = [int(tree.token_ids[k]) for k in nodes] + [next_bonus]
        request.rounds += 1
        request.accepted += len(nodes)
        before = len(request.output)
        self.commit_tokens(tokens)
        committed = len(request.output) - before
        request.round_stats.append(RoundStats.of_walk(tree, nodes, committed, running.length))
        if request.stop_reason is not None:
            return None
        if self.copies is not None:
            self.copies.commit(tokens, tokens[:committed])
        if self.choice is not None:
            self.choice.observe(committed)  # no per-request time in a batch: modelled costs
        rows = verification_rows(nodes)
        move = (running.slot, running.length, rows)
        running.length += len(rows)
        accepted = features[torch.tensor(rows, device=features.device)]
        # the drafter has not seen them yet: kept (with any of rounds it skipped) until it has
        running.features = [*running.features, accepted] if request.policy.needs_drafter else []
        running.bonus = next_bonus
        return move

    def commit_tokens(self, tokens: list[int]) -> None:
        """Append the tokens the output keeps (up to a stop token, a stopping criterion or the
        length) and say whether the request is done (``stop_reason``)."""
        running, request = self, self.request
        room = request.max_new_tokens - len(request.output)
        stops, criteria = set(request.stop_token_ids), request.stopping_criteria
        keep, reason = stop_point(tokens, room, stops, criteria, running.context)
        request.output.extend(tokens[:keep])
        if running.context is not None and reason is None:
            running.context.commit(tokens[:keep])
        request.stop_reason = reason


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
        self.max_batch = check_int("max_batch", max_batch, minimum=1)
        self.capacity = check_int("capacity", capacity, minimum=2)
        target.compile_batch(self.max_batch, progress)
        target.reserve(self.max_batch, self.capacity)
        self.proposer = (
            BatchProposer(drafter, target.model, self.max_batch) if drafter is not None else None
        )
        self._free = list(range(self.max_batch))
        self.joint = JointBudget(joint_cost_model, joint_max_nodes)
        self.copy_rates = CopyRates()  # copies' acceptance, pooled over the requests (lookup)
        self._running: list[_Running] = []

    @property
    def joint_cost_model(self) -> CostModel | BatchCostModel | None:
        """The cost model that prices joint rounds (``None``: none are)."""
        return self.joint.cost_model

    @property
    def calibration(self) -> float:
        """The joint budget's calibration of the drafter (:attr:`JointBudget.calibration`)."""
        return self.joint.calibration

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
        has_drafter = self.drafter is not None
        prompt = check_prompt(
            request.prompt_ids, request.max_new_tokens, request.policy, has_drafter
        )
        if not self._free:
            raise InvalidInputError(f"the batch is full ({self.max_batch} requests); wait")
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
        running.commit_tokens([running.bonus])
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
        copies = None
        if request.policy.lookup:
            copies = ContextCopies.start([*prompt, bonus], self.copy_rates)
        # the gate of a batch weighs copies alone against drafting; without copies, every
        # CaDDTree request drafts (the joint budget prices the round)
        choice = DraftChoice.start(request.policy, measured=False) if copies else None
        return _Running(request, slot, len(prompt), bonus, [features], context, copies, choice)

    def step(self) -> list[GenerationRequest]:
        """One round for every running request (propose, build, verify, walk, commit); returns
        the ones that finished in it."""
        if not self._running:
            return []
        start = time.perf_counter()
        joint = self.joint.applies(self._policies())
        drafts = self._propose(joint)
        drafted = time.perf_counter()
        trees = self._build(drafts, joint)
        built = time.perf_counter()
        logits, features = self.target.forward(self._rows(trees))
        forward_s = time.perf_counter() - built
        walked, finished = self._walk_all(trees, logits, features)
        end = time.perf_counter()
        for stats in walked:
            stats.draft_s, stats.tree_s, stats.verify_s = (
                drafted - start,
                built - drafted,
                end - built,
            )
            stats.forward_s, stats.round_s = forward_s, end - start
        if joint:
            committed = sum(s.committed for s in walked)
            drew = any(d is not None for d in drafts)
            self.joint.observe_round(len(walked), drew, committed, end - start)
        return finished

    def _policies(self) -> list:
        return [r.request.policy for r in self._running]

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

    def _propose(self, joint: bool) -> list[DraftLogits | None]:
        """Every running request's draft logits for this round, from one drafter pass (``None``
        for a request that does not draft now: its policy does not, one token is left, or a
        joint round in the skip window), each block as deep as its tree can reach."""
        wanted = {}
        joint_reach = self.joint.reach() if joint else None
        for running in self._running:
            request = running.request
            max_depth = request.max_new_tokens - len(request.output) - 1
            for reach in (getattr(request.policy, "reach", None), joint_reach):
                max_depth = max_depth if reach is None else min(max_depth, reach)
            running.copy_trie()
            if request.policy.needs_drafter and max_depth > 0 and not running.copies_suffice():
                wanted[running.slot] = max_depth
        if not wanted or self.joint.skip_round(self._policies()):
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
        self.joint.time_draft(len(calls), sum(sizes), time.perf_counter() - began)
        for running in self._running:
            if running.slot in wanted:  # the drafter has these features now
                running.features = []
        return [
            drafted[r.slot][: wanted[r.slot]] if r.slot in wanted else None for r in self._running
        ]

    def _build(self, drafts: list[DraftLogits | None], joint: bool) -> list[DraftTree]:
        """Every request's tree: from the joint budget, or each from its own policy; each cut to
        what is left of its slot (the best-first order's first nodes: still a tree)."""
        running = self._running
        tries = [r.copies.trie if r.copies is not None else None for r in running]
        if joint:
            trees = self.joint.trees(drafts, [r.length for r in running], tries)
        else:
            trees = [
                r.alone if r.alone is not None else build_tree(r.request.policy, d, r.length, trie)
                for r, d, trie in zip(running, drafts, tries)
            ]
        trees = [t.head(self.capacity - r.length - 1) for r, t in zip(running, trees)]
        for r, d, t in zip(running, drafts, trees):
            if r.choice is not None:
                r.choice.note_draft(r.request.policy, r.length, t if d is not None else None)
        return trees

    def _rows(self, trees: list[DraftTree]) -> Rows:
        """The rows of one target forward verifying every request's tree in its own slot."""
        return Rows.batch(
            [tree_rows(r.slot, r.length, r.bonus, t) for r, t in zip(self._running, trees)],
            self.target.device,
        )

    def _walk_all(
        self, trees: list[DraftTree], logits: torch.Tensor, features: torch.Tensor
    ) -> tuple[list[RoundStats], list[GenerationRequest]]:
        """Walk and commit every request's tree (greedy choices for all rows in one call), then
        compact every accepted path in one go; the round's statistics and the finished
        requests."""
        greedy = any(plain_greedy(r.request.sampler) for r in self._running)
        choices = greedy_choices(logits).tolist() if greedy else None
        walked, finished, moves, offset = [], [], [], 0
        try:
            for running, tree in zip(list(self._running), trees):
                rows = slice(offset, offset + len(tree) + 1)
                chosen = choices and choices[rows]
                moves.append(running.walk(tree, logits[rows], features[rows], chosen))
                offset = rows.stop
                stats = running.request.round_stats[-1]
                walked.append(stats)
                if stats.budget:
                    self.joint.observe_tree(stats.phi, stats.accepted)
                if running.request.stop_reason is not None:
                    self._leave(running)
                    finished.append(running.request)
        finally:  # the walked requests' caches match their lengths, whatever happened after
            self.target.compact_many([m for m in moves if m is not None])
        return walked, finished


def _joined(chunks: list[torch.Tensor]) -> torch.Tensor:
    return chunks[0] if len(chunks) == 1 else torch.cat(chunks)
