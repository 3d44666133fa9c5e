"""The decoding loop: one round = draft, build a tree, verify it, walk it, commit.

AR, DFlash, DDTree and CaDDTree are the same loop with a different :class:`TreePolicy`:

========  ===================  ==================================================
method    policy               tree per round
========  ===================  ==================================================
ar        :class:`NoTree`      empty: the target verifies only the bonus token
dflash    :class:`Chain`       the drafter's top-1 token at each position
ddtree    :class:`Budget`      the top-``budget`` prefixes (Eq. phistar)
caddtree  :class:`CostAware`   the top-``n*`` prefixes, ``n*`` by Algorithm 1
========  ===================  ==================================================

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
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np
import torch

from ..core.sampling import Sampler, TokenContext, walk_tree
from ..core.tree import DraftTree, build_caddtree, build_chain, build_ddtree
from ..util.checks import DEFAULT_DDTREE_BUDGET, check_int, check_method
from ..util.errors import InvalidInputError

if TYPE_CHECKING:  # pragma: no cover
    from ..core.cost import CostModel
    from ..models.target import TreeVerifier

__all__ = [
    "Budget",
    "Chain",
    "CostAware",
    "GenerationResult",
    "GenerationStats",
    "NoTree",
    "Proposer",
    "RoundStats",
    "TreePolicy",
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
    ``bonus``, ``[B-1, V]`` (a tensor, or :class:`~caddtree.core.tree.DraftRows` computed on demand);
    ``new_context_features`` are the target's features of the tokens committed since the last
    call. ``reset()`` forgets everything (a new prompt); ``crop(length)`` forgets the context past
    its first ``length`` tokens; ``context_length`` is how many tokens the proposer has seen.
    :class:`~caddtree.models.proposer.DFlashProposer` is one. Two members are optional, and
    :func:`decode` uses them when present: ``propose_lazy`` (preferred to ``propose``: rows
    projected on demand) and ``token_map`` (target id of each draft id, for a drafter with its
    own draft vocabulary).
    """

    def propose(self, bonus_token: int, new_context_features: torch.Tensor) -> Any: ...

    def reset(self) -> None: ...

    def crop(self, context_length: int) -> None: ...

    @property
    def context_length(self) -> int: ...


class TreePolicy(Protocol):
    """Chooses the draft tree of a round from the drafter's logits."""

    name: str
    needs_drafter: bool

    def build(self, draft_logits: Any, context_length: int) -> DraftTree: ...


@dataclass(frozen=True)
class NoTree:
    """Plain autoregressive decoding: no drafter, an empty tree."""

    name: str = "ar"
    needs_drafter: bool = False

    def build(self, draft_logits: Any, context_length: int) -> DraftTree:
        return DraftTree.empty()


@dataclass(frozen=True)
class Chain:
    """DFlash: the drafter's top-1 token at every position."""

    name: str = "dflash"
    needs_drafter: bool = True

    def build(self, draft_logits: Any, context_length: int) -> DraftTree:
        return build_chain(draft_logits)


@dataclass(frozen=True)
class Budget:
    """DDTree: the ``budget`` most probable prefixes."""

    budget: int
    name: str = "ddtree"
    needs_drafter: bool = True

    def build(self, draft_logits: Any, context_length: int) -> DraftTree:
        return build_ddtree(draft_logits, self.budget)


@dataclass(frozen=True)
class CostAware:
    """CaDDTree: the size that maximises surrogate throughput under ``cost_model``."""

    cost_model: CostModel
    max_budget: int = 1024
    name: str = "caddtree"
    needs_drafter: bool = True

    def build(self, draft_logits: Any, context_length: int) -> DraftTree:
        return build_caddtree(draft_logits, self.cost_model, context_length, self.max_budget)


def make_policy(
    method: str,
    *,
    budget: int | None = None,
    cost_model: CostModel | None = None,
    max_budget: int = 1024,
) -> TreePolicy:
    """The tree policy of ``method`` (one of :data:`METHODS`), with a clear error for missing or
    meaningless arguments."""
    check_method(method)
    if method == "ddtree":
        if budget is None:
            raise InvalidInputError("method 'ddtree' needs a node budget (e.g. budget=64)")
        check_int("the ddtree budget", budget)
        return Budget(int(budget))
    if budget is not None:
        raise InvalidInputError(f"a node budget only applies to method 'ddtree', not {method!r}")
    if method == "caddtree":
        if cost_model is None:
            raise InvalidInputError(
                "method 'caddtree' needs a cost model: pass cost_model= (a CostModel or a file from "
                "`caddtree profile` / ConvexCostModel.fit(...).save())"
            )
        return CostAware(cost_model, check_int("max_budget", max_budget))
    return Chain() if method == "dflash" else NoTree()


