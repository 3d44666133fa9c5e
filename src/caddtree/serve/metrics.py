"""The server's counters, gauges and histograms, written out in the Prometheus text format.

Names follow vLLM's where vLLM has the quantity (``vllm:prompt_tokens_total`` becomes
``caddtree:prompt_tokens_total``), so dashboards and scrapers written for vLLM need only the prefix
changed; the tree-specific ones (mean tree budget, decode speed) are caddtree's own. Every sample
carries the ``model_name`` label, as vLLM's do. Speculative-decoding terms:

* a *draft* is one round in which the drafter ran (every round of dflash, ddtree and caddtree but
  the last one of a generation that has one token left to make; AR rounds have none);
* its *draft tokens* are the tree's nodes (the chain's length for dflash), its *accepted tokens*
  the nodes on the accepted path, at depths 1..k, counted per *position* 0..k-1 as vLLM does.

The round and draft counters, and the acceptance gauges made of them, carry a ``method`` label
(``ar``, ``dflash``, ``ddtree``, ``caddtree``), every method shown from the start at 0.
*Inter-token latency* is the time between two successive outputs of one request (one sample per
round that gave it tokens: a tree round that commits three tokens is one gap, as in vLLM);
*time per output token* is, per completed request, its decoding time after the first token over
its tokens after the first.

Plain Python, no web framework: the worker thread reports into a :class:`ServerMetrics` and the
``/metrics`` endpoint calls :meth:`ServerMetrics.render`.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterable, Sequence
from typing import Any

from ..util.checks import METHODS

__all__ = ["PREFIX", "FINISH_REASONS", "Histogram", "ServerMetrics"]

PREFIX = "caddtree:"
FINISH_REASONS = ("stop", "length", "abort")
ERROR_KINDS = ("invalid_request", "server_error")

# Seconds. Like vLLM's, from a millisecond up to minutes: a CPU target takes tens of milliseconds a
# forward, a long answer from a queued request tens of seconds.
LATENCY_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0,
)  # fmt: skip


def _escape_label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def _number(value: float) -> str:
    """A sample value as the text format writes it (``NaN``, ``+Inf``, integers without ``.0``)."""
    value = float(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if value.is_integer() and abs(value) < 2**53:
        return str(int(value))
    return repr(value)


class Histogram:
    """Cumulative buckets, a sum and a count, as a Prometheus histogram."""

    def __init__(self, buckets: Sequence[float] = LATENCY_BUCKETS):
        self.buckets = tuple(sorted(float(b) for b in buckets))
        self.counts = [0] * len(self.buckets)  # per bucket, not cumulative
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        value = float(value)
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[i] += 1
                break
        self.sum += value
        self.count += 1

    def samples(self, name: str, labels: str) -> Iterable[str]:
        running = 0
        for bound, count in zip(self.buckets, self.counts):
            running += count
            yield f'{name}_bucket{{{labels},le="{_number(bound)}"}} {running}'
        yield f'{name}_bucket{{{labels},le="+Inf"}} {self.count}'
        yield f"{name}_sum{{{labels}}} {_number(self.sum)}"
        yield f"{name}_count{{{labels}}} {self.count}"


class ServerMetrics:
    """Everything ``/metrics`` shows; thread-safe (the worker thread writes, the server reads).

    ``positions`` is the number of draft positions (the drafter's block size minus one; 0 without
    a drafter): their per-position counters are shown from the start, at 0.
    """

    def __init__(self, model_name: str, positions: int = 0):
        self.model_name = model_name
        self._lock = threading.Lock()
        self.success = dict.fromkeys(FINISH_REASONS, 0)
        self.errors = dict.fromkeys(ERROR_KINDS, 0)
        self.rejected = 0
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.positions = max(int(positions), 0)
        self.methods = {method: _MethodCounts(self.positions) for method in METHODS}
        self.decode_tokens = 0
        self.decode_s = 0.0
        self.ttft = Histogram()
        self.e2e = Histogram()
        self.queue_time = Histogram()
        self.itl = Histogram()
        self.tpot = Histogram()

    # ---- what the worker and the endpoints report ---------------------------------------------

    def request_rejected(self) -> None:
        """A request found the queue full (HTTP 503)."""
        with self._lock:
            self.rejected += 1

    def request_error(self, kind: str) -> None:
        """A request ended in an error response: ``invalid_request`` (4xx) or ``server_error``."""
        with self._lock:
            self.errors[kind] = self.errors.get(kind, 0) + 1

    def prefill_done(self, prompt_tokens: int, queue_s: float, ttft_s: float) -> None:
        """A request's prompt was prefilled and its first token chosen."""
        with self._lock:
            self.prompt_tokens += int(prompt_tokens)
            self.queue_time.observe(queue_s)
            self.ttft.observe(ttft_s)

    def tokens_generated(self, count: int, gap_s: float | None = None) -> None:
        """``count`` tokens reached a request, ``gap_s`` after its previous ones (``None``: its
        first, which the time to first token measures)."""
        with self._lock:
            self.generation_tokens += int(count)
            if gap_s is not None and count:
                self.itl.observe(gap_s)

    def round_done(self, method: str, stats: Any) -> None:
        """One verification round (a :class:`~caddtree.engine.decoding.RoundStats`) of ``method``."""
        with self._lock:
            counts = self.methods.setdefault(method, _MethodCounts(self.positions))
            counts.rounds += 1
            confidence = getattr(stats, "confidence", math.nan)
            drafted = method != "ar" and (
                stats.budget > 0 or not (isinstance(confidence, float) and math.isnan(confidence))
            )
            if drafted:
                counts.add_draft(int(stats.budget), int(stats.accepted))
                counts.copied_tokens += int(getattr(stats, "copied", 0))
                counts.copied_accepted_tokens += int(getattr(stats, "copied_accepted", 0))

    def request_finished(
        self,
        finish_reason: str,
        e2e_s: float,
        new_tokens: int = 0,
        wall_s: float = 0.0,
        prefill_s: float = 0.0,
    ) -> None:
        """A request ended: ``stop`` / ``length`` (completed; its decode speed is counted) or
        ``abort`` (its client went away)."""
        with self._lock:
            self.success[finish_reason] = self.success.get(finish_reason, 0) + 1
            self.e2e.observe(e2e_s)
            if finish_reason != "abort" and new_tokens > 1 and wall_s > prefill_s:
                self.decode_tokens += int(new_tokens) - 1
                self.decode_s += float(wall_s) - float(prefill_s)
                self.tpot.observe((float(wall_s) - float(prefill_s)) / (int(new_tokens) - 1))

    # ---- the exposition -----------------------------------------------------------------------

    def _render_methods(self, family: Any, sample: Any, ratio: Any) -> None:
        """The round and draft counters and the acceptance gauges, one sample per method."""
        counters = (
            (
                "num_rounds_total",
                "rounds",
                "Verification rounds (target forward passes after the prefill).",
            ),
            (
                "spec_decode_num_drafts_total",
                "drafts",
                "Rounds with a draft: from the drafter (dflash, ddtree, caddtree) or copied from "
                "the context (lookup).",
            ),
            (
                "spec_decode_num_draft_tokens_total",
                "draft_tokens",
                "Draft tokens verified: the nodes of every draft tree (the chain for dflash).",
            ),
            (
                "spec_decode_num_accepted_tokens_total",
                "accepted_tokens",
                "Draft tokens accepted by the target (the accepted path; bonus tokens excluded).",
            ),
            (
                "copied_draft_tokens_total",
                "copied_tokens",
                "Draft tokens copied from the context (lookup): tree nodes whose estimate was a "
                "copy's.",
            ),
            (
                "copied_accepted_tokens_total",
                "copied_accepted_tokens",
                "Accepted draft tokens that were copied from the context (lookup); divide by the "
                "tokens committed in rounds for their share of the acceptance length.",
            ),
        )
        for metric, field, help_text in counters:
            family(metric, "counter", help_text)
            for method, counts in self.methods.items():
                sample(getattr(counts, field), f'method="{_escape_label(method)}"')
        family(
            "spec_decode_num_accepted_tokens_per_pos_total",
            "counter",
            "Drafts whose accepted path reached draft position `position` (0 = the first drafted "
            "token, at tree depth 1); divide by spec_decode_num_drafts_total for the per-position "
            "acceptance rate.",
        )
        for method, counts in self.methods.items():
            for pos, count in enumerate(counts.accepted_per_pos):
                sample(count, f'method="{_escape_label(method)}",position="{pos}"')
        gauges = (
            (
                "mean_acceptance_length",
                "Tokens committed per draft, bonus token included: 1 + "
                "accepted / drafts, since start (NaN before the first draft).",
                lambda c: 1 + ratio(c.accepted_tokens, c.drafts) if c.drafts else math.nan,
            ),
            (
                "draft_acceptance_rate",
                "Accepted draft tokens / draft tokens, since start: the "
                "share of tree nodes the target accepted (NaN before the first draft).",
                lambda c: ratio(c.accepted_tokens, c.draft_tokens),
            ),
            (
                "mean_tree_budget",
                "Mean draft-tree size (nodes verified per draft), since start "
                "(NaN before the first draft).",
                lambda c: ratio(c.draft_tokens, c.drafts),
            ),
        )
        for metric, help_text, value in gauges:
            family(metric, "gauge", help_text)
            for method, counts in self.methods.items():
                sample(value(counts), f'method="{_escape_label(method)}"')

    def _histograms(self) -> list[tuple[str, Histogram, str]]:
        """The latency histograms: (metric, histogram, help text)."""
        return [
            (
                "time_to_first_token_seconds",
                self.ttft,
                "Time from the request's arrival (queue time included) to its first token.",
            ),
            (
                "e2e_request_latency_seconds",
                self.e2e,
                "Time from the request's arrival to the end of its generation.",
            ),
            (
                "request_queue_time_seconds",
                self.queue_time,
                "Time a request waited in the queue before its generation started.",
            ),
            (
                "inter_token_latency_seconds",
                self.itl,
                "Time between two successive outputs of a request (one sample per round that "
                "gave it tokens).",
            ),
            (
                "request_time_per_output_token_seconds",
                self.tpot,
                "Per completed request: decoding time after the first token over its tokens "
                "after the first.",
            ),
        ]

    def render(self, *, running: int, waiting: int) -> str:
        """The Prometheus text exposition (format 0.0.4) of every metric."""
        lines: list[str] = []
        model = f'model_name="{_escape_label(self.model_name)}"'
        name = ""

        def family(metric: str, kind: str, help_text: str) -> None:
            nonlocal name
            name = PREFIX + metric
            lines.append(f"# HELP {name} {_escape_help(help_text)}")
            lines.append(f"# TYPE {name} {kind}")

        def sample(value: float, extra: str = "") -> None:
            labels = model + ("," + extra if extra else "")
            lines.append(f"{name}{{{labels}}} {_number(value)}")

        def ratio(num: float, den: float) -> float:
            return num / den if den else math.nan

        with self._lock:
            family(
                "num_requests_running",
                "gauge",
                "Requests being generated now: the running batch (at most --max-batch).",
            )
            sample(running)
            family(
                "num_requests_waiting",
                "gauge",
                "Requests queued for the generation worker (bounded by --max-queue).",
            )
            sample(waiting)
            family(
                "request_success_total",
                "counter",
                "Requests finished, by finish reason: stop (a stop token or string), length "
                "(max_tokens reached) or abort (the client disconnected; generation was cancelled).",
            )
            for reason, count in self.success.items():
                sample(count, f'finished_reason="{_escape_label(reason)}"')
            family(
                "num_requests_rejected_total",
                "counter",
                "Requests refused with HTTP 503 because the queue was full.",
            )
            sample(self.rejected)
            family(
                "request_errors_total",
                "counter",
                "Requests answered with an error: invalid_request (HTTP 4xx) or server_error "
                "(HTTP 5xx, queue-full refusals excluded).",
            )
            for kind, count in self.errors.items():
                sample(count, f'type="{_escape_label(kind)}"')
            family("prompt_tokens_total", "counter", "Prompt tokens prefilled.")
            sample(self.prompt_tokens)
            family(
                "generation_tokens_total",
                "counter",
                "Tokens generated, those of cancelled requests included.",
            )
            sample(self.generation_tokens)
            self._render_methods(family, sample, ratio)
            family(
                "decode_tokens_per_second",
                "gauge",
                "Decode speed of completed requests since start: tokens after the first one, over "
                "the generation time after the prefill (NaN before the first such request).",
            )
            sample(ratio(self.decode_tokens, self.decode_s))
            for metric, hist, help_text in self._histograms():
                family(metric, "histogram", help_text)
                lines.extend(hist.samples(name, model))
        return "\n".join(lines) + "\n"


class _MethodCounts:
    """The round and draft counters of one method."""

    def __init__(self, positions: int) -> None:
        self.rounds = self.drafts = self.draft_tokens = self.accepted_tokens = 0
        self.copied_tokens = self.copied_accepted_tokens = 0  # nodes copied from the context
        self.accepted_per_pos = [0] * positions

    def add_draft(self, draft_tokens: int, accepted: int) -> None:
        self.drafts += 1
        self.draft_tokens += draft_tokens
        self.accepted_tokens += accepted
        if accepted > len(self.accepted_per_pos):
            self.accepted_per_pos.extend([0] * (accepted - len(self.accepted_per_pos)))
        for pos in range(accepted):
            self.accepted_per_pos[pos] += 1
