"""What one drafter pass costs, by drafter depth and draft-vocabulary size, on the built-in target.

    python benchmarks/drafter_cost.py [--layers 1 2 3] [--vocab 0 8192] [--dtype bfloat16]
                                      [--context 300] [--rounds 15]

For every combination it builds a randomly initialised DFlash drafter shaped for the built-in
SmolLM2-135M-Instruct target (the weights do not change the cost), and times
``DFlashProposer.propose`` after a ``--context``-token prompt with 4 new context features, as a
decoding round does (``--vocab 0`` is the full vocabulary). It prints the median milliseconds of:

* ``propose`` - the whole drafter pass: the layers, then the projection to the (draft) vocabulary;
* ``head``    - the projection alone (``B - 1`` hidden states through the lm_head rows).

Configurations are timed in rounds, each round in a fresh random order, after an untimed warm-up
of each, so machine drift falls evenly on all of them. Ratios are against the first configuration.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch
from transformers import AutoModelForCausalLM

from caddtree.models import DFlashDraftModel, DFlashProposer
from caddtree.models.target import TreeVerifier
from caddtree.util.defaults import default_target_dir
from caddtree.util.devices import resolve_dtype


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--vocab", type=int, nargs="+", default=[0, 8192])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--context", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()

    dtype = resolve_dtype(args.dtype, torch.device("cpu"))
    target = AutoModelForCausalLM.from_pretrained(
        default_target_dir(), dtype=dtype, attn_implementation="sdpa"
    ).eval()
    vocab = int(target.config.vocab_size)
    gen = torch.Generator().manual_seed(0)
    context = torch.randint(0, vocab, (args.context,), generator=gen).tolist()

    cases = {}
    for layers in args.layers:
        for k in args.vocab:
            torch.manual_seed(layers)
            ids = None if k == 0 else torch.randperm(vocab, generator=gen)[:k].tolist()
            drafter = DFlashDraftModel.for_target(
                target.config,
                mask_token_id=vocab - 1,
                num_layers=layers,
                target_layer_ids=[1, 14, 27][:layers] if layers < 3 else None,
                draft_token_ids=ids,
                dtype=dtype,
            ).eval()
            verifier = TreeVerifier(target, drafter.target_layer_ids)
            _, features = verifier.prefill(context)
            proposer = DFlashProposer(drafter, target)
            proposer.propose(7, features[:, :-4])
            start = proposer.context_length
            tail = features[:, start:]
            hidden = torch.randn(drafter.block_size - 1, target.config.hidden_size, dtype=dtype)

            def propose(p=proposer, s=start, t=tail):
                p.crop(s)
                p.propose(7, t).rows()

            def head(p=proposer, h=hidden):
                p.lm_head(h)

            name = f"{layers} layer{'s' if layers > 1 else ''}, " + (
                "full vocabulary" if k == 0 else f"{k} draft ids"
            )
            cases[name] = {"propose": propose, "head": head}

    times = {name: {part: [] for part in fns} for name, fns in cases.items()}
    order = list(cases)
    with torch.inference_mode():
        for fns in cases.values():
            for fn in fns.values():
                fn()
        rng = random.Random(0)
        for _ in range(args.rounds):
            rng.shuffle(order)
            for name in order:
                for part, fn in cases[name].items():
                    t0 = time.perf_counter()
                    fn()
                    times[name][part].append(time.perf_counter() - t0)

    first = None
    print(f"{'configuration':<34} {'propose ms':>11} {'ratio':>6} {'head ms':>8} {'ratio':>6}")
    for name in cases:
        med = {part: 1e3 * statistics.median(v) for part, v in times[name].items()}
        first = first or med
        print(
            f"{name:<34} {med['propose']:>11.2f} {med['propose'] / first['propose']:>6.2f} "
            f"{med['head']:>8.2f} {med['head'] / first['head']:>6.2f}"
        )
    print(f"(median of {args.rounds} rounds, {args.dtype}, {torch.get_num_threads()} threads)")


if __name__ == "__main__":
    main()