# --------------------------------------------------------------------------------------------------
# Statistics
# --------------------------------------------------------------------------------------------------


@dataclass
class RoundStats:
    """One verification round. Times are wall seconds, taken with the device synchronised.

    The phases of a round add up: ``round_s = draft_s + tree_s + verify_s + bookkeeping``, where
    ``draft_s`` (the drafter: its forward pass and its projection to the vocabulary) includes
    ``project_s``, and ``verify_s`` (target forward, walk and cache compaction) includes
    ``forward_s``. A proposer that projects on demand does so while the tree is built; that time
    is counted in ``project_s`` (so in ``draft_s``), not in ``tree_s``.
    """

    context_length: int  # tokens in the target's cache when the tree was verified
    budget: int  # nodes in the tree
    accepted: int  # draft tokens accepted (alpha); the round commits accepted + 1 tokens
    committed: int  # tokens this round added to the output (after stop / length truncation)
    draft_s: float  # drafter forward and projection
    tree_s: float  # tree construction (and mapping draft ids to target ids), projection excluded
    verify_s: float  # target forward, walk and cache compaction
    phi: float  # the tree's surrogate expected acceptance
    # the drafter's confidence: its largest position-1 probability (NaN without a draft), the
    # quantity the paper bins rounds by (Fig. 1)
    confidence: float = math.nan
    # the accepted nodes, as indices into the tree (best-first order for DDTree and CaDDTree, so
    # the acceptance a smaller budget n would have had is the number of indices below n)
    path: list[int] = field(default_factory=list)
    project_s: float = 0.0  # the part of draft_s spent projecting hidden states to the vocabulary
    projected: int = 0  # positions projected (of the block's B - 1; 0 without a draft)
    forward_s: float = 0.0  # the part of verify_s spent in the target's forward pass
    round_s: float = 0.0  # the whole round, bookkeeping included (callbacks excluded)


@dataclass
class GenerationStats:
    """Summary of one generation.

    Speed: ``ms_per_token`` is the wall time of the whole call (prefill included) per generated
    token; ``ttft_s`` (time to first token) is the prefill forward plus the choice of the first
    token, from the start of :func:`decode`; ``decode_tokens_per_s`` is the tokens after the
    first over the time after it (``None`` when only one token was generated).

    Acceptance: ``tau`` is the mean number of tokens committed per verification round (accepted
    draft tokens plus the bonus token, after any stop or length cut; AR has ``tau = 1``);
    ``mean_acceptance_length`` is the same number under vLLM's name. The token of the prefill is
    part of no round. ``draft_tokens`` counts the tree nodes verified, ``accepted_tokens`` the
    draft tokens accepted, and ``draft_acceptance_rate`` is their ratio (0 without draft tokens).
    For a tree that rate is per verified node: a round that verifies 60 nodes and accepts a path of
    4 counts 4/60, however good the path, so it falls as trees grow even when ``tau`` rises.
    ``accepted_per_position[k - 1]`` is the number of rounds that accepted at least ``k`` draft
    tokens (vLLM's ``num_accepted_tokens_per_pos``; as long as the deepest acceptance).

    ``stop_reason``: ``"stop_token"`` (EOS or another stop token id), ``"stop_string"``,
    ``"stopping_criteria"`` (another criterion), or ``"max_new_tokens"``.
    """

    method: str
    new_tokens: int
    rounds: int
    tau: float
    ms_per_token: float
    budget_mean: float
    budget_std: float
    wall_s: float
    prefill_s: float
    draft_s: float
    tree_s: float
    verify_s: float
    stop_reason: str
    ttft_s: float
    decode_tokens_per_s: float | None
    mean_acceptance_length: float
    draft_tokens: int
    accepted_tokens: int
    draft_acceptance_rate: float
    accepted_per_position: list[int]
    per_round: list[RoundStats] = field(default_factory=list, repr=False)

    @classmethod
    def from_rounds(
        cls,
        method: str,
        rounds: list[RoundStats],
        new_tokens: int,
        wall_s: float,
        prefill_s: float,
        stop_reason: str,
    ) -> GenerationStats:
        """The summary of one generation of ``new_tokens`` tokens in ``rounds``; ``prefill_s`` is
        the time to the first token."""
        budgets = np.array([r.budget for r in rounds], dtype=np.float64)
        tau = float(np.mean([r.committed for r in rounds])) if rounds else 0.0
        draft_tokens = sum(r.budget for r in rounds)
        accepted_tokens = sum(r.accepted for r in rounds)
        deepest = max((r.accepted for r in rounds), default=0)
        after_first = wall_s - prefill_s
        return cls(
            method=method,
            new_tokens=new_tokens,
            rounds=len(rounds),
            tau=tau,
            ms_per_token=1e3 * wall_s / new_tokens,
            budget_mean=float(budgets.mean()) if rounds else 0.0,
            budget_std=float(budgets.std()) if rounds else 0.0,
            wall_s=wall_s,
            prefill_s=prefill_s,
            draft_s=sum(r.draft_s for r in rounds),
            tree_s=sum(r.tree_s for r in rounds),
            verify_s=sum(r.verify_s for r in rounds),
            stop_reason=stop_reason,
            ttft_s=prefill_s,
            decode_tokens_per_s=(
                (new_tokens - 1) / after_first if new_tokens > 1 and after_first > 0 else None
            ),
            mean_acceptance_length=tau,
            draft_tokens=draft_tokens,
            accepted_tokens=accepted_tokens,
            draft_acceptance_rate=accepted_tokens / draft_tokens if draft_tokens else 0.0,
            accepted_per_position=[
                sum(r.accepted >= k for r in rounds) for k in range(1, deepest + 1)
            ],
            per_round=rounds,
        )

    def to_dict(self, per_round: bool = False) -> dict[str, Any]:
        out = asdict(self)
        if per_round:  # NaN (no draft this round) is not JSON: it becomes None (null)
            out["per_round"] = [
                {**asdict(r), "confidence": None if math.isnan(r.confidence) else r.confidence}
                for r in self.per_round
            ]
        else:
            out.pop("per_round")
        return out


