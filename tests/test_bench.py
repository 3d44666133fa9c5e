"""The benchmark harness (`caddtree bench`) on the tiny float64 pair: records, losslessness,
multi-turn prompts, resuming, and a 2-process torchrun (gloo) run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from caddtree.bench import ABLATIONS, parse_methods, read_records, trees_path
from caddtree.cli import main
from caddtree.cost import ConvexCostModel
from caddtree.errors import InvalidInputError

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
        assert r["dataset"] == "tiny" and r["temperature"] == 0.0
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


def test_bench_saves_draft_trees_for_the_report(bench_run):
    trees = [json.loads(x) for x in trees_path(bench_run).read_text().splitlines()]
    assert 1 <= len(trees) <= 2
    for t in trees:
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
    from caddtree.report import write_report

    files = write_report(bench_run, tmp_path / "report")
    names = {f.name for f in files}
    assert {"report.md", "tables.tex"} <= names
    assert any(n.startswith("fig6") for n in names)  # the trees the bench saved
    md = (tmp_path / "report" / "report.md").read_text()
    assert "caddtree-constant" in md and "ddtree-6" in md


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


@pytest.mark.skipif(sys.platform == "win32", reason="gloo over TCP on localhost")
def test_bench_data_parallel_with_torchrun(bench_inputs, bench_run, tmp_path):
    out = tmp_path / "dp.jsonl"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--standalone",
        "-m",
        "caddtree.cli",
        *_args(bench_inputs, out, "--methods", "ar", "dflash", "caddtree", "--no-warmup"),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    recs = read_records(out)
    assert len(recs) == 2 * 3
    assert not list(Path(tmp_path).glob("dp.rank*.jsonl"))  # merged on rank 0, parts removed
    single = {(r["prompt_index"], r["method"]): r["output_sha"] for r in read_records(bench_run)}
    for r in recs:  # each prompt ran on one rank; the outputs equal the 1-process run's
        assert r["output_sha"] == single[(r["prompt_index"], r["method"])]
        assert r["matches_ar"] is (None if r["method"] == "ar" else True)
