"""Do the trainer's walks predict what decoding measures? Walk prompts' training samples.

    python benchmarks/chain_walk.py DRAFTER PROMPTS.jsonl [--data DATA] [--max-new-tokens 64]
                                    [--dtype float32] [--budgets 16]
    python benchmarks/chain_walk.py DRAFTER --heldout 200 [--split SPLIT.json] ...

For each prompt of ``PROMPTS.jsonl`` (``{"prompt": ...}`` per line, e.g.
``training-data/smollm2-135m-instruct/unseen40.jsonl``), finds its sample in ``--data`` (the
committed training data by default), keeps the prompt and the first ``--max-new-tokens`` response
tokens, computes the built-in target's context features of those samples, and walks them with
``AnchorBlockLoss.chain_walk`` (what the trainer's ``eval_walk_tau`` does on held-out samples).
Prints the walk's tokens per round two ways: counting the prefill's token, as
``caddtree bench``'s pooled ``new_tokens / rounds`` does, and without it, as the engine's ``tau``
does. Compare with

    caddtree bench --draft DRAFTER --prompts PROMPTS.jsonl --methods dflash \
        --max-new-tokens 64 --dtype bfloat16 --out chain.jsonl

(the data's responses are the target's greedy bfloat16 ones, which is what that decodes).
``--heldout N`` walks N of the data's held-out samples instead (drawn with ``random.Random(1)``
from ``--split``, the committed split by default), with no prompt file.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from caddtree.train.data import TrainingData, chat_prompt_ids
from caddtree.train.features import compute_features
from caddtree.train.loss import AnchorBlockLoss
from caddtree.train.trainer import TrainConfig, load_trained_drafter
from caddtree.util.defaults import default_target_dir

DATA = Path(__file__).resolve().parents[1] / "training-data/smollm2-135m-instruct/data.safetensors"
SPLIT = DATA.with_name("split.json")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("drafter", type=Path)
    ap.add_argument("prompts", type=Path, nargs="?")
    ap.add_argument("--heldout", type=int, help="walk N held-out samples instead of PROMPTS")
    ap.add_argument("--split", type=Path, default=SPLIT)
    ap.add_argument("--data", type=Path, default=DATA)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--dtype", default="float32", help="the drafter's dtype for the walk")
    ap.add_argument("--budgets", type=int, nargs="*", default=[16], help="DDTree node budgets")
    args = ap.parse_args()

    target_dir = default_target_dir()
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.bfloat16)
    data = TrainingData.load(args.data)
    if args.heldout:
        held = json.loads(args.split.read_text())["heldout"]
        found = random.Random(1).sample(held, args.heldout)
    elif args.prompts:
        where = {
            tuple(s[:p].tolist()): i
            for i, (s, p) in enumerate(zip(data.sequences, data.prompt_lengths))
        }
        prompts = [json.loads(line)["prompt"] for line in args.prompts.read_text().splitlines()]
        found = [where.get(tuple(chat_prompt_ids(tokenizer, p))) for p in prompts]
        if None in found:
            raise SystemExit(f"{found.count(None)} prompts have no sample in {args.data}")
    else:
        raise SystemExit("give PROMPTS.jsonl or --heldout N")
    samples = TrainingData(
        [data.sequences[i][: data.prompt_lengths[i] + args.max_new_tokens] for i in found],
        [data.prompt_lengths[i] for i in found],
    )
    drafter = load_trained_drafter(args.drafter).to(getattr(torch, args.dtype)).eval()
    features = compute_features(target, samples, drafter.target_layer_ids, progress=False)
    config = TrainConfig(block_size=drafter.block_size, precision="float32")
    loss = AnchorBlockLoss(drafter, target, features, samples, config, torch.device("cpu"))
    budgets = [None, *args.budgets]
    per_sample = [loss.walks(i, budgets) for i in range(len(found))]  # one drafter pass each
    for j, budget in enumerate(budgets):
        rounds = [c for walks in per_sample for c in walks[j]]
        with_prefill = (sum(rounds) + len(found)) / len(rounds)
        name = "dflash" if budget is None else f"ddtree-{budget}"
        print(
            f"{args.drafter} {name}: {len(found)} samples, {len(rounds)} rounds; tokens per "
            f"round {with_prefill:.3f} with the prefill's token (bench's pooled tau), "
            f"{sum(rounds) / len(rounds):.3f} without (the engine's tau)"
        )


if __name__ == "__main__":
    main()
