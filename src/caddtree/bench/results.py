"""The results of ``caddtree bench``: the one definition of their files and their records.

The runner (:mod:`caddtree.bench.runner`) writes results and the report
(:mod:`caddtree.bench.report`) reads them; both import this module and neither imports the other.
Here, and nowhere else:

* **Files.** ``results.jsonl`` holds one record per (dataset, prompt, method, temperature). Next
  to it: ``results.meta.json`` (the run's settings and machine; :data:`RUN_KEYS` must match for a
  run to resume), ``results.trees.jsonl`` (draft trees for the report's Fig. 6) and, while a
  data-parallel run is going, per-rank files (:func:`side_file`, :func:`rank_path`).
* **JSON lines and the torn-line rule** (:func:`parse_jsonl`): a cut-off *last* line is what a
  kill mid-write (or a run still writing) leaves, so it is dropped; a bad line anywhere else is an
  error naming it. The runner drops it and runs that record again (:func:`read_records`); the
  report skips it with a note (:func:`load_results`).
* **The record** (:func:`make_record`, :data:`REQUIRED_KEYS`, :func:`validate_record`,
  :func:`record_key`: the last record of a key wins) and **the tree record**
  (:func:`make_tree_record`, :data:`TREE_KEYS`, :func:`validate_tree`, :func:`tree_key`).
* **Names**: method labels (``ar``, ``ar-<dtype>`` with a dtype of :data:`AR_DTYPES`,
  ``dflash``, ``ddtree-<B>``, ``caddtree``, ``caddtree-<variant>`` with a variant of
  :data:`ABLATIONS`) in the paper's order (:func:`method_key`), and datasets in the paper's order
  (:data:`DATASET_ORDER`, :func:`dataset_name`).

Users' description of the record: ``docs/benchmarking.md`` and ``docs/benchmarking-report.md``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from ..util.checks import is_int, is_number
from ..util.errors import InvalidInputError
from ..util.files import atomic_write_text

__all__ = [
    "ABLATIONS",
    "AR_DTYPES",
    "DATASET_NAMES",
    "DATASET_ORDER",
    "OPTIONAL_PER_ROUND_KEYS",
    "PER_ROUND_KEYS",
    "REQUIRED_KEYS",
    "RUN_KEYS",
    "TREE_KEYS",
    "VARIANTS",
    "dataset_key",
    "dataset_name",
    "load_meta",
    "load_results",
    "load_results_with_notes",
    "load_trees",
    "make_record",
    "make_tree_record",
    "meta_path",
    "method_key",
    "parse_jsonl",
    "rank_files",
    "rank_path",
    "read_records",
    "record_key",
    "side_file",
    "tree_key",
    "trees_path",
    "validate_record",
    "validate_tree",
    "write_jsonl",
]

logger = logging.getLogger(__name__)

# ---- names ---------------------------------------------------------------------------------------

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

VARIANTS = tuple(v for v, scale in ABLATIONS.items() if scale is not None)
"""Cost-model perturbations of paper Table 3, as method-label suffixes (``caddtree-cd0.5`` ...)."""

DATASET_ORDER = (
    "math500",
    "gsm8k",
    "aime25",
    "aime24",
    "humaneval",
    "mbpp",
    "livecodebench",
    "mt-bench",
    "alpaca",
)
"""The paper's row order; other datasets follow alphabetically."""
DATASET_NAMES = {
    "math500": "MATH-500",
    "gsm8k": "GSM8K",
    "aime25": "AIME 2025",
    "aime24": "AIME 2024",
    "humaneval": "HumanEval",
    "mbpp": "MBPP",
    "livecodebench": "LiveCodeBench",
    "mt-bench": "MT-Bench",
    "alpaca": "Alpaca",
}


def dataset_name(dataset: str) -> str:
    """The paper's name for a dataset id (``math500`` -> ``MATH-500``); unknown ids unchanged."""
    return DATASET_NAMES.get(dataset, dataset)


