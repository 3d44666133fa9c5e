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

Losslessness. At temperature 0 the walk follows the target's argmax at every node, so the output
is token for token that of plain greedy decoding. At temperature > 0 the walk samples the target's
token at each visited node (from the target's own, possibly tempered / top-p filtered
distribution) and follows the child that carries it; the first sampled token with no matching
child becomes the next bonus token. Every committed token is therefore a sample of the target's
distribution given everything before it, exactly as in plain sampling.

Statistics. ``tau`` is the mean number of tokens committed per verification round (accepted draft
tokens plus the bonus token, so AR has ``tau = 1``); the token produced by the prefill pass is not
part of any round. ``ms_per_token`` is the wall time of the whole call (prefill included) divided
by the number of generated tokens.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np
import torch

from .checks import check_int
from .errors import InvalidInputError
from .tree import DraftTree, build_caddtree, build_chain, build_ddtree

if TYPE_CHECKING:  # pragma: no cover
    from .cost import CostModel
    from .models.target import TreeVerifier

__all__ = [
    "METHODS",
    "Budget",
    "Chain",
    "CostAware",
    "DecodeResult",
    "GenerationStats",
    "NoTree",
    "Proposer",
    "RoundStats",
    "Sampler",
    "TreePolicy",
    "decode",
    "make_policy",
]

METHODS = ("ar", "dflash", "ddtree", "caddtree")


# --------------------------------------------------------------------------------------------------
# Tree policies
# --------------------------------------------------------------------------------------------------


