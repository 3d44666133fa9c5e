"""The paper's tables from :func:`caddtree.bench.summary.aggregate`, each both in Markdown (for
``report.md`` and the summary ``caddtree bench`` prints) and in booktabs LaTeX (``tables.tex``):
Table 1 (Table 4 at temperature 1), the cost-model ablations of Tables 2 and 3, and every method
per dataset (:func:`method_table`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from .results import VARIANTS, dataset_name
from .summary import Aggregates, aggregate, ar_title, temperature_label

__all__ = [
    "VARIANT_TITLES",
    "Cell",
    "Table",
    "ablation_table",
    "all_tables",
    "method_table",
    "sensitivity_table",
    "summary_table",
    "table1",
]

VARIANT_TITLES = {
    "cd0.5": ("C_d×0.5", r"$C_d{\times}0.5$"),
    "cd2": ("C_d×2", r"$C_d{\times}2.0$"),
    "cv0.5": ("C_v×0.5", r"$C_v{\times}0.5$"),
    "cv2": ("C_v×2", r"$C_v{\times}2.0$"),
}


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
    rows = [_table1_row(agg, temperature, d, labels, several) for d in agg.datasets(temperature)]
    t = temperature_label(temperature)
    header = _table1_latex_header(agg, temperature, labels, several)
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
        ar_columns = [f"{ar_title(agg, temperature, label)} ms/tok" for label in labels]
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


def _table1_row(
    agg: Aggregates, temperature: float, d: str, labels: list[str], several: bool
) -> list[Cell]:
    """Table 1's row for dataset ``d``: one AR column per label in ``labels``, and with
    ``several`` the baseline marked in LaTeX and named in a last column."""
    k = len(labels)
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
    return row


def _table1_latex_header(
    agg: Aggregates, temperature: float, labels: list[str], several: bool
) -> str:
    """Table 1's LaTeX header lines: the method groups, their rules and the column names."""
    k = len(labels)
    if several:
        ar_head = rf"\multicolumn{{{k}}}{{c}}{{\textbf{{AR}} ms/tok}}" if k > 1 else r"\textbf{AR}"
        ar_rule = rf"\cmidrule(lr){{2-{1 + k}}}" if k > 1 else ""
        ar_sub = " & ".join(
            _latex_escape(title[3:] if title.startswith("AR ") else "run dtype")
            for title in (ar_title(agg, temperature, label) for label in labels)
        )
    else:
        ar_head, ar_rule, ar_sub = r"\textbf{AR}", "", "ms/tok"

    def span(a: int, b: int) -> str:
        return rf"\cmidrule(lr){{{a + k - 1}-{b + k - 1}}}"

    return "\n".join(
        [
            rf" & {ar_head} & \multicolumn{{2}}{{c}}{{\textbf{{DFlash}}}} & "
            r"\multicolumn{3}{c}{\textbf{DDTree-oracle}} & \multicolumn{3}{c}{\textbf{CaDDTree}} \\",
            ar_rule + span(3, 4) + span(5, 7) + span(8, 10),
            rf"\textbf{{Dataset}} & {ar_sub} & ms/tok & $\tau$ & ms/tok & $\tau$ & $n^*$ "
            r"& ms/tok & $\tau$ & $\bar{n}^*(\sigma)$ \\",
        ]
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
    t = temperature_label(temperature)
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
    t = temperature_label(temperature)
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
                    MISSING if s.decode_ms_per_token is None else _num(s.decode_ms_per_token),
                    _speedup(s.speedup),
                    _num(s.tau),
                    budget,
                    _int(s.prompts),
                    same,
                ]
            )
    t = temperature_label(temperature)
    return Table(
        key=f"methods_T{t}",
        title=f"All methods, temperature {t}",
        caption=(
            f"Every method at temperature~{t}: median and mean ms/tok over prompts, the median "
            "ms/tok after the prefill (decode), speed-up over "
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
            "decode ms/tok",
            "speed-up vs fastest AR" if several else "speed-up vs AR",
            "τ",
            "budget mean (std)",
            "prompts",
            "identical to AR",
        ],
        rows=rows,
        latex_spec="llcccccccc",
        latex_header=(
            r"Dataset & Method & ms/tok & mean ms/tok & decode ms/tok & speed-up & $\tau$ & budget "
            r"& prompts & $=$AR \\"
        ),
        midrule_before=tuple(breaks),
        wide=True,
    )


def lookup_table(agg: Aggregates, temperature: float) -> Table | None:
    """Copies from the context: for each method with lookup, per dataset, tau, the accepted
    copied nodes per round and their share of the tokens committed in rounds. ``None`` without
    records of such methods."""
    rows = [
        [
            _text(dataset_name(d)),
            _text(s.method),
            _num(s.tau),
            _num(s.copied_per_round),
            Cell(f"{100 * s.copied_share:.0f}%", f"{100 * s.copied_share:.0f}\\%"),
        ]
        for d in agg.datasets(temperature)
        for s in agg.methods(temperature, d)
        if s.copied_share is not None
    ]
    if not rows:
        return None
    t = temperature_label(temperature)
    return Table(
        key=f"lookup_T{t}",
        title=f"Copies from the context, temperature {t}",
        caption=(
            f"Methods with copies from the context at temperature~{t}: pooled $\\tau$, accepted "
            "copied nodes per round, and their share of the tokens committed in rounds."
        ),
        columns=["Dataset", "Method", "τ", "copied accepted / round", "share of τ"],
        rows=rows,
        latex_spec="llccc",
        latex_header=r"Dataset & Method & $\tau$ & copied / round & share \\",
    )


def all_tables(agg: Aggregates) -> list[Table]:
    """Every table the data supports, temperature by temperature: Table 1, Table 2 and Table 3
    (when their ablation records exist) and the full per-method table."""
    out: list[Table] = []
    for t in agg.temperatures():
        out.append(table1(agg, t))
        for extra in (ablation_table(agg, t), sensitivity_table(agg, t), lookup_table(agg, t)):
            if extra is not None:
                out.append(extra)
        out.append(method_table(agg, t))
    return out


def summary_table(records: list[dict[str, Any]]) -> str:
    """Markdown tables, one per temperature: every method's median ms per token, speed-up over
    the fastest AR of each dataset (``ar`` or an ``ar-<dtype>``; marked "baseline" when there
    are several), pooled tau, budget and outputs identical to AR's, as ``caddtree report``
    computes them (:func:`~caddtree.bench.summary.aggregate`, :func:`method_table`)."""
    agg = aggregate(records)
    return "\n\n".join(
        f"{table.title}\n\n{table.markdown()}"
        for table in (method_table(agg, t) for t in agg.temperatures())
    )
