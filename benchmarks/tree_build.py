"""Host time of draft-tree construction, separately from the vocabulary-wide top-k.

    python benchmarks/tree_build.py [--vocab 151936] [--depth 15] [--repeats 200]

For each budget it prints the median microseconds of:

* ``topk``     - log-softmax + top-k over the vocabulary (torch, on the CPU here);
* ``ddtree``   - ``build_ddtree`` from the precomputed top-k (the best-first expansion);
* ``caddtree`` - ``build_caddtree`` from the precomputed top-k, with a cost model whose optimum
  lands near that budget (the printed ``n*`` is the size it chose).

The logits are synthetic: a drafter-like mix of confident and uncertain positions.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from caddtree import ConvexCostModel, build_caddtree, build_ddtree, topk_log_probs


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


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--depth", type=int, default=15)
    ap.add_argument("--repeats", type=int, default=200)
    args = ap.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    logits = synthetic_logits(args.depth, args.vocab)
    print(
        f"logits [{args.depth}, {args.vocab}] float32, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, median of {args.repeats}"
    )
    print(f"{'budget':>6} {'topk us':>9} {'ddtree us':>10} {'caddtree us':>12} {'n*':>5}")
    for budget in (16, 32, 64, 128, 256, 512, 1024):
        t_topk = median_us(lambda b=budget: topk_log_probs(logits, b), max(20, args.repeats // 10))
        topk = topk_log_probs(logits, budget)
        t_dd = median_us(lambda b=budget, t=topk: build_ddtree(t, b), args.repeats)
        full = topk_log_probs(logits, 1024)
        model = cost_model_for(budget, 0.005, full)
        n_star = len(build_caddtree(full, model, 0))
        t_ca = median_us(lambda m=model, t=full: build_caddtree(t, m, 0), args.repeats)
        print(f"{budget:>6} {t_topk:>9.0f} {t_dd:>10.1f} {t_ca:>12.1f} {n_star:>5}")


if __name__ == "__main__":
    main()