@runtime_checkable
class Proposer(Protocol):
    """What the round loop needs from a drafter (the proposer of DESIGN.md's round loop).

    ``propose(bonus, new_context_features)`` returns the draft logits of the block after
    ``bonus``, ``[B-1, V]`` (a tensor, or :class:`~caddtree.tree.DraftRows` computed on demand);
    ``new_context_features`` are the target's features of the tokens committed since the last
    call. ``reset()`` forgets everything (a new prompt); ``crop(length)`` forgets the context past
    its first ``length`` tokens; ``context_length`` is how many tokens the proposer has seen.
    :class:`~caddtree.models.dflash.DFlashProposer` is one. Two members are optional, and
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
    if method not in METHODS:
        raise InvalidInputError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")
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
# Sampling
# --------------------------------------------------------------------------------------------------


class Sampler:
    """Chooses the target's token from one row of logits: argmax at temperature 0, otherwise a
    sample of ``softmax(logits / temperature)``, optionally restricted to the top-p nucleus."""

    def __init__(
        self,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int | None = None,
        device: torch.device | str = "cpu",
    ):
        if (
            not isinstance(temperature, (int, float))
            or not math.isfinite(temperature)
            or temperature < 0
        ):
            raise InvalidInputError(
                f"temperature must be a finite number >= 0, got {temperature!r}"
            )
        if not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
            raise InvalidInputError(f"top_p must be in (0, 1], got {top_p!r}")
        self.temperature = float(temperature)
        self.top_p = float(top_p)
        self.generator: torch.Generator | None = None
        if self.temperature > 0:
            self.generator = torch.Generator(device=device)
            if seed is None:
                self.generator.seed()
            else:
                self.generator.manual_seed(int(seed))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def probabilities(self, logits: torch.Tensor) -> torch.Tensor:
        """The distribution that :meth:`choose` samples from (for a 1D row of logits)."""
        probs = torch.softmax(logits.double() / self.temperature, dim=-1)
        if self.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
            sorted_probs[before >= self.top_p] = 0.0  # keep the smallest set reaching top_p
            probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
            probs /= probs.sum()
        return probs

    def choose(self, logits: torch.Tensor) -> int:
        if self.greedy:
            return int(greedy_choices(logits))
        return int(torch.multinomial(self.probabilities(logits), 1, generator=self.generator))


def greedy_choices(logits: torch.Tensor) -> torch.Tensor:
    """``argmax`` over the last dimension (the first index on ties). Half-precision logits are
    upcast to float32 first: exact, so the choices are the same, and on a CPU several times
    faster than a bfloat16 argmax (0.23 ms instead of 0.9 ms for 5 rows of a 49k vocabulary)."""
    if logits.dtype in (torch.bfloat16, torch.float16):
        logits = logits.float()
    return torch.argmax(logits, dim=-1)


def walk_tree(tree: DraftTree, logits: torch.Tensor, sampler: Sampler) -> tuple[list[int], int]:
    """Walk ``tree`` with the target's choices.

    ``logits`` [n+1, V] are the target's logits for ``[bonus] + nodes``. Returns the accepted path
    as indices into ``[bonus] + nodes`` (``0`` first) and the next bonus token: the target's choice
    after the last accepted node, which no child carries.
    """
    if sampler.greedy and len(tree):
        choices = greedy_choices(logits).tolist()  # one host sync for the whole tree
        choose = choices.__getitem__
    else:

        def choose(row: int) -> int:
            return sampler.choose(logits[row])

    path = [0]
    node = -1
    while True:
        token = choose(node + 1)
        child = tree.child_with_token(node, token) if len(tree) else -1
        if child < 0:
            return path, token
        path.append(child + 1)
        node = child


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
    """Summary of one generation (see the module docstring for ``tau`` and ``ms_per_token``)."""

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
    stop_reason: str  # "stop_token" or "max_new_tokens"
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
        """The summary of one generation of ``new_tokens`` tokens in ``rounds``."""
        budgets = np.array([r.budget for r in rounds], dtype=np.float64)
        return cls(
            method=method,
            new_tokens=new_tokens,
            rounds=len(rounds),
            tau=float(np.mean([r.committed for r in rounds])) if rounds else 0.0,
            ms_per_token=1e3 * wall_s / new_tokens,
            budget_mean=float(budgets.mean()) if rounds else 0.0,
            budget_std=float(budgets.std()) if rounds else 0.0,
            wall_s=wall_s,
            prefill_s=prefill_s,
            draft_s=sum(r.draft_s for r in rounds),
            tree_s=sum(r.tree_s for r in rounds),
            verify_s=sum(r.verify_s for r in rounds),
            stop_reason=stop_reason,
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
class DecodeResult:
    token_ids: list[int]  # generated tokens (the stop token included, if one was hit)
    stats: GenerationStats


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
            f"model's context of {limit} tokens; lower max_new_tokens to {limit - len(prompt)}"
        )
    return prompt


def _truncate_at_stop(tokens: list[int], stops: set[int], room: int) -> tuple[list[int], bool]:
    """``tokens`` cut after the first stop token (kept) and to at most ``room`` tokens; and
    whether a stop token was hit within them."""
    for j, tok in enumerate(tokens[:room]):
        if tok in stops:
            return tokens[: j + 1], True
    return tokens[:room], False


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
    what a lazy one (:class:`~caddtree.models.dflash.DraftLogits`) projected, none without one."""
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
    callback: Callable[[RoundStats, list[int]], Any] | None = None,
    tree_callback: Callable[[DraftTree, RoundStats], Any] | None = None,
) -> DecodeResult:
    """Generate up to ``max_new_tokens`` tokens after ``prompt_ids`` with one tree policy.

    ``callback(round_stats, new_tokens)`` is called after every round (and once after the prefill,
    with ``round_stats=None``) with the tokens that round added, e.g. for streaming.
    ``tree_callback(tree, round_stats)`` receives every round's draft tree (for analysis and
    rendering; ``round_stats.path`` is its accepted path). Generation
    stops after a token in ``stop_token_ids`` (which is kept in the output) or after
    ``max_new_tokens`` tokens.
    """
    prompt = _checked_prompt(verifier, prompt_ids, policy, proposer, max_new_tokens)
    sampler = sampler or Sampler()
    stops = {int(t) for t in stop_token_ids}
    device = verifier.device
    rounds: list[RoundStats] = []
    # a lazy proposer (DFlashProposer.propose_lazy) leaves the projection to the tree builder
    propose = getattr(proposer, "propose_lazy", None) or getattr(proposer, "propose", None)
    token_map = getattr(proposer, "token_map", None)  # proposers without one draft target ids

    t_start = time.perf_counter()
    verifier.reset()
    if proposer is not None:
        proposer.reset()
    logits, features = verifier.prefill(prompt)
    bonus = sampler.choose(logits)
    output = [bonus]
    _sync(device)
    prefill_s = time.perf_counter() - t_start
    if callback is not None:
        callback(None, [bonus])
    stop_reason = "stop_token" if bonus in stops else "max_new_tokens"

    while bonus not in stops and len(output) < max_new_tokens:
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
        path, next_bonus = walk_tree(tree, target_logits, sampler)
        new_tokens = [int(tree.token_ids[i - 1]) for i in path[1:]] + [next_bonus]
        new_tokens, stopped = _truncate_at_stop(new_tokens, stops, max_new_tokens - len(output))
        if stopped:
            stop_reason = "stop_token"
        done = stopped or len(output) + len(new_tokens) >= max_new_tokens
        if not done:
            features = verifier.commit(path)
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
        if callback is not None:
            callback(stats, new_tokens)
        if done:
            break
        bonus = next_bonus

    wall_s = time.perf_counter() - t_start
    stats = GenerationStats.from_rounds(
        policy.name, rounds, len(output), wall_s, prefill_s, stop_reason
    )
    return DecodeResult(output, stats)
