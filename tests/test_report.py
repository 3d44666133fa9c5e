"""`caddtree report`: aggregation, tables and figures from a hand-made results file whose numbers
can be worked out by hand (see the comments next to each record)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from caddtree import ConvexCostModel
from caddtree.bench.figures import rejected_subtrees
from caddtree.bench.report import write_report
from caddtree.bench.results import load_results, load_trees, side_file
from caddtree.bench.summary import aggregate, budget_grid, confidence_analysis
from caddtree.bench.tables import method_table, table1
from caddtree.cli import main
from caddtree.util.errors import InvalidInputError

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def record(dataset, index, method, ms, committed, budgets=None, temperature=0.0, **extra):
    """One results record in the `caddtree bench` schema."""
    family, budget, variant = method, None, None
    if method.startswith("ar-"):  # plain decoding in another dtype
        family = "ar"
    elif method.startswith("ddtree-"):
        family, budget = "ddtree", int(method.split("-")[1])
    elif method.startswith("caddtree-"):
        family, variant = "caddtree", method.removeprefix("caddtree-")
    rounds = len(committed)
    if budgets is None:
        budgets = [budget or (0 if family == "ar" else 15)] * rounds
    rec = {
        "dataset": dataset,
        "prompt_index": index,
        "prompt_id": f"{dataset}/{index}",
        "method": method,
        "family": family,
        "budget": budget,
        "variant": variant,
        "temperature": temperature,
        "turns": 1,
        "new_tokens": sum(committed),
        "rounds": rounds,
        "wall_s": ms * sum(committed) / 1000,
        "prefill_s": 0.01,
        "ms_per_token": ms,
        "tau": sum(committed) / rounds if rounds else None,
        "budgets": budgets,
        "accepted": [c - 1 for c in committed],
        "committed": committed,
        "context_lengths": list(range(10, 10 + rounds)),
        "confidence": [None if family == "ar" else 0.5] * rounds,
        "paths": [list(range(c - 1)) for c in committed],
        "matches_ar": None,
        "stop_reason": "max_new_tokens",
    }
    rec.update(extra)
    return rec


LOW_PATH, HIGH_PATH = [0, 5, 12], [0, 1, 2]  # accepted node indices (best-first order)


def greedy_records():
    recs = []
    # gsm8k, temperature 0 ------------------------------------------------------------------------
    # AR: median of 30, 32, 40 = 32 ms/tok
    for i, ms in enumerate([30.0, 32.0, 40.0]):
        recs.append(record("gsm8k", i, "ar", ms, [1, 1, 1, 1]))
    # DFlash: median 12; tau pooled (3+2 + 2 + 4+1) / 5 rounds = 2.40
    for i, (ms, c) in enumerate([(10.0, [3, 2]), (12.0, [2]), (14.0, [4, 1])]):
        recs.append(record("gsm8k", i, "dflash", ms, c))
    # DDTree-4: median 9.5 (mean 12.83); DDTree-8: median 8.5 (mean 15.5): the oracle is n* = 8
    # by median (by mean it would be 4); its tau = (4 + 4+2 + 3) / 4 = 3.25. DDTree-16: 11.
    for i, ms in enumerate([9.0, 9.5, 20.0]):
        recs.append(record("gsm8k", i, "ddtree-4", ms, [3, 3]))
    for i, (ms, c) in enumerate([(8.0, [4]), (8.5, [4, 2]), (30.0, [3])]):
        recs.append(record("gsm8k", i, "ddtree-8", ms, c))
    # DDTree-16 (the largest budget) carries Fig. 1's data: 10 rounds, 10 distinct confidences;
    # the five least confident accept LOW_PATH, the five most confident HIGH_PATH.
    confidences = [[0.1, 0.9, 0.2, 0.8], [0.3, 0.7, 0.4], [0.6, 0.5, 1.0]]
    for i, conf in enumerate(confidences):
        paths = [LOW_PATH if c <= 0.5 else HIGH_PATH for c in conf]
        recs.append(
            record("gsm8k", i, "ddtree-16", 11.0, [4] * len(conf), confidence=conf, paths=paths)
        )
    # CaDDTree: median 8.2, the best of the row; tau (5+3 + 4 + 2+2+2) / 6 = 3.00; budgets
    # 10, 20, 30, 10, 10, 10: mean 15, population std sqrt(350 / 6) = 7.64; identical to AR 2 of 3
    for i, (ms, c, b, same) in enumerate(
        [
            (8.0, [5, 3], [10, 20], True),
            (8.2, [4], [30], True),
            (9.0, [2, 2, 2], [10, 10, 10], False),
        ]
    ):
        recs.append(record("gsm8k", i, "caddtree", ms, c, budgets=b, matches_ar=same))
    # ablations: constant 16; C_d x0.5 median 8.1 (delta -0.10), C_d x2 median 8.5 (+0.30)
    for i in range(3):
        recs.append(record("gsm8k", i, "caddtree-constant", 16.0, [4, 4], budgets=[64, 64]))
    for i, ms in enumerate([8.0, 8.1, 9.0]):
        recs.append(record("gsm8k", i, "caddtree-cd0.5", ms, [4]))
    for i, ms in enumerate([8.4, 8.5, 9.0]):
        recs.append(record("gsm8k", i, "caddtree-cd2", ms, [4]))
    # math500, temperature 0: AR and CaDDTree only (no DDTree: no oracle, no Fig. 1 panel) -------
    for i in range(3):
        recs.append(record("math500", i, "ar", 31.0, [1, 1]))
        recs.append(record("math500", i, "caddtree", 10.0, [3, 3], budgets=[40, 60]))
    # gsm8k, temperature 1: the oracle is DDTree-4 here ------------------------------------------
    for i in range(3):
        recs.append(record("gsm8k", i, "ar", 30.0, [1, 1], temperature=1.0))
        recs.append(record("gsm8k", i, "ddtree-4", 9.0, [3], temperature=1.0))
        recs.append(record("gsm8k", i, "ddtree-8", 10.0, [3], temperature=1.0))
    return recs


def tree_records():
    # Tree A (3 nodes): a plain chain, all accepted. Tree B (7 nodes): the root has children 0
    # (accepted) and 1 (rejected, with child 5 and grandchild 6: a rejected subtree of 3 nodes);
    # node 0 has children 2 (accepted) and 3 (rejected: 1 node); node 2 has child 4 (accepted).
    base = {"dataset": "gsm8k", "prompt_index": 0, "method": "caddtree", "temperature": 0.0}
    a = {
        **base,
        "round": 3,
        "budget": 3,
        "accepted": 3,
        "token_ids": [5, 6, 7],
        "token_texts": [" The", " answer", " is"],
        "parents": [-1, 0, 1],
        "ranks": [0, 0, 0],
        "depths": [1, 2, 3],
        "path": [0, 1, 2],
        "bonus_text": "So",
    }
    b = {
        **base,
        "round": 9,
        "budget": 7,
        "accepted": 3,
        "token_ids": [1, 2, 3, 4, 8, 9, 10],
        "token_texts": [" x", "$", "\n", " y", "=", " z", "2"],
        "parents": [-1, -1, 0, 0, 2, 1, 5],
        "ranks": [0, 1, 1, 0, 0, 0, 0],
        "depths": [1, 1, 2, 2, 3, 2, 3],
        "path": [0, 2, 4],
        "bonus_text": " Let",
    }
    return [a, b]


def write_jsonl(path, recs):
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return path


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench")
    recs = greedy_records()
    # a resumed run measured AR's prompt 0 twice: the earlier (absurd) record must be dropped
    stale = record("gsm8k", 0, "ar", 1000.0, [1, 1, 1, 1])
    path = write_jsonl(root / "results.jsonl", [stale, *recs])
    write_jsonl(root / "results.trees.jsonl", tree_records())
    meta = {"machine": "test-box", "dtype": "float32", "target": "tiny", "max_new_tokens": 64}
    (root / "results.meta.json").write_text(json.dumps(meta))
    return path


@pytest.fixture(scope="module")
def report(results, tmp_path_factory):
    out = tmp_path_factory.mktemp("report")
    files = write_report(results, out)
    return out, files


def table_row(markdown: str, first_cell: str) -> list[str]:
    for line in markdown.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells[0] == first_cell:
            return cells
    raise AssertionError(f"no row {first_cell!r} in\n{markdown}")


def section(text: str, heading_start: str) -> str:
    """The Markdown section whose heading starts with ``heading_start``."""
    start = text.index("## " + heading_start)
    end = text.find("\n## ", start + 1)
    return text[start : end if end >= 0 else None]


# ---- loading and aggregation ---------------------------------------------------------------------


def test_load_results_keeps_the_last_of_duplicate_records(results):
    recs = load_results(results)
    assert len(recs) == len(greedy_records())
    ar0 = [
        r for r in recs if r["method"] == "ar" and r["dataset"] == "gsm8k" and r["temperature"] == 0
    ]
    assert sorted(r["ms_per_token"] for r in ar0) == [30.0, 32.0, 40.0]


def test_aggregate_medians_pooled_tau_budgets_and_oracle(results):
    agg = aggregate(load_results(results))
    ar = agg.get(0.0, "gsm8k", "ar")
    assert ar.ms_per_token == 32.0 and ar.prompts == 3
    assert ar.ms_per_token_mean == pytest.approx(34.0)
    dflash = agg.get(0.0, "gsm8k", "dflash")
    assert dflash.tau == pytest.approx(12 / 5)  # pooled, not the mean of per-prompt tau (2.5)
    ca = agg.get(0.0, "gsm8k", "caddtree")
    assert ca.ms_per_token == pytest.approx(8.2)
    assert ca.tau == pytest.approx(3.0)
    assert ca.budget_mean == pytest.approx(15.0)
    assert ca.budget_std == pytest.approx(math.sqrt(350 / 6))
    assert (ca.matches_ar, ca.matches_ar_known) == (2, 3)
    assert ca.speedup == pytest.approx(32 / 8.2)
    assert [s.budget for s in agg.ddtree(0.0, "gsm8k")] == [4, 8, 16]
    oracle = agg.oracle(0.0, "gsm8k")
    assert (oracle.budget, oracle.method) == (8, "ddtree-8")  # lowest median, not lowest mean
    assert oracle.ms_per_token == pytest.approx(8.5) and oracle.tau == pytest.approx(3.25)
    assert agg.oracle(1.0, "gsm8k").budget == 4
    assert agg.oracle(0.0, "math500") is None
    assert agg.temperatures() == [0.0, 1.0]
    assert agg.datasets(0.0) == ["math500", "gsm8k"]  # the paper's order
    assert any("temperature 1 is 4, at temperature 0 it is 8" in n for n in agg.notes)


def test_confidence_analysis_replays_the_largest_budget(results):
    agg = aggregate(load_results(results))
    a = confidence_analysis(agg, "gsm8k")
    assert a.method == "ddtree-16" and a.grid == [1, 2, 4, 8, 16]
    # 10 rounds, at least 5 per bin: 2 bins, the least confident first
    assert [count for _, _, count in a.bins] == [5, 5]
    assert a.bins[0][:2] == (0.1, 0.5) and a.bins[1][:2] == (0.6, 1.0)
    # LOW_PATH [0, 5, 12]: 1 + #indices < n; HIGH_PATH [0, 1, 2]
    np.testing.assert_allclose(a.acceptance[0], [2, 2, 2, 3, 4])
    np.testing.assert_allclose(a.acceptance[1], [2, 3, 4, 4, 4])
    assert a.recovery == [16, 4]
    assert "2 confidence bins instead of 10" in a.note
    assert "no DDTree runs" in confidence_analysis(agg, "math500")


def test_budget_grid():
    assert budget_grid(16) == [1, 2, 4, 8, 16]
    assert budget_grid(24) == [1, 2, 4, 8, 16, 24]
    assert budget_grid(1) == [1]


# ---- tables --------------------------------------------------------------------------------------


def test_table1_markdown_and_latex(report):
    out, _ = report
    md = (out / "report.md").read_text()
    t1 = section(md, "Table 1 — per-token time and acceptance length, temperature 0\n")
    row = table_row(t1, "GSM8K")
    assert row == [
        "GSM8K",
        "32.00",
        "12.00",
        "2.40",
        "8.50",
        "3.25",
        "8",
        "**8.20**",
        "3.00",
        "15.0 (7.6)",
        "3.90×",
    ]
    math_row = table_row(t1, "MATH-500")
    assert math_row[1] == "31.00" and math_row[4:7] == ["–", "–", "–"]
    assert math_row[7] == "**10.00**" and math_row[9] == "50.0 (10.0)"
    tex = (out / "tables.tex").read_text()
    assert r"\label{tab:table1_T0}" in tex and r"\toprule" in tex and r"\bottomrule" in tex
    latex_row = next(line for line in tex.splitlines() if line.startswith("GSM8K & 32.00"))
    assert latex_row == (
        r"GSM8K & 32.00 & 12.00 & 2.40 & 8.50 & 3.25 & 8 & \textbf{8.20} & 3.00 & $15.0\,(7.6)$ \\"
    )
    # temperature 1: the oracle is DDTree-4, the best of its row; no CaDDTree run
    t1_hot = section(md, "Table 1 — per-token time and acceptance length, temperature 1\n")
    assert table_row(t1_hot, "GSM8K")[4:8] == ["**9.00**", "3.00", "4", "–"]


def test_ablation_sensitivity_and_method_tables(report):
    out, _ = report
    md = (out / "report.md").read_text()
    t2 = section(md, "Table 2")
    assert table_row(t2, "C_v model") == ["C_v model", "GSM8K"]
    assert table_row(t2, "CaDDTree") == ["CaDDTree", "**8.20**"]
    assert table_row(t2, "Constant") == ["Constant", "16.00"]
    t3 = section(md, "Table 3")
    assert table_row(t3, "GSM8K") == ["GSM8K", "8.20", "-0.10", "+0.30", "–", "–"]
    assert "MATH-500" not in t3  # no perturbed runs there
    assert "Table 2 — cost-model ablation (ms/tok), temperature 1" not in md
    full = section(md, "All methods, temperature 0")
    methods = [line.split("|")[2].strip() for line in full.splitlines() if "| GSM8K |" in line]
    assert methods == [
        "ar",
        "dflash",
        "ddtree-4",
        "ddtree-8",
        "ddtree-16",
        "caddtree",
        "caddtree-constant",
        "caddtree-cd0.5",
        "caddtree-cd2",
    ]
    # the best median of the whole grid is bold: here the C_d x0.5 variant (8.10)
    assert "| GSM8K | caddtree-cd0.5 | **8.10** |" in full
    lines = [line for line in full.splitlines() if line.startswith("| GSM8K | ddtree-8 |")]
    assert lines == [
        "| GSM8K | ddtree-8 | 8.50 | 15.50 | 8.20 | 3.76× | 3.25 | 8.0 (0.0) | 3 | – |"
    ]
    assert "| GSM8K | caddtree | 8.20 | 8.40 | 7.71 | 3.90× | 3.00 | 15.0 (7.6) | 3 | 2/3 |" in full
    tex = (out / "tables.tex").read_text()
    assert r"CaDDTree & \textbf{8.20} \\" in tex
    assert r"GSM8K & 8.20 & $-0.10$ & $+0.30$ & -- & -- \\" in tex
    assert r"\label{tab:methods_T0}" in tex


# ---- figures and the report ----------------------------------------------------------------------


def test_report_writes_every_figure_as_png(report):
    out, files = report
    names = {p.name for p in files}
    expected = {
        "report.md",
        "tables.tex",
        "fig1_confidence.png",
        "fig2_time_vs_budget_T0.png",
        "fig2_time_vs_budget_T1.png",
        "fig5_budgets_T0.png",
        "fig6_trees_gsm8k_caddtree_T0.png",
    }
    assert names == expected
    md = (out / "report.md").read_text()
    for name in expected - {"report.md", "tables.tex"}:
        data = (out / name).read_bytes()
        assert data[:8] == PNG_MAGIC and len(data) > 1000, name
        assert f"]({name})" in md
    assert not list(out.glob(".*"))  # no temporary files left behind
    assert "## Run" in md and "test-box" in md
    assert "1 records repeated" in md
    assert "Fig. 1 leaves out MATH-500" in md


def test_trees_file_and_rejected_subtrees(results):
    trees = load_trees(results.with_name("results.trees.jsonl"))
    assert [t["budget"] for t in trees] == [3, 7]
    assert rejected_subtrees(trees[0]) == [0, 0, 0, 0]
    assert rejected_subtrees(trees[1]) == [3, 1, 0, 0]


def test_missing_side_files_are_skipped_with_a_note(tmp_path):
    recs = [r for r in greedy_records() if r["method"] in ("ar", "dflash")]
    path = write_jsonl(tmp_path / "results.jsonl", recs)
    files = write_report(path, tmp_path / "out")
    assert {p.name for p in files} == {"report.md", "tables.tex"}  # no DDTree/CaDDTree: no figures
    md = (tmp_path / "out" / "report.md").read_text()
    assert "No run metadata: results.meta.json is missing" in md
    assert "Fig. 6 skipped: no draft-trees file results.trees.jsonl" in md
    assert "## Run" not in md


def test_bad_trees_file_is_rejected(tmp_path):
    bad = tree_records()[1] | {"path": [0, 4]}  # node 4's parent is 2, not 0
    path = write_jsonl(tmp_path / "results.trees.jsonl", [bad])
    with pytest.raises(InvalidInputError, match="not a root-to-leaf chain"):
        load_trees(path)


def test_cost_model_figure_through_profiling(tmp_path, monkeypatch):
    n = np.array([0, 4, 16, 64])
    cost = ConvexCostModel.fit({0: (n, 0.01 + 1e-4 * n)}, draft_cost=0.003).save(
        tmp_path / "c.json"
    )
    path = write_jsonl(tmp_path / "results.jsonl", [record("gsm8k", 0, "ar", 30.0, [1])])
    calls = []

    def fake_plot(model, target):
        calls.append(model)
        target.write_bytes(PNG_MAGIC)
        return target

    import caddtree.core.profiling

    monkeypatch.setattr(caddtree.core.profiling, "plot_cost_model", fake_plot)
    files = write_report(path, tmp_path / "a", cost_model=cost)
    assert len(calls) == 1 and calls[0].draft_cost == pytest.approx(0.003)
    assert "fig4_cost_model.png" in {p.name for p in files}


# ---- bad input -----------------------------------------------------------------------------------


def test_missing_results_file(tmp_path):
    with pytest.raises(InvalidInputError, match="results file not found"):
        load_results(tmp_path / "nope.jsonl")


def test_broken_json_line_names_the_line(tmp_path):
    path = tmp_path / "results.jsonl"
    good = json.dumps(record("gsm8k", 0, "ar", 30.0, [1]))
    path.write_text(good + "\n" + good[:40] + "\n" + good + "\n")
    with pytest.raises(InvalidInputError, match=r"line 2: not valid JSON"):
        load_results(path)


def test_cut_off_last_line_is_skipped_with_a_note(tmp_path):
    # what an interrupted (or still running) benchmark leaves; `caddtree bench` redoes it
    path = tmp_path / "results.jsonl"
    recs = [record("gsm8k", i, "ar", 30.0 + i, [1]) for i in range(3)]
    path.write_text("".join(json.dumps(r) + "\n" for r in recs[:2]) + json.dumps(recs[2])[:50])
    assert [r["prompt_index"] for r in load_results(path)] == [0, 1]
    write_report(path, tmp_path / "out")
    assert "line 3 (the last) is cut off" in (tmp_path / "out" / "report.md").read_text()


def test_records_without_tokens_are_left_out(tmp_path):
    too_long = record("gsm8k", 2, "ar", 1.0, [], skipped="turn 1 has 900 prompt tokens")
    too_long |= {"ms_per_token": None, "tau": None, "new_tokens": 0}
    recs = [record("gsm8k", i, "ar", ms, [1]) for i, ms in enumerate([30.0, 40.0])]
    agg = aggregate([*recs, too_long])
    assert agg.get(0.0, "gsm8k", "ar").prompts == 2
    assert agg.get(0.0, "gsm8k", "ar").ms_per_token == 35.0
    assert any("1 records generated no tokens" in n and "900 prompt tokens" in n for n in agg.notes)


def test_side_file_names_follow_bench():
    assert side_file("runs/results.jsonl", "meta").as_posix() == "runs/results.meta.json"
    assert side_file("runs/r.jsonl", "trees").as_posix() == "runs/r.trees.jsonl"


def test_missing_keys_are_named(tmp_path):
    rec = record("gsm8k", 0, "ar", 30.0, [1])
    del rec["tau"], rec["committed"]
    path = write_jsonl(tmp_path / "results.jsonl", [rec])
    with pytest.raises(
        InvalidInputError, match=r"line 1: record is missing required keys 'tau', 'committed'"
    ):
        load_results(path)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"ms_per_token": float("nan")}, "'ms_per_token' must be null or a positive finite number"),
        ({"budgets": [1, 2, 3]}, r"'budgets' must be a list with one entry per round \(1 rounds\)"),
        (
            {"method": "ddtree-8", "family": "ddtree", "budget": None},
            "positive integer for a DDTree",
        ),
        ({"paths": [["a"]]}, "'paths' must be a list of valid per-round values"),
        ({"dtype": 16}, "'dtype' must be null or a string"),
    ],
)
def test_malformed_values_are_rejected(tmp_path, change, message):
    rec = record("gsm8k", 0, "ar", 30.0, [1]) | change
    path = write_jsonl(tmp_path / "results.jsonl", [rec])
    with pytest.raises(InvalidInputError, match=message):
        load_results(path)


def test_empty_results_file(tmp_path):
    path = tmp_path / "results.jsonl"
    path.write_text("\n")
    with pytest.raises(InvalidInputError, match="holds no records"):
        load_results(path)


# ---- AR in several dtypes: speed-ups against the fastest --------------------------------------------


def dtype_records():
    """A bfloat16 run that also measured plain decoding in float32 (``ar-float32``)."""
    recs = []
    # GSM8K: AR bf16 per-prompt 31, 32, 35: median 32 (mean 32.67); AR fp32 29, 30, 40: median 30
    # (mean 33). fp32 is the faster plain decoding by median (not by mean): the baseline.
    # CaDDTree median 8: speed-up 30 / 8 = 3.75 (it would be 32 / 8 = 4.00 against bf16 AR).
    for i, (bf16, fp32) in enumerate([(31.0, 29.0), (32.0, 30.0), (35.0, 40.0)]):
        recs.append(record("gsm8k", i, "ar", bf16, [1, 1], dtype="bfloat16"))
        recs.append(
            record("gsm8k", i, "ar-float32", fp32, [1, 1], dtype="float32", matches_ar=i != 2)
        )
        recs.append(record("gsm8k", i, "dflash", 12.0, [3], dtype="bfloat16"))
        recs.append(record("gsm8k", i, "ddtree-4", 9.0, [3, 3], dtype="bfloat16"))
        recs.append(record("gsm8k", i, "ddtree-8", 10.0, [3, 3], dtype="bfloat16"))
        recs.append(record("gsm8k", i, "caddtree", 8.0, [4], budgets=[12], dtype="bfloat16"))
    # MATH-500: here bf16 AR (20) beats fp32 AR (25): CaDDTree's speed-up is 20 / 10 = 2.00
    for i in range(3):
        recs.append(record("math500", i, "ar", 20.0, [1], dtype="bfloat16"))
        recs.append(record("math500", i, "ar-float32", 25.0, [1], dtype="float32"))
        recs.append(record("math500", i, "caddtree", 10.0, [3, 3], budgets=[40, 60]))
    return recs


def test_speedups_are_against_the_faster_ar_dtype():
    agg = aggregate(dtype_records())
    assert [s.method for s in agg.ar_runs(0.0, "gsm8k")] == ["ar", "ar-float32"]
    assert agg.ar_labels(0.0) == ["ar", "ar-float32"]
    assert agg.get(0.0, "gsm8k", "ar").dtype == "bfloat16"
    assert agg.get(0.0, "gsm8k", "ar-float32").dtype == "float32"
    assert agg.baseline(0.0, "gsm8k").method == "ar-float32"
    assert agg.baseline(0.0, "math500").method == "ar"
    ca = agg.get(0.0, "gsm8k", "caddtree")
    assert ca.baseline == "ar-float32" and ca.speedup == pytest.approx(30 / 8)
    assert agg.get(0.0, "gsm8k", "ar").speedup == pytest.approx(30 / 32)
    assert agg.get(0.0, "gsm8k", "ddtree-4").speedup == pytest.approx(30 / 9)
    math = agg.get(0.0, "math500", "caddtree")
    assert math.baseline == "ar" and math.speedup == pytest.approx(20 / 10)
    assert agg.get(0.0, "math500", "ar-float32").speedup == pytest.approx(20 / 25)
    assert (
        "GSM8K at temperature 0: speed-ups are against ar-float32 (30.00 ms/tok), the fastest "
        "plain decoding (ar: 32.00 ms/tok)."
    ) in agg.notes
    assert any(
        n.startswith("MATH-500 at temperature 0: speed-ups are against ar (20.00")
        for n in agg.notes
    )
    # ties go to `ar`, the run's own dtype
    tie = aggregate([record("x", 0, "ar", 5.0, [1]), record("x", 0, "ar-float32", 5.0, [1])])
    assert tie.baseline(0.0, "x").method == "ar"


def test_tables_show_every_ar_dtype_and_name_the_baseline(tmp_path):
    path = write_jsonl(tmp_path / "results.jsonl", dtype_records())
    out = tmp_path / "report"
    files = write_report(path, out)
    assert "fig2_time_vs_budget_T0.png" in {p.name for p in files}  # AR lines for both dtypes
    md = (out / "report.md").read_text()
    t1 = section(md, "Table 1")
    header = table_row(t1, "Dataset")
    assert header[1:3] == ["AR bfloat16 ms/tok", "AR float32 ms/tok"]
    assert header[-2:] == ["CaDDTree speed-up vs fastest AR", "fastest AR"]
    gsm = table_row(t1, "GSM8K")
    assert gsm == [
        "GSM8K",
        "32.00",
        "30.00",
        "12.00",
        "3.00",
        "9.00",
        "3.00",
        "4",
        "**8.00**",
        "4.00",
        "12.0 (0.0)",
        "3.75×",
        "ar-float32",
    ]
    math_row = table_row(t1, "MATH-500")
    assert math_row[1:3] == ["20.00", "25.00"] and math_row[-2:] == ["2.00×", "ar"]
    tex = (out / "tables.tex").read_text()
    assert r"\multicolumn{2}{c}{\textbf{AR} ms/tok}" in tex
    assert r"\cmidrule(lr){2-3}\cmidrule(lr){4-5}\cmidrule(lr){6-8}\cmidrule(lr){9-11}" in tex
    assert r"\textbf{Dataset} & bfloat16 & float32 & ms/tok" in tex
    assert r"\begin{tabular}{l cc cc ccc ccc}" in tex
    # the faster AR carries the dagger; the speed-up columns are Markdown-only
    assert (
        r"GSM8K & 32.00 & 30.00$^\dagger$ & 12.00 & 3.00 & 9.00 & 3.00 & 4 & \textbf{8.00} & 4.00 "
        r"& $12.0\,(0.0)$ \\"
    ) in tex
    assert r"MATH-500 & 20.00$^\dagger$ & 25.00 & -- & " in tex
    full = section(md, "All methods, temperature 0")
    assert "speed-up vs fastest AR" in full
    assert "| GSM8K | ar | 32.00 | 32.67 | 54.00 | 0.94× | 1.00 | – | 3 | – |" in full
    assert (
        "| GSM8K | ar-float32 (baseline) | 30.00 | 33.00 | 50.00 | 1.00× | 1.00 | – | 3 | 2/3 |"
        in full
    )
    assert "| GSM8K | caddtree | **8.00** | 8.00 | 7.33 | 3.75× |" in full
    assert "| MATH-500 | ar (baseline) | 20.00 |" in full
    assert "| MATH-500 | ar-float32 | 25.00 | 25.00 | – | 0.80× |" in full
    assert "speed-ups are against ar-float32" in section(md, "Notes")


def test_only_ar_keeps_the_single_ar_column(results):
    """Without AR in other dtypes, Table 1 and the full table keep their one-AR format."""
    agg = aggregate(load_results(results))
    t1 = table1(agg, 0.0)
    assert t1.columns[1] == "AR ms/tok" and t1.columns[-1] == "CaDDTree speed-up vs AR"
    assert len(t1.columns) == 11 and t1.latex_spec == "l c cc ccc ccc"
    assert "speed-up vs AR" in method_table(agg, 0.0).columns
    assert not any("fastest plain decoding" in n for n in agg.notes)


# ---- command line --------------------------------------------------------------------------------


def test_cli_report_prints_table1_and_paths(tmp_path, capsys):
    recs = [r for r in greedy_records() if r["method"] in ("ar", "dflash")]
    path = write_jsonl(tmp_path / "results.jsonl", recs)
    assert main(["report", str(path), "--out", str(tmp_path / "out")]) == 0
    captured = capsys.readouterr()
    assert "| GSM8K | 32.00 | **12.00** | 2.40 |" in captured.out
    assert f"wrote {tmp_path / 'out' / 'report.md'}" in captured.err
    assert (tmp_path / "out" / "tables.tex").is_file()


def test_cli_report_bad_input_exits_2(tmp_path, capsys):
    path = tmp_path / "results.jsonl"
    path.write_text("{not json\n" + json.dumps(record("gsm8k", 0, "ar", 30.0, [1])) + "\n")
    assert main(["report", str(path)]) == 2
    err = capsys.readouterr().err
    assert "line 1: not valid JSON" in err and "Traceback" not in err
    assert main(["report", str(tmp_path / "missing.jsonl")]) == 2
    assert "results file not found" in capsys.readouterr().err
    assert not (tmp_path / "report").exists()