def dataset_key(dataset: str) -> tuple[int, str]:
    """Sort key of a dataset id: the paper's order (:data:`DATASET_ORDER`), then by name."""
    if dataset in DATASET_ORDER:
        return (DATASET_ORDER.index(dataset), "")
    return (len(DATASET_ORDER), dataset)


def method_key(method: str, budget: int | None = None) -> tuple[int, float, str]:
    """Sort key of a method label: AR (``ar``, then ``ar-<dtype>``), DFlash, DDTree by budget,
    CaDDTree, its ablation variants in :data:`ABLATIONS` order, anything else."""
    if method == "ar":
        return (0, 0, "")
    if method.startswith("ar-"):  # plain decoding in another dtype, right after ``ar``
        return (0, 1, method)
    if method == "dflash":
        return (1, 0, "")
    if method.startswith("ddtree"):
        return (2, budget if budget is not None else math.inf, method)
    if method == "caddtree":
        return (3, 0, "")
    variant = method.removeprefix("caddtree-")
    order = tuple(ABLATIONS)
    if method.startswith("caddtree-") and variant in order:
        return (4, order.index(variant), "")
    return (5, 0, method)


# ---- keys ----------------------------------------------------------------------------------------

REQUIRED_KEYS = (
    "dataset",
    "prompt_index",
    "method",
    "family",
    "budget",
    "variant",
    "temperature",
    "new_tokens",
    "rounds",
    "ms_per_token",
    "tau",
    "budgets",
    "accepted",
    "committed",
)
"""Keys every results record must have (others, such as ``wall_s`` or ``prompt_id``, may be there).
``confidence`` and ``paths`` are optional: only Fig. 1 needs them; ``copied_accepted`` (accepted
nodes copied from the context, per round) is there for methods with lookup."""

PER_ROUND_KEYS = ("budgets", "accepted", "committed")
OPTIONAL_PER_ROUND_KEYS = ("context_lengths", "confidence", "paths", "copied_accepted")

TREE_KEYS = ("dataset", "prompt_index", "method", "temperature", "round", "budget", "parents")

RUN_KEYS = (
    "target",
    "draft",
    "dtype",
    "device_type",
    "machine",
    "world_size",
    "machines",
    "max_new_tokens",
    "max_budget",
    "seed",
    "cost_model_digest",
    "packed_layers",
    "runtime",
    "weights",
    "repeats",
)
"""The settings in ``results.meta.json`` that change the measurements: a resumed run must match
the earlier one in these."""


def mixed_machines(meta: dict[str, Any] | None) -> str | None:
    """Which machines the ranks of a data-parallel run ran on, where that is more than one (their
    timings would pool machines); ``None`` where one machine ran everything."""
    machines = (meta or {}).get("machines") or []
    kinds: dict[str, list[int]] = {}
    for rank, machine in enumerate(machines):
        kinds.setdefault(str(machine), []).append(rank)
    if len(kinds) < 2:
        return None
    return "; ".join(
        f"{'rank' if len(r) == 1 else 'ranks'} {', '.join(map(str, r))} on {m}"
        for m, r in kinds.items()
    )


def record_key(rec: dict[str, Any]) -> tuple[str, int, str, float]:
    """What a record measures: (dataset, prompt index, method, temperature)."""
    return (rec["dataset"], int(rec["prompt_index"]), rec["method"], float(rec["temperature"]))


def tree_key(rec: dict[str, Any]) -> tuple:
    """What a tree record draws: (dataset, prompt index, method, temperature, round)."""
    return (rec["dataset"], rec["prompt_index"], rec["method"], rec["temperature"], rec["round"])


# ---- files ---------------------------------------------------------------------------------------


def _side_file(out: Path, suffix: str) -> Path:
    stem = out.name[: -len(".jsonl")] if out.name.endswith(".jsonl") else out.name
    return out.with_name(f"{stem}.{suffix}")


