"""The FastAPI application: OpenAI's completion endpoints on one :class:`SpeculativeGenerator`.

Endpoints: ``POST /v1/chat/completions``, ``POST /v1/completions`` (both streaming, as server-sent
events, or not), ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus text).

A request is checked and its prompt tokenized on the event loop (a bad one gets its 400 at once,
without queueing), then queued for the single generation worker (:mod:`caddtree.serve.worker`). The
handler waits for the job's first event (the prefill) before answering, so an error that
``generate`` raises still becomes a proper HTTP error, even for a streaming request; a client
that goes away meanwhile cancels its job. Errors are OpenAI's ``{"error": {...}}`` bodies: 400 for
a bad request (``caddtree.util.errors.CaddtreeError`` from ``generate`` included), 404 for an unknown
model, 503 with ``Retry-After`` when the queue is full, 500 for anything unexpected; the server
stays up.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..util.checks import DEFAULT_DDTREE_BUDGET
from ..util.errors import CaddtreeError, InvalidInputError
from .metrics import ServerMetrics
from .protocol import (
    DEFAULT_MAX_REQUEST_BYTES,
    OpenAIError,
    OpenAIRequest,
    StopText,
    chunk_body,
    completion_body,
    cut_at_stop,
    error_body,
    finite,
    new_id,
    parse_request,
    usage,
)
from .worker import Engine, Job, QueueFull, ShuttingDown, finish_reason

__all__ = ["build_app"]

logger = logging.getLogger(__name__)

_POLL_S = 0.2  # how often a waiting handler checks whether its client is still there


class _ClientGone(Exception):
    """The client disconnected while its request waited."""


def _json(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(body, status_code=status, headers=headers)


def _sse(body: Any) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False, allow_nan=False)}\n\n"


def build_app(
    generator: Any,
    *,
    model_name: str,
    method: str = "caddtree",
    budget: int | None = None,
    max_budget: int = 1024,
    max_new_tokens: int = 256,
    temperature: float = 1.0,
    max_queue: int = 8,
    max_batch: int = 1,
    batch_budget: str = "joint",
    joint_cost_model: Any = None,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    retry_after_s: int = 1,
    cost_model_dir: str | os.PathLike[str] | None = None,
    on_round: Any = None,
    torch_thread: Any = None,
    lookup: bool = False,
) -> FastAPI:
    """The OpenAI-compatible app serving ``generator`` (a loaded
    :class:`~caddtree.api.SpeculativeGenerator` with a tokenizer) under the name ``model_name``.

    Defaults for requests that leave a field out: ``method``; ``budget``, ddtree's node budget
    (:data:`~caddtree.util.checks.DEFAULT_DDTREE_BUDGET` when ``None``); ``max_budget``, caddtree's
    largest tree; ``max_new_tokens`` (``max_tokens``, lowered to what the model's context has room
    for); ``temperature`` (OpenAI's default is 1); ``lookup`` (copies from the context in the
    trees of ddtree and caddtree requests).
    A caddtree request uses ``generator.cost_model`` unless it names a cost-model file: a file
    name inside ``cost_model_dir`` (requests may read no other file on the server; without a
    directory they may name none).
    ``max_batch`` requests generate at once (above 1: :class:`~caddtree.serve.batch_worker.
    BatchEngine`, one target forward per round for all of them; it needs the lean runtime), their
    CaDDTree trees sized by one joint budget (``batch_budget`` ``"joint"``; priced by
    ``joint_cost_model``, a :class:`~caddtree.engine.batch_cost.BatchCostModel`, else by
    ``generator.cost_model``) or each by its own (``"per-request"``);
    ``max_queue`` more may wait for a slot; one more gets HTTP 503 with
    ``Retry-After: retry_after_s``. ``torch_thread``: the one-thread executor that loaded the
    models, to generate on (see :class:`~caddtree.serve.worker.Engine`). A body larger than ``max_request_bytes`` gets HTTP 413 before
    it is read; JSON nested too deeply to parse gets HTTP 400. Prompts are tokenised off the event
    loop, so a long one never stalls ``/health`` or the other requests' streams. ``on_round(job)`` is a test hook, called by the worker thread
    after every round.
    """
    if getattr(generator, "tokenizer", None) is None:
        raise InvalidInputError("serving needs a generator with a tokenizer")
    proposer = getattr(generator, "proposer", None)
    positions = max(int(getattr(proposer, "block_size", 1)) - 1, 0) if proposer else 0
    metrics = ServerMetrics(model_name, positions)
    joint = (batch_budget == "joint", joint_cost_model)
    engine = _make_engine(generator, metrics, max_batch, joint, max_queue, on_round, torch_thread)
    defaults = _Defaults(
        method=method,
        budget=DEFAULT_DDTREE_BUDGET if budget is None else int(budget),
        max_budget=max_budget,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        lookup=lookup,
    )
    service = _Service(
        generator,
        engine,
        metrics,
        model_name,
        defaults,
        max_request_bytes,
        retry_after_s,
        cost_model_dir,
    )
    return _app(service)


def _app(service: _Service) -> FastAPI:
    """The FastAPI app of ``service``: its engine started and stopped with the app, its error
    handlers and routes."""
    engine = service.engine

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        try:
            yield
        finally:
            await asyncio.to_thread(engine.stop)

    app = FastAPI(title="caddtree serve", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.engine = engine
    app.state.metrics = service.metrics
    app.state.model_name = service.model_name
    _add_error_handlers(app, service)
    _add_routes(app, service)
    return app


def _make_engine(
    generator: Any,
    metrics: ServerMetrics,
    max_batch: int,
    joint: tuple[bool, Any],
    max_queue: int,
    on_round: Any,
    torch_thread: Any,
) -> Engine:
    """The generation worker: one job at a time, or a batch of ``max_batch`` (``joint``: whether
    its CaDDTree rounds take one joint budget, and the model that prices them)."""
    if max_batch > 1:
        from .batch_worker import BatchEngine

        return BatchEngine(
            generator,
            metrics,
            max_batch=max_batch,
            joint_budget=joint[0],
            joint_cost_model=joint[1],
            max_queue=max_queue,
            on_round=on_round,
            torch_thread=torch_thread,
        )
    return Engine(
        generator, metrics, max_queue=max_queue, on_round=on_round, torch_thread=torch_thread
    )


def _add_error_handlers(app: FastAPI, service: _Service) -> None:
    """OpenAI-style error bodies for every error a request can meet."""

    @app.exception_handler(OpenAIError)
    async def _openai_error(_request: Request, exc: OpenAIError) -> JSONResponse:
        return service.error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request: Request, exc: StarletteHTTPException) -> Response:
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return _json(error_body(str(exc.detail), kind), exc.status_code, exc.headers)

    @app.exception_handler(Exception)
    async def _unexpected(_request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unexpected error in a request", exc_info=exc)
        service.metrics.request_error("server_error")
        return _json(error_body(f"internal server error: {exc}", "server_error"), 500)


def _add_routes(app: FastAPI, service: _Service) -> None:
    created = int(time.time())

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await service.handle(request, "chat")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await service.handle(request, "completion")

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        card: dict[str, Any] = {
            "id": service.model_name,
            "object": "model",
            "created": created,
            "owned_by": "caddtree",
        }
        if service.context_limit is not None:
            card["max_model_len"] = service.context_limit
        return _json({"object": "list", "data": [card]})

    @app.get("/health")
    async def health() -> JSONResponse:
        engine = service.engine
        if not engine.alive:
            return _json({"status": "unavailable"}, 503)
        return _json({"status": "ok", "running": engine.running, "waiting": engine.waiting})

    @app.get("/metrics")
    async def prometheus() -> PlainTextResponse:
        engine = service.engine
        text = service.metrics.render(running=engine.running, waiting=engine.waiting)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")


@dataclass(frozen=True)
class _Defaults:
    """The server's settings for requests that leave a field out."""

    method: str
    budget: int
    max_budget: int
    max_new_tokens: int
    temperature: float
    lookup: bool = False


