"""The drafter's training steps: one optimiser step on anchor blocks of samples of similar
lengths (:func:`train_step`), and the loop that runs them (:func:`run_steps`), reading their
figures back from the device a window at a time, evaluating, checkpointing, and ending by a
deadline where one is set. :func:`caddtree.train.train_drafter` sets it up."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..util.ranks import DistInfo, from_rank0
from .batch import length_buckets
from .loss import AnchorBlockLoss, evaluate

logger = logging.getLogger(__name__)

__all__ = ["BUCKET_WINDOW", "Clock", "Loop", "lr_at", "run_steps", "train_step"]


def lr_at(step: int, config: Any, total: int | None = None) -> float:
    """The learning rate of ``step``: a linear warm-up, then a cosine to a tenth of the rate by
    step ``total`` (default ``config.steps``)."""
    if step < config.warmup_steps:
        return config.learning_rate * (step + 1) / config.warmup_steps
    total = config.steps if total is None else total
    span = max(1, total - config.warmup_steps)
    progress = min(1.0, (step - config.warmup_steps) / span)
    return config.learning_rate * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


@dataclass
class Loop:
    """What the training loop works with besides its log."""

    trainer: AnchorBlockLoss
    optimizer: Any
    train_ids: Any
    eval_ids: Any
    ckpt: Path
    log_path: Path
    write_checkpoint: Callable[[list[dict]], None]  # a checkpoint of the steps of a log
    deadline: float | None = None  # time.monotonic() by which the call ends
    on_checkpoint: Callable[[Path], None] | None = None
    ranks: DistInfo = field(default_factory=DistInfo)  # under torchrun, rank 0 writes the files

    def save(self, log: list[dict]) -> None:
        """A checkpoint of the steps in ``log``, then ``on_checkpoint`` (rank 0's alone)."""
        if self.ranks.rank != 0:
            return
        self.write_checkpoint(log)
        if self.on_checkpoint is not None:
            self.on_checkpoint(self.ckpt)


WARM_STEPS = 2
"""The first steps of a call are read back one at a time and set no pace: the first one warms up
(compilation, allocation) and the second is the first real one. Until both are read back, the call
goes on a step at a time while time is left, on the schedule as asked."""


class Clock:
    """The seconds a training step, an evaluation and a checkpoint take, and so the steps that
    still fit before a deadline with the last evaluation and checkpoint kept in reserve."""

    def __init__(self, deadline: float | None) -> None:
        self.deadline = deadline
        self.step_s: float | None = None  # the latest window's mean (evaluations, saves excluded)
        self.windows = 0  # windows read back so far
        self.reserve = {"evaluate": 0.0, "save": 0.0}  # the latest of each

    def observe(self, step_s: float | None) -> None:
        """The mean seconds a step of the window just read back took."""
        if step_s is not None:
            self.step_s, self.windows = step_s, self.windows + 1

    def timed(self, kind: str, work: Callable[[], Any]) -> Any:
        began = time.perf_counter()
        try:
            return work()
        finally:
            self.reserve[kind] = time.perf_counter() - began

    def limits(self, step: int, end: int, steps: int) -> tuple[int, int]:
        """The step this call ends at (at most ``end``) and the schedule's total (at most
        ``steps``), from the latest pace: a step is started only if it can finish, and be
        evaluated and saved, by the deadline. Until the warm-up steps are read back
        (``WARM_STEPS``), one step at a time while time is left."""
        if self.deadline is None:
            return end, steps
        left = self.deadline - time.monotonic() - sum(self.reserve.values())
        if self.step_s is None or self.windows < WARM_STEPS:
            return min(end, step + 1 if left > 0 else step), steps
        fits = max(0, int(left / max(self.step_s, 1e-9)))
        return min(end, step + fits), min(steps, max(step + fits, step + 1))


def run_steps(loop: Loop, log: list[dict], start: int, end: int, progress: bool) -> dict[str, Any]:
    """Run steps ``start`` to ``end``, appending each entry to ``log`` and its file (read back
    from the device every ``log_every`` steps, before an evaluation and before a checkpoint),
    evaluating every ``eval_every`` steps and at the end, saving a checkpoint every
    ``save_every`` steps and at the end, or on an interrupt. With a deadline, the call and the
    learning-rate schedule end where the latest pace says (:class:`Clock`). Returns the last
    entry."""
    from tqdm.auto import tqdm

    config = loop.trainer.config
    writer = loop.ranks.rank == 0
    bar = tqdm(
        total=config.steps,
        initial=start,
        desc="training drafter",
        unit="step",
        disable=not (progress and writer),
    )
    pending = _Pending(log, loop.log_path if writer else None, bar)
    clock = Clock(loop.deadline)

    def limits(step: int) -> tuple[int, int]:
        # under torchrun rank 0's clock says where the call ends: every rank runs the same steps
        return from_rank0(loop.ranks, clock.limits(step, end, config.steps))

    previous_handler = terminate_as_interrupt()
    try:
        step, (last, total) = start, limits(start)
        while step < last:
            pending.add(train_step(loop.trainer, loop.optimizer, loop.train_ids, step, total))
            step += 1
            if not _window_ends(config, step, start, last, bool(loop.eval_ids)):
                continue
            clock.observe(pending.read_back())
            last, total = limits(step)
            bar.total = total
            # a call cut short by its deadline ends evaluated; with a deadline, the first step is
            # evaluated and saved too, to learn what that end will cost
            probe = clock.deadline is not None and step == start + 1
            cut = step == last < end
            evaluating = bool(loop.eval_ids) and (
                step % config.eval_every == 0 or step == config.steps or cut or probe
            )
            pending.write(clock.timed("evaluate", lambda: _evaluate(loop)) if evaluating else {})
            if step == last or probe or step % config.save_every == 0:
                clock.timed("save", lambda: loop.save(log))
            pending.restart()
    except KeyboardInterrupt:
        pending.read_back()
        pending.write({})
        if len(log) > start:
            loop.save(log)
            logger.warning("interrupted: saved step %d; run again to resume", len(log))
        raise
    finally:
        bar.close()
        if previous_handler is not None:
            signal.signal(signal.SIGTERM, previous_handler)
    return log[-1] if log else {}


def _window_ends(config: Any, step: int, start: int, last: int, evaluates: bool) -> bool:
    """Whether the figures are read back after ``step``: at the end of a log window, before an
    evaluation or a checkpoint, at the call's last step, and after each of its first steps."""
    return (
        step == last
        or step - start <= WARM_STEPS
        or step % config.log_every == 0
        or step % config.save_every == 0
        or (evaluates and step % config.eval_every == 0)
    )


def _evaluate(loop: Loop) -> dict[str, Any]:
    config = loop.trainer.config
    return evaluate(loop.trainer, loop.eval_ids[: config.eval_samples], config.seed)


@contextlib.contextmanager
def _signals_deferred() -> Any:
    """Defer SIGINT and SIGTERM until the block ends, so an interrupt never lands between the log
    and its file: their handlers only record the signal meanwhile (Python runs them on the main
    thread whichever thread the system delivered to), and the first one recorded is handled as
    it would have been once the block is over. Off the main thread, where handlers cannot be
    set, the block runs as it is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    kinds = [k for k in (signal.SIGINT, signal.SIGTERM) if signal.getsignal(k) is not None]
    # (a handler not set from Python reads as None and could not be put back: left as it is)
    previous = {
        kind: signal.signal(kind, lambda signum, frame: caught.append(signum)) for kind in kinds
    }
    try:
        yield
    finally:
        for kind, handler in previous.items():
            signal.signal(kind, handler)
        if caught:
            _deliver(caught[0], previous[caught[0]])


def _deliver(signum: int, handler: Any) -> None:
    """Handle a deferred signal as ``handler`` would have."""
    if callable(handler):
        handler(signum, None)
    elif handler == signal.SIG_DFL:
        signal.raise_signal(signum)


class _Pending:
    """Log entries of steps whose figures are still on the device, then on the host until they
    are written to the log and its file (``None``: no file, on a rank other than 0)."""

    def __init__(self, log: list[dict], path: Path | None, bar: Any) -> None:
        self.log, self.path, self.bar = log, path, bar
        self.entries: list[dict[str, Any]] = []
        self.read: list[dict[str, Any]] = []
        self.since = time.perf_counter()

    def add(self, entry: dict[str, Any]) -> None:
        self.entries.append(entry)

    def restart(self) -> None:
        """Start the next window's clock (after an evaluation or a checkpoint)."""
        self.since = time.perf_counter()

    def read_back(self) -> float | None:
        """Bring the pending entries' figures to the host (one synchronisation); returns the
        window's seconds per step (None when nothing was pending)."""
        if not self.entries:
            return None
        stacked = _stack_figures(self.entries)
        step_s = (time.perf_counter() - self.since) / len(self.entries)
        with _signals_deferred():
            entries, self.entries = self.entries, []
            for entry, figures in zip(entries, stacked):
                self.read.append({**entry, **figures, "step_s": round(step_s, 3)})
        return step_s

    def write(self, evaluation: dict[str, Any]) -> None:
        """Append the entries read back (the last one with ``evaluation``) to the file, then to
        the log, both or neither, and each once: entries whose file write failed are not tried
        again (the file may hold a part of them; the log never does)."""
        if not self.read:
            return
        with _signals_deferred():
            read, self.read = self.read, []
            read[-1].update(evaluation)
            if self.path is not None:
                with open(self.path, "a", encoding="utf-8") as fh:
                    fh.write("".join(json.dumps(e) + "\n" for e in read))
            self.log.extend(read)
        last = read[-1]
        self.bar.set_postfix(loss=f"{last['loss']:.3f}", acc=f"{last['train_accept']:.2f}")
        self.bar.update(len(read))


def _stack_figures(entries: list[dict[str, Any]]) -> list[dict[str, float]]:
    """The tensor figures of ``entries`` as floats, read back in one copy."""
    keys = [k for k, v in entries[0].items() if isinstance(v, torch.Tensor)]
    if not keys:
        return [{} for _ in entries]
    values = torch.stack([torch.stack([e[k].float() for k in keys]) for e in entries]).tolist()
    return [dict(zip(keys, row)) for row in values]


def terminate_as_interrupt() -> Any:
    """Make SIGTERM (``kill PID``, a job scheduler's stop) behave like Ctrl-C while training, so
    a stopped run saves its checkpoint; background jobs started by a shell ignore Ctrl-C's SIGINT.
    Returns the previous handler (``None`` off the main thread, where handlers cannot be set)."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    return signal.signal(signal.SIGTERM, interrupt)


def train_step(
    trainer: AnchorBlockLoss, optimizer, train_ids, step: int, total: int | None = None
) -> dict[str, Any]:
    """One optimiser step on ``samples_per_step`` samples of similar lengths from ``train_ids``
    (ordered by length, :func:`~caddtree.train.batch.by_length`), drawn with the RNG of
    ``(seed, step)`` (the anchors with a generator of the training device). The entry's figures
    stay on the device (read back by :class:`_Pending`). ``total``: the learning-rate schedule's
    length (default ``steps``)."""
    config, drafter = trainer.config, trainer.drafter
    seed = config.seed * 1_000_003 + step
    picks = torch.rand(config.samples_per_step, generator=torch.Generator().manual_seed(seed))
    window = BUCKET_WINDOW * config.samples_per_step
    sample_ids = length_buckets(train_ids, picks, window)
    anchor_gen = torch.Generator(device=trainer.device).manual_seed(seed)
    for group in optimizer.param_groups:
        group["lr"] = lr_at(step, config, total)
    optimizer.zero_grad(set_to_none=True)
    loss, stats = trainer.batch_loss(sample_ids, anchor_gen)
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(drafter.parameters(), config.grad_clip)
    optimizer.step()
    entry = {
        "step": step + 1,
        "loss": stats["loss"],  # the whole batch's, under torchrun too
        "train_accept": stats["accept"],
        "lr": optimizer.param_groups[0]["lr"],
        "schedule_steps": config.steps if total is None else total,
        "grad_norm": grad_norm,
    }
    if "l1" in stats:  # the loss has the target's distribution: its parts
        entry.update(train_ce=stats["ce"], train_l1=stats["l1"])
    return entry


BUCKET_WINDOW = 16
"""A step's samples come from this many times ``samples_per_step`` samples of neighbouring
lengths (:func:`~caddtree.train.batch.length_buckets`)."""
