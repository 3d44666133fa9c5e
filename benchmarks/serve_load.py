"""The server under load: streamed chat requests from the ``openai`` client at several concurrencies.

    python benchmarks/serve_load.py [--max-batch 8] [--concurrency 1 2 4 8 16]
                                    [--methods ar ddtree:8 caddtree] [--batch-budget joint]
                                    [--requests 16] [--max-tokens 64] [--runtime auto]
                                    [--dtype bfloat16] [--llamacpp] [--out DIR]

For each ``--max-batch`` and ``--batch-budget`` it starts ``caddtree serve`` on the built-in pair
(``--dtype``, on ``--runtime``) on a free localhost port, as a process of its own (so the
clients' threads here do not share its interpreter), and for each method and concurrency C sends
``--requests`` streamed chat requests (temperature 0, ``max_tokens`` each, EOS ignored so every
request makes the same number of tokens), C at a time, with the real ``openai`` client. A method
is ``ar``, ``dflash``, ``caddtree``, ``ddtree:N`` (DDTree with a fixed budget of N nodes) or
``lookup`` (prompt lookup), a ddtree or caddtree one ending in ``+lookup`` with copies from the
context in its trees; the
batch budget (``joint`` or ``per-request``) only changes CaDDTree, so a server of any budget but
the first runs only ``caddtree``. An untimed warm-up request of each method comes first.

Per level it prints the aggregate output tokens per second (all tokens over the wall time of the
level), the time to first token and the inter-token latency (gaps between streamed chunks),
median and 95th percentile, and how many requests' texts equal the same prompt's text at the first
concurrency (a request's output must not depend on the others: in float32, ``--dtype float32``,
all of them).

``--llamacpp`` adds llama.cpp's batched decoding of the same weights in BF16
(``llama-batched-bench -npp 128 -ntg 64`` at each concurrency as the number of sequences; the
binaries and the GGUF as ``vs_llamacpp.py`` makes them). ``--out DIR`` writes ``load.jsonl`` (one
record per level, the fields of the printed table), ``load.meta.json`` (the machine and the
settings) and ``load_throughput.png`` (throughput against concurrency, one line per method).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

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


def method_body(method: str) -> dict:
    """The request fields of a method name (``ddtree:8``: DDTree with a budget of 8 nodes; a name
    ending in ``+lookup``: with copies from the context in its trees; ``lookup``: copies alone)."""
    base = method.removesuffix("+lookup")
    name, _, budget = base.partition(":")
    body = {"method": name, **({"budget": int(budget)} if budget else {})}
    return {**body, "lookup": True} if base != method else body


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
        extra_body={**method_body(method), "ignore_eos": True},
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


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile of ``values`` (nearest rank; NaN without values)."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def level(served: Served, method: str, concurrency: int, args: argparse.Namespace) -> dict:
    """One concurrency level of one method: its figures and every request's text."""
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.requests)]
    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        runs = list(pool.map(lambda p: one_request(served, p, method, args.max_tokens), prompts))
    wall = time.perf_counter() - start
    ttfts = [r["ttft"] for r in runs]
    gaps = [g for r in runs for g in r["gaps"]]
    return {
        "tok_s": sum(r["tokens"] for r in runs) / wall,
        "ttft_p50": statistics.median(ttfts),
        "ttft_p95": percentile(ttfts, 0.95),
        "itl_p50": percentile(gaps, 0.5),
        "itl_p95": percentile(gaps, 0.95),
        "texts": [r["text"] for r in runs],
    }


def server_options(batch: int, budget: str, args: argparse.Namespace) -> list[str]:
    return [
        *("--max-batch", str(batch), "--batch-budget", budget, "--max-queue", "64"),
        *("--max-new-tokens", str(args.max_tokens), "--runtime", args.runtime),
        *("--dtype", args.dtype),
    ]


def serve_levels(batch: int, budget: str, methods: list[str], args: argparse.Namespace) -> list:
    """Every level of ``methods`` on one server; the records, printed as they come."""
    served, records = Served(server_options(batch, budget, args)), []
    try:
        for method in methods:
            one_request(served, PROMPTS[0], method, 8)  # warm-up
        for method in methods:
            first = None
            for concurrency in args.concurrency:
                r = level(served, method, concurrency, args)
                first = first or r["texts"]
                record = {
                    "engine": "caddtree",
                    "max_batch": batch,
                    "batch_budget": budget,
                    "method": method,
                    "concurrency": concurrency,
                    "requests": args.requests,
                    "max_tokens": args.max_tokens,
                    **{k: v for k, v in r.items() if k != "texts"},
                    "same_text": sum(a == b for a, b in zip(first, r["texts"])),
                }
                print_record(record)
                records.append(record)
    finally:
        served.stop()
    return records


