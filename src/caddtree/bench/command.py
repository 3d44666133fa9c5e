"""``caddtree bench``: its options, and the command that loads the prompts and the models, runs
the benchmark (:func:`caddtree.bench.runner.run_bench`) and prints the summary tables
(:func:`caddtree.bench.tables.summary_table`). How the benchmark runs: :mod:`caddtree.bench.runner`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from ..arguments import add_draft_dtype_argument, add_runtime_arguments, check_draft_dtype
from ..util.checks import check_int
from ..util.errors import InvalidInputError
from ..util.ranks import DistInfo, barrier, init_distributed
from .methods import (
    DEFAULT_BUDGETS,
    DEFAULT_METHODS,
    MethodSpec,
    default_ar_dtypes,
    parse_methods,
)
from .results import load_meta, meta_path, mixed_machines
from .runner import BenchConfig, generator_dtype, run_bench

__all__ = ["add_arguments", "cli_main"]


def _add_model_options(p: Any) -> None:
    """The models, their dtypes, the device and the runtime."""
    p.add_argument("--target", help="target model (default: the built-in SmolLM2 pair)")
    p.add_argument("--draft", help="DFlash drafter for --target")
    p.add_argument(
        "--dtype",
        default="auto",
        help="auto, float32, bfloat16, float16, float64: the dtype of every method (ar-DTYPE "
        "excepted)",
    )
    add_draft_dtype_argument(p)
    p.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    add_runtime_arguments(p)


def add_arguments(p: Any) -> None:
    """The ``caddtree bench`` options."""
    from .datasets import PAPER_BENCHMARKS

    _add_model_options(p)
    p.add_argument(
        "--datasets",
        nargs="+",
        metavar="NAME",
        help=f"benchmarks to run (default: the paper's {', '.join(PAPER_BENCHMARKS)}; none with "
        "--prompts). Also: aime24",
    )
    p.add_argument(
        "--prompts",
        nargs="+",
        default=[],
        metavar="FILE",
        help="extra prompt files (JSON lines with 'turns' or 'prompt'); the file name is the "
        "dataset name. With --prompts and no --datasets, only these run",
    )
    p.add_argument(
        "--methods",
        nargs="+",
        help="ar, ar-DTYPE (plain decoding with a copy of the target in DTYPE: float32, "
        "bfloat16, float16, float64), dflash, ddtree (every --budgets), ddtree-B, caddtree, "
        "caddtree-VARIANT, lookup (prompt-lookup decoding); a ddtree or caddtree name ending in "
        "+lookup takes copies from the context into its trees. Default: ar dflash ddtree "
        "caddtree, and on a CPU the AR baseline in the other of float32/bfloat16 (ar-float32 for "
        "a bfloat16 run); speed-ups are against the fastest AR",
    )
    p.add_argument(
        "--lookup",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="every ddtree and caddtree method takes copies from the context into its trees "
        "(labelled +lookup; default: --no-lookup)",
    )
    p.add_argument(
        "--budgets",
        type=int,
        nargs="+",
        default=list(DEFAULT_BUDGETS),
        help="DDTree budget grid (default 16 ... 1024)",
    )
    p.add_argument(
        "--ablations",
        action="store_true",
        help="also run the cost-model ablations: caddtree-constant (Table 2) and "
        "caddtree-cd0.5/cd2/cv0.5/cv2 (Table 3)",
    )
    p.add_argument("--temperatures", type=float, nargs="+", default=[0.0], help="default: 0")
    p.add_argument("--max-samples", type=int, help="first N prompts of each dataset (default all)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument(
        "--max-budget", type=int, default=1024, help="CaDDTree's node cap (default 1024)"
    )
    p.add_argument(
        "--cost-model", help="from `caddtree profile` (default: profile this machine once, cached)"
    )
    p.add_argument("--out", default="bench-results/results.jsonl", help="JSON lines results file")
    p.add_argument("--no-resume", action="store_true", help="start over instead of resuming")
    p.add_argument("--no-warmup", action="store_true", help="skip the untimed warm-up prompt")
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="time each method on each prompt N times, a prompt's methods in alternating order "
        "each time round, and record its median run (default 1)",
    )
    p.add_argument("--seed", type=int, default=0, help="sampling seed base (temperature > 0)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def cli_main(args: Any) -> int:
    """``caddtree bench``: see :mod:`caddtree.bench.runner`."""
    import torch

    from ..util.devices import resolve_dtype

    check_int("--max-samples", args.max_samples, allow_none=True)
    check_int("--repeats", args.repeats)
    methods = list(DEFAULT_METHODS) if args.methods is None else args.methods
    specs = parse_methods(methods, args.budgets, args.ablations, args.lookup)
    _check_model_options(args, specs)  # cheap checks before any data or model
    resolve_dtype(args.dtype, torch.device("cpu"))
    check_draft_dtype(args.draft_dtype)
    config = BenchConfig(
        prompts={},
        methods=specs,
        temperatures=args.temperatures,
        max_new_tokens=args.max_new_tokens,
        max_budget=args.max_budget,
        seed=args.seed,
        warmup=not args.no_warmup,
        repeats=args.repeats,
    )
    _load_bench_prompts(args, config)
    config.validate()

    info = init_distributed(args.device)
    needs_draft = any(s.family not in ("ar", "lookup") for s in specs)
    gen, ar_gens = _load_generators(args, methods, config, info, needs_draft)
    cost = _bench_cost_model(args, gen, config.methods, info)
    records = run_bench(
        gen,
        config,
        args.out,
        cost_model=cost,
        resume=not args.no_resume,
        progress=not args.no_progress,
        dist_info=info,
        meta=_bench_meta(args, gen, needs_draft),
        ar_generators=ar_gens,
    )
    _print_summary(args, records, info)
    if info.distributed:
        import torch.distributed as dist

        dist.destroy_process_group()
    return 0


def _check_model_options(args: Any, specs: list[MethodSpec]) -> None:
    """Reject a --target/--draft combination the methods cannot run with."""
    if args.target is None and args.draft is not None:
        raise InvalidInputError("--draft needs --target (the model the drafter was trained for)")
    drafting = any(s.family not in ("ar", "lookup") for s in specs)
    if args.target is not None and args.draft is None and drafting:
        raise InvalidInputError("drafting methods need --draft (a DFlash checkpoint)")


def _load_bench_prompts(args: Any, config: BenchConfig) -> None:
    """Fill ``config.prompts`` from --datasets and --prompts. Every data set loads before any
    model: an unreachable one fails now, not an hour in."""
    from .datasets import (
        PAPER_BENCHMARKS,
        canonical_benchmark_name,
        load_benchmark,
        load_prompt_file,
    )

    datasets = args.datasets
    if datasets is None:
        datasets = [] if args.prompts else list(PAPER_BENCHMARKS)
    for name in dict.fromkeys(canonical_benchmark_name(n) for n in datasets):
        config.prompts[name] = load_benchmark(name, max_samples=args.max_samples)
    for file in args.prompts:
        items = load_prompt_file(file)
        config.prompts[Path(file).stem] = items[: args.max_samples] if args.max_samples else items


def _load_generators(
    args: Any, methods: list[str], config: BenchConfig, info: DistInfo, needs_draft: bool
) -> tuple[Any, dict[Any, Any]]:
    """The generator the methods share and one target-only copy per other dtype that plain
    decoding is measured in. With the default method list, ``config.methods`` gains AR in the
    dtype that may be faster here."""
    from ..api import SpeculativeGenerator
    from ..util.defaults import resolve_model_pair

    device = info.device if info.distributed else args.device
    args.target, args.draft, args.dtype = resolve_model_pair(args.target, args.draft, args.dtype)
    gen = SpeculativeGenerator.from_pretrained(
        args.target,
        args.draft if needs_draft else None,
        dtype=args.dtype,
        device=device,
        pack_weights=args.pack_weights,
        runtime=args.runtime,
        dequantize=getattr(args, "dequantize", False),
        draft_dtype=args.draft_dtype if needs_draft else "same",
    )
    main_dtype = generator_dtype(gen)
    if args.methods is None:
        extra = default_ar_dtypes(main_dtype, gen.verifier.device.type)
        config.methods = parse_methods(
            [*methods, *(f"ar-{d}" for d in extra)], args.budgets, args.ablations
        )
    ar_gens = {
        s.dtype: SpeculativeGenerator.from_pretrained(
            args.target,
            None,
            dtype=s.dtype,
            device=gen.verifier.device,
            pack_weights=args.pack_weights,
            runtime=args.runtime,
            dequantize=getattr(args, "dequantize", False),
        )
        for s in config.methods
        if s.dtype is not None and s.dtype != main_dtype
    }
    return gen, ar_gens


def _bench_cost_model(args: Any, gen: Any, specs: list[MethodSpec], info: DistInfo) -> Any:
    """The cost model, when a method needs one: --cost-model, or this machine's cached profile
    (rank 0 profiles once per machine; the other ranks then read the cache)."""
    from ..core.cost import load_cost_model

    cost = None
    if any(s.needs_cost_model for s in specs):
        if args.cost_model:
            cost = load_cost_model(args.cost_model)
        else:
            if info.rank == 0:
                cost = gen.cached_cost_model()
            barrier(info)
            if cost is None:
                cost = gen.cached_cost_model()
    return cost


def _bench_meta(args: Any, gen: Any, needs_draft: bool) -> dict[str, Any]:
    """What the results file records about the run: models, machine, versions, command."""
    import shlex

    import torch

    from .. import __version__
    from ..util.devices import machine_description

    return {
        "target": str(args.target),
        "draft": str(args.draft) if needs_draft else None,
        "dtype": str(gen.verifier.dtype),
        "draft_dtype": str(gen.drafter.dtype) if gen.drafter is not None else None,
        "device_type": gen.verifier.device.type,
        "machine": machine_description(gen.verifier.device),
        "torch": torch.__version__,
        "caddtree": __version__,
        "threads": torch.get_num_threads(),
        # linear layers packed for oneDNN (caddtree.runtime.packing): they change every timing
        "packed_layers": gen.packed_layers,
        "runtime": gen.runtime,
        # what the linear layers computed on (a GGUF's blocks, or the dtype's own weights);
        # AR in another dtype (ar-float32) runs the weights widened to it
        "weights": gen.weight_format,
        "cost_model": args.cost_model or "profiled on this machine (cached)",
        "command": shlex.join(["caddtree", "bench", *sys.argv[2:]])
        if len(sys.argv) > 1 and sys.argv[1] == "bench"
        else None,
    }


def _print_summary(args: Any, records: list[dict[str, Any]], info: DistInfo) -> None:
    """Rank 0 prints the summary table, and where the results went."""
    from .tables import summary_table

    if info.rank == 0:
        print(summary_table(records))
        mixed = mixed_machines(load_meta(meta_path(args.out)))
        if mixed:
            print(f"note: these timings pool different machines ({mixed})", file=sys.stderr)
        print(
            f"\nresults: {args.out} ({len(records)} records); tables and figures: "
            f"caddtree report {args.out}",
            file=sys.stderr,
        )