def side_file(results_path: str | os.PathLike[str], kind: str) -> Path:
    """The side file ``kind`` (``"meta"`` -> ``results.meta.json``, ``"trees"`` ->
    ``results.trees.jsonl``) that ``caddtree bench`` writes next to ``results_path``."""
    return _side_file(Path(results_path), {"meta": "meta.json", "trees": "trees.jsonl"}[kind])


def meta_path(out: str | os.PathLike[str]) -> Path:
    return side_file(out, "meta")


def trees_path(out: str | os.PathLike[str]) -> Path:
    return side_file(out, "trees")


def rank_path(out: Path, rank: int, trees: bool = False) -> Path:
    """The file rank ``rank`` of a data-parallel run appends its records (or trees) to."""
    return _side_file(out, f"trees.rank{rank}.jsonl" if trees else f"rank{rank}.jsonl")


def rank_files(out: Path, trees: bool = False) -> list[Path]:
    """Per-rank files of a data-parallel run (any number of ranks), in rank order."""
    prefix = re.escape(_side_file(out, "trees." if trees else "").name)
    pattern = re.compile(prefix + r"rank(\d+)\.jsonl")
    found = [(m, p) for p in out.parent.iterdir() if (m := pattern.fullmatch(p.name))]
    return [p for m, p in sorted(found, key=lambda mp: int(mp[0].group(1)))]


# ---- JSON lines ----------------------------------------------------------------------------------


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


def write_jsonl(path: Path, records: Iterable[dict[str, Any]]) -> Path:
    """Write ``records`` to ``path``, one JSON object a line, atomically (a reader never sees a
    half-written file)."""
    return atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in records))


def _read_jsonl(
    path: Path, what: str, notes: list[str] | None = None
) -> list[tuple[int, dict[str, Any]]]:
    """(line number, object) for every non-blank line of a JSON-lines file, or a clear error.

    A cut-off last line (an interrupted or still running benchmark) is skipped with a note in
    ``notes``, as ``caddtree bench`` itself does on resume (:func:`parse_jsonl`); without
    ``notes`` it is an error."""
    if not path.exists():
        raise InvalidInputError(
            f"{what} file not found: {path} (run `caddtree bench` first, or check the path)"
        )
    if not path.is_file():
        raise InvalidInputError(f"{what} path is not a file: {path}")
    rows, cut_off = parse_jsonl(path, what)
    if cut_off and notes is None:
        raise InvalidInputError(f"{cut_off}; fix or delete that line")
    if cut_off:
        notes.append(f"{cut_off}; it was skipped.")
    return rows


# ---- records -------------------------------------------------------------------------------------


def _digest(token_ids: Sequence[int]) -> str:
    return hashlib.sha256(json.dumps(list(token_ids)).encode()).hexdigest()[:20]


def make_record(
    dataset: str,
    index: int,
    item: Any,
    spec: Any,
    temperature: float,
    out: Any,
    dtype: str | None = None,
) -> dict[str, Any]:
    """The record of one method (``spec``: a :class:`caddtree.bench.methods.MethodSpec`) on one
    prompt (``item``, the ``index``-th of ``dataset``): ``out`` is what the runner measured (its
    output tokens, turns, times and per-round statistics), ``dtype`` the dtype the target ran in."""
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
        "lookup": spec.lookup,
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
        "copied_accepted": (
            [r.copied_accepted for r in rounds] if spec.lookup or spec.family == "lookup" else None
        ),
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