@dataclass
class GenerationResult:
    """What one generation produced: :func:`decode` fills everything but ``text``, which
    :meth:`caddtree.api.SpeculativeGenerator.generate` decodes with its tokenizer."""

    text: str
    token_ids: list[int]  # generated tokens only (the stop token included, if one was hit)
    prompt_ids: list[int]
    method: str
    stats: GenerationStats

    def to_dict(self, per_round: bool = False) -> dict[str, Any]:
        return {
            "method": self.method,
            "text": self.text,
            "token_ids": self.token_ids,
            "prompt_tokens": len(self.prompt_ids),
            "stats": self.stats.to_dict(per_round=per_round),
        }


# --------------------------------------------------------------------------------------------------
# The loop
# --------------------------------------------------------------------------------------------------


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _checked_prompt(
    verifier: TreeVerifier,
    prompt_ids: Sequence[int],
    policy: TreePolicy,
    proposer: Proposer | None,
    max_new_tokens: Any,
) -> list[int]:
    """``prompt_ids`` as a list of ints, once the arguments of :func:`decode` are known to fit."""
    check_int("max_new_tokens", max_new_tokens)
    prompt = [int(t) for t in prompt_ids]
    if not prompt:
        raise InvalidInputError("the prompt is empty; give at least one token")
    if policy.needs_drafter and proposer is None:
        raise InvalidInputError(f"method {policy.name!r} needs a drafter")
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


