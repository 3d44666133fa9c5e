"""`caddtree bench` under torchrun (two gloo processes on the tiny float64 pair): a rank killed
mid-run, a rerun that does only the missing work, the merged results equal to one process's
(outputs, and the report's tables but for timings), and the ranks' machines in the metadata."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from caddtree.bench.report import build_report
from caddtree.bench.results import meta_path, rank_files, read_records, record_key
from caddtree.cli import main
from caddtree.util.errors import InvalidInputError

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="gloo over TCP on localhost")

# enough work per rank (12 runs) that one can be killed after its first record and before its last
PROMPTS = [
    {"id": f"p{i}", "prompt": f"count to {i} and then some more words {i}"} for i in range(8)
]
TIMINGS = ("wall_s", "prefill_s", "ms_per_token", "draft_s", "tree_s", "verify_s", "project_s")
TIMINGS += ("forward_s",)


def _argv(tiny_pair_dirs, cost_file, prompts: Path, out: Path) -> list[str]:
    target, draft = tiny_pair_dirs
    return [
        "bench", "--target", str(target), "--draft", str(draft), "--dtype", "float64",
        "--prompts", str(prompts), "--cost-model", cost_file, "--max-new-tokens", "24",
        "--methods", "ar", "dflash", "caddtree", "--no-warmup", "--no-progress",
        "--out", str(out),
    ]  # fmt: skip


def _torchrun(argv: list[str]) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        [*cmd, "-m", "caddtree.cli", *argv],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def _worker_of_rank(launcher: int, rank: int) -> int | None:
    """The pid of the torchrun worker (a child of ``launcher``) that runs ``rank``."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            status = (entry / "status").read_text()
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        parent = next(
            int(line.split()[1]) for line in status.splitlines() if line.startswith("PPid")
        )
        if parent == launcher and f"RANK={rank}".encode() in environ:
            return int(entry.name)
    return None


def _kill_rank_after_its_first_record(proc: subprocess.Popen, out: Path, rank: int) -> None:
    part = out.with_name(f"{out.stem}.rank{rank}.jsonl")
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if part.is_file() and part.read_text().endswith("\n"):
            pid = _worker_of_rank(proc.pid, rank)
            assert pid is not None, "rank's worker not found"
            os.kill(pid, signal.SIGKILL)
            return
        time.sleep(0.005)
    pytest.fail(
        f"rank {rank} wrote no record before the run ended: {proc.communicate()[1][-2000:]}"
    )


def _with_timings_of(records: list[dict], reference: dict[tuple, dict]) -> list[dict]:
    """``records`` with every timing taken from the reference record of the same run."""
    return [{**r, **{k: reference[record_key(r)][k] for k in TIMINGS}} for r in records]


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds the rank's worker in /proc")
def test_bench_under_torchrun_survives_a_killed_rank_and_equals_one_process(
    tiny_pair_dirs, cost_file, tmp_path
):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS), encoding="utf-8")
    out = tmp_path / "dp" / "results.jsonl"
    argv = _argv(tiny_pair_dirs, cost_file, prompts, out)

    # rank 1 killed after its first record: the run fails, the ranks' parts stay behind
    first = _torchrun(argv)
    _kill_rank_after_its_first_record(first, out, rank=1)
    first.communicate(timeout=120)
    assert first.returncode != 0
    parts = rank_files(out)
    kept = {record_key(r): r for part in parts for r in read_records(part)}
    assert parts and 1 <= len(kept) < len(PROMPTS) * 3

    # the rerun names what is missing and runs only that
    second = _torchrun(argv)
    _, err = second.communicate(timeout=180)
    assert second.returncode == 0, err[-3000:]
    missing = len(PROMPTS) * 3 - len(kept)
    assert f"holds {len(kept)} of the {len(PROMPTS) * 3} runs asked for" in err
    assert f"running the {missing} missing" in err
    merged = read_records(out)
    assert not rank_files(out) and len(merged) == len(PROMPTS) * 3
    for rec in merged:
        if record_key(rec) in kept:  # not run again: the record from before the kill, unchanged
            assert rec == kept[record_key(rec)]
    assert {r["rank"] for r in merged} == {0, 1}
    meta = json.loads(meta_path(out).read_text())
    assert meta["world_size"] == 2 and meta["machines"] == [meta["machine"]] * 2

    # one process: the same tokens for every (prompt, method), and the same report but for timings
    single = tmp_path / "one" / "results.jsonl"
    assert main(_argv(tiny_pair_dirs, cost_file, prompts, single)) == 0
    alone = {record_key(r): r for r in read_records(single)}
    assert {record_key(r): r["output_sha"] for r in merged} == {
        k: r["output_sha"] for k, r in alone.items()
    }
    assert all(r["matches_ar"] is (None if r["method"] == "ar" else True) for r in merged)
    retimed = tmp_path / "retimed" / "results.jsonl"
    retimed.parent.mkdir()
    retimed.write_text(
        "".join(json.dumps(r) + "\n" for r in _with_timings_of(merged, alone)), encoding="utf-8"
    )
    meta_path(retimed).write_text(meta_path(out).read_text())
    tables = [t.markdown() for t in build_report(retimed, tmp_path / "r1").tables]
    assert tables == [t.markdown() for t in build_report(single, tmp_path / "r2").tables]


def test_the_report_refuses_to_pool_the_timings_of_different_machines(tmp_path, capsys):
    """A torchrun run whose ranks ran on two machines: refused with what to do, unless
    --pool-machines, and then the report says which machines it pooled."""
    out = tmp_path / "results.jsonl"
    record = {
        "dataset": "tiny", "prompt_index": 0, "method": "ar", "family": "ar", "temperature": 0.0,
        "turns": 1, "new_tokens": 3, "rounds": 2, "wall_s": 0.01, "ms_per_token": 3.3,
        "tau": 1.0, "budgets": [0, 0], "accepted": [0, 0], "committed": [1, 1],
        "output_sha": "0", "matches_ar": None, "budget": None, "variant": None, "dtype": "float64",
    }  # fmt: skip
    out.write_text(json.dumps(record) + "\n")
    meta = {"machine": "cpu:A", "machines": ["cpu:A", "cpu:B"], "world_size": 2}
    meta_path(out).write_text(json.dumps(meta))
    with pytest.raises(InvalidInputError, match="rank 0 on cpu:A; rank 1 on cpu:B"):
        build_report(out, tmp_path / "r")
    assert main(["report", str(out), "--out", str(tmp_path / "r")]) == 2
    assert "--pool-machines" in capsys.readouterr().err
    report = build_report(out, tmp_path / "r", pool_machines=True)
    assert any("pool different machines" in n and "cpu:B" in n for n in report.notes)
    assert main(["report", str(out), "--out", str(tmp_path / "r"), "--pool-machines"]) == 0
