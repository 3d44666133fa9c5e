"""Measure the cost model on this machine: C_v(n; l) over a grid, and C_d (paper §3.6).

Verification cost: the target's KV cache is filled with ``l`` context tokens once per context
length; then, for each node count ``n``, a tree of ``n`` nodes (a DDTree over fixed random
marginals, so of realistic shape and depth) is verified and discarded again, ``warmup`` times
untimed and ``trials`` times timed. The median of the trials is the measurement. Drafting cost:
the median time of one drafter pass (a block after a few new context features) at each context
length, averaged over the context lengths.

Timings synchronise the device around each call (CUDA), so they measure the work, not the launch.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from .cost import ConvexCostModel
from .errors import InvalidInputError
from .tree import DraftTree, build_ddtree

__all__ = ["DEFAULT_NODE_COUNTS", "profile_cost_model", "profiling_tree"]

DEFAULT_NODE_COUNTS = (0, 1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


def profiling_tree(n: int, depth: int, vocab_size: int, seed: int = 0) -> DraftTree:
    """A DDTree of ``n`` nodes over fixed random marginals of ``depth`` positions: the shape a real
    round produces (a few long branches and many short ones), independent of any model."""
    rng = np.random.default_rng(seed)
    logits = rng.normal(0.0, 2.0, size=(depth, min(256, vocab_size)))
    return build_ddtree(logits, n)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_time(fn, warmup: int, trials: int, device: torch.device) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(trials):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


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
    """Profile ``verifier`` (a :class:`~caddtree.models.TreeVerifier`) and ``proposer`` (a
    :class:`~caddtree.models.DFlashProposer`) and fit a :class:`ConvexCostModel`.

    The fitted model's ``metadata`` records the grid, the raw medians and ``metadata``.
    """
    from tqdm.auto import tqdm

    if len(set(node_counts)) < 3:
        raise InvalidInputError("profiling needs at least 3 distinct node counts")
    if trials < 1 or warmup < 0:
        raise InvalidInputError("trials must be >= 1 and warmup >= 0")
    lengths = sorted({int(x) for x in context_lengths})
    counts = sorted({int(x) for x in node_counts})
    depth = proposer.block_size - 1
    limit = verifier.max_positions
    if limit is not None and lengths[-1] + depth + 2 > limit:
        raise InvalidInputError(
            f"context length {lengths[-1]} plus a depth-{depth} tree exceeds the model's "
            f"{limit} positions; profile shorter contexts"
        )
    vocab = vocab_size or int(verifier.model.config.get_text_config().vocab_size)
    gen = torch.Generator().manual_seed(seed)
    device = verifier.device
    trees = {n: profiling_tree(n, depth, vocab, seed) for n in counts}
    measurements: dict[int, tuple[list[int], list[float]]] = {}
    draft_times: list[float] = []
    bar = tqdm(
        total=len(lengths) * (len(counts) + 1), desc="profiling", unit="point", disable=not progress
    )
    for length in lengths:
        # a context of `length` random tokens (at least one: the first bonus follows something)
        context = torch.randint(0, vocab, (max(length, 1),), generator=gen).tolist()
        verifier.reset()
        _, features = verifier.prefill(context)
        bonus = int(torch.randint(0, vocab, (1,), generator=gen))
        latencies = []
        for n in counts:
            tree = trees[n]

            def verify_once(tree: DraftTree = tree, bonus: int = bonus) -> None:
                verifier.verify(bonus, tree)
                verifier.commit([])  # discard: the cache stays at `length` tokens

            latencies.append(_median_time(verify_once, warmup, trials, device))
            bar.update(1)
        measurements[length] = (counts, latencies)

        proposer.reset()
        proposer.propose(bonus, features[:, :-4] if features.shape[1] > 4 else features[:, :1])
        start = proposer.context_length
        tail = features[:, start : start + 4]

        def draft_once(start: int = start, bonus: int = bonus, tail: torch.Tensor = tail) -> None:
            proposer.crop(start)
            proposer.propose(bonus, tail)

        draft_times.append(_median_time(draft_once, warmup, trials, device))
        bar.update(1)
    bar.close()
    verifier.reset()
    proposer.reset()
    draft_cost = float(np.mean(draft_times))
    meta = {
        "node_counts": counts,
        "context_lengths": lengths,
        "trials": trials,
        "warmup": warmup,
        "draft_times": draft_times,
        "raw_verify": {str(k): v[1] for k, v in measurements.items()},
        **(metadata or {}),
    }
    return ConvexCostModel.fit(measurements, draft_cost, metadata=meta)