def _criteria_list(criteria: Any) -> list[Callable[..., Any]]:
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
    (transformers' criterion builds and caches vocabulary-sized tables for every set of strings:
    1,000 strings once took 16.7 s and 2 GB that were never given back)."""

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


def _stop_point(
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


def _confidence(tree: DraftTree, draft_logits: Any) -> float:
    """The drafter's largest position-1 probability (NaN without a draft). Node 0 of a non-empty
    tree is that token; a tree the cost rule left empty (CaDDTree's n = 0) still had a draft, so
    its confidence is read from position 1's logits, not dropped from the analysis."""
    if draft_logits is None:
        return math.nan
    if len(tree):
        return math.exp(float(tree.log_probs[0]))
    row = draft_logits.row(0) if hasattr(draft_logits, "row") else draft_logits[0]
    row = torch.as_tensor(row).detach().double()
    return math.exp(float(row.max() - torch.logsumexp(row, 0)))


def _projected(draft_logits: Any) -> int:
    """Positions of ``draft_logits`` projected to the vocabulary: all of a plain tensor's rows,
    what a lazy one (:class:`~caddtree.models.proposer.DraftLogits`) projected, none without one."""
    if draft_logits is None:
        return 0
    return int(getattr(draft_logits, "projected", draft_logits.shape[0]))


def decode(
    verifier: TreeVerifier,
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
    """
    prompt = _checked_prompt(verifier, prompt_ids, policy, proposer, max_new_tokens)
    sampler = sampler or Sampler()
    stops = {int(t) for t in stop_token_ids}
    criteria = _criteria_list(stopping_criteria)
    device = verifier.device
    # The context as a tensor, only for a sampler or criteria that read it: the default greedy
    # path keeps none.
    context = None
    if sampler.needs_context or criteria:
        context = TokenContext(prompt, len(prompt) + max_new_tokens, device)
    rounds: list[RoundStats] = []
    # a lazy proposer (DFlashProposer.propose_lazy) leaves the projection to the tree builder
    propose = getattr(proposer, "propose_lazy", None) or getattr(proposer, "propose", None)
    token_map = getattr(proposer, "token_map", None)  # proposers without one draft target ids

    t_start = time.perf_counter()
    # room for every position the call may fill: the prompt, its output, and the last tree
    # (within the context window; without one, at most MAX_RESERVED, and the cache grows after)
    tree_room = int(
        getattr(policy, "budget", None)
        or getattr(policy, "max_budget", None)
        or DEFAULT_DDTREE_BUDGET
    )
    fill = len(prompt) + max_new_tokens
    fill = min(fill, verifier.max_positions or MAX_RESERVED)
    verifier.reset(reserve=fill + tree_room + 1)
    if proposer is not None:
        proposer.reset()
    logits, features = verifier.prefill(prompt)
    bonus = sampler.choose(logits, context.ids() if sampler.needs_context else None)
    output = [bonus]
    _sync(device)
    prefill_s = time.perf_counter() - t_start
    _, stop_reason = _stop_point(output, max_new_tokens, stops, criteria, context)
    if context is not None:
        context.commit(output)
    if logits_callback is not None:
        logits_callback(logits[None])
    if callback is not None:
        callback(None, [bonus])

    while stop_reason is None:
        # Nodes deeper than this could never be committed within max_new_tokens.
        max_depth = max_new_tokens - len(output) - 1
        context_length = verifier.context_length
        t0 = time.perf_counter()
        draft_logits = None
        if policy.needs_drafter and max_depth > 0:
            draft_logits = propose(bonus, features)[:max_depth]
            _sync(device)
        t1 = time.perf_counter()
        tree = (
            policy.build(draft_logits, context_length)
            if draft_logits is not None
            else DraftTree.empty()
        )
        if draft_logits is not None and token_map is not None:
            tree = tree.map_tokens(token_map)  # draft vocabulary ids -> target ids
        confidence = _confidence(tree, draft_logits)
        t2 = time.perf_counter()
        project_s = getattr(draft_logits, "project_s", 0.0)
        target_logits, _ = verifier.verify(bonus, tree)
        _sync(device)
        t_forward = time.perf_counter()
        path, next_bonus = walk_tree(tree, target_logits, sampler, context)
        new_tokens = [int(tree.token_ids[i - 1]) for i in path[1:]] + [next_bonus]
        keep, stop_reason = _stop_point(
            new_tokens, max_new_tokens - len(output), stops, criteria, context
        )
        new_tokens = new_tokens[:keep]
        if stop_reason is None:
            features = verifier.commit(path)
            if context is not None:
                context.commit(new_tokens)
        _sync(device)
        t3 = time.perf_counter()
        output.extend(new_tokens)
        stats = RoundStats(
            context_length=context_length,
            budget=len(tree),
            accepted=len(path) - 1,
            committed=len(new_tokens),
            draft_s=t1 - t0 + project_s,
            tree_s=t2 - t1 - project_s,
            verify_s=t3 - t2,
            phi=tree.phi,
            confidence=confidence,
            path=[i - 1 for i in path[1:]],
            project_s=project_s,
            projected=_projected(draft_logits),
            forward_s=t_forward - t2,
        )
        rounds.append(stats)
        stats.round_s = time.perf_counter() - t0
        if tree_callback is not None:
            tree_callback(tree, stats)
        if logits_callback is not None:  # row path[j] chose new_tokens[j]
            logits_callback(target_logits[torch.tensor(path[:keep], device=target_logits.device)])
        if callback is not None:
            callback(stats, new_tokens)
        bonus = next_bonus

    wall_s = time.perf_counter() - t_start
    stats = GenerationStats.from_rounds(
        policy.name, rounds, len(output), wall_s, prefill_s, stop_reason
    )
    return GenerationResult("", output, prompt, policy.name, stats)
