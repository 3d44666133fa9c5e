"""``caddtree train-drafter``: train a DFlash drafter for a target (prompts, regenerated responses,
features, training; resumable)."""

from __future__ import annotations

import argparse
import math
import sys
import time
from typing import Any

from ..arguments import add_target_argument
from ..util.checks import check_int
from ..util.errors import InvalidInputError
from .train_options import add_data_options, add_training_options


def train_drafter(args: argparse.Namespace) -> int:
    """Train a DFlash drafter for a target: regenerate responses with the frozen target, cache its
    context features, then train with anchor blocks. Resumes from OUTPUT if it holds a run."""
    import json
    from pathlib import Path

    from ..train import train_drafter as train
    from ..util.devices import resolve_device, resolve_dtype

    began = time.monotonic()
    _check_prompt_counts(args)
    config = _train_config(args)
    ranks = _join_ranks(args)
    target_dir = args.target
    if target_dir is None:
        from ..util.defaults import default_target_dir

        target_dir = default_target_dir()
    device = resolve_device(ranks.device if ranks.distributed else args.device)
    dtype = resolve_dtype(args.dtype, device)
    user_prompts = None
    if args.prompts:
        from ..train.magpie import read_prompt_file

        user_prompts = read_prompt_file(args.prompts)  # before any slow work: fail fast
    out = Path(args.output)
    if args.train_only:
        _require_data(out)  # before the target loads: fail fast
    out.mkdir(parents=True, exist_ok=True)

    target, tokenizer, stops = _load_target(target_dir, dtype, device)
    timings: dict[str, float] = {}
    if args.train_only:
        data = _existing_data(args, target, stops, out)
        prompts = {"total": len(data.sequences), "source": "the run's data as it was"}
    else:
        sources = _builtin_sources(args)
        if args.magpie:
            kept = _magpie_prompts(args, target, tokenizer, stops, out, timings)
            sources["magpie"] = lambda: kept
        if user_prompts is not None:
            sources["file"] = lambda: user_prompts
        model = (target, tokenizer, stops)
        prompt_set, data = _prompts_and_data(args, config, model, sources, out, timings)
        _write_heldout_prompts(data, config, prompt_set.prompts, out)
        prompts = {
            "total": len(prompt_set.prompts),
            **prompt_set.sources,
            "dropped_overlap": prompt_set.overlap,
            "dropped_duplicates": prompt_set.duplicates,
        }
        if args.data_only:
            return 0
    t0 = time.perf_counter()
    final = train(
        target,
        data,
        out,
        config,
        stop_after=args.stop_after,
        stop_token_ids=stops,
        init_from=args.init_from,
        deadline=None if args.time_limit is None else began + 60 * args.time_limit,
        ranks=ranks,
    )
    if ranks.distributed:
        import torch.distributed as dist

        dist.destroy_process_group()
        if ranks.rank != 0:
            return 0
    timings["train_s"] = round(time.perf_counter() - t0, 1)
    record = _run_record(target_dir, dtype, device, prompts, data, config, out, final, timings)
    (out / "run.json").write_text(json.dumps(record, indent=1))
    if args.export:
        _export_drafter(args, out)
    print(json.dumps(final))
    return 0


def _join_ranks(args: argparse.Namespace) -> Any:
    """The process group under torchrun (:func:`~caddtree.util.ranks.init_distributed`), which
    trains only: the data is made by one process first."""
    from ..util.ranks import init_distributed

    ranks = init_distributed(args.device)
    if ranks.distributed and not args.train_only:
        raise InvalidInputError(
            "under torchrun, train-drafter trains only: make the data in one process first "
            "(caddtree train-drafter ... --data-only), then run torchrun with --train-only"
        )
    return ranks


def _check_prompt_counts(args: argparse.Namespace) -> None:
    """Check the count options before any work; --code may not ask for more prompts than the
    standard library gives."""
    from ..train import prompts as prompt_data

    check_int("--stop-after", args.stop_after, allow_none=True)
    check_int("--max-prompts", args.max_prompts, allow_none=True)
    check_int("--eval-samples", args.eval_samples, allow_none=True)
    limit = args.time_limit
    if limit is not None and not (math.isfinite(limit) and limit > 0):
        raise InvalidInputError(f"--time-limit must be a number of minutes > 0, got {limit}")
    for flag, count in (
        ("--sharegpt", args.sharegpt),
        ("--code", args.code),
        ("--math", args.math),
        ("--magpie", args.magpie),
        ("--followups", args.followups),
    ):
        check_int(flag, count, minimum=0)
    code_pool = len(prompt_data.stdlib_code_prompts())
    if args.code > code_pool:
        raise InvalidInputError(
            f"--code {args.code} asks for more code prompts than this Python's standard library "
            f"gives ({code_pool}); use at most that many, or add "
            "prompts of your own with --prompts"
        )


