"""The benchmark harness (`caddtree bench`) on the tiny float64 pair: records, losslessness,
multi-turn prompts and resuming (under torchrun: test_bench_ranks.py)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from caddtree.bench.datasets import load_prompt_file
from caddtree.bench.methods import default_ar_dtypes, parse_methods
from caddtree.bench.results import (
    ABLATIONS,
    read_records,
    trees_path,
    validate_record,
    validate_tree,
)
from caddtree.bench.runner import BenchConfig, run_bench
from caddtree.bench.tables import summary_table
from caddtree.cli import main
from caddtree.core.cost import ConvexCostModel
from caddtree.util.errors import InvalidInputError

PROMPTS = [
    {"id": "one", "prompt": "hello there"},
    {"id": "two", "turns": ["abc", "more"]},
]


@pytest.fixture(scope="module")
def bench_inputs(tmp_path_factory, tiny_pair_dirs):
    root = tmp_path_factory.mktemp("bench")
    prompts = root / "tiny.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS), encoding="utf-8")
    n = np.arange(0, 65, 8)
    cost = ConvexCostModel.fit(
        {0: (n, 0.01 + 0.0004 * n), 32: (n, 0.012 + 0.0005 * n)}, draft_cost=0.004
    )
    cost_path = cost.save(root / "cost.json")
    target, draft = tiny_pair_dirs
    return {"target": target, "draft": draft, "prompts": prompts, "cost": cost_path, "root": root}


def _args(inp, out, *extra):
    return [
        "bench",
        "--target",
        str(inp["target"]),
        "--draft",
        str(inp["draft"]),
        "--dtype",
        "float64",
        "--prompts",
        str(inp["prompts"]),
        "--cost-model",
        str(inp["cost"]),
        "--max-new-tokens",
        "10",
        "--out",
        str(out),
        "--no-progress",
        *extra,
    ]


def test_the_runner_and_the_report_never_import_each_other():
    """Both import the results schema (caddtree.bench.results); neither imports the other, even
    lazily inside a function."""
    import ast

    import caddtree.bench

    package = Path(caddtree.bench.__file__).parent
    runner_side = {"runner", "methods"}
    report_side = {"report", "summary", "tables", "figures"}

    def imported(module):
        tree = ast.parse((package / f"{module}.py").read_text(encoding="utf-8"))
        found = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                found.add((node.module or "").split(".")[0])
                if not node.module:
                    found.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                "caddtree.bench."
            ):
                found.add(node.module.split(".")[2])
        return found

    for module in runner_side:
        assert not imported(module) & report_side, module
    for module in report_side:
        assert not imported(module) & runner_side, module


def test_parse_methods_expands_the_grid_and_puts_ar_first():
    specs = parse_methods(["caddtree", "ddtree", "ar", "ddtree-16"], budgets=[4, 16])
    assert [s.label for s in specs] == ["ar", "caddtree", "ddtree-4", "ddtree-16"]
    assert [s.budget for s in specs if s.family == "ddtree"] == [4, 16]
    abl = parse_methods(["caddtree"], ablations=True)
    assert [s.variant for s in abl] == [None, *ABLATIONS]
    for bad in (["ddtree-0"], ["beam"], ["caddtree-cv3"], []):
        with pytest.raises(InvalidInputError):
            parse_methods(bad)
    with pytest.raises(InvalidInputError, match="budgets"):
        parse_methods(["ddtree"], budgets=[0])


def test_parse_methods_with_copies_from_the_context():
    specs = parse_methods(["lookup", "caddtree+lookup", "ddtree-8+LOOKUP", "dflash"], budgets=[4])
    labels = {s.label: (s.family, s.budget, s.lookup) for s in specs}
    assert labels == {
        "lookup": ("lookup", None, False),
        "caddtree+lookup": ("caddtree", None, True),
        "ddtree-8+lookup": ("ddtree", 8, True),
        "dflash": ("dflash", None, False),
    }
    every = parse_methods(["ar", "ddtree", "caddtree-cv2", "dflash"], budgets=[4], lookup=True)
    assert [s.label for s in every] == ["ar", "ddtree-4+lookup", "caddtree-cv2+lookup", "dflash"]
    for bad in (["dflash+lookup"], ["ar+lookup"], ["lookup+lookup"]):
        with pytest.raises(InvalidInputError, match="may end in \\+lookup"):
            parse_methods(bad)


def test_parse_methods_ar_in_other_dtypes():
    specs = parse_methods(["caddtree", "ar-fp32", "ar-BF16", "ar", "ar-float32", "ar-float64"])
    # `ar` first (the run's dtype: matches_ar is against it), then the other dtypes; aliases fold
    assert [s.label for s in specs] == ["ar", "ar-float32", "ar-bfloat16", "ar-float64", "caddtree"]
    assert [(s.family, s.dtype) for s in specs[:4]] == [
        ("ar", None),
        ("ar", "float32"),
        ("ar", "bfloat16"),
        ("ar", "float64"),
    ]
    assert not any(s.needs_cost_model for s in specs[:4])
    for bad in (["ar-int8"], ["ar-"], ["ar-auto"]):
        with pytest.raises(InvalidInputError, match="ar-<dtype>"):
            parse_methods(bad)


def test_default_ar_dtypes():
    # on a CPU either dtype can be the faster plain decoding: measure the other one too
    assert default_ar_dtypes("bfloat16", "cpu") == ["float32"]
    assert default_ar_dtypes("float16", "cpu") == ["float32"]
    assert default_ar_dtypes("float32", "cpu") == ["bfloat16"]
    # on a GPU bfloat16 is the faster one; float64 is for exactness tests
    assert default_ar_dtypes("bfloat16", "cuda") == []
    assert default_ar_dtypes("float32", "cuda") == ["bfloat16"]
    assert default_ar_dtypes("float64", "cpu") == []


METHODS = ["--methods", "ar", "dflash", "ddtree-2", "ddtree-6", "caddtree", "--ablations"]


@pytest.fixture(scope="module")
def bench_run(bench_inputs):
    out = bench_inputs["root"] / "res" / "results.jsonl"
    assert main(_args(bench_inputs, out, *METHODS)) == 0
    return out


def test_bench_records_are_complete_and_lossless(bench_run):
    records = read_records(bench_run)
    labels = ["ar", "dflash", "ddtree-2", "ddtree-6", "caddtree"] + [
        f"caddtree-{v}" for v in ABLATIONS
    ]
    assert sorted((r["prompt_index"], r["method"]) for r in records) == sorted(
        (i, m) for i in range(2) for m in labels
    )
    for r in records:
        validate_record(r, r["method"])  # what the runner writes is what the report reads
        assert r["dataset"] == "tiny" and r["temperature"] == 0.0
        assert r["dtype"] == "float64"  # the dtype the target ran in
        # float64 at temperature 0: every method's output is AR's, token for token
        assert r["matches_ar"] is (None if r["method"] == "ar" else True), r["method"]
        n = r["rounds"]
        assert len(r["budgets"]) == len(r["accepted"]) == len(r["paths"]) == n
        assert [len(p) for p in r["paths"]] == r["accepted"]
        # each turn's prefill yields one token; every round commits `committed` more
        assert r["new_tokens"] == r["turns"] + sum(r["committed"])
        assert r["ms_per_token"] == pytest.approx(1e3 * r["wall_s"] / r["new_tokens"])
        if r["family"] == "ddtree":
            assert max(r["budgets"]) <= r["budget"]
        if r["family"] == "ar":
            assert set(r["budgets"]) == {0} and all(c is None for c in r["confidence"])
        else:
            assert all(c is None or 0 < c <= 1 for c in r["confidence"])
            assert any(c is not None for c in r["confidence"])
        for path, budget in zip(r["paths"], r["budgets"], strict=True):
            assert all(0 <= i < budget for i in path) and path == sorted(path)
    # the two-turn prompt ran both turns, the second after the model's own first answer
    assert {r["turns"] for r in records if r["prompt_index"] == 1} == {2}
    assert {r["turns"] for r in records if r["prompt_index"] == 0} == {1}
    # the constant-cost ablation grows trees to the cap (here the depth-limited maximum)
    const = [r for r in records if r["method"] == "caddtree-constant"]
    nominal = [r for r in records if r["method"] == "caddtree"]
    assert np.mean([np.mean(r["budgets"]) for r in const]) > np.mean(
        [np.mean(r["budgets"]) for r in nominal]
    )
    meta = json.loads(bench_run.with_name("results.meta.json").read_text())
    assert meta["max_new_tokens"] == 10 and "float64" in meta["dtype"]


def test_bench_alternates_the_order_of_methods(bench_run):
    records = read_records(bench_run)
    # records are written in the order the methods ran: as listed on the first prompt, reversed
    # on the second (whose records wait for AR, which ran last, to say whether they match it)
    first = [r["method"] for r in records if r["prompt_index"] == 0]
    second = [r["method"] for r in records if r["prompt_index"] == 1]
    assert first[0] == "ar" and second == first[::-1]
    assert all(r["matches_ar"] for r in records if r["method"] != "ar")
    for r in records:  # the parts of a round are timed, and the parts sit inside the totals
        assert 0 <= r["project_s"] <= r["draft_s"] and 0 <= r["forward_s"] <= r["verify_s"]
        assert r["draft_s"] + r["tree_s"] + r["verify_s"] <= r["wall_s"] - r["prefill_s"]
    assert any(r["project_s"] > 0 for r in records if r["family"] != "ar")


def test_bench_saves_draft_trees_for_the_report(bench_run):
    trees = [json.loads(x) for x in trees_path(bench_run).read_text().splitlines()]
    assert 1 <= len(trees) <= 2
    for t in trees:
        validate_tree(t, "tree")
        assert t["method"] == "caddtree" and t["prompt_index"] == 0
        n = t["budget"]
        assert len(t["token_ids"]) == len(t["parents"]) == len(t["ranks"]) == n
        assert all(-1 <= p < i for i, p in enumerate(t["parents"]))
        assert len(t["path"]) == t["accepted"]
        # the accepted path is a chain from the root
        prev = -1
        for node in t["path"]:
            assert t["parents"][node] == prev
            prev = node


def test_bench_resumes_without_redoing_work(bench_inputs, bench_run, tmp_path):
    out = tmp_path / "results.jsonl"
    lines = bench_run.read_text().splitlines()
    kept, dropped = lines[:-3], lines[-3:]
    # three records lost, the last one torn mid-write
    out.write_text("\n".join(kept) + "\n" + dropped[0][:25], encoding="utf-8")
    for side in ("meta.json", "trees.jsonl"):
        out.with_name(f"results.{side}").write_text(
            bench_run.with_name(f"results.{side}").read_text()
        )
    assert main(_args(bench_inputs, out, *METHODS, "--no-warmup")) == 0
    again = out.read_text().splitlines()
    assert again[: len(kept)] == kept  # earlier records untouched, not re-run
    assert len(again) == len(lines)
    redone = [json.loads(x) for x in again[len(kept) :]]
    original = [json.loads(x) for x in dropped]
    assert sorted(r["method"] for r in redone) == sorted(r["method"] for r in original)
    for r in redone:  # same greedy outputs as the first run
        match = next(o for o in original if o["method"] == r["method"])
        assert r["output_sha"] == match["output_sha"]
    # a resumed run must use the same settings
    assert main(_args(bench_inputs, out, *METHODS, "--max-new-tokens", "12")) == 2


def test_leftover_rank_files_are_folded_in(bench_inputs, bench_run, tmp_path):
    """An interrupted data-parallel run leaves per-rank files; a later run (here a single
    process) folds them into the results file instead of losing or re-running them."""
    out = tmp_path / "results.jsonl"
    lines = bench_run.read_text().splitlines()
    out.write_text("\n".join(lines[:5]) + "\n")
    out.with_name("results.rank0.jsonl").write_text("\n".join(lines[5:12]) + "\n")
    out.with_name("results.rank3.jsonl").write_text("\n".join(lines[12:]) + "\n")
    out.with_name("results.meta.json").write_text(
        bench_run.with_name("results.meta.json").read_text()
    )
    out.with_name("results.trees.rank0.jsonl").write_text(trees_path(bench_run).read_text())
    assert main(_args(bench_inputs, out, *METHODS, "--no-warmup")) == 0
    assert sorted(out.read_text().splitlines()) == sorted(lines)  # nothing re-run, nothing lost
    assert not list(tmp_path.glob("results.*rank*.jsonl"))
    assert trees_path(out).read_text() == trees_path(bench_run).read_text()


def test_report_renders_bench_output(bench_run, tmp_path):
    from caddtree.bench.report import write_report

    files = write_report(bench_run, tmp_path / "report")
    names = {f.name for f in files}
    assert {"report.md", "tables.tex"} <= names
    assert any(n.startswith("fig6") for n in names)  # the trees the bench saved
    md = (tmp_path / "report" / "report.md").read_text()
    assert "caddtree-constant" in md and "ddtree-6" in md


def test_bench_runs_methods_with_copies_from_the_context(bench_inputs, tmp_path):
    from caddtree.bench.report import write_report

    out = tmp_path / "lookup" / "results.jsonl"
    argv = _args(bench_inputs, out, "--methods", "ar", "lookup", "caddtree", "--lookup")
    assert main([*argv, "--max-new-tokens", "24"]) == 0
    records = read_records(out)
    assert {r["method"] for r in records} == {"ar", "lookup", "caddtree+lookup"}
    for r in records:
        validate_record(r, r["method"])
        assert r["matches_ar"] is (None if r["method"] == "ar" else True), r["method"]
        assert r["lookup"] is (r["method"] == "caddtree+lookup")
        copied = r["copied_accepted"]
        if r["method"] != "ar":
            assert len(copied) == r["rounds"] and all(
                0 <= c <= a for c, a in zip(copied, r["accepted"])
            )
        else:
            assert copied is None
    assert write_report(out, tmp_path / "report")
    report = (tmp_path / "report" / "report.md").read_text()
    assert "caddtree+lookup" in report and "Copies from the context, temperature 0" in report
    table = report.split("Copies from the context, temperature 0")[1].split("\n\n")[1]
    assert "| lookup |" in table and "| caddtree+lookup |" in table and "| ar |" not in table


def test_bench_sampling_and_bad_input(bench_inputs, tmp_path, capsys):
    out = tmp_path / "t1.jsonl"
    args = _args(bench_inputs, out, "--methods", "ar", "caddtree", "--temperatures", "1")
    assert main([*args, "--max-samples", "1"]) == 0
    recs = read_records(out)
    assert [(r["method"], r["temperature"], r["matches_ar"]) for r in recs] == [
        ("ar", 1.0, None),
        ("caddtree", 1.0, None),
    ]
    capsys.readouterr()
    for bad in (
        ["--methods", "beam"],
        ["--temperatures", "-1"],
        ["--max-samples", "0"],
        ["--datasets", "nonsense"],
    ):
        assert main([*args, *bad]) == 2
        err = capsys.readouterr().err
        assert err.startswith("caddtree: error:") and "Traceback" not in err
    bad_prompts = tmp_path / "bad.jsonl"
    for bad in ('{"turns": []}', '{"turns": "not a list"}', '{"id": 3}'):
        bad_prompts.write_text(bad + "\n")
        assert main([*_args(bench_inputs, out), "--prompts", str(bad_prompts)]) == 2
        assert "line 1" in capsys.readouterr().err


def test_bench_runs_the_drafter_in_the_dtype_asked_for_and_records_it(bench_inputs, tmp_path):
    out = tmp_path / "results.jsonl"
    argv = _args(bench_inputs, out, "--methods", "ar", "dflash", "--no-warmup")
    assert main([*argv, "--draft-dtype", "float32"]) == 0
    meta = json.loads(out.with_name("results.meta.json").read_text())
    assert meta["draft_dtype"] == "torch.float32" and "float64" in meta["dtype"]
    recs = [r for r in read_records(out) if r["method"] == "dflash"]
    assert recs and all(r["matches_ar"] is True for r in recs)


# ---- plain decoding in other dtypes (the speed-up baseline is the fastest of them) ---------------


def test_bench_ar_in_other_dtypes_and_resume(bench_inputs, tmp_path):
    out = tmp_path / "results.jsonl"
    assert main(_args(bench_inputs, out, "--methods", "ar", "dflash", "--no-warmup")) == 0
    first = out.read_text().splitlines()
    # resuming with more AR dtypes adds only their records, beside the float64 run's
    methods = ["--methods", "ar", "ar-float32", "ar-float64", "dflash", "--no-warmup"]
    assert main(_args(bench_inputs, out, *methods)) == 0
    lines = out.read_text().splitlines()
    assert lines[: len(first)] == first
    recs = {(r["prompt_index"], r["method"]): r for r in read_records(out)}
    assert sorted(recs) == sorted(
        (i, m) for i in range(2) for m in ("ar", "ar-float32", "ar-float64", "dflash")
    )
    for i in range(2):
        ar, f32, f64 = (recs[(i, m)] for m in ("ar", "ar-float32", "ar-float64"))
        # each record names the dtype its target really ran in: the float32 copy for ar-float32
        assert (ar["dtype"], f32["dtype"], f64["dtype"]) == ("float64", "float32", "float64")
        assert f32["family"] == f64["family"] == "ar" and set(f32["budgets"]) == {0}
        assert f64["output_sha"] == ar["output_sha"] and f64["matches_ar"] is True
        # float32 may round differently from float64; whatever it says is checked against `ar`
        assert f32["matches_ar"] is (f32["output_sha"] == ar["output_sha"])
        assert f32["new_tokens"] == f32["turns"] + sum(f32["committed"])
    meta = json.loads(out.with_name("results.meta.json").read_text())
    assert "float64" in meta["dtype"]  # the run's dtype is still the main one
    # a run over: nothing is redone
    assert main(_args(bench_inputs, out, *methods)) == 0
    assert out.read_text().splitlines() == lines


def test_run_bench_uses_the_generator_of_each_dtype(bench_inputs, tmp_path):
    """``ar_generators`` supplies the target copy of each ``ar-<dtype>``: a separately loaded
    float64 copy decodes exactly as the main float64 target; a missing copy is an error."""
    from caddtree import SpeculativeGenerator

    target = bench_inputs["target"]
    gen = SpeculativeGenerator.from_pretrained(target, None, dtype="float64", device="cpu")
    copy = SpeculativeGenerator.from_pretrained(target, None, dtype="float64", device="cpu")
    f32 = SpeculativeGenerator.from_pretrained(target, None, dtype="float32", device="cpu")
    config = BenchConfig(
        prompts={"tiny": load_prompt_file(bench_inputs["prompts"])},
        methods=parse_methods(["ar", "ar-float64"]),
        max_new_tokens=8,
        warmup=False,
    )
    out = tmp_path / "r.jsonl"
    recs = run_bench(gen, config, out, progress=False, ar_generators={"float64": copy})
    by = {(r["prompt_index"], r["method"]): r for r in recs}
    for i in range(2):
        assert by[(i, "ar-float64")]["output_sha"] == by[(i, "ar")]["output_sha"]
        assert by[(i, "ar-float64")]["matches_ar"] is True
    config.methods = parse_methods(["ar", "ar-float32"])
    with pytest.raises(InvalidInputError, match="ar-float32 needs a copy of the target in float32"):
        run_bench(gen, config, tmp_path / "x.jsonl", progress=False)
    with pytest.raises(InvalidInputError, match="runs in float64, not float32"):
        run_bench(gen, config, tmp_path / "x.jsonl", progress=False, ar_generators={"float32": gen})
    recs = run_bench(
        gen, config, tmp_path / "y.jsonl", progress=False, ar_generators={"float32": f32}
    )
    assert {r["method"]: r["dtype"] for r in recs} == {"ar": "float64", "ar-float32": "float32"}


def test_default_methods_add_the_other_ar_dtype(bench_inputs, tmp_path):
    """Without --methods, a float32 run on the CPU also measures plain decoding in bfloat16."""
    out = tmp_path / "results.jsonl"
    args = _args(bench_inputs, out, "--budgets", "2", "--max-samples", "1", "--no-warmup")
    args[args.index("float64")] = "float32"
    assert main(args) == 0
    recs = read_records(out)
    assert {r["method"]: r["dtype"] for r in recs} == {
        "ar": "float32",
        "ar-bfloat16": "bfloat16",
        "dflash": "float32",
        "ddtree-2": "float32",
        "caddtree": "float32",
    }


def test_summary_table_speedups_are_against_the_faster_ar(bench_run):
    """The end-of-run summary, on bench records whose times are set by hand: plain decoding in
    float32 (8 ms/tok) beats the run's dtype (10 ms/tok), so speed-ups are against it."""
    times = {"ar": 10.0, "ar-float32": 8.0, "dflash": 5.0, "caddtree": 4.0}
    recs = []
    for r in read_records(bench_run):
        if r["method"] in ("ar", "dflash", "caddtree"):
            recs.append(r | {"ms_per_token": times[r["method"]]})
            if r["method"] == "ar":
                recs.append(
                    r
                    | {"method": "ar-float32", "dtype": "float32", "ms_per_token": 8.0}
                    | {"matches_ar": True}
                )
    text = summary_table(recs)
    assert "speed-up vs fastest AR" in text
    rows = {
        cells[1]: cells[2:4] + cells[5:6]  # cells[4]: decode ms/tok, from the records' times
        for line in text.splitlines()
        if (cells := [c.strip() for c in line.strip().strip("|").split("|")])[0] == "tiny"
    }
    assert rows == {
        "ar": ["10.00", "10.00", "0.80×"],
        "ar-float32 (baseline)": ["8.00", "8.00", "1.00×"],
        "dflash": ["5.00", "5.00", "1.60×"],
        "caddtree": ["**4.00**", "4.00", "2.00×"],
    }


