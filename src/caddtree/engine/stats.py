"""What a generation reports: one round (:class:`RoundStats`), the whole call
(:class:`GenerationStats`) and its output (:class:`GenerationResult`)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

__all__ = ["GenerationResult", "GenerationStats", "RoundStats"]


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
    copied: int = 0  # tree nodes whose estimate was a copy's from the context (lookup)
    copied_accepted: int = 0  # of the accepted nodes, those

    @classmethod
    def of_walk(cls, tree: Any, path: list[int], committed: int, context_length: int) -> RoundStats:
        """The round that verified ``tree`` after ``context_length`` tokens and accepted
        ``path``, adding ``committed`` tokens; its times are set by the loop that ran it."""
        return cls(
            context_length=context_length,
            budget=len(tree),
            accepted=len(path),
            committed=committed,
            draft_s=0.0,
            tree_s=0.0,
            verify_s=0.0,
            phi=tree.phi,
            path=path,
            copied=int(tree.copied.sum()) if tree.copied is not None else 0,
            copied_accepted=int(tree.copied[path].sum()) if tree.copied is not None else 0,
        )


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

    Copies from the context (``lookup``): ``copied_tokens`` counts the tree nodes whose estimate
    was a copy's, ``copied_accepted_tokens`` those accepted, and ``copied_share`` is their share of
    the tokens committed in rounds (of ``tau``).

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
    copied_tokens: int = 0
    copied_accepted_tokens: int = 0
    copied_share: float = 0.0

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
        copied_accepted = sum(r.copied_accepted for r in rounds)
        committed = sum(r.committed for r in rounds)
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
            copied_tokens=sum(r.copied for r in rounds),
            copied_accepted_tokens=copied_accepted,
            copied_share=copied_accepted / committed if committed else 0.0,
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
