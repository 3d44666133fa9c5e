"""One generation at a time: a bounded queue of jobs and the worker thread that runs them.

The target's and drafter's KV caches live in the :class:`~caddtree.api.SpeculativeGenerator`, so
it can run one generation at a time; the worker thread is the only caller of its ``generate``.
Requests wait in a queue of at most ``max_queue`` jobs (the running one not counted); a request
that finds it full is refused at once (:class:`QueueFull`, HTTP 503) rather than left to time out.

A job talks back to its request through an asyncio queue on the server's event loop: the worker
hands it events with ``loop.call_soon_threadsafe``:

* ``("start", None)`` once the prompt is prefilled and the first token chosen;
* ``("text", str)`` the new text of a round (streaming jobs only; decoded with
  :class:`~caddtree.util.streaming.IncrementalDecoder`, so no character is split);
* then exactly one of ``("done", GenerationResult)``, ``("error", exception)`` or
  ``("cancelled", None)``.

Cancelling (the client went away): :meth:`Job.cancel` sets a flag; a queued job is dropped from
the queue, a running one ends at its next round, when the ``generate`` callback sees the flag and
raises :class:`_Cancelled`, which the worker catches (``generate`` resets the caches in its
``finally``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field
from typing import Any

from ..util.streaming import IncrementalDecoder
from .metrics import ServerMetrics

__all__ = ["Engine", "Job", "QueueFull", "finish_reason"]

logger = logging.getLogger(__name__)


class QueueFull(Exception):
    """The queue holds ``max_queue`` jobs already."""


class _Cancelled(Exception):
    """Raised from the ``generate`` callback to end a cancelled job's generation."""


class ShuttingDown(Exception):
    """The server is stopping; the job was never run."""


def finish_reason(stop_reason: str) -> str:
    """OpenAI's ``finish_reason`` for a :class:`~caddtree.engine.decoding.GenerationStats` ``stop_reason``:
    ``length`` when ``max_new_tokens`` ended it, ``stop`` for a stop token or string."""
    return "length" if stop_reason == "max_new_tokens" else "stop"


@dataclass
class Job:
    """One request's generation: the arguments of ``generate`` and the way back to the request.

    ``kwargs`` go to ``generator.generate(prompt_ids, **kwargs)`` (the worker adds ``callback``).
    Create it on the event loop that will read :attr:`events`.
    """

    prompt_ids: list[int]
    kwargs: dict[str, Any]
    stream: bool = False
    arrival: float = field(default_factory=time.perf_counter)
    loop: asyncio.AbstractEventLoop = field(default_factory=asyncio.get_running_loop)
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    started: float | None = None  # when the worker took it
    ttft_s: float | None = None  # arrival to first token
    tokens: int = 0  # tokens generated so far
    last_output: float | None = None  # when its newest tokens were generated

    def output_gap(self) -> float | None:
        """Seconds since this job's previous tokens (``None`` for its first), and now is the
        time of its newest ones."""
        now = time.perf_counter()
        gap = None if self.last_output is None else now - self.last_output
        self.last_output = now
        return gap

    finished: bool = False  # a terminal event was sent

    def cancel(self) -> None:
        """Ask for the generation to end (at its next round, or before it starts)."""
        self.cancelled.set()

    def emit(self, kind: str, value: Any = None) -> None:
        """Hand an event to the request (from any thread)."""
        if kind in ("done", "error", "cancelled"):
            self.finished = True
        # a closed event loop raises RuntimeError: nobody is listening any more
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))


class _Submitted:
    """The worker loop running on an executor's thread, seen as a thread (alive, join)."""

    def __init__(self, future: Future) -> None:
        self.future = future

    def is_alive(self) -> bool:
        return not self.future.done()

    def join(self, timeout: float | None = None) -> None:
        with contextlib.suppress(Exception):
            self.future.exception(timeout)


