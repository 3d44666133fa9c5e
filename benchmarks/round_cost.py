"""What one decoding round costs, part by part, from the engine's own per-round timing.

    python benchmarks/round_cost.py [--prompts 4] [--max-new-tokens 64] [--method caddtree]
                                    [--budget 16] [--models default tiny] [--lookup]
                                    [--prompt-file FILE.jsonl] [--dtype auto]

For the built-in pair (SmolLM2-135M-Instruct and its shipped drafter, resolved as the CLI resolves
them, in bfloat16) and for the tiny random float64 pair of the tests, it decodes ``--prompts``
prompts with ``--method`` after one untimed warm-up, and prints, over all rounds that drafted:

* the median milliseconds per round of each part of a round, as
  :class:`caddtree.engine.decoding.RoundStats` times it (device synchronised):

  - ``drafter forward`` (``draft_s - project_s``): the drafter's layers;
  - ``projection`` (``project_s``): its hidden states through the (draft) vocabulary head, for
    the positions the tree reached;
  - ``tree build`` (``tree_s``);
  - ``target forward`` (``forward_s``): the verification forward over the tree;
  - ``walk + commit`` (``verify_s - forward_s``): the walk with the target's choices and the
    KV-cache compaction;
  - ``bookkeeping`` (``round_s`` minus all of the above): the rest of the loop body;

* each part's share of the rounds' total time (sums over rounds, so the shares add up to 100%);
* ``host overhead``: everything but the two forward passes and the projection (tree build, walk,
  commit and bookkeeping), the quantity issue 10 wants at most 5% of a round.

Rounds with no draft (the last round, when only the bonus token fits) are left out. With
``--lookup`` (DDTree and CaDDTree with copies from the context), the rounds whose tree is copies
alone (the draft gate left the drafter out) get a table of their own, and CaDDTree's line says
what its cost model charges for a drafter pass (``C_d``), to set against the measured drafter
forward, projection and tree build of the rounds that drafted. With a cost model it also sets
each round's target forward against the model's ``C_v(n; l)`` at that round's tree size and
context length (medians by tree size): whether the profile measured what decoding sees.
``--prompt-file``: the first turn of each line of a benchmark prompt file (``{"turns": [...]}``
or ``{"prompt": ...}``, e.g. ``benchmarks/prompts/context-reuse.jsonl``) instead of the built-in
prompts; ``--dtype``: the built-in pair's dtype (``auto``: the CLI's choice).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

from caddtree.engine.decoding import RoundStats
from caddtree.util.checks import METHODS

PROMPTS = [
    "Write a Python function that checks whether a number is prime.",
    "Explain in three sentences why the sky is blue.",
    "List five ideas for a weekend trip with children.",
    "What is the difference between a list and a tuple in Python?",
    "Summarise the causes of the French Revolution.",
    "Write a haiku about autumn rain.",
    "How do I reverse a linked list? Show code.",
    "Give me a recipe for a simple tomato soup.",
]

PARTS = {
    "drafter forward": lambda r: r.draft_s - r.project_s,
    "projection": lambda r: r.project_s,
    "tree build": lambda r: r.tree_s,
    "target forward": lambda r: r.forward_s,
    "walk + commit": lambda r: r.verify_s - r.forward_s,
    "bookkeeping": lambda r: r.round_s - r.draft_s - r.tree_s - r.verify_s,
}
FORWARDS = ("drafter forward", "projection", "target forward")


def default_pair(method: str, dtype: str = "auto") -> tuple[Any, list[Any], Any]:
    """The built-in pair (in ``dtype``), its prompts, and (for CaDDTree) its cached cost model."""
    from caddtree.api import SpeculativeGenerator
    from caddtree.util.defaults import resolve_model_pair

    target, draft, dtype = resolve_model_pair(None, None, dtype)
    gen = SpeculativeGenerator.from_pretrained(target, draft, dtype=dtype, device="cpu")
    cost = gen.cached_cost_model() if method == "caddtree" else None
    return gen, PROMPTS, cost


def file_prompts(path: str) -> list[str]:
    """The first turn of each prompt of a benchmark prompt file."""
    from caddtree.bench.datasets import load_prompt_file

    return [prompt.turns[0] for prompt in load_prompt_file(path)]


def tiny_pair(method: str) -> tuple[Any, list[Any], Any]:
    """The tests' tiny float64 target and drafter, token-id prompts, a quickly profiled cost."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from caddtree.api import SpeculativeGenerator
    from tiny_models import new_drafter, qwen3_target

    target = qwen3_target()
    gen = SpeculativeGenerator(target, None, new_drafter(target))
    cost = None
    if method == "caddtree":
        cost = gen.profile(
            context_lengths=(0, 32), node_counts=(1, 2, 4, 8, 16), trials=3, progress=False
        )
    prompts = [[(7 * i + 3 * j) % 90 for j in range(4 + i)] for i in range(len(PROMPTS))]
    return gen, prompts, cost


