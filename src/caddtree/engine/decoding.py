"""The decoding loop: one round = draft, build a tree, verify it, walk it, commit.

AR, DFlash, DDTree, CaDDTree and prompt lookup are the same loop with a different
:class:`~caddtree.engine.policies.TreePolicy` (:mod:`caddtree.engine.policies`).

Losslessness. The target's token at every visited tree node is chosen as plain decoding would
choose it there, and the walk follows the child that carries it (:mod:`caddtree.core.sampling`). Stop
tokens and stopping criteria (e.g. stop strings) are checked after every committed token, as
transformers checks them after every generated token, so the output ends where plain decoding's
would.

Statistics: see :class:`GenerationStats` (``tau``, time to first token, decode speed, draft
acceptance) and :class:`RoundStats` (one verification round).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

from ..core.copies import CopyRates, CopyTrie
from ..core.sampling import Sampler, TokenContext, walk_tree
from ..core.tree import DraftTree, verification_rows
from ..util.checks import check_int
from ..util.errors import InvalidInputError
from .policies import (
    LOOKUP_TOKENS,
    Budget,
    Chain,
    ContextCopies,
    CostAware,
    DraftChoice,
    Lookup,
    NoTree,
    TreePolicy,
    build_tree,
    copy_depth,
    make_policy,
)
from .stats import GenerationResult, GenerationStats, RoundStats

if TYPE_CHECKING:  # pragma: no cover
    from ..models.drafts import DraftLogits
    from ..runtime.verifier import Verifier

__all__ = [
    "Budget",
    "Chain",
    "ContextCopies",
    "CostAware",
    "GenerationResult",
    "GenerationStats",
    "LOOKUP_TOKENS",
    "Lookup",
    "NoTree",
    "Proposer",
    "RoundStats",
    "TreePolicy",
    "build_tree",
    "check_prompt",
    "decode",
    "make_policy",
]


# Positions a call reserves KV-cache room for at most when the target has no context window
MAX_RESERVED = 32768

# --------------------------------------------------------------------------------------------------
# Tree policies
# --------------------------------------------------------------------------------------------------


@runtime_checkable
class Proposer(Protocol):
    """What the round loop needs from a drafter (the proposer of docs/design.md's round).

    ``propose(bonus, new_context_features)`` returns the draft logits of the block after
    ``bonus``, ``[B-1, V]``, as :class:`~caddtree.models.drafts.DraftLogits` (which carries the
    map from a draft vocabulary to the target's); ``new_context_features`` are the target's
    features of the tokens committed since the last call. ``reset()`` forgets everything (a new
    prompt); ``crop(length)`` forgets the context past its first ``length`` tokens;
    ``context_length`` is how many tokens the proposer has seen.
    :class:`~caddtree.models.proposer.DFlashProposer` is one.
    """

    def propose(self, bonus_token: int, new_context_features: torch.Tensor) -> DraftLogits: ...

    def reset(self) -> None: ...

    def crop(self, context_length: int) -> None: ...

    @property
    def context_length(self) -> int: ...


# --------------------------------------------------------------------------------------------------
# The loop
# --------------------------------------------------------------------------------------------------


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def check_prompt(
    prompt_ids: Sequence[int], max_new_tokens: Any, policy: TreePolicy, has_drafter: bool
) -> list[int]:
    """``prompt_ids`` as a list of ints, checked with ``max_new_tokens`` and ``policy`` (one or
    a batch of requests alike): a count, a prompt of at least one token, a drafter where the
    policy drafts."""
    check_int("max_new_tokens", max_new_tokens)
    prompt = [int(t) for t in prompt_ids]
    if not prompt:
        raise InvalidInputError("the prompt is empty; give at least one token")
    if policy.needs_drafter and not has_drafter:
        raise InvalidInputError(f"method {policy.name!r} needs a drafter")
    return prompt


def _checked_prompt(
    verifier: Verifier,
    prompt_ids: Sequence[int],
    policy: TreePolicy,
    proposer: Proposer | None,
    max_new_tokens: Any,
) -> list[int]:
    """``prompt_ids`` as a list of ints, once the arguments of :func:`decode` are known to fit."""
    prompt = check_prompt(prompt_ids, max_new_tokens, policy, proposer is not None)
    limit = verifier.max_positions
    if limit is not None and len(prompt) + max_new_tokens > limit:
        if len(prompt) >= limit:
            raise InvalidInputError(
                f"the prompt has {len(prompt)} tokens but the model's context holds {limit}; "
                "shorten the prompt"
            )
        raise InvalidInputError(
            f"the prompt ({len(prompt)} tokens) plus max_new_tokens ({max_new_tokens}) exceeds the "
            f"model's context of {limit} tokens; lower max_new_tokens to {limit - len(prompt)}, "
            "or allow a longer context (context_window=, --context-window; past the model's "
            "trained window its positions are extrapolated)"
        )
    return prompt


def criteria_list(criteria: Any) -> list[Callable[..., Any]]:
    """Stopping criteria as a flat list: ``None`` is none, a single criterion is one, and an
    iterable (a ``StoppingCriteriaList`` is one, though it is callable too) holds several."""
    if criteria is None:
        return []
    if callable(criteria) and not isinstance(criteria, Iterable):
        return [criteria]
    return list(criteria)


class StopStrings:
    """A stopping criterion (transformers' form, ``criterion(input_ids, scores) -> bool``) that
    fires on the token that completes any of ``stops`` in the decoded text, where transformers'
    ``StopStringCriteria`` fires: a stop string whose last character lies in the last token (it
    may overhang into that token's text).

    It decodes only the last tokens, enough to hold the longest stop string, once with and once
    without the last token, and fires when a stop string appears in the first text and not in
    the second. Its memory and time grow with the stop strings, not with the vocabulary
    (transformers' criterion builds and caches vocabulary-sized tables for every set of strings,
    and never gives that memory back)."""

    def __init__(self, tokenizer: Any, stops: Sequence[str]) -> None:
        self.tokenizer, self.stops = tokenizer, list(stops)
        # every token decodes to one character at least (a partial UTF-8 byte to U+FFFD)
        self.window = max(len(stop) for stop in self.stops) + 2

    def __call__(self, input_ids: torch.Tensor, scores: Any = None) -> bool:
        tail = input_ids[0, -self.window :].tolist()
        text = self.tokenizer.decode(tail)
        if not any(stop in text for stop in self.stops):
            return False
        before = self.tokenizer.decode(tail[:-1])
        return any(stop in text and stop not in before for stop in self.stops)


def _criterion_reason(criterion: Any) -> str:
    """The ``stop_reason`` of a stopping criterion that fired: ``"stop_string"`` for
    :class:`StopStrings` and transformers' ``StopStringCriteria``, ``"stop_token"`` for its
    ``EosTokenCriteria``,
    ``"stopping_criteria"`` for any other."""
    from transformers import EosTokenCriteria, StopStringCriteria

    if isinstance(criterion, (StopStrings, StopStringCriteria)):
        return "stop_string"
    if isinstance(criterion, EosTokenCriteria):
        return "stop_token"
    return "stopping_criteria"


def stop_point(
    tokens: list[int],
    room: int,
    stops: set[int],
    criteria: Sequence[Callable[..., Any]],
    context: TokenContext | None,
) -> tuple[int, str | None]:
    """How many of a round's ``tokens`` to keep, and why generation ends there (``None``: it
    goes on). Each token in turn, up to ``room`` of them: a stop token ends generation after
    itself, and so does a stopping criterion that fires on the context up to that token (as
    transformers checks its criteria after every token); else ``room`` tokens end it by length.
    """
    for j, tok in enumerate(tokens[:room]):
        if tok in stops:
            return j + 1, "stop_token"
        if criteria:
            context.put(j, tok)
            ids = context.ids(j + 1)
            for criterion in criteria:
                if bool(torch.as_tensor(criterion(ids, None)).any()):
                    return j + 1, _criterion_reason(criterion)
    if len(tokens) >= room:
        return room, "max_new_tokens"
    return len(tokens), None


def _confidence(tree: DraftTree, draft: DraftLogits | None) -> float:
    """The drafter's largest position-1 probability (NaN without a draft). Node 0 of a non-empty
    tree is that token; a tree the cost rule left empty (CaDDTree's n = 0) still had a draft, so
    its confidence is read from position 1's logits, not dropped from the analysis."""
    if draft is None:
        return math.nan
    if len(tree) and tree.copied is None:
        return math.exp(float(tree.log_probs[0]))
    return draft.confidence()  # node 0 of a tree with copies may be a copy's


@dataclass
class _Loop:
    """What one :func:`decode` call carries from round to round."""

    verifier: Verifier
    policy: TreePolicy
    proposer: Proposer | None
    sampler: Sampler
    stops: set[int]
    criteria: list[Callable[..., Any]]
    context: TokenContext | None
    max_new_tokens: int
    pooled: CopyRates | None = None  # the copies' rates pooled over requests (lookup)
    copies: ContextCopies | None = None
    choice: DraftChoice | None = None  # CaDDTree's choice to draft or not, each round
    unseen: list[torch.Tensor] = field(default_factory=list)  # features the drafter has not read
    output: list[int] = field(default_factory=list)
    rounds: list[RoundStats] = field(default_factory=list)

    def prefill(self, prompt: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Reserve the caches, run the prompt, choose the first token; the prompt's logits and
        features."""
        verifier = self.verifier
        # room for every position the call may fill: the prompt, its output, and the last tree
        # (within the context window; without one, at most MAX_RESERVED, and the cache grows after)
        fill = min(len(prompt) + self.max_new_tokens, verifier.max_positions or MAX_RESERVED)
        verifier.reset(reserve=fill + self.policy.reserve_nodes + 1)
        if self.proposer is not None:
            self.proposer.reset()
        logits, features = verifier.prefill(prompt)
        context = self.context
        self.output.append(
            self.sampler.choose(logits, context.ids() if self.sampler.needs_context else None)
        )
        if self.policy.lookup:
            self.copies = ContextCopies.start([*prompt, self.output[0]], self.pooled)
        self.choice = DraftChoice.start(self.policy, measured=True)
        return logits, features

    def cut(self, tokens: list[int]) -> tuple[int, str | None]:
        """How many of ``tokens`` (the next ones of the output) to keep, and why generation ends
        there (``None``: it goes on)."""
        room = self.max_new_tokens - len(self.output)
        return stop_point(tokens, room, self.stops, self.criteria, self.context)

    def propose(self, bonus: int) -> DraftLogits | None:
        """The drafter's logits for this round (``None`` when it does not draft: AR, or a last
        token whose tree could not commit), from the features it has not read yet."""
        max_depth = self.max_new_tokens - len(self.output) - 1  # deeper nodes cannot commit
        if not self.policy.needs_drafter or max_depth <= 0:
            return None
        features = self.unseen[0] if len(self.unseen) == 1 else torch.cat(self.unseen, 1)
        self.unseen = []
        draft = self.proposer.propose(bonus, features)[:max_depth]
        _sync(self.verifier.device)
        return draft

    def copy_trie(self) -> CopyTrie | None:
        """This round's copies from the context (lookup), as deep as a draft could go."""
        if self.copies is None:
            return None
        room = self.max_new_tokens - len(self.output) - 1  # deeper nodes cannot commit
        return self.copies.propose(copy_depth(self.policy, room))

    def draft_and_build(self, bonus: int, context_length: int) -> tuple[Any, DraftTree, float]:
        """The round's draft (``None`` without one) and tree, in target ids (the drafter's and,
        with lookup, the copies'), and the seconds the drafter's pass took."""
        trie, choice = self.copy_trie(), self.choice
        alone = choice.alone(self.policy, trie, context_length) if choice is not None else None
        if alone is not None:
            return None, alone, 0.0
        t0 = time.perf_counter()
        draft = self.propose(bonus)
        propose_s = time.perf_counter() - t0
        tree = build_tree(self.policy, draft, context_length, trie)
        if choice is not None:
            choice.note_draft(self.policy, context_length, tree if draft is not None else None)
        return draft, tree, propose_s

    def round(self, bonus: int, features: torch.Tensor) -> _RoundOutcome:
        """One round after ``bonus``: draft, build, verify, walk, commit."""
        verifier, context_length = self.verifier, self.verifier.context_length
        t0 = time.perf_counter()
        if self.policy.needs_drafter and self.proposer is not None:
            self.unseen.append(features)  # for the drafter's next pass
        draft, tree, propose_s = self.draft_and_build(bonus, context_length)
        confidence = _confidence(tree, draft)
        t2 = time.perf_counter()
        project_s = draft.project_s if draft is not None else 0.0
        logits, _ = verifier.verify(bonus, tree)
        _sync(verifier.device)
        t_forward = time.perf_counter()
        nodes, next_bonus = walk_tree(tree, logits, self.sampler, self.context)
        chosen = [int(tree.token_ids[k]) for k in nodes] + [next_bonus]
        keep, stop_reason = self.cut(chosen)
        tokens = chosen[:keep]
        if stop_reason is None:
            features = verifier.commit(nodes)
            if self.context is not None:
                self.context.commit(tokens)
            if self.copies is not None:
                self.copies.commit(chosen, tokens)
        _sync(verifier.device)
        t3 = time.perf_counter()
        self.output.extend(tokens)
        stats = RoundStats.of_walk(tree, nodes, len(tokens), context_length)
        stats.draft_s, stats.tree_s, stats.verify_s = (
            propose_s + project_s,
            t2 - t0 - propose_s - project_s,
            t3 - t2,
        )
        stats.confidence, stats.project_s, stats.forward_s = confidence, project_s, t_forward - t2
        stats.projected = draft.projected if draft is not None else 0
        stats.round_s = time.perf_counter() - t0
        if self.choice is not None:
            self.choice.observe(len(tokens), stats.round_s)
        self.rounds.append(stats)
        rows = verification_rows(nodes)[:keep]  # where the kept tokens were chosen
        return _RoundOutcome(tree, stats, tokens, logits, rows, next_bonus, features, stop_reason)


@dataclass
class _RoundOutcome:
    tree: DraftTree
    stats: RoundStats
    tokens: list[int]  # the tokens the round added to the output
    logits: torch.Tensor  # the target's logits over [bonus] + nodes
    rows: list[int]  # the rows of ``logits`` at which ``tokens`` were chosen
    bonus: int  # the next round's bonus token
    features: torch.Tensor  # the committed tokens' features, for the drafter's next round
    stop_reason: str | None


def decode(
    verifier: Verifier,
    prompt_ids: Sequence[int],
    policy: TreePolicy,
    *,
    proposer: Proposer | None = None,
    max_new_tokens: int = 256,
    sampler: Sampler | None = None,
    stop_token_ids: Iterable[int] = (),
    stopping_criteria: Iterable[Callable[..., Any]] | None = None,
    callback: Callable[[RoundStats, list[int]], Any] | None = None,
    tree_callback: Callable[[DraftTree, RoundStats], Any] | None = None,
    logits_callback: Callable[[torch.Tensor], Any] | None = None,
    copy_rates: CopyRates | None = None,
) -> GenerationResult:
    """Generate up to ``max_new_tokens`` tokens after ``prompt_ids`` with one tree policy.

    ``sampler`` chooses the target's tokens (default: greedy decoding). Generation stops after a
    token in ``stop_token_ids``, or after a token at which one of ``stopping_criteria`` fires
    (the token is kept in both cases), or after ``max_new_tokens`` tokens. The criteria are
    transformers' (a ``StoppingCriteriaList``, e.g. of ``StopStringCriteria``) or any callables
    of the same form, ``criterion(input_ids, scores) -> bool`` (or a one-element bool tensor);
    each is called after every generated token with ``input_ids`` the prompt and the tokens
    generated so far (``[1, n]``) and ``scores=None``.
    ``callback(round_stats, new_tokens)`` is called after every round (and once after the prefill,
    with ``round_stats=None``) with the tokens that round added, e.g. for streaming.
    ``tree_callback(tree, round_stats)`` receives every round's draft tree (for analysis and
    rendering; ``round_stats.path`` is its accepted path).
    ``logits_callback(rows)`` receives, after the prefill and after every round (before
    ``callback``), the target's raw logits at which the tokens added were chosen, ``[k, V]``, one
    row per token (for transformers' ``output_logits`` / ``output_scores``).
    ``copy_rates``: where the policy takes copies from the context (``lookup``), the rates pooled
    over calls that this call's own learn from and add to (default: this call's alone).
    """
    prompt = _checked_prompt(verifier, prompt_ids, policy, proposer, max_new_tokens)
    sampler = sampler or Sampler()
    criteria = criteria_list(stopping_criteria)
    # The context as a tensor, only for a sampler or criteria that read it: the default greedy
    # path keeps none.
    context = None
    if sampler.needs_context or criteria:
        context = TokenContext(prompt, len(prompt) + max_new_tokens, verifier.device)
    stops = {int(t) for t in stop_token_ids}
    loop = _Loop(
        verifier, policy, proposer, sampler, stops, criteria, context, max_new_tokens, copy_rates
    )
    t_start = time.perf_counter()
    logits, features = loop.prefill(prompt)
    _sync(verifier.device)
    prefill_s = time.perf_counter() - t_start
    bonus = loop.output[0]
    _, stop_reason = stop_point(loop.output, max_new_tokens, stops, criteria, context)
    if context is not None:
        context.commit(loop.output)
    if logits_callback is not None:
        logits_callback(logits[None])
    if callback is not None:
        callback(None, [bonus])
    while stop_reason is None:
        outcome = loop.round(bonus, features)
        if tree_callback is not None:
            tree_callback(outcome.tree, outcome.stats)
        if logits_callback is not None:
            logits_callback(outcome.logits[torch.tensor(outcome.rows, device=logits.device)])
        if callback is not None:
            callback(outcome.stats, outcome.tokens)
        bonus, features, stop_reason = outcome.bonus, outcome.features, outcome.stop_reason
    wall_s = time.perf_counter() - t_start
    stats = GenerationStats.from_rounds(
        policy.name, loop.rounds, len(loop.output), wall_s, prefill_s, stop_reason
    )
    return GenerationResult("", loop.output, prompt, policy.name, stats)