def validate_record(rec: dict[str, Any], where: str) -> None:
    """Raise an :class:`InvalidInputError` starting with ``where`` unless ``rec`` is a valid
    results record."""
    missing = [k for k in REQUIRED_KEYS if k not in rec]
    if missing:
        raise InvalidInputError(
            f"{where}: record is missing required keys {', '.join(map(repr, missing))} "
            "(is this a `caddtree bench` results file?)"
        )

    def bad(key: str, expected: str) -> InvalidInputError:
        return InvalidInputError(f"{where}: {key!r} must be {expected}, got {rec[key]!r:.80}")

    for key in ("dataset", "method", "family"):
        if not isinstance(rec[key], str) or not rec[key]:
            raise bad(key, "a non-empty string")
    for key in ("prompt_index", "rounds", "new_tokens"):
        if not is_int(rec[key]) or rec[key] < 0:
            raise bad(key, "a non-negative integer")
    if not is_number(rec["temperature"]) or not rec["temperature"] >= 0:
        raise bad("temperature", "a number >= 0")
    ms = rec["ms_per_token"]  # null: the prompt generated no tokens (see summary.aggregate)
    if ms is not None and (not is_number(ms) or not (math.isfinite(ms) and ms > 0)):
        raise bad("ms_per_token", "null or a positive finite number")
    if rec["tau"] is not None and not is_number(rec["tau"]):
        raise bad("tau", "null or a number")
    if rec["budget"] is not None and (not is_int(rec["budget"]) or rec["budget"] < 0):
        raise bad("budget", "null or a non-negative integer")
    if rec["family"] == "ddtree" and (rec["budget"] is None or rec["budget"] < 1):
        raise bad("budget", "a positive integer for a DDTree record")
    if rec["variant"] is not None and not isinstance(rec["variant"], str):
        raise bad("variant", "null or a string")
    if rec.get("dtype") is not None and not isinstance(rec["dtype"], str):  # older files lack it
        raise bad("dtype", "null or a string")
    rounds = rec["rounds"]
    for key in PER_ROUND_KEYS + OPTIONAL_PER_ROUND_KEYS:
        if key not in rec or (key in OPTIONAL_PER_ROUND_KEYS and rec[key] is None):
            continue
        value = rec[key]
        if not isinstance(value, list) or len(value) != rounds:
            raise bad(key, f"a list with one entry per round ({rounds} rounds)")
        if key == "confidence":
            ok = all(v is None or is_number(v) for v in value)
        elif key == "paths":
            ok = all(isinstance(p, list) and all(is_int(i) and i >= 0 for i in p) for p in value)
        else:
            ok = all(is_int(v) and v >= 0 for v in value)
        if not ok:
            raise bad(key, "a list of valid per-round values")
    matches = rec.get("matches_ar")
    if matches is not None and not isinstance(matches, bool):
        raise bad("matches_ar", "true, false or null")


def load_results_with_notes(
    path: str | os.PathLike[str],
) -> tuple[list[dict[str, Any]], list[str]]:
    """:func:`load_results`, and notes on what was dropped (a cut-off last line, repeats)."""
    path = Path(path)
    notes: list[str] = []
    lines = _read_jsonl(path, "results", notes)
    latest: dict[tuple[str, int, str, float], dict[str, Any]] = {}
    for number, rec in lines:
        validate_record(rec, f"{path} line {number}")
        key = record_key(rec)
        latest.pop(key, None)  # re-insert: a resumed run's record replaces the earlier one
        latest[key] = rec
    if not latest:
        raise InvalidInputError(f"results file {path} holds no records")
    duplicates = len(lines) - len(latest)
    if duplicates:
        notes.append(
            f"{duplicates} records repeated an earlier (dataset, prompt, method, temperature) "
            "(a resumed run); the last one of each was kept."
        )
    return list(latest.values()), notes