def _train_config(args: argparse.Namespace) -> Any:
    """The validated :class:`caddtree.train.TrainConfig` of the options."""
    from ..train import TrainConfig

    config = TrainConfig(
        block_size=args.block_size,
        num_layers=args.num_layers,
        num_feature_layers=args.feature_layers,
        steps=args.steps,
        anchors_per_sample=args.anchors,
        samples_per_step=args.samples_per_step,
        learning_rate=args.lr,
        warmup_steps=args.warmup,
        seed=args.seed,
        save_every=args.save_every,
        eval_every=args.eval_every,
        log_every=args.log_every,
        eval_samples=args.eval_samples,
        compile=args.compile,
        features=args.features,
        draft_vocab_coverage=args.draft_vocab_coverage or None,
        precision=training_precision(args.precision, args.device),
        loss_weighting=args.loss_weighting,
        dpace_alpha=args.dpace_alpha,
        ce_weight=args.ce_weight,
        l1_weight=args.l1_weight,
        lk_weight=args.lk_weight,
        target_topk=args.target_topk,
    )
    config.validate()
    return config


def training_precision(choice: str, device: Any) -> str:
    """``--precision``: ``auto`` is bfloat16 where bfloat16 matmuls are fast (CUDA, or a CPU with
    AVX512-BF16), else float32; ``device`` is ``--device``."""
    import torch

    from ..util.devices import resolve_device

    if choice != "auto":
        return choice
    if resolve_device(device).type == "cuda" or torch.cpu._is_avx512_bf16_supported():
        return "bfloat16"
    return "float32"


