"""caddtree's bfloat16 linear kernel beside torch's, on the built-in target's layers.

    python benchmarks/linear_kernel.py [--rows 1 2 4 8 16 32 64] [--repeats 15] [--threads 2]

A forward of the target runs its 120 fused linear layers (q/k/v, o, gate/up and down of each of
the 30 decoder layers, as the lean runtime fuses them) and the LM head on a few rows; their
weights (269 MB in bfloat16) do not fit in the CPU's caches, so each call reads its weight from
memory, as here: the script runs all 121 calls in layer order, through caddtree's kernel
(:mod:`caddtree.runtime.kernels`) and through torch's fastest bfloat16 linear there (oneDNN's
packed one, :mod:`caddtree.runtime.packing`, where oneDNN packs bfloat16; else ``F.linear``), the two
alternating and taking turns going first, after a warm-up of each. It prints, per row count, the
median milliseconds of the 121 calls for each, their ratio (below 1: the kernel is faster) and
the bandwidth the kernel reached, and checks that both compute the same products (within
bfloat16 rounding) and that the kernel gives a row the same bits alone or among others.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from caddtree.api import SpeculativeGenerator
from caddtree.runtime import kernels
from caddtree.runtime.packing import _kernel_packs, _pack
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


def baseline(weights: list[torch.Tensor]) -> tuple[str, list[torch.Tensor], Callable]:
    """torch's fastest bfloat16 linear here: oneDNN's packed one where it packs bfloat16 (CPUs
    with AVX-512), else ``F.linear`` on the plain weight (what a packed layer falls back to)."""
    if _kernel_packs(weights[0]):
        return "oneDNN", [_pack(w) for w in weights], _onednn_linear
    return "F.linear", weights, torch.nn.functional.linear


def _onednn_linear(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


def check(weight: torch.Tensor, ours: torch.Tensor, theirs_weight: torch.Tensor, linear) -> None:
    x = torch.randn(9, weight.shape[1]).bfloat16()
    mine = kernels.rows_linear(x, ours)
    theirs = linear(x, theirs_weight)
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
    name, theirs, linear = baseline(weights)
    check(weights[0], ours[0], theirs[0], linear)
    total = sum(w.numel() * w.element_size() for w in weights)
    print(
        f"{machine_description(torch.device('cpu'))}, torch {torch.__version__}, "
        f"{args.threads} threads; {len(weights)} linear calls, {total / 1e6:.0f} MB of weights"
    )
    print(f"{kernels.kernel_variant()} kernel beside torch's {name}")
    print(f"{'rows':>4}  {'torch ms':>9}  {'kernel ms':>9}  {'ratio':>6}  {'kernel GB/s':>11}")
    for rows in args.rows:
        xs = [torch.randn(rows, w.shape[1]).bfloat16() for w in weights]

        def run_ours(xs=xs) -> None:
            for x, w in zip(xs, ours):
                kernels.rows_linear(x, w)

        def run_torch(xs=xs) -> None:
            for x, w in zip(xs, theirs):
                linear(x, w)

        med = timed([("torch", run_torch), ("kernel", run_ours)], args.repeats)
        print(
            f"{rows:>4}  {med['torch'] * 1e3:>9.2f}  {med['kernel'] * 1e3:>9.2f}  "
            f"{med['kernel'] / med['torch']:>6.3f}  {total / med['kernel'] / 1e9:>11.1f}"
        )


if __name__ == "__main__":
    main()
