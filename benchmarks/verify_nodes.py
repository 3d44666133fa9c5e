"""What a verification forward costs by tree size, in steady calls and right after a large tree.

    python benchmarks/verify_nodes.py [--nodes 0 3 4 5 7] [--context 200] [--calls 25]
                                      [--rounds 4] [--after 128] [--dtype bfloat16]

Loads the built-in pair as the CLI does (its target on its GGUF blocks where it has them), fills
the cache with ``--context`` tokens, and times ``verify`` + ``discard`` of trees of ``--nodes``
nodes (the profile's trees, :func:`caddtree.core.profiling.profiling_tree`): each size ``--calls``
times in a row after 5 untimed calls, the sizes in alternating order for ``--rounds`` rounds. It
prints, per size, the median milliseconds of a steady call and its excess over a one-row forward
(0 nodes), the figure a change to the kernels should be judged by when machine noise moves whole
runs. With ``--after N`` it also times each size right after one call of an ``N``-node tree, as
``caddtree profile`` times its points, one after another size. Compare code versions by running
this in alternating processes (``PYTHONPATH=<a worktree>/src python benchmarks/verify_nodes.py``).
"""

from __future__ import annotations

import argparse
import statistics
import time

from caddtree.arguments import load_pair
from caddtree.core.profiling import profiling_tree
from caddtree.core.tree import DraftTree


def timed(verifier, tree: DraftTree) -> float:
    """Milliseconds of one verification of ``tree`` and its discard."""
    began = time.perf_counter()
    verifier.verify(5, tree)
    verifier.discard()
    return 1e3 * (time.perf_counter() - began)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[0, 3, 4, 5, 7])
    parser.add_argument("--context", type=int, default=200)
    parser.add_argument("--calls", type=int, default=25)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--after", type=int, default=0)
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    gen = load_pair(None, None, dtype=args.dtype, method="ar")
    verifier = gen.verifier
    verifier.reset(reserve=args.context + max(args.nodes + [args.after]) + 8)
    verifier.prefill(list(range(1000, 1000 + args.context)))
    vocab = gen.tokenizer.vocab_size
    sizes = sorted(set([0, *args.nodes]))
    trees = {n: profiling_tree(n, min(n, 8), vocab) if n else DraftTree.empty() for n in sizes}
    large = profiling_tree(args.after, min(args.after, 8), vocab) if args.after else None
    steady: dict[int, list[float]] = {n: [] for n in sizes}
    after: dict[int, list[float]] = {n: [] for n in sizes}
    for r in range(args.rounds):
        for n in sizes if r % 2 == 0 else sizes[::-1]:
            for _ in range(5):
                timed(verifier, trees[n])
            steady[n] += [timed(verifier, trees[n]) for _ in range(args.calls)]
            for _ in range(args.calls if large is not None else 0):
                timed(verifier, large)
                after[n].append(timed(verifier, trees[n]))
    base = statistics.median(steady[0])
    print(f"context {args.context}, {gen.verifier.dtype}; ms per call (median)")
    header = "| nodes | steady | over one row |" + (f" after {args.after} nodes |" if large else "")
    print(header + "\n|--:|--:|--:|" + ("--:|" if large else ""))
    for n in sizes:
        ms = statistics.median(steady[n])
        line = f"| {n} | {ms:.2f} | {ms - base:.2f} |"
        print(line + (f" {statistics.median(after[n]):.2f} |" if large else ""))


if __name__ == "__main__":
    main()
