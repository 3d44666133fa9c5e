"""Memory over one long generation on the built-in pair (issue 14, "done when").

    python benchmarks/long_generation.py [--max-new-tokens 10000] [--method caddtree]
                                         [--budget 32] [--dtype bfloat16] [--json]
    python benchmarks/long_generation.py --forward-memory 1000 4000 8000 10000

Loads the built-in pair (SmolLM2-135M-Instruct and its shipped drafter, resolved as the CLI
resolves them, in bfloat16 unless ``--dtype``), warms it up with a short untimed generation, then
generates ``--max-new-tokens`` tokens (EOS ignored, so the output has that length; a progress bar
on stderr follows it) and reports the process's resident memory (RSS, from /proc: Linux only):

* ``before``: after loading and the warm-up;
* ``peak``: the highest RSS sampled every 10 ms during the call;
* ``after``: right after the call returns, and again after ``gc.collect()`` and glibc's
  ``malloc_trim(0)`` (freed memory the allocator kept for reuse is not a leak);

and compares the growth with the KV cache the call needs: bytes per token of the target
(``2 x layers x kv_heads x head_dim x dtype bytes``, keys and values) and of the drafter (its own
context cache), times the tokens in the context at the end. It says whether memory returned to its
level (within ``--tolerance`` MiB of ``before``).

``--forward-memory`` measures instead the working memory of one verification forward beyond the
cache: its peak RSS above the level before it, after prefilling each given context.

The target's window (``max_position_embeddings``: 8192 for SmolLM2-135M) is raised to fit the
prompt and ``--max-new-tokens`` (``SpeculativeGenerator(context_window=...)``, with a note: past
its window the model's positions are extrapolated, and the output is still plain decoding's);
``--keep-window`` lowers ``--max-new-tokens`` to fit the window instead.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import threading
import time
from typing import Any

import torch

PROMPT = "Write a long, detailed story about a lighthouse keeper and the sea, chapter by chapter."
MiB = 2**20


def rss_bytes() -> int:
    """The process's resident set size, from /proc/self/statm."""
    with open("/proc/self/statm", encoding="ascii") as fh:
        pages = int(fh.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE")


class PeakSampler:
    """Samples RSS every ``interval`` seconds in a thread, keeping the highest value."""

    def __init__(self, interval: float = 0.01) -> None:
        self.interval, self.peak = interval, rss_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_bytes())
            time.sleep(self.interval)

    def __enter__(self) -> PeakSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_bytes())


def kv_bytes_per_token(config: Any, dtype: torch.dtype) -> int:
    """Keys and values of one token in every layer of a model with this config."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    element = torch.tensor([], dtype=dtype).element_size()
    return 2 * int(text.num_hidden_layers) * int(heads) * int(head_dim) * element


def release_freed_memory() -> None:
    """Collect garbage and ask glibc to hand freed heap memory back to the system (what
    ``SpeculativeGenerator.decode`` does itself after a long generation)."""
    from caddtree.models.kvcache import return_freed_memory

    gc.collect()
    return_freed_memory()


def branching_tree(rng: Any, vocab: int, budget: int = 16) -> Any:
    """A DDTree of ``budget`` nodes over 15 positions of synthetic draft logits drawn from ``rng``,
    with a few likely tokens per position so that the tree branches (for timing verification)."""
    import numpy as np

    from caddtree.core.tree import build_ddtree

    logits = rng.normal(size=(15, vocab)).astype(np.float32)
    logits[:, :4] += 6.0
    return build_ddtree(logits, budget)


def prefill_context(gen: Any, ids: list[int], room: int) -> None:
    """Empty ``gen``'s verifier with KV room for ``ids`` and ``room`` more positions (raising the
    context window if they do not fit it) and prefill ``ids`` in chunks of 500 tokens, so that the
    prefill's own working memory stays small."""
    verifier, needed = gen.verifier, len(ids) + room
    if verifier.max_positions is not None and needed > verifier.max_positions:
        gen.set_context_window(needed)
    verifier.reset(reserve=needed)
    for start in range(0, len(ids), 500):
        verifier.prefill(ids[start : start + 500])