def test_decode_time_leaves_out_each_turns_prefill(bench_run):
    """decode ms/tok: the time after each turn's first token over the tokens after the first
    (what llama-bench's token generation times), median over prompts."""
    from caddtree.bench.summary import _decode_ms, aggregate

    recs = [
        r | {"wall_s": 1.0 + i, "prefill_s": 0.2 + i, "new_tokens": 9, "turns": 1}
        for i, r in enumerate(r for r in read_records(bench_run) if r["method"] == "ar")
    ]
    recs += [recs[0] | {"prompt_index": 99, "wall_s": 1.0, "prefill_s": 0.5, "turns": 2}]
    (summary,) = aggregate(recs).summaries.values()
    # 0.8 s over 8 tokens for each single-turn prompt, 0.5 s over 7 for the two-turn one
    expected = sorted([100.0] * (len(recs) - 1) + [1e3 * 0.5 / 7])
    assert summary.decode_ms_per_token == pytest.approx(float(np.median(expected)))
    assert _decode_ms(recs[0] | {"new_tokens": 1}) is None


@pytest.mark.parametrize("damage", ["{ torn", "[1, 2]", b"\xff\xfe"])
def test_a_damaged_meta_file_refuses_to_resume(bench_inputs, bench_run, tmp_path, capsys, damage):
    """The settings check must not turn itself off when the file it reads is damaged."""
    out = tmp_path / "results.jsonl"
    out.write_text(bench_run.read_text())
    meta = out.with_name("results.meta.json")
    if isinstance(damage, bytes):
        meta.write_bytes(damage)
    else:
        meta.write_text(damage)
    capsys.readouterr()
    assert main(_args(bench_inputs, out, *METHODS, "--max-new-tokens", "12")) == 2
    err = capsys.readouterr().err
    assert "cannot be read" in err and "--no-resume" in err
    assert out.read_text() == bench_run.read_text()  # nothing added to the old results


