"""What one more row costs the target's linear layers on this CPU: why trees pay less on some CPUs.

    python benchmarks/linear_rows.py [--rows 1 5 9 17 33] [--dtype bfloat16] [--repeats 7]
                                     [--calls 100]

A round of tree verification runs the target's forward over the bonus token and the tree's
nodes, one row each; plain decoding runs it over one row. How much each extra row costs decides
how large a tree can pay (CaDDTree's cost model measures it for the whole forward; `caddtree
profile`). Most of that growth is the linear layers, and what a row costs them differs a lot
between CPUs of the same core count (docs/results/default-pair/README.md compares two).

This script loads the built-in target (as decoding does: in ``--dtype``, linear weights packed for
oneDNN, :mod:`caddtree.runtime.packing`) and times the seven linear layers of its first decoder
layer (q, k, v, o, gate, up, down) on ``--rows`` rows, with each layer's weight packed and plain,
in alternating order, ``--repeats`` times ``--calls`` calls each. It prints the median
microseconds of one decoder layer's seven calls, per row count, the ratio to one row, and what
the target's whole stack of layers spends in them per forward. It also times the same work with
q/k/v as one layer and gate/up as one (their weights stacked), which is what fusing those
projections would save (the engine does not fuse them).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from caddtree.api import SpeculativeGenerator
from caddtree.runtime.packing import pack_linear_layers, unpack_linear_layers
from caddtree.util.defaults import resolve_model_pair

NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _stacked(*layers: nn.Linear) -> nn.Linear:
    """One linear layer whose weight is ``layers``' weights stacked (their outputs side by side)."""
    weight = torch.cat([layer.weight.detach() for layer in layers])
    out = nn.Linear(weight.shape[1], weight.shape[0], bias=False, dtype=weight.dtype)
    with torch.no_grad():
        out.weight.copy_(weight)
    return out


def _time(fn, calls: int, *args) -> float:
    """Microseconds per call of ``fn(*args)``, over ``calls`` calls."""
    t0 = time.perf_counter()
    for _ in range(calls):
        fn(*args)
    return 1e6 * (time.perf_counter() - t0) / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 5, 9, 17, 33])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--calls", type=int, default=100)
    args = parser.parse_args()
    if min(args.rows) < 1 or args.repeats < 1 or args.calls < 1:
        parser.error("--rows, --repeats and --calls must be positive")

    target, draft, dtype = resolve_model_pair(None, None, args.dtype)
    gen = SpeculativeGenerator.from_pretrained(target, draft, dtype=dtype, device="cpu")
    model = gen.target
    dtype = model.dtype  # resolve_model_pair may give the dtype's name
    layer = model.model.layers[0]
    mods = {
        name: getattr(layer.self_attn, name, None) or getattr(layer.mlp, name) for name in NAMES
    }
    qkv = _stacked(mods["q_proj"], mods["k_proj"], mods["v_proj"])
    gate_up = _stacked(mods["gate_proj"], mods["up_proj"])
    width = mods["q_proj"].in_features
    inner = mods["down_proj"].in_features
    n_layers = len(model.model.layers)
    print(
        f"target: {n_layers} decoder layers, hidden {width}, MLP {inner}, {dtype}, "
        f"{torch.get_num_threads()} threads; median of {args.repeats} x {args.calls} calls"
    )

    def separate(x, h):
        for name in NAMES[:4]:
            mods[name](x)
        mods["gate_proj"](x)
        mods["up_proj"](x)
        mods["down_proj"](h)

    def fused(x, h):
        qkv(x)
        mods["o_proj"](x)
        gate_up(x)
        mods["down_proj"](h)

    all_layers = [*mods.values(), qkv, gate_up]
    variants = {  # name: (weights packed?, the calls of one decoder layer)
        "packed": (True, separate),
        "plain": (False, separate),
        "packed, q/k/v and gate/up fused": (True, fused),
    }
    order = list(variants)
    results: dict[tuple[str, int], list[float]] = {}
    with torch.inference_mode():
        for rows in args.rows:
            x = torch.randn(1, rows, width, dtype=dtype)
            h = torch.randn(1, rows, inner, dtype=dtype)
            for r in range(args.repeats):
                for name in order if r % 2 == 0 else order[::-1]:
                    packed, fn = variants[name]
                    (pack_linear_layers if packed else unpack_linear_layers)(*all_layers)
                    for _ in range(5):  # untimed after each switch
                        fn(x, h)
                    results.setdefault((name, rows), []).append(_time(fn, args.calls, x, h))
        pack_linear_layers(*all_layers)

    base_rows = args.rows[0]
    for name in order:
        base = statistics.median(results[(name, base_rows)])
        print(f"\n{name}: one decoder layer's linear calls")
        print(f"{'rows':>6} {'us/layer':>9} {'x ' + str(base_rows) + ' row':>9} {'ms/forward':>11}")
        for rows in args.rows:
            us = statistics.median(results[(name, rows)])
            print(f"{rows:>6} {us:>9.0f} {us / base:>9.2f} {us * n_layers / 1e3:>11.1f}")


if __name__ == "__main__":
    main()
