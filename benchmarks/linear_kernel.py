"""caddtree's bfloat16 linear kernel beside oneDNN's packed linear, on the built-in target's layers.

    python benchmarks/linear_kernel.py [--rows 1 2 4 8 16 32 64] [--repeats 15] [--threads 2]

A forward of the target runs its 120 fused linear layers (q/k/v, o, gate/up and down of each of
the 30 decoder layers, as the lean runtime fuses them) and the LM head on a few rows; their
weights (269 MB in bfloat16) do not fit in the CPU's caches, so each call reads its weight from
memory, as here: the script runs all 121 calls in layer order, through caddtree's kernel
(:mod:`caddtree.models.kernels`) and through oneDNN (:mod:`caddtree.models.packing`), the two
alternating and taking turns going first, after a warm-up of each. It prints, per row count, the
median milliseconds of the 121 calls for each, their ratio (below 1: the kernel is faster) and
the bandwidth the kernel reached, and checks that both compute the same products (within
bfloat16 rounding) and that the kernel gives a row the same bits alone or among others.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from caddtree.api import SpeculativeGenerator
from caddtree.models import kernels
from caddtree.models.packing import _pack
from caddtree.util.defaults import resolve_model_pair
from caddtree.util.devices import machine_description


def target_weights() -> list[torch.Tensor]:
    """The built-in target's fused linear weights in forward order, then its LM head."""
    target, draft, dtype = resolve_model_pair(None, None, "bfloat16")
    gen = SpeculativeGenerator.from_pretrained(
        target, draft, dtype=dtype, device="cpu", runtime="transformers", pack_weights=False
    )
    out = []
    for layer in gen.target.model.layers:
        attention, mlp = layer.self_attn, layer.mlp
        for group in (
            (attention.q_proj, attention.k_proj, attention.v_proj),
            (attention.o_proj,),
            (mlp.gate_proj, mlp.up_proj),
            (mlp.down_proj,),
        ):
            out.append(torch.cat([linear.weight.detach() for linear in group]))
    out.append(gen.target.lm_head.weight.detach())
    return out


def check(weight: torch.Tensor, ours: torch.Tensor, onednn: torch.Tensor) -> None:
    x = torch.randn(9, weight.shape[1]).bfloat16()
    mine = kernels.rows_linear(x, ours)
    theirs = torch.ops.mkldnn._linear_pointwise(x, onednn, None, "none", [], "")
    exact = torch.nn.functional.linear(x.double(), weight.double())
    scale = exact.abs().clamp(min=1.0)
    assert ((mine.double() - exact).abs() / scale).max() < 1e-2
    assert ((theirs.double() - exact).abs() / scale).max() < 1e-2
    assert torch.equal(kernels.rows_linear(x[4:5], ours), mine[4:5])


def timed(calls: list, repeats: int) -> dict[str, float]:
    """Median seconds of each side's whole pass, alternating which goes first."""
    times: dict[str, list[float]] = {name: [] for name, _ in calls}
    for _name, run in calls:
        run()
    for repeat in range(repeats):
        for name, run in calls if repeat % 2 == 0 else calls[::-1]:
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if not kernels.kernel_available():
        raise SystemExit("caddtree's bfloat16 kernel is not available here (see the log above)")
    weights = target_weights()
    ours = [kernels.pack_rows(w) for w in weights]
    onednn = [_pack(w) for w in weights]
    check(weights[0], ours[0], onednn[0])
    total = sum(w.numel() * w.element_size() for w in weights)
    print(
        f"{machine_description(torch.device('cpu'))}, torch {torch.__version__}, "
        f"{args.threads} threads; {len(weights)} linear calls, {total / 1e6:.0f} MB of weights"
    )
    print(f"{'rows':>4}  {'oneDNN ms':>9}  {'kernel ms':>9}  {'ratio':>6}  {'kernel GB/s':>11}")
    for rows in args.rows:
        xs = [torch.randn(rows, w.shape[1]).bfloat16() for w in weights]

        def run_ours(xs=xs) -> None:
            for x, w in zip(xs, ours):
                kernels.rows_linear(x, w)

        def run_onednn(xs=xs) -> None:
            for x, w in zip(xs, onednn):
                torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")

        med = timed([("onednn", run_onednn), ("kernel", run_ours)], args.repeats)
        print(
            f"{rows:>4}  {med['onednn'] * 1e3:>9.2f}  {med['kernel'] * 1e3:>9.2f}  "
            f"{med['kernel'] / med['onednn']:>6.3f}  {total / med['kernel'] / 1e9:>11.1f}"
        )


if __name__ == "__main__":
    main()
