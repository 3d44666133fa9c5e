"""The built-in pair with and without its linear weights packed for oneDNN, side by side.

    python benchmarks/packed_linear.py [--dtype bfloat16] [--context 256] [--nodes 0 8 16 32]
                                       [--trials 15] [--prompts 3] [--max-new-tokens 64]

One process, one copy of each model: packing is switched on and off between measurements
(:func:`caddtree.runtime.packing.pack_linear_layers` / ``unpack_linear_layers``), the two orders
alternating, after an untimed warm-up of each and one untimed forward after each switch. Prints medians of

* the target's verification forward (``TreeVerifier.verify`` and an empty ``commit``) after a
  ``--context``-token prefill, for each ``--nodes`` tree size (0: plain decoding's one-token step);
* whole generations (ms per new token) of ``--prompts`` chat prompts with plain decoding (AR) and
  CaDDTree (the cached cost model, profiled once if missing, as ``caddtree generate`` does);

and each one's packed / plain time ratio. The outputs of both settings are compared as well.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from caddtree.api import SpeculativeGenerator
from caddtree.core.profiling import profiling_tree
from caddtree.core.tree import DraftTree
from caddtree.runtime.packing import pack_linear_layers, unpack_linear_layers
from caddtree.util.defaults import resolve_model_pair
from chat_prompts import PROMPTS as ALL_PROMPTS

PROMPTS = ALL_PROMPTS[:4]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--nodes", type=int, nargs="+", default=[0, 8, 16, 32])
    parser.add_argument("--trials", type=int, default=15)
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    args = parser.parse_args()

    target, draft, dtype = resolve_model_pair(None, None, args.dtype)
    gen = SpeculativeGenerator.from_pretrained(target, draft, dtype=dtype, device="cpu")
    modules = (gen.target, gen.drafter, gen.proposer.lm_head)
    cost = gen.cached_cost_model()  # profiled with packing on, as decoding runs by default
    print(
        f"built-in pair, {dtype}, torch {torch.__version__}, {torch.get_num_threads()} threads; "
        f"{gen.packed_layers} linear layers packed"
    )

    def setting(packed: bool) -> None:
        if packed:
            pack_linear_layers(*modules)
        else:
            unpack_linear_layers(*modules)

    v = gen.verifier
    vocab = gen.target.config.vocab_size
    trees = {n: profiling_tree(n, 15, vocab) if n else DraftTree.empty() for n in args.nodes}
    v.reset(reserve=args.context + 64)
    v.prefill(torch.randint(0, vocab, (args.context,), generator=torch.Generator().manual_seed(0)))

    def forward(n: int) -> float:
        t = time.perf_counter()
        v.verify(5, trees[n])
        v.discard()
        return time.perf_counter() - t

    times: dict[tuple[bool, int], list[float]] = {}
    for packed in (True, False):
        setting(packed)
        for n in args.nodes:
            forward(n), forward(n)
    for trial in range(args.trials):
        for packed in (True, False) if trial % 2 else (False, True):
            setting(packed)
            forward(args.nodes[0])  # untimed: the first forward after a switch runs slow
            for n in args.nodes:
                times.setdefault((packed, n), []).append(forward(n))
    print(f"\ntarget forward after {args.context} tokens, median of {args.trials} (ms)")
    print(f"  {'nodes':>5} {'plain':>8} {'packed':>8} {'ratio':>6}")
    for n in args.nodes:
        plain, packed = (1e3 * statistics.median(times[p, n]) for p in (False, True))
        print(f"  {n:>5} {plain:>8.1f} {packed:>8.1f} {packed / plain:>6.2f}")

    kwargs = {"max_new_tokens": args.max_new_tokens, "chat": True, "cost_model": cost}
    runs: dict[tuple[bool, str], list[float]] = {}
    outputs: dict[tuple[bool, str, int], list[int]] = {}
    for packed in (True, False):
        setting(packed)
        gen.generate(PROMPTS[0], "caddtree", **{**kwargs, "max_new_tokens": 16})
    for i, prompt in enumerate(PROMPTS[: args.prompts]):
        for packed in (True, False) if i % 2 else (False, True):
            setting(packed)
            for method in ("ar", "caddtree"):
                result = gen.generate(prompt, method, **kwargs)
                runs.setdefault((packed, method), []).append(result.stats.ms_per_token)
                outputs[packed, method, i] = result.token_ids
    print(f"\ngenerations, {args.prompts} prompts x {args.max_new_tokens} tokens, median ms/token")
    print(f"  {'method':<9} {'plain':>8} {'packed':>8} {'ratio':>6}")
    for method in ("ar", "caddtree"):
        plain, packed = (statistics.median(runs[p, method]) for p in (False, True))
        print(f"  {method:<9} {plain:>8.1f} {packed:>8.1f} {packed / plain:>6.2f}")
    for packed in (False, True):
        ar, cad = (statistics.median(runs[packed, m]) for m in ("ar", "caddtree"))
        print(f"  CaDDTree vs AR, {'packed' if packed else 'plain'}: {ar / cad:.2f}x")
    same = sum(
        outputs[True, m, i] == outputs[False, m, i]
        for m in ("ar", "caddtree")
        for i in range(args.prompts)
    )
    print(f"  outputs identical packed and plain: {same} of {2 * args.prompts}")


if __name__ == "__main__":
    main()
