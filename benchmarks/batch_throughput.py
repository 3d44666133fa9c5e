"""Throughput of several requests decoded together (caddtree.engine.batching), by batch size.

    python benchmarks/batch_throughput.py [--requests 16] [--max-new-tokens 64]
                                          [--batches 1 2 4 8] [--methods ar ddtree-8]
                                          [--runtime auto]

Loads the built-in pair in bfloat16 on ``--runtime`` (``auto``, as ``caddtree serve`` does:
``compiled`` on CPUs where it compiles; ``lean``) and, for each ``--batches`` size B and
each method, decodes ``--requests`` chat prompts of ``--max-new-tokens`` tokens with
:class:`caddtree.engine.batching.BatchDecoder` (B requests at once, the next one joining as soon as one
finishes), greedy. It prints the aggregate tokens per second (all requests' tokens over the wall
time, prefills included), τ over all rounds, and the speed-up over the same method at batch 1.
The methods run in alternating order at each batch size, after an untimed warm-up of each.
It also prints the decoder's calibration ``kappa`` (accepted tree nodes per unit of the drafter's
prefix mass, over its last 256 trees; 1.00 for AR). ``--whole-blocks`` makes every drafter pass
draft the whole block instead of as deep as the trees can reach.
``--breakdown`` also prints where a round's time goes (ms per round, prefills apart): the
drafter's pass, building the trees (each request's, or the joint budget's), the target's
forward, and the rest (walks, greedy choices, compaction).
``ddtree-N`` is DDTree with budget N; ``caddtree`` uses the cost model cached for this machine
and builds each request's tree as if it were alone; ``caddtree-joint`` chooses all the batch's
trees with one joint budget (:func:`caddtree.core.tree.build_joint_caddtrees`), pricing a batch round
with the batch cost model of this machine (profiled once and cached, as ``caddtree serve`` does:
:meth:`~caddtree.api.SpeculativeGenerator.cached_batch_cost_model`); ``caddtree-joint@M`` does so
with a margin ``M`` in place of :data:`caddtree.engine.joint_budget._DRAFT_MARGIN` (drafting must beat
plain rounds by that factor to go on: ``@1`` none, ``@inf`` a joint batch of two or more requests
never drafts).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import time
from collections import defaultdict

import torch

from caddtree.api import chat_template_ids
from caddtree.arguments import load_pair
from caddtree.engine import batching, joint_budget
from caddtree.engine.batching import BatchDecoder, GenerationRequest
from caddtree.engine.decoding import make_policy
from chat_prompts import PROMPTS


def policy(method: str, gen):
    if method.startswith("ddtree-"):
        return make_policy("ddtree", budget=int(method.split("-")[1]))
    if method == "caddtree":
        return make_policy("caddtree", cost_model=gen.cost_model, max_budget=64)
    return make_policy(method)


def decode_all(
    gen,
    prompts: list[list[int]],
    method: str,
    batch: int,
    new: int,
    joint_model=None,
    whole_blocks: bool = False,
) -> tuple:
    """(seconds, tokens, rounds, calibration) for decoding every prompt, ``batch`` at a time
    (``calibration``: the decoder's, accepted nodes per unit of the drafter's prefix mass).
    ``whole_blocks``: every drafter pass drafts the drafter's whole block, however deep the
    trees can reach."""
    method, _, margin = method.partition("@")
    if margin:
        with margin_of(float(margin)):
            return decode_all(gen, prompts, method, batch, new, joint_model, whole_blocks)
    joint = joint_model if method == "caddtree-joint" else None
    decoder = BatchDecoder(
        gen.verifier.target,
        gen.drafter,
        max_batch=batch,
        capacity=max(map(len, prompts)) + new + 80,
        joint_cost_model=joint,
        joint_max_nodes=64,
    )
    name = "caddtree" if joint is not None else method
    chosen = WholeBlocks(policy(name, gen)) if whole_blocks else policy(name, gen)
    if whole_blocks:
        decoder.joint.reach = lambda: None
    requests = [GenerationRequest(p, chosen, new) for p in prompts]
    start = time.perf_counter()
    done = decoder.run(requests)
    seconds = time.perf_counter() - start
    tokens, rounds = sum(len(r.output) for r in done), sum(r.rounds for r in done)
    return seconds, tokens, rounds, decoder.calibration


class WholeBlocks:
    """``inner``, a tree policy, whose drafts take the drafter's whole block (no ``reach``)."""

    reach = None

    def __init__(self, inner) -> None:
        self.inner = inner

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


