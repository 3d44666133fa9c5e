"""Measure the cost model on this machine: C_v(n; l) over a grid, and C_d (paper §3.6).

Verification cost: the target's KV cache (reserved in place, as decoding reserves it) is filled
with the longest context once per pass; each context length ``l`` is then had by truncating it,
from the longest down, and for each node count ``n`` a tree of ``n`` nodes (a DDTree over fixed
random marginals, so of realistic shape and depth) is verified once and discarded again. The first
``warmup`` passes are untimed, then ``trials`` timed passes follow, visiting the node counts in
alternating order; the median of a point's trials is its measurement. Interleaving the grid this
way spreads a slow spell of the machine (a fresh process's first calls, another job) over every
point as one outlier among several, where timing each point's trials back to back let it shift
whole stretches of one context's curve. Drafting cost: what a round that drafts pays beyond its
tree's rows, at each context length (:func:`_drafted_round_extra`: the drafter's pass over a few new
context features, a tree built from it, and the verification's slower start after them, timed
against the same verification without them), at least one drafter pass timed alone, averaged
over the context lengths.

Timings synchronise every device involved (the target's, and the drafter's when it differs)
around each call, so on CUDA they measure the work, not the kernel launches.

:func:`plot_cost_model` draws the paper's Figure 4 from a fitted (or loaded) model.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..util.checks import MAX_TREE_NODES
from ..util.errors import InvalidInputError
from .cost import ConvexCostModel, CostModel
from .tree import DraftTree, build_ddtree

__all__ = [
    "DEFAULT_NODE_COUNTS",
    "MAX_NODE_COUNT",
    "PAPER_CONTEXT_LENGTHS",
    "PAPER_NODE_COUNTS",
    "QUICK_CONTEXT_LENGTHS",
    "QUICK_NODE_COUNTS",
    "check_profile_grid",
    "describe_duration",
    "estimate_profile_seconds",
    "fit_context_lengths",
    "max_profile_context_length",
    "median_time",
    "plot_cost_model",
    "profile_cost_model",
    "profiling_tree",
]

DEFAULT_NODE_COUNTS = (0, 1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
"""The grid of the automatic (cached) profile: up to 256 nodes, a minute on a CPU."""

#: the tree a drafted round builds when the profile times what drafting adds to a round
PROFILE_TREE_BUDGET = 8

PAPER_CONTEXT_LENGTHS = tuple(range(0, 8193, 1024))
"""The paper's context lengths (§4.4): 0, 1k, ..., 8k tokens."""

PAPER_NODE_COUNTS = (0, 1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024)
"""Node counts up to the paper's N = 1024, denser where the curve bends (few nodes)."""

QUICK_CONTEXT_LENGTHS = (0, 512, 1024)
QUICK_NODE_COUNTS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256)
"""``caddtree profile --quick``: a grid that takes about a minute for a small model on a CPU."""

MAX_NODE_COUNT = MAX_TREE_NODES  # the largest tree a round may verify (caddtree.util.checks)
"""The largest tree profiled: 4x the paper's largest. The attention over ``n`` tree nodes after
``l`` context tokens is ``n x (l + n)`` per head, so a typo like 100000 would exhaust memory."""


