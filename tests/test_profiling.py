"""`caddtree profile` and caddtree.core.profiling: measuring, fitting, saving and plotting the cost model
on the tiny float64 pair, and clear one-line errors for grids a user can get wrong."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
import torch

from caddtree import ConvexCostModel, load_cost_model
from caddtree.cli import main
from caddtree.core.profiling import (
    MAX_NODE_COUNT,
    check_profile_grid,
    fit_context_lengths,
    plot_cost_model,
    profile_cost_model,
)
from caddtree.util.errors import InvalidInputError
from tiny_models import MAX_POSITIONS, qwen3_target, saved_drafter

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
TINY_BLOCK = 6  # tiny_models.new_drafter's block size: trees of depth 5


def profile_argv(dirs, *extra):
    target, draft = dirs
    argv = ["profile", "--target", str(target), "--draft", str(draft), "--dtype", "float64"]
    return [*argv, "--device", "cpu", *extra]


def png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE, "not a PNG file"
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def assert_convex_nondecreasing(xs, ys):
    xs, ys = np.asarray(xs, dtype=float), np.asarray(ys, dtype=float)
    slopes = np.diff(ys) / np.diff(xs)
    tol = 1e-9 * max(float(np.abs(ys).max()), 1e-30)
    assert ys[0] >= 0 and slopes[0] >= -tol, (xs, ys)
    assert (np.diff(slopes) >= -tol).all(), (xs, ys)


@pytest.fixture(scope="module")
def profiled(tiny_pair_dirs, tmp_path_factory):
    """One `caddtree profile` run on a tiny grid, shared by the tests that read its outputs."""
    import io
    from contextlib import redirect_stderr, redirect_stdout

    out_dir = tmp_path_factory.mktemp("profile")
    cost, fig = out_dir / "cost.json", out_dir / "fig4.png"
    argv = profile_argv(
        tiny_pair_dirs,
        *("--context-lengths", "0", "24", "48"),
        *("--node-counts", "0", "2", "8", "32", "64"),
        *("--trials", "1", "--warmup", "1", "--out", str(cost), "--plot", str(fig)),
    )
    stdout, stderr = io.StringIO(), io.StringIO()
    with redirect_stdout(stdout), redirect_stderr(stderr):
        status = main(argv)
    assert status == 0, stderr.getvalue()
    return cost, fig, stdout.getvalue(), stderr.getvalue()


def test_profile_writes_a_convex_cost_model_that_loads_back(profiled):
    cost, _, stdout, _ = profiled
    model = load_cost_model(cost)
    assert isinstance(model, ConvexCostModel)
    assert model.context_lengths == [0, 24, 48]
    assert 0 < model.draft_cost < 10
    for curve in model.curves:
        assert curve.node_counts.tolist() == [0, 2, 8, 32, 64]
        assert_convex_nondecreasing(curve.node_counts, curve.values)
    # the raw medians survive save/load, one per node count and context length
    meta = model.metadata
    assert meta["node_counts"] == [0, 2, 8, 32, 64] and meta["trials"] == 1
    assert sorted(meta["raw_verify"], key=int) == ["0", "24", "48"]
    assert all(len(v) == 5 and min(v) > 0 for v in meta["raw_verify"].values())
    for length, medians in meta["raw_verify"].items():  # one trial per point (--trials 1)
        assert meta["verify_trials"][length] == [[m] for m in medians]
    assert meta["target"].endswith("target") and meta["dtype"] == "torch.float64"
    # the file is versioned JSON, not pickle
    data = json.loads(cost.read_text())
    assert data["format"] == "caddtree.cost_model" and data["type"] == "convex"
    # C_d is the mean over the contexts of a drafted round's extra cost (at least the pass
    # alone), and is printed
    extra, alone = meta["drafted_round_extra"], meta["draft_times"]
    assert len(extra) == len(alone) == 3
    assert model.draft_cost == pytest.approx(np.mean(np.maximum(extra, alone)))
    assert f"C_d = {model.draft_cost * 1e3:.3f} ms" in stdout


def test_profile_prints_the_fit_report_and_where_it_saved(profiled):
    cost, fig, stdout, stderr = profiled
    model = load_cost_model(cost)
    assert "R2" in stdout and "RMSE ms" in stdout
    rows = {
        int(line.split()[0]): line.split()
        for line in stdout.splitlines()
        if line[:8].strip().isdigit()
    }
    assert sorted(rows) == [0, 24, 48]
    for length, row in rows.items():
        q = model.fit_quality[length]
        assert float(row[2]) == pytest.approx(q.r2, abs=1e-4)  # the printed R2 is the saved one
        assert float(row[3]) == pytest.approx(q.rmse * 1e3, abs=1e-3)
    assert f"saved the cost model to {cost}" in stdout
    assert f"saved the figure to {fig}" in stdout
    assert "3 context lengths x 5 node counts" in stderr


def test_profile_plot_is_a_real_png(profiled):
    _, fig, _, _ = profiled
    width, height = png_size(fig)
    assert width > 400 and height > 300
    assert fig.stat().st_size > 10_000
    assert not list(fig.parent.glob(".*tmp*")), "no temporary file left behind"


def capture_figure(monkeypatch):
    """Replace save_figure to keep the figure for inspection (it still writes the file)."""
    import caddtree.util.plots as plots

    captured = {}
    real = plots.save_figure

    def keep(fig, path):
        captured["axes"] = fig.axes[0]
        captured["texts"] = [t.get_text() for t in fig.axes[0].texts]
        return real(fig, path)

    monkeypatch.setattr(plots, "save_figure", keep)
    return captured


def test_plot_of_a_loaded_model_has_points_and_curves(profiled, tmp_path, monkeypatch):
    cost, _, _, _ = profiled
    model = load_cost_model(cost)
    captured = capture_figure(monkeypatch)
    out = plot_cost_model(model, tmp_path / "again.png")
    png_size(out)
    ax = captured["axes"]
    lines = ax.get_lines()
    assert len(lines) == 3 and len(ax.collections) == 3  # one curve and one set of dots each
    # curves are the fitted model in milliseconds, light to dark
    for line, length in zip(lines, model.context_lengths):
        x, y = line.get_data()
        assert np.allclose(y, model.curves[model.context_lengths.index(length)](x) * 1e3)
    darkness = [sum(line.get_color()[:3]) for line in lines]
    assert darkness == sorted(darkness, reverse=True)
    dots = ax.collections[1].get_offsets()
    assert np.allclose(dots[:, 0], [0, 2, 8, 32, 64])
    assert np.allclose(dots[:, 1], np.asarray(model.metadata["raw_verify"]["24"]) * 1e3)
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels[0].startswith("l = 0") and labels[-1].startswith("l = 48")
    assert any(f"C_d = {model.draft_cost * 1e3:.2f} ms" in t for t in captured["texts"])


def test_plot_of_a_published_torch_model_draws_curves_only(tmp_path, monkeypatch):
    n = [0, 16, 64, 256]
    published = {
        "type": "convex",
        "context_lengths": [0, 4096],
        "node_counts": n,
        "fitted_curves": {0: [0.02, 0.02, 0.03, 0.08], 4096: [0.03, 0.031, 0.045, 0.11]},
        "draft_cost": 0.004,
    }
    torch.save(published, tmp_path / "cost.pt")
    model = load_cost_model(tmp_path / "cost.pt")
    captured = capture_figure(monkeypatch)
    out = plot_cost_model(model, tmp_path / "fig.png")
    png_size(out)
    ax = captured["axes"]
    assert len(ax.get_lines()) == 2 and len(ax.collections) == 0
    assert ax.get_xlim()[1] == 256
    assert any("C_d = 4.00 ms" in t for t in captured["texts"])


def test_plot_rejects_what_it_cannot_draw(tmp_path):
    with pytest.raises(InvalidInputError, match="no per-context verification curves"):
        plot_cost_model(object(), tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()


# ---- grids and windows ---------------------------------------------------------------------------


def test_default_context_lengths_are_clipped_to_the_window_with_a_note(
    capsys, tiny_pair_dirs, tmp_path
):
    cost = tmp_path / "cost.json"
    argv = profile_argv(tiny_pair_dirs, "--node-counts", "0", "1", "2", "--trials", "1")
    assert main([*argv, "--warmup", "0", "--out", str(cost)]) == 0
    longest = MAX_POSITIONS - TINY_BLOCK - 1
    assert load_cost_model(cost).context_lengths == [0, longest]
    err = capsys.readouterr().err
    assert f"the longest context is {longest}" in err and "8192" in err


def test_fit_context_lengths():
    assert fit_context_lengths([2048, 0, 1024], 1500) == ([0, 1024, 1500], [2048])
    assert fit_context_lengths([0, 1024], 1024) == ([0, 1024], [])
    assert fit_context_lengths([0, 1024], None) == ([0, 1024], [])
    with pytest.raises(InvalidInputError, match="position window is too small"):
        fit_context_lengths([0], -3)


def test_check_profile_grid():
    assert check_profile_grid([512, 0, 0], [8, 0, 2, 8], 3, 0) == ([0, 512], [0, 2, 8])
    for lengths, counts, match in [
        ([], [0, 1, 2], "at least one context length"),
        ([0], [0, 1, 1], "at least 3 distinct"),
        ([0], [0, 1, 2.5], "must be integers"),
        ([-1], [0, 1, 2], "non-negative"),
        ([0], [0, 1, MAX_NODE_COUNT + 1], "profiling limit"),
    ]:
        with pytest.raises(InvalidInputError, match=match):
            check_profile_grid(lengths, counts)
    with pytest.raises(InvalidInputError, match="trials must be an integer >= 1"):
        check_profile_grid([0], [0, 1, 2], 0, 0)


def test_profile_cost_model_needs_a_drafter():
    with pytest.raises(InvalidInputError, match="needs a drafter"):
        profile_cost_model(None, None, context_lengths=[0], node_counts=[0, 1, 2])


# ---- errors from the command line ----------------------------------------------------------------


def failing_profile(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("caddtree: error:")
    return last


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--node-counts", "0", "1"], "at least 3 distinct node counts"),
        (["--node-counts", "4", "4", "4", "1"], "at least 3 distinct node counts"),
        (["--node-counts", "-1", "2", "4"], "node counts must be non-negative"),
        (["--context-lengths", "-5", "0"], "context lengths must be non-negative"),
        (["--node-counts", "0", "1", "100000"], f"above the profiling limit of {MAX_NODE_COUNT}"),
        (["--trials", "0"], "trials must be an integer >= 1"),
        (["--warmup", "-1"], "warmup must be an integer >= 0"),
        (["--plot", "fig.gif"], "use a .png, .pdf or .svg"),
        (["--dtype", "int8"], "unknown dtype"),
        (["--context-lengths", "0", "60"], "context length 60 leaves no room"),
    ],
)
def test_profile_bad_input_is_one_line(capsys, tiny_pair_dirs, tmp_path, extra, message):
    cost = tmp_path / "cost.json"
    argv = profile_argv(tiny_pair_dirs, "--trials", "1", "--out", str(cost), *extra)
    assert message in failing_profile(capsys, argv)
    assert not cost.exists()


def test_profile_needs_both_models_or_neither(capsys, tiny_pair_dirs):
    target, draft = tiny_pair_dirs
    assert "needs --draft" in failing_profile(capsys, ["profile", "--target", str(target)])
    assert "--draft needs --target" in failing_profile(capsys, ["profile", "--draft", str(draft)])


def test_profile_out_must_be_a_file(capsys, tiny_pair_dirs, tmp_path):
    argv = profile_argv(tiny_pair_dirs, "--out", str(tmp_path))
    assert "is a directory" in failing_profile(capsys, argv)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message for a missing GPU")
def test_profile_on_cuda_without_a_gpu(capsys, tiny_pair_dirs, tmp_path):
    argv = profile_argv(tiny_pair_dirs, "--out", str(tmp_path / "c.json"))
    argv[argv.index("cpu")] = "cuda"
    assert "no CUDA device" in failing_profile(capsys, argv)


def test_node_count_beyond_what_a_tree_can_hold(capsys, tiny_pair_dirs, tmp_path):
    # a block of 2 drafts one position: a tree holds at most one node per vocabulary token (96)
    target_dir, _ = tiny_pair_dirs
    saved_drafter(qwen3_target(), tmp_path / "draft_b2", block_size=2)
    argv = profile_argv((target_dir, tmp_path / "draft_b2"), "--node-counts", "0", "8", "200")
    argv += ["--context-lengths", "0", "--out", str(tmp_path / "cost.json")]
    message = failing_profile(capsys, argv)
    assert "holds at most 96 nodes; node count 200 does not fit" in message


# ---- issue 14: say how long a first-use profile will take ----------------------------------------


@pytest.fixture(scope="module")
def tiny_generator(tiny_pair_dirs):
    from caddtree.api import SpeculativeGenerator

    target, draft = tiny_pair_dirs
    return SpeculativeGenerator.from_pretrained(target, draft, dtype="float64", device="cpu")


def test_the_profile_estimate_is_on_the_high_side_of_the_real_time(tiny_generator, monkeypatch):
    """With verification made slow (as a half dtype on a CPU makes it), the estimate knows."""
    import time

    from caddtree.core.profiling import estimate_profile_seconds

    verifier, proposer = tiny_generator.verifier, tiny_generator.proposer
    verify = verifier.verify

    def slow_verify(bonus, tree):
        time.sleep(0.002 + 0.0004 * len(tree))  # 2 ms per round, 0.4 ms per node
        return verify(bonus, tree)

    monkeypatch.setattr(verifier, "verify", slow_verify)
    grid = {"context_lengths": [0, 16], "node_counts": [0, 4, 16, 32], "trials": 2, "warmup": 1}
    estimate = estimate_profile_seconds(verifier, proposer, **grid)
    start = time.perf_counter()
    profile_cost_model(verifier, proposer, progress=False, **grid)
    actual = time.perf_counter() - start
    slept = 2 * 3 * sum(0.002 + 0.0004 * n for n in grid["node_counts"])  # lengths x runs
    assert estimate >= slept and actual <= 3 * estimate, (estimate, actual)
    assert estimate <= 5 * actual, (estimate, actual)


def test_the_grid_is_measured_in_interleaved_passes(tiny_generator, monkeypatch):
    """A slow spell of the machine as long as four calls (a fresh process's first calls, another
    job) once inflated every trial of the point it fell on, and a curve with it: the context-0
    curve of a real profile started far above the context-256 one. Measured in passes over the
    whole grid, each point meets it at most once, and its median ignores it. Also: decoding's
    reserved cache is what is timed, and every point is verified warmup + trials times. The
    clock is the test's: a verification of n nodes takes 2 ms + 0.2 ms n on it, anything else
    next to nothing, so a loaded machine cannot make a point look noisy."""
    import collections
    from types import SimpleNamespace

    from caddtree.core import profiling

    verifier, proposer = tiny_generator.verifier, tiny_generator.proposer
    verify = verifier.verify
    counts, lengths, spell = [0, 4, 16, 32], [0, 16], range(8, 12)
    calls = []
    clock = SimpleNamespace(now=0.0)

    def perf_counter():
        clock.now += 1e-7
        return clock.now

    def timed_verify(bonus, tree):
        slow = 0.25 if len(calls) in spell else 0.0
        calls.append((verifier.context_length, len(tree), verifier.cache_capacity()))
        clock.now += 0.002 + 0.0002 * len(tree) + slow
        return verify(bonus, tree)

    monkeypatch.setattr(profiling, "time", SimpleNamespace(perf_counter=perf_counter))
    monkeypatch.setattr(verifier, "verify", timed_verify)
    grid = {"context_lengths": lengths, "node_counts": counts, "trials": 3, "warmup": 1}
    model = profile_cost_model(verifier, proposer, progress=False, **grid)
    trials = model.metadata["verify_trials"]
    assert max(trials["16"][0]) >= 0.25  # the spell fell on the first timed pass, at context 16
    for length in lengths:
        for n, seconds in zip(counts, model.metadata["raw_verify"][str(length)], strict=True):
            # a median that met the spell would be 0.25 s more
            assert seconds == pytest.approx(0.002 + 0.0002 * n, abs=1e-5), (length, n, seconds)
    points = collections.Counter((max(length, 1), n) for length in lengths for n in counts)
    # and the drafting cost verifies the bonus alone at each context, with and without a pass
    # before it: 2 untimed and 12 timed turns of each
    alone = 2 * (2 + 12)
    expected = {p: 4 + (alone if p[1] == 0 else 0) for p in points}
    assert collections.Counter(call[:2] for call in calls) == expected
    # on this clock the drafter's pass and tree take next to nothing beside a verification
    assert all(abs(extra) < 1e-5 for extra in model.metadata["drafted_round_extra"])
    (capacity,) = {call[2] for call in calls}  # room reserved once, as decoding reserves it
    assert capacity >= 16 + 32 + 1
    per_pass = len(lengths) * len(counts)
    assert [call[:2] for call in calls[:per_pass]] == [(16, n) for n in counts] + [
        (1, n) for n in counts
    ]  # the longest context first, then truncated; the next pass visits the counts backwards
    assert [call[1] for call in calls[per_pass : per_pass + len(counts)]] == counts[::-1]


def test_a_point_whose_trials_disagree_wildly_is_measured_again(tiny_generator, monkeypatch):
    """Trials of 2, 20 and 40 ms have a median no one can trust: the point is measured again
    (one untimed and `trials` timed calls) and keeps the steady run; the metadata names it."""
    import collections
    import time

    verifier, proposer = tiny_generator.verifier, tiny_generator.proposer
    verify = verifier.verify
    counts, lengths = [0, 4, 16], [0, 16]
    calls = []
    erratic = iter([0.0, 0.018, 0.038])  # the timed trials of (16, 4) in the first passes

    def timed_verify(bonus, tree):
        point = (verifier.context_length, len(tree))
        calls.append(point)
        first_passes = len(calls) <= 4 * len(counts) * len(lengths)
        slow = next(erratic) if point == (16, 4) and first_passes and calls.count(point) > 1 else 0
        time.sleep(0.003 + slow)
        return verify(bonus, tree)

    monkeypatch.setattr(verifier, "verify", timed_verify)
    grid = {"context_lengths": lengths, "node_counts": counts, "trials": 3, "warmup": 1}
    model = profile_cost_model(verifier, proposer, progress=False, **grid)
    # (a loaded machine may make other points erratic too, and those are measured again as well)
    assert 4 in model.metadata["retried"].get("16", [])
    assert collections.Counter(calls)[(16, 4)] >= 4 + 4
    assert max(model.metadata["verify_trials"]["16"][1]) < 0.015  # the steady run was kept
    assert model.metadata["raw_verify"]["16"][1] < 0.015


def test_median_time_takes_erratic_trials_again(monkeypatch):
    from caddtree.core import profiling

    durations = iter([0.001, 0.01, 0.03, 0.004, 0.004, 0.0041])
    clock = [0.0]

    def tick():
        clock[0] += next(durations)

    monkeypatch.setattr(profiling.time, "perf_counter", lambda: clock[0])
    assert profiling.median_time(tick, 0, 3, []) == pytest.approx(0.004)
    assert profiling.spread([1.0, 1.0, 1.0]) == 0.0
    assert profiling.spread([1.0, 3.0, 5.0]) > profiling.NOISY_SPREAD


def test_describe_duration():
    from caddtree.core.profiling import describe_duration

    assert describe_duration(3) == "about 3 seconds"
    assert describe_duration(70) == "about a minute"
    assert describe_duration(900) == "about 15 minutes"
    assert describe_duration(3 * 3600) == "about 3.0 hours"


def test_first_use_profiling_says_how_long_it_will_take(
    tiny_generator, tmp_path, monkeypatch, caplog
):
    """It promised "about a minute" whatever the dtype; a float16 profile on a CPU took 15."""
    import caddtree.core.profiling

    fake = ConvexCostModel.fit({0: ([0, 8, 64], [0.01, 0.011, 0.02])}, draft_cost=0.002)
    monkeypatch.setattr(caddtree.core.profiling, "estimate_profile_seconds", lambda *a, **k: 900.0)
    monkeypatch.setattr(tiny_generator, "profile", lambda **kwargs: fake)
    monkeypatch.setattr(tiny_generator.verifier, "dtype", torch.float16)  # what the hint reads
    tiny_generator.cached_cost_model(tmp_path)
    err = caplog.text
    assert "profiling it once (about 15 minutes, estimated" in err
    assert "float16 may have no fast kernels on this CPU" in err and "float32" in err


def test_a_profile_on_a_busy_cpu_warns_that_its_timings_will_be_off(caplog):
    import logging
    import os

    from caddtree.profiles import others_cpu_share, warn_if_cpu_busy

    if not hasattr(os, "sched_getaffinity"):
        pytest.skip("reads Linux's /proc/stat")
    cpus = sorted(os.sched_getaffinity(0))

    def stat_reader(busy_per_snapshot: int):
        snapshots = iter((1, 2))  # cumulative counts: a second snapshot adds the same again

        def read() -> str:
            k = next(snapshots)  # user nice system idle iowait irq softirq steal guest guest_nice
            busy, idle = k * busy_per_snapshot, k * (100 - busy_per_snapshot)
            lines = ["cpu 0 0 0 0 0 0 0 0 0 0", "cpu9999 5000 0 0 0 0 0 0 0 0 0"]  # not ours
            lines += [f"cpu{c} {busy} 0 0 {idle} 0 0 0 0 0 0" for c in cpus]
            return "\n".join([*lines, "", "intr 1 2 3"])

        return read

    assert others_cpu_share(0.0, stat_reader(90)) == pytest.approx(0.9)
    assert others_cpu_share(0.0, stat_reader(5)) == pytest.approx(0.05)

    def unreadable() -> str:
        raise OSError("no /proc")

    assert others_cpu_share(0.0, unreadable) is None
    with caplog.at_level(logging.WARNING, logger="caddtree.api"):
        warn_if_cpu_busy(torch.device("cpu"), stat_reader(5))
        assert not caplog.records
        warn_if_cpu_busy(torch.device("cuda"), unreadable)  # a GPU profile reads nothing
        warn_if_cpu_busy(torch.device("cpu"), stat_reader(90))
    (record,) = caplog.records
    assert "other processes keep 90% of this process's CPUs busy" in record.getMessage()
    assert "caddtree profile --out cost.json" in record.getMessage()