class Engine:
    """Runs :class:`Job` s one at a time on a worker thread, in arrival order.

    ``generator`` is a :class:`~caddtree.api.SpeculativeGenerator` (or anything with its
    ``generate`` and ``tokenizer``). ``on_round`` is a test hook called after the callback's own
    work every round, from the worker thread. ``torch_thread``: a one-thread executor to run the
    worker loop on instead of a thread of its own; give the one that loaded the models. On a
    CPU, torch's OpenMP threads spin between operations only while no more threads use OpenMP
    than there are cores; a model loaded (or profiled) on one thread and run on another keeps two
    thread pools, and every generation then runs markedly slower (``benchmarks/serve_load.py``
    shows it).
    """

    def __init__(
        self,
        generator: Any,
        metrics: ServerMetrics,
        *,
        max_queue: int = 8,
        on_round: Callable[[Job], Any] | None = None,
        torch_thread: Executor | None = None,
    ):
        self.generator = generator
        self.torch_thread = torch_thread
        self.metrics = metrics
        self.max_queue = int(max_queue)
        self.on_round = on_round
        self._pending: deque[Job] = deque()
        self._cond = threading.Condition()
        self._running: Job | None = None
        self._stopping = False
        self._thread: threading.Thread | None = None

    # ---- state ----------------------------------------------------------------------------------

    @property
    def waiting(self) -> int:
        with self._cond:
            return len(self._pending)

    @property
    def running(self) -> int:
        with self._cond:
            return self._busy()

    def _busy(self) -> int:
        """Jobs generating now (called holding the lock)."""
        return 0 if self._running is None else 1

    def _full(self) -> bool:
        """Whether another job would pass the queue bound (called holding the lock): one
        generating, ``max_queue`` waiting."""
        return len(self._pending) + min(self._busy(), 1) > self.max_queue

    def _cancel_running(self) -> None:
        """Ask the generating jobs to end (called holding the lock)."""
        if self._running is not None:
            self._running.cancel()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    # ---- life cycle -------------------------------------------------------------------------------

    def start(self) -> None:
        with self._cond:
            if self._thread is not None and self._thread.is_alive():
                return
            self._stopping = False
            if self.torch_thread is not None:
                self._thread = _Submitted(self.torch_thread.submit(self._work))
            else:
                self._thread = threading.Thread(
                    target=self._work, name="caddtree-generate", daemon=True
                )
                self._thread.start()

    def stop(self, timeout: float | None = 10.0) -> None:
        """Cancel the running job, fail the queued ones, and end the worker thread."""
        with self._cond:
            self._stopping = True
            pending = list(self._pending)
            self._pending.clear()
            self._cancel_running()
            self._cond.notify_all()
        for job in pending:
            job.emit("error", ShuttingDown("the server is shutting down"))
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    # ---- requests ---------------------------------------------------------------------------------

    def submit(self, job: Job) -> None:
        """Queue ``job``; :class:`QueueFull` when ``max_queue`` jobs wait already (behind a running
        one, or for the worker to take the first of them)."""
        with self._cond:
            if self._stopping:
                raise ShuttingDown("the server is shutting down")
            if self._full():
                raise QueueFull(f"{len(self._pending)} requests are queued already")
            self._pending.append(job)
            self._cond.notify()

    def cancel(self, job: Job) -> None:
        """Cancel ``job``: dropped at once when still queued, else ended at its next round."""
        job.cancel()
        with self._cond:
            try:
                self._pending.remove(job)
            except ValueError:
                return  # running, or over
        self._finish_cancelled(job)

    def _finish_cancelled(self, job: Job) -> None:
        self.metrics.request_finished("abort", time.perf_counter() - job.arrival)
        job.emit("cancelled")

    # ---- the worker ---------------------------------------------------------------------------------

    def _work(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._stopping:
                    self._cond.wait()
                if self._stopping:
                    return
                job = self._pending.popleft()
                self._running = job
            try:
                if job.cancelled.is_set():
                    self._finish_cancelled(job)
                else:
                    self._run(job)
            except BaseException:  # noqa: BLE001 - the worker must outlive any one job
                logger.exception("the generation worker failed on a request")
                if not job.finished:
                    job.emit("error", RuntimeError("internal error in the generation worker"))
            finally:
                with self._cond:
                    self._running = None

    def _run(self, job: Job) -> None:
        job.started = time.perf_counter()
        decoder = IncrementalDecoder(self.generator.tokenizer) if job.stream else None
        method = job.kwargs.get("method", "caddtree")

        def callback(round_stats: Any, new_tokens: list[int]) -> None:
            if job.cancelled.is_set():
                raise _Cancelled
            job.tokens += len(new_tokens)
            self.metrics.tokens_generated(len(new_tokens), job.output_gap())
            if round_stats is None:  # the prefill
                now = time.perf_counter()
                job.ttft_s = now - job.arrival
                self.metrics.prefill_done(
                    len(job.prompt_ids), job.started - job.arrival, job.ttft_s
                )
                job.emit("start")
            else:
                self.metrics.round_done(method, round_stats)
            if decoder is not None:
                piece = decoder.push(new_tokens)
                if piece:
                    job.emit("text", piece)
            if self.on_round is not None:
                self.on_round(job)

        try:
            result = self.generator.generate(job.prompt_ids, callback=callback, **job.kwargs)
        except _Cancelled:
            self._finish_cancelled(job)
            return
        except Exception as exc:  # noqa: BLE001 - reported to the request, the server goes on
            from ..util.errors import CaddtreeError

            if not isinstance(exc, CaddtreeError):
                logger.exception("generation failed")
            job.emit("error", exc)
            return
        self._done(job, result, decoder)

    def _done(self, job: Job, result: Any, text: IncrementalDecoder | None) -> None:
        """Hand ``job`` the rest of its streamed text and its result; count it as finished."""
        if text is not None:
            with contextlib.suppress(Exception):
                piece = text.flush()
                if piece:
                    job.emit("text", piece)
        stats = result.stats
        self.metrics.request_finished(
            finish_reason(stats.stop_reason),
            time.perf_counter() - job.arrival,
            new_tokens=stats.new_tokens,
            wall_s=stats.wall_s,
            prefill_s=stats.prefill_s,
        )
        job.emit("done", result)
