"""The numbers behind ``caddtree report`` (and the summary ``caddtree bench`` prints).

Every number in every table and figure comes from one place, :func:`aggregate`, per
(temperature, dataset, method label):

* **ms/tok**: the median over prompts of each prompt's wall time per new token (the mean is kept
  too). **decode ms/tok**: the same median of the time after each turn's first token (its
  prefill) per token after the first, which is what llama-bench's token generation times.
  **Speed-up** over AR is the AR baseline's median ms/tok divided by the method's. The
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

Records come validated from :mod:`caddtree.bench.results`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from .results import dataset_key, dataset_name, method_key

__all__ = [
    "MIN_ROUNDS_PER_BIN",
    "Aggregates",
    "ConfidenceAnalysis",
    "MethodSummary",
    "Oracle",
    "aggregate",
    "ar_title",
    "budget_grid",
    "confidence_analysis",
    "temperature_label",
]

MIN_ROUNDS_PER_BIN = 5
"""Fig. 1 uses at most ten confidence bins and at least this many rounds per bin."""


def temperature_label(temperature: float) -> str:
    """How tables, figures and file names write a temperature (``0``, ``0.7``)."""
    return f"{temperature:g}"


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
    # median over prompts of the time after each turn's first token per token after the first
    # (the prefill excluded, as llama-bench's token generation excludes its depth); None when no
    # record has ``prefill_s``
    decode_ms_per_token: float | None = None
    # copies from the context (records with ``copied_accepted``): accepted copied nodes per
    # round, and their share of the tokens committed in rounds; None for a method without them
    copied_per_round: float | None = None
    copied_share: float | None = None


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
        return sorted(found, key=dataset_key)

    def get(self, temperature: float, dataset: str, method: str) -> MethodSummary | None:
        return self.summaries.get((temperature, dataset, method))

    def methods(self, temperature: float, dataset: str) -> list[MethodSummary]:
        """Every method run on ``dataset``, in the paper's order (AR, DFlash, DDTree by budget,
        CaDDTree, its ablation variants, anything else)."""
        rows = [s for (t, d, _), s in self.summaries.items() if t == temperature and d == dataset]
        return sorted(rows, key=lambda s: method_key(s.method, s.budget))

    def ar_runs(self, temperature: float, dataset: str) -> list[MethodSummary]:
        """The plain-decoding (AR) runs of ``dataset``: ``ar``, then ``ar-<dtype>`` by name."""
        return [s for s in self.methods(temperature, dataset) if s.family == "ar"]

    def ar_labels(self, temperature: float) -> list[str]:
        """Every AR label run at ``temperature`` on any dataset, ``ar`` first."""
        labels = {
            m for (t, _, m), s in self.summaries.items() if t == temperature and s.family == "ar"
        }
        return sorted(labels, key=method_key)

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
    groups, unmeasured, cut_short = _group_records(records)
    summaries = {key: _summarise(key, recs) for key, recs in groups.items()}
    ar_runs, baselines = _apply_baselines(summaries)
    agg = Aggregates(
        summaries=summaries,
        oracles={},
        records=groups,
        baselines={key: base.method for key, base in baselines.items()},
    )
    _note_baselines(agg, ar_runs, baselines)
    _note_left_out(agg, unmeasured, cut_short)
    _find_oracles(agg)
    _note_oracle_budgets(agg)
    return agg


def _group_records(
    records: Iterable[dict[str, Any]],
) -> tuple[dict[tuple[float, str, str], list[dict[str, Any]]], list[dict[str, Any]], int]:
    """The timed records by (temperature, dataset, method), each group by prompt index; the
    records without a time; how many timed records stopped early."""
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
    return groups, unmeasured, cut_short


def _decode_ms(rec: dict[str, Any]) -> float | None:
    """A record's decoding ms per token after each turn's first (``None`` without a prefill
    time, or with no token after the first)."""
    prefill, after = rec.get("prefill_s"), rec["new_tokens"] - rec.get("turns", 1)
    if prefill is None or after < 1:
        return None
    return 1e3 * (rec["wall_s"] - prefill) / after


def _summarise(key: tuple[float, str, str], recs: list[dict[str, Any]]) -> MethodSummary:
    """One group's summary, without a speed-up (:func:`_apply_baselines` adds it)."""
    t, d, m = key
    ms = np.array([r["ms_per_token"] for r in recs], dtype=np.float64)
    committed = sum(sum(r["committed"]) for r in recs)
    n_rounds = sum(len(r["committed"]) for r in recs)
    budgets = np.array([b for r in recs for b in r["budgets"]], dtype=np.float64)
    verdicts = [r.get("matches_ar") for r in recs if r.get("matches_ar") is not None]
    dtypes = {r.get("dtype") for r in recs}
    decode = [ms for ms in map(_decode_ms, recs) if ms is not None]
    copied = [c for r in recs for c in (r.get("copied_accepted") or [])]
    has_copies = any(r.get("copied_accepted") is not None for r in recs)
    first = recs[0]
    return MethodSummary(
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
        decode_ms_per_token=float(np.median(decode)) if decode else None,
        copied_per_round=sum(copied) / n_rounds if has_copies and n_rounds else None,
        copied_share=sum(copied) / committed if has_copies and committed else None,
    )


