"""The ``caddtree`` command line.

Every sub-command turns a :class:`~caddtree.errors.CaddtreeError` into a one-line message on
stderr and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
from collections.abc import Callable, Sequence

from .checks import check_int
from .errors import CaddtreeError, InvalidInputError

Handler = Callable[[argparse.Namespace], int]

# `tree-demo` bounds: a block of B positions over V tokens is a [B-1, V] float64 array per round.
DEMO_MAX_BLOCK_SIZE = 64
DEMO_MAX_VOCAB = 2**18


def _tree_demo(args: argparse.Namespace) -> int:
    """Build chain, DDTree and CaDDTree trees from synthetic drafter marginals and compare them."""
    import numpy as np

    from .cost import ConvexCostModel
    from .tree import build_caddtree, build_chain, build_ddtree, topk_log_probs

    B, V = args.block_size, args.vocab
    if not 2 <= B <= DEMO_MAX_BLOCK_SIZE:
        raise InvalidInputError(
            f"--block-size must be between 2 and {DEMO_MAX_BLOCK_SIZE} (the bonus token and at "
            f"least one drafted position), got {B}"
        )
    if not 4 * (B - 1) <= V <= DEMO_MAX_VOCAB:
        raise InvalidInputError(
            f"--vocab must be between {4 * (B - 1)} (the demo plants 4 likely tokens, distinct "
            f"across the block's {B - 1} drafted positions) and {DEMO_MAX_VOCAB}, got {V}"
        )
    if args.rounds < 0 or args.seed < 0:
        raise InvalidInputError(
            f"--rounds and --seed must be non-negative integers, got {args.rounds} and {args.seed}"
        )
    rng = np.random.default_rng(args.seed)
    L = B - 1
    # A synthetic verification cost: flat up to 16 nodes, then 0.5 ms per node (a gentler slope than
    # DESIGN.md reports for SmolLM2-135M on a 2-core CPU), growing with context length.
    n = np.arange(0, 1025, 8)
    measurements = {
        length: (
            n,
            0.030 + 0.004 * length / 1024 + 0.0005 * np.maximum(n - 16, 0) * (1 + length / 4096),
        )
        for length in (0, 1024, 2048, 4096)
    }
    cost = ConvexCostModel.fit(measurements, draft_cost=0.012, metadata={"synthetic": True})
    print("Synthetic verification-cost fit (seconds in, ms shown):")
    print(cost.fit_report())
    print()
    header = f"{'round':>5} {'confidence':>10} {'context':>7} | {'chain phi':>9} | {'DDTree-64 phi':>13} | {'CaDDTree n*':>11} {'phi':>6} {'theta* gain':>11}"
    print(header)
    print("-" * len(header))
    for r in range(args.rounds):
        sharpness = rng.uniform(8.0, 20.0)  # low = an uncertain drafter, high = a confident one
        logits = rng.normal(0, 1, (L, V))
        # four plausible tokens per position, the drafter growing less sure with depth
        boost = np.sort(rng.uniform(0.75, 1.0, (L, 4)), axis=1)[:, ::-1]
        boost *= sharpness * np.linspace(1.0, 0.6, L)[:, None]
        logits[np.arange(L)[:, None], rng.choice(V, (L, 4), replace=False)] += boost
        context = int(rng.integers(0, 4096))
        topk = topk_log_probs(logits, 1024)
        chain = build_chain(logits)
        dd = build_ddtree(topk, 64)
        ca = build_caddtree(topk, cost, context)
        table = cost.round_cost_table(context, max(len(ca), 64))
        gain = ((1 + ca.phi) / table[len(ca)]) / ((1 + dd.phi) / table[64])
        confidence = float(np.exp(topk.log_probs[0, 0]))
        print(
            f"{r:>5} {confidence:>10.3f} {context:>7} | {chain.phi:>9.3f} | {dd.phi:>13.3f} | "
            f"{len(ca):>11} {ca.phi:>6.2f} {gain:>10.2f}x"
        )
    print()
    print("CaDDTree picks n* per round to maximise (1 + phi(n)) / (C_d + C_v(n; l));")
    print("'theta* gain' is its surrogate throughput over a fixed 64-node DDTree.")
    return 0


def _resolve_pair(args: argparse.Namespace) -> None:
    """Fill in ``args.target``/``args.draft`` and ``args.dtype`` (see
    :func:`caddtree.defaults.resolve_model_pair`)."""
    from .defaults import resolve_model_pair

    args.target, args.draft, args.dtype = resolve_model_pair(args.target, args.draft, args.dtype)


def _chat_template_kwargs(text: str | None) -> dict | None:
    """``--chat-template-kwargs``: a JSON object, checked (a one-line error otherwise)."""
    import json

    from .checks import check_chat_template_kwargs

    if text is None:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidInputError(
            f"--chat-template-kwargs is not valid JSON ({exc.msg} at character {exc.pos}); give "
            """an object such as '{"enable_thinking": false}'"""
        ) from None
    if not isinstance(value, dict):
        raise InvalidInputError(
            "--chat-template-kwargs must be a JSON object such as "
            f"""'{{"enable_thinking": false}}', got {text!r}"""
        )
    return check_chat_template_kwargs(value)


def _speed_line(s) -> str:
    """Time to first token, decode speed and draft acceptance of one run's statistics."""
    speed = "-" if s.decode_tokens_per_s is None else f"{s.decode_tokens_per_s:.1f}"
    line = f"TTFT {1e3 * s.ttft_s:.0f} ms  decode {speed} tok/s"
    if s.draft_tokens:
        line += (
            f"  draft acceptance {s.draft_acceptance_rate:.1%} ({s.accepted_tokens} of "
            f"{s.draft_tokens} nodes)  mean acceptance length {s.mean_acceptance_length:.2f}"
        )
    return line


