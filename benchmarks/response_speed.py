"""Tokens per second of the data generator: caddtree's batched decoder against transformers'
``generate``, on the built-in target, in one run.

    python benchmarks/response_speed.py [--prompts 32] [--max-new-tokens 128] [--batch 16]
                                        [--rounds 2] [--dtype bfloat16] [--queries] [--pack]

Takes the first ``--prompts`` committed Magpie queries (``training-data/``), puts each in the chat
template, and has ``caddtree.train.data.generate_responses`` answer them greedily with each
generator in turn (``engine``, then ``hf``, ``--rounds`` times), printing each run's response
tokens and tokens per second. ``--queries`` times the sampling of Magpie queries instead
(``caddtree.train.magpie.sample_messages`` at temperature 1: ``--batch`` rows of the second
persona's pre-query template, at most ``--max-new-tokens`` tokens each), counting the tokens of
the sampled queries up to their stop tokens. ``--pack`` lays the target's linear weights out for
oneDNN first, as ``caddtree train-drafter`` does (transformers' ``generate`` then runs on them).
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
    parser.add_argument("--queries", action="store_true", help="time Magpie query sampling")
    parser.add_argument(
        "--pack", action="store_true", help="lay the linear weights out as train-drafter does"
    )
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from caddtree.util.defaults import default_target_dir

    directory = default_target_dir()
    tokenizer = AutoTokenizer.from_pretrained(directory)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=getattr(torch, args.dtype))
    if args.pack:  # as caddtree train-drafter runs the target
        from caddtree.runtime.packing import pack_linear_layers

        pack_linear_layers(model)
    work = (
        query_work(model, tokenizer, args) if args.queries else answer_work(model, tokenizer, args)
    )
    for r in range(args.rounds):
        for generator in ("engine", "hf"):
            began = time.perf_counter()
            tokens, what = work(generator, r)
            seconds = time.perf_counter() - began
            print(
                f"{generator}: {what}{tokens} tokens in {seconds:.1f} s, {tokens / seconds:.0f} tok/s"
            )


def answer_work(model, tokenizer, args: argparse.Namespace):
    """Greedy responses to the first committed queries: (response tokens, "")."""
    from caddtree.train.data import chat_prompt_ids, generate_responses
    from caddtree.train.magpie import read_raw_queries

    queries = [r["query"] for r in read_raw_queries(RAW)][: args.prompts]
    prompts = [chat_prompt_ids(tokenizer, q) for q in queries]

    def work(generator: str, r: int):
        data = generate_responses(
            model,
            prompts,
            max_new_tokens=args.max_new_tokens,
            batch_size=args.batch,
            stop_token_ids=[tokenizer.eos_token_id],
            progress=False,
            generator=generator,
        )
        return sum(len(s) - p for s, p in zip(data.sequences, data.prompt_lengths)), ""

    return work


def query_work(model, tokenizer, args: argparse.Namespace):
    """Magpie queries sampled from the second persona's pre-query template, seeded by round:
    (their tokens up to and with the stop token, how many finished)."""
    from caddtree.train.magpie import PERSONAS, pre_query_ids, sample_messages

    prefix = pre_query_ids(tokenizer, PERSONAS[1].system)
    stops = {tokenizer.eos_token_id}

    def work(generator: str, r: int):
        rows = [prefix] * args.batch
        messages = sample_messages(
            model, tokenizer, rows, args.max_new_tokens, stops, seed=r, generator=generator
        )
        tokens = sum(len(tokenizer(m)["input_ids"]) + f for m, f in messages)
        finished = sum(f for _, f in messages)
        return tokens, f"{len(messages)} queries ({finished} finished), "

    return work


if __name__ == "__main__":
    main()
