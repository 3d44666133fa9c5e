"""What copies from the context add to a round's host time (``--lookup``), at a long prompt.

    python benchmarks/copy_index.py [--tokens 8192] [--vocab 49152] [--repeats 50]

Prints the median microseconds of:

* ``index``    - ``ContextIndex(prompt)``: the first round's index over the whole prompt (later
  rounds only add their committed tokens);
* ``extend``   - adding one round's 4 committed tokens to that index;
* ``trie``     - the round's lookup: the longest recurring suffix, its continuations, the trie;
* ``caddtree`` / ``caddtree+copies`` - the round's CaDDTree tree from synthetic draft logits
  alone, and merged with the trie (:func:`caddtree.engine.policies.build_tree`);

and the first round's overhead: ``index + trie + (caddtree+copies - caddtree)``, which the issue
"Free drafts in the tree" bounds at 5 ms for a prompt at the built-in target's context limit.
The prompt repeats passages (as code and documents do): 40% of it copies an earlier span. Each
item is timed in alternation with the others, in an order rotated every repetition.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from caddtree import ConvexCostModel
from caddtree.core.copies import ContextIndex, CopyRates, copy_trie
from caddtree.engine.policies import build_tree, make_policy
from caddtree.models.drafts import DraftLogits


def repetitive_prompt(tokens: int, vocab: int, seed: int = 0) -> list[int]:
    """Random text in which 40% of the tokens copy an earlier span of 8-64 tokens, ending in
    one (so the round's lookup finds something)."""
    rng = np.random.default_rng(seed)
    out: list[int] = []
    while len(out) < tokens:
        if len(out) > 64 and rng.random() < 0.4:
            span = int(rng.integers(8, 65))
            start = int(rng.integers(0, len(out) - span))
            out.extend(out[start : start + span])
        else:
            out.extend(rng.integers(0, vocab, int(rng.integers(4, 32))).tolist())
    return out[: tokens - 16] + out[100:116]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--depth", type=int, default=15)
    ap.add_argument("--repeats", type=int, default=50)
    args = ap.parse_args()

    prompt = repetitive_prompt(args.tokens, args.vocab)
    logits = torch.randn(args.depth, args.vocab, generator=torch.Generator().manual_seed(1)) * 2
    n = np.arange(0, 1025, 32)
    cost = ConvexCostModel.fit({0: (n, 0.02 + 2e-4 * n)}, 0.004)
    policy = make_policy("caddtree", cost_model=cost, max_budget=256, lookup=True)
    rates = CopyRates()
    index = ContextIndex(prompt)
    trie = copy_trie(index, rates, args.depth)
    assert trie is not None, "the prompt's end must recur for the benchmark to measure a lookup"

    items = {
        "index": lambda: ContextIndex(prompt),
        "extend": None,
        "trie": lambda: copy_trie(index, rates, args.depth),
        "caddtree": lambda: build_tree(policy, DraftLogits.precomputed(logits), args.tokens),
        "caddtree+copies": lambda: build_tree(
            policy, DraftLogits.precomputed(logits), args.tokens, trie
        ),
    }
    times: dict[str, list[float]] = {name: [] for name in items}
    for rep in range(args.repeats + 1):
        names = list(items)
        names = names[rep % len(names) :] + names[: rep % len(names)]
        for name in names:
            if name == "extend":
                big = ContextIndex(prompt[: args.tokens - 4])
                t0 = time.perf_counter()
                big.extend(prompt[-4:])
            else:
                t0 = time.perf_counter()
                items[name]()
            if rep:  # the first pass warms up
                times[name].append(time.perf_counter() - t0)
    med = {name: statistics.median(t) * 1e6 for name, t in times.items()}
    for name, us in med.items():
        print(f"{name:>16}: {us:9.1f} us")
    first = med["index"] + med["trie"] + med["caddtree+copies"] - med["caddtree"]
    print(f"first round's overhead at {args.tokens} tokens: {first / 1e3:.2f} ms")
    merged = len(items["caddtree+copies"]())
    print(
        f"trie: a match of {trie.match} tokens, {len(trie)} nodes; merged tree {merged} nodes "
        f"(the drafter's alone {len(items['caddtree']())}); index {index._keys.nbytes} B of hashes"
    )


if __name__ == "__main__":
    main()
