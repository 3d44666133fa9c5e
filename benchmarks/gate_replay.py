"""The draft gate's choices priced by the cost model: modelled ms per token and tau, per data set.

    python benchmarks/gate_replay.py [--recent 16 64] [--max-new-tokens 128] [--samples 6]
                                     [--datasets math500 gsm8k aime25 humaneval mt-bench]
                                     [--prompts benchmarks/prompts/context-reuse.jsonl]
                                     [--dtype bfloat16]

Decodes each prompt greedily on the built-in pair (bfloat16, or ``--dtype``) with CaDDTree and
copies from the context (``lookup=True``), once per ``--recent`` (the number of drafted rounds
the draft gate judges the drafter by, :class:`caddtree.engine.policies.DraftGate`), and with
CaDDTree alone for reference. Every round is priced as the policy prices it: ``C_d + C_v(n; l)``
where the drafter ran, ``C_v(n; l)`` where the gate left it out. The gate decides from the cost
model and the tokens alone, never from timings, so the figures are the same on a busy machine and
variants compare without timing noise; what they are worth in seconds is `caddtree bench`'s to
measure. The cost model is this machine's cached one for the dtype (profiled on first use), or
``--cost-model FILE``.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict

from caddtree.arguments import load_pair
from caddtree.bench.datasets import load_benchmark
from caddtree.core.copies import CopyRates
from caddtree.engine.policies import DraftGate
from chat_prompts import PROMPTS


def prompts(datasets: list[str], samples: int, prompt_file: str | None) -> list[tuple[str, str]]:
    """(data set, first user turn) pairs: the data sets' first ``samples``, the prompt file's
    prompts, and the README's prompt."""
    chosen = [(d, p.turns[0]) for d in datasets for p in load_benchmark(d, max_samples=samples)]
    if prompt_file:
        with open(prompt_file, encoding="utf-8") as f:
            chosen += [
                ("context-reuse", json.loads(line)["turns"][0]) for line in f if line.strip()
            ]
    return [*chosen, ("readme", PROMPTS[0])]


def replay(gen, policy, text: str, lookup: bool, max_new_tokens: int) -> tuple[int, int, float]:
    """Tokens, rounds and the modelled seconds (priced by ``policy``) of one greedy decode, the
    copies' rates started afresh."""
    rounds = []
    # each decode starts from the prior, as caddtree bench's records do
    gen.copy_rates = CopyRates()
    result = gen.generate(
        text,
        method="caddtree",
        lookup=lookup,
        max_new_tokens=max_new_tokens,
        temperature=0,
        callback=lambda stats, _: rounds.append(stats) if stats is not None else None,
    )
    seconds = sum(
        policy.limits(s.context_length, drafting=s.draft_s > 0)[1][s.budget] for s in rounds
    )
    return len(result.token_ids), len(rounds), seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recent", type=int, nargs="+", default=[DraftGate.RECENT])
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--samples", type=int, default=6)
    parser.add_argument(
        "--datasets", nargs="*", default=["math500", "gsm8k", "aime25", "humaneval", "mt-bench"]
    )
    parser.add_argument("--prompts", default="benchmarks/prompts/context-reuse.jsonl")
    parser.add_argument("--cost-model", help="a cost model file (default: this machine's cached)")
    parser.add_argument("--dtype", default="bfloat16", help="the pair's dtype (default bfloat16)")
    args = parser.parse_args()
    gen = load_pair(None, None, dtype=args.dtype, method="caddtree", cost_model=args.cost_model)
    chosen = prompts(args.datasets, args.samples, args.prompts)
    policy = gen.policy("caddtree")
    variants = [(f"caddtree+lookup, recent {r}", True, r) for r in args.recent]
    print(
        "| variant | data set | tokens | rounds | tau | modelled ms/tok |\n|:--|:--|--:|--:|--:|--:|"
    )
    for label, lookup, recent in [*variants, ("caddtree", False, DraftGate.RECENT)]:
        DraftGate.RECENT = recent
        totals: dict[str, list[float]] = defaultdict(lambda: [0, 0, 0.0])
        for dataset, text in chosen:
            figures = replay(gen, policy, text, lookup, args.max_new_tokens)
            for key in (dataset, "all"):
                for i, value in enumerate(figures):
                    totals[key][i] += value
        for dataset in sorted(totals, key=lambda key: key == "all"):  # "all" last
            tokens, rounds, seconds = totals[dataset]
            tau, ms = tokens / rounds, 1e3 * seconds / tokens
            print(f"| {label} | {dataset} | {tokens:.0f} | {rounds:.0f} | {tau:.2f} | {ms:.3f} |")


if __name__ == "__main__":
    main()
