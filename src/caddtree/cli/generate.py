"""``caddtree generate``: one generation with any method, its statistics, and with ``--compare-ar``
the speed-up over plain decoding and the lossless check (explaining a difference, if any)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from ..arguments import add_method_arguments, add_pair_arguments, check_pair_arguments, load_pair_of
from ..util.checks import (
    DEFAULT_DDTREE_BUDGET,
    DRAFTLESS_METHODS,
    check_chat_template_kwargs,
    check_int,
    check_sampling,
    check_stop,
    check_text,
    check_tree_budgets,
)
from ..util.errors import InvalidInputError


def _chat_template_kwargs(text: str | None) -> dict | None:
    """``--chat-template-kwargs``: a JSON object, checked (a one-line error otherwise)."""
    import json

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
    if s.copied_tokens:
        line += f"  copied {s.copied_share:.0%} of the tokens"
    return line


def _checked_settings(args: argparse.Namespace) -> tuple[int, Any, dict | None]:
    """Check every option that needs no model (a one-line error otherwise); returns the number
    of timed repeats, the AR dtypes to compare with and the chat-template keyword arguments."""
    import torch

    from ..util.devices import ar_baseline_dtypes

    check_pair_arguments(args)
    if args.budget is not None and args.method != "ddtree":
        raise InvalidInputError("--budget only applies to --method ddtree")
    if args.method == "ddtree" and args.budget is None:
        args.budget = DEFAULT_DDTREE_BUDGET
    if args.lookup and args.method not in ("ddtree", "caddtree"):
        raise InvalidInputError(
            "--lookup adds copies from the context to the trees of --method ddtree and caddtree "
            "(--method lookup decodes with copies alone)"
        )
    if args.lookup is None:  # the default: copies join the trees that take them
        args.lookup = args.method in ("ddtree", "caddtree")
    check_text(args.prompt)
    check_tree_budgets(
        args.method, args.budget, args.max_budget, names=("--budget", "--max-budget")
    )
    check_int("max_new_tokens", args.max_new_tokens)
    check_sampling(
        args.temperature,
        args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        seed=args.seed,
    )
    check_stop(args.stop)
    template_kwargs = _chat_template_kwargs(args.chat_template_kwargs)
    if template_kwargs and args.raw:
        raise InvalidInputError(
            "--chat-template-kwargs only applies with the chat template (not --raw)"
        )
    if args.ar_dtypes is not None and not args.compare_ar:
        raise InvalidInputError("--ar-dtypes only applies with --compare-ar")
    if args.repeats is not None and not args.compare_ar:
        raise InvalidInputError("--repeats only applies with --compare-ar")
    repeats = check_int("--repeats", 3 if args.repeats is None else args.repeats)
    ar_dtypes = args.ar_dtypes or "auto"
    if ar_dtypes not in ("auto", "same"):
        ar_dtypes = [d.strip() for d in ar_dtypes.split(",") if d.strip()]
    ar_baseline_dtypes(torch.float32, "cpu", ar_dtypes)  # a bad name fails before any loading
    return repeats, ar_dtypes, template_kwargs


def _ar_generators(gen: Any, args: argparse.Namespace, ar_dtypes: Any) -> list:
    """Plain decoding to compare with: in the run's own dtype first (the lossless reference),
    then in any dtype plain decoding may be faster in on this device (a float32 copy of the
    target for a bfloat16/float16 run on the CPU), so that the speed-up is over the fastest AR a
    user could pick, not over a slow baseline."""
    from ..api import SpeculativeGenerator
    from ..util.devices import ar_baseline_dtypes

    if not args.compare_ar or args.method == "ar":
        return []
    run_dtype, device = gen.verifier.dtype, gen.verifier.device
    return [
        gen
        if dtype == run_dtype
        else SpeculativeGenerator.from_pretrained(
            gen.source["target"],
            None,
            dtype=dtype,
            device=device,
            context_window=args.context_window,
            pack_weights=args.pack_weights,
            runtime=args.runtime,
            dequantize=getattr(args, "dequantize", False),
        )
        for dtype in ar_baseline_dtypes(run_dtype, device, ar_dtypes)
    ]


def generate(args: argparse.Namespace) -> int:
    """Generate a continuation of PROMPT with one decoding method and print text and statistics."""
    from ..bench.compare import compare_with_ar
    from ..util.streaming import IncrementalDecoder

    repeats, ar_dtypes, template_kwargs = _checked_settings(args)
    drafting = args.method not in DRAFTLESS_METHODS
    gen = load_pair_of(args, with_drafter=drafting or args.compare_ar)
    ar_gens = _ar_generators(gen, args, ar_dtypes)
    streaming = not args.json and not args.no_stream and gen.tokenizer is not None
    text_stream = IncrementalDecoder(gen.tokenizer) if streaming else None

    def stream(_stats: Any, tokens: list[int]) -> None:
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

    def run_method(k: int, overrides: dict) -> Any:  # the first timed run is streamed
        return gen.generate(
            args.prompt,
            method=args.method,
            budget=args.budget,
            max_budget=args.max_budget,
            lookup=args.lookup,
            callback=stream if k == 0 else None,
            **{**common, **overrides},
        )

    def ar_run(ar_gen: Any) -> Any:
        return lambda overrides: ar_gen.generate(
            args.prompt, method="ar", **{**common, **overrides}
        )

    compared = compare_with_ar(
        run_method,
        [(ar_gen.verifier.dtype, ar_run(ar_gen)) for ar_gen in ar_gens],
        repeats,
        warm_tokens=min(8, args.max_new_tokens),
    )
    divergence = _divergence(gen, compared, args)
    if args.json:
        print(_json_output(gen, compared, divergence, args))
        return 0
    if args.no_stream:
        print(compared.result.text)
    else:
        print(text_stream.flush() if text_stream is not None else "")
    _print_summary(gen, compared, divergence, args)
    return 0


def _divergence(gen: Any, compared: Any, args: argparse.Namespace) -> Any:
    """Greedy: the outputs should be identical; if not, why (after the timed runs)."""
    from ..bench.divergence import explain_divergence

    result, baseline = compared.result, compared.baseline
    if baseline is None or args.temperature != 0:
        return None
    return explain_divergence(
        gen,
        result.prompt_ids,
        baseline.token_ids,
        result.token_ids,
        method=result.method,
        tree_nodes=round(result.stats.budget_mean),
    )


def _ar_key(compared: Any, i: int) -> str:
    from ..util.devices import dtype_name

    return "ar" if i == 0 else f"ar_{dtype_name(compared.ar_runs[i][0])}"


def _json_output(gen: Any, compared: Any, divergence: Any, args: argparse.Namespace) -> str:
    import json

    from ..util.devices import dtype_name

    result, baseline = compared.result, compared.baseline
    out = result.to_dict(per_round=args.per_round)
    out["lookup"] = bool(args.lookup)
    if baseline is not None:
        out["dtype"] = dtype_name(gen.verifier.dtype)
        for i, (dtype, run) in enumerate(compared.ar_runs):
            record = run.to_dict()
            record["dtype"] = dtype_name(dtype)
            if i > 0 and args.temperature == 0:  # information only: dtypes round differently
                record["same_tokens_as_method"] = run.token_ids == result.token_ids
            out[_ar_key(compared, i)] = record
        out["baseline"] = _ar_key(compared, compared.fastest)
        out["repeats"] = len(compared.every_ms[0])
        keys = ["method", *(_ar_key(compared, i) for i in range(len(compared.ar_runs)))]
        out["ms_per_token_runs"] = dict(zip(keys, compared.every_ms))
        out["speedup_over_ar"] = compared.speedup
        out["speedup_over_same_dtype_ar"] = baseline.stats.ms_per_token / result.stats.ms_per_token
        if args.temperature == 0:
            out["divergence"] = None if divergence is None else divergence.to_dict()
    return json.dumps(out)


def _run_label(gen: Any, dtype: Any) -> str:
    """A run's dtype, and the weights it computed on where they are not of that dtype (the run's
    own dtype on a GGUF's quantized blocks: ``bfloat16, Q4_1+Q8_0 weights``)."""
    from ..util.devices import dtype_name

    name = dtype_name(dtype)
    weights = getattr(gen, "weight_format", name)
    if dtype == gen.verifier.dtype and weights != name:
        return f"{name}, {weights} weights"
    return name