def forward_memory(gen: Any, contexts: list[int]) -> dict[int, float]:
    """Peak RSS (MiB) of one verification forward above the level before it, per context length:
    the working memory one round needs beyond the KV cache."""
    import numpy as np

    verifier, rng = gen.verifier, np.random.default_rng(0)
    vocab = int(gen.target.config.get_text_config().vocab_size)
    tree = branching_tree(rng, vocab)
    peaks = {}
    for context in contexts:
        prefill_context(gen, rng.integers(100, min(vocab, 40000), context).tolist(), 64)
        verifier.verify(5, tree)  # one untimed round first
        verifier.commit([])
        release_freed_memory()
        before = rss_bytes()
        with PeakSampler(0.002) as sampler:
            verifier.verify(5, tree)
        peaks[context] = (sampler.peak - before) / MiB
    verifier.reset()
    return peaks


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-new-tokens", type=int, default=10000)
    parser.add_argument("--method", default="caddtree", help="ar, dflash, ddtree or caddtree")
    parser.add_argument("--budget", type=int, default=32, help="node budget for --method ddtree")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--tolerance", type=float, default=32.0, help="MiB (default 32)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument(
        "--keep-window",
        action="store_true",
        help="lower --max-new-tokens to fit the target's window instead of raising the window",
    )
    parser.add_argument(
        "--forward-memory",
        type=int,
        nargs="+",
        metavar="CONTEXT",
        help="instead: the peak RSS of one verification forward (a 16-node tree) above its start, "
        "after a prefill of each of these context lengths (random tokens)",
    )
    args = parser.parse_args(argv)

    from caddtree.api import SpeculativeGenerator
    from caddtree.util.defaults import resolve_model_pair
    from caddtree.util.devices import dtype_name

    target, draft, dtype = resolve_model_pair(None, None, args.dtype)
    gen = SpeculativeGenerator.from_pretrained(target, draft, dtype=dtype, device=args.device)
    if args.forward_memory:
        peaks = forward_memory(gen, args.forward_memory)
        for context, peak in peaks.items():
            print(f"one verification at {context} tokens of context: peak +{peak:.1f} MiB")
        return 0
    if args.method == "caddtree":
        gen.cost_model = gen.cached_cost_model()
    budget = args.budget if args.method == "ddtree" else None
    prompt_ids = gen.encode(PROMPT)
    window = gen.verifier.max_positions
    tokens = args.max_new_tokens
    note = None
    if window is not None and len(prompt_ids) + tokens > window:
        if args.keep_window:
            tokens = window - len(prompt_ids)
            note = (
                f"--max-new-tokens {args.max_new_tokens} does not fit the target's window of "
                f"{window} positions after a {len(prompt_ids)}-token prompt; generating {tokens} "
                "instead"
            )
        else:
            gen.set_context_window(len(prompt_ids) + tokens)
            note = (
                f"the target's window of {window} positions was raised to "
                f"{len(prompt_ids) + tokens} (prompt + --max-new-tokens)"
            )
        print(f"note: {note}", file=sys.stderr)

    run = {"method": args.method, "budget": budget, "stop_token_ids": ()}
    gen.generate(prompt_ids, max_new_tokens=64, **run)  # warm-up: allocator, lazy init
    release_freed_memory()
    before = rss_bytes()
    start = time.perf_counter()
    from tqdm.auto import tqdm

    # a progress bar on stderr: the callback gets each round's new tokens (the prefill's first)
    with (
        PeakSampler() as sampler,
        tqdm(total=tokens, desc=args.method, unit="tok", file=sys.stderr) as bar,
    ):
        result = gen.generate(
            prompt_ids,
            max_new_tokens=tokens,
            callback=lambda _stats, new_tokens: bar.update(len(new_tokens)),
            **run,
        )
    seconds = time.perf_counter() - start
    after = rss_bytes()
    release_freed_memory()
    after_release = rss_bytes()

    torch_dtype = gen.verifier.dtype
    target_kv = kv_bytes_per_token(gen.target.config, torch_dtype)
    drafter_kv = kv_bytes_per_token(gen.drafter.config, torch_dtype) if gen.drafter else 0
    context = len(prompt_ids) + len(result.token_ids)
    expected = (target_kv + drafter_kv) * context
    returned = after_release - before <= args.tolerance * MiB
    report = {
        "method": args.method,
        "dtype": dtype_name(torch_dtype),
        "prompt_tokens": len(prompt_ids),
        "new_tokens": len(result.token_ids),
        "seconds": round(seconds, 1),
        "ms_per_token": round(result.stats.ms_per_token, 2),
        "tau": round(result.stats.tau, 3),
        "rss_before_mib": round(before / MiB, 1),
        "rss_peak_mib": round(sampler.peak / MiB, 1),
        "rss_after_mib": round(after / MiB, 1),
        "rss_after_release_mib": round(after_release / MiB, 1),
        "peak_growth_mib": round((sampler.peak - before) / MiB, 1),
        "kv_bytes_per_token": {"target": target_kv, "drafter": drafter_kv},
        "expected_kv_mib_at_end": round(expected / MiB, 1),
        "returned_to_level": returned,
        "note": note,
    }
    if args.json:
        print(json.dumps(report))
        return 0 if returned else 1
    print(
        f"{report['new_tokens']} tokens with {args.method} in {report['dtype']} "
        f"({report['seconds']} s, {report['ms_per_token']} ms/token, tau {report['tau']})"
    )
    print(
        f"KV cache per token: target {target_kv} B ({target_kv / 1024:.1f} KiB), drafter "
        f"{drafter_kv} B; at {context} tokens of context: {report['expected_kv_mib_at_end']} MiB"
    )
    print(
        f"RSS: before {report['rss_before_mib']} MiB, peak {report['rss_peak_mib']} MiB "
        f"(+{report['peak_growth_mib']} MiB), after {report['rss_after_mib']} MiB, after "
        f"gc + malloc_trim {report['rss_after_release_mib']} MiB"
    )
    verdict = "returned to its level" if returned else "did NOT return to its level"
    print(f"memory {verdict} (tolerance {args.tolerance:g} MiB)")
    return 0 if returned else 1


if __name__ == "__main__":
    sys.exit(main())
