"""Response tokens per second of the data generator: caddtree's batched decoder against
transformers' ``generate``, on the built-in target, in one run.

    python benchmarks/response_speed.py [--prompts 32] [--max-new-tokens 128] [--batch 16]
                                        [--rounds 2] [--dtype bfloat16]

Takes the first ``--prompts`` committed Magpie queries (``training-data/``), puts each in the chat
template, and has ``caddtree.train.data.generate_responses`` answer them greedily with each
generator in turn (``engine``, then ``hf``, ``--rounds`` times), printing each run's response
tokens and tokens per second.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

RAW = Path(__file__).resolve().parents[1] / "training-data/smollm2-135m-instruct/magpie_raw.jsonl"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from caddtree.train.data import chat_prompt_ids, generate_responses
    from caddtree.train.magpie import read_raw_queries
    from caddtree.util.defaults import default_target_dir

    directory = default_target_dir()
    tokenizer = AutoTokenizer.from_pretrained(directory)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=getattr(torch, args.dtype))
    queries = [r["query"] for r in read_raw_queries(RAW)][: args.prompts]
    prompts = [chat_prompt_ids(tokenizer, q) for q in queries]
    for _ in range(args.rounds):
        for generator in ("engine", "hf"):
            began = time.perf_counter()
            data = generate_responses(
                model,
                prompts,
                max_new_tokens=args.max_new_tokens,
                batch_size=args.batch,
                stop_token_ids=[tokenizer.eos_token_id],
                progress=False,
                generator=generator,
            )
            seconds = time.perf_counter() - began
            tokens = sum(len(s) - p for s, p in zip(data.sequences, data.prompt_lengths))
            print(f"{generator}: {tokens} tokens in {seconds:.1f} s, {tokens / seconds:.0f} tok/s")


if __name__ == "__main__":
    main()
