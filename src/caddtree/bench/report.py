"""``caddtree report``: the paper's tables and figures from ``caddtree bench`` results.

Input is ``results.jsonl`` (one JSON record per dataset, prompt, method and temperature, written by
``caddtree bench``) and, when they are there, two side files next to it: ``results.meta.json`` (the
run's machine, models and command) and ``results.trees.jsonl`` (draft trees for Fig. 6). The files
and records are defined (and validated) in :mod:`caddtree.bench.results`; every number comes from
:func:`caddtree.bench.summary.aggregate`, the tables from :mod:`caddtree.bench.tables` and the
figures from :mod:`caddtree.bench.figures`. This module ties them together into ``report.md`` and
``tables.tex``. Users' description: ``docs/benchmarking-report.md``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..util.errors import CaddtreeError, InvalidInputError, MissingDependencyError
from ..util.files import atomic_write_text
from ..util.plots import pyplot
from .figures import plot_budget_histograms, plot_confidence, plot_time_vs_budget, plot_trees
from .results import (
    dataset_key,
    dataset_name,
    load_meta,
    load_results_with_notes,
    load_trees,
    mixed_machines,
    side_file,
)
from .summary import Aggregates, aggregate, confidence_analysis, temperature_label
from .tables import Table, all_tables

__all__ = ["Report", "build_report", "write_report"]


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
            plot_time_vs_budget(agg, t, out / f"fig2_time_vs_budget_T{temperature_label(t)}.png"),
            "Fig. 2 — median ms/tok (left) and τ (right) vs DDTree budget, temperature "
            f"{temperature_label(t)}; AR dotted (other AR dtypes dash-dotted), CaDDTree a star at "
            "its mean budget, the oracle circled.",
        )
    for t in agg.temperatures():
        add(
            plot_budget_histograms(agg, t, out / f"fig5_budgets_T{temperature_label(t)}.png"),
            "Fig. 5 — CaDDTree per-round budget distribution, temperature "
            f"{temperature_label(t)}; dashed: the DDTree-oracle n*.",
        )
    for path, caption in _tree_figures(trees_path, out, notes):
        add(path, caption)
    if cost_model is not None:
        from ..core.profiling import plot_cost_model

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


def _tree_figures(trees_path: Path, out: Path, notes: list[str]) -> list[tuple[Path | None, str]]:
    """Fig. 6 for each temperature, dataset and method of the draft-trees file (skips noted)."""
    if not trees_path.is_file():
        notes.append(f"Fig. 6 skipped: no draft-trees file {trees_path.name} next to the results.")
        return []
    trees = load_trees(trees_path, notes)
    if not trees:
        notes.append(f"Fig. 6 skipped: {trees_path.name} holds no trees.")
    groups: dict[tuple[float, str, str], list[dict[str, Any]]] = {}
    for rec in trees:
        groups.setdefault((float(rec["temperature"]), rec["dataset"], rec["method"]), []).append(
            rec
        )
    figures = []
    for (t, d, m), recs in sorted(
        groups.items(), key=lambda kv: (kv[0][0], dataset_key(kv[0][1]), kv[0][2])
    ):
        name = f"fig6_trees_{_slug(d)}_{_slug(m)}_T{temperature_label(t)}.png"
        figures.append(
            (
                plot_trees(recs, out / name),
                f"Fig. 6 — {m} draft trees on {dataset_name(d)}, temperature "
                f"{temperature_label(t)}, smallest and largest n*: orange = bonus token (root), "
                "green = accepted tokens (↑k: k-th most probable sibling), + N = a rejected "
                "subtree of N nodes.",
            )
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
    pool_machines: bool = False,
) -> Report:
    """:func:`write_report`, also returning the notes and the tables (for the command line).
    Results whose ranks ran on different machines are refused unless ``pool_machines`` (the
    report then says which machines its timings pool)."""
    results_path = Path(results_path)
    out = Path(out_dir)
    records, notes = load_results_with_notes(results_path)
    meta_path = side_file(results_path, "meta")
    meta = load_meta(meta_path)
    mixed = mixed_machines(meta)
    if mixed and not pool_machines:
        raise InvalidInputError(
            f"the ranks of {results_path} ran on different machines ({mixed}), so its timings "
            "would pool them; pass --pool-machines to report them pooled anyway (the report "
            "says so), or benchmark each machine in a run of its own"
        )
    if mixed:
        notes.append(f"Timings pool different machines: {mixed}.")
    model = None
    if cost_model is not None:
        from ..core.cost import load_cost_model

        model = load_cost_model(cost_model)
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
        f"{', '.join(temperature_label(t) for t in agg.temperatures())}.",
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
    pool_machines: bool = False,
) -> list[Path]:
    """Write ``report.md`` (run metadata, notes, every Markdown table, the figures), ``tables.tex``
    (the same tables in booktabs LaTeX) and the figures' PNGs into ``out_dir``; return the paths.

    ``cost_model`` is an optional cost-model file to draw Fig. 4 from (with
    :func:`caddtree.core.profiling.plot_cost_model`). Side files that are missing
    (``results.meta.json``, ``results.trees.jsonl``), figures the data cannot support and a missing
    matplotlib are skipped with a note in the report, never an error. Bad input (the results, a
    side file, the cost model) raises a :class:`~caddtree.util.errors.CaddtreeError`; the results and
    the cost model are checked before anything is written; so are the machines of a torchrun run's
    ranks (different ones are refused unless ``pool_machines``).
    """
    return build_report(results_path, out_dir, cost_model, pool_machines).files