def _method_label(method: str, args: argparse.Namespace) -> str:
    """The method as the summary names it: ``caddtree+lookup`` where copies joined its trees."""
    return f"{method}+lookup" if args.lookup and method in ("ddtree", "caddtree") else method


def _print_summary(gen: Any, compared: Any, divergence: Any, args: argparse.Namespace) -> None:
    """Each run's statistics, and with AR the timings, the speed-up and the lossless check, on
    stderr."""
    result, ar_runs, fastest = compared.result, compared.ar_runs, compared.fastest
    rows = [(result, gen.verifier.dtype, "")]
    for i, (dtype, run) in enumerate(ar_runs):
        note = "  <- baseline (fastest AR)" if len(ar_runs) > 1 and i == fastest else ""
        rows.append((run, dtype, note))
    for res, dtype, note in rows:
        s = res.stats
        method = _method_label(s.method, args) if res is result else s.method
        budget = (
            ""
            if s.method == "ar"
            else f"  mean budget {s.budget_mean:.1f} (std {s.budget_std:.1f})"
        )
        print(
            f"[{method} {_run_label(gen, dtype)}] {s.new_tokens} tokens in {s.rounds} rounds  "
            f"tau {s.tau:.2f}{budget}  {s.ms_per_token:.1f} ms/token  ({s.stop_reason}){note}",
            file=sys.stderr,
        )
        print(f"  {_speed_line(s)}", file=sys.stderr)
    if compared.baseline is None:
        return
    if len(compared.every_ms[0]) > 1:
        names = [f"{_method_label(result.method, args)} {_run_label(gen, gen.verifier.dtype)}"]
        names += [f"ar {_run_label(gen, dtype)}" for dtype, _ in ar_runs]
        print(
            f"each run timed {len(compared.every_ms[0])} times in alternating order and shown by "
            "its median (ms/token: "
            + "; ".join(
                f"{name} " + " ".join(f"{ms:.1f}" for ms in timed)
                for name, timed in zip(names, compared.every_ms)
            )
            + ")",
            file=sys.stderr,
        )
    _print_speedup(gen, compared, args)
    if divergence is not None:
        print(divergence.describe(), file=sys.stderr)


