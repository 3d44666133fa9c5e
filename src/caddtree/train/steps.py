"""The drafter's training steps: one optimiser step on anchor blocks of samples of similar
lengths (:func:`train_step`), and the loop that runs them (:func:`run_steps`), reading their
figures back from the device a window at a time, evaluating, checkpointing, and ending by a
deadline where one is set. :func:`caddtree.train.train_drafter` sets it up."""

from __future__ import annotations

import json
import logging
import math
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .batch import length_buckets
from .loss import AnchorBlockLoss, evaluate

logger = logging.getLogger(__name__)

__all__ = ["BUCKET_WINDOW", "Loop", "lr_at", "run_steps", "train_step"]


def lr_at(step: int, config: Any) -> float:
    if step < config.warmup_steps:
        return config.learning_rate * (step + 1) / config.warmup_steps
    span = max(1, config.steps - config.warmup_steps)
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

    def save(self, log: list[dict]) -> None:
        """A checkpoint of the steps in ``log``, then ``on_checkpoint``."""
        self.write_checkpoint(log)
        if self.on_checkpoint is not None:
            self.on_checkpoint(self.ckpt)

    def steps_before_deadline(self, step_s: float) -> int | None:
        """How many more steps of ``step_s`` seconds fit before the deadline (``None``: none
        is set)."""
        if self.deadline is None:
            return None
        return max(0, int((self.deadline - time.monotonic()) / max(step_s, 1e-9)))


def run_steps(loop: Loop, log: list[dict], start: int, end: int, progress: bool) -> dict[str, Any]:
    """Run steps ``start`` to ``end``, appending each entry to ``log`` and its file (read back
    from the device every ``log_every`` steps, before an evaluation and before a checkpoint) and
    saving a checkpoint every ``save_every`` steps and at the end, or on an interrupt. Returns
    the last entry."""
    from tqdm.auto import tqdm

    trainer, optimizer = loop.trainer, loop.optimizer
    config = trainer.config
    bar = tqdm(
        total=config.steps,
        initial=start,
        desc="training drafter",
        unit="step",
        disable=not progress,
    )
    pending = _Pending(log, loop.log_path, bar)
    previous_handler = terminate_as_interrupt()
    try:
        step = start
        while step < end:
            pending.add(train_step(trainer, optimizer, loop.train_ids, step))
            step += 1
            evaluating = bool(loop.eval_ids) and (
                step % config.eval_every == 0 or step == config.steps
            )
            if evaluating or step % config.save_every == 0 or step % config.log_every == 0:
                pending.flush(evaluate(trainer, loop.eval_ids, config.seed) if evaluating else {})
                end = _end_by_deadline(loop, step, end, pending.step_s, bar)
            if step % config.save_every == 0 or step == end:
                pending.flush({})
                loop.save(log)
    except KeyboardInterrupt:
        pending.flush({})
        if len(log) > start:
            loop.save(log)
            logger.warning("interrupted: saved step %d; run again to resume", len(log))
        raise
    finally:
        bar.close()
        if previous_handler is not None:
            signal.signal(signal.SIGTERM, previous_handler)
    return log[-1] if log else {}


def _end_by_deadline(loop: Loop, step: int, end: int, step_s: float | None, bar: Any) -> int:
    """The step this call ends at, given the deadline and the latest pace: before a step that
    would not finish in time, with the schedule's total lowered to what fits."""
    fits = None if step_s is None else loop.steps_before_deadline(step_s)
    if fits is None:
        return end
    config = loop.trainer.config
    if step + fits < config.steps:
        config.steps = max(step + fits, step)
        bar.total = config.steps
    return min(end, step + fits)


class _Pending:
    """Log entries of steps whose figures are still on the device."""

    def __init__(self, log: list[dict], path: Path, bar: Any) -> None:
        self.log, self.path, self.bar = log, path, bar
        self.entries: list[dict[str, Any]] = []
        self.since = time.perf_counter()
        self.step_s: float | None = None  # the mean of the last window read back

    def add(self, entry: dict[str, Any]) -> None:
        self.entries.append(entry)

    def flush(self, evaluation: dict[str, Any]) -> None:
        """Read the pending entries back (the last one gets ``evaluation``), append them to the
        log and its file."""
        if not self.entries:
            return
        read = [{k: _host_value(v) for k, v in e.items()} for e in self.entries]
        self.step_s = (time.perf_counter() - self.since) / len(read)
        for entry in read:
            entry["step_s"] = round(self.step_s, 3)
        read[-1].update(evaluation)
        self.log.extend(read)
        with open(self.path, "a", encoding="utf-8") as fh:
            fh.write("".join(json.dumps(e) + "\n" for e in read))
        last = read[-1]
        self.bar.set_postfix(loss=f"{last['loss']:.3f}", acc=f"{last['train_accept']:.2f}")
        self.bar.update(len(read))
        self.entries = []
        self.since = time.perf_counter()


def _host_value(value: Any) -> Any:
    return float(value) if isinstance(value, torch.Tensor) else value


def terminate_as_interrupt() -> Any:
    """Make SIGTERM (``kill PID``, a job scheduler's stop) behave like Ctrl-C while training, so
    a stopped run saves its checkpoint; background jobs started by a shell ignore Ctrl-C's SIGINT.
    Returns the previous handler (``None`` off the main thread, where handlers cannot be set)."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    return signal.signal(signal.SIGTERM, interrupt)


def train_step(trainer: AnchorBlockLoss, optimizer, train_ids, step: int) -> dict[str, Any]:
    """One optimiser step on ``samples_per_step`` samples of similar lengths from ``train_ids``
    (ordered by length, :func:`~caddtree.train.batch.by_length`), drawn with the RNG of
    ``(seed, step)`` (the anchors with a generator of the training device). The entry's figures
    stay on the device (read back by :class:`_Pending`)."""
    config, drafter = trainer.config, trainer.drafter
    seed = config.seed * 1_000_003 + step
    picks = torch.rand(config.samples_per_step, generator=torch.Generator().manual_seed(seed))
    window = BUCKET_WINDOW * config.samples_per_step
    sample_ids = length_buckets(train_ids, picks, window)
    anchor_gen = torch.Generator(device=trainer.device).manual_seed(seed)
    for group in optimizer.param_groups:
        group["lr"] = lr_at(step, config)
    optimizer.zero_grad(set_to_none=True)
    loss, stats = trainer.batch_loss(sample_ids, anchor_gen)
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(drafter.parameters(), config.grad_clip)
    optimizer.step()
    entry = {
        "step": step + 1,
        "loss": loss.detach(),
        "train_accept": stats["accept"],
        "lr": optimizer.param_groups[0]["lr"],
        "grad_norm": grad_norm,
    }
    if "l1" in stats:  # the loss has the target's distribution: its parts
        entry.update(train_ce=stats["ce"], train_l1=stats["l1"])
    return entry


BUCKET_WINDOW = 16
"""A step's samples come from this many times ``samples_per_step`` samples of neighbouring
lengths (:func:`~caddtree.train.batch.length_buckets`)."""