class _Service:
    """What the endpoints do with a request: check and tokenise it, turn it into a job for the
    engine, and answer with the job's result or stream."""

    def __init__(
        self,
        generator: Any,
        engine: Engine,
        metrics: ServerMetrics,
        model_name: str,
        defaults: _Defaults,
        max_request_bytes: int,
        retry_after_s: int,
        cost_model_dir: str | os.PathLike[str] | None,
    ) -> None:
        self.generator, self.engine, self.metrics = generator, engine, metrics
        self.model_name, self.defaults = model_name, defaults
        self.max_request_bytes, self.retry_after_s = max_request_bytes, retry_after_s
        self.context_limit = getattr(getattr(generator, "verifier", None), "max_positions", None)
        self.allowed_dir = Path(cost_model_dir).resolve() if cost_model_dir is not None else None
        self._cost_models: dict[Path, tuple[float, Any]] = {}  # path -> (mtime, model)

    # ---- errors ---------------------------------------------------------------------------------

    def error_response(self, exc: OpenAIError) -> JSONResponse:
        if exc.status == 503 and exc.code == "queue_full":
            self.metrics.request_rejected()
        else:
            self.metrics.request_error("invalid_request" if exc.status < 500 else "server_error")
        return _json(exc.body(), exc.status, exc.headers)

    # ---- turning a request into a job ---------------------------------------------------------------

    def cost_model_file(self, name: str) -> Any:
        from ..core.cost import load_cost_model

        allowed = self.allowed_dir
        if allowed is None:
            raise OpenAIError(
                "this server reads no cost-model files named by requests; its operator can allow "
                "the ones in a folder with --cost-model-dir DIR",
                param="cost_model",
            )
        path = (allowed / name).resolve()
        if not path.is_relative_to(allowed):
            raise OpenAIError(
                f"cost_model {name!r} is not a file in the server's cost-model folder; give the "
                "name of one of its files",
                param="cost_model",
            )
        try:
            mtime = os.stat(path).st_mtime
        except OSError as exc:
            raise OpenAIError(
                f"cost_model {name!r}: {exc.strerror or exc}", param="cost_model"
            ) from None
        cached = self._cost_models.get(path)
        if cached is None or cached[0] != mtime:
            try:
                cached = (mtime, load_cost_model(path))
            except CaddtreeError as exc:
                raise OpenAIError(f"cost_model: {exc}", param="cost_model") from None
            self._cost_models[path] = cached
        return cached[1]

    def encode(self, req: OpenAIRequest) -> list[int]:
        extra = {"chat_template_kwargs": req.chat_template_kwargs or None}
        field = "messages" if req.kind == "chat" else "prompt"
        try:
            if req.kind == "chat":
                ids = self.generator.encode(req.prompt, chat=True, **extra)
            else:
                ids = self.generator.encode(req.prompt, chat=False)
        except CaddtreeError as exc:
            raise OpenAIError(str(exc), param=field) from None
        except Exception as exc:  # noqa: BLE001 - e.g. a chat template that rejects the roles
            raise OpenAIError(f"cannot tokenize the {field}: {exc}", param=field) from None
        if not ids:
            raise OpenAIError("the prompt is empty", param="prompt")
        return [int(t) for t in ids]

    def max_tokens(self, req: OpenAIRequest, n_prompt: int) -> int:
        """The request's ``max_tokens``, defaulted, and refused where the context has no room."""
        limit, max_tokens = self.context_limit, req.max_tokens
        if limit is None:
            return self.defaults.max_new_tokens if max_tokens is None else max_tokens
        room = limit - n_prompt
        if room <= 0:
            raise OpenAIError(
                f"the prompt has {n_prompt} tokens but the model's context holds {limit}; "
                "shorten it",
                param="messages" if req.kind == "chat" else "prompt",
                code="context_length_exceeded",
            )
        if max_tokens is None:
            return min(self.defaults.max_new_tokens, room)
        if max_tokens > room:
            raise OpenAIError(
                f"the model's context holds {limit} tokens, but {n_prompt} prompt tokens plus "
                f"max_tokens {max_tokens} need {n_prompt + max_tokens}; lower max_tokens to at "
                f"most {room}",
                param="max_tokens",
                code="context_length_exceeded",
            )
        return max_tokens

    def method_kwargs(self, req: OpenAIRequest, run: str) -> dict[str, Any]:
        """The settings of the request's method: DDTree's budget, CaDDTree's cost model, lookup."""
        lookup = self.defaults.lookup if req.lookup is None else req.lookup
        if req.lookup and run not in ("ddtree", "caddtree"):  # the server's default method
            raise OpenAIError(f"lookup takes ddtree or caddtree, not {run!r}", param="lookup")
        if run == "ddtree":
            budget = req.budget if req.budget is not None else self.defaults.budget
            return {"budget": budget, "lookup": lookup}
        if run != "caddtree":
            if req.max_budget is not None:
                raise OpenAIError(
                    f"max_budget only applies to method 'caddtree', not {run!r}",
                    param="max_budget",
                )
            return {}
        max_budget = req.max_budget if req.max_budget is not None else self.defaults.max_budget
        kwargs: dict[str, Any] = {"max_budget": max_budget, "lookup": lookup}
        if req.cost_model is not None:
            kwargs["cost_model"] = self.cost_model_file(req.cost_model)
        elif getattr(self.generator, "cost_model", None) is None:
            raise OpenAIError(
                "method 'caddtree' needs a cost model: this server has none (start it with "
                "--method caddtree or --cost-model), so give cost_model (a file on the server) "
                "or another method",
                param="method",
            )
        return kwargs

    def generate_kwargs(self, req: OpenAIRequest, n_prompt: int) -> dict[str, Any]:
        run = req.method or self.defaults.method
        temperature = self.defaults.temperature if req.temperature is None else req.temperature
        kwargs: dict[str, Any] = {
            "method": run,
            "max_new_tokens": self.max_tokens(req, n_prompt),
            "temperature": temperature,
            "top_p": req.top_p,
            "seed": req.seed,
            **self.method_kwargs(req, run),
        }
        if req.ignore_eos:
            kwargs["stop_token_ids"] = ()
        kwargs.update(
            top_k=req.top_k,
            min_p=req.min_p,
            repetition_penalty=req.repetition_penalty,
            stop=req.stop or None,
        )
        return kwargs

    async def read_body(self, request: Request) -> bytes:
        """The request body, refused with 413 as soon as it is known to pass the limit."""
        limit = self.max_request_bytes
        declared = request.headers.get("content-length", "")
        too_large = OpenAIError(
            f"the request body is larger than this server takes ({limit:,} bytes; "
            "caddtree serve --max-request-bytes)",
            status=413,
            code="request_too_large",
        )
        if declared.isdigit() and int(declared) > limit:
            raise too_large
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_large
            chunks.append(chunk)
        return b"".join(chunks)

    async def parse(self, request: Request, kind: str) -> OpenAIRequest:
        """The request's body, checked (400 / 404 / 413 otherwise)."""
        raw = await self.read_body(request)
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise OpenAIError(f"the request body is not valid JSON: {exc}") from None
        except RecursionError:
            raise OpenAIError(
                "the request body is not valid JSON here: it nests arrays or objects too deeply"
            ) from None
        req = parse_request(body, kind)
        if req.model is not None and req.model != self.model_name:
            raise OpenAIError(
                f"the model {req.model!r} does not exist; this server serves {self.model_name!r}",
                status=404,
                param="model",
                code="model_not_found",
            )
        return req

    def submit(self, job: Job) -> None:
        """Queue ``job`` (503 when the queue is full)."""
        try:
            self.engine.submit(job)
        except QueueFull:
            raise OpenAIError(
                f"the server is busy: {self.engine.max_queue} requests are waiting already; "
                f"retry after {self.retry_after_s} s",
                status=503,
                code="queue_full",
                headers={"Retry-After": str(self.retry_after_s)},
            ) from None
        except ShuttingDown as exc:
            raise _generate_error(exc) from None

    # ---- answering ----------------------------------------------------------------------------------

    async def next_event(self, job: Job, request: Request) -> tuple[str, Any]:
        """The job's next event; cancels the job if the client goes away meanwhile."""
        get = asyncio.ensure_future(job.events.get())
        try:
            while True:
                done, _ = await asyncio.wait({get}, timeout=_POLL_S)
                if done:
                    return get.result()
                if await request.is_disconnected():
                    self.engine.cancel(job)
                    raise _ClientGone
        finally:
            if not get.done():
                get.cancel()

    async def until(self, job: Job, request: Request, ends: tuple[str, ...]) -> tuple[str, Any]:
        """The job's events up to one of ``ends`` (or an error or cancellation), that one;
        ``("gone", None)`` if the client went away."""
        try:
            event = await self.next_event(job, request)
            while event[0] not in (*ends, "error", "cancelled"):
                event = await self.next_event(job, request)
        except _ClientGone:
            return ("gone", None)
        except asyncio.CancelledError:
            self.engine.cancel(job)
            raise
        if event[0] == "error":
            raise _generate_error(event[1])
        return event

    async def handle(self, request: Request, kind: str) -> Response:
        req = await self.parse(request, kind)
        prompt_ids = await asyncio.to_thread(self.encode, req)  # a long prompt takes a while
        job = Job(prompt_ids, self.generate_kwargs(req, len(prompt_ids)), stream=req.stream)
        self.submit(job)
        first = await self.until(job, request, ends=("start", "text", "done"))
        if first[0] in ("gone", "cancelled"):
            return Response(status_code=499)
        request_id = new_id(kind)
        if req.stream:
            return _JobStream(self.stream(req, job, first, request_id), self.engine, job)
        event = first if first[0] == "done" else await self.until(job, request, ends=("done",))
        if event[0] in ("gone", "cancelled"):
            return Response(status_code=499)
        result = event[1]
        text, _ = cut_at_stop(result.text, req.stop)
        return _json(
            completion_body(
                kind,
                request_id,
                self.model_name,
                text,
                finish_reason(result.stats.stop_reason),
                usage(len(result.prompt_ids), len(result.token_ids)),
                _stats(result, job),
            )
        )

    async def stream(
        self, req: OpenAIRequest, job: Job, first: tuple[str, Any], request_id: str
    ) -> AsyncIterator[str]:
        """The server-sent events of a streaming request, from its job's events."""
        chunks = _Chunks(req, request_id, self.model_name)
        stops = StopText(req.stop)
        try:
            if req.kind == "chat":
                yield chunks.text("", role=True)
            event = first
            while True:
                if event[0] == "text":
                    piece = stops.push(event[1])
                    if piece:
                        yield chunks.text(piece)
                elif event[0] == "done":
                    for line in chunks.final(event[1], stops, job):
                        yield line
                    break
                elif event[0] == "error":
                    err = _generate_error(event[1])
                    kind = "invalid_request" if err.status < 500 else "server_error"
                    self.metrics.request_error(kind)
                    yield _sse(err.body())
                    break
                elif event[0] == "cancelled":
                    break
                event = await job.events.get()
            yield "data: [DONE]\n\n"
        finally:
            if not job.finished:
                self.engine.cancel(job)