def load_results(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Read and validate a ``caddtree bench`` results file (JSON lines).

    Records that repeat a (dataset, prompt_index, method, temperature) replace the earlier one
    (a resumed run re-measures a prompt), so the last one wins. A cut-off last line (a benchmark
    interrupted, or still running) is skipped.

    Raises :class:`~caddtree.util.errors.InvalidInputError` naming the file, the line and the problem
    when the file is missing or empty, a line is not JSON, or a record lacks a required key
    (:data:`REQUIRED_KEYS`) or has a malformed value.
    """
    return load_results_with_notes(path)[0]


def load_meta(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The run metadata ``results.meta.json``, or ``None`` when the file does not exist."""
    path = Path(path)
    if not path.is_file():
        return None
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidInputError(f"cannot read run metadata {path}: {exc}") from None
    if not isinstance(meta, dict):
        raise InvalidInputError(f"run metadata {path} must be a JSON object")
    return meta


# ---- draft trees ---------------------------------------------------------------------------------


def make_tree_record(
    dataset: str,
    index: int,
    method: str,
    temperature: float,
    round_index: int,
    tree: Any,
    stats: Any,
    bonus: int,
    text: Any,
) -> dict[str, Any]:
    """The record of one draft tree: round ``round_index``'s ``tree`` (a
    :class:`caddtree.core.tree.DraftTree`), its round statistics ``stats``, the round's ``bonus``
    token (the tree's root) and ``text``, which decodes one token id."""
    return {
        "dataset": dataset,
        "prompt_index": index,
        "method": method,
        "temperature": float(temperature),
        "round": round_index,
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


def validate_tree(rec: dict[str, Any], where: str) -> None:
    """Raise an :class:`InvalidInputError` starting with ``where`` unless ``rec`` is a valid tree
    record: ``parents`` lists every node's parent (``-1``: a child of the root, the bonus token)
    with parents before children, and ``path`` (the accepted nodes) runs from a child of the root
    down the tree."""
    missing = [k for k in TREE_KEYS if k not in rec]
    if missing:
        raise InvalidInputError(
            f"{where}: tree record is missing keys {', '.join(map(repr, missing))}"
        )
    for key in ("prompt_index", "round", "budget"):
        if not is_int(rec[key]) or rec[key] < 0:
            raise InvalidInputError(f"{where}: {key!r} must be a non-negative integer")
    if not is_number(rec["temperature"]):
        raise InvalidInputError(f"{where}: 'temperature' must be a number")
    parents = rec["parents"]
    n = len(parents) if isinstance(parents, list) else -1
    if n < 0 or not all(is_int(p) and -1 <= p < i for i, p in enumerate(parents)):
        raise InvalidInputError(
            f"{where}: 'parents' must be a list with each node's parent index (-1 for the "
            "root), parents listed before their children"
        )
    for key in ("token_texts", "ranks", "depths", "token_ids"):
        if rec.get(key) is not None and (not isinstance(rec[key], list) or len(rec[key]) != n):
            raise InvalidInputError(f"{where}: {key!r} must have one entry per node ({n})")
    if rec.get("ranks") is not None and not all(is_int(r) and r >= 0 for r in rec["ranks"]):
        raise InvalidInputError(f"{where}: 'ranks' must be non-negative integers")
    accepted = rec.get("path") or []
    if not isinstance(accepted, list) or not all(is_int(i) and 0 <= i < n for i in accepted):
        raise InvalidInputError(f"{where}: 'path' must list accepted node indices below {n}")
    previous = -1
    for i in accepted:
        if parents[i] != previous:
            raise InvalidInputError(
                f"{where}: 'path' is not a root-to-leaf chain (node {i} has parent "
                f"{parents[i]}, expected {previous})"
            )
        previous = i


def load_trees(
    path: str | os.PathLike[str], notes: list[str] | None = None
) -> list[dict[str, Any]]:
    """Read and validate the draft trees of ``results.trees.jsonl`` (for Fig. 6; see
    :func:`validate_tree`). A cut-off last line is skipped with a note in ``notes`` (without
    ``notes`` it is an error)."""
    path = Path(path)
    out: dict[tuple, dict[str, Any]] = {}  # a resumed run may repeat a round: the last one wins
    for number, rec in _read_jsonl(path, "draft-trees", notes):
        validate_tree(rec, f"{path} line {number}")
        out[tree_key(rec)] = rec
    return list(out.values())
