"""Held-out accuracy of a trained drafter, on many more blocks than the trainer's periodic eval.

    python benchmarks/heldout_accuracy.py RUN_DIR [--prompts N] [--drafter DIR] [--anchors 256]
                                          [--ngram]

``RUN_DIR`` is a `caddtree train-drafter` output directory (``data.safetensors``,
``features.safetensors``, ``run.json`` and ``checkpoint/``). The held-out samples are the ones the
run held out (same split); ``--prompts N`` uses the first N samples of the data, as
``--max-prompts N`` did for the run. Every held-out sample contributes ``--anchors`` random blocks
(at most one per response position), scored exactly as training scores them:

* ``loss``: the position-weighted cross-entropy the trainer minimises;
* ``top1``: position 1's top-1 accuracy (the first draft token is the target's next token);
* ``chain``: the expected accepted length of a chain draft per block.

``--drafter DIR`` scores another drafter (released format) on the same blocks, e.g. a checkpoint
of another run with the same draft vocabulary. ``--ngram`` also prints what a bigram table and a
trigram table (backing off to the bigram), counted on the training responses, get for position 1:
a floor that a useful drafter must clear.
"""

from __future__ import annotations

import argparse
import collections
import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from caddtree.train.data import TrainingData, split_samples
from caddtree.train.features import load_features
from caddtree.train.loss import AnchorBlockLoss
from caddtree.train.trainer import TrainConfig, load_trained_drafter


def ngram_top1(data: TrainingData, train: list[int], held: list[int]) -> tuple[float, float]:
    bigram: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
    trigram: dict[tuple[int, int], collections.Counter] = collections.defaultdict(
        collections.Counter
    )
    for i in train:
        s, p = data.sequences[i].tolist(), data.prompt_lengths[i]
        for t in range(max(p, 1), len(s) - 1):
            bigram[s[t]][s[t + 1]] += 1
            trigram[(s[t - 1], s[t])][s[t + 1]] += 1
    hits2 = hits3 = n = 0
    for i in held:
        s, p = data.sequences[i].tolist(), data.prompt_lengths[i]
        for t in range(max(p, 1), len(s) - 1):
            n += 1
            two = bigram[s[t]].most_common(1)[0][0] if bigram[s[t]] else -1
            three = trigram.get((s[t - 1], s[t]))
            hits2 += two == s[t + 1]
            hits3 += (three.most_common(1)[0][0] if three else two) == s[t + 1]
    return hits2 / max(n, 1), hits3 / max(n, 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run", type=Path)
    ap.add_argument("--prompts", type=int, default=None)
    ap.add_argument("--drafter", type=Path, default=None)
    ap.add_argument("--anchors", type=int, default=256)
    ap.add_argument("--ngram", action="store_true")
    ap.add_argument("--seed", type=int, default=5)
    args = ap.parse_args()

    run_info = json.loads((args.run / "run.json").read_text())
    fields = TrainConfig.__dataclass_fields__
    config = TrainConfig(**{k: v for k, v in run_info["config"].items() if k in fields})
    config.anchors_per_sample = args.anchors
    data = TrainingData.load(args.run / "data.safetensors")
    n = args.prompts or run_info["prompts"]["total"]
    data = TrainingData(data.sequences[:n], data.prompt_lengths[:n], data.meta)
    record = args.run / "split.json"  # the run's own split, as its trainer made it
    train_ids, held_ids = split_samples(data, config, record if record.is_file() else None)

    features = load_features(args.run / "features.safetensors")[:n]
    if len(features) != n:
        raise SystemExit(f"{args.run}/features.safetensors holds {len(features)} samples, not {n}")
    target = AutoModelForCausalLM.from_pretrained(run_info["target"], dtype=torch.bfloat16)
    drafter = load_trained_drafter(args.drafter or args.run).float().eval()
    trainer = AnchorBlockLoss(drafter, target, features, data, config, torch.device("cpu"))
    generator = torch.Generator().manual_seed(args.seed)
    totals = collections.Counter()
    batches = 0
    with torch.no_grad():
        for k in range(0, len(held_ids), 2):
            loss, stats = trainer.batch_loss(held_ids[k : k + 2], generator)
            totals["loss"] += loss.item()
            totals["top1"] += float(stats["top1"])
            totals["chain"] += float(stats["accept"])
            batches += 1
    print(
        f"{args.drafter or args.run}: {len(held_ids)} held-out samples x {args.anchors} blocks: "
        + ", ".join(f"{k} {v / batches:.4f}" for k, v in totals.items())
    )
    if args.ngram:
        two, three = ngram_top1(data, train_ids, held_ids)
        print(f"position-1 top-1 of n-gram tables: bigram {two:.3f}, trigram {three:.3f}")


if __name__ == "__main__":
    main()