@contextlib.contextmanager
def margin_of(margin: float):
    """Joint batches draft on only where drafting beats plain rounds by ``margin`` meanwhile."""
    kept = joint_budget._DRAFT_MARGIN
    joint_budget._DRAFT_MARGIN = margin
    try:
        yield
    finally:
        joint_budget._DRAFT_MARGIN = kept


PHASES = {"step": "round", "_propose": "drafter", "_build": "trees"}


@contextlib.contextmanager
def phase_timer(totals: dict[str, float]):
    """Add the seconds of each of a BatchDecoder round's phases (:data:`PHASES`, and the target's
    forward inside a round) to ``totals`` while the block runs."""
    originals = {name: getattr(BatchDecoder, name) for name in PHASES}
    forward = batching.LeanTarget.forward
    inside = [False]

    def timed(name, method):
        @functools.wraps(method)
        def run(*args, **kwargs):
            inside[0] = inside[0] or name == "step"
            began = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                totals[PHASES[name]] += time.perf_counter() - began
                totals["rounds"] += name == "step"
                inside[0] = inside[0] and name != "step"

        return run

    @functools.wraps(forward)
    def timed_forward(*args, **kwargs):
        began = time.perf_counter()
        try:
            return forward(*args, **kwargs)
        finally:  # prefills run outside rounds
            totals["forward" if inside[0] else "prefills"] += time.perf_counter() - began

    for name, method in originals.items():
        setattr(BatchDecoder, name, timed(name, method))
    batching.LeanTarget.forward = timed_forward
    try:
        yield totals
    finally:
        for name, method in originals.items():
            setattr(BatchDecoder, name, method)
        batching.LeanTarget.forward = forward


def print_breakdown(batch: int, method: str, totals: dict[str, float]) -> None:
    rounds = max(1, totals["rounds"])
    parts = {k: totals[k] / rounds * 1e3 for k in ("round", "drafter", "trees", "forward")}
    parts["rest"] = parts["round"] - parts["drafter"] - parts["trees"] - parts["forward"]
    text = ", ".join(f"{k} {v:.2f}" for k, v in parts.items())
    print(f"{batch:>5} {method:>10}   ms per round: {text} ({int(rounds)} rounds)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument(
        "--methods", nargs="+", default=["ar", "ddtree-8", "caddtree", "caddtree-joint"]
    )
    parser.add_argument("--runtime", default="auto", choices=["auto", "compiled", "lean"])
    parser.add_argument("--breakdown", action="store_true", help="where a round's time goes")
    parser.add_argument(
        "--whole-blocks", action="store_true", help="draft whole blocks, however deep trees reach"
    )
    args = parser.parse_args()
    gen = load_pair(None, None, dtype="bfloat16", method="caddtree", runtime=args.runtime)
    tokenizer = gen.tokenizer
    prompts = [
        chat_template_ids(tokenizer, [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}])
        for i in range(args.requests)
    ]
    joint = gen.cached_batch_cost_model(max(args.batches)) if max(args.batches) > 1 else None
    joint = joint or gen.cost_model
    for method in args.methods:  # warm-up
        decode_all(gen, prompts[:2], method, 2, 8, joint)
    print(
        f"built-in pair, bfloat16, {gen.runtime} runtime, {torch.get_num_threads()} threads, "
        f"{args.requests} requests x {args.max_new_tokens} tokens, greedy"
    )
    print(f"{'batch':>5} {'method':>10} {'tok/s':>8} {'tau':>6} {'x batch 1':>10} {'kappa':>6}")
    base: dict[str, float] = {}
    for k, batch in enumerate(args.batches):
        order = args.methods if k % 2 == 0 else list(reversed(args.methods))
        results, phases = {}, {}
        for m in order:
            with phase_timer(defaultdict(float)) as totals:
                results[m] = decode_all(
                    gen, prompts, m, batch, args.max_new_tokens, joint, args.whole_blocks
                )
            phases[m] = totals
        for method in args.methods:
            seconds, tokens, rounds, kappa = results[method]
            rate = tokens / seconds
            base.setdefault(method, rate)
            tau = (tokens - len(prompts)) / rounds
            speedup = rate / base[method]
            print(
                f"{batch:>5} {method:>10} {rate:>8.1f} {tau:>6.2f} {speedup:>9.2f}x {kappa:>6.2f}"
            )
        if args.breakdown:
            for method in args.methods:
                print_breakdown(batch, method, phases[method])


if __name__ == "__main__":
    main()
