"""``caddtree tree-demo``: chain, DDTree and CaDDTree trees on synthetic drafter marginals (numpy
only: no torch, no model)."""

from __future__ import annotations

import argparse

from ..util.errors import InvalidInputError

# `tree-demo` bounds: a block of B positions over V tokens is a [B-1, V] float64 array per round.
DEMO_MAX_BLOCK_SIZE = 64
DEMO_MAX_VOCAB = 2**18


def tree_demo(args: argparse.Namespace) -> int:
    """Build chain, DDTree and CaDDTree trees from synthetic drafter marginals and compare them."""
    import numpy as np

    from ..core.cost import ConvexCostModel
    from ..core.tree import build_caddtree, build_chain, build_ddtree, topk_log_probs

    B, V = args.block_size, args.vocab
    if not 2 <= B <= DEMO_MAX_BLOCK_SIZE:
        raise InvalidInputError(
            f"--block-size must be between 2 and {DEMO_MAX_BLOCK_SIZE} (the bonus token and at "
            f"least one drafted position), got {B}"
        )
    if not 4 * (B - 1) <= V <= DEMO_MAX_VOCAB:
        raise InvalidInputError(
            f"--vocab must be between {4 * (B - 1)} (the demo plants 4 likely tokens, distinct "
            f"across the block's {B - 1} drafted positions) and {DEMO_MAX_VOCAB}, got {V}"
        )
    if args.rounds < 0 or args.seed < 0:
        raise InvalidInputError(
            f"--rounds and --seed must be non-negative integers, got {args.rounds} and {args.seed}"
        )
    rng = np.random.default_rng(args.seed)
    L = B - 1
    # A synthetic verification cost: flat up to 16 nodes, then 0.5 ms per node, growing with
    # context length (an illustration, not a measurement).
    n = np.arange(0, 1025, 8)
    measurements = {
        length: (
            n,
            0.030 + 0.004 * length / 1024 + 0.0005 * np.maximum(n - 16, 0) * (1 + length / 4096),
        )
        for length in (0, 1024, 2048, 4096)
    }
    cost = ConvexCostModel.fit(measurements, draft_cost=0.012, metadata={"synthetic": True})
    print("Synthetic verification-cost fit (seconds in, ms shown):")
    print(cost.fit_report())
    print()
    header = f"{'round':>5} {'confidence':>10} {'context':>7} | {'chain phi':>9} | {'DDTree-64 phi':>13} | {'CaDDTree n*':>11} {'phi':>6} {'theta* gain':>11}"
    print(header)
    print("-" * len(header))
    for r in range(args.rounds):
        sharpness = rng.uniform(8.0, 20.0)  # low = an uncertain drafter, high = a confident one
        logits = rng.normal(0, 1, (L, V))
        # four plausible tokens per position, the drafter growing less sure with depth
        boost = np.sort(rng.uniform(0.75, 1.0, (L, 4)), axis=1)[:, ::-1]
        boost *= sharpness * np.linspace(1.0, 0.6, L)[:, None]
        logits[np.arange(L)[:, None], rng.choice(V, (L, 4), replace=False)] += boost
        context = int(rng.integers(0, 4096))
        topk = topk_log_probs(logits, 1024)
        chain = build_chain(logits)
        dd = build_ddtree(topk, 64)
        ca = build_caddtree(topk, cost, context)
        table = cost.round_cost_table(context, max(len(ca), 64))
        gain = ((1 + ca.phi) / table[len(ca)]) / ((1 + dd.phi) / table[64])
        confidence = float(np.exp(topk.log_probs[0, 0]))
        print(
            f"{r:>5} {confidence:>10.3f} {context:>7} | {chain.phi:>9.3f} | {dd.phi:>13.3f} | "
            f"{len(ca):>11} {ca.phi:>6.2f} {gain:>10.2f}x"
        )
    print()
    print("CaDDTree picks n* per round to maximise (1 + phi(n)) / (C_d + C_v(n; l));")
    print("'theta* gain' is its surrogate throughput over a fixed 64-node DDTree.")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add this sub-command's parser to ``sub``."""
    p = sub.add_parser(
        "tree-demo",
        help="compare chain, DDTree and CaDDTree trees on synthetic drafter marginals",
        description=tree_demo.__doc__,
    )
    p.add_argument("--rounds", type=int, default=8, help="number of synthetic rounds (default 8)")
    p.add_argument("--block-size", type=int, default=16, help="drafter block size B (default 16)")
    p.add_argument("--vocab", type=int, default=32000, help="vocabulary size (default 32000)")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(handler=tree_demo)
