"""CaDDTree with and without its draft gate, beside plain decoding, one request at a time.

    python benchmarks/draft_gate.py [--samples 3] [--max-new-tokens 128] [--repeats 3]
                                    [--json FILE]

The gate (:class:`caddtree.engine.policies.DraftGate`) decides each round whether the drafter
runs at all, weighing what drafted rounds delivered per second of wall time against a round
without the drafter: copies from the context alone (with lookup, where it is on by default) or
the bonus token alone (without, ``gate=True``). On the built-in pair (the target on its Q4_1
blocks, bfloat16), for the README's prompt and the first ``--samples`` prompts of each of the
report's five datasets, this decodes with plain decoding (``ar``), ``caddtree`` (every round
drafts, as the paper's Algorithm 1), ``caddtree`` with the gate, and ``caddtree`` with lookup with
and without the gate, in one process: ``--repeats`` rounds over the prompts, each visiting the
methods in turn (the order reversed every other round), after a warm-up. It prints each prompt's
speed-up over plain decoding (the ratio of median ms/token) per method, then the medians over the
prompts, and checks that every method's output is plain decoding's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from caddtree.api import SpeculativeGenerator
from caddtree.bench.datasets import load_benchmark
from caddtree.util.defaults import resolve_model_pair
from caddtree.util.devices import machine_description

README_PROMPT = "Write a Python function that checks whether a number is prime."
DATASETS = ("gsm8k", "humaneval", "mt-bench", "math500", "aime25")
METHODS = {
    "ar": ("ar", {}),
    "caddtree": ("caddtree", {"gate": False}),
    "caddtree+gate": ("caddtree", {"gate": True}),
    "caddtree+lookup-nogate": ("caddtree", {"lookup": True, "gate": False}),
    "caddtree+lookup": ("caddtree", {"lookup": True}),
}


def prompts(samples: int) -> list[tuple[str, str]]:
    out = [("readme", README_PROMPT)]
    for name in DATASETS:
        for i, item in enumerate(load_benchmark(name, max_samples=samples)):
            out.append((f"{name}-{i}", item.turns[0]))
    return out


def measure(gen, items, max_new_tokens: int, repeats: int) -> dict[str, dict[str, float]]:
    """Median ms/token per method and prompt; every output checked against plain decoding's."""
    times: dict[str, dict[str, list[float]]] = {m: {} for m in METHODS}
    reference: dict[str, list[int]] = {}
    gen.generate(README_PROMPT, method="caddtree", max_new_tokens=16)  # warm-up
    for rep in range(repeats):
        order = list(METHODS) if rep % 2 == 0 else list(reversed(METHODS))
        for key, text in items:
            for label in order:
                method, kwargs = METHODS[label]
                began = time.perf_counter()
                out = gen.generate(text, method=method, max_new_tokens=max_new_tokens, **kwargs)
                seconds = time.perf_counter() - began
                times[label].setdefault(key, []).append(seconds / max(1, len(out.token_ids)))
                if label == "ar":
                    reference.setdefault(key, out.token_ids)
                elif key in reference and out.token_ids != reference[key]:
                    raise SystemExit(f"{label} on {key}: the output differs from plain decoding's")
    return {m: {k: statistics.median(v) * 1e3 for k, v in t.items()} for m, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target, draft, dtype = resolve_model_pair(None, None, "bfloat16")
    gen = SpeculativeGenerator.from_pretrained(target, draft, dtype=dtype, device="cpu")
    gen.cost_model = gen.cached_cost_model()
    items = prompts(args.samples)
    ms = measure(gen, items, args.max_new_tokens, args.repeats)
    print(
        f"{machine_description(gen.verifier.device)}, {gen.weight_format}, {args.threads} threads"
    )
    speedups = {m: {k: ms["ar"][k] / v for k, v in t.items()} for m, t in ms.items() if m != "ar"}
    for key, _ in items:
        cells = " ".join(f"{m}={s[key]:.2f}x" for m, s in speedups.items())
        print(f"{key:14s} ar={ms['ar'][key]:.2f} ms/token {cells}")
    summary = {m: statistics.median(s.values()) for m, s in speedups.items()}
    print("medians over the prompts:", " ".join(f"{m}={v:.3f}x" for m, v in summary.items()))
    worst = {m: min(s.values()) for m, s in speedups.items()}
    print("worst prompts:", " ".join(f"{m}={v:.2f}x" for m, v in worst.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"ms_per_token": ms, "speedup_medians": summary, "args": vars(args)}, f)


if __name__ == "__main__":
    main()
