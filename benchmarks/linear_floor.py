"""How much of one token's forward is the linear layers: the floor the rest of the forward sits on.

    python benchmarks/linear_floor.py [--dtype bfloat16] [--context 300] [--repeats 9]

Loads the built-in target on the lean runtime (:mod:`caddtree.runtime.lean`) and times, in
alternating order after a warm-up, each ``--repeats`` times:

* ``linears``: one token's linear calls alone, as the forward makes them: every decoder layer's
  fused q/k/v, o, fused gate/up and down (the runtime's own packed weights), then the LM head,
  each on one row. The weights stream from memory as in a real forward (about 270 MB in
  bfloat16 for the built-in target, more than the caches hold), so this is the memory floor the
  kernels reach, not a cache-warm figure;
* ``forward``: the whole one-row forward after a ``--context``-token prefill (``verify`` of a
  lone bonus token and an empty ``commit``), everything included.

It prints both medians in ms, the weights' GB/s for the linears, and what the forward spends
besides them (norms, rotary, attention, the KV cache, Python).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from caddtree.arguments import load_pair
from caddtree.core.tree import DraftTree


def one_token_linears(target, hidden: int, inner: int) -> Callable[[], None]:
    """A callable that runs every linear call of one token's forward on one row."""
    x = torch.randn(1, hidden).to(target.dtype)
    h = torch.randn(1, inner).to(target.dtype)
    layers, head = target.layers, target.model.lm_head

    def run() -> None:
        for layer in layers:
            layer.qkv(x)
            layer.o(x)
            layer.gate_up(x)
            layer.down(h)
        head(x)

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--context", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    gen = load_pair(None, None, dtype=args.dtype, with_drafter=False, runtime="lean")
    verifier, config = gen.verifier, gen.target.config
    target = verifier.target
    linears = one_token_linears(target, config.hidden_size, config.intermediate_size)
    verifier.reset(reserve=args.context + 8)
    verifier.prefill(list(range(100, 100 + args.context)))

    def forward() -> None:
        verifier.verify(5, DraftTree.empty())
        verifier.discard()

    times: dict[str, list[float]] = {"linears": [], "forward": []}
    steps = {"linears": linears, "forward": forward}
    for repeat in range(args.repeats + 1):
        order = list(steps) if repeat % 2 == 0 else list(reversed(steps))
        for name in order:
            start = time.perf_counter()
            for _ in range(10):
                steps[name]()
            if repeat:  # the first pass warms up
                times[name].append((time.perf_counter() - start) / 10)
    weights = (
        sum(
            p.numel() * p.element_size()
            for layer in gen.target.model.layers
            for p in layer.parameters()
            if p.dim() == 2
        )
        + gen.target.lm_head.weight.numel() * gen.target.lm_head.weight.element_size()
    )
    lin, fwd = (statistics.median(times[k]) for k in ("linears", "forward"))
    print(f"runtime lean, {args.dtype}, {torch.get_num_threads()} threads, context {args.context}")
    print(f"  linears alone  {lin * 1e3:6.2f} ms  ({weights / lin / 1e9:.1f} GB/s of weights)")
    print(f"  whole forward  {fwd * 1e3:6.2f} ms")
    print(f"  the rest       {(fwd - lin) * 1e3:6.2f} ms  ({(fwd - lin) / fwd:.0%} of the forward)")


if __name__ == "__main__":
    main()
