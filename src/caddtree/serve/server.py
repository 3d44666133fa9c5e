"""``caddtree serve``: load the models once, then serve them over HTTP with uvicorn.

:func:`add_arguments` declares the options on an ``argparse`` parser, :func:`main` parses them and
runs the server until Ctrl-C (or SIGTERM). Loading is the ``caddtree generate`` command's
(:func:`caddtree.arguments.load_pair`): the built-in pair without ``--target``/``--draft``, then,
for ``--method caddtree`` without ``--cost-model``, the cost model profiled once for this machine
and cached.
"""

from __future__ import annotations

import argparse
import math
import socket
import statistics
import sys
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ..arguments import add_method_arguments, add_pair_arguments, check_pair_arguments, load_pair_of
from ..util.checks import check_int
from ..util.errors import CaddtreeError, InvalidInputError
from ..util.logs import run_command, stop_on_interrupt
from .protocol import DEFAULT_MAX_REQUEST_BYTES

__all__ = ["add_arguments", "load_generator", "main"]

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
DEFAULT_MAX_QUEUE = 8
AUTO_MAX_BATCH = 8
"""The largest batch ``--max-batch auto`` considers (each slot holds a whole context's cache)."""


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Declare ``caddtree serve``'s options on ``parser`` (and return it)."""
    add_pair_arguments(parser)
    add_method_arguments(parser, per_request=True)
    _add_listening_arguments(parser)
    _add_request_defaults(parser)
    _add_refusal_and_log_arguments(parser)
    return parser


def _add_listening_arguments(parser: argparse.ArgumentParser) -> None:
    """Where the server listens, and how many requests it takes and batches."""
    parser.add_argument(
        "--host", default=DEFAULT_HOST, help=f"address to listen on (default {DEFAULT_HOST})"
    )
    parser.add_argument(
        "--port",
        type=int,
        default=DEFAULT_PORT,
        help=f"port to listen on (default {DEFAULT_PORT}; 0 picks a free one)",
    )
    parser.add_argument(
        "--max-queue",
        type=int,
        default=DEFAULT_MAX_QUEUE,
        help="requests that may wait while one generates; one more gets HTTP 503 with "
        f"Retry-After (default {DEFAULT_MAX_QUEUE})",
    )
    parser.add_argument(
        "--max-batch",
        type=_max_batch,
        default="auto",
        help="requests generated at once, each round one target forward for all of them (lean "
        "runtime; 1: one at a time). Default 'auto': the batch size whose rounds measure the most "
        f"tokens per second on this machine, up to {AUTO_MAX_BATCH} (profiled once with the batch "
        "cost model, then cached); 1 where the target runs on transformers' forward",
    )
    parser.add_argument(
        "--batch-budget",
        choices=("joint", "per-request"),
        default="joint",
        help="with --max-batch above 1, how CaDDTree requests decoding together size their "
        "trees: 'joint' (the default) chooses all of a round's trees with one budget from the "
        "server's cost model, and skips drafting while it cannot pay; 'per-request' lets each "
        "request choose as if it were alone",
    )
    parser.add_argument(
        "--max-request-bytes",
        type=int,
        default=DEFAULT_MAX_REQUEST_BYTES,
        help="the largest request body taken; a larger one gets HTTP 413 before it is read "
        f"(default {DEFAULT_MAX_REQUEST_BYTES:,}, far more than the model's context fills)",
    )


def _add_request_defaults(parser: argparse.ArgumentParser) -> None:
    """What a request that leaves a setting out gets, and what it may name."""
    parser.add_argument(
        "--max-new-tokens",
        type=int,
        default=256,
        help="max_tokens of a request that gives none (default 256; never more than the model's "
        "context has room for)",
    )
    parser.add_argument(
        "--temperature",
        type=float,
        default=1.0,
        help="temperature of a request that gives none (default 1, as OpenAI's API; 0 = greedy)",
    )
    parser.add_argument(
        "--served-model-name",
        help="the model name clients send and /v1/models lists (default: --target as given, or "
        "the built-in target's name)",
    )
    parser.add_argument(
        "--cost-model-dir",
        help="a folder of cost-model files that requests may name in their cost_model field "
        "(default: none; requests then use the server's cost model)",
    )


def _add_refusal_and_log_arguments(parser: argparse.ArgumentParser) -> None:
    """What a refused client is told, and how much the server logs."""
    parser.add_argument(
        "--retry-after",
        type=int,
        default=1,
        help="seconds a refused client is told to wait (Retry-After; default 1)",
    )
    parser.add_argument(
        "--log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug"],
        help="uvicorn's log level (default info: one access line per request)",
    )


def _check_arguments(args: argparse.Namespace) -> None:
    """Everything that needs no model, before the slow loading."""
    from ..util.checks import check_tree_budgets

    check_pair_arguments(args)
    if args.budget is not None:
        check_tree_budgets(
            "ddtree", args.budget, args.max_budget, names=("--budget", "--max-budget")
        )
    check_int("--max-budget", args.max_budget)
    check_int("--max-new-tokens", args.max_new_tokens)
    check_int("--max-queue", args.max_queue, minimum=0)
    check_int("--max-request-bytes", args.max_request_bytes)
    if args.max_batch != "auto":
        check_int("--max-batch", args.max_batch)
    check_int("--retry-after", args.retry_after, minimum=0)
    if not 0 <= args.port <= 65535:
        raise InvalidInputError(f"--port must be in 0..65535, got {args.port}")
    if not (math.isfinite(args.temperature) and 0 <= args.temperature <= 2):
        raise InvalidInputError(f"--temperature must be in [0, 2], got {args.temperature}")


