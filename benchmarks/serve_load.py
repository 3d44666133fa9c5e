"""The server under load: streamed chat requests from the ``openai`` client at several concurrencies.

    python benchmarks/serve_load.py [--max-batch 1 8] [--concurrency 1 8] [--methods ar caddtree]
                                    [--requests 16] [--max-tokens 64] [--runtime auto]
                                    [--dtype bfloat16]

For each ``--max-batch`` it starts ``caddtree serve`` on the built-in pair (bfloat16, on
``--runtime``, default ``auto``) on a free localhost port, as a process of its own (so the clients' threads here do not
share its interpreter), and for each method and concurrency C sends
``--requests`` streamed chat requests (temperature 0, ``max_tokens`` each, EOS ignored so every
request makes the same number of tokens), C at a time, with the real ``openai`` client. It prints
the aggregate output tokens per second (all tokens over the wall time of the level), the time to
first token (median and 95th percentile) and the median inter-token latency of the streamed
chunks. An untimed warm-up request of each method comes first. It also says, per method, how
many requests' texts at each concurrency equal the same prompt's text at the first concurrency
(a request's output must not depend on the others: in float32, ``--dtype float32``, all of them).
"""

from __future__ import annotations

import argparse
import json
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai

from chat_prompts import PROMPTS


class Served:
    """``caddtree serve`` on a free localhost port, as a child process."""

    def __init__(self, args: list[str]):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        command = [sys.executable, "-m", "caddtree.cli", "serve", "--port", str(port), *args]
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self.base = f"http://127.0.0.1:{port}/v1"
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise SystemExit(f"caddtree serve exited: {self.process.stderr.read().decode()}")
            try:
                with urllib.request.urlopen(self.base + "/models", timeout=2) as reply:
                    self.model = json.loads(reply.read())["data"][0]["id"]
                    return
            except OSError:
                time.sleep(0.5)
        raise SystemExit("caddtree serve did not start in 10 minutes")

    def stop(self) -> None:
        self.process.send_signal(signal.SIGINT)
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()


def one_request(served: Served, prompt: str, method: str, max_tokens: int) -> dict:
    """Stream one chat completion; its tokens, time to first token and chunk gaps."""
    client = openai.OpenAI(base_url=served.base, api_key="none", max_retries=0, timeout=600)
    start = time.perf_counter()
    stream = client.chat.completions.create(
        model=served.model,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"method": method, "ignore_eos": True},
    )
    arrivals, tokens, text = [], 0, []
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            arrivals.append(time.perf_counter())
            text.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    return {"tokens": tokens, "ttft": arrivals[0] - start, "gaps": gaps, "text": "".join(text)}


def level(served: Served, method: str, concurrency: int, args: argparse.Namespace) -> dict:
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.requests)]
    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        runs = list(pool.map(lambda p: one_request(served, p, method, args.max_tokens), prompts))
    wall = time.perf_counter() - start
    ttfts = sorted(r["ttft"] for r in runs)
    gaps = [g for r in runs for g in r["gaps"]]
    return {
        "tok_s": sum(r["tokens"] for r in runs) / wall,
        "ttft_p50": statistics.median(ttfts),
        "ttft_p95": ttfts[min(len(ttfts) - 1, round(0.95 * (len(ttfts) - 1)))],
        "itl_p50": statistics.median(gaps) if gaps else float("nan"),
        "texts": [r["text"] for r in runs],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--methods", nargs="+", default=["ar", "caddtree"])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--runtime", default="auto", help="the server's --runtime")
    parser.add_argument("--dtype", default="bfloat16", help="the server's --dtype")
    args = parser.parse_args()
    print(
        f"built-in pair, {args.dtype}, runtime {args.runtime}; {args.requests} streamed requests x "
        f"{args.max_tokens} tokens per level, temperature 0"
    )
    print(
        f"{'max-batch':>9} {'method':>9} {'conc.':>5} {'tok/s':>7} {'TTFT p50':>9} "
        f"{'TTFT p95':>9} {'ITL p50':>8} same text as at the first concurrency"
    )
    for batch in args.max_batch:
        served = Served(
            [
                "--max-batch",
                str(batch),
                "--max-queue",
                "64",
                "--max-new-tokens",
                str(args.max_tokens),
                "--runtime",
                args.runtime,
                "--dtype",
                args.dtype,
            ]
        )
        try:
            for method in args.methods:
                one_request(served, PROMPTS[0], method, 8)  # warm-up
            for method in args.methods:
                first = None
                for concurrency in args.concurrency:
                    r = level(served, method, concurrency, args)
                    first = first or r["texts"]
                    same = sum(a == b for a, b in zip(first, r["texts"]))
                    print(
                        f"{batch:>9} {method:>9} {concurrency:>5} {r['tok_s']:>7.1f} "
                        f"{r['ttft_p50']:>8.2f}s {r['ttft_p95']:>8.2f}s {1e3 * r['itl_p50']:>6.1f}ms"
                        f" {same:>3}/{len(first)}"
                    )
        finally:
            served.stop()


if __name__ == "__main__":
    main()