def check_profile_grid(
    context_lengths: Iterable[Any], node_counts: Iterable[Any], trials: Any = 1, warmup: Any = 0
) -> tuple[list[int], list[int]]:
    """Validate a profiling grid before any model work; return the sorted distinct lengths and
    node counts. Raises :class:`~caddtree.util.errors.InvalidInputError` naming the bad value."""

    def integers(values: Iterable[Any], what: str) -> list[int]:
        out = []
        for v in values:
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                raise InvalidInputError(f"{what} must be integers, got {v!r}")
            if v < 0:
                raise InvalidInputError(f"{what} must be non-negative, got {v}")
            out.append(int(v))
        return sorted(set(out))

    lengths = integers(context_lengths, "context lengths")
    counts = integers(node_counts, "node counts")
    if not lengths:
        raise InvalidInputError("profiling needs at least one context length")
    if len(counts) < 3:
        raise InvalidInputError(
            f"profiling needs at least 3 distinct node counts for a convex fit, got {counts}"
        )
    if counts[-1] > MAX_NODE_COUNT:
        raise InvalidInputError(
            f"node count {counts[-1]} is above the profiling limit of {MAX_NODE_COUNT} "
            "(the paper profiles up to 1024)"
        )
    for name, value, low in (("trials", trials, 1), ("warmup", warmup, 0)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
            raise InvalidInputError(f"{name} must be an integer >= {low}, got {value!r}")
    return lengths, counts


def max_profile_context_length(verifier: Any, proposer: Any) -> int | None:
    """The longest context that leaves room for a full-depth tree and the drafter's block in the
    target's position window (``max_position_embeddings``); ``None`` when the model has no limit.

    A profiled context of ``l`` tokens (at least one) is followed by the bonus token and a tree of
    depth ``B - 1``, so ``l + B + 1`` positions must fit.
    """
    limit = verifier.max_positions
    if limit is None:
        return None
    return int(limit) - proposer.block_size - 1


def fit_context_lengths(lengths: Sequence[int], longest: int | None) -> tuple[list[int], list[int]]:
    """Clip a *default* grid of context lengths to ``longest`` (see
    :func:`max_profile_context_length`): keep the lengths that fit and, when some do not, add
    ``longest`` itself so the whole window the model can serve is profiled.
    Returns ``(lengths, dropped)``."""
    lengths = sorted({int(x) for x in lengths})
    if longest is None:
        return lengths, []
    if longest < 0:
        raise InvalidInputError(
            f"the model's position window is too small to verify a tree of the drafter's depth "
            f"(longest profilable context: {longest})"
        )
    kept = [x for x in lengths if x <= longest]
    dropped = [x for x in lengths if x > longest]
    if dropped and longest not in kept:
        kept.append(longest)
    return kept, dropped


def profiling_tree(n: int, depth: int, vocab_size: int, seed: int = 0) -> DraftTree:
    """A DDTree of ``n`` nodes over fixed random marginals of ``depth`` positions: the shape a real
    round produces (a few long branches and many short ones), independent of any model."""
    rng = np.random.default_rng(seed)
    logits = rng.normal(0.0, 2.0, size=(depth, min(256, vocab_size)))
    return build_ddtree(logits, n)


def _sync(devices: Sequence[torch.device]) -> None:
    for device in devices:
        if device.type == "cuda":
            torch.cuda.synchronize(device)


NOISY_SPREAD = 0.25
"""A point's trials disagree wildly when their median absolute deviation exceeds this fraction of
their median: the median itself is then uncertain, and the point is measured again."""

NOISY_RETRIES = 2
"""How many times a point whose trials disagree is measured again (each time ``trials`` calls)."""


def spread(times: Sequence[float]) -> float:
    """The median absolute deviation of ``times`` relative to their median (0 for one time)."""
    middle = statistics.median(times)
    if len(times) < 2 or middle <= 0:
        return 0.0
    return statistics.median(abs(t - middle) for t in times) / middle


def steadiest(runs: Sequence[Sequence[float]]) -> list[float]:
    """Of several runs of one point's trials, the one that agrees with itself best."""
    return list(min(runs, key=spread))


def _time_trials(fn, trials: int, devices: Sequence[torch.device]) -> list[float]:
    times = []
    for _ in range(trials):
        _sync(devices)
        t0 = time.perf_counter()
        fn()
        _sync(devices)
        times.append(time.perf_counter() - t0)
    return times


def median_time(fn, warmup: int, trials: int, devices: Sequence[torch.device]) -> float:
    """Median wall time of ``fn()`` over ``trials`` calls after ``warmup`` untimed ones; every
    device in ``devices`` is synchronised before the clock starts and before it stops. Trials that
    disagree wildly (:data:`NOISY_SPREAD`) are taken again, up to :data:`NOISY_RETRIES` times, and
    the steadiest run counts."""
    for _ in range(warmup):
        fn()
    runs = [_time_trials(fn, trials, devices)]
    while spread(runs[-1]) > NOISY_SPREAD and len(runs) <= NOISY_RETRIES:
        runs.append(_time_trials(fn, trials, devices))
    return statistics.median(steadiest(runs))


_GRID_DEFAULTS: dict[str, Any] = {
    "context_lengths": (0, 256, 512),
    "node_counts": DEFAULT_NODE_COUNTS,
    "trials": 5,
    "warmup": 2,
    "vocab_size": None,
    "seed": 0,
}
"""The defaults of :func:`profile_cost_model`'s grid, for :func:`estimate_profile_seconds`."""


def _checked_grid(
    verifier: Any,
    proposer: Any,
    context_lengths: Sequence[int],
    node_counts: Sequence[int],
    trials: int,
    warmup: int,
    vocab_size: int | None,
    seed: int,
) -> tuple[list[int], list[int], int, dict[int, DraftTree]]:
    """The grid of :func:`profile_cost_model`, checked against the models: ``(lengths, counts,
    vocab, trees)`` with the profiling tree of every node count."""
    if proposer is None:
        raise InvalidInputError("profiling the drafting cost C_d needs a drafter (a DFlash model)")
    lengths, counts = check_profile_grid(context_lengths, node_counts, trials, warmup)
    depth = proposer.block_size - 1
    longest = max_profile_context_length(verifier, proposer)
    if longest is not None and lengths[-1] > longest:
        raise InvalidInputError(
            f"context length {lengths[-1]} leaves no room for the bonus token and a depth-{depth} "
            f"tree in the model's {verifier.max_positions} positions; "
            + (f"profile context lengths up to {longest}" if longest >= 0 else "none fits")
        )
    vocab = vocab_size or int(verifier.model.config.get_text_config().vocab_size)
    trees = {n: profiling_tree(n, depth, vocab, seed) for n in counts}
    short = [n for n, tree in trees.items() if len(tree) != n]
    if short:
        raise InvalidInputError(
            f"a tree of depth {depth} over {min(256, vocab)} candidate tokens holds at most "
            f"{len(trees[short[0]])} nodes; node count {short[0]} does not fit"
        )
    return lengths, counts, vocab, trees


def _timed(fn, devices: Sequence[torch.device]) -> float:
    """Wall time of one call of ``fn()``, every device in ``devices`` synchronised around it."""
    return _time_trials(fn, 1, devices)[0]


def estimate_profile_seconds(verifier: Any, proposer: Any, **grid: Any) -> float:
    """How long :func:`profile_cost_model` with the same arguments will take, in seconds: an
    estimate on the high side, from a few forwards on this machine, to tell a user before a
    profile that may take minutes (a half-precision dtype without fast CPU kernels is many times
    slower than float32).

    Times the prefill of the longest context, then after it one untimed and one timed
    verification of the largest tree, one of the empty tree, and one drafter pass. The estimate
    takes a verification to grow linearly in ``n`` between the two trees and to cost as much at
    every context length as at the longest.
    ``grid`` holds :func:`profile_cost_model`'s keyword arguments (the same defaults; ``progress``
    and ``metadata`` are ignored). Leaves both caches empty.
    """
    grid = {**_GRID_DEFAULTS, **{k: v for k, v in grid.items() if k in _GRID_DEFAULTS}}
    lengths, counts, vocab, trees = _checked_grid(verifier, proposer, **grid)
    trials, warmup, seed = grid["trials"], grid["warmup"], grid["seed"]
    devices = list(dict.fromkeys([verifier.device, proposer.drafter.fc.weight.device]))
    gen = torch.Generator().manual_seed(seed)
    longest = max(lengths[-1], 1)
    context = torch.randint(0, vocab, (longest,), generator=gen).tolist()
    largest = trees[counts[-1]]
    features: list[torch.Tensor] = []

    def verify(tree: DraftTree) -> None:
        verifier.verify(0, tree)
        verifier.discard()

    try:
        verifier.reset(reserve=_profile_reserve(longest, counts))  # as the profile reserves it
        prefill_s = _timed(lambda: features.append(verifier.prefill(context)[1]), devices)
        verify(largest)  # untimed: the first call pays one-time costs
        largest_s = _timed(lambda: verify(largest), devices)
        empty_s = _timed(lambda: verify(DraftTree.empty()), devices)
        proposer.reset()
        draft_s = _timed(lambda: proposer.propose(0, features[0]).rows(), devices)
    finally:
        verifier.reset()
        proposer.reset()
    slope = max(largest_s - empty_s, 0.0) / max(counts[-1], 1)
    per_pass = sum(empty_s + slope * n for n in counts)  # one context length's node counts
    runs = warmup + trials
    # each pass prefills the longest context and verifies every point; then the drafter's points
    return runs * (prefill_s + len(lengths) * per_pass) + len(lengths) * (runs + 1) * draft_s


def _profile_reserve(longest: int, counts: Sequence[int]) -> int:
    """The KV room a profile reserves, as decoding reserves it: the longest context, the largest
    tree and its bonus token."""
    return longest + counts[-1] + 1


def describe_duration(seconds: float) -> str:
    """A duration for a person: ``"about 40 seconds"``, ``"about a minute"``, ``"about 15
    minutes"``, ``"about 2.5 hours"``."""
    if seconds < 45:
        return f"about {max(round(seconds), 1)} seconds"
    if seconds < 90:
        return "about a minute"
    if seconds < 5400:
        return f"about {round(seconds / 60)} minutes"
    return f"about {seconds / 3600:.1f} hours"


def _verify_passes(
    verifier: Any,
    context: list[int],
    bonus: int,
    reserve: int,
    trees: dict[int, DraftTree],
    trials: int,
    bar: Any,
    points: dict[int, list[int]],
    skip: int,
) -> tuple[dict[int, dict[int, list[float]]], torch.Tensor]:
    """``skip + trials`` passes over ``points`` (context length -> node counts), the first
    ``skip`` untimed: each point's timed trials, and the context's features."""
    times: dict[int, dict[int, list[float]]] = {k: {n: [] for n in v} for k, v in points.items()}
    features = torch.empty(0)
    for p in range(skip + trials):
        verifier.reset(reserve=reserve)
        _, features = verifier.prefill(context)
        for length in sorted(points, reverse=True):
            verifier.truncate(max(length, 1))
            for n in points[length] if p % 2 == 0 else reversed(points[length]):

                def verify_once(tree: DraftTree = trees[n]) -> None:
                    verifier.verify(bonus, tree)
                    verifier.discard()  # discard: the cache stays at `length` tokens

                seconds = _timed(verify_once, [verifier.device])
                if p >= skip:
                    times[length][n].append(seconds)
                bar.update(1)
    return times, features


def profile_cost_model(
    verifier: Any,
    proposer: Any,
    *,
    context_lengths: Sequence[int] = (0, 256, 512),
    node_counts: Sequence[int] = DEFAULT_NODE_COUNTS,
    trials: int = 5,
    warmup: int = 2,
    vocab_size: int | None = None,
    seed: int = 0,
    progress: bool = True,
    metadata: dict[str, Any] | None = None,
) -> ConvexCostModel:
    """Profile ``verifier`` (a :class:`~caddtree.runtime.verifier.Verifier`) and ``proposer`` (a
    :class:`~caddtree.models.DFlashProposer`) and fit a :class:`ConvexCostModel`.

    A point whose trials disagree wildly (:data:`NOISY_SPREAD`) is measured again, up to
    :data:`NOISY_RETRIES` times, and keeps its steadiest trials. The fitted model's ``metadata``
    records the grid, the raw medians, every kept trial, the points measured again and
    ``metadata``.
    Raises :class:`~caddtree.util.errors.InvalidInputError` for a bad grid (see
    :func:`check_profile_grid`), a context length beyond the model's window, or a node count that
    no tree of the drafter's depth can hold.
    """
    from tqdm.auto import tqdm

    lengths, counts, vocab, trees = _checked_grid(
        verifier, proposer, context_lengths, node_counts, trials, warmup, vocab_size, seed
    )
    gen = torch.Generator().manual_seed(seed)
    device = verifier.device
    draft_devices = list(dict.fromkeys([device, proposer.drafter.fc.weight.device]))
    # one context of random tokens; each length is its first max(l, 1) tokens (at least one: the
    # first bonus follows something), had by truncating the longest, the model being causal
    context = torch.randint(0, vocab, (max(lengths[-1], 1),), generator=gen).tolist()
    bonus = int(torch.randint(0, vocab, (1,), generator=gen))
    reserve = _profile_reserve(len(context), counts)
    bar = tqdm(
        total=(warmup + trials) * len(lengths) * len(counts) + len(lengths),
        desc="profiling",
        unit="point",
        disable=not progress,
    )

    measure = partial(_verify_passes, verifier, context, bonus, reserve, trees, trials, bar)
    times, features = measure({length: list(counts) for length in lengths}, warmup)
    retried = _measure_noisy_again(measure, times, counts, trials, bar)
    measurements = {
        length: (counts, [statistics.median(times[length][n]) for n in counts])
        for length in lengths
    }
    timing = partial(median_time, warmup=warmup, trials=trials, devices=draft_devices)
    draft_times = _draft_times(proposer, features, lengths, bonus, timing, bar)
    verifier.reset(reserve=reserve)
    verifier.prefill(context)
    round_times = [
        _drafted_round_extra(verifier, proposer, features, length, bonus, trials, draft_devices)
        for length in sorted(lengths, reverse=True)
    ][::-1]
    bar.close()
    verifier.reset()
    proposer.reset()
    draft_cost = float(np.mean([max(r, d) for r, d in zip(round_times, draft_times)]))
    meta = {
        "node_counts": counts,
        "context_lengths": lengths,
        "trials": trials,
        "warmup": warmup,
        "draft_times": draft_times,
        "drafted_round_extra": round_times,
        "raw_verify": {str(k): v[1] for k, v in measurements.items()},
        # every timed trial, per context length and node count (in pass order): how noisy it was
        "verify_trials": {str(k): [times[k][n] for n in counts] for k in lengths},
        # node counts per context length whose trials disagreed wildly and were measured again
        "retried": {str(k): sorted(v) for k, v in retried.items()},
        **(metadata or {}),
    }
    return ConvexCostModel.fit(measurements, draft_cost, metadata=meta)


def _measure_noisy_again(
    measure: Callable[..., Any],
    times: dict[int, dict[int, list[float]]],
    counts: list[int],
    trials: int,
    bar: Any,
) -> dict[int, set[int]]:
    """Measure the points whose trials disagree wildly (:data:`NOISY_SPREAD`) again, up to
    :data:`NOISY_RETRIES` times, keeping each point's steadiest trials in ``times``; the node
    counts measured again, per context length."""
    retried: dict[int, set[int]] = {}
    for _ in range(NOISY_RETRIES):
        noisy = {k: [n for n in counts if spread(v[n]) > NOISY_SPREAD] for k, v in times.items()}
        noisy = {k: v for k, v in noisy.items() if v}
        if not noisy:
            break
        bar.total += (1 + trials) * sum(map(len, noisy.values()))
        again, _ = measure(noisy, 1)
        for length, ns in noisy.items():
            retried.setdefault(length, set()).update(ns)
            for n in ns:
                times[length][n] = steadiest([times[length][n], again[length][n]])
    return retried


def _drafted_round_extra(
    verifier: Any,
    proposer: Any,
    features: torch.Tensor,
    length: int,
    bonus: int,
    trials: int,
    devices: Sequence[torch.device],
) -> float:
    """What a round that drafts pays beyond its tree's rows at context ``length``: a verification
    of the bonus token alone after the drafter's pass (its last 4 tokens new, the whole block
    projected) and a DDTree of :data:`PROFILE_TREE_BUDGET` nodes built from it, minus the same
    verification without them, the two timed in turns (medians). Beside the pass, this charges
    the tree's construction and the verification's slower start after a pass (the drafter's
    work has taken the caches), which the pass timed alone leaves out. ``verifier`` holds at
    least ``length`` tokens of the context whose ``features`` are given, and keeps ``length``."""
    verifier.truncate(max(length, 1))
    draft_once, empty = _draft_pass(proposer, features, length, bonus), DraftTree.empty()

    def plain() -> None:
        verifier.verify(bonus, empty)
        verifier.discard()

    def drafted() -> None:
        draft = draft_once()
        draft.in_target_ids(build_ddtree(draft, PROFILE_TREE_BUDGET))
        plain()

    times: dict[Callable[[], None], list[float]] = {plain: [], drafted: []}
    rounds = max(4 * trials, 12)
    for t in range(2 + rounds):  # two untimed
        for fn in (drafted, plain) if t % 2 == 0 else (plain, drafted):
            seconds = _timed(fn, devices)
            if t >= 2:
                times[fn].append(seconds)
    return statistics.median(times[drafted]) - statistics.median(times[plain])


def _draft_times(
    proposer: Any,
    features: torch.Tensor,
    lengths: list[int],
    bonus: int,
    timing: Callable[[Callable[[], None]], float],
    bar: Any,
) -> list[float]:
    """The drafter's pass at each context length (its last 4 tokens new, the whole block
    projected), timed by ``timing``."""
    draft_times: list[float] = []
    for length in lengths:
        draft_times.append(timing(_draft_pass(proposer, features, length, bonus)))
        bar.update(1)
    return draft_times


def _draft_pass(
    proposer: Any, features: torch.Tensor, length: int, bonus: int
) -> Callable[[], Any]:
    """A call of one drafter pass at context ``length`` (the context's last 4 tokens new, the
    whole block projected), returning its draft; the proposer is left holding the rest of the
    context, which every call crops back to."""
    prefix = features[:, : max(length, 1)]
    proposer.reset()
    proposer.propose(bonus, prefix[:, :-4] if prefix.shape[1] > 4 else prefix[:, :1])
    start = proposer.context_length
    tail = prefix[:, start : start + 4]

    def draft_once() -> Any:
        proposer.crop(start)
        draft = proposer.propose(bonus, tail)
        draft.rows()  # the whole block projected
        return draft

    return draft_once


def _raw_measurements(model: CostModel) -> dict[int, tuple[list[int], list[float]]]:
    """The measured medians kept in a profiled model's metadata (``node_counts`` and
    ``raw_verify``: context length, as a string in JSON, -> seconds per node count); entries that
    do not line up are skipped, and a model without them (a published file) gives ``{}``."""
    meta = getattr(model, "metadata", {}) or {}
    counts, raw = meta.get("node_counts"), meta.get("raw_verify")
    if not isinstance(counts, list) or not isinstance(raw, dict):
        return {}
    out = {}
    for key, values in raw.items():
        try:
            length = int(key)
            ys = [float(v) for v in values]
        except (TypeError, ValueError):
            continue
        if len(ys) == len(counts):
            out[length] = (counts, ys)
    return out


def plot_cost_model(
    model: CostModel, path: str | os.PathLike[str], title: str | None = None
) -> Path:
    """Draw the paper's Figure 4 for ``model`` and write it to ``path`` (format from the suffix).

    Verification latency (ms) against the number of draft nodes: the fitted convex curve of every
    profiled context length, light to dark as the context grows, with the measured medians as dots
    when the model carries them (a model from :func:`profile_cost_model`, also after a save and
    load; a published torch file has only curves), and ``C_d`` in a corner.
    """
    from ..util.plots import pyplot, save_figure

    lengths = getattr(model, "context_lengths", None)
    curves = getattr(model, "curves", None)
    if not lengths or not curves:
        raise InvalidInputError(
            f"cannot plot a {type(model).__name__}: it has no per-context verification curves"
        )
    raw = _raw_measurements(model)
    quality = getattr(model, "fit_quality", {}) or {}
    largest = max(
        [float(c.node_counts[-1]) for c in curves]
        + [float(max(counts)) for counts, _ in raw.values()]
        + [1.0]
    )
    n = np.linspace(0.0, largest, 400)

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    shades = np.linspace(0.35, 1.0, len(lengths)) if len(lengths) > 1 else [0.8]
    colours = plt.get_cmap("Blues")(shades)
    for length, curve, colour in zip(lengths, curves, colours):
        label = f"l = {length}"
        q = quality.get(length)
        if q is not None and np.isfinite(q.r2):
            label += f"  (R² {q.r2:.3f})"
        ax.plot(n, curve(n) * 1e3, color=colour, linewidth=1.6, label=label)
        if length in raw:
            counts, ys = raw[length]
            ax.scatter(counts, np.asarray(ys) * 1e3, color=colour, s=14, zorder=3)
    ax.set_xlabel("number of draft nodes n")
    ax.set_ylabel("verification latency C_v(n; l) (ms)")
    ax.set_xlim(0, largest)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(title="context length", fontsize=8, title_fontsize=8, loc="upper left")
    note = f"C_d = {model.draft_cost * 1e3:.2f} ms (one drafter pass)"
    if raw:
        note += "\ndots: measured medians; lines: convex fit"
    ax.text(
        0.98,
        0.03,
        note,
        transform=ax.transAxes,
        ha="right",
        va="bottom",
        fontsize=8,
        bbox={"boxstyle": "round", "facecolor": "white", "alpha": 0.85, "edgecolor": "0.7"},
    )
    meta = getattr(model, "metadata", {}) or {}
    if title is None:
        name = Path(str(meta.get("target") or "")).name
        if len(name) > 40:  # e.g. the built-in target's cache directory
            name = name[:39] + "…"
        title = "Verification cost" + (f": {name}" if name else "")
        if meta.get("dtype"):
            title += f" ({str(meta['dtype']).removeprefix('torch.')})"
    ax.set_title(title, fontsize=10)
    return save_figure(fig, path)
