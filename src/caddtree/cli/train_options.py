"""The options of ``caddtree train-drafter`` (:mod:`caddtree.cli.train`): the run and its data,
the training schedule, how a step computes, and the loss."""

from __future__ import annotations

import argparse

__all__ = ["add_data_options", "add_training_options"]


def add_data_options(p: argparse.ArgumentParser) -> None:
    """The run directory, the prompt sources and the data generation options."""
    p.add_argument(
        "--output",
        required=True,
        help="run directory (data, features, checkpoint, log); run again with larger prompt "
        "sources to grow its data: the responses made before stay first, new prompts are "
        "appended, and only their responses and features are computed",
    )
    p.add_argument("--sharegpt", type=int, default=500, help="ShareGPT prompts to use (max 500)")
    p.add_argument("--code", type=int, default=500, help="stdlib code prompts to use")
    p.add_argument("--math", type=int, default=300, help="synthetic arithmetic word problems")
    p.add_argument(
        "--magpie",
        type=int,
        default=0,
        help="sample this many user queries from the target itself (Magpie), then filter them",
    )
    p.add_argument(
        "--followups",
        type=int,
        default=0,
        help="continue this many of the data's conversations with a second user message the "
        "target writes itself (Magpie's way), and train on those conversations too",
    )
    p.add_argument(
        "--prompts",
        help='your own prompts: a JSON-lines file, one {"prompt": ...} or {"messages": [...]} '
        "per line",
    )
    p.add_argument(
        "--max-prompts",
        type=int,
        help="use only the first N prompts (after the seeded shuffle): train on the responses "
        "generated so far, and grow the run later with a larger N or none",
    )
    mode = p.add_mutually_exclusive_group()
    mode.add_argument(
        "--data-only",
        action="store_true",
        help="stop after generating the training data (prompts and responses)",
    )
    mode.add_argument(
        "--train-only",
        action="store_true",
        help="train on the run's data as it is (data.safetensors in --output, e.g. the "
        "committed training-data/ copied there): no prompt source is read and nothing is "
        "generated, so the benchmark prompt packages the overlap check needs are not needed",
    )
    p.add_argument("--max-new-tokens", type=int, default=256, help="response length cap")
    p.add_argument("--batch-size", type=int, default=16, help="generation batch size")
    p.add_argument("--dtype", default="bfloat16", help="target dtype for data and features")
    p.add_argument(
        "--device",
        default=None,
        help="where the target generates data and features and the drafter trains: cpu, cuda, "
        "cuda:1 ... (default: cuda if available); a run may move between devices and resume",
    )


def _add_loss_terms(p: argparse.ArgumentParser) -> None:
    """The weights of the loss's terms, and the target's distribution the L1 and LK terms use."""
    p.add_argument(
        "--ce-weight",
        type=float,
        default=1.0,
        help="weight of the cross-entropy on the target's greedy tokens (default 1)",
    )
    p.add_argument(
        "--l1-weight",
        type=float,
        default=0.0,
        help="weight of L1 = sum |p - q| = 2 TV between the target's and the drafter's "
        "distributions over the draft vocabulary, at each block position (default 0; DSpark's "
        "recipe: --ce-weight 0.1 --l1-weight 0.9)",
    )
    p.add_argument(
        "--lk-weight",
        type=float,
        default=0.0,
        help="weight of the LK term -log(1 - TV), the negative log of the acceptance "
        "(LK-alpha of arXiv 2602.23881; default 0)",
    )
    p.add_argument(
        "--target-topk",
        type=int,
        default=None,
        help="store the target's K most likely draft-vocabulary tokens per response position "
        "with the context features (4K + 8 bytes per token), for the L1 and LK terms and the "
        "per-position 1 - TV of the evaluation (default: 32 when --l1-weight or --lk-weight is "
        "set, else none; 0: none)",
    )


def add_training_options(p: argparse.ArgumentParser) -> None:
    """The drafter's shape, the training schedule and loss, and the export options."""
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-layers", type=int, default=1, help="drafter layers")
    p.add_argument(
        "--feature-layers", type=int, default=3, help="target layers feeding the drafter"
    )
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument(
        "--stop-after",
        type=int,
        help="end this call after N more steps (saving a checkpoint); run again to go on",
    )
    p.add_argument(
        "--time-limit",
        type=float,
        metavar="MINUTES",
        help="end this call within MINUTES of its start, evaluated and saved, the learning-rate "
        "schedule shortened to the steps that fit (a later call resumes with --steps' schedule)",
    )
    p.add_argument("--anchors", type=int, default=32, help="blocks per sample per step")
    p.add_argument("--samples-per-step", type=int, default=4)
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--save-every", type=int, default=50)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument(
        "--eval-samples",
        type=int,
        help="held-out samples an evaluation's loss covers (the first in split order; default "
        "all of them)",
    )
    _add_step_options(p)


def _add_step_options(p: argparse.ArgumentParser) -> None:
    """How a step computes: compiled or not, where its features come from, the draft vocabulary,
    the precision and the position weights; then the loss terms, the seed and the export."""
    p.add_argument(
        "--compile",
        action="store_true",
        help="compile the drafter's training forward (torch.compile; compiling first takes a while)",
    )
    p.add_argument(
        "--features",
        choices=["auto", "cache", "step"],
        default="auto",
        help="the target's context features: cache (computed once, kept in memory and in "
        "features.safetensors), step (computed by the target for each step's samples: no cache, "
        "a target forward per step), or auto (cache where it takes at most half the free memory)",
    )
    p.add_argument(
        "--log-every",
        type=int,
        default=10,
        help="steps whose log entries are read back from the device at once (default 10)",
    )
    p.add_argument(
        "--draft-vocab-coverage",
        type=float,
        default=0.99,
        help="score only the most frequent response tokens that cover this share of them, plus "
        "the stop tokens (a draft vocabulary); 0 for the target's whole vocabulary",
    )
    p.add_argument(
        "--precision",
        choices=["auto", "bfloat16", "float32"],
        default="auto",
        help="autocast dtype of the training forward (weights and optimiser stay float32); auto: "
        "bfloat16 on a GPU or a CPU with AVX512-BF16, else float32 (without it, bfloat16 "
        "matmuls run several times slower than float32 ones)",
    )
    p.add_argument(
        "--loss-weighting",
        choices=["decay", "dpace"],
        default="decay",
        help="how block positions weigh in the loss: decay (exp(-(k-1)/7), the DFlash recipe) or "
        "dpace (by each position's expected share of the accepted length, D-PACE)",
    )
    p.add_argument(
        "--dpace-alpha",
        type=float,
        default=0.5,
        help="smoothing of the drafter's confidences under --loss-weighting dpace, in (0, 1]",
    )
    _add_loss_terms(p)
    p.add_argument(
        "--init-from",
        help="start a new run from this drafter's weights (released format) instead of random; "
        "a drafter with fewer layers than --num-layers is grown (new layers start as the identity)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--export", help="also write the final drafter here (released format)")
    p.add_argument("--export-dtype", default="bfloat16")