def _generate(args: argparse.Namespace) -> int:
    """Generate a continuation of PROMPT with one decoding method and print text and statistics."""
    import json

    import torch

    from .api import (
        SpeculativeGenerator,
        ar_baseline_dtypes,
        check_text,
        check_tree_budgets,
        dtype_name,
        explain_divergence,
        make_sampler,
        resolve_dtype,
    )
    from .checks import check_stop
    from .cost import load_cost_model
    from .streaming import IncrementalDecoder

    if args.target is not None and args.method != "ar" and args.draft is None:
        raise InvalidInputError(f"--method {args.method} needs --draft (a DFlash checkpoint)")
    if args.budget is not None and args.method != "ddtree":
        raise InvalidInputError("--budget only applies to --method ddtree")
    if args.method == "ddtree" and args.budget is None:
        args.budget = 64
    # check what needs no model before spending time on loading one
    check_text(args.prompt)
    check_tree_budgets(
        args.method, args.budget, args.max_budget, names=("--budget", "--max-budget")
    )
    check_int("max_new_tokens", args.max_new_tokens)
    make_sampler(
        args.temperature,
        args.top_p,
        args.seed,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
    )
    check_stop(args.stop)
    template_kwargs = _chat_template_kwargs(args.chat_template_kwargs)
    if template_kwargs and args.raw:
        raise InvalidInputError(
            "--chat-template-kwargs only applies with the chat template (not --raw)"
        )
    resolve_dtype(args.dtype, torch.device("cpu"))
    if args.cost_model is not None:
        args.cost_model = load_cost_model(args.cost_model)
    if args.ar_dtypes is not None and not args.compare_ar:
        raise InvalidInputError("--ar-dtypes only applies with --compare-ar")
    ar_dtypes = args.ar_dtypes or "auto"
    if ar_dtypes not in ("auto", "same"):
        ar_dtypes = [d.strip() for d in ar_dtypes.split(",") if d.strip()]
    ar_baseline_dtypes(torch.float32, "cpu", ar_dtypes)  # a bad name fails before any loading
    _resolve_pair(args)
    gen = SpeculativeGenerator.from_pretrained(
        args.target,
        args.draft if args.method != "ar" or args.compare_ar else None,
        dtype=args.dtype,
        device=args.device,
        cost_model=args.cost_model,
    )
    if args.method == "caddtree" and gen.cost_model is None:
        # no silent fallback: profile this machine once (cached), and say so
        gen.cost_model = gen.cached_cost_model()
    # Plain AR decoding to compare with: in the run's own dtype first (the lossless reference), then
    # in any dtype plain decoding may be faster in on this device (a float32 copy of the target
    # for a bfloat16/float16 run on the CPU), so the speed-up is over the fastest AR a user could
    # pick, not over a slow baseline.
    ar_gens = []
    if args.compare_ar and args.method != "ar":
        run_dtype, device = gen.verifier.dtype, gen.verifier.device
        for dtype in ar_baseline_dtypes(run_dtype, device, ar_dtypes):
            if dtype == run_dtype:
                ar_gens.append(gen)
            else:
                ar_gens.append(
                    SpeculativeGenerator.from_pretrained(
                        args.target, None, dtype=dtype, device=device
                    )
                )

    streaming = not args.json and not args.no_stream and gen.tokenizer is not None
    text_stream = IncrementalDecoder(gen.tokenizer) if streaming else None

    def stream(_stats, tokens):
        if text_stream is not None:
            print(text_stream.push(tokens), end="", flush=True)

    # the same prompt and sampling settings for every run, the AR baselines' included
    common = {
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "min_p": args.min_p,
        "repetition_penalty": args.repetition_penalty,
        "stop": args.stop,
        "max_new_tokens": args.max_new_tokens,
        "seed": args.seed,
        "chat": False if args.raw else None,
        "chat_template_kwargs": template_kwargs or None,
    }
    if ar_gens:
        # Untimed warm-up of every timed run (the method, and AR in each dtype) on the same prompt,
        # so one-time costs (lazy initialisation, allocator growth, first-call kernel choices)
        # fall on none of them; the first timed run used to pay for them all.
        warm = {**common, "max_new_tokens": min(8, args.max_new_tokens)}
        gen.generate(
            args.prompt, method=args.method, budget=args.budget, max_budget=args.max_budget, **warm
        )
        for ar_gen in ar_gens:
            ar_gen.generate(args.prompt, method="ar", **warm)
    result = gen.generate(
        args.prompt,
        method=args.method,
        budget=args.budget,
        max_budget=args.max_budget,
        callback=stream,
        **common,
    )
    # the timed AR runs, in the order of ar_gens (the same-dtype one first), each with its dtype
    ar_runs = [
        (ar_gen.verifier.dtype, ar_gen.generate(args.prompt, method="ar", **common))
        for ar_gen in ar_gens
    ]
    baseline = ar_runs[0][1] if ar_runs else None  # AR in the run's dtype: the lossless reference
    divergence = None
    if baseline is not None and args.temperature == 0:
        # greedy: the outputs should be identical; if not, say why (after the timed runs)
        divergence = explain_divergence(
            gen,
            result.prompt_ids,
            baseline.token_ids,
            result.token_ids,
            method=result.method,
            tree_nodes=round(result.stats.budget_mean),
        )
    # the speed-up is over the fastest AR run (the same-dtype one on a tie)
    fastest = min(range(len(ar_runs)), key=lambda i: ar_runs[i][1].stats.ms_per_token, default=0)

    def ar_key(i: int) -> str:
        return "ar" if i == 0 else f"ar_{dtype_name(ar_runs[i][0])}"

    if args.json:
        out = result.to_dict(per_round=args.per_round)
        if baseline is not None:
            out["dtype"] = dtype_name(gen.verifier.dtype)
            for i, (dtype, run) in enumerate(ar_runs):
                record = run.to_dict()
                record["dtype"] = dtype_name(dtype)
                if i > 0 and args.temperature == 0:  # information only: dtypes round differently
                    record["same_tokens_as_method"] = run.token_ids == result.token_ids
                out[ar_key(i)] = record
            out["baseline"] = ar_key(fastest)
            out["speedup_over_ar"] = (
                ar_runs[fastest][1].stats.ms_per_token / result.stats.ms_per_token
            )
            out["speedup_over_same_dtype_ar"] = (
                baseline.stats.ms_per_token / result.stats.ms_per_token
            )
            if args.temperature == 0:
                out["divergence"] = None if divergence is None else divergence.to_dict()
        print(json.dumps(out))
        return 0
    if args.no_stream:
        print(result.text)
    else:
        print(text_stream.flush() if text_stream is not None else "")
    rows = [(result, gen.verifier.dtype, "")]
    for i, (dtype, run) in enumerate(ar_runs):
        note = "  <- baseline (fastest AR)" if len(ar_runs) > 1 and i == fastest else ""
        rows.append((run, dtype, note))
    for res, dtype, note in rows:
        s = res.stats
        budget = (
            ""
            if s.method == "ar"
            else f"  mean budget {s.budget_mean:.1f} (std {s.budget_std:.1f})"
        )
        print(
            f"[{s.method} {dtype_name(dtype)}] {s.new_tokens} tokens in {s.rounds} rounds  "
            f"tau {s.tau:.2f}{budget}  {s.ms_per_token:.1f} ms/token  ({s.stop_reason}){note}",
            file=sys.stderr,
        )
        print(f"  {_speed_line(s)}", file=sys.stderr)
    if baseline is not None:
        same = "identical output" if baseline.token_ids == result.token_ids else "outputs differ"
        if args.temperature > 0:
            same = "sampled: outputs may differ"
        speedup = ar_runs[fastest][1].stats.ms_per_token / result.stats.ms_per_token
        if len(ar_runs) == 1:
            print(
                f"speed-up of {result.method} over AR, same run: {speedup:.2f}x ({same})",
                file=sys.stderr,
            )
        else:
            others = ", ".join(
                f"{run.stats.ms_per_token / result.stats.ms_per_token:.2f}x against AR in "
                f"{dtype_name(dtype)}"
                for i, (dtype, run) in enumerate(ar_runs)
                if i != fastest
            )
            print(
                f"speed-up of {result.method} over AR, same run: {speedup:.2f}x against AR in "
                f"{dtype_name(ar_runs[fastest][0])}, the fastest AR ({others})",
                file=sys.stderr,
            )
            info = ""
            if args.temperature == 0:
                info = "".join(
                    f"; AR in {dtype_name(dtype)} gives "
                    + (
                        "the same tokens"
                        if run.token_ids == result.token_ids
                        else "other tokens (information only: another dtype rounds differently)"
                    )
                    for dtype, run in ar_runs[1:]
                )
            print(
                f"lossless check against AR in {dtype_name(ar_runs[0][0])}: {same}{info}",
                file=sys.stderr,
            )
        if divergence is not None:
            print(divergence.describe(), file=sys.stderr)
    return 0