def _apply_baselines(
    summaries: dict[tuple[float, str, str], MethodSummary],
) -> tuple[dict[tuple[float, str], list[MethodSummary]], dict[tuple[float, str], MethodSummary]]:
    """Give every summary its speed-up over the fastest plain decoding of its (temperature,
    dataset). Returns the AR runs and that baseline, by (temperature, dataset)."""
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
    return ar_runs, baselines


def _note_baselines(
    agg: Aggregates,
    ar_runs: dict[tuple[float, str], list[MethodSummary]],
    baselines: dict[tuple[float, str], MethodSummary],
) -> None:
    """A note for each (temperature, dataset) with more than one AR run: which one is the
    baseline, and the others' times."""
    for (t, d), runs in sorted(ar_runs.items(), key=lambda kv: (kv[0][0], dataset_key(kv[0][1]))):
        if len(runs) > 1:
            base = baselines[(t, d)]
            others = ", ".join(
                f"{s.method}: {s.ms_per_token:.2f}"
                for s in sorted(runs, key=lambda s: method_key(s.method))
                if s is not base
            )
            agg.notes.append(
                f"{dataset_name(d)} at temperature {temperature_label(t)}: speed-ups are against "
                f"{base.method} ({base.ms_per_token:.2f} ms/tok), the fastest plain decoding "
                f"({others} ms/tok)."
            )


def _note_left_out(agg: Aggregates, unmeasured: list[dict[str, Any]], cut_short: int) -> None:
    """Notes on the records without a time and on those that stopped early."""
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


def _find_oracles(agg: Aggregates) -> None:
    """The DDTree-oracle of each (temperature, dataset), and a note where its methods ran on
    different numbers of prompts."""
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
                    f"{dataset_name(d)} at temperature {temperature_label(t)}: methods ran on "
                    f"different numbers of prompts ({detail}), so their medians are over different "
                    "prompt sets."
                )


def _note_oracle_budgets(agg: Aggregates) -> None:
    """A note for each dataset whose DDTree-oracle budget at a temperature above 0 differs from
    its budget at temperature 0."""
    for t in agg.temperatures():
        if t == 0.0:
            continue
        for d in agg.datasets(t):
            here, greedy = agg.oracle(t, d), agg.oracle(0.0, d)
            if here and greedy and here.budget != greedy.budget:
                agg.notes.append(
                    f"{dataset_name(d)}: the DDTree-oracle budget at temperature "
                    f"{temperature_label(t)} is {here.budget}, at temperature 0 it is "
                    f"{greedy.budget}. This report picks "
                    "the best budget per temperature; the paper's temperature-1 table reuses the "
                    "temperature-0 budget."
                )


def ar_title(agg: Aggregates, temperature: float, label: str) -> str:
    """How tables name an AR run: ``AR float32`` for ``ar-float32``; ``AR bfloat16`` for ``ar``
    when its records say it ran in bfloat16 (older records do not: plain ``AR``)."""
    if label != "ar":
        return f"AR {label.removeprefix('ar-')}"
    dtypes = {s.dtype for (t, _, m), s in agg.summaries.items() if t == temperature and m == label}
    dtype = dtypes.pop() if len(dtypes) == 1 else None
    return f"AR {dtype}" if dtype else "AR"


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
        return (
            f"no DDTree runs for {dataset_name(dataset)} at temperature "
            f"{temperature_label(temperature)}"
        )
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
