"""``caddtree profile``: measure this machine's cost model (C_v and C_d) and save it as JSON."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from ..arguments import add_pair_arguments, load_pair
from ..util.checks import MAX_TREE_NODES, check_int
from ..util.errors import InvalidInputError


def profile(args: argparse.Namespace) -> int:
    """Measure this machine's verification cost C_v(n; l) (the median over --trials of one target
    forward over a tree of n nodes after l context tokens) and drafting cost C_d, fit the paper's
    convex, non-decreasing cost model, and save it as JSON for `generate --cost-model`."""
    from pathlib import Path

    from ..core import profiling
    from ..util.devices import dtype_name, machine_description

    lengths, counts, trials, warmup = _checked_grid(args)  # before spending time on a model
    out = Path(args.out)
    gen = load_pair(
        args.target,
        args.draft,
        dtype=args.dtype,
        device=args.device,
        context_window=args.context_window,
        pack_weights=args.pack_weights,
        runtime=args.runtime,
    )
    longest = profiling.max_profile_context_length(gen.verifier, gen.proposer)
    if args.context_lengths is None:
        lengths, dropped = profiling.fit_context_lengths(lengths, longest)
        if dropped:
            print(
                f"caddtree: note: the target holds {gen.verifier.max_positions} positions, so with "
                f"a depth-{gen.proposer.block_size - 1} tree the longest context is {longest}; "
                f"profiling {lengths} instead of {dropped} (beyond {lengths[-1]} the model "
                "clamps to the longest profiled curve)",
                file=sys.stderr,
            )
    print(
        f"caddtree: profiling {gen.source['target']} with drafter {gen.source['draft']} on "
        f"{machine_description(gen.verifier.device)} ({dtype_name(gen.verifier.dtype)}): "
        f"{len(lengths)} context lengths x {len(counts)} node counts, median of {trials} trials "
        f"after {warmup} warm-up",
        file=sys.stderr,
    )
    seconds = profiling.estimate_profile_seconds(
        gen.verifier,
        gen.proposer,
        context_lengths=lengths,
        node_counts=counts,
        trials=trials,
        warmup=warmup,
    )
    print(f"caddtree: {profiling.describe_duration(seconds)}, estimated", file=sys.stderr)
    model = gen.profile(context_lengths=lengths, node_counts=counts, trials=trials, warmup=warmup)
    _report(model, model.save(out), args, lengths)
    if args.batch is not None:
        _profile_batches(gen, args, lengths, trials, warmup)
    return 0


def _checked_grid(args: argparse.Namespace) -> tuple[list[int], list[int], int, int]:
    """The grid (context lengths, node counts, trials, warm-up) of the options and --quick, and
    every option checked that can be without a model."""
    from pathlib import Path

    import torch

    from ..core import profiling
    from ..util.devices import resolve_dtype

    quick = args.quick
    lengths = args.context_lengths
    if lengths is None:
        lengths = profiling.QUICK_CONTEXT_LENGTHS if quick else profiling.PAPER_CONTEXT_LENGTHS
    counts = args.node_counts
    if counts is None:
        counts = profiling.QUICK_NODE_COUNTS if quick else profiling.PAPER_NODE_COUNTS
    trials = args.trials if args.trials is not None else (3 if quick else 5)
    warmup = args.warmup if args.warmup is not None else (1 if quick else 2)
    lengths, counts = profiling.check_profile_grid(lengths, counts, trials, warmup)
    resolve_dtype(args.dtype, torch.device("cpu"))
    if Path(args.out).is_dir():
        raise InvalidInputError(
            f"--out {args.out} is a directory; give a file name such as cost.json"
        )
    if args.plot is not None:
        from ..util.plots import pyplot

        if Path(args.plot).suffix.lower() not in (".png", ".pdf", ".svg"):
            raise InvalidInputError(f"--plot {args.plot}: use a .png, .pdf or .svg file name")
        pyplot()  # a missing matplotlib is reported now, not after a long profile
    if args.target is not None and args.draft is None:
        raise InvalidInputError("profiling needs --draft too: C_d is the drafter's cost")
    if args.context_window is not None:
        check_int("--context-window", args.context_window, minimum=2)
    if args.batch is not None:
        check_int("--batch", args.batch, minimum=1)
    return lengths, counts, trials, warmup


def _report(model: Any, saved: Any, args: argparse.Namespace, lengths: list[int]) -> None:
    """What the profile found and where it went, and how to use it."""
    from ..core import profiling

    print("verification cost C_v(n; l), convex fit per context length:")
    print(model.fit_report())
    print(
        f"drafting cost C_d = {model.draft_cost * 1e3:.3f} ms per drafted round "
        f"(median per context length, mean over {len(lengths)})"
    )
    print(f"saved the cost model to {saved}")
    if args.plot is not None:
        print(f"saved the figure to {profiling.plot_cost_model(model, args.plot)}")
    warning = model.noise_warning(
        "for a better one, run again on a quiet machine or with more --trials."
    )
    if warning:
        print(f"caddtree: warning: {warning}", file=sys.stderr)
    print(f"use it with: caddtree generate --method caddtree --cost-model {saved} PROMPT")


def _profile_batches(
    gen: Any, args: argparse.Namespace, lengths: list[int], trials: int, warmup: int
) -> None:
    """``--batch N``: the batch cost model of rounds of up to N requests, saved beside --out."""
    from pathlib import Path

    from ..profiles import batch_sizes, profile_batches

    print(f"caddtree: profiling rounds of {batch_sizes(args.batch)} requests", file=sys.stderr)
    model = profile_batches(
        gen,
        args.batch,
        context_lengths=[n for n in lengths if n <= 1024] or lengths[:1],
        trials=trials,
        warmup=warmup,
    )
    out = Path(args.out)
    saved = model.save(out.with_name(f"{out.stem}.batch.json"))
    print("batched rounds: C_v(N; B, l) over the round's total nodes N, and C_d(B):")
    print(model.fit_report())
    print(f"saved the batch cost model to {saved}")


def register(sub: argparse._SubParsersAction) -> None:
    """Add this sub-command's parser to ``sub``."""
    p = sub.add_parser(
        "profile",
        help="measure this machine's cost model (C_v and C_d) and save it as JSON",
        description=profile.__doc__,
    )
    add_pair_arguments(p)
    p.add_argument(
        "--context-lengths",
        type=int,
        nargs="+",
        metavar="L",
        help="context lengths to profile (default: 0 1024 ... 8192 as in the paper, clipped to "
        "the model's window; --quick: 0 512 1024)",
    )
    p.add_argument(
        "--node-counts",
        type=int,
        nargs="+",
        metavar="N",
        help="tree sizes to time, at least 3 distinct (default: 0 1 2 4 8 ... 768 1024; "
        f"--quick: up to 256; at most {MAX_TREE_NODES})",
    )
    p.add_argument(
        "--trials",
        type=int,
        help="timed passes over the grid; each point keeps its median (default 5)",
    )
    p.add_argument("--warmup", type=int, help="untimed passes before them (default 2)")
    p.add_argument("--out", default="cost.json", help="cost-model JSON file (default cost.json)")
    p.add_argument("--plot", help="also draw Figure 4 (latency vs nodes) to this .png/.pdf/.svg")
    p.add_argument(
        "--quick",
        action="store_true",
        help="a small grid (about a minute for a small model on a CPU): 3 context lengths, up to "
        "256 nodes, 3 trials, 1 warm-up",
    )
    p.add_argument(
        "--batch",
        type=int,
        metavar="N",
        help="also profile rounds of 1 to N requests at once (the server's --max-batch): the "
        "batch cost model its joint budget prices rounds with, saved as <out>.batch.json",
    )
    p.set_defaults(handler=profile)
