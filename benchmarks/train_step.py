"""Seconds per drafter-training step on the built-in target, on synthetic data of realistic shape.

    python benchmarks/train_step.py [--layers 1] [--precision bfloat16] [--coverage 0.99]
                                    [--steps 8] [--compile] [--src PATH]

It builds 64 random sequences shaped like the built-in pair's training data (prompts of 40-160
tokens, responses of 120-256, tokens drawn from the 8,000 lowest ids so a 99% draft vocabulary
has about 8k entries), random bfloat16 context features, and runs ``--steps`` steps of
``caddtree.train.train_drafter`` (4 samples x 32 anchor blocks per step, the defaults). It prints
the median ``step_s`` of the training log after two warm-up steps, and the anchor blocks trained
per second it makes. ``--compile`` compiles the forward (its compilation falls in the warm-up).

``--src PATH`` imports caddtree from another source tree (for example a checkout of an older
commit), so the same script times the trainer before and after a change. Options the older
trainer does not know are left out: pass only ``--layers`` there.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--precision", choices=["bfloat16", "float32"])
    parser.add_argument("--coverage", type=float, help="draft vocabulary coverage (default: none)")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--compile", action="store_true", help="torch.compile the forward")
    parser.add_argument("--src", help="import caddtree from this source tree instead")
    args = parser.parse_args()
    if args.src:
        sys.path.insert(0, args.src)

    import torch
    from transformers import AutoModelForCausalLM

    from caddtree.train import TrainConfig, TrainingData, train_drafter
    from caddtree.util.defaults import default_target_dir

    target = AutoModelForCausalLM.from_pretrained(
        default_target_dir(), dtype=torch.bfloat16, attn_implementation="sdpa"
    )
    hidden = int(target.config.hidden_size)
    g = torch.Generator().manual_seed(0)
    seqs, prompt_lengths, features = [], [], []
    for _ in range(64):
        p = int(torch.randint(40, 161, (1,), generator=g))
        r = int(torch.randint(120, 257, (1,), generator=g))
        seqs.append(torch.randint(0, 8000, (p + r,), generator=g))
        prompt_lengths.append(p)
        features.append(torch.randn(p + r, 3 * hidden, generator=g).to(torch.bfloat16))
    extra = {}
    if "log_every" in TrainConfig.__dataclass_fields__:
        extra["log_every"] = 1  # every step's own time (a CPU step is synchronous anyway)
    if args.precision:
        extra["precision"] = args.precision
    if args.compile:
        extra["compile"] = True
    if args.coverage:
        extra["draft_vocab_coverage"] = args.coverage
    config = TrainConfig(
        num_layers=args.layers,
        steps=args.steps + 2,
        eval_every=10**6,
        save_every=10**6,
        mask_token_id=int(target.config.vocab_size) - 1,
        eval_fraction=0.0,
        **extra,
    )
    with tempfile.TemporaryDirectory() as out:
        train_drafter(
            target,
            TrainingData(seqs, prompt_lengths),
            out,
            config,
            features=features,
            resume=False,
            progress=False,
        )
        with open(f"{out}/train_log.jsonl", encoding="utf-8") as fh:
            log = [json.loads(line) for line in fh]
    times = [entry["step_s"] for entry in log[2:]]
    settings = f"{args.layers} layer(s), precision {args.precision or 'default'}, coverage "
    settings += f"{args.coverage or 'none (full vocabulary)'}"
    step = statistics.median(times)
    blocks = config.samples_per_step * config.anchors_per_sample
    print(
        f"{settings}: median {step:.3f} s/step over {len(times)} steps, "
        f"{blocks / step:.1f} blocks/s ({torch.get_num_threads()} threads)"
    )


if __name__ == "__main__":
    main()
