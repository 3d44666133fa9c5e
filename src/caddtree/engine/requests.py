"""The one request type: what to decode, checked once, and (filled in) what came of it.

:meth:`caddtree.api.SpeculativeGenerator.request` makes a :class:`GenerationRequest` from
``generate``'s arguments; ``generate`` decodes it with :func:`caddtree.engine.decoding.decode`, and
:class:`caddtree.engine.batching.BatchDecoder` decodes many together (``caddtree serve --max-batch``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..core.sampling import Sampler
from .decoding import GenerationResult, GenerationStats, RoundStats, TreePolicy

__all__ = ["GenerationRequest"]


@dataclass(eq=False)
class GenerationRequest:
    """One request: what to decode, and (filled in by :class:`~caddtree.engine.batching.BatchDecoder`)
    its output.

    ``prompt_ids`` and ``policy`` (:func:`caddtree.engine.decoding.make_policy`) say what; at most
    ``max_new_tokens`` tokens come out, and a token of ``stop_token_ids`` ends the output after
    itself, and so does one at which a criterion of ``stopping_criteria`` fires (transformers'
    form, as :func:`~caddtree.engine.decoding.decode` takes them). ``sampler`` chooses the target's tokens (greedy by
    default; give each sampled request its own seeded sampler).
    :meth:`caddtree.api.SpeculativeGenerator.request` makes one from ``generate``'s arguments. ``output``, ``stop_reason`` (``None`` while it runs), ``rounds``
    (verification rounds) and ``accepted`` (draft tokens accepted) are filled in as it decodes.
    """

    prompt_ids: Sequence[int]
    policy: TreePolicy
    max_new_tokens: int
    sampler: Sampler = field(default_factory=Sampler)
    stop_token_ids: frozenset[int] = frozenset()
    stopping_criteria: list[Callable[..., Any]] = field(default_factory=list)
    output: list[int] = field(default_factory=list)
    stop_reason: str | None = None
    rounds: int = 0
    accepted: int = 0
    round_stats: list[RoundStats] = field(default_factory=list)
    started: float = 0.0  # perf_counter when its prefill began
    prefill_s: float = 0.0  # its prefill and first token
    wall_s: float = 0.0  # from its prefill to its last token

    def result(self) -> GenerationResult:
        """The finished request as :func:`~caddtree.engine.decoding.decode`'s result (no text)."""
        stats = GenerationStats.from_rounds(
            self.policy.name,
            self.round_stats,
            len(self.output),
            self.wall_s,
            self.prefill_s,
            self.stop_reason or "cancelled",
        )
        return GenerationResult(
            "", list(self.output), list(self.prompt_ids), self.policy.name, stats
        )

    @property
    def tau(self) -> float:
        """Tokens committed per verification round (the prefill's token left out)."""
        return (len(self.output) - 1) / self.rounds if self.rounds else float("nan")
