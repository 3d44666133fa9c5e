"""``caddtree bench`` and ``caddtree report``: the glue to :mod:`caddtree.bench` (the runner and the
report, which never import each other)."""

from __future__ import annotations

import argparse
import sys


def bench(args: argparse.Namespace) -> int:
    """Benchmark AR, DFlash, DDTree (a budget grid) and CaDDTree on benchmark prompts; results
    are JSON lines (resumable), summarised at the end. Runs data-parallel under torchrun."""
    from ..bench import cli_main

    return cli_main(args)


def report(args: argparse.Namespace) -> int:
    """Write the paper's tables (Markdown and LaTeX) and figures from `caddtree bench` results:
    report.md, tables.tex and PNGs in --out. Missing side files (results.meta.json,
    results.trees.jsonl) are skipped with a note."""
    from pathlib import Path

    from ..bench.report import build_report

    out = args.out if args.out is not None else Path(args.results).parent / "report"
    report = build_report(
        args.results, out, cost_model=args.cost_model, pool_machines=args.pool_machines
    )
    for table in report.tables:
        if table.key.startswith("table1_"):
            print(f"## {table.title}\n\n{table.markdown()}\n")
    for note in report.notes:
        print(f"note: {note}", file=sys.stderr)
    for path in report.files:
        print(f"wrote {path}", file=sys.stderr)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``bench`` and ``report`` parsers to ``sub``."""
    from ..bench import add_arguments as bench_arguments

    p = sub.add_parser(
        "bench",
        help="benchmark AR, DFlash, DDTree and CaDDTree on the paper's datasets",
        description=bench.__doc__,
    )
    bench_arguments(p)
    p.set_defaults(handler=bench)

    p = sub.add_parser(
        "report",
        help="the paper's tables and figures from `caddtree bench` results",
        description=report.__doc__,
    )
    p.add_argument("results", help="results.jsonl written by `caddtree bench`")
    p.add_argument("--out", help="output folder (default: report/ next to RESULTS)")
    p.add_argument("--cost-model", help="cost-model file: also draw Fig. 4 (the cost profile)")
    p.add_argument(
        "--pool-machines",
        action="store_true",
        help="report a torchrun run whose ranks ran on different machines, timings pooled "
        "(refused without it; the report says which machines it pools)",
    )
    p.set_defaults(handler=report)