def test_bench_repeats_each_run_and_records_its_median_run(bench_inputs, tmp_path, capsys):
    from caddtree.bench.runner import _repeated

    a, b = (0.0, "d", 0, "a"), (0.0, "d", 1, "b")
    todo = [(a, "x"), (a, "y"), (b, "y"), (b, "x")]
    assert [(it[3], m, first) for it, m, first in _repeated(todo, 2)] == [
        ("a", "x", True),
        ("a", "y", True),
        ("a", "y", False),
        ("a", "x", False),
        ("b", "y", True),
        ("b", "x", True),
        ("b", "x", False),
        ("b", "y", False),
    ]
    out = tmp_path / "r.jsonl"
    methods = ["--methods", "ar", "caddtree", "lookup", "--no-warmup"]
    assert main(_args(bench_inputs, out, *methods, "--repeats", "3")) == 0
    records = read_records(out)
    assert len(records) == 2 * 3
    for r in records:
        validate_record(r, "record")
        runs = r["wall_s_runs"]
        assert r["repeats"] == 3 and len(runs) == 3 and r["repeats_identical"] is True
        assert r["wall_s"] == sorted(runs)[1]  # the median run's (the same tokens each time)
        assert r["method"] == "ar" or r["matches_ar"] is True
    assert json.loads(out.with_name("r.meta.json").read_text())["repeats"] == 3
    assert main(_args(bench_inputs, out, *methods, "--repeats", "2")) == 2
    assert "repeats: 3 then, 2 now" in capsys.readouterr().err
    assert main(_args(bench_inputs, tmp_path / "z.jsonl", *methods, "--repeats", "0")) == 2
    assert "--repeats must be a positive integer" in capsys.readouterr().err
