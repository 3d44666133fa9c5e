"""The benchmark harness: AR, DFlash, DDTree (a budget grid) and CaDDTree on benchmark prompts.

One *work item* is a (temperature, dataset, prompt) triple. Every method runs on it back to back,
so machine noise hits all methods alike, in the listed order on even items and in reverse on odd
ones, so that no method always runs first (or straight after another); every method is warmed up
on a short untimed run before anything is timed. A record is written once the item's AR run is
done, so each record can say whether its output is identical to AR's. Rounds are timed by phase
with the device synchronised (:class:`caddtree.decoding.RoundStats`). Results are JSON lines, one record per
(dataset, prompt, method, temperature), written and flushed as they are made; see
``docs/benchmarking.md`` for the record schema. Next to ``results.jsonl`` the harness writes
``results.meta.json`` (the settings and the machine) and ``results.trees.jsonl`` (two CaDDTree
draft trees per dataset, for the report's Figure 6).

The AR baseline. Speed-ups are against the fastest plain decoding a user could pick on the
machine, and on a CPU that is not always the run's dtype (bfloat16 AR can be slower than float32
AR). ``ar`` is plain decoding in the run's ``--dtype``; ``ar-<dtype>`` (``ar-float32``,
``ar-bfloat16``, ...) is plain decoding of a second copy of the target in that dtype, in the same
run and on the same prompts; each record names its ``dtype``. ``caddtree report`` (and the summary
printed at the end) computes speed-ups against the fastest of them.

Resuming. Running again with the same ``--out`` skips every record already there, so an
interrupted run continues where it stopped; a torn last line (a kill mid-write) is dropped. The
settings that change the numbers (model pair, dtype, max new tokens, ...) must match the earlier
run's, or the harness refuses to mix them.

Multi-turn prompts (MT-Bench) are run as in the paper: each turn is appended after the model's own
answer to the previous turn, and the record sums the turns (``turns`` says how many).

Data parallel. Under ``torchrun --nproc-per-node N`` the work items are split round-robin over the
ranks (torch.distributed: gloo on CPU, nccl on CUDA, one GPU per rank). Each rank appends to its
own ``results.rankK.jsonl``; at the end the records are gathered on rank 0, which writes the
merged ``results.jsonl`` and removes the per-rank files.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import logging
import math
import os
import re
import sys
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .checks import check_int
from .errors import InvalidInputError
from .files import atomic_write_text

__all__ = [
    "ABLATIONS",
    "AR_DTYPES",
    "DEFAULT_BUDGETS",
    "DEFAULT_METHODS",
    "BenchConfig",
    "MethodSpec",
    "default_ar_dtypes",
    "init_distributed",
    "parse_methods",
    "read_records",
    "run_bench",
    "summary_table",
]

logger = logging.getLogger(__name__)

DEFAULT_BUDGETS = (16, 32, 64, 128, 256, 512, 1024)

DEFAULT_METHODS = ("ar", "dflash", "ddtree", "caddtree")
"""``--methods`` when it is not given; :func:`default_ar_dtypes` adds plain decoding in another
dtype to it."""

AR_DTYPES = {
    "float32": "float32",
    "fp32": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
    "float64": "float64",
    "fp64": "float64",
    "double": "float64",
}
"""Dtype names ``ar-<dtype>`` accepts, and the canonical name each one stands for."""

# CaDDTree cost-model variants of the paper's ablations: Table 2 (constant C_v) and Table 3
# (C_d and C_v scaled by 0.5 and 2).
ABLATIONS: dict[str, tuple[float, float] | None] = {
    "constant": None,
    "cd0.5": (0.5, 1.0),
    "cd2": (2.0, 1.0),
    "cv0.5": (1.0, 0.5),
    "cv2": (1.0, 2.0),
}

# The settings that change the measurements: a resumed run must match the earlier one in these.
_RUN_KEYS = (
    "target",
    "draft",
    "dtype",
    "device_type",
    "machine",
    "world_size",
    "max_new_tokens",
    "max_budget",
    "seed",
    "cost_model_digest",
)


@dataclass(frozen=True)
class MethodSpec:
    """One benchmarked method: ``label`` names it in the results (``ddtree-16``, ``caddtree-cv2``,
    ``ar-float32``), ``family`` is the decoding method, ``budget`` DDTree's node budget,
    ``variant`` the CaDDTree cost-model ablation (``None`` = the cost model as profiled), ``dtype``
    the dtype of the target copy plain decoding runs in (``ar-<dtype>``; ``None`` = the run's
    dtype)."""

    label: str
    family: str
    budget: int | None = None
    variant: str | None = None
    dtype: str | None = None

    @property
    def needs_cost_model(self) -> bool:
        return self.family == "caddtree"


def parse_methods(
    methods: Iterable[str],
    budgets: Sequence[int] = DEFAULT_BUDGETS,
    ablations: bool = False,
) -> list[MethodSpec]:
    """Method specs from names: ``ar``, ``ar-<dtype>`` (plain decoding of a copy of the target in
    that dtype, see :data:`AR_DTYPES`; ``ar-fp32`` is labelled ``ar-float32``), ``dflash``,
    ``ddtree`` (one per budget in ``budgets``), ``ddtree-<B>``, ``caddtree`` and
    ``caddtree-<variant>`` (see :data:`ABLATIONS`). ``ablations=True`` adds every CaDDTree
    variant. AR comes first (``ar`` itself, then the other dtypes), duplicates are dropped."""
    for b in budgets:
        if isinstance(b, bool) or not isinstance(b, int) or b < 1:
            raise InvalidInputError(f"DDTree budgets must be positive integers, got {b!r}")
    specs: dict[str, MethodSpec] = {}

    def add(spec: MethodSpec) -> None:
        specs.setdefault(spec.label, spec)

    names = list(methods)
    if ablations:
        names += [f"caddtree-{v}" for v in ABLATIONS]
    if not names:
        raise InvalidInputError("no methods to benchmark")
    for name in names:
        key = str(name).strip().lower()
        if key in ("ar", "dflash", "caddtree"):
            add(MethodSpec(key, key))
        elif key.startswith("ar-") and key[3:] in AR_DTYPES:
            dtype = AR_DTYPES[key[3:]]
            add(MethodSpec(f"ar-{dtype}", "ar", dtype=dtype))
        elif key == "ddtree":
            for b in budgets:
                add(MethodSpec(f"ddtree-{b}", "ddtree", budget=int(b)))
        elif key.startswith("ddtree-") and key[7:].isdigit() and int(key[7:]) > 0:
            add(MethodSpec(f"ddtree-{int(key[7:])}", "ddtree", budget=int(key[7:])))
        elif key.startswith("caddtree-") and key[9:] in ABLATIONS:
            add(MethodSpec(key, "caddtree", variant=key[9:]))
        else:
            raise InvalidInputError(
                f"unknown method {name!r}; use ar, ar-<dtype> (a dtype in "
                f"{', '.join(sorted(set(AR_DTYPES.values())))}), dflash, ddtree, ddtree-<budget>, "
                f"caddtree or caddtree-<variant> with a variant in {', '.join(ABLATIONS)}"
            )
    return sorted(specs.values(), key=lambda s: (s.family != "ar", s.label != "ar"))


def default_ar_dtypes(dtype: str, device_type: str) -> list[str]:
    """The dtypes of the plain-decoding baselines that the default ``--methods`` adds next to
    ``ar`` for a run in ``dtype`` (a canonical name, e.g. ``"bfloat16"``) on ``device_type``:
    the rule of :func:`caddtree.api.ar_baseline_dtypes`, which ``generate --compare-ar`` uses."""
    from .api import ar_baseline_dtypes, dtype_name

    return [dtype_name(d) for d in ar_baseline_dtypes(dtype, device_type)[1:]]


def variant_cost_model(cost_model: Any, variant: str | None) -> Any:
    """The cost model a CaDDTree variant decodes with."""
    from .cost import ConstantCostModel

    if variant is None:
        return cost_model
    if variant == "constant":
        try:
            return ConstantCostModel.from_cost_model(cost_model)
        except (AttributeError, TypeError):
            raise InvalidInputError(
                "the constant-cost ablation needs a profiled cost model (per-context curves)"
            ) from None
    draft, verify = ABLATIONS[variant]
    return cost_model.scaled(draft=draft, verify=verify)


@dataclass
class BenchConfig:
    """What to run. ``prompts`` maps a dataset name to its prompts (``caddtree.data``
    ``BenchmarkPrompt`` objects, or anything with ``id`` and ``turns``)."""

    prompts: dict[str, list[Any]]
    methods: list[MethodSpec]
    temperatures: Sequence[float] = (0.0,)
    max_new_tokens: int = 256
    max_budget: int = 1024
    seed: int = 0
    warmup: bool = True
    warmup_tokens: int = 32
    save_trees: bool = True

    def validate(self) -> None:
        if not self.prompts or not any(self.prompts.values()):
            raise InvalidInputError("no prompts to benchmark")
        if not self.methods:
            raise InvalidInputError("no methods to benchmark")
        for t in self.temperatures:
            if not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
                raise InvalidInputError(f"temperatures must be finite numbers >= 0, got {t!r}")
        for name, value in (
            ("max_new_tokens", self.max_new_tokens),
            ("max_budget", self.max_budget),
        ):
            check_int(name, value)


# ---- files ----------------------------------------------------------------------------------------


def _side_file(out: Path, suffix: str) -> Path:
    stem = out.name[: -len(".jsonl")] if out.name.endswith(".jsonl") else out.name
    return out.with_name(f"{stem}.{suffix}")


def meta_path(out: str | os.PathLike[str]) -> Path:
    return _side_file(Path(out), "meta.json")


def trees_path(out: str | os.PathLike[str]) -> Path:
    return _side_file(Path(out), "trees.jsonl")


def _rank_path(out: Path, rank: int, trees: bool = False) -> Path:
    return _side_file(out, f"trees.rank{rank}.jsonl" if trees else f"rank{rank}.jsonl")


def _rank_files(out: Path, trees: bool = False) -> list[Path]:
    """Per-rank files of a data-parallel run (any number of ranks), in rank order."""
    prefix = re.escape(_side_file(out, "trees." if trees else "").name)
    pattern = re.compile(prefix + r"rank(\d+)\.jsonl")
    found = [(m, p) for p in out.parent.iterdir() if (m := pattern.fullmatch(p.name))]
    return [p for m, p in sorted(found, key=lambda mp: int(mp[0].group(1)))]


def _tree_key(rec: dict[str, Any]) -> tuple:
    return (rec["dataset"], rec["prompt_index"], rec["method"], rec["temperature"], rec["round"])


def _consolidate(out: Path) -> None:
    """Fold what an interrupted run left behind into ``out`` and its trees file: per-rank files
    (of any number of ranks) and torn last lines. Later records win; the per-rank files go."""
    for trees, target, key in ((False, out, record_key), (True, trees_path(out), _tree_key)):
        parts = _rank_files(out, trees)
        text = target.read_text(encoding="utf-8") if target.is_file() else ""
        clean = text == "" or text.endswith("\n")
        if not parts and clean:
            continue
        merged: dict[tuple, dict[str, Any]] = {}
        for source in (target, *parts):
            for rec in read_records(source):
                merged[key(rec)] = rec
        atomic_write_text(target, "".join(json.dumps(r) + "\n" for r in merged.values()))
        for part in parts:
            part.unlink(missing_ok=True)


def parse_jsonl(path: Path, what: str) -> tuple[list[tuple[int, dict[str, Any]]], str | None]:
    """``(line number, object)`` for every non-blank line of the JSON-lines file ``path``, and a
    message when its last line was cut off (a kill mid-write, or a run still writing): that line
    is dropped. A bad line anywhere else is an :class:`InvalidInputError` naming it. Shared by
    ``caddtree bench`` (resuming) and ``caddtree report`` (reading), which differ only in how they
    treat a missing file and how they tell the user about a cut-off line."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidInputError(f"cannot read {what} file {path}: {exc}") from None
    lines = text.splitlines()
    last = max((i for i, line in enumerate(lines, start=1) if line.strip()), default=0)
    rows: list[tuple[int, dict[str, Any]]] = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            if number == last:
                return rows, (
                    f"{path.name} line {number} (the last) is cut off, as an interrupted or "
                    "still running benchmark leaves it"
                )
            raise InvalidInputError(
                f"{path} line {number}: not valid JSON ({exc.msg} at column {exc.colno}); fix or "
                "delete that line"
            ) from None
        if not isinstance(obj, dict):
            raise InvalidInputError(
                f"{path} line {number}: expected a JSON object (one record per line), "
                f"got {type(obj).__name__}"
            )
        rows.append((number, obj))
    return rows, None