def _load_target(target_dir: Any, dtype: Any, device: Any) -> tuple[Any, Any, list[int]]:
    """The frozen target (linear layers packed), its tokenizer and its stop token ids."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..api import eos_token_ids
    from ..runtime.packing import pack_linear_layers

    target = AutoModelForCausalLM.from_pretrained(
        target_dir, dtype=dtype, attn_implementation="sdpa"
    ).to(device)
    # data generation and context features run the frozen target many times: on the CPU, lay
    # its linear weights out for oneDNN once (caddtree.runtime.packing; training steps, which
    # need gradients through its head, fall back to the plain layer)
    pack_linear_layers(target)
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    stops = sorted(eos_token_ids(tokenizer, target))
    return target, tokenizer, stops


def _builtin_sources(args: argparse.Namespace) -> dict[str, Any]:
    """The built-in prompt sources by name, each a function giving its prompts."""
    import random

    from ..train import prompts as prompt_data

    rng = random.Random(args.seed)
    sources: dict = {
        "sharegpt": lambda: prompt_data.sharegpt_prompts()[: args.sharegpt],
        # a larger --code adds prompts after the ones a smaller one chose (data can grow)
        "stdlib": lambda: prompt_data.stable_sample(
            rng, prompt_data.stdlib_code_prompts(), args.code
        ),
        "math": lambda: prompt_data.synthetic_math_prompts(args.math, seed=args.seed),
    }
    return sources


def _prompts_and_data(
    args: argparse.Namespace,
    config: Any,
    model: tuple[Any, Any, list[int]],
    sources: dict[str, Any],
    out: Any,
    timings: dict[str, float],
) -> tuple[Any, Any]:
    """The training prompts and their data. With --followups, the second turns of the data's
    conversations join the sources (those of the data already made first, so that it stays a
    prefix), and once the data has grown, those of its new conversations too."""
    from ..train import TrainingData

    target, tokenizer, stops = model
    path = out / "data.safetensors"
    followed: list[Any] = []
    if args.followups and TrainingData.exists(path):
        followed = _followup_prompts(args, model, TrainingData.load(path), out, timings)
    if args.followups:
        sources["followup"] = lambda: followed
    prompt_set = _choose_prompts(args, config, tokenizer, sources, out)
    data = _make_data(args, target, tokenizer, prompt_set.prompts, out, stops, timings)
    if args.followups:
        more = _followup_prompts(args, model, data, out, timings)
        if len(more) > len(followed):
            sources["followup"] = lambda: more
            prompt_set = _choose_prompts(args, config, tokenizer, sources, out)
            data = _make_data(args, target, tokenizer, prompt_set.prompts, out, stops, timings)
    return prompt_set, data


def _followup_prompts(
    args: argparse.Namespace,
    model: tuple[Any, Any, list[int]],
    data: Any,
    out: Any,
    timings: dict[str, float],
) -> list[Any]:
    """The second turns of the first --followups finished conversations of ``data`` that the
    filter keeps (:mod:`caddtree.train.followups`), sampled once into followups_raw.jsonl."""

    from ..train.followups import conversations, followup_prompts, generate_followups

    target, tokenizer, stops = model
    t0 = time.perf_counter()
    chats = conversations(data, tokenizer, args.followups)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stops[0]
    raw = generate_followups(
        target,
        tokenizer,
        chats,
        out / "followups_raw.jsonl",
        seed=args.seed,
        stop_token_ids=stops,
        pad_token_id=pad,
    )
    timings["followups_s"] = timings.get("followups_s", 0.0) + round(time.perf_counter() - t0, 1)
    prompts = followup_prompts(chats, raw)
    print(f"follow-ups: {len(prompts)} of {len(raw)} sampled second turns kept", file=sys.stderr)
    return prompts


def _magpie_prompts(
    args: argparse.Namespace,
    target: Any,
    tokenizer: Any,
    stops: list[int],
    out: Any,
    timings: dict[str, float],
) -> list[Any]:
    """Sample --magpie user queries from the target and keep those the filter passes."""

    from ..train.magpie import filter_queries, generate_queries

    t0 = time.perf_counter()
    raw = generate_queries(
        target,
        tokenizer,
        args.magpie,
        out / "magpie_raw.jsonl",
        seed=args.seed,
        stop_token_ids=stops,
    )
    timings["magpie_s"] = round(time.perf_counter() - t0, 1)
    magpie_report = filter_queries(raw)
    print(
        f"Magpie: {len(magpie_report.kept)} of {len(raw)} sampled queries kept "
        f"(dropped: {dict(magpie_report.dropped)})",
        file=sys.stderr,
    )
    return magpie_report.kept


def _choose_prompts(
    args: argparse.Namespace, config: Any, tokenizer: Any, sources: dict[str, Any], out: Any
) -> Any:
    """The training prompts: those of an earlier run's data first, in their order, then new
    ones from ``sources``."""
    from ..train import TrainingData, chat_prompt_ids, split_samples
    from ..train import prompts as prompt_data

    # responses made earlier stay first, in their order, and new prompts are appended after
    # them; the held-out side of each of their samples is recorded before the data grows
    existing: list[tuple[int, ...]] = []
    if TrainingData.exists(out / "data.safetensors"):
        earlier = TrainingData.load(out / "data.safetensors")
        existing = [
            tuple(s[:p].tolist()) for s, p in zip(earlier.sequences, earlier.prompt_lengths)
        ]
        split_samples(earlier, config, out / "split.json")
    prompt_set = prompt_data.build_training_prompts(
        args.max_prompts,
        seed=args.seed,
        sources=sources,
        existing=existing,
        key=lambda prompt: tuple(chat_prompt_ids(tokenizer, prompt)),
    )
    print(
        f"training prompts: {len(prompt_set.prompts)} {prompt_set.sources} "
        f"(dropped {prompt_set.overlap} overlapping a benchmark, {prompt_set.duplicates} duplicates)",
        file=sys.stderr,
    )
    return prompt_set


def _make_data(
    args: argparse.Namespace,
    target: Any,
    tokenizer: Any,
    prompts: list[Any],
    out: Any,
    stops: list[int],
    timings: dict[str, float],
) -> Any:
    """Generate (or extend) the training data: the target's responses to ``prompts``."""

    from ..train import prepare_data

    t0 = time.perf_counter()
    data = prepare_data(
        target,
        tokenizer,
        prompts,
        out / "data.safetensors",
        max_new_tokens=args.max_new_tokens,
        batch_size=args.batch_size,
        stop_token_ids=stops,
    )
    timings["data_s"] = round(time.perf_counter() - t0, 1)
    response_tokens = int(sum(len(s) - p for s, p in zip(data.sequences, data.prompt_lengths)))
    print(
        f"training data: {len(data.sequences)} samples, {response_tokens} response tokens",
        file=sys.stderr,
    )
    return data


