"""``caddtree report``: the paper's tables and figures from ``caddtree bench`` results.

Input is ``results.jsonl`` (one JSON record per dataset, prompt, method and temperature, written by
``caddtree bench``) and, when they are there, two side files next to it: ``results.meta.json`` (the
run's machine, models and command) and ``results.trees.jsonl`` (draft trees for Fig. 6). The schema
and every definition below are described for users in ``docs/benchmarking-report.md``.

Every number in every table and figure comes from one place, :func:`aggregate`, per
(temperature, dataset, method label):

* **ms/tok**: the median over prompts of each prompt's wall time per new token (the mean is kept
  too). **Speed-up** over AR is the AR baseline's median ms/tok divided by the method's. The
  baseline is the fastest plain decoding a user could pick: among the AR runs of the temperature
  and dataset (``ar`` in the run's dtype and ``ar-<dtype>`` in other dtypes, e.g.
  ``ar-float32``), the one with the lowest median ms/tok (ties: ``ar``).
* **tau** (acceptance length): pooled, the sum of committed tokens over the sum of rounds of all
  prompts, so long generations weigh by their rounds.
* **budget** mean and std: pooled over all rounds of all prompts (population std), the paper's
  :math:`\\bar n^*(\\sigma)` for CaDDTree.
* **DDTree-oracle**: among the DDTree budgets run for this temperature and dataset, the one with the
  lowest median ms/tok (ties: the smaller budget); its budget is the oracle's :math:`n^*`.

Fig. 1 replays the largest DDTree budget's rounds at smaller budgets: DDTree adds nodes best-first
in an order that does not depend on the budget, so the tree of budget ``n`` is the first ``n``
nodes of a bigger one and the round would have accepted ``1 + #{path index < n}`` tokens (bonus
included). See :func:`confidence_analysis`.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from .checks import is_int, is_number
from .errors import CaddtreeError, InvalidInputError, MissingDependencyError
from .files import atomic_write_text
from .plots import pyplot, save_figure

__all__ = [
    "Aggregates",
    "Cell",
    "ConfidenceAnalysis",
    "MethodSummary",
    "Oracle",
    "Report",
    "Table",
    "aggregate",
    "build_report",
    "budget_grid",
    "dataset_name",
    "all_tables",
    "confidence_analysis",
    "load_meta",
    "load_results",
    "load_trees",
    "method_table",
    "ablation_table",
    "plot_budget_histograms",
    "plot_confidence",
    "plot_time_vs_budget",
    "plot_trees",
    "rejected_subtrees",
    "sensitivity_table",
    "side_file",
    "table1",
    "write_report",
]

# ---- the record contract -------------------------------------------------------------------------

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
``confidence`` and ``paths`` are optional: only Fig. 1 needs them."""

PER_ROUND_KEYS = ("budgets", "accepted", "committed")
OPTIONAL_PER_ROUND_KEYS = ("context_lengths", "confidence", "paths")

TREE_KEYS = ("dataset", "prompt_index", "method", "temperature", "round", "budget", "parents")

VARIANTS = ("cd0.5", "cd2", "cv0.5", "cv2")
"""Cost-model perturbations of paper Table 3, as method-label suffixes (``caddtree-cd0.5`` ...)."""
VARIANT_TITLES = {
    "cd0.5": ("C_d×0.5", r"$C_d{\times}0.5$"),
    "cd2": ("C_d×2", r"$C_d{\times}2.0$"),
    "cv0.5": ("C_v×0.5", r"$C_v{\times}0.5$"),
    "cv2": ("C_v×2", r"$C_v{\times}2.0$"),
}

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

MIN_ROUNDS_PER_BIN = 5
"""Fig. 1 uses at most ten confidence bins and at least this many rounds per bin."""


def dataset_name(dataset: str) -> str:
    """The paper's name for a dataset id (``math500`` -> ``MATH-500``); unknown ids unchanged."""
    return DATASET_NAMES.get(dataset, dataset)


def _dataset_key(dataset: str) -> tuple[int, str]:
    if dataset in DATASET_ORDER:
        return (DATASET_ORDER.index(dataset), "")
    return (len(DATASET_ORDER), dataset)


def _method_key(method: str, budget: int | None = None) -> tuple[int, float, str]:
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
    order = ("constant", *VARIANTS)
    if method.startswith("caddtree-") and variant in order:
        return (4, order.index(variant), "")
    return (5, 0, method)


def _t(temperature: float) -> str:
    return f"{temperature:g}"


# ---- loading -------------------------------------------------------------------------------------


def side_file(results_path: str | os.PathLike[str], kind: str) -> Path:
    """The side file ``kind`` (``"meta"`` -> ``results.meta.json``, ``"trees"`` ->
    ``results.trees.jsonl``) that ``caddtree bench`` writes next to ``results_path``."""
    path = Path(results_path)
    suffix = {"meta": ".meta.json", "trees": ".trees.jsonl"}[kind]
    stem = path.name.removesuffix(".jsonl")  # the same rule as caddtree.bench
    return path.with_name(stem + suffix)


def _read_jsonl(
    path: Path, what: str, notes: list[str] | None = None
) -> list[tuple[int, dict[str, Any]]]:
    """(line number, object) for every non-blank line of a JSON-lines file, or a clear error.

    A cut-off last line (an interrupted or still running benchmark) is skipped with a note in
    ``notes``, as ``caddtree bench`` itself does on resume (:func:`caddtree.bench.parse_jsonl`);
    without ``notes`` it is an error."""
    from .bench import parse_jsonl

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


def _validate_record(rec: dict[str, Any], where: str) -> None:
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
    ms = rec["ms_per_token"]  # null: the prompt generated no tokens (see aggregate)
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