def read_records(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The records of a results (or trees) file, empty if it does not exist. A cut-off last line
    is dropped (see :func:`parse_jsonl`): that record is run again."""
    path = Path(path)
    if not path.is_file():
        return []
    rows, cut_off = parse_jsonl(path, "results")
    if cut_off:
        logger.warning("%s; dropping it (that record is run again)", cut_off)
    return [obj for _, obj in rows]


def record_key(rec: dict[str, Any]) -> tuple[str, int, str, float]:
    return (rec["dataset"], int(rec["prompt_index"]), rec["method"], float(rec["temperature"]))


# ---- distributed ----------------------------------------------------------------------------------


@dataclass
class DistInfo:
    rank: int = 0
    world: int = 1
    device: str | None = None  # None = the caller's choice

    @property
    def distributed(self) -> bool:
        return self.world > 1


def init_distributed(device: str | None = None) -> DistInfo:
    """Join the process group when launched by ``torchrun`` (``WORLD_SIZE`` > 1): gloo on CPU,
    nccl on CUDA with one GPU per local rank. A single process needs nothing."""
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if world <= 1:
        return DistInfo(device=device)
    import torch
    import torch.distributed as dist

    local = int(os.environ.get("LOCAL_RANK", "0"))
    asks_cuda = device is not None and device.startswith("cuda")
    want_cuda = (device in (None, "auto") or asks_cuda) and torch.cuda.is_available()
    if asks_cuda and not torch.cuda.is_available():
        raise InvalidInputError("--device cuda was asked for, but CUDA is not available")
    if want_cuda:
        torch.cuda.set_device(local)
        device = f"cuda:{local}"
    else:
        device = "cpu"
    if not dist.is_initialized():
        # ranks finish at different times (prompts differ in length); the default timeout (10 min
        # for nccl) would kill the final gather of a long run
        dist.init_process_group(
            backend="nccl" if want_cuda else "gloo", timeout=datetime.timedelta(hours=72)
        )
    return DistInfo(rank=dist.get_rank(), world=dist.get_world_size(), device=device)


def _barrier(info: DistInfo) -> None:
    if info.distributed:
        import torch.distributed as dist

        dist.barrier()


# ---- running --------------------------------------------------------------------------------------


@dataclass
class _Outcome:
    token_ids: list[int] = field(default_factory=list)
    turns: int = 0
    new_tokens: int = 0
    wall_s: float = 0.0
    prefill_s: float = 0.0
    rounds: list[Any] = field(default_factory=list)
    stop_reason: str = ""
    trees: list[tuple[Any, Any, int]] = field(default_factory=list)  # (tree, stats, bonus)
    skipped: str | None = None


def _prompt_seed(seed: int, dataset: str, index: int, turn: int) -> int:
    return (seed * 1_000_003 + zlib.crc32(f"{dataset}/{index}/{turn}".encode())) % (2**63)


def _run_prompt(
    gen: Any,
    item: Any,
    spec: MethodSpec,
    cost_model: Any,
    temperature: float,
    config: BenchConfig,
    dataset: str,
    index: int,
    *,
    keep_trees: bool = False,
    max_new_tokens: int | None = None,
) -> _Outcome:
    """Run one method on one (possibly multi-turn) prompt."""
    max_new = max_new_tokens or config.max_new_tokens
    has_template = getattr(gen.tokenizer, "chat_template", None) is not None
    limit = gen.verifier.max_positions
    out = _Outcome()
    messages: list[dict[str, str]] = []
    raw = ""
    for turn, text in enumerate(item.turns):
        if has_template:
            messages.append({"role": "user", "content": text})
            prompt_ids = gen.encode(messages)
        else:
            raw = f"{raw}{text}" if not raw else f"{raw}\n\n{text}"
            prompt_ids = gen.encode(raw, chat=False)
        room = max_new if limit is None else min(max_new, limit - len(prompt_ids))
        if room < 1:
            out.skipped = (
                f"turn {turn + 1} has {len(prompt_ids)} prompt tokens; the model holds {limit}"
            )
            break
        trees: list[tuple[Any, Any]] = []
        res = gen.generate(
            prompt_ids,
            method=spec.family,
            budget=spec.budget,
            cost_model=cost_model if spec.needs_cost_model else None,
            max_budget=config.max_budget,
            temperature=temperature,
            max_new_tokens=room,
            seed=_prompt_seed(config.seed, dataset, index, turn) if temperature > 0 else None,
            tree_callback=(lambda t, s, acc=trees: acc.append((t, s)))
            if keep_trees and turn == 0
            else None,
        )
        s = res.stats
        if trees:  # the bonus of round r is the output token after the previous rounds' tokens
            at = 0
            for tree, stats in trees:
                out.trees.append((tree, stats, res.token_ids[at]))
                at += stats.committed
        out.token_ids.extend(res.token_ids)
        out.turns += 1
        out.new_tokens += s.new_tokens
        out.wall_s += s.wall_s
        out.prefill_s += s.prefill_s
        out.rounds.extend(s.per_round)
        out.stop_reason = s.stop_reason
        if has_template:
            messages.append({"role": "assistant", "content": res.text})
        else:
            raw = f"{raw}{res.text}"
    return out


def _digest(token_ids: Sequence[int]) -> str:
    return hashlib.sha256(json.dumps(list(token_ids)).encode()).hexdigest()[:20]


def _dtype_name(gen: Any) -> str:
    """The canonical name of the dtype ``gen``'s target runs in (``"bfloat16"``)."""
    from .api import dtype_name

    return dtype_name(gen.verifier.dtype)


def _record(
    dataset: str,
    index: int,
    item: Any,
    spec: MethodSpec,
    temperature: float,
    out: _Outcome,
    dtype: str | None = None,
) -> dict[str, Any]:
    rounds = out.rounds
    committed = [r.committed for r in rounds]
    return {
        "dataset": dataset,
        "prompt_index": index,
        "prompt_id": str(item.id),
        "method": spec.label,
        "family": spec.family,
        "budget": spec.budget,
        "variant": spec.variant,
        "dtype": dtype,
        "temperature": float(temperature),
        "turns": out.turns,
        "new_tokens": out.new_tokens,
        "rounds": len(rounds),
        "wall_s": out.wall_s,
        "prefill_s": out.prefill_s,
        "ms_per_token": 1e3 * out.wall_s / out.new_tokens if out.new_tokens else None,
        "tau": sum(committed) / len(committed) if committed else None,
        "budgets": [r.budget for r in rounds],
        "accepted": [r.accepted for r in rounds],
        "committed": committed,
        "context_lengths": [r.context_length for r in rounds],
        "confidence": [None if math.isnan(r.confidence) else r.confidence for r in rounds],
        "paths": [list(r.path) for r in rounds],
        "draft_s": sum(r.draft_s for r in rounds),
        "tree_s": sum(r.tree_s for r in rounds),
        "verify_s": sum(r.verify_s for r in rounds),
        "project_s": sum(r.project_s for r in rounds),
        "forward_s": sum(r.forward_s for r in rounds),
        "output_sha": _digest(out.token_ids),
        "matches_ar": None,
        "stop_reason": out.stop_reason,
        "skipped": out.skipped,
    }


def _tree_records(
    gen: Any, dataset: str, index: int, spec: MethodSpec, temperature: float, out: _Outcome
) -> list[dict[str, Any]]:
    """The rounds with the smallest and the largest non-empty tree, for Figure 6."""
    rounds = [(i, t) for i, t in enumerate(out.trees) if len(t[0]) > 0]
    if not rounds:
        return []
    small = min(rounds, key=lambda it: (len(it[1][0]), -it[1][1].accepted))
    large = max(rounds, key=lambda it: (len(it[1][0]), it[1][1].accepted))
    picked = [small] if small[0] == large[0] else [small, large]
    tok = gen.tokenizer

    def text(t: int) -> str:
        return tok.decode([int(t)]) if tok is not None else str(int(t))

    recs = []
    for i, (tree, stats, bonus) in picked:
        recs.append(
            {
                "dataset": dataset,
                "prompt_index": index,
                "method": spec.label,
                "temperature": float(temperature),
                "round": i,
                "budget": len(tree),
                "accepted": stats.accepted,
                "context_length": stats.context_length,
                "token_ids": [int(t) for t in tree.token_ids],
                "token_texts": [text(t) for t in tree.token_ids],
                "parents": [int(p) for p in tree.parents],
                "ranks": [int(r) for r in tree.ranks],
                "depths": [int(d) for d in tree.depths],
                "log_probs": [float(x) for x in tree.log_probs],
                "path": list(stats.path),
                "bonus_id": int(bonus),
                "bonus_text": text(bonus),
            }
        )
    return recs


def _check_meta(out: Path, meta: dict[str, Any], resume: bool) -> None:
    path = meta_path(out)
    if not resume or not path.is_file():
        return
    try:
        old = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(old, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as exc:
        # the guard against mixing settings must not turn off because its record is damaged
        raise InvalidInputError(
            f"{path} cannot be read ({exc}), so the results in {out} cannot be checked against "
            "this run's settings; restore the file, or pass --no-resume to start over"
        ) from None
    # an AR-only run has no drafter: adding drafting methods to it later is fine
    diff = [
        k
        for k in _RUN_KEYS
        if k in old
        and old.get(k) != meta.get(k)
        and not (k in ("draft", "cost_model_digest") and None in (old.get(k), meta.get(k)))
    ]
    if diff:
        what = ", ".join(f"{k}: {old.get(k)!r} then, {meta.get(k)!r} now" for k in diff)
        raise InvalidInputError(
            f"{out} holds results made with other settings ({what}); use another --out, or "
            "--no-resume to start it over"
        )


def run_bench(
    gen: Any,
    config: BenchConfig,
    out: str | os.PathLike[str],
    *,
    cost_model: Any = None,
    resume: bool = True,
    progress: bool = True,
    dist_info: DistInfo | None = None,
    meta: dict[str, Any] | None = None,
    ar_generators: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """Run ``config`` with the generator ``gen`` (a :class:`caddtree.SpeculativeGenerator`) and
    write the results to ``out`` (JSON lines). Returns every record of the results file (on rank 0
    of a distributed run; the other ranks return their own).

    ``ar_generators`` maps a dtype name (``"float32"``) to a generator whose target runs in that
    dtype (no drafter needed), for the ``ar-<dtype>`` methods; an ``ar-<dtype>`` in the run's own
    dtype without one uses ``gen``. Each record's ``dtype`` is the dtype its target ran in."""
    from tqdm.auto import tqdm

    config.validate()
    info = dist_info or DistInfo()
    gens = _generators(gen, config.methods, ar_generators or {})
    out = Path(out)
    if out.exists() and out.is_dir():
        raise InvalidInputError(f"--out {out} is a directory; give a .jsonl file path")
    out.parent.mkdir(parents=True, exist_ok=True)
    needs_cost = any(s.needs_cost_model for s in config.methods)
    if needs_cost and cost_model is None:
        raise InvalidInputError("CaDDTree methods need a cost model")
    if any(s.family != "ar" for s in config.methods) and gen.proposer is None:
        raise InvalidInputError("drafting methods need a drafter; load the generator with one")
    costs = {s.label: variant_cost_model(cost_model, s.variant) for s in config.methods}

    run_meta = dict(meta or {})
    run_meta.setdefault("max_new_tokens", config.max_new_tokens)
    run_meta.setdefault("max_budget", config.max_budget)
    run_meta.setdefault("seed", config.seed)
    run_meta.setdefault("world_size", info.world)
    if needs_cost:
        digest = json.dumps(cost_model.to_dict(), sort_keys=True, default=str)
        run_meta["cost_model_digest"] = hashlib.sha256(digest.encode()).hexdigest()[:16]
    _check_meta(out, run_meta, resume)
    if info.rank == 0:
        if not resume:
            for stale in (out, trees_path(out), *_rank_files(out), *_rank_files(out, True)):
                stale.unlink(missing_ok=True)
        _consolidate(out)
        old = {}
        if meta_path(out).is_file():
            with contextlib.suppress(ValueError):
                old = json.loads(meta_path(out).read_text(encoding="utf-8"))
        now = datetime.datetime.now().isoformat(timespec="seconds")
        run_meta["started"] = old.get("started", now) if resume else now
        run_meta["updated"] = now
        atomic_write_text(meta_path(out), json.dumps(run_meta, indent=1, default=str) + "\n")
    _barrier(info)

    done = {record_key(rec): rec for rec in read_records(out)}
    items = [
        (t, dataset, i, item)
        for t in config.temperatures
        for dataset, prompts in config.prompts.items()
        for i, item in enumerate(prompts)
    ]
    # split what is left (every rank sees the same results file), so a resumed run stays balanced
    left = [
        it
        for it in items
        if any((it[1], it[2], s.label, float(it[0])) not in done for s in config.methods)
    ]
    mine = left[info.rank :: info.world]
    todo = [
        (it, spec)
        for j, it in enumerate(mine)
        for spec in _method_order(config.methods, j)
        if (it[1], it[2], spec.label, float(it[0])) not in done
    ]
    part = _rank_path(out, info.rank) if info.distributed else out
    tree_part = _rank_path(out, info.rank, trees=True) if info.distributed else trees_path(out)
    if todo:
        if config.warmup:  # untimed: one short prompt per method, so no method pays for warm-up
            t, dataset, i, item = todo[0][0]
            for spec in config.methods:
                _run_prompt(
                    gens[spec.label],
                    item,
                    spec,
                    costs[spec.label],
                    0.0,
                    config,
                    dataset,
                    i,
                    max_new_tokens=config.warmup_tokens,
                )
        bar = tqdm(
            total=len(todo),
            desc=f"bench (rank {info.rank})" if info.distributed else "bench",
            unit="run",
            disable=not progress,
        )
        # AR of a work item may run after other methods (the order alternates): their records
        # wait for it, to say whether their output is AR's, and are written when it is known
        ar_todo = {(it[1], it[2], float(it[0])) for it, spec in todo if spec.label == "ar"}
        waiting: list[dict[str, Any]] = []
        with open(part, "a", encoding="utf-8") as fh:
            for (t, dataset, i, item), spec in todo:
                bar.set_postfix_str(f"{dataset}#{i} {spec.label} T={t:g}")
                keep = config.save_trees and spec.label == "caddtree" and t == 0 and i == 0
                g = gens[spec.label]
                outcome = _run_prompt(
                    g, item, spec, costs[spec.label], t, config, dataset, i, keep_trees=keep
                )
                rec = _record(dataset, i, item, spec, t, outcome, _dtype_name(g))
                if keep:  # before the record: once the record is there, the run is done
                    with open(tree_part, "a", encoding="utf-8") as tf:
                        for tr in _tree_records(gen, dataset, i, spec, t, outcome):
                            tf.write(json.dumps(tr) + "\n")
                done[record_key(rec)] = rec
                waiting.append(rec)
                if spec.label == "ar":
                    ar_todo.discard((dataset, i, float(t)))
                waiting = _write_settled(fh, waiting, done, ar_todo)
                bar.update(1)
            _write_settled(fh, waiting, done, set())
        bar.close()
    if not info.distributed:
        return list(done.values())
    return _gather(out, info, list(done.values()))


def _method_order(methods: Sequence[MethodSpec], item: int) -> list[MethodSpec]:
    """The order the methods run in on the ``item``-th work item: as listed on even items,
    reversed on odd ones, so that no method always runs first (or last) after another."""
    return list(methods) if item % 2 == 0 else list(reversed(methods))


def _write_settled(
    fh: Any,
    waiting: list[dict[str, Any]],
    done: dict[tuple, dict[str, Any]],
    ar_todo: set[tuple[str, int, float]],
) -> list[dict[str, Any]]:
    """Write (and flush) the records of ``waiting`` whose work item has no AR run to come (the
    keys of ``ar_todo``), with ``matches_ar`` against plain decoding in the run's dtype (for AR
    in other dtypes too; greedy only). Returns the records still waiting."""
    left = []
    for rec in waiting:
        key = (rec["dataset"], rec["prompt_index"], rec["temperature"])
        if key in ar_todo:
            left.append(rec)
            continue
        ar = done.get((*key[:2], "ar", key[2]))
        if ar is not None and rec["temperature"] == 0 and rec["method"] != "ar":
            rec["matches_ar"] = rec["output_sha"] == ar["output_sha"]
        fh.write(json.dumps(rec) + "\n")
    fh.flush()
    return left


def _generators(
    gen: Any, methods: Sequence[MethodSpec], ar_generators: dict[str, Any]
) -> dict[str, Any]:
    """The generator each method runs with (by label): ``gen``, or for ``ar-<dtype>`` the one of
    ``ar_generators`` in that dtype (``gen`` when there is none and that is the run's dtype)."""
    main = _dtype_name(gen)
    out = {}
    for spec in methods:
        if spec.dtype in ar_generators:
            other = ar_generators[spec.dtype]
            if _dtype_name(other) != spec.dtype:
                raise InvalidInputError(
                    f"the generator for {spec.label} runs in {_dtype_name(other)}, not {spec.dtype}"
                )
            out[spec.label] = other
        elif spec.dtype is None or spec.dtype == main:
            out[spec.label] = gen
        else:
            raise InvalidInputError(
                f"{spec.label} needs a copy of the target in {spec.dtype} (ar_generators); the "
                f"run's dtype is {main}"
            )
    return out


def _gather(out: Path, info: DistInfo, records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Collect every rank's records (and draft trees) on rank 0 with ``gather_object``, which
    works without a shared file system; rank 0 writes the merged files and the per-rank files go."""
    import torch.distributed as dist

    trees = read_records(_rank_path(out, info.rank, trees=True))
    gathered: list[Any] | None = [None] * info.world if info.rank == 0 else None
    dist.gather_object((records, trees), gathered, dst=0)
    if info.rank == 0:
        merged: dict[tuple, dict[str, Any]] = {}
        merged_trees = {_tree_key(t): t for t in read_records(trees_path(out))}
        for recs, trs in gathered:
            merged.update((record_key(r), r) for r in recs)
            merged_trees.update((_tree_key(t), t) for t in trs)
        records = sorted(
            merged.values(), key=lambda r: (r["temperature"], r["dataset"], r["prompt_index"])
        )
        atomic_write_text(out, "".join(json.dumps(r) + "\n" for r in records))
        if merged_trees:
            text = "".join(json.dumps(t) + "\n" for t in merged_trees.values())
            atomic_write_text(trees_path(out), text)
    dist.barrier()  # the merged file is complete before any per-rank file goes
    _rank_path(out, info.rank).unlink(missing_ok=True)
    _rank_path(out, info.rank, trees=True).unlink(missing_ok=True)
    return records


# ---- a quick summary ------------------------------------------------------------------------------


def summary_table(records: list[dict[str, Any]]) -> str:
    """Markdown tables, one per temperature: every method's median ms per token, speed-up over
    the fastest AR of each dataset (``ar`` or an ``ar-<dtype>``; marked "baseline" when there
    are several), pooled tau, budget and outputs identical to AR's, as ``caddtree report``
    computes them (:func:`caddtree.report.aggregate`, :func:`caddtree.report.method_table`)."""
    from .report import aggregate, method_table

    agg = aggregate(records)
    return "\n\n".join(
        f"{table.title}\n\n{table.markdown()}"
        for table in (method_table(agg, t) for t in agg.temperatures())
    )


# ---- command line ---------------------------------------------------------------------------------


def load_prompt_file(path: str | os.PathLike[str]) -> list[Any]:
    """Prompts from a JSON-lines file: one object per line with ``turns`` (a list of user
    messages) or ``prompt`` (one message), and optionally ``id``."""
    from .data import BenchmarkPrompt

    path = Path(path)
    if not path.is_file():
        raise InvalidInputError(f"prompt file {path} does not exist")
    prompts = []
    for i, line in enumerate(path.read_text(encoding="utf-8").splitlines()):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except ValueError as exc:
            raise InvalidInputError(f"{path}, line {i + 1}: not JSON ({exc})") from None
        turns = (
            obj.get("turns", [obj["prompt"]] if "prompt" in obj else None)
            if isinstance(obj, dict)
            else None
        )
        if (
            not isinstance(turns, list)
            or not turns
            or not all(isinstance(t, str) and t for t in turns)
        ):
            raise InvalidInputError(
                f"{path}, line {i + 1}: expected an object with 'turns' (a list of non-empty "
                "strings) or 'prompt' (a string)"
            )
        prompts.append(BenchmarkPrompt(str(obj.get("id", i)), path.stem, list(turns)))
    if not prompts:
        raise InvalidInputError(f"prompt file {path} holds no prompts")
    return prompts


def add_arguments(p: Any) -> None:
    """The ``caddtree bench`` options."""
    from .data import PAPER_BENCHMARKS

    p.add_argument("--target", help="target model (default: the built-in SmolLM2 pair)")
    p.add_argument("--draft", help="DFlash drafter for --target")
    p.add_argument(
        "--dtype",
        default="auto",
        help="auto, float32, bfloat16, float16, float64: the dtype of every method (ar-DTYPE "
        "excepted)",
    )
    p.add_argument("--device", help="cpu or cuda (default: cuda when available)")
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
        "caddtree-VARIANT. Default: ar dflash ddtree caddtree, and on a CPU the AR baseline in "
        "the other of float32/bfloat16 (ar-float32 for a bfloat16 run); speed-ups are against "
        "the fastest AR",
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
    p.add_argument("--seed", type=int, default=0, help="sampling seed base (temperature > 0)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def cli_main(args: Any) -> int:
    """``caddtree bench``: see the module docstring."""
    import shlex

    import torch

    from . import __version__
    from .api import SpeculativeGenerator, machine_description, resolve_dtype
    from .cost import load_cost_model
    from .data import load_benchmark

    check_int("--max-samples", args.max_samples, allow_none=True)
    methods = list(DEFAULT_METHODS) if args.methods is None else args.methods
    specs = parse_methods(methods, args.budgets, args.ablations)
    if args.target is None and args.draft is not None:  # cheap checks before any data or model
        raise InvalidInputError("--draft needs --target (the model the drafter was trained for)")
    if args.target is not None and args.draft is None and any(s.family != "ar" for s in specs):
        raise InvalidInputError("drafting methods need --draft (a DFlash checkpoint)")
    resolve_dtype(args.dtype, torch.device("cpu"))
    config = BenchConfig(
        prompts={},
        methods=specs,
        temperatures=args.temperatures,
        max_new_tokens=args.max_new_tokens,
        max_budget=args.max_budget,
        seed=args.seed,
        warmup=not args.no_warmup,
    )
    # load every data set before any model: an unreachable one fails now, not an hour in
    from .data import PAPER_BENCHMARKS, canonical_benchmark_name

    datasets = args.datasets
    if datasets is None:
        datasets = [] if args.prompts else list(PAPER_BENCHMARKS)
    for name in dict.fromkeys(canonical_benchmark_name(n) for n in datasets):
        config.prompts[name] = load_benchmark(name, max_samples=args.max_samples)
    for file in args.prompts:
        items = load_prompt_file(file)
        config.prompts[Path(file).stem] = items[: args.max_samples] if args.max_samples else items
    config.validate()

    info = init_distributed(args.device)
    device = info.device if info.distributed else args.device
    from .defaults import resolve_model_pair

    args.target, args.draft, args.dtype = resolve_model_pair(args.target, args.draft, args.dtype)
    needs_draft = any(s.family != "ar" for s in specs)
    gen = SpeculativeGenerator.from_pretrained(
        args.target, args.draft if needs_draft else None, dtype=args.dtype, device=device
    )
    main_dtype = _dtype_name(gen)
    if args.methods is None:  # the default list: also AR in the dtype that may be faster here
        extra = default_ar_dtypes(main_dtype, gen.verifier.device.type)
        specs = parse_methods([*methods, *(f"ar-{d}" for d in extra)], args.budgets, args.ablations)
        config.methods = specs
    # one target-only copy per other dtype that plain decoding is measured in
    ar_gens = {
        s.dtype: SpeculativeGenerator.from_pretrained(
            args.target, None, dtype=s.dtype, device=gen.verifier.device
        )
        for s in specs
        if s.dtype is not None and s.dtype != main_dtype
    }
    cost = None
    if any(s.needs_cost_model for s in specs):
        if args.cost_model:
            cost = load_cost_model(args.cost_model)
        else:  # rank 0 profiles (once per machine, cached); the others then read the cache
            if info.rank == 0:
                cost = gen.cached_cost_model()
            _barrier(info)
            if cost is None:
                cost = gen.cached_cost_model()
    meta = {
        "target": str(args.target),
        "draft": str(args.draft) if needs_draft else None,
        "dtype": str(gen.verifier.dtype),
        "device_type": gen.verifier.device.type,
        "machine": machine_description(gen.verifier.device),
        "torch": torch.__version__,
        "caddtree": __version__,
        "threads": torch.get_num_threads(),
        "cost_model": args.cost_model or "profiled on this machine (cached)",
        "command": shlex.join(["caddtree", "bench", *sys.argv[2:]])
        if len(sys.argv) > 1 and sys.argv[1] == "bench"
        else None,
    }
    records = run_bench(
        gen,
        config,
        args.out,
        cost_model=cost,
        resume=not args.no_resume,
        progress=not args.no_progress,
        dist_info=info,
        meta=meta,
        ar_generators=ar_gens,
    )
    if info.rank == 0:
        print(summary_table(records))
        print(
            f"\nresults: {args.out} ({len(records)} records); tables and figures: "
            f"caddtree report {args.out}",
            file=sys.stderr,
        )
    if info.distributed:
        import torch.distributed as dist

        dist.destroy_process_group()
    return 0