class _Chunks:
    """The server-sent-event chunks of one streaming request."""

    def __init__(self, req: OpenAIRequest, request_id: str, model_name: str) -> None:
        self.kind, self.request_id, self.model_name = req.kind, request_id, model_name
        self.created = int(time.time())
        self.include_usage = req.include_usage

    def body(self, **fields: Any) -> dict[str, Any]:
        return chunk_body(
            self.kind,
            self.request_id,
            self.created,
            self.model_name,
            include_usage=self.include_usage,
            **fields,
        )

    def text(self, piece: str, **fields: Any) -> str:
        return _sse(self.body(text=piece, **fields))

    def final(self, result: Any, stops: StopText, job: Job) -> list[str]:
        """The rest of the text, the finishing chunk (with caddtree's statistics) and, when
        asked for, the usage chunk."""
        lines = []
        rest = stops.finish(result.text)
        if rest:
            lines.append(self.text(rest))
        last = self.body(
            text="" if self.kind == "completion" else None,
            finish=finish_reason(result.stats.stop_reason),
        )
        last["caddtree"] = finite(_stats(result, job))
        lines.append(_sse(last))
        if self.include_usage:
            lines.append(
                _sse(
                    {
                        "id": self.request_id,
                        "object": last["object"],
                        "created": self.created,
                        "model": self.model_name,
                        "choices": [],
                        "usage": usage(len(result.prompt_ids), len(result.token_ids)),
                    }
                )
            )
        return lines


def _stats(result: Any, job: Job) -> dict[str, Any]:
    """caddtree's statistics of a finished job, its time in the queue included."""
    return dict(result.stats.to_dict(), queue_time_s=(job.started or 0.0) - job.arrival)


def _generate_error(exc: BaseException) -> OpenAIError:
    """The HTTP error for an exception the worker got from ``generate``."""
    if isinstance(exc, ShuttingDown):
        return OpenAIError(str(exc), status=503, code="shutting_down")
    if isinstance(exc, CaddtreeError):
        return OpenAIError(str(exc), status=400)
    return OpenAIError(f"internal server error: {exc}", status=500, code="internal_error")


class _JobStream(StreamingResponse):
    """A server-sent-event stream that cancels its job however the response ends (the client
    disconnecting included)."""

    def __init__(self, content: AsyncIterator[str], engine: Engine, job: Job):
        super().__init__(
            content,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self._engine = engine
        self._job = job

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if not self._job.finished:
                self._engine.cancel(self._job)
