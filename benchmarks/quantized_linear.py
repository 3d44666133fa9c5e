"""The built-in target's linear layers on its own GGUF blocks beside the same weights in bfloat16.

    python benchmarks/quantized_linear.py [--rows 1 2 4 8 16 32 64] [--repeats 15] [--threads 2]
                                          [--gguf FILE]

A forward runs 120 fused linear layers (q/k/v, o, gate/up and down of each decoder layer, as the
lean runtime fuses them) and the LM head. This script loads the target twice, as
``caddtree generate`` does: on the file's quantized blocks (the built-in Q4_1 file, Q8_0 head; or
``--gguf FILE``) and de-quantized to bfloat16 (``--dequantize``, caddtree's bfloat16 kernel),
and runs all 121 calls in layer order on random rows through each, alternating which goes first,
after a warm-up. It prints, per row count, the median milliseconds of the 121 calls, their ratio
(below 1: the blocks are faster) and the bytes each read per second, and checks that a row gets
the same bits alone and among the others.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from caddtree.api import SpeculativeGenerator
from caddtree.util.defaults import resolve_model_pair
from caddtree.util.devices import machine_description


def linears(gguf: str | None, dequantize: bool) -> tuple[str, list]:
    """(weight format, the 121 linear layers in forward order) of the target on ``gguf``."""
    target, _, dtype = resolve_model_pair(gguf, None, "bfloat16")
    gen = SpeculativeGenerator.from_pretrained(
        target, None, dtype=dtype, device="cpu", runtime="lean", dequantize=dequantize
    )
    lean = gen.verifier.target
    calls = [f for layer in lean.layers for f in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    head = lean.head if lean.head is not None else gen.target.lm_head
    return gen.weight_format, [*calls, head]


def in_features(linear) -> int:
    packed = getattr(linear, "packed", None)
    if packed is None:  # the model's own (packed) LM head
        return linear.in_features
    return packed.shape[1] * 32 if packed.dim() == 3 else packed.shape[1] * 2


def weight_bytes(linear) -> int:
    packed = getattr(linear, "packed", None)
    tensor = packed if packed is not None else linear.weight
    return tensor.numel() * tensor.element_size()


def timed(calls: list, xs: list[torch.Tensor]) -> float:
    start = time.perf_counter()
    for call, x in zip(calls, xs):
        call(x)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--gguf", help="a GGUF file (default: the built-in target's)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    sides = dict([linears(args.gguf, False), linears(args.gguf, True)])
    names = list(sides)
    gigabytes = {name: sum(map(weight_bytes, calls)) / 1e9 for name, calls in sides.items()}
    print(machine_description(torch.device("cpu")), f"{args.threads} threads")
    print("weights read per forward: " + ", ".join(f"{n} {g:.3f} GB" for n, g in gigabytes.items()))
    print(f"{'rows':>5} " + " ".join(f"{n + ' ms':>16} {'GB/s':>7}" for n in names) + "  ratio")
    for rows in args.rows:
        xs = [torch.randn(rows, in_features(c)).bfloat16() for c in sides[names[0]]]
        for name in names:  # warm-up, and a row's bits alone equal its bits among the others
            together = [call(x) for call, x in zip(sides[name], xs)]
            alone = [call(x[-1:]) for call, x in zip(sides[name], xs)]
            assert all(torch.equal(a, t[-1:]) for a, t in zip(alone, together)), name
        times: dict[str, list[float]] = {name: [] for name in names}
        for k in range(args.repeats):
            for name in names if k % 2 == 0 else names[::-1]:
                times[name].append(timed(sides[name], xs))
        ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
        cells = " ".join(f"{ms[n]:>16.2f} {gigabytes[n] / ms[n] * 1e3:>7.1f}" for n in names)
        print(f"{rows:>5} {cells}  {ms[names[0]] / ms[names[1]]:.2f}")


if __name__ == "__main__":
    main()
