"""Several requests decoded together: one target forward per round verifies every request's tree.

:class:`BatchDecoder` keeps up to ``max_batch`` requests in the lean runtime's cache slots
(:class:`~caddtree.models.lean.LeanTarget`). Requests join between rounds (:meth:`BatchDecoder.add`
prefills one and chooses its first token) and leave when they finish (:meth:`BatchDecoder.step`
returns them and frees their slots): continuous batching. Each round

1. drafts for every request that drafts (one drafter pass each, on its own drafter cache) and
   builds its tree with its own policy (AR, DFlash, DDTree, CaDDTree);
2. verifies all the trees in **one** target forward (:meth:`LeanTarget.forward` of
   :class:`~caddtree.models.lean.Rows`: each request's rows see only its own cache and tree);
3. walks each request's tree with its own sampler, stops it where plain decoding would stop, and
   compacts its accepted path into its slot.

A request's output does not depend on what else is in the batch: its rows see nothing of the
others', and its sampler draws from its own generator. At temperature 0 it is plain greedy
decoding's output token for token (float64 on the test models), as for :func:`caddtree.decoding.
decode`, which stays the single-request loop with every analysis hook.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch

from .checks import check_int
from .cost import CostModel
from .decoding import RoundStats, _stop_point
from .errors import InvalidInputError
from .models.lean import LeanTarget, Rows
from .models.target import tree_position_ids
from .requests import GenerationRequest
from .sampling import TokenContext, walk_tree
from .tree import DraftTree, build_joint_caddtrees

__all__ = ["BatchDecoder", "GenerationRequest"]


@dataclass(eq=False)
class _Running:
    """A request in a slot: where its context ends, its next bonus token, the features of its
    newest tokens (for its drafter) and its drafter's own cache."""

    request: GenerationRequest
    slot: int
    length: int
    bonus: int
    features: torch.Tensor
    proposer: object | None
    context: TokenContext | None


