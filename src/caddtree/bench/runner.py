"""The benchmark runner: AR, DFlash, DDTree (a budget grid) and CaDDTree on benchmark prompts.

One *work item* is a (temperature, dataset, prompt) triple. Every method runs on it back to back,
so machine noise hits all methods alike, in the listed order on even items and in reverse on odd
ones, so that no method always runs first (or straight after another); every method is warmed up
on a short untimed run before anything is timed. With ``repeats`` > 1 the item's methods run that
many times over, in alternating order each time round, and each record is its method's median
run (:func:`median_run`) with every run's wall time. A record is written once the item's AR run is
done, so each record can say whether its output is identical to AR's. Rounds are timed by phase
with the device synchronised (:class:`caddtree.engine.decoding.RoundStats`). Results are JSON lines, one
record per (dataset, prompt, method, temperature), written and flushed as they are made. Next to
``results.jsonl`` the runner writes ``results.meta.json`` (the settings and the machine) and
``results.trees.jsonl`` (two CaDDTree draft trees per dataset, for the report's Figure 6). The
files and records are defined in :mod:`caddtree.bench.results` (for users:
``docs/benchmarking.md``); the report reads them from there and this module never imports it.

The AR baseline. Speed-ups are against the fastest plain decoding a user could pick on the
machine, and on a CPU that is not always the run's dtype (bfloat16 AR can be slower than float32
AR). ``ar`` is plain decoding in the run's ``--dtype``; ``ar-<dtype>`` (``ar-float32``,
``ar-bfloat16``, ...) is plain decoding of a second copy of the target in that dtype, in the same
run and on the same prompts; each record names its ``dtype``. ``caddtree report`` (and the summary
printed at the end) computes speed-ups against the fastest of them.

Resuming. Running again with the same ``--out`` skips every record already there, so an
interrupted run continues where it stopped; a torn last line (a kill mid-write) is dropped. The
settings that change the numbers (model pair, dtype, max new tokens, ...) must match the earlier
run's, or the runner refuses to mix them.

Multi-turn prompts (MT-Bench) are run as in the paper: each turn is appended after the model's own
answer to the previous turn, and the record sums the turns (``turns`` says how many).

Data parallel. Under ``torchrun`` the work items left are split round-robin over the ranks; each
rank appends to its own part file and rank 0 merges them (:mod:`caddtree.bench.data_parallel`).
A rerun after a rank died folds its parts in, says what is missing and runs only that.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import math
import os
import statistics
import sys
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from ..util.checks import DRAFTLESS_METHODS, check_int
from ..util.errors import InvalidInputError
from ..util.files import atomic_write_text
from ..util.ranks import DistInfo, all_objects, from_rank0
from .data_parallel import gather_records
from .methods import MethodSpec, variant_cost_model
from .results import (
    RUN_KEYS,
    make_record,
    make_tree_record,
    meta_path,
    rank_files,
    rank_path,
    read_records,
    record_key,
    tree_key,
    trees_path,
    write_jsonl,
)

T = TypeVar("T")

__all__ = [
    "BenchConfig",
    "alternating_order",
    "generator_dtype",
    "run_bench",
]


@dataclass
class BenchConfig:
    """What to run. ``prompts`` maps a dataset name to its prompts
    (:class:`caddtree.bench.datasets.BenchmarkPrompt` objects, or anything with ``id`` and
    ``turns``)."""

    prompts: dict[str, list[Any]]
    methods: list[MethodSpec]
    temperatures: Sequence[float] = (0.0,)
    max_new_tokens: int = 256
    max_budget: int = 1024
    seed: int = 0
    warmup: bool = True
    warmup_tokens: int = 32
    save_trees: bool = True
    repeats: int = 1

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
            ("repeats", self.repeats),
        ):
            check_int(name, value)


# ---- files ----------------------------------------------------------------------------------------


def _consolidate(out: Path) -> None:
    """Fold what an interrupted run left behind into ``out`` and its trees file: per-rank files
    (of any number of ranks) and torn last lines. Later records win; the per-rank files go."""
    for trees, target, key in ((False, out, record_key), (True, trees_path(out), tree_key)):
        parts = rank_files(out, trees)
        text = target.read_text(encoding="utf-8") if target.is_file() else ""
        clean = text == "" or text.endswith("\n")
        if not parts and clean:
            continue
        merged: dict[tuple, dict[str, Any]] = {}
        for source in (target, *parts):
            for rec in read_records(source):
                merged[key(rec)] = rec
        write_jsonl(target, merged.values())
        for part in parts:
            part.unlink(missing_ok=True)


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
    """Run one method on one (possibly multi-turn) prompt. Copies' acceptance rates (lookup)
    start afresh for each, so a record does not depend on what ran before it."""
    from ..core.copies import CopyRates

    if spec.lookup or spec.family == "lookup":
        gen.copy_rates = CopyRates()
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
            lookup=spec.lookup,
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


def generator_dtype(gen: Any) -> str:
    """The canonical name of the dtype ``gen``'s target runs in (``"bfloat16"``)."""
    from ..util.devices import dtype_name

    return dtype_name(gen.verifier.dtype)


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

    return [
        make_tree_record(dataset, index, spec.label, temperature, i, tree, stats, bonus, text)
        for i, (tree, stats, bonus) in picked
    ]


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
    if "weights" not in old and "dtype" in old:  # runs before weight formats were recorded
        old = {**old, "weights": str(old["dtype"]).removeprefix("torch.")}
    # an AR-only run has no drafter: adding drafting methods to it later is fine
    diff = [
        k
        for k in RUN_KEYS
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
    if any(s.family not in DRAFTLESS_METHODS for s in config.methods) and gen.proposer is None:
        raise InvalidInputError("drafting methods need a drafter; load the generator with one")
    costs = {s.label: variant_cost_model(cost_model, s.variant) for s in config.methods}
    setup = _Setup(config, gen, gens, costs)

    run_meta = _run_meta(config, info, meta, cost_model if needs_cost else None)
    _check_meta(out, run_meta, resume)
    if info.rank == 0:
        _start_results(out, run_meta, resume)
    # every rank splits the work by rank 0's view of what is done (collective: rank 0 is ready)
    records = from_rank0(info, read_records(out) if info.rank == 0 else None)
    done = {record_key(rec): rec for rec in records}
    if info.rank == 0 and done:
        _say_missing(config, done, out)
    todo = _todo(config, done, info)
    if todo:
        if config.warmup:
            _warm_up(setup, todo)
        _run_todo(setup, todo, done, out, info, progress)
    if not info.distributed:
        return list(done.values())
    return gather_records(out, info, list(done.values()))


@dataclass
class _Setup:
    """What every run of a benchmark needs: the config, the main generator, and by method label
    the generator and the cost model that method runs with."""

    config: BenchConfig
    gen: Any
    gens: dict[str, Any]
    costs: dict[str, Any]

    def run(
        self, item: Any, spec: MethodSpec, temperature: float, dataset: str, index: int, **kw: Any
    ) -> _Outcome:
        """:func:`_run_prompt` with ``spec``'s generator and cost model."""
        gen, cost = self.gens[spec.label], self.costs[spec.label]
        return _run_prompt(gen, item, spec, cost, temperature, self.config, dataset, index, **kw)


def _run_meta(
    config: BenchConfig, info: DistInfo, meta: dict[str, Any] | None, cost_model: Any
) -> dict[str, Any]:
    """``meta`` with the settings that change the numbers, and a digest of ``cost_model`` (when
    the methods use one)."""
    run_meta = dict(meta or {})
    run_meta.setdefault("max_new_tokens", config.max_new_tokens)
    run_meta.setdefault("max_budget", config.max_budget)
    run_meta.setdefault("seed", config.seed)
    run_meta.setdefault("repeats", config.repeats)
    run_meta.setdefault("world_size", info.world)
    if info.distributed:  # each rank's machine, by rank (one process: ``machine`` says it)
        run_meta["machines"] = all_objects(info, run_meta.get("machine"))
    if cost_model is not None:
        digest = json.dumps(cost_model.to_dict(), sort_keys=True, default=str)
        run_meta["cost_model_digest"] = hashlib.sha256(digest.encode()).hexdigest()[:16]
    return run_meta


def _start_results(out: Path, run_meta: dict[str, Any], resume: bool) -> None:
    """Rank 0 before the run: clear the old files (without ``resume``), fold in what an
    interrupted run left, and write the meta file with its start and update times."""
    if not resume:
        for stale in (out, trees_path(out), *rank_files(out), *rank_files(out, True)):
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


def _items(config: BenchConfig) -> list[tuple[float, str, int, Any]]:
    """Every work item ``config`` asks for: (temperature, dataset, prompt index, prompt)."""
    return [
        (t, dataset, i, item)
        for t in config.temperatures
        for dataset, prompts in config.prompts.items()
        for i, item in enumerate(prompts)
    ]


def _run_key(item: tuple[float, str, int, Any], spec: MethodSpec) -> tuple[str, int, str, float]:
    """The record key (:func:`~caddtree.bench.results.record_key`) of ``spec`` on ``item``."""
    return (item[1], item[2], spec.label, float(item[0]))


def _say_missing(config: BenchConfig, done: dict[tuple, dict[str, Any]], out: Path) -> None:
    """Rank 0 resuming a run: how much of it ``out`` already holds, and which runs are missing
    (a rank that died, an interrupt), the ones this run does."""
    wanted = [_run_key(it, spec) for it in _items(config) for spec in config.methods]
    missing = [k for k in wanted if k not in done]
    if not missing:
        return
    named = ", ".join(f"{d}#{i} {m} T={t:g}" for d, i, m, t in missing[:8])
    more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
    print(
        f"bench: {out} holds {len(wanted) - len(missing)} of the {len(wanted)} runs asked for; "
        f"running the {len(missing)} missing: {named}{more}",
        file=sys.stderr,
    )


def _todo(
    config: BenchConfig, done: dict[tuple, dict[str, Any]], info: DistInfo
) -> list[tuple[tuple[float, str, int, Any], MethodSpec]]:
    """This rank's (work item, method) runs not yet in ``done``, each item's methods in
    alternating order."""
    # split what is left (every rank has rank 0's ``done``), so a resumed run stays balanced
    left = [it for it in _items(config) if any(_run_key(it, s) not in done for s in config.methods)]
    mine = left[info.rank :: info.world]
    return [
        (it, spec)
        for j, it in enumerate(mine)
        for spec in alternating_order(config.methods, j)
        if _run_key(it, spec) not in done
    ]


def _warm_up(setup: _Setup, todo: list[tuple[tuple[float, str, int, Any], MethodSpec]]) -> None:
    """Untimed: one short prompt per method, so no method pays for warm-up."""
    t, dataset, i, item = todo[0][0]
    for spec in setup.config.methods:
        setup.run(item, spec, 0.0, dataset, i, max_new_tokens=setup.config.warmup_tokens)


def _run_todo(
    setup: _Setup,
    todo: list[tuple[tuple[float, str, int, Any], MethodSpec]],
    done: dict[tuple, dict[str, Any]],
    out: Path,
    info: DistInfo,
    progress: bool,
) -> None:
    """Time every run of ``todo`` (each ``config.repeats`` times, the work item's methods in
    alternating order each time round) and append its record, made from its median run, and
    CaDDTree's draft trees to this rank's files; ``done`` gains each record."""
    from tqdm.auto import tqdm

    config = setup.config
    part = rank_path(out, info.rank) if info.distributed else out
    tree_part = rank_path(out, info.rank, trees=True) if info.distributed else trees_path(out)
    bar = tqdm(
        total=len(todo) * config.repeats,
        desc=f"bench (rank {info.rank})" if info.distributed else "bench",
        unit="run",
        disable=not progress,
    )
    # AR of a work item may run after other methods (the order alternates): their records
    # wait for it, to say whether their output is AR's, and are written when it is known
    ar_todo = {(it[1], it[2], float(it[0])) for it, spec in todo if spec.label == "ar"}
    waiting: list[dict[str, Any]] = []
    timed: dict[tuple[float, str, int, str], list[_Outcome]] = {}
    with open(part, "a", encoding="utf-8") as fh:
        for (t, dataset, i, item), spec, first in _repeated(todo, config.repeats):
            bar.set_postfix_str(f"{dataset}#{i} {spec.label} T={t:g}")
            keep = first and config.save_trees and spec.label == "caddtree" and t == 0 and i == 0
            runs = timed.setdefault((t, dataset, i, spec.label), [])
            runs.append(setup.run(item, spec, t, dataset, i, keep_trees=keep))
            bar.update(1)
            if len(runs) < config.repeats:
                continue
            del timed[(t, dataset, i, spec.label)]
            rec = _repeated_record(dataset, i, item, spec, t, runs, setup)
            if info.distributed:
                rec["rank"] = info.rank
            if runs[0].trees:  # before the record: once it is there, the run is done
                with open(tree_part, "a", encoding="utf-8") as tf:
                    for tr in _tree_records(setup.gen, dataset, i, spec, t, runs[0]):
                        tf.write(json.dumps(tr) + "\n")
            done[record_key(rec)] = rec
            waiting.append(rec)
            if spec.label == "ar":
                ar_todo.discard((dataset, i, float(t)))
            waiting = _write_settled(fh, waiting, done, ar_todo)
        _write_settled(fh, waiting, done, set())
    bar.close()


def _repeated(
    todo: list[tuple[tuple[float, str, int, Any], MethodSpec]], repeats: int
) -> list[tuple[tuple[float, str, int, Any], MethodSpec, bool]]:
    """``todo`` with each work item's runs (adjacent in ``todo``) ``repeats`` times over, in
    alternating order each time round, each flagged whether it is the first time round."""
    blocks: list[list[tuple[tuple[float, str, int, Any], MethodSpec]]] = []
    for entry in todo:
        if blocks and blocks[-1][0][0] == entry[0]:
            blocks[-1].append(entry)
        else:
            blocks.append([entry])
    return [
        (item, spec, k == 0)
        for block in blocks
        for k in range(repeats)
        for item, spec in alternating_order(block, k)
    ]


def _repeated_record(
    dataset: str,
    index: int,
    item: Any,
    spec: MethodSpec,
    temperature: float,
    runs: list[_Outcome],
    setup: _Setup,
) -> dict[str, Any]:
    """The record of ``runs`` (one method on one prompt, repeated): its median run's, with every
    run's wall time and whether all runs wrote the same tokens."""
    run = median_run(runs, key=lambda r: r.wall_s / max(r.new_tokens, 1))
    rec = make_record(
        dataset, index, item, spec, temperature, run, generator_dtype(setup.gens[spec.label])
    )
    rec["repeats"] = len(runs)
    rec["wall_s_runs"] = [r.wall_s for r in runs]
    rec["repeats_identical"] = all(r.token_ids == runs[0].token_ids for r in runs)
    return rec


def median_run(runs: Sequence[T], key: Callable[[T], float]) -> T:
    """The run of ``runs`` (one timed run repeated) with the median ``key`` (its time per
    token), the lower of the two middle ones for an even count, so that it is a run that
    happened."""
    middle = statistics.median_low(key(r) for r in runs)
    return next(r for r in runs if key(r) == middle)


def alternating_order(items: Sequence[T], k: int) -> list[T]:
    """The order timed runs take the ``k``-th time round (a benchmark's ``k``-th work item, or
    ``generate --compare-ar``'s ``k``-th repeat): as listed for even ``k``, reversed for odd
    ``k``, so that no run always goes first (or last) after another."""
    return list(items) if k % 2 == 0 else list(reversed(items))


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
    main = generator_dtype(gen)
    out = {}
    for spec in methods:
        if spec.dtype in ar_generators:
            other = ar_generators[spec.dtype]
            if generator_dtype(other) != spec.dtype:
                raise InvalidInputError(
                    f"the generator for {spec.label} runs in {generator_dtype(other)}, not "
                    f"{spec.dtype}"
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