def label(r: dict) -> str:
    """A record's method, with its batch budget where that is per request."""
    return r["method"] + (" (per-request)" if r.get("batch_budget") == "per-request" else "")


def print_record(r: dict) -> None:
    ms = {k: 1e3 * r[k] for k in ("itl_p50", "itl_p95")}
    print(
        f"{r['max_batch']:>9} {label(r):>22} {r['concurrency']:>5} {r['tok_s']:>7.1f} "
        f"{r['ttft_p50']:>8.2f}s {r['ttft_p95']:>8.2f}s {ms['itl_p50']:>6.1f}ms "
        f"{ms['itl_p95']:>6.1f}ms {r['same_text']:>3}/{r['requests']}"
    )


def llamacpp_levels(args: argparse.Namespace) -> list[dict]:
    """llama.cpp's batched decoding of the same weights at each concurrency."""
    import vs_llamacpp

    bins, _ = vs_llamacpp.llama_cpp()
    gguf = vs_llamacpp.bf16_gguf(bins)
    options = argparse.Namespace(threads=args.threads)
    records = []
    for r in vs_llamacpp.llama_batched(bins, gguf, options, tuple(args.concurrency)):
        record = {"engine": "llama.cpp", "method": "llama.cpp BF16", "concurrency": r["pl"]}
        record |= {"tok_s": r["speed_tg"], "max_tokens": r["tg"], "prompt_tokens": r["pp"]}
        print(f"{'':>9} {'llama.cpp BF16':>22} {r['pl']:>5} {r['speed_tg']:>7.1f}")
        records.append(record)
    return records


def plot(records: list[dict], path: Path) -> None:
    """Throughput against concurrency, one line per method (and batch budget)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lines: dict[str, list[tuple[int, float]]] = {}
    batches = {r["max_batch"] for r in records if r["engine"] == "caddtree"}
    for r in records:
        name = label(r)
        if r["engine"] == "caddtree" and len(batches) > 1:
            name += f", max-batch {r['max_batch']}"
        lines.setdefault(name, []).append((r["concurrency"], r["tok_s"]))
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, points in lines.items():
        xs, ys = zip(*sorted(points))
        ax.plot(xs, ys, "o-", label=name)
    ax.set_xscale("log", base=2)
    levels = sorted({r["concurrency"] for r in records})
    ax.set_xticks(levels, [str(c) for c in levels])
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("output tokens per second")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_out(records: list[dict], args: argparse.Namespace) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "load.jsonl", "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    import torch

    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{cpu_model()}, {os.cpu_count()} cores, {torch.get_num_threads()} threads",
        "torch": torch.__version__,
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
    }
    (out / "load.meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    plot(records, out / "load_throughput.png")
    print(f"wrote {out}/load.jsonl, load.meta.json and load_throughput.png")


def cpu_model() -> str:
    """The CPU's model name (Linux), else what ``platform`` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-batch", type=int, nargs="+", default=[8])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--methods", nargs="+", default=["ar", "ddtree:8", "caddtree"])
    parser.add_argument(
        "--batch-budget", nargs="+", default=["joint"], choices=["joint", "per-request"]
    )
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--runtime", default="auto", help="the server's --runtime")
    parser.add_argument("--dtype", default="bfloat16", help="the server's --dtype")
    parser.add_argument("--llamacpp", action="store_true", help="add llama.cpp's batched decoding")
    parser.add_argument("--threads", type=int, default=2, help="llama.cpp's threads")
    parser.add_argument("--out", help="folder for load.jsonl, load.meta.json and the plot")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    print(
        f"built-in pair, {args.dtype}, runtime {args.runtime}; {args.requests} streamed requests x "
        f"{args.max_tokens} tokens per level, temperature 0"
    )
    print(
        f"{'max-batch':>9} {'method':>22} {'conc.':>5} {'tok/s':>7} {'TTFT p50':>9} "
        f"{'TTFT p95':>9} {'ITL p50':>8} {'ITL p95':>8} same text as at the first concurrency"
    )
    records = []
    for batch in args.max_batch:
        for k, budget in enumerate(args.batch_budget):
            methods = args.methods if k == 0 else [m for m in args.methods if m == "caddtree"]
            records += serve_levels(batch, budget, methods, args) if methods else []
    if args.llamacpp:
        records += llamacpp_levels(args)
    if args.out:
        write_out(records, args)


if __name__ == "__main__":
    main()