class BatchDecoder:
    """Continuous batching of :class:`GenerationRequest` s over ``target`` (see the module
    docstring).

    Args:
        target: the lean runtime of the target model (its feature layers the drafter's).
        drafter: a DFlash drafter for requests whose policy drafts (``None``: AR only).
        max_batch: requests decoded at once (cache slots).
        capacity: the most positions one request may fill (prompt, output and its largest tree).
    """

    def __init__(
        self,
        target: LeanTarget,
        drafter: object | None = None,
        *,
        max_batch: int,
        capacity: int,
        joint_cost_model: CostModel | None = None,
        joint_max_nodes: int = 256,
    ) -> None:
        self.target, self.drafter = target, drafter
        self.joint_cost_model, self.joint_max_nodes = joint_cost_model, joint_max_nodes
        self.max_batch = check_int("max_batch", max_batch, minimum=1)
        self.capacity = check_int("capacity", capacity, minimum=2)
        target.reserve(self.max_batch, self.capacity)
        self._free = list(range(self.max_batch))
        self._running: list[_Running] = []

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
        proposer = None
        if request.policy.needs_drafter:
            from .models.proposer import DFlashProposer

            proposer = DFlashProposer(self.drafter, self.target.model)
        return _Running(request, slot, len(prompt), bonus, features[None], proposer, context)

    def step(self) -> list[GenerationRequest]:
        """One round for every running request; returns the ones that finished in it."""
        if not self._running:
            return []
        start = time.perf_counter()
        trees = self._joint_trees() or [self._tree(r) for r in self._running]
        # a tree fits what is left of its slot (the best-first order's first nodes: still a tree)
        trees = [
            _first_nodes(t, self.capacity - r.length - 1) for r, t in zip(self._running, trees)
        ]
        rows = Rows.batch(
            [_tree_rows(r.slot, r.length, r.bonus, t) for r, t in zip(self._running, trees)],
            self.target.device,
        )
        drafted = time.perf_counter()
        logits, features = self.target.forward(rows)
        forward_s = time.perf_counter() - drafted
        finished, offset = [], 0
        for running, tree in zip(list(self._running), trees):
            n = len(tree) + 1
            self._walk(running, tree, logits[offset : offset + n], features[offset : offset + n])
            offset += n
            stats = running.request.round_stats[-1]
            stats.draft_s, stats.forward_s = drafted - start, forward_s
            stats.round_s = stats.verify_s = time.perf_counter() - drafted
            if running.request.stop_reason is not None:
                self._leave(running)
                finished.append(running.request)
        return finished

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

    def _draft(self, running: _Running) -> object | None:
        """The request's draft logits for this round (``None``: it does not draft now)."""
        request = running.request
        max_depth = request.max_new_tokens - len(request.output) - 1
        if not request.policy.needs_drafter or max_depth <= 0:
            return None
        return running.proposer.propose_lazy(running.bonus, running.features)[:max_depth]

    def _mapped(self, running: _Running, tree: DraftTree) -> DraftTree:
        token_map = getattr(running.proposer, "token_map", None)
        return tree.map_tokens(token_map) if token_map is not None and len(tree) else tree

    def _tree(self, running: _Running) -> DraftTree:
        draft = self._draft(running)
        if draft is None:
            return DraftTree.empty()
        return self._mapped(running, running.request.policy.build(draft, running.length))

    def _joint_trees(self) -> list[DraftTree] | None:
        """Every request's tree from one joint budget (:func:`~caddtree.tree.
        build_joint_caddtrees`), when the decoder has a ``joint_cost_model`` and every running
        request is a CaDDTree one; ``None`` otherwise.

        Until the batch cost model (C_v over total rows and sequences) is measured, a batch of
        ``B`` requests with ``n`` nodes in all is priced as one sequence's round with ``B - 1 + n``
        nodes (the other requests' bonus rows counted as nodes) at the mean context, plus
        ``B - 1`` more drafter passes."""
        model, running = self.joint_cost_model, self._running
        if model is None or any(r.request.policy.name != "caddtree" for r in running):
            return None
        drafts = [self._draft(r) for r in running]
        batch = len(running)
        context = int(np.mean([r.length for r in running]))
        table = model.round_cost_table(context, batch - 1 + self.joint_max_nodes)
        costs = (batch - 1) * model.draft_cost + table[batch - 1 :]
        present = [d for d in drafts if d is not None]
        built = iter(build_joint_caddtrees(present, costs, self.joint_max_nodes))
        return [
            self._mapped(r, next(built)) if d is not None else DraftTree.empty()
            for r, d in zip(running, drafts)
        ]

    def _walk(
        self, running: _Running, tree: DraftTree, logits: torch.Tensor, features: torch.Tensor
    ) -> None:
        request = running.request
        path, next_bonus = walk_tree(tree, logits, request.sampler, running.context)
        tokens = [int(tree.token_ids[i - 1]) for i in path[1:]] + [next_bonus]
        request.rounds += 1
        request.accepted += len(path) - 1
        before = len(request.output)
        self._commit_tokens(running, tokens)
        request.round_stats.append(
            RoundStats(
                context_length=running.length,
                budget=len(tree),
                accepted=len(path) - 1,
                committed=len(request.output) - before,
                draft_s=0.0,
                tree_s=0.0,
                verify_s=0.0,
                phi=tree.phi,
                path=[i - 1 for i in path[1:]],
            )
        )
        if request.stop_reason is None:
            self.target.compact(running.slot, running.length, path)
            running.length += len(path)
            running.features = features[torch.tensor(path, device=features.device)][None]
            running.bonus = next_bonus

    def _commit_tokens(self, running: _Running, tokens: list[int]) -> None:
        """Append the tokens the output keeps (up to a stop token, a stopping criterion or the
        length) and say whether the request is done (``stop_reason``)."""
        request = running.request
        room = request.max_new_tokens - len(request.output)
        stops, criteria = set(request.stop_token_ids), request.stopping_criteria
        keep, reason = _stop_point(tokens, room, stops, criteria, running.context)
        request.output.extend(tokens[:keep])
        if running.context is not None and reason is None:
            running.context.commit(tokens[:keep])
        request.stop_reason = reason


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


def _tree_rows(
    slot: int, start: int, bonus: int, tree: DraftTree
) -> tuple[int, int, list[int], list[int], np.ndarray | None]:
    """One sequence of a verification call: ``[bonus] + tree`` after ``start`` cache entries."""
    tokens = [int(bonus), *(int(t) for t in tree.token_ids)]
    positions = tree_position_ids(tree, start).tolist()
    return slot, start, tokens, positions, tree.visibility_mask() if len(tree) else None