def measure(
    gen: Any, prompts: list[Any], cost: Any, args: argparse.Namespace
) -> tuple[list[RoundStats], list[RoundStats]]:
    """The rounds of decoding every prompt (after one untimed warm-up) that drafted a tree, and
    (with ``--lookup``) those whose tree was copies alone."""
    kwargs = {
        "method": args.method,
        "budget": args.budget if args.method == "ddtree" else None,
        "cost_model": cost,
        "max_new_tokens": args.max_new_tokens,
        "stop_token_ids": (),
        **({"lookup": True} if args.lookup else {}),
    }
    gen.generate(prompts[0], **{**kwargs, "max_new_tokens": min(16, args.max_new_tokens)})
    limit = gen.verifier.max_positions  # the tiny models hold 64 positions
    drafted: list[RoundStats] = []
    alone: list[RoundStats] = []
    for prompt in prompts[: args.prompts]:
        if limit is not None:
            room = limit - len(gen.encode(prompt))
            kwargs["max_new_tokens"] = min(args.max_new_tokens, room)
        result = gen.generate(prompt, **kwargs)
        for r in result.stats.per_round:
            if args.method == "ar" or r.projected > 0:
                drafted.append(r)
            elif args.lookup and r.budget > 0:
                alone.append(r)
    return drafted, alone


def table(name: str, rounds: list[RoundStats]) -> str:
    total = sum(r.round_s for r in rounds)
    median_round = 1e3 * statistics.median(r.round_s for r in rounds)
    lines = [
        f"{name}: {len(rounds)} rounds, median round {median_round:.2f} ms, mean tree "
        f"{statistics.mean(r.budget for r in rounds):.1f} nodes, mean positions projected "
        f"{statistics.mean(r.projected for r in rounds):.1f}",
        f"  {'part':<18} {'median ms':>10} {'share':>7}",
    ]
    host = 0.0
    for part, of in PARTS.items():
        values = [of(r) for r in rounds]
        share = sum(values) / total
        if part not in FORWARDS:
            host += share
        lines.append(f"  {part:<18} {1e3 * statistics.median(values):>10.3f} {share:>7.1%}")
    overhead = [r.round_s - sum(PARTS[p](r) for p in FORWARDS) for r in rounds]
    lines.append(
        f"  {'host overhead':<18} {1e3 * statistics.median(overhead):>10.3f} {host:>7.1%}"
        "   (tree build + walk + commit + bookkeeping)"
    )
    return "\n".join(lines)


SIZES = ((0, 0), (1, 2), (3, 4), (5, 8), (9, 16), (17, 64), (65, 4096))


def cost_check(cost: Any, rounds: list[RoundStats]) -> str:
    """The target forward of ``rounds`` against the cost model's ``C_v(n; l)`` at each round's
    tree size and context length, by tree size: the medians of both and of their ratio."""
    lines = [
        "  the cost model's C_v(n; l) against the target forward it prices, by tree size:",
        f"  {'nodes':<8} {'rounds':>6} {'forward ms':>11} {'C_v ms':>8} {'C_v / forward':>14}",
    ]
    for low, high in SIZES:
        group = [r for r in rounds if low <= r.budget <= high]
        if not group:
            continue
        measured = [r.forward_s for r in group]
        modelled = [float(cost.verify_cost(r.budget, r.context_length)) for r in group]
        ratio = statistics.median(m / f for m, f in zip(modelled, measured))
        lines.append(
            f"  {f'{low}-{high}':<8} {len(group):>6} {1e3 * statistics.median(measured):>11.2f} "
            f"{1e3 * statistics.median(modelled):>8.2f} {ratio:>14.2f}"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="See the module docstring for the parts.",
    )
    parser.add_argument("--prompts", type=int, default=4, help="prompts per model (default 4)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--method", default="caddtree", choices=METHODS)
    parser.add_argument("--budget", type=int, default=16, help="DDTree's node budget")
    parser.add_argument(
        "--models", nargs="+", default=["default", "tiny"], choices=["default", "tiny"]
    )
    parser.add_argument("--lookup", action="store_true", help="copies from the context join")
    parser.add_argument("--prompt-file", help="a benchmark prompt file (first turns)")
    parser.add_argument("--dtype", default="auto", help="the built-in pair's dtype")
    parser.add_argument(
        "--projection-steps",
        type=int,
        nargs="*",
        help="positions per projection call, in order, the rest in one more call (see "
        "caddtree.models.drafts.DraftLogits); none: the whole block at once. Default: the "
        "proposer's own",
    )
    args = parser.parse_args()
    prompts = file_prompts(args.prompt_file) if args.prompt_file else PROMPTS
    if not 1 <= args.prompts <= len(prompts):
        parser.error(f"--prompts must be between 1 and {len(prompts)}")
    steps = "proposer default" if args.projection_steps is None else args.projection_steps
    print(
        f"method {args.method}{' with lookup' if args.lookup else ''}, {args.prompts} prompts x "
        f"{args.max_new_tokens} new tokens, projection steps {steps}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads"
    )
    for name in args.models:
        if name == "default":
            gen, own, cost = default_pair(args.method, args.dtype)
        else:
            gen, own, cost = tiny_pair(args.method)
        if args.projection_steps is not None and gen.proposer is not None:
            gen.proposer.projection_steps = tuple(args.projection_steps)
        label = {
            "default": f"default pair (SmolLM2-135M + shipped drafter, {gen.weight_format})",
            "tiny": "tiny pair (tests/tiny_models.py, float64)",
        }[name]
        chosen = prompts if args.prompt_file and name == "default" else own
        drafted, alone = measure(gen, chosen, cost, args)
        print()
        if cost is not None:
            print(f"{label}: the cost model's C_d (a drafter pass) {1e3 * cost.draft_cost:.2f} ms")
        print(table(f"{label}, rounds that drafted", drafted))
        if args.lookup and alone:
            print(table(f"{label}, rounds of copies alone", alone))
        if cost is not None:
            print(cost_check(cost, drafted + alone))


if __name__ == "__main__":
    main()
