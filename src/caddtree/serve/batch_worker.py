"""Several generations at once: the server's worker on :class:`~caddtree.engine.batching.BatchDecoder`.

:class:`BatchEngine` has :class:`~caddtree.serve.worker.Engine`'s contract (the same jobs, events,
queue bound, cancellation and metrics) but keeps up to ``max_batch`` jobs generating together: a
job joins the batch as soon as a slot is free (its prompt is prefilled alone, then it decodes in
every round with the others), and leaves it when it finishes or is cancelled. Each round is one
target forward for every job in the batch, so the running jobs share the round's cost instead of
waiting for each other. It needs the lean runtime (the generator's ``runtime``, ``"lean"`` or ``"compiled"``), whose
KV cache has a slot per job.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from ..engine.batching import BatchDecoder
from ..engine.requests import GenerationRequest
from ..util.errors import CaddtreeError, InvalidInputError
from ..util.streaming import IncrementalDecoder
from .metrics import ServerMetrics
from .worker import Engine, Job

__all__ = ["BatchEngine"]

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class _Active:
    """A job in the batch: its request, its text stream, and what was reported of it so far."""

    job: Job
    request: GenerationRequest
    text: IncrementalDecoder | None
    sent: int = 0  # output tokens reported
    rounds: int = 0  # rounds reported to the metrics


class BatchEngine(Engine):
    """Runs up to ``max_batch`` :class:`Job` s at once (see the module docstring); ``max_queue``
    more may wait for a slot, one more is refused (:class:`~caddtree.serve.worker.QueueFull`).
    ``joint_budget``: rounds whose requests are all CaDDTree ones size their trees with one joint
    budget (``joint_cost_model`` of :class:`~caddtree.engine.batching.BatchDecoder`): priced by
    ``joint_cost_model`` (a :class:`~caddtree.engine.batch_cost.BatchCostModel`), else by the
    generator's one-sequence cost model."""

    def __init__(
        self,
        generator: Any,
        metrics: ServerMetrics,
        *,
        max_batch: int,
        joint_budget: bool = True,
        joint_cost_model: Any = None,
        max_queue: int = 8,
        on_round: Any = None,
        torch_thread: Any = None,
    ):
        if getattr(generator, "runtime", None) not in ("lean", "compiled"):
            raise InvalidInputError(
                "serving several requests at once (--max-batch above 1) needs the lean runtime; "
                "this target runs on transformers' forward"
            )
        super().__init__(
            generator, metrics, max_queue=max_queue, on_round=on_round, torch_thread=torch_thread
        )
        verifier = generator.verifier
        self.max_batch = int(max_batch)
        self.decoder = BatchDecoder(
            verifier.target,
            generator.drafter,
            max_batch=self.max_batch,
            capacity=int(verifier.max_positions or 8192),
            joint_cost_model=(joint_cost_model or generator.cost_model) if joint_budget else None,
            progress=True,
        )
        self._active: list[_Active] = []

    # ---- the bound and cancellation (called holding the lock) -------------------------------------

    def _busy(self) -> int:
        return len(self._active)

    def _full(self) -> bool:
        return len(self._pending) >= self.max_queue + max(self.max_batch - len(self._active), 1)

    def _cancel_running(self) -> None:
        for active in self._active:
            active.job.cancel()

    # ---- the worker ---------------------------------------------------------------------------------

    def _work(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._active and not self._stopping:
                    self._cond.wait()
                if self._stopping:
                    admitted = []
                else:
                    room = self.max_batch - len(self._active)
                    admitted = [
                        self._pending.popleft() for _ in range(min(room, len(self._pending)))
                    ]
            if self._stopping:
                for active in list(self._active):
                    self._end(active, cancelled=True)
                return
            try:
                for job in admitted:
                    self._admit(job)
                self._round()
            except BaseException:  # noqa: BLE001 - the worker must outlive any one round
                logger.exception("the generation worker failed on a round")
                for active in list(self._active):
                    self.decoder.drop(active.request)
                    self._forget(active)
                    if not active.job.finished:
                        active.job.emit("error", RuntimeError("internal error in the worker"))

    def _admit(self, job: Job) -> None:
        """Prefill ``job`` into the batch (its first token reported), or end it."""
        if job.cancelled.is_set():
            self._finish_cancelled(job)
            return
        job.started = time.perf_counter()
        try:
            request = self.generator.request(job.prompt_ids, **job.kwargs)
            self.decoder.add(request)
        except Exception as exc:  # noqa: BLE001 - reported to the request, the server goes on
            if not isinstance(exc, CaddtreeError):
                logger.exception("generation failed")
            job.emit("error", exc)
            return
        job.ttft_s = time.perf_counter() - job.arrival
        self.metrics.prefill_done(len(job.prompt_ids), job.started - job.arrival, job.ttft_s)
        job.emit("start")
        text = IncrementalDecoder(self.generator.tokenizer) if job.stream else None
        active = _Active(job, request, text)
        with self._cond:
            self._active.append(active)
        self._report(active)
        if request.stop_reason is not None:
            self._end(active)

    def _round(self) -> None:
        """One round for the batch: cancelled jobs leave first, then every job reports."""
        for active in list(self._active):
            if active.job.cancelled.is_set():
                self.decoder.drop(active.request)
                self._end(active, cancelled=True)
        if not self._active:
            return
        self.decoder.step()
        for active in list(self._active):
            self._report(active)
            if self.on_round is not None:
                self.on_round(active.job)
            if active.request.stop_reason is not None:
                self._end(active)

    def _report(self, active: _Active) -> None:
        """Hand the job its new tokens (text, when streaming) and the metrics its new rounds."""
        job, request = active.job, active.request
        method = job.kwargs.get("method", "caddtree")
        for stats in request.round_stats[active.rounds :]:
            self.metrics.round_done(method, stats)
        active.rounds = len(request.round_stats)
        new = request.output[active.sent :]
        active.sent = len(request.output)
        job.tokens += len(new)
        self.metrics.tokens_generated(len(new), job.output_gap() if new else None)
        if active.text is not None and new:
            piece = active.text.push(new)
            if piece:
                job.emit("text", piece)

    def _end(self, active: _Active, cancelled: bool = False) -> None:
        """The job leaves the batch: done (its result) or cancelled."""
        self._forget(active)
        job, request = active.job, active.request
        if cancelled:
            self._finish_cancelled(job)
            return
        result = request.result()
        result.text = self.generator.tokenizer.decode(result.token_ids, skip_special_tokens=True)
        self._done(job, result, active.text)

    def _forget(self, active: _Active) -> None:
        with self._cond:
            if active in self._active:
                self._active.remove(active)
