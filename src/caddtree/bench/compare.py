"""One generation timed against plain decoding, as ``caddtree generate --compare-ar`` runs it.

:func:`compare_with_ar` warms every run up untimed, times the method and plain decoding (AR) in
each dtype ``repeats`` times in alternating order (:func:`~caddtree.bench.runner.
alternating_order`), and keeps each one's median run. The speed-up is over the fastest AR: AR in
the run's own dtype is the lossless reference, and AR in another dtype (float32 beside a bfloat16
run on the CPU) is the plain decoding a user could pick instead.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from .runner import alternating_order, median_run

__all__ = ["Comparison", "compare_with_ar"]


def _ms_per_token(result: Any) -> float:
    return result.stats.ms_per_token


@dataclass
class Comparison:
    """The method's median run, AR's median run in each dtype (the run's own dtype first), and
    every timed run's ms/token (the method's first)."""

    result: Any
    ar_runs: list[tuple[Any, Any]]  # (dtype, median run)
    every_ms: list[list[float]]

    @property
    def baseline(self) -> Any:
        """AR in the run's own dtype: the lossless reference (``None`` without AR)."""
        return self.ar_runs[0][1] if self.ar_runs else None

    @property
    def fastest(self) -> int:
        """Index into ``ar_runs`` of the fastest AR (the same-dtype one on a tie)."""
        runs = self.ar_runs
        return min(range(len(runs)), key=lambda i: runs[i][1].stats.ms_per_token, default=0)

    @property
    def speedup(self) -> float:
        """The method's speed-up over the fastest AR."""
        return self.ar_runs[self.fastest][1].stats.ms_per_token / self.result.stats.ms_per_token


def compare_with_ar(
    run_method: Callable[[int, dict], Any],
    ar_runs: Sequence[tuple[Any, Callable[[dict], Any]]],
    repeats: int,
    warm_tokens: int,
) -> Comparison:
    """Time ``run_method(k, overrides)`` (the ``k``-th timed run) against each AR run
    ``(dtype, run(overrides))``. With AR runs, each run is first made once untimed with
    ``max_new_tokens=warm_tokens`` (one-time costs fall on none of the timed runs), then all are
    timed ``repeats`` times in alternating order; without, the method runs once."""
    if ar_runs:
        warm = {"max_new_tokens": warm_tokens}
        run_method(-1, warm)
        for _, run in ar_runs:
            run(warm)
    timed: list[list[Any]] = [[] for _ in range(1 + len(ar_runs))]
    for k in range(repeats if ar_runs else 1):
        for i in alternating_order(range(len(timed)), k):
            timed[i].append(run_method(k, {}) if i == 0 else ar_runs[i - 1][1]({}))
    return Comparison(
        result=median_run(timed[0], key=_ms_per_token),
        ar_runs=[
            (dtype, median_run(runs, key=_ms_per_token))
            for (dtype, _), runs in zip(ar_runs, timed[1:])
        ],
        every_ms=[[r.stats.ms_per_token for r in runs] for runs in timed],
    )
