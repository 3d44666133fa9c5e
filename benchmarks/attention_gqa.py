"""Tree verification with transformers' SDPA attention vs caddtree's grouped-query SDPA.

    python benchmarks/attention_gqa.py [--contexts 200 2000 6000] [--budget 16] [--single-query]
                                       [--repeats 6] [--calls 5] [--dtype bfloat16]

On the CPU, :meth:`caddtree.SpeculativeGenerator.from_pretrained` loads a target with
``caddtree_sdpa`` (:mod:`caddtree.models.attention`): SDPA that reads grouped-query key/value heads
in place under a tree mask, where transformers' ``sdpa`` first copies them once per query head
group (``repeat_kv``). This script loads the built-in target (SmolLM2-135M-Instruct: 9 query heads
over 3 key/value heads) and, for each context length, prefills that many random tokens and times
one verification of a fixed DDTree of ``--budget`` nodes (the KV cache is cut back after each, so
every call sees the same context). Both implementations run in one process on the same model,
switched between calls, in alternating order, ``--repeats`` times ``--calls`` calls each; it
prints the median milliseconds of each, their ratio, and whether the verification's logits were
identical (they must be: the two compute the same attention).

``--single-query`` times plain decoding's step instead: the target forward over one token (a
round that verifies only the bonus token), where caddtree_sdpa stacks the query heads that share a
key/value head into one flash call and transformers' SDPA runs the kernel with ``enable_gqa``. The
two may round differently in bfloat16 (the same float32 softmax, summed in another order), so the
logits column then says how far apart they are.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from caddtree.api import SpeculativeGenerator
from caddtree.core.tree import DraftTree
from caddtree.models.attention import GQA_SDPA
from caddtree.util.defaults import resolve_model_pair
from long_generation import branching_tree, prefill_context  # this folder's memory benchmark

IMPLEMENTATIONS = ("sdpa", GQA_SDPA)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[200, 2000, 6000])
    parser.add_argument("--budget", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument(
        "--single-query",
        action="store_true",
        help="time a one-token forward (plain decoding's step) instead of a tree verification",
    )
    args = parser.parse_args()

    target, draft, dtype = resolve_model_pair(None, None, args.dtype)
    gen = SpeculativeGenerator.from_pretrained(target, draft, dtype=dtype, device="cpu")
    verifier, model = gen.verifier, gen.target
    rng = np.random.default_rng(0)
    vocab = model.config.vocab_size
    tree = DraftTree.empty() if args.single_query else branching_tree(rng, vocab, args.budget)
    print(
        f"{model.config.num_attention_heads} query heads over "
        f"{model.config.num_key_value_heads} key/value heads; the bonus token and a tree of "
        f"{len(tree)} nodes, "
        f"{args.dtype}, {torch.get_num_threads()} threads"
    )
    print(f"{'context':>8} {'sdpa ms':>9} {GQA_SDPA + ' ms':>18} {'speed-up':>9}  logits")
    for length in args.contexts:
        ids = rng.integers(100, vocab - 100, length).tolist()
        times: dict[str, list[float]] = {name: [] for name in IMPLEMENTATIONS}
        logits: dict[str, torch.Tensor] = {}
        for rep in range(args.repeats + 1):  # the first repeat warms up and is not counted
            order = IMPLEMENTATIONS if rep % 2 == 0 else IMPLEMENTATIONS[::-1]
            for name in order:
                model.set_attn_implementation(name)
                prefill_context(gen, ids, args.budget + 1)
                calls = []
                for _ in range(args.calls):
                    t0 = time.perf_counter()
                    out, _ = verifier.verify(5, tree)
                    calls.append(time.perf_counter() - t0)
                    verifier.discard()  # discard: the next call verifies the same context
                logits[name] = out.float()
                if rep:
                    times[name].append(1e3 * statistics.median(calls))
        a, b = (statistics.median(times[name]) for name in IMPLEMENTATIONS)
        same = torch.equal(logits["sdpa"], logits[GQA_SDPA])
        diff = float((logits["sdpa"] - logits[GQA_SDPA]).abs().max())
        print(
            f"{length:>8} {a:>9.1f} {b:>18.1f} {a / b:>8.2f}x  "
            f"{'identical' if same else f'differ (max {diff:.3g})'}"
        )
    model.set_attn_implementation(GQA_SDPA)


if __name__ == "__main__":
    main()