def _print_speedup(gen: Any, compared: Any, args: argparse.Namespace) -> None:
    result, ar_runs, fastest = compared.result, compared.ar_runs, compared.fastest
    name = _method_label(result.method, args)
    same = (
        "identical output" if compared.baseline.token_ids == result.token_ids else "outputs differ"
    )
    if args.temperature > 0:
        same = "sampled: outputs may differ"
    speedup = compared.speedup
    if len(ar_runs) == 1:
        print(
            f"speed-up of {name} over AR, same run: {speedup:.2f}x ({same})",
            file=sys.stderr,
        )
        return
    others = ", ".join(
        f"{run.stats.ms_per_token / result.stats.ms_per_token:.2f}x against AR in "
        f"{_run_label(gen, dtype)}"
        for i, (dtype, run) in enumerate(ar_runs)
        if i != fastest
    )
    print(
        f"speed-up of {name} over AR, same run: {speedup:.2f}x against AR in "
        f"{_run_label(gen, ar_runs[fastest][0])}, the fastest AR ({others})",
        file=sys.stderr,
    )
    info = ""
    if args.temperature == 0:
        info = "".join(
            f"; AR in {_run_label(gen, dtype)} gives "
            + (
                "the same tokens"
                if run.token_ids == result.token_ids
                else "other tokens (information only: another dtype rounds differently)"
            )
            for dtype, run in ar_runs[1:]
        )
    print(
        f"lossless check against AR in {_run_label(gen, ar_runs[0][0])}: {same}{info}",
        file=sys.stderr,
    )


def register(sub: argparse._SubParsersAction) -> None:
    """Add this sub-command's parser to ``sub``."""
    p = sub.add_parser(
        "generate",
        help="generate text with AR, DFlash, DDTree or CaDDTree",
        description=generate.__doc__,
    )
    p.add_argument("prompt", help="the prompt (wrapped in the chat template unless --raw)")
    add_pair_arguments(p)
    add_method_arguments(p)
    p.add_argument(
        "--compare-ar",
        action="store_true",
        help="also run plain AR decoding and print the speed-up (each run warmed up untimed "
        "first, then timed --repeats times); the speed-up is over the fastest AR timed (see "
        "--ar-dtypes), the identical-output check against AR in the run's own dtype",
    )
    p.add_argument(
        "--repeats",
        type=int,
        metavar="N",
        help="with --compare-ar: time the method and each AR run N times, alternating their "
        "order, and report each by its median run (default 3)",
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
    p.add_argument("--seed", type=int, default=None, help="sampling seed")
    p.add_argument("--raw", action="store_true", help="do not apply the chat template")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.add_argument("--per-round", action="store_true", help="with --json: include per-round stats")
    p.add_argument("--no-stream", action="store_true", help="print the text at the end only")
    p.set_defaults(handler=generate)