def _profile(args: argparse.Namespace) -> int:
    """Measure this machine's verification cost C_v(n; l) (the median over --trials of one target
    forward over a tree of n nodes after l context tokens) and drafting cost C_d, fit the paper's
    convex, non-decreasing cost model, and save it as JSON for `generate --cost-model`."""
    from pathlib import Path

    import torch

    from . import profiling
    from .api import SpeculativeGenerator, machine_description, resolve_dtype

    quick = args.quick
    lengths = args.context_lengths
    if lengths is None:
        lengths = profiling.QUICK_CONTEXT_LENGTHS if quick else profiling.PAPER_CONTEXT_LENGTHS
    counts = args.node_counts
    if counts is None:
        counts = profiling.QUICK_NODE_COUNTS if quick else profiling.PAPER_NODE_COUNTS
    trials = args.trials if args.trials is not None else (3 if quick else 5)
    warmup = args.warmup if args.warmup is not None else (1 if quick else 2)
    # check what needs no model before spending time on loading one
    lengths, counts = profiling.check_profile_grid(lengths, counts, trials, warmup)
    resolve_dtype(args.dtype, torch.device("cpu"))
    out = Path(args.out)
    if out.is_dir():
        raise InvalidInputError(f"--out {out} is a directory; give a file name such as cost.json")
    if args.plot is not None:
        from .plots import pyplot

        if Path(args.plot).suffix.lower() not in (".png", ".pdf", ".svg"):
            raise InvalidInputError(f"--plot {args.plot}: use a .png, .pdf or .svg file name")
        pyplot()  # a missing matplotlib is reported now, not after a long profile
    if args.target is not None and args.draft is None:
        raise InvalidInputError("profiling needs --draft too: C_d is the drafter's cost")
    _resolve_pair(args)
    gen = SpeculativeGenerator.from_pretrained(
        args.target, args.draft, dtype=args.dtype, device=args.device
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
        f"caddtree: profiling {args.target} with drafter {args.draft} on "
        f"{machine_description(gen.verifier.device)} ({str(gen.verifier.dtype).removeprefix('torch.')}): "
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
    saved = model.save(out)
    print("verification cost C_v(n; l), convex fit per context length:")
    print(model.fit_report())
    print(
        f"drafting cost C_d = {model.draft_cost * 1e3:.3f} ms per drafter pass "
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
    return 0


def _train_drafter(args: argparse.Namespace) -> int:
    """Train a DFlash drafter for a target: regenerate responses with the frozen target, cache its
    context features, then train with anchor blocks. Resumes from OUTPUT if it holds a run."""
    import json
    import random
    import time

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .api import eos_token_ids, resolve_dtype
    from .train import TrainConfig, prepare_data, train_drafter
    from .train import prompts as prompt_data

    check_int("--stop-after", args.stop_after, allow_none=True)
    check_int("--max-prompts", args.max_prompts, allow_none=True)
    for flag, count in (
        ("--sharegpt", args.sharegpt),
        ("--code", args.code),
        ("--math", args.math),
        ("--magpie", args.magpie),
    ):
        check_int(flag, count, minimum=0)
    code_pool = len(prompt_data.stdlib_code_prompts())
    if args.code > code_pool:
        raise InvalidInputError(
            f"--code {args.code} asks for more code prompts than this Python's standard library "
            f"gives ({code_pool}); use at most that many, or add "
            "prompts of your own with --prompts"
        )

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
        draft_vocab_coverage=args.draft_vocab_coverage or None,
        precision=args.precision,
    )
    config.validate()
    target_dir = args.target
    if target_dir is None:
        from .defaults import default_target_dir

        target_dir = default_target_dir()
    dtype = resolve_dtype(args.dtype, torch.device("cpu"))
    user_prompts = None
    if args.prompts:
        from .train.magpie import read_prompt_file

        user_prompts = read_prompt_file(args.prompts)  # before any slow work: fail fast
    out = __import__("pathlib").Path(args.output)
    out.mkdir(parents=True, exist_ok=True)

    target = AutoModelForCausalLM.from_pretrained(
        target_dir, dtype=dtype, attn_implementation="sdpa"
    )
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    stops = sorted(eos_token_ids(tokenizer, target))
    timings = {}

    rng = random.Random(args.seed)
    sources: dict = {
        "sharegpt": lambda: prompt_data.sharegpt_prompts()[: args.sharegpt],
        "stdlib": lambda: rng.sample(prompt_data.stdlib_code_prompts(), args.code),
        "math": lambda: prompt_data.synthetic_math_prompts(args.math, seed=args.seed),
    }
    magpie_report = None
    if args.magpie:
        from .train.magpie import filter_queries, generate_queries

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
        sources["magpie"] = lambda: magpie_report.kept
    if user_prompts is not None:
        sources["file"] = lambda: user_prompts
    prompt_set = prompt_data.build_training_prompts(
        args.max_prompts, seed=args.seed, sources=sources
    )
    print(
        f"training prompts: {len(prompt_set.prompts)} {prompt_set.sources} "
        f"(dropped {prompt_set.overlap} overlapping a benchmark, {prompt_set.duplicates} duplicates)",
        file=sys.stderr,
    )
    t0 = time.perf_counter()
    data = prepare_data(
        target,
        tokenizer,
        prompt_set.prompts,
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
    # the held-out samples' prompts, e.g. for `caddtree bench --prompts` to compare drafters on
    # prompts no training step saw
    from .files import atomic_write_text
    from .train import split_samples

    heldout = [prompt_set.prompts[i] for i in split_samples(data, config)[1]]
    atomic_write_text(
        out / "heldout_prompts.jsonl",
        "".join(json.dumps({"prompt": p}) + "\n" for p in heldout if isinstance(p, str)),
    )
    if args.data_only:
        return 0
    t0 = time.perf_counter()
    final = train_drafter(
        target,
        data,
        out,
        config,
        stop_after=args.stop_after,
        stop_token_ids=stops,
        init_from=args.init_from,
    )
    timings["train_s"] = round(time.perf_counter() - t0, 1)
    from .train import draft_vocab_coverage, load_trained_drafter

    ids = load_trained_drafter(out).draft_token_ids
    draft_vocab = None
    if ids is not None:
        draft_vocab = {"size": ids.numel(), "coverage": draft_vocab_coverage(data, ids)}
    record = {
        "command": "caddtree " + " ".join(sys.argv[1:]) if sys.argv else "",
        "target": str(target_dir),
        "dtype": str(dtype),
        "prompts": {
            "total": len(prompt_set.prompts),
            **prompt_set.sources,
            "dropped_overlap": prompt_set.overlap,
            "dropped_duplicates": prompt_set.duplicates,
        },
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
    (out / "run.json").write_text(json.dumps(record, indent=1))
    if args.export:
        from .models import DFlashDraftModel

        drafter = DFlashDraftModel.from_pretrained(
            out / "checkpoint", dtype=resolve_dtype(args.export_dtype, torch.device("cpu"))
        )
        drafter.save_pretrained(args.export)
        print(f"exported the drafter to {args.export}", file=sys.stderr)
    print(json.dumps(final))
    return 0


def _bench(args: argparse.Namespace) -> int:
    """Benchmark AR, DFlash, DDTree (a budget grid) and CaDDTree on benchmark prompts; results
    are JSON lines (resumable), summarised at the end. Runs data-parallel under torchrun."""
    from .bench import cli_main

    return cli_main(args)


def _report(args: argparse.Namespace) -> int:
    """Write the paper's tables (Markdown and LaTeX) and figures from `caddtree bench` results:
    report.md, tables.tex and PNGs in --out. Missing side files (results.meta.json,
    results.trees.jsonl) are skipped with a note."""
    from pathlib import Path

    from .bench.report import build_report

    out = args.out if args.out is not None else Path(args.results).parent / "report"
    report = build_report(args.results, out, cost_model=args.cost_model)
    for table in report.tables:
        if table.key.startswith("table1_"):
            print(f"## {table.title}\n\n{table.markdown()}\n")
    for note in report.notes:
        print(f"note: {note}", file=sys.stderr)
    for path in report.files:
        print(f"wrote {path}", file=sys.stderr)
    return 0


def _serve(args: argparse.Namespace) -> int:
    """`caddtree serve`: see :func:`caddtree.serve.main`."""
    from .serve import main as serve_main  # MissingDependencyError without the serve extra

    return serve_main(args.serve_args)


def _build_parser() -> argparse.ArgumentParser:
    from .checks import MAX_TREE_NODES, METHODS

    parser = argparse.ArgumentParser(
        prog="caddtree",
        description="Lossless speculative decoding with cost-aware diffusion draft trees.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser(
        "tree-demo",
        help="compare chain, DDTree and CaDDTree trees on synthetic drafter marginals",
        description=_tree_demo.__doc__,
    )
    p.add_argument("--rounds", type=int, default=8, help="number of synthetic rounds (default 8)")
    p.add_argument("--block-size", type=int, default=16, help="drafter block size B (default 16)")
    p.add_argument("--vocab", type=int, default=32000, help="vocabulary size (default 32000)")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(handler=_tree_demo)

    p = sub.add_parser(
        "generate",
        help="generate text with AR, DFlash, DDTree or CaDDTree",
        description=_generate.__doc__,
    )
    p.add_argument("prompt", help="the prompt (wrapped in the chat template unless --raw)")
    p.add_argument(
        "--target", help="target model: a local directory or hub id (default: built-in SmolLM2)"
    )
    p.add_argument("--draft", help="DFlash drafter: a local directory or hub id")
    p.add_argument("--method", choices=METHODS, default="caddtree")
    p.add_argument("--budget", type=int, help="node budget for --method ddtree (default 64)")
    p.add_argument(
        "--max-budget", type=int, default=1024, help="largest CaDDTree tree (default 1024)"
    )
    p.add_argument(
        "--cost-model",
        help="cost-model file for --method caddtree (JSON or published .pt); default: profile "
        "this machine once and cache the result",
    )
    p.add_argument(
        "--compare-ar",
        action="store_true",
        help="also run plain AR decoding and print the speed-up (each run warmed up untimed "
        "first); the speed-up is over the fastest AR timed (see --ar-dtypes), the identical-output "
        "check against AR in the run's own dtype",
    )
    p.add_argument(
        "--ar-dtypes",
        metavar="auto|same|DTYPES",
        help="with --compare-ar: dtypes to time plain AR in besides the run's own, comma-separated "
        "(e.g. float32); 'auto' (default) adds float32 for a bfloat16/float16 run on the CPU "
        "(loading a float32 copy of the target), where float32 is often faster; 'same' times AR "
        "in the run's dtype only",
    )
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (1 = off)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k best (0 = off)")
    p.add_argument(
        "--min-p",
        type=float,
        default=0.0,
        help="drop tokens below this fraction of the best token's probability (0 = off)",
    )
    p.add_argument(
        "--repetition-penalty",
        type=float,
        default=1.0,
        help="penalise tokens already in the context, greedy or sampling (1 = off; e.g. 1.1)",
    )
    p.add_argument(
        "--stop",
        action="append",
        metavar="TEXT",
        help="stop after the token that completes TEXT (kept in the output); repeatable",
    )
    p.add_argument(
        "--chat-template-kwargs",
        metavar="JSON",
        help="""extra chat-template arguments as a JSON object, e.g. '{"enable_thinking": false}'""",
    )
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--dtype", default="auto", help="auto, float32, bfloat16, float16 or float64")
    p.add_argument(
        "--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda if available)"
    )
    p.add_argument("--seed", type=int, default=None, help="sampling seed")
    p.add_argument("--raw", action="store_true", help="do not apply the chat template")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.add_argument("--per-round", action="store_true", help="with --json: include per-round stats")
    p.add_argument("--no-stream", action="store_true", help="print the text at the end only")
    p.set_defaults(handler=_generate)

    p = sub.add_parser(
        "profile",
        help="measure this machine's cost model (C_v and C_d) and save it as JSON",
        description=_profile.__doc__,
    )
    p.add_argument(
        "--target", help="target model: a local directory or hub id (default: built-in SmolLM2)"
    )
    p.add_argument("--draft", help="DFlash drafter: a local directory or hub id")
    p.add_argument("--dtype", default="auto", help="auto, float32, bfloat16, float16 or float64")
    p.add_argument(
        "--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda if available)"
    )
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
    p.add_argument("--trials", type=int, help="timed runs per point, median kept (default 5)")
    p.add_argument("--warmup", type=int, help="untimed runs before them (default 2)")
    p.add_argument("--out", default="cost.json", help="cost-model JSON file (default cost.json)")
    p.add_argument("--plot", help="also draw Figure 4 (latency vs nodes) to this .png/.pdf/.svg")
    p.add_argument(
        "--quick",
        action="store_true",
        help="a small grid (about a minute for a small model on a CPU): 3 context lengths, up to "
        "256 nodes, 3 trials, 1 warm-up",
    )
    p.set_defaults(handler=_profile)

    p = sub.add_parser(
        "train-drafter",
        help="train a DFlash drafter for a target (resumable)",
        description=_train_drafter.__doc__,
    )
    p.add_argument("--target", help="target model directory or hub id (default: built-in SmolLM2)")
    p.add_argument(
        "--output", required=True, help="run directory (data, features, checkpoint, log)"
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
    p.add_argument(
        "--data-only",
        action="store_true",
        help="stop after generating the training data (prompts and responses)",
    )
    p.add_argument("--max-new-tokens", type=int, default=256, help="response length cap")
    p.add_argument("--batch-size", type=int, default=16, help="generation batch size")
    p.add_argument("--dtype", default="bfloat16", help="target dtype for data and features")
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
    p.add_argument("--anchors", type=int, default=32, help="blocks per sample per step")
    p.add_argument("--samples-per-step", type=int, default=4)
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--save-every", type=int, default=50)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument(
        "--draft-vocab-coverage",
        type=float,
        default=0.99,
        help="score only the most frequent response tokens that cover this share of them, plus "
        "the stop tokens (a draft vocabulary); 0 for the target's whole vocabulary",
    )
    p.add_argument(
        "--precision",
        choices=["bfloat16", "float32"],
        default="bfloat16",
        help="autocast dtype of the training forward (weights and optimiser stay float32)",
    )
    p.add_argument(
        "--init-from",
        help="start a new run from this drafter's weights (released format) instead of random",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--export", help="also write the final drafter here (released format)")
    p.add_argument("--export-dtype", default="bfloat16")
    p.set_defaults(handler=_train_drafter)

    from .bench import add_arguments as bench_arguments

    p = sub.add_parser(
        "bench",
        help="benchmark AR, DFlash, DDTree and CaDDTree on the paper's datasets",
        description=_bench.__doc__,
    )
    bench_arguments(p)
    p.set_defaults(handler=_bench)

    p = sub.add_parser(
        "report",
        help="the paper's tables and figures from `caddtree bench` results",
        description=_report.__doc__,
    )
    p.add_argument("results", help="results.jsonl written by `caddtree bench`")
    p.add_argument("--out", help="output folder (default: report/ next to RESULTS)")
    p.add_argument("--cost-model", help="cost-model file: also draw Fig. 4 (the cost profile)")
    p.set_defaults(handler=_report)

    # The server's options live in caddtree.serve, which needs the optional fastapi and uvicorn:
    # its arguments pass through untouched (`caddtree serve --help` prints its own help).
    p = sub.add_parser(
        "serve",
        help="serve the models with an OpenAI-compatible HTTP API (pip install 'caddtree[serve]')",
        add_help=False,
        prefix_chars="\0",
    )
    p.add_argument("serve_args", nargs="*")
    p.set_defaults(handler=_serve)
    return parser


def _quiet_broken_pipe() -> int:
    """Exit quietly after the reader of our output went away (``caddtree ... | head``), as Unix
    tools do: point stdout and stderr at /dev/null, so that the interpreter's final flush does not
    raise again, and return the status of a process ended by SIGPIPE (see the Python
    documentation's note on SIGPIPE)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    for stream in (sys.stdout, sys.stderr):
        # not every stream is a real file (e.g. under a test)
        with contextlib.suppress(OSError, ValueError, AttributeError):
            os.dup2(devnull, stream.fileno())
    os.close(devnull)
    return 128 + getattr(signal, "SIGPIPE", 13)


class _StderrLines(logging.Handler):
    """The command line's view of the library's log: ``caddtree: message`` on stderr, written to
    whatever ``sys.stderr`` is when the record is emitted."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            prefix = "caddtree: warning: " if record.levelno >= logging.WARNING else "caddtree: "
            sys.stderr.write(prefix + self.format(record) + "\n")
            sys.stderr.flush()
        except Exception:  # noqa: BLE001 - logging must never end the program
            self.handleError(record)


def _install_log_handler() -> None:
    """Show the library's info messages and warnings (once, however often ``main`` runs)."""
    root = logging.getLogger("caddtree")
    if not any(isinstance(h, _StderrLines) for h in root.handlers):
        root.addHandler(_StderrLines())
    root.setLevel(logging.INFO)


def main(argv: Sequence[str] | None = None) -> int:
    """Run one sub-command. Everything heavy (torch, transformers) is imported in here, after
    ``caddtree.cli`` itself has loaded, so a Ctrl-C during start-up ends as any other one does:
    "caddtree: interrupted" and exit status 130, no traceback."""
    _install_log_handler()
    try:
        parser = _build_parser()
        args = parser.parse_args(argv)
        handler: Handler = args.handler
        status = handler(args)
        sys.stdout.flush()  # a closed pipe is reported here, not at interpreter exit
        return status
    except CaddtreeError as exc:
        print(f"caddtree: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("caddtree: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return _quiet_broken_pipe()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