def _require_data(out: Any) -> None:
    """--train-only needs the run's data."""
    from ..train import TrainingData

    if not TrainingData.exists(out / "data.safetensors"):
        raise InvalidInputError(
            f"--train-only trains on the run's data, and {out} has none (data.safetensors); "
            "generate it first (the same command without --train-only, or --data-only), or copy "
            "a run's data.safetensors (or the committed data.safetensors.xz) and split.json there"
        )


def _existing_data(args: argparse.Namespace, target: Any, stops: list[int], out: Any) -> Any:
    """--train-only: the run's data as it is (its first --max-prompts samples), checked against
    the target; no prompt source is read, so the benchmarks' prompt packages are not needed."""
    from ..train import TrainingData
    from ..train.data import describe_differences, target_fingerprint

    path = out / "data.safetensors"
    data = TrainingData.load(path)
    wanted = {"stops": sorted(stops), **target_fingerprint(target)}
    saved = {k: data.meta.get(k) for k in wanted}
    if saved != wanted:
        raise InvalidInputError(
            f"{path} holds responses for other {describe_differences(saved, wanted)}; train with "
            "the target and dtype that made them, or in another output directory"
        )
    if args.max_prompts is not None:
        data = TrainingData(
            data.sequences[: args.max_prompts], data.prompt_lengths[: args.max_prompts], data.meta
        )
    print(f"training data: {len(data.sequences)} samples of {path}", file=sys.stderr)
    return data


def _write_heldout_prompts(data: Any, config: Any, prompts: list[Any], out: Any) -> None:
    """Write the held-out samples' prompts, e.g. for `caddtree bench --prompts` to compare
    drafters on prompts no training step saw."""
    import json

    from ..train import split_samples
    from ..util.files import atomic_write_text

    heldout = [prompts[i] for i in split_samples(data, config, out / "split.json")[1]]
    atomic_write_text(
        out / "heldout_prompts.jsonl",
        "".join(json.dumps({"prompt": p}) + "\n" for p in heldout if isinstance(p, str)),
    )


def _run_record(
    target_dir: Any,
    dtype: Any,
    device: Any,
    prompts: dict[str, Any],
    data: Any,
    config: Any,
    out: Any,
    final: Any,
    timings: dict[str, float],
) -> dict[str, Any]:
    """What ``run.json`` records: the command, the target, the prompts, the data, the config,
    the draft vocabulary, the final evaluation and the timings."""
    import torch

    from ..train import draft_vocab_coverage, load_trained_drafter

    ids = load_trained_drafter(out).draft_token_ids
    draft_vocab = None
    if ids is not None:
        draft_vocab = {"size": ids.numel(), "coverage": draft_vocab_coverage(data, ids)}
    return {
        "command": "caddtree " + " ".join(sys.argv[1:]) if sys.argv else "",
        "target": str(target_dir),
        "dtype": str(dtype),
        "device": str(device),
        "prompts": prompts,
        "tokens": int(sum(len(s) for s in data.sequences)),
        "response_tokens": int(
            sum(len(s) - p for s, p in zip(data.sequences, data.prompt_lengths))
        ),
        "config": config.__dict__,
        "draft_vocab": draft_vocab,
        "final": final,
        "timings": timings,
        "torch": torch.__version__,
    }


def _export_drafter(args: argparse.Namespace, out: Any) -> None:
    """Write the trained drafter to --export (released format) in --export-dtype."""
    import torch

    from ..models import DFlashDraftModel
    from ..util.devices import resolve_dtype

    drafter = DFlashDraftModel.from_pretrained(
        out / "checkpoint", dtype=resolve_dtype(args.export_dtype, torch.device("cpu"))
    )
    drafter.save_pretrained(args.export)
    print(f"exported the drafter to {args.export}", file=sys.stderr)


def register(sub: argparse._SubParsersAction) -> None:
    """Add this sub-command's parser to ``sub``."""
    p = sub.add_parser(
        "train-drafter",
        help="train a DFlash drafter for a target (resumable)",
        description=train_drafter.__doc__,
    )
    add_target_argument(p)
    add_data_options(p)
    add_training_options(p)
    p.set_defaults(handler=train_drafter)
