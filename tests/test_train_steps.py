"""The training loop's bookkeeping (caddtree.train.steps.run_steps) on a fake clock: what a step,
an evaluation and a save cost is set by the test, so the deadline arithmetic, the pace that
excludes evaluations and saves, and the log's integrity under an interrupt are checked exactly."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from caddtree.train import steps


class FakeTime:
    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now

    perf_counter = monotonic


def fake_loop(monkeypatch, tmp_path, *, step_s, eval_s=0.0, save_s=0.0, deadline=None, **cfg):
    """A loop whose steps, evaluations and saves only advance a fake clock; ``step_s`` is a
    number or a function of the step. Returns the loop, the clock and the saves' step counts."""
    clock = FakeTime()
    monkeypatch.setattr(steps, "time", clock)
    defaults = dict(steps=1000, log_every=4, save_every=10**6, eval_every=10**6, seed=0)
    defaults["eval_samples"] = None
    config = SimpleNamespace(**{**defaults, **cfg})
    cost = step_s if callable(step_s) else (lambda step: step_s)

    def train_step(trainer, optimizer, train_ids, step, total=None):
        clock.now += cost(step)
        one = torch.tensor(1.0)
        return {"step": step + 1, "loss": one, "train_accept": one, "schedule_steps": total}

    def evaluate(trainer, eval_ids, seed):
        clock.now += eval_s
        return {"eval_accept": 0.5}

    saves: list[int] = []

    def write_checkpoint(log):
        clock.now += save_s
        saves.append(len(log))

    monkeypatch.setattr(steps, "train_step", train_step)
    monkeypatch.setattr(steps, "evaluate", evaluate)
    trainer = SimpleNamespace(config=config)
    loop = steps.Loop(
        trainer,
        None,
        [0],
        [1],
        tmp_path / "ckpt",
        tmp_path / "log.jsonl",
        write_checkpoint,
        deadline,
    )
    return loop, clock, saves


def file_log(tmp_path):
    return [json.loads(x) for x in (tmp_path / "log.jsonl").read_text().splitlines()]


def test_evaluations_and_saves_are_not_counted_in_the_pace(monkeypatch, tmp_path):
    loop, clock, saves = fake_loop(
        monkeypatch, tmp_path, step_s=1.0, eval_s=7.0, save_s=3.0, eval_every=4, save_every=6
    )
    log: list[dict] = []
    last = steps.run_steps(loop, log, 0, 12, progress=False)
    assert [e["step"] for e in log] == list(range(1, 13)) and log == file_log(tmp_path)
    assert {e["step_s"] for e in log} == {1.0}
    assert [e["step"] for e in log if "eval_accept" in e] == [4, 8, 12] and last is log[-1]
    assert saves == [6, 12]
    assert clock.now == 12 * 1.0 + 3 * 7.0 + 2 * 3.0


def test_a_deadline_keeps_the_end_evaluation_and_save_in_reserve(monkeypatch, tmp_path):
    loop, clock, saves = fake_loop(
        monkeypatch, tmp_path, step_s=1.0, eval_s=5.0, save_s=3.0, deadline=40.0
    )
    log: list[dict] = []
    steps.run_steps(loop, log, 0, 1000, progress=False)
    # step 1 is evaluated and saved to learn what the end costs (t = 9); then 22 steps of 1 s
    # fit before 40 - 8: the last step is evaluated and saved exactly by the deadline
    assert len(log) == 24 and clock.now == 40.0
    assert saves == [1, 24] and "eval_accept" in log[0] and "eval_accept" in log[-1]
    assert log[-1]["schedule_steps"] == 24  # the learning rate's schedule ended there too


def test_the_first_steps_set_a_cautious_pace_and_a_faster_one_raises_the_end(monkeypatch, tmp_path):
    # the first step compiles (20 s), the next ones run at 2 s and then 1 s a step: the end
    # follows the latest pace, upward too, never past the steps asked for
    cost = lambda step: 20.0 if step == 0 else (2.0 if step < 10 else 1.0)  # noqa: E731
    loop, clock, saves = fake_loop(monkeypatch, tmp_path, step_s=cost, deadline=100.0)
    log: list[dict] = []
    steps.run_steps(loop, log, 0, 1000, progress=False)
    totals = [e["schedule_steps"] for e in log]
    assert totals[:2] == [1000, 1000]  # the warm-up steps set no pace
    assert min(totals[2:]) < max(totals[2:])  # raised as the pace got faster
    assert clock.now <= 100.0 and clock.now + 1.0 > 100.0  # no room for another step
    # a run that fits keeps its schedule
    (tmp_path / "b").mkdir()
    loop, clock, _ = fake_loop(monkeypatch, tmp_path / "b", step_s=1.0, deadline=100.0, steps=30)
    few: list[dict] = []
    steps.run_steps(loop, few, 0, 30, progress=False)
    assert len(few) == 30 and {e["schedule_steps"] for e in few} == {30}


