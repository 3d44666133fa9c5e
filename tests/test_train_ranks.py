"""`caddtree train-drafter` under torchrun (two gloo processes, the tiny float64 target): the
same loss curve as one process with the same global batch, and a checkpoint that decodes
losslessly."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from caddtree.cli import main

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="gloo over TCP on localhost")

STEPS = 20


def _curve(run) -> list[float]:
    log = [json.loads(line) for line in (run / "train_log.jsonl").read_text().splitlines()]
    assert [e["step"] for e in log] == list(range(1, STEPS + 1))
    return [e["loss"] for e in log]


def test_train_drafter_under_torchrun_follows_one_process(tiny_pair_dirs, cost_file, tmp_path):
    from caddtree import SpeculativeGenerator

    target, _ = tiny_pair_dirs
    prompts = tmp_path / "prompts.jsonl"
    kinds = ["cats", "dogs", "rain", "sun", "moss", "tea", "owls", "sand"]
    words = [f"{w} {n}" for w in kinds for n in range(5)]
    prompts.write_text("".join(json.dumps({"prompt": f"tell me about {w}"}) + "\n" for w in words))
    one, dp = tmp_path / "one", tmp_path / "dp"
    made = ["train-drafter", "--target", str(target), "--output", str(one), "--data-only"]
    made += ["--sharegpt", "0", "--code", "0", "--math", "0", "--prompts", str(prompts)]
    assert main([*made, "--dtype", "float64", "--max-new-tokens", "16"]) == 0
    shutil.copytree(one, dp)

    def train(out):
        argv = ["train-drafter", "--target", str(target), "--output", str(out), "--train-only"]
        argv += ["--dtype", "float64", "--steps", str(STEPS), "--samples-per-step", "4"]
        argv += ["--anchors", "3", "--feature-layers", "2", "--eval-every", "10", "--device"]
        return [*argv, "cpu", "--export", str(out / "export"), "--export-dtype", "float64"]

    assert main(train(one)) == 0
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    cmd = [*launcher, "--standalone", "-m", "caddtree.cli", *train(dp)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]

    # each rank trained on half of every batch of 4: the loss curve is one process's
    assert _curve(dp) == pytest.approx(_curve(one), rel=1e-5)  # float32 sums in another order
    last = {run: json.loads((run / "run.json").read_text())["final"] for run in (one, dp)}
    assert last[dp]["eval_loss"] == pytest.approx(last[one]["eval_loss"], rel=1e-5)
    assert last[dp]["eval_walk_tau"] == pytest.approx(last[one]["eval_walk_tau"])
    assert not (dp / "train_log.jsonl.tmp").exists()

    # its checkpoint, exported by rank 0, drafts losslessly
    gen = SpeculativeGenerator.from_pretrained(
        target, dp / "export", dtype="float64", device="cpu", cost_model=cost_file
    )
    for prompt in ("tell me about owls", "count to five"):
        plain = gen.generate(prompt, method="ar", max_new_tokens=24).token_ids
        assert gen.generate(prompt, method="caddtree", max_new_tokens=24).token_ids == plain


def test_train_drafter_under_torchrun_trains_only(tmp_path, monkeypatch, capsys):
    """Data is made by one process: under torchrun without --train-only, a clear error."""
    monkeypatch.setattr("caddtree.util.ranks.init_distributed", lambda device=None: _two_ranks())
    argv = ["train-drafter", "--output", str(tmp_path / "run"), "--math", "4", "--sharegpt", "0"]
    assert main([*argv, "--code", "0"]) == 2
    err = capsys.readouterr().err
    assert "under torchrun, train-drafter trains only" in err and "Traceback" not in err


def _two_ranks():
    from caddtree.util.ranks import DistInfo

    return DistInfo(rank=0, world=2, device="cpu")


def test_a_rank_takes_every_world_th_sample_of_a_batch_and_its_anchors():
    import torch

    from caddtree.train.loss import _share
    from caddtree.util.ranks import DistInfo

    ids = [7, 3, 9, 4, 1]
    padded, real = torch.arange(15).view(5, 3), torch.ones(5, 3, dtype=torch.bool)
    for rank, mine in ((0, [7, 9, 1]), (1, [3, 4])):
        ranks = DistInfo(rank=rank, world=2)
        host, device, (anchors, kept) = _share(ranks, ids, torch.tensor(ids), (padded, real))
        assert host == mine and device.tolist() == mine
        assert anchors.tolist() == [padded[ids.index(i)].tolist() for i in mine]
        assert kept.shape == (len(mine), 3)
        lists = [torch.tensor([i]) for i in ids]
        assert [t.item() for t in _share(ranks, ids, torch.tensor(ids), lists)[2]] == mine