def _listen(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` (before loading anything: a port in use fails fast)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        sock = socket.socket(family, kind, proto)
    except (OSError, IndexError) as exc:
        raise InvalidInputError(f"cannot listen on {host}:{port}: {exc}") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(128)  # clients that connect before uvicorn is up wait in the backlog
    except OSError as exc:
        sock.close()
        raise CaddtreeError(
            f"cannot listen on {host}:{port}: {exc.strerror or exc} (is another server running "
            "there? pick another --port)"
        ) from None
    return sock


def load_generator(args: argparse.Namespace) -> tuple[Any, str]:
    """Load the models ``args`` name as ``caddtree generate`` does
    (:func:`caddtree.arguments.load_pair`) and, for ``--method caddtree``, obtain the cost model
    once. Returns the generator and the name to serve it under."""
    from ..util.defaults import DEFAULT_TARGET_NAME

    name = args.served_model_name or (
        DEFAULT_TARGET_NAME if args.target is None else str(args.target)
    )
    return load_pair_of(args), name


def _url(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}/v1"


def _max_batch(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a whole number or 'auto', got {text!r}"
        ) from None


def _batching(gen: Any, args: argparse.Namespace) -> tuple[int, Any]:
    """(max_batch, the model that prices the joint budget's rounds). ``--max-batch auto``: the
    batch cost model's :meth:`~caddtree.engine.batch_cost.BatchCostModel.best_batch` at the
    contexts it profiled (measured once on this machine, then cached); 1 where batching cannot
    run (transformers' forward) or has no drafter to price rounds with. The batch cost model
    prices joint rounds where there is one: several requests at once, the joint budget, the
    lean runtimes and a drafter, and no ``--cost-model`` (that file prices them then, as one
    sequence's rounds)."""
    batching = gen.runtime in ("lean", "compiled") and gen.drafter is not None
    max_batch, model = args.max_batch, None
    if max_batch == "auto":
        if not batching:
            return 1, None
        model = gen.cached_batch_cost_model(AUTO_MAX_BATCH)
        contexts = model.metadata.get("context_lengths") or [256]
        max_batch = model.best_batch(int(statistics.median(contexts)))
        print(f"caddtree: --max-batch auto: {max_batch} on this machine", file=sys.stderr)
    if max_batch < 2 or args.batch_budget != "joint" or args.cost_model is not None:
        return max_batch, None
    if not batching:
        return max_batch, None
    return max_batch, model or gen.cached_batch_cost_model(max_batch)


def serve(args: argparse.Namespace) -> int:
    """Load, then serve until interrupted (``args`` from a parser given :func:`add_arguments`)."""
    import uvicorn

    from .app import build_app

    _check_arguments(args)
    sock = _listen(args.host, args.port)
    # the models are loaded (and profiled) on the thread that will generate: one OpenMP pool
    torch_thread = ThreadPoolExecutor(1, thread_name_prefix="caddtree-generate")
    try:
        gen, name = torch_thread.submit(load_generator, args).result()
        max_batch, joint = torch_thread.submit(_batching, gen, args).result()
        app = torch_thread.submit(
            build_app,
            gen,
            model_name=name,
            method=args.method,
            budget=args.budget,
            max_budget=args.max_budget,
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            max_queue=args.max_queue,
            max_batch=max_batch,
            batch_budget=args.batch_budget,
            joint_cost_model=joint,
            max_request_bytes=args.max_request_bytes,
            retry_after_s=args.retry_after,
            cost_model_dir=args.cost_model_dir,
            torch_thread=torch_thread,
            lookup=args.lookup,
        ).result()  # on the generating thread too: the batch engine allocates its cache there
        config = uvicorn.Config(
            app, log_level=args.log_level, timeout_graceful_shutdown=5, lifespan="on"
        )
        server = uvicorn.Server(config)
        print(f"caddtree: serving {name} at {_url(sock)}", file=sys.stderr, flush=True)
        with stop_on_interrupt():  # uvicorn re-raises the Ctrl-C it stopped on
            server.run(sockets=[sock])
        print("caddtree: server stopped", file=sys.stderr)
    finally:
        sock.close()
        torch_thread.shutdown(wait=False, cancel_futures=True)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``caddtree serve [options]``: returns the exit status: 0 after a clean shutdown (Ctrl-C;
    SIGTERM ends the process as uvicorn does, by the signal), 2 with a ``caddtree: error: ...``
    line for a bad option, a model that does not load or a busy port, 130 when interrupted while
    loading."""
    parser = add_arguments(
        argparse.ArgumentParser(
            prog="caddtree serve",
            description="Serve a target and its DFlash drafter with an OpenAI-compatible API "
            "(/v1/chat/completions, /v1/completions, /v1/models, /health, /metrics).",
        )
    )
    args = parser.parse_args(None if argv is None else list(argv))
    # the library's messages (model conversion, profiling) on stderr, errors as one line
    return run_command(lambda: serve(args))