def test_a_deadline_already_past_runs_nothing(monkeypatch, tmp_path):
    loop, clock, saves = fake_loop(monkeypatch, tmp_path, step_s=1.0, deadline=-1.0)
    log: list[dict] = []
    assert steps.run_steps(loop, log, 0, 10, progress=False) == {}
    assert log == [] and saves == []


def test_an_interrupt_saves_each_step_once_in_the_log_and_its_file(monkeypatch, tmp_path):
    loop, clock, saves = fake_loop(monkeypatch, tmp_path, step_s=1.0, log_every=4)
    real = steps.train_step

    def interrupted(trainer, optimizer, train_ids, step, total=None):
        if step == 6:
            raise KeyboardInterrupt
        return real(trainer, optimizer, train_ids, step, total)

    monkeypatch.setattr(steps, "train_step", interrupted)
    log: list[dict] = []
    with pytest.raises(KeyboardInterrupt):
        steps.run_steps(loop, log, 0, 12, progress=False)
    assert [e["step"] for e in log] == [1, 2, 3, 4, 5, 6] and file_log(tmp_path) == log
    assert saves == [6]


def test_limits_before_and_after_the_pace_is_known(monkeypatch):
    clock = FakeTime()
    monkeypatch.setattr(steps, "time", clock)
    assert steps.Clock(None).limits(3, 50, 100) == (50, 100)
    timer = steps.Clock(10.0)
    assert timer.limits(3, 50, 100) == (4, 100)  # one step at a time, the schedule as asked
    timer.observe(30.0)  # the warm-up step: no pace yet, however slow
    assert timer.limits(3, 50, 100) == (4, 100)
    timer.observe(None)  # nothing read back
    assert timer.windows == 1
    timer.observe(2.0)
    assert timer.limits(3, 50, 100) == (8, 8)
    timer.reserve["save"] = 4.0
    assert timer.limits(3, 50, 100) == (6, 6)
    clock.now = 11.0
    assert timer.limits(3, 50, 100) == (3, 4)


def test_a_slow_first_step_does_not_end_the_call(monkeypatch, tmp_path):
    # the first step takes longer than the time left after it; at the real pace 10 more fit
    cost = lambda step: 50.0 if step == 0 else 1.0  # noqa: E731
    loop, clock, saves = fake_loop(monkeypatch, tmp_path, step_s=cost, deadline=60.0)
    log: list[dict] = []
    steps.run_steps(loop, log, 0, 1000, progress=False)
    assert len(log) == 11 and clock.now == 60.0 and saves == [1, 11]


def pending_with_entries(tmp_path, count=3):
    log: list[dict] = []
    bar = SimpleNamespace(set_postfix=lambda **kw: None, update=lambda n: None)
    pending = steps._Pending(log, tmp_path / "log.jsonl", bar)
    for step in range(1, count + 1):
        pending.add({"step": step, "loss": torch.tensor(0.5), "train_accept": torch.tensor(0.25)})
    return pending, log


def test_an_interrupt_during_the_write_waits_for_both_copies(monkeypatch, tmp_path):
    import os
    import signal

    pending, log = pending_with_entries(tmp_path)
    pending.read_back()
    real_dumps = steps.json.dumps
    sent: list[int] = []

    def dumps_then_interrupt(entry):
        if not sent:  # the interrupt arrives in the middle of the write
            sent.append(1)
            os.kill(os.getpid(), signal.SIGINT)
        return real_dumps(entry)

    monkeypatch.setattr(steps.json, "dumps", dumps_then_interrupt)
    # a shell's background job starts with SIGINT ignored; give this test Python's own handler
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            pending.write({"eval_accept": 0.5})
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, before)
    assert sent and [e["step"] for e in log] == [1, 2, 3] and file_log(tmp_path) == log
    pending.write({})  # nothing is left to write twice
    assert file_log(tmp_path) == log


def test_a_failed_write_is_not_written_twice(monkeypatch, tmp_path):
    pending, log = pending_with_entries(tmp_path)
    pending.read_back()
    pending.read_back()  # nothing pending: reads nothing twice
    assert len(pending.read) == 3
    real_open = open

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("builtins.open", full_disk)
    with pytest.raises(OSError):
        pending.write({})
    monkeypatch.setattr("builtins.open", real_open)
    assert log == [] and pending.read == []
    pending.add({"step": 4, "loss": torch.tensor(0.5), "train_accept": torch.tensor(0.25)})
    pending.read_back()
    pending.write({})
    assert [e["step"] for e in log] == [4] and file_log(tmp_path) == log


def test_a_handler_set_outside_python_is_left_as_it_is(monkeypatch, tmp_path):
    import signal

    real = signal.getsignal
    monkeypatch.setattr(
        steps.signal, "getsignal", lambda k: None if k == signal.SIGTERM else real(k)
    )
    before = real(signal.SIGTERM)
    pending, log = pending_with_entries(tmp_path)
    pending.read_back()
    pending.write({})
    assert [e["step"] for e in log] == [1, 2, 3] and real(signal.SIGTERM) is before
