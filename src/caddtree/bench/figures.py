"""The paper's figures from :func:`caddtree.bench.summary.aggregate` and the draft trees of
``results.trees.jsonl``, drawn with matplotlib (the optional ``plot`` extra; see
:mod:`caddtree.util.plots`): Fig. 1 (acceptance by drafter confidence), Fig. 2 (time and tau against the
DDTree budget), Fig. 5 (CaDDTree's per-round budgets) and Fig. 6 (draft trees). Fig. 4 (the cost
model) is :func:`caddtree.core.profiling.plot_cost_model`.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..util.plots import pyplot, save_figure
from .results import dataset_name
from .summary import Aggregates, ConfidenceAnalysis, ar_title, temperature_label

__all__ = [
    "plot_budget_histograms",
    "plot_confidence",
    "plot_time_vs_budget",
    "plot_trees",
    "rejected_subtrees",
]


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
                name = ar_title(agg, temperature, ar.method)
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
        "Per-token time and acceptance length vs DDTree budget "
        f"(temperature {temperature_label(temperature)})"
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
    fig.suptitle(
        f"CaDDTree per-round budget distribution (temperature {temperature_label(temperature)})"
    )
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