def _load_results(path: str | os.PathLike[str]) -> tuple[list[dict[str, Any]], list[str]]:
    """The validated, de-duplicated records and notes on what was dropped."""
    path = Path(path)
    notes: list[str] = []
    lines = _read_jsonl(path, "results", notes)
    latest: dict[tuple[str, int, str, float], dict[str, Any]] = {}
    for number, rec in lines:
        _validate_record(rec, f"{path} line {number}")
        key = (rec["dataset"], rec["prompt_index"], rec["method"], float(rec["temperature"]))
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

    Raises :class:`~caddtree.errors.InvalidInputError` naming the file, the line and the problem
    when the file is missing or empty, a line is not JSON, or a record lacks a required key
    (:data:`REQUIRED_KEYS`) or has a malformed value.
    """
    return _load_results(path)[0]


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


def load_trees(
    path: str | os.PathLike[str], notes: list[str] | None = None
) -> list[dict[str, Any]]:
    """Read and validate the draft trees of ``results.trees.jsonl`` (for Fig. 6).

    Each record's ``parents`` must list every node's parent (``-1``: a child of the root, the
    bonus token) with parents before children, and ``path`` (the accepted nodes) must run from a
    child of the root down the tree.
    """
    path = Path(path)
    out: dict[tuple, dict[str, Any]] = {}  # a resumed run may repeat a round: the last one wins
    for number, rec in _read_jsonl(path, "draft-trees", notes):
        where = f"{path} line {number}"
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
        key = (rec["dataset"], rec["prompt_index"], rec["method"], rec["temperature"], rec["round"])
        out[key] = rec
    return list(out.values())


# ---- aggregation ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class MethodSummary:
    """One method on one dataset at one temperature, over all its prompts."""

    temperature: float
    dataset: str
    method: str
    family: str
    budget: int | None
    variant: str | None
    prompts: int
    ms_per_token: float  # median over prompts
    ms_per_token_mean: float
    tau: float  # pooled: sum committed / sum rounds
    budget_mean: float  # pooled over rounds
    budget_std: float  # pooled over rounds, population std
    rounds: int
    new_tokens: int
    matches_ar: int  # prompts whose output is identical to AR's (in the run's dtype)
    matches_ar_known: int  # prompts with a verdict (matches_ar not null)
    speedup: float | None  # the AR baseline's median ms/tok / this one; None without AR
    baseline: str | None = None  # the AR label ``speedup`` is against (the fastest AR run)
    dtype: str | None = None  # the dtype the target ran in (records' ``dtype``; older: None)


@dataclass(frozen=True)
class Oracle:
    """DDTree-oracle: the DDTree budget with the lowest median ms/tok (paper Table 1)."""

    temperature: float
    dataset: str
    method: str
    budget: int
    ms_per_token: float
    tau: float


@dataclass
class Aggregates:
    """Everything :func:`aggregate` computes; tables and figures read only this."""

    summaries: dict[tuple[float, str, str], MethodSummary]
    oracles: dict[tuple[float, str], Oracle]
    records: dict[tuple[float, str, str], list[dict[str, Any]]]
    notes: list[str] = field(default_factory=list)
    baselines: dict[tuple[float, str], str] = field(default_factory=dict)

    def temperatures(self) -> list[float]:
        return sorted({t for t, _, _ in self.summaries})

    def datasets(self, temperature: float) -> list[str]:
        found = {d for t, d, _ in self.summaries if t == temperature}
        return sorted(found, key=_dataset_key)

    def get(self, temperature: float, dataset: str, method: str) -> MethodSummary | None:
        return self.summaries.get((temperature, dataset, method))

    def methods(self, temperature: float, dataset: str) -> list[MethodSummary]:
        """Every method run on ``dataset``, in the paper's order (AR, DFlash, DDTree by budget,
        CaDDTree, its ablation variants, anything else)."""
        rows = [s for (t, d, _), s in self.summaries.items() if t == temperature and d == dataset]
        return sorted(rows, key=lambda s: _method_key(s.method, s.budget))

    def ar_runs(self, temperature: float, dataset: str) -> list[MethodSummary]:
        """The plain-decoding (AR) runs of ``dataset``: ``ar``, then ``ar-<dtype>`` by name."""
        return [s for s in self.methods(temperature, dataset) if s.family == "ar"]

    def ar_labels(self, temperature: float) -> list[str]:
        """Every AR label run at ``temperature`` on any dataset, ``ar`` first."""
        labels = {
            m for (t, _, m), s in self.summaries.items() if t == temperature and s.family == "ar"
        }
        return sorted(labels, key=_method_key)

    def baseline(self, temperature: float, dataset: str) -> MethodSummary | None:
        """The AR run speed-ups are against: the fastest of :meth:`ar_runs` (``None``: no AR)."""
        label = self.baselines.get((temperature, dataset))
        return None if label is None else self.get(temperature, dataset, label)

    def ddtree(self, temperature: float, dataset: str) -> list[MethodSummary]:
        """The DDTree runs of ``dataset``, by increasing budget."""
        return [s for s in self.methods(temperature, dataset) if s.family == "ddtree"]

    def oracle(self, temperature: float, dataset: str) -> Oracle | None:
        return self.oracles.get((temperature, dataset))


def aggregate(records: Iterable[dict[str, Any]]) -> Aggregates:
    """Summarise validated records (see the module docstring for each definition).

    Records without a time (``ms_per_token`` null: the prompt generated no tokens, e.g. it did not
    fit the model's context) are left out, with a note in ``notes``."""
    groups: dict[tuple[float, str, str], list[dict[str, Any]]] = {}
    unmeasured: list[dict[str, Any]] = []
    cut_short = 0
    for rec in records:
        if rec["ms_per_token"] is None:
            unmeasured.append(rec)
            continue
        cut_short += bool(rec.get("skipped"))
        key = (float(rec["temperature"]), rec["dataset"], rec["method"])
        groups.setdefault(key, []).append(rec)
    for recs in groups.values():
        recs.sort(key=lambda r: r["prompt_index"])

    summaries: dict[tuple[float, str, str], MethodSummary] = {}
    for (t, d, m), recs in groups.items():
        ms = np.array([r["ms_per_token"] for r in recs], dtype=np.float64)
        committed = sum(sum(r["committed"]) for r in recs)
        n_rounds = sum(len(r["committed"]) for r in recs)
        budgets = np.array([b for r in recs for b in r["budgets"]], dtype=np.float64)
        verdicts = [r.get("matches_ar") for r in recs if r.get("matches_ar") is not None]
        dtypes = {r.get("dtype") for r in recs}
        first = recs[0]
        summaries[(t, d, m)] = MethodSummary(
            temperature=t,
            dataset=d,
            method=m,
            family=first["family"],
            budget=first["budget"],
            variant=first["variant"],
            prompts=len(recs),
            ms_per_token=float(np.median(ms)),
            ms_per_token_mean=float(ms.mean()),
            tau=committed / n_rounds if n_rounds else math.nan,
            budget_mean=float(budgets.mean()) if budgets.size else math.nan,
            budget_std=float(budgets.std()) if budgets.size else math.nan,
            rounds=n_rounds,
            new_tokens=sum(r["new_tokens"] for r in recs),
            matches_ar=sum(1 for v in verdicts if v),
            matches_ar_known=len(verdicts),
            speedup=None,
            dtype=dtypes.pop() if len(dtypes) == 1 else None,
        )
    # the speed-up baseline: the fastest plain decoding of each (temperature, dataset)
    ar_runs: dict[tuple[float, str], list[MethodSummary]] = {}
    for s in summaries.values():
        if s.family == "ar":
            ar_runs.setdefault((s.temperature, s.dataset), []).append(s)
    baselines = {
        key: min(runs, key=lambda s: (s.ms_per_token, s.method != "ar", s.method))
        for key, runs in ar_runs.items()
    }
    for key, s in summaries.items():
        base = baselines.get((s.temperature, s.dataset))
        if base is not None:
            summaries[key] = replace(
                s, speedup=base.ms_per_token / s.ms_per_token, baseline=base.method
            )

    agg = Aggregates(
        summaries=summaries,
        oracles={},
        records=groups,
        baselines={key: base.method for key, base in baselines.items()},
    )
    for (t, d), runs in sorted(ar_runs.items(), key=lambda kv: (kv[0][0], _dataset_key(kv[0][1]))):
        if len(runs) > 1:
            base = baselines[(t, d)]
            others = ", ".join(
                f"{s.method}: {s.ms_per_token:.2f}"
                for s in sorted(runs, key=lambda s: _method_key(s.method))
                if s is not base
            )
            agg.notes.append(
                f"{dataset_name(d)} at temperature {_t(t)}: speed-ups are against "
                f"{base.method} ({base.ms_per_token:.2f} ms/tok), the fastest plain decoding "
                f"({others} ms/tok)."
            )
    if unmeasured:
        first = unmeasured[0]
        why = f": {first['skipped']}" if first.get("skipped") else ""
        agg.notes.append(
            f"{len(unmeasured)} records generated no tokens and are left out (for example "
            f"{first['dataset']} prompt {first['prompt_index']} with {first['method']}{why})."
        )
    if cut_short:
        agg.notes.append(
            f"{cut_short} records stopped early (a later turn did not fit the model's context, "
            "see their 'skipped'); their measured turns are included."
        )
    for t in agg.temperatures():
        for d in agg.datasets(t):
            runs = agg.ddtree(t, d)
            if runs:
                best = min(runs, key=lambda s: (s.ms_per_token, s.budget))
                agg.oracles[(t, d)] = Oracle(
                    t, d, best.method, int(best.budget or 0), best.ms_per_token, best.tau
                )
            counts = {s.method: s.prompts for s in agg.methods(t, d)}
            if len(set(counts.values())) > 1:
                detail = ", ".join(f"{m}: {n}" for m, n in counts.items())
                agg.notes.append(
                    f"{dataset_name(d)} at temperature {_t(t)}: methods ran on different numbers "
                    f"of prompts ({detail}), so their medians are over different prompt sets."
                )
    for t in agg.temperatures():
        if t == 0.0:
            continue
        for d in agg.datasets(t):
            here, greedy = agg.oracle(t, d), agg.oracle(0.0, d)
            if here and greedy and here.budget != greedy.budget:
                agg.notes.append(
                    f"{dataset_name(d)}: the DDTree-oracle budget at temperature {_t(t)} is "
                    f"{here.budget}, at temperature 0 it is {greedy.budget}. This report picks "
                    "the best budget per temperature; the paper's temperature-1 table reuses the "
                    "temperature-0 budget."
                )
    return agg


# ---- tables --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Cell:
    """One table cell, in Markdown and in LaTeX source."""

    md: str
    tex: str
    bold: bool = False


MISSING = Cell("–", "--")


def _latex_escape(text: str) -> str:
    table = {
        "\\": r"\textbackslash{}",
        "&": r"\&",
        "%": r"\%",
        "$": r"\$",
        "#": r"\#",
        "_": r"\_",
        "{": r"\{",
        "}": r"\}",
        "~": r"\textasciitilde{}",
        "^": r"\textasciicircum{}",
    }
    return "".join(table.get(c, c) for c in text)


def _text(text: str) -> Cell:
    return Cell(text.replace("|", "\\|"), _latex_escape(text))


def _num(x: float | None, digits: int = 2) -> Cell:
    if x is None or not math.isfinite(x):
        return MISSING
    s = f"{x:.{digits}f}"
    return Cell(s, s if x >= 0 else f"${s}$")


def _int(x: int | None) -> Cell:
    return MISSING if x is None else Cell(str(x), str(x))


def _signed(x: float | None) -> Cell:
    if x is None or not math.isfinite(x):
        return MISSING
    s = f"{x:+.2f}"
    return Cell(s, f"${s}$")


def _speedup(x: float | None) -> Cell:
    if x is None or not math.isfinite(x):
        return MISSING
    return Cell(f"{x:.2f}×", rf"{x:.2f}$\times$")


def _budget(mean: float, std: float) -> Cell:
    if not math.isfinite(mean):
        return MISSING
    digits = 0 if mean >= 100 else 1
    m, s = f"{mean:.{digits}f}", f"{std:.{digits}f}"
    return Cell(f"{m} ({s})", rf"${m}\,({s})$")


def _bold_lowest(cells: list[Cell]) -> list[Cell]:
    """Bold the cells showing the lowest number (ties as displayed all bold, as in the paper)."""
    values = [float(c.md) if c is not MISSING else math.inf for c in cells]
    best = min(values, default=math.inf)
    if not math.isfinite(best):
        return cells
    return [Cell(c.md, c.tex, True) if v == best else c for c, v in zip(cells, values)]


@dataclass
class Table:
    """A table rendered both as Markdown (for report.md) and as booktabs LaTeX (tables.tex)."""

    key: str  # short id, e.g. "table1_T0"
    title: str  # Markdown heading
    caption: str  # LaTeX caption (LaTeX source)
    columns: list[str]  # Markdown header
    rows: list[list[Cell]]
    latex_spec: str  # tabular column spec, for the columns not in markdown_only
    latex_header: str  # LaTeX header lines, each ending in \\
    markdown_only: tuple[int, ...] = ()  # column indices left out of the LaTeX version
    midrule_before: tuple[int, ...] = ()  # LaTeX: \midrule before these row indices
    wide: bool = False  # LaTeX table* (two columns wide)

    def markdown(self) -> str:
        def fmt(c: Cell) -> str:
            return f"**{c.md}**" if c.bold else c.md

        lines = [
            "| " + " | ".join(self.columns) + " |",
            "|" + "|".join([":--"] + ["--:"] * (len(self.columns) - 1)) + "|",
        ]
        lines += ["| " + " | ".join(fmt(c) for c in row) + " |" for row in self.rows]
        return "\n".join(lines)

    def latex(self) -> str:
        env = "table*" if self.wide else "table"
        lines = [
            f"\\begin{{{env}}}[tbp]",
            "\\centering",
            "\\small",
            f"\\caption{{{self.caption}}}",
            f"\\label{{tab:{self.key}}}",
            f"\\begin{{tabular}}{{{self.latex_spec}}}",
            "\\toprule",
            self.latex_header,
            "\\midrule",
        ]
        for i, row in enumerate(self.rows):
            if i in self.midrule_before:
                lines.append("\\midrule")
            cells = [
                f"\\textbf{{{c.tex}}}" if c.bold else c.tex
                for j, c in enumerate(row)
                if j not in self.markdown_only
            ]
            lines.append(" & ".join(cells) + r" \\")
        lines += ["\\bottomrule", "\\end{tabular}", f"\\end{{{env}}}"]
        return "\n".join(lines)


def _ar_title(agg: Aggregates, temperature: float, label: str) -> str:
    """How tables name an AR run: ``AR float32`` for ``ar-float32``; ``AR bfloat16`` for ``ar``
    when its records say it ran in bfloat16 (older records do not: plain ``AR``)."""
    if label != "ar":
        return f"AR {label.removeprefix('ar-')}"
    dtypes = {s.dtype for (t, _, m), s in agg.summaries.items() if t == temperature and m == label}
    dtype = dtypes.pop() if len(dtypes) == 1 else None
    return f"AR {dtype}" if dtype else "AR"


def table1(agg: Aggregates, temperature: float) -> Table:
    """Paper Table 1 (Table 4 at temperature 1): AR, DFlash, DDTree-oracle and CaDDTree per
    dataset; the best ms/tok of each row in bold; Markdown adds CaDDTree's speed-up over AR.

    When plain decoding ran in more than one dtype (``ar`` and ``ar-<dtype>``), there is one AR
    column per dtype; the speed-up is over the faster of them, which the Markdown names in a
    last column and the LaTeX marks with a dagger."""
    labels = agg.ar_labels(temperature)
    several = labels not in ([], ["ar"])
    if not several:
        labels = ["ar"]
    k = len(labels)
    rows = []
    for d in agg.datasets(temperature):
        ars = [agg.get(temperature, d, label) for label in labels]
        base = agg.baseline(temperature, d)
        dflash = agg.get(temperature, d, "dflash")
        ca = agg.get(temperature, d, "caddtree")
        oracle = agg.oracle(temperature, d)
        times = _bold_lowest(
            [
                *(_num(ar.ms_per_token) if ar else MISSING for ar in ars),
                _num(dflash.ms_per_token) if dflash else MISSING,
                _num(oracle.ms_per_token) if oracle else MISSING,
                _num(ca.ms_per_token) if ca else MISSING,
            ]
        )
        ar_cells = times[:k]
        if several:  # mark the baseline in LaTeX (Markdown names it in its own column)
            ar_cells = [
                replace(c, tex=c.tex + r"$^\dagger$") if ar is not None and ar is base else c
                for c, ar in zip(ar_cells, ars)
            ]
        row = [
            _text(dataset_name(d)),
            *ar_cells,
            times[k],
            _num(dflash.tau) if dflash else MISSING,
            times[k + 1],
            _num(oracle.tau) if oracle else MISSING,
            _int(oracle.budget) if oracle else MISSING,
            times[k + 2],
            _num(ca.tau) if ca else MISSING,
            _budget(ca.budget_mean, ca.budget_std) if ca else MISSING,
            _speedup(ca.speedup) if ca else MISSING,
        ]
        if several:
            row.append(_text(base.method) if base else MISSING)
        rows.append(row)
    t = _t(temperature)
    if several:
        ar_head = rf"\multicolumn{{{k}}}{{c}}{{\textbf{{AR}} ms/tok}}" if k > 1 else r"\textbf{AR}"
        ar_rule = rf"\cmidrule(lr){{2-{1 + k}}}" if k > 1 else ""
        ar_sub = " & ".join(
            _latex_escape(title[3:] if title.startswith("AR ") else "run dtype")
            for title in (_ar_title(agg, temperature, label) for label in labels)
        )
    else:
        ar_head, ar_rule, ar_sub = r"\textbf{AR}", "", "ms/tok"

    def span(a: int, b: int) -> str:
        return rf"\cmidrule(lr){{{a + k - 1}-{b + k - 1}}}"

    header = "\n".join(
        [
            rf" & {ar_head} & \multicolumn{{2}}{{c}}{{\textbf{{DFlash}}}} & "
            r"\multicolumn{3}{c}{\textbf{DDTree-oracle}} & \multicolumn{3}{c}{\textbf{CaDDTree}} \\",
            ar_rule + span(3, 4) + span(5, 7) + span(8, 10),
            rf"\textbf{{Dataset}} & {ar_sub} & ms/tok & $\tau$ & ms/tok & $\tau$ & $n^*$ "
            r"& ms/tok & $\tau$ & $\bar{n}^*(\sigma)$ \\",
        ]
    )
    caption = (
        "Per-token generation time (ms/tok, median over prompts; lower is better) and mean "
        f"acceptance length $\\tau$ at temperature~{t}. $n^*$ is the oracle's best grid "
        "budget; $\\bar{n}^*(\\sigma)$ is CaDDTree's per-round mean (std)."
    )
    ar_columns = ["AR ms/tok"]
    speedup_column = "CaDDTree speed-up vs AR"
    markdown_only: tuple[int, ...] = (10,)
    if several:
        caption += (
            " AR: plain decoding in each dtype measured; $^\\dagger$ marks the faster one, the "
            "baseline of speed-ups."
        )
        ar_columns = [f"{_ar_title(agg, temperature, label)} ms/tok" for label in labels]
        speedup_column = "CaDDTree speed-up vs fastest AR"
        markdown_only = (9 + k, 10 + k)
    return Table(
        key=f"table1_T{t}",
        title=f"Table 1 — per-token time and acceptance length, temperature {t}",
        caption=caption,
        columns=[
            "Dataset",
            *ar_columns,
            "DFlash ms/tok",
            "DFlash τ",
            "DDTree-oracle ms/tok",
            "oracle τ",
            "n*",
            "CaDDTree ms/tok",
            "CaDDTree τ",
            "CaDDTree n* mean (std)",
            speedup_column,
            *(["fastest AR"] if several else []),
        ],
        rows=rows,
        latex_spec=f"l {'c' * k} cc ccc ccc",
        latex_header=header,
        markdown_only=markdown_only,
        wide=True,
    )


def ablation_table(agg: Aggregates, temperature: float) -> Table | None:
    """Paper Table 2: CaDDTree against the constant cost model (``caddtree-constant``), ms/tok
    per dataset, best per dataset in bold. ``None`` without ``caddtree-constant`` records."""
    datasets = [
        d for d in agg.datasets(temperature) if agg.get(temperature, d, "caddtree-constant")
    ]
    if not datasets:
        return None
    nominal = [agg.get(temperature, d, "caddtree") for d in datasets]
    constant = [agg.get(temperature, d, "caddtree-constant") for d in datasets]
    columns = [
        _bold_lowest([_num(a.ms_per_token) if a else MISSING, _num(b.ms_per_token)])
        for a, b in zip(nominal, constant)
    ]
    rows = [
        [_text("CaDDTree")] + [c[0] for c in columns],
        [_text("Constant")] + [c[1] for c in columns],
    ]
    names = [dataset_name(d) for d in datasets]
    t = _t(temperature)
    return Table(
        key=f"table2_T{t}",
        title=f"Table 2 — cost-model ablation (ms/tok), temperature {t}",
        caption=(
            f"Cost model ablation (temp.~{t}). Per-token latency in ms/tok (median over prompts); "
            "lower is better. ``Constant'' sets $C_v(n;\\,\\ell){=}C_v(0;\\,\\ell)$ for all~$n$."
        ),
        columns=["C_v model", *names],
        rows=rows,
        latex_spec="l" + "c" * len(datasets),
        latex_header="$C_v$ model & " + " & ".join(map(_latex_escape, names)) + r" \\",
    )


def sensitivity_table(agg: Aggregates, temperature: float) -> Table | None:
    """Paper Table 3: the change in CaDDTree's median ms/tok when C_d or C_v is scaled by 0.5 or
    2 (``caddtree-cd0.5`` ...), against the nominal ``caddtree`` run, per dataset. ``None`` when
    no such records exist."""
    rows = []
    for d in agg.datasets(temperature):
        variants = [agg.get(temperature, d, f"caddtree-{v}") for v in VARIANTS]
        nominal = agg.get(temperature, d, "caddtree")
        if not any(variants):
            continue
        deltas = [
            _signed(v.ms_per_token - nominal.ms_per_token) if v and nominal else MISSING
            for v in variants
        ]
        rows.append(
            [_text(dataset_name(d)), _num(nominal.ms_per_token) if nominal else MISSING, *deltas]
        )
    if not rows:
        return None
    t = _t(temperature)
    return Table(
        key=f"table3_T{t}",
        title=f"Table 3 — sensitivity to cost-parameter perturbations, temperature {t}",
        caption=(
            f"Sensitivity of CaDDTree per-token latency to cost parameter perturbations "
            f"(temp.~{t}). $\\Delta$ is the change in median ms/tok relative to the nominal run."
        ),
        columns=["Dataset", "nominal ms/tok", *(f"Δ {VARIANT_TITLES[v][0]}" for v in VARIANTS)],
        rows=rows,
        latex_spec="lccccc",
        latex_header=(
            r"Dataset & nominal & "
            + " & ".join(rf"$\Delta$ {VARIANT_TITLES[v][1]}" for v in VARIANTS)
            + r" \\"
        ),
    )


def method_table(agg: Aggregates, temperature: float) -> Table:
    """Every method label (each DDTree budget included) per dataset: median and mean ms/tok,
    speed-up over AR, tau, mean (std) budget, prompts, and prompts identical to AR. The best
    median ms/tok of each dataset in bold. When a dataset has AR runs in several dtypes, the
    speed-ups are over the fastest one, whose method cell says ``(baseline)``."""
    rows: list[list[Cell]] = []
    breaks = []
    several = False
    for d in agg.datasets(temperature):
        runs = agg.methods(temperature, d)
        base = agg.baselines.get((temperature, d)) if len(agg.ar_runs(temperature, d)) > 1 else None
        several = several or base is not None
        if rows:
            breaks.append(len(rows))
        times = _bold_lowest([_num(s.ms_per_token) for s in runs])
        for s, time_cell in zip(runs, times):
            same = (
                Cell(f"{s.matches_ar}/{s.matches_ar_known}", f"{s.matches_ar}/{s.matches_ar_known}")
                if s.matches_ar_known
                else MISSING
            )
            budget = _budget(s.budget_mean, s.budget_std) if s.family != "ar" else MISSING
            rows.append(
                [
                    _text(dataset_name(d)),
                    _text(f"{s.method} (baseline)" if s.method == base else s.method),
                    time_cell,
                    _num(s.ms_per_token_mean),
                    _speedup(s.speedup),
                    _num(s.tau),
                    budget,
                    _int(s.prompts),
                    same,
                ]
            )
    t = _t(temperature)
    return Table(
        key=f"methods_T{t}",
        title=f"All methods, temperature {t}",
        caption=(
            f"Every method at temperature~{t}: median and mean ms/tok over prompts, speed-up over "
            + ("the fastest AR (the baseline)" if several else "AR")
            + " (ratio of medians), pooled $\\tau$, per-round mean (std) budget, prompts, and "
            "prompts whose output is identical to AR's"
            + (" (in the run's dtype)." if several else ".")
        ),
        columns=[
            "Dataset",
            "Method",
            "ms/tok (median)",
            "ms/tok (mean)",
            "speed-up vs fastest AR" if several else "speed-up vs AR",
            "τ",
            "budget mean (std)",
            "prompts",
            "identical to AR",
        ],
        rows=rows,
        latex_spec="llccccccc",
        latex_header=(
            r"Dataset & Method & ms/tok & mean ms/tok & speed-up & $\tau$ & budget "
            r"& prompts & $=$AR \\"
        ),
        midrule_before=tuple(breaks),
        wide=True,
    )


def all_tables(agg: Aggregates) -> list[Table]:
    """Every table the data supports, temperature by temperature: Table 1, Table 2 and Table 3
    (when their ablation records exist) and the full per-method table."""
    out: list[Table] = []
    for t in agg.temperatures():
        out.append(table1(agg, t))
        for extra in (ablation_table(agg, t), sensitivity_table(agg, t)):
            if extra is not None:
                out.append(extra)
        out.append(method_table(agg, t))
    return out


# ---- Fig. 1: counterfactual acceptance by drafter confidence -------------------------------------


@dataclass
class ConfidenceAnalysis:
    """Fig. 1 data for one dataset (see :func:`confidence_analysis`)."""

    dataset: str
    method: str  # the DDTree run whose rounds are replayed (its largest budget)
    budget: int
    grid: list[int]  # budgets n at which acceptance is evaluated (ends with ``budget``)
    bins: list[tuple[float, float, int]]  # (lowest, highest confidence, rounds) per bin, low first
    acceptance: np.ndarray  # [bins, grid]: mean acceptance (bonus included) at each budget
    recovery: list[int]  # per bin: the smallest grid budget reaching the full-budget acceptance
    note: str | None = None


def budget_grid(largest: int) -> list[int]:
    """Powers of two from 1 up to ``largest``, and ``largest`` itself."""
    grid = [1 << k for k in range(max(largest, 1).bit_length()) if (1 << k) <= largest]
    if not grid or grid[-1] != largest:
        grid.append(largest)
    return grid


def confidence_analysis(
    agg: Aggregates, dataset: str, temperature: float = 0.0, max_bins: int = 10
) -> ConfidenceAnalysis | str:
    """Acceptance length against budget, by drafter-confidence bin (paper Fig. 1).

    Takes the rounds of the largest DDTree budget ``B`` run on ``dataset``. A round's acceptance
    at budget ``n`` is ``1 + #{i in path : i < n}``: DDTree inserts nodes best-first in an order
    independent of the budget, so a budget-``n`` tree is the first ``n`` nodes of the budget-``B``
    tree and would have accepted exactly the path nodes among them. Rounds are sorted by
    confidence (the drafter's largest position-1 probability) and split into equal-count bins:
    ``max_bins`` of them, fewer when there are fewer distinct confidences or fewer than
    :data:`MIN_ROUNDS_PER_BIN` rounds per bin (the ``note`` then says so). A bin's recovery budget
    is the smallest grid budget whose mean acceptance equals the bin's mean acceptance at ``B``.

    Returns the analysis, or a string saying why it cannot be made.
    """
    runs = agg.ddtree(temperature, dataset)
    if not runs:
        return f"no DDTree runs for {dataset_name(dataset)} at temperature {_t(temperature)}"
    largest = max(runs, key=lambda s: s.budget or 0)
    recs = agg.records[(temperature, dataset, largest.method)]
    if any(r.get("paths") is None or r.get("confidence") is None for r in recs):
        return f"{largest.method} records for {dataset_name(dataset)} lack 'paths' or 'confidence'"
    B = int(largest.budget or 0)
    grid = budget_grid(B)
    conf, acc = [], []
    limits = np.array(grid)[None, :]
    for r in recs:
        for c, path in zip(r["confidence"], r["paths"]):
            if c is None or not math.isfinite(c):
                continue
            conf.append(float(c))
            acc.append(1 + (np.asarray(path, dtype=np.int64)[:, None] < limits).sum(axis=0))
    distinct = len(set(conf))
    k = min(max_bins, distinct, len(conf) // MIN_ROUNDS_PER_BIN)
    if k < 1:
        return (
            f"{dataset_name(dataset)}: only {len(conf)} rounds with a confidence in "
            f"{largest.method} (Fig. 1 needs at least {MIN_ROUNDS_PER_BIN})"
        )
    conf_arr = np.asarray(conf)
    acc_arr = np.asarray(acc, dtype=np.float64).reshape(len(conf), len(grid))
    order = np.argsort(conf_arr, kind="stable")
    bins, means, recovery = [], [], []
    for idx in np.array_split(order, k):
        mean = acc_arr[idx].mean(axis=0)
        bins.append((float(conf_arr[idx].min()), float(conf_arr[idx].max()), int(idx.size)))
        means.append(mean)
        recovery.append(grid[int(np.argmax(mean >= mean[-1] - 1e-9))])
    note = None
    if k < max_bins:
        note = (
            f"{dataset_name(dataset)}: {k} confidence bins instead of {max_bins} ({len(conf)} "
            f"rounds, {distinct} distinct confidences, at least {MIN_ROUNDS_PER_BIN} rounds a bin)"
        )
    return ConfidenceAnalysis(
        dataset, largest.method, B, grid, bins, np.asarray(means), recovery, note
    )


# ---- figures -------------------------------------------------------------------------------------


def _grid_axes(plt: Any, n: int, width: float, height: float) -> tuple[Any, list[Any]]:
    ncols = min(3, n)
    nrows = math.ceil(n / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(width * ncols, height * nrows), squeeze=False)
    flat = list(axes.flat)
    for ax in flat[n:]:
        ax.set_visible(False)
    return fig, flat[:n]


def _log2_budget_axis(ax: Any, budgets: Sequence[int], axis: str = "x") -> None:
    from matplotlib.ticker import NullLocator

    setter = ax.set_xscale if axis == "x" else ax.set_yscale
    setter("log", base=2)
    ticks = sorted(set(budgets))
    if axis == "x":
        ax.set_xticks(ticks, [str(b) for b in ticks])
        ax.xaxis.set_minor_locator(NullLocator())
    else:
        ax.set_yticks(ticks, [str(b) for b in ticks])
        ax.yaxis.set_minor_locator(NullLocator())


def plot_time_vs_budget(
    agg: Aggregates, temperature: float, path: str | os.PathLike[str]
) -> Path | None:
    """Paper Fig. 2: median ms/tok (left axis) and tau (right axis) against the DDTree budget
    (log2 axis), one panel per dataset, with AR's ms/tok as a line (one per AR dtype run, the
    speed-up baseline dotted) and CaDDTree as a star at its mean budget. ``None`` when there are
    no DDTree runs at this temperature."""
    datasets = [d for d in agg.datasets(temperature) if agg.ddtree(temperature, d)]
    if not datasets:
        return None
    plt = pyplot()
    fig, axes = _grid_axes(plt, len(datasets), 4.8, 3.5)
    for ax, d in zip(axes, datasets):
        runs = agg.ddtree(temperature, d)
        budgets = [int(s.budget or 0) for s in runs]
        ax.plot(
            budgets, [s.ms_per_token for s in runs], "o-", color="tab:blue", label="DDTree ms/tok"
        )
        _log2_budget_axis(ax, budgets)
        oracle = agg.oracle(temperature, d)
        if oracle is not None:
            ax.plot(
                [oracle.budget],
                [oracle.ms_per_token],
                "o",
                ms=12,
                mfc="none",
                color="tab:blue",
                label=f"oracle n*={oracle.budget}",
            )
        ars = agg.ar_runs(temperature, d)
        base = agg.baseline(temperature, d)
        for ar in ars:
            if len(ars) == 1:
                label = f"AR {ar.ms_per_token:.2f}"
            else:
                name = _ar_title(agg, temperature, ar.method)
                label = f"{name} {ar.ms_per_token:.2f}" + (" (baseline)" if ar is base else "")
            ax.axhline(
                ar.ms_per_token,
                color="grey" if ar is base else "silver",
                ls=":" if ar is base else "-.",
                label=label,
            )
        ca = agg.get(temperature, d, "caddtree")
        if ca is not None and math.isfinite(ca.budget_mean) and ca.budget_mean > 0:
            ax.plot(
                [ca.budget_mean],
                [ca.ms_per_token],
                "*",
                ms=14,
                color="tab:green",
                label=f"CaDDTree (mean n {ca.budget_mean:.0f})",
            )
        ax.set_xlabel("DDTree budget (nodes)")
        ax.set_ylabel("ms / token", color="tab:blue")
        ax.set_title(dataset_name(d))
        ax2 = ax.twinx()
        ax2.plot(budgets, [s.tau for s in runs], "s--", color="tab:orange", label="τ")
        ax2.set_ylabel("τ (tokens / round)", color="tab:orange")
        h1, l1 = ax.get_legend_handles_labels()
        h2, l2 = ax2.get_legend_handles_labels()
        ax.legend(
            h1 + h2, l1 + l2, fontsize=7, ncol=2, loc="upper center", bbox_to_anchor=(0.5, -0.2)
        )
    fig.suptitle(
        f"Per-token time and acceptance length vs DDTree budget (temperature {_t(temperature)})"
    )
    fig.tight_layout()
    return save_figure(fig, path)


def plot_confidence(
    analyses: Sequence[ConfidenceAnalysis], path: str | os.PathLike[str]
) -> Path | None:
    """Paper Fig. 1: one panel per dataset with mean acceptance against budget for each confidence
    bin (bin 1 = least confident), and a last panel with each bin's recovery budget (the smallest
    budget reaching the largest budget's acceptance), one line per dataset."""
    if not analyses:
        return None
    plt = pyplot()
    fig, axes = _grid_axes(plt, len(analyses) + 1, 4.6, 3.5)
    cmap = plt.get_cmap("viridis")
    for ax, a in zip(axes, analyses):
        k = len(a.bins)
        for i, (lo, hi, _count) in enumerate(a.bins):
            ax.plot(
                a.grid,
                a.acceptance[i],
                "o-",
                ms=3,
                color=cmap(i / max(k - 1, 1)),
                label=f"bin {i + 1} ({lo:.2f}–{hi:.2f})",
            )
        _log2_budget_axis(ax, a.grid)
        ax.set_xlabel("budget n (nodes)")
        ax.set_ylabel("acceptance length")
        ax.set_title(f"{dataset_name(a.dataset)} ({a.method} rounds)")
        ax.legend(fontsize=6, title="confidence bin", title_fontsize=6)
    ax = axes[-1]
    for a in analyses:
        ax.plot(range(1, len(a.bins) + 1), a.recovery, "o-", label=dataset_name(a.dataset))
    _log2_budget_axis(ax, [b for a in analyses for b in a.grid], axis="y")
    ax.set_xticks(range(1, max(len(a.bins) for a in analyses) + 1))
    ax.set_xlabel("confidence bin (1 = low)")
    ax.set_ylabel("budget recovering 100% of acceptance")
    ax.set_title("Budget needed vs drafter confidence")
    ax.legend(fontsize=7)
    fig.suptitle("Acceptance length vs budget by drafter-confidence bin (temperature 0)")
    fig.tight_layout()
    return save_figure(fig, path)


def _integer_bins(values: Sequence[int], most: int = 30) -> np.ndarray:
    """Histogram edges centred on integers, at most ``most`` bins of a whole number of budgets."""
    lo, hi = min(values), max(values)
    width = max(1, math.ceil((hi - lo + 1) / most))
    return np.arange(lo, hi + width + 1, width) - 0.5


def plot_budget_histograms(
    agg: Aggregates, temperature: float, path: str | os.PathLike[str]
) -> Path | None:
    """Paper Fig. 5: the distribution of CaDDTree's per-round budget n* per dataset (nominal cost
    model), mean and std in the legend, and the DDTree-oracle n* as a vertical line. ``None``
    without CaDDTree runs at this temperature."""
    datasets = [d for d in agg.datasets(temperature) if agg.get(temperature, d, "caddtree")]
    if not datasets:
        return None
    plt = pyplot()
    fig, axes = _grid_axes(plt, len(datasets), 4.6, 3.2)
    for ax, d in zip(axes, datasets):
        s = agg.get(temperature, d, "caddtree")
        assert s is not None
        budgets = [b for r in agg.records[(temperature, d, "caddtree")] for b in r["budgets"]]
        if not budgets:  # every prompt ended before its first round
            ax.text(0.5, 0.5, "no rounds", ha="center", va="center", transform=ax.transAxes)
            ax.set_title(dataset_name(d))
            continue
        ax.hist(
            budgets,
            bins=_integer_bins(budgets),
            color="tab:green",
            alpha=0.75,
            label=f"CaDDTree n* (mean {s.budget_mean:.1f}, std {s.budget_std:.1f})",
        )
        oracle = agg.oracle(temperature, d)
        if oracle is not None:
            ax.axvline(
                oracle.budget, color="black", ls="--", label=f"DDTree-oracle n* = {oracle.budget}"
            )
        ax.set_xlabel("per-round budget n*")
        ax.set_ylabel("rounds")
        ax.set_title(dataset_name(d))
        ax.legend(fontsize=7)
    fig.suptitle(f"CaDDTree per-round budget distribution (temperature {_t(temperature)})")
    fig.tight_layout()
    return save_figure(fig, path)


def _token_label(text: Any) -> str:
    text = "" if text is None else str(text)
    if not text.strip():
        text = repr(text)
    text = text.replace("\n", "\\n").replace("\t", "\\t").replace("$", r"\$")
    return text if len(text) <= 12 else text[:11] + "…"


def rejected_subtrees(rec: dict[str, Any]) -> list[int]:
    """For a tree record (see :func:`load_trees`): entry ``k`` is the number of nodes in the
    rejected subtrees hanging below position ``k`` of the accepted chain (0 = the root, the bonus
    token; ``k`` = the k-th accepted node), i.e. all nodes under its children that are not on the
    accepted path."""
    parents = rec["parents"]
    n = len(parents)
    size = [1] * n
    for i in range(n - 1, -1, -1):  # parents precede children (checked by load_trees)
        if parents[i] >= 0:
            size[parents[i]] += size[i]
    path = list(rec.get("path") or [])
    on_path = set(path)
    rejected = [0] * (len(path) + 1)
    position = {node: k for k, node in enumerate([-1, *path])}
    for i, p in enumerate(parents):
        if p in position and i not in on_path:
            rejected[position[p]] += size[i]
    return rejected


def _tree_columns(rec: dict[str, Any]) -> int:
    """Layers (depths) the drawing of ``rec`` needs: the root, the accepted chain, and one more
    when the last accepted node has rejected children."""
    rejected = rejected_subtrees(rec)
    return len(rejected) + (1 if rejected[-1] else 0)


def _draw_tree(ax: Any, rec: dict[str, Any], columns: int) -> None:
    """One draft tree, layered by depth: the bonus token (root) as an orange circle at depth 0,
    accepted nodes as green boxes along the top row (token text and ↑rank), and under every
    accepted node (or the root) one "+N" marker in the next layer for the N nodes of its rejected
    child subtrees."""
    n = len(rec["parents"])
    path = list(rec.get("path") or [])
    texts = rec.get("token_texts") or [str(t) for t in rec.get("token_ids", [""] * n)]
    ranks = rec.get("ranks")
    rejected = dict(enumerate(rejected_subtrees(rec)))
    chain = [-1, *path]
    edge = {"color": "0.3", "lw": 1, "zorder": 1}
    for pos in range(1, len(chain)):
        ax.plot([pos - 1, pos], [0, 0], **edge)
    for pos, count in rejected.items():
        if count:
            ax.plot([pos, pos + 1], [0, -1], ls="--", **edge)
            ax.text(
                pos + 1,
                -1,
                "+",
                ha="center",
                va="center",
                fontsize=10,
                zorder=2,
                bbox={"boxstyle": "circle,pad=0.2", "fc": "0.85", "ec": "0.4"},
            )
            ax.text(pos + 1, -1.45, str(count), ha="center", va="center", fontsize=8)
    ax.text(
        0,
        0,
        _token_label(rec.get("bonus_text", "")),
        ha="center",
        va="center",
        fontsize=8,
        zorder=3,
        bbox={"boxstyle": "circle,pad=0.35", "fc": "#f5a623", "ec": "#b36b00"},
    )
    for pos, node in enumerate(path, start=1):
        rank = f"\n↑{ranks[node] + 1}" if ranks is not None else ""
        ax.text(
            pos,
            0,
            _token_label(texts[node]) + rank,
            ha="center",
            va="center",
            fontsize=7,
            zorder=3,
            bbox={"boxstyle": "round,pad=0.3", "fc": "#b7e4b0", "ec": "#2e7d32"},
        )
    ax.set_xlim(-0.7, columns - 0.3)
    ax.set_ylim(-1.75, 0.45)
    ax.axis("off")
    ax.set_title(
        f"{dataset_name(rec['dataset'])}, prompt {rec['prompt_index']}, round {rec['round']}: "
        f"n* = {rec['budget']}, {len(path)} accepted",
        fontsize=9,
    )


def plot_trees(records: Sequence[dict[str, Any]], path: str | os.PathLike[str]) -> Path | None:
    """Paper Fig. 6: the trees with the smallest and the largest budget among ``records`` (one
    tree when they coincide)."""
    if not records:
        return None
    small = min(records, key=lambda r: r["budget"])
    large = max(records, key=lambda r: r["budget"])
    chosen = [small] if small is large or small["budget"] == large["budget"] else [small, large]
    columns = max(max(_tree_columns(r) for r in chosen), 6)  # one scale for both trees
    plt = pyplot()
    fig, axes = plt.subplots(
        len(chosen), 1, figsize=(0.95 * columns + 0.5, 1.9 * len(chosen)), squeeze=False
    )
    for ax, rec in zip(axes[:, 0], chosen):
        _draw_tree(ax, rec, columns)
    fig.tight_layout()
    return save_figure(fig, path)


# ---- the report ----------------------------------------------------------------------------------


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-." else "_" for c in text)


def _figures(
    agg: Aggregates,
    trees_path: Path,
    out: Path,
    cost_model: Any,
    notes: list[str],
) -> list[tuple[Path, str]]:
    """Draw every figure the data supports; (path, caption) each. Skips are added to ``notes``."""
    figures: list[tuple[Path, str]] = []

    def add(path: Path | None, caption: str) -> None:
        if path is not None:
            figures.append((path, caption))

    if 0.0 in agg.temperatures():
        analyses = []
        for d in agg.datasets(0.0):
            result = confidence_analysis(agg, d)
            if isinstance(result, str):
                notes.append(f"Fig. 1 leaves out {dataset_name(d)}: {result}.")
                continue
            if result.note:
                notes.append(f"Fig. 1: {result.note}.")
            analyses.append(result)
        add(
            plot_confidence(analyses, out / "fig1_confidence.png"),
            "Fig. 1 — acceptance length vs budget by drafter-confidence bin, replayed from the "
            "largest DDTree budget's rounds (acceptance at budget n = 1 + accepted path nodes "
            "among the first n); last panel: the smallest budget recovering 100% of the "
            "largest budget's acceptance, per bin.",
        )
    else:
        notes.append("Fig. 1 skipped: it uses temperature-0 runs and there are none.")
    for t in agg.temperatures():
        add(
            plot_time_vs_budget(agg, t, out / f"fig2_time_vs_budget_T{_t(t)}.png"),
            f"Fig. 2 — median ms/tok (left) and τ (right) vs DDTree budget, temperature {_t(t)}; "
            "AR dotted (other AR dtypes dash-dotted), CaDDTree a star at its mean budget, the "
            "oracle circled.",
        )
    for t in agg.temperatures():
        add(
            plot_budget_histograms(agg, t, out / f"fig5_budgets_T{_t(t)}.png"),
            f"Fig. 5 — CaDDTree per-round budget distribution, temperature {_t(t)}; dashed: the "
            "DDTree-oracle n*.",
        )
    if trees_path.is_file():
        trees = load_trees(trees_path, notes)
        groups: dict[tuple[float, str, str], list[dict[str, Any]]] = {}
        for rec in trees:
            groups.setdefault(
                (float(rec["temperature"]), rec["dataset"], rec["method"]), []
            ).append(rec)
        for (t, d, m), recs in sorted(
            groups.items(), key=lambda kv: (kv[0][0], _dataset_key(kv[0][1]), kv[0][2])
        ):
            name = f"fig6_trees_{_slug(d)}_{_slug(m)}_T{_t(t)}.png"
            add(
                plot_trees(recs, out / name),
                f"Fig. 6 — {m} draft trees on {dataset_name(d)}, temperature {_t(t)}, smallest and "
                "largest n*: orange = bonus token (root), green = accepted tokens (↑k: k-th most "
                "probable sibling), + N = a rejected subtree of N nodes.",
            )
        if not trees:
            notes.append(f"Fig. 6 skipped: {trees_path.name} holds no trees.")
    else:
        notes.append(f"Fig. 6 skipped: no draft-trees file {trees_path.name} next to the results.")
    if cost_model is not None:
        from .profiling import plot_cost_model

        try:
            drawn = Path(plot_cost_model(cost_model, out / "fig4_cost_model.png"))
        except CaddtreeError as exc:
            notes.append(f"Fig. 4 skipped: {exc}.")
        else:
            add(
                drawn,
                "Fig. 4 — verification latency vs draft nodes per context length, with the "
                "fitted convex cost model.",
            )
    return figures


def _meta_lines(meta: dict[str, Any]) -> list[str]:
    lines = ["| key | value |", "|:--|:--|"]
    for key, value in meta.items():
        text = value if isinstance(value, str) else json.dumps(value)
        cell = text.replace("|", "\\|").replace("\n", " ")
        lines.append(f"| {key} | {cell} |")
    return lines


@dataclass
class Report:
    """What :func:`build_report` wrote: the files, the notes on what was skipped, and the tables."""

    files: list[Path]
    notes: list[str]
    tables: list[Table]


def build_report(
    results_path: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    cost_model: str | os.PathLike[str] | None = None,
) -> Report:
    """:func:`write_report`, also returning the notes and the tables (for the command line)."""
    results_path = Path(results_path)
    out = Path(out_dir)
    records, notes = _load_results(results_path)
    model = None
    if cost_model is not None:
        from .cost import load_cost_model

        model = load_cost_model(cost_model)
    meta_path = side_file(results_path, "meta")
    meta = load_meta(meta_path)
    trees_path = side_file(results_path, "trees")
    agg = aggregate(records)
    tables = all_tables(agg)

    out.mkdir(parents=True, exist_ok=True)
    if meta is None:
        notes.append(f"No run metadata: {meta_path.name} is missing next to the results.")
    notes += agg.notes
    try:
        pyplot()
    except MissingDependencyError as exc:
        figures: list[tuple[Path, str]] = []
        notes.append(f"Figures skipped: {exc}.")
    else:
        figures = _figures(agg, trees_path, out, model, notes)

    n_prompts = len({(r["dataset"], r["prompt_index"]) for r in records})
    md = [
        "# CaDDTree benchmark report",
        "",
        f"Results: `{results_path}`: {len(records)} records, {n_prompts} prompts, "
        f"{len({r['method'] for r in records})} methods, temperatures "
        f"{', '.join(_t(t) for t in agg.temperatures())}.",
        "",
        "ms/tok is the median over prompts of wall time per new token; speed-up is AR's median "
        "over the method's (with AR run in several dtypes, the fastest AR's); τ is committed "
        "tokens over rounds, pooled over prompts; the "
        "DDTree-oracle is the DDTree budget with the lowest median ms/tok. See "
        "docs/benchmarking-report.md.",
        "",
    ]
    if meta is not None:
        md += ["## Run", "", *_meta_lines(meta), ""]
    if notes:
        md += ["## Notes", "", *(f"- {n}" for n in notes), ""]
    for table in tables:
        md += [f"## {table.title}", "", table.markdown(), ""]
    if figures:
        md += ["## Figures", ""]
        for path, caption in figures:
            md += [f"![{path.stem}]({path.name})", "", caption, ""]
    tex = [
        f"% Tables written by `caddtree report` from {results_path}; needs \\usepackage{{booktabs}}.",
        "",
    ]
    for table in tables:
        tex += [table.latex(), ""]
    written = [
        atomic_write_text(out / "report.md", "\n".join(md)),
        atomic_write_text(out / "tables.tex", "\n".join(tex)),
    ]
    return Report(written + [p for p, _ in figures], notes, tables)


def write_report(
    results_path: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    cost_model: str | os.PathLike[str] | None = None,
) -> list[Path]:
    """Write ``report.md`` (run metadata, notes, every Markdown table, the figures), ``tables.tex``
    (the same tables in booktabs LaTeX) and the figures' PNGs into ``out_dir``; return the paths.

    ``cost_model`` is an optional cost-model file to draw Fig. 4 from (with
    :func:`caddtree.profiling.plot_cost_model`). Side files that are missing
    (``results.meta.json``, ``results.trees.jsonl``), figures the data cannot support and a missing
    matplotlib are skipped with a note in the report, never an error. Bad input (the results, a
    side file, the cost model) raises a :class:`~caddtree.errors.CaddtreeError`; the results and
    the cost model are checked before anything is written.
    """
    return build_report(results_path, out_dir, cost_model).files
