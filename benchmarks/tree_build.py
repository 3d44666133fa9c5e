"""Host time of draft-tree construction from raw draft logits, against a vocabulary-wide top-k.

    python benchmarks/tree_build.py [--vocab 151936] [--depth 15] [--repeats 100]

For each budget it prints the median microseconds of:

* ``topk1024`` - ``torch.topk(logits, 1024)`` alone: what a builder that reads a fixed top-1024 of
  every position (the paper's published builder) spends before it builds anything;
* ``ddtree``   - ``build_ddtree(logits, budget)``: normalisation, the candidates it reads, and the
  best-first expansion;
* ``caddtree`` - ``build_caddtree(logits, ...)`` with a cost model whose optimum lands near that
  budget (the printed ``n*`` is the size it chose), everything included;

and ``caddtree / topk1024``. The three are timed in alternation, in an order rotated every
repetition, so machine drift and the after-effects of one on the next fall on all.
The logits are synthetic: a drafter-like mix of confident and uncertain positions.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from caddtree import ConvexCostModel, build_caddtree, build_ddtree


def median_us(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def synthetic_logits(depth: int, vocab: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(depth, vocab, generator=g) * 2.0
    # a few strong candidates per position, with confidence decaying with depth
    for i in range(depth):
        top = torch.randint(0, vocab, (4,), generator=g)
        logits[i, top] += torch.tensor([14.0, 12.5, 11.5, 10.0]) - 0.3 * i
    return logits


def cost_model_for(target_n: int, draft_cost: float, probe) -> ConvexCostModel:
    """Bisect the per-node verification slope until CaDDTree picks about ``target_n`` nodes."""
    lo, hi = 1e-9, 1e-1
    model = None
    for _ in range(60):
        slope = (lo * hi) ** 0.5
        n = np.arange(0, 2049, 32)
        model = ConvexCostModel.fit({0: (n, 0.02 + slope * n)}, draft_cost)
        size = len(build_caddtree(probe, model, 0, max_budget=1024))
        if size > target_n:
            lo = slope
        elif size < target_n:
            hi = slope
        else:
            break
    return model


def alternating_medians(fns: dict, repeats: int) -> dict[str, float]:
    """Median microseconds of each function, timed in turn ``repeats`` times after a warm-up."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    names = list(fns)
    for r in range(repeats):
        # rotate the order: what runs right after a multi-threaded op pays for its idle
        # helper threads still spinning, so no function may always come first or last
        for name in names[r % len(names) :] + names[: r % len(names)]:
            fn = fns[name]
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(v) * 1e6 for name, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--depth", type=int, default=15)
    ap.add_argument("--repeats", type=int, default=100)
    args = ap.parse_args()
    logits = synthetic_logits(args.depth, args.vocab)
    print(
        f"logits [{args.depth}, {args.vocab}] float32, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, median of {args.repeats}"
    )
    print(
        f"{'budget':>6} {'topk1024 us':>12} {'ddtree us':>10} {'caddtree us':>12} {'n*':>5} "
        f"{'caddtree/topk1024':>18}"
    )
    k = min(1024, args.vocab)
    for budget in (16, 32, 64, 128, 200, 256, 512, 1024):
        model = cost_model_for(budget, 0.005, logits)
        n_star = len(build_caddtree(logits, model, 0))
        t = alternating_medians(
            {
                "topk": lambda: torch.topk(logits, k, dim=-1),
                "ddtree": lambda b=budget: build_ddtree(logits, b),
                "caddtree": lambda m=model: build_caddtree(logits, m, 0),
            },
            args.repeats,
        )
        print(
            f"{budget:>6} {t['topk']:>12.0f} {t['ddtree']:>10.0f} {t['caddtree']:>12.0f} "
            f"{n_star:>5} {t['caddtree'] / t['topk']:>18.2f}"
        )


if __name__ == "__main__":
    main()
