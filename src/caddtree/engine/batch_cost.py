"""The cost of a batched round, measured on this machine: :class:`BatchCostModel`.

A round of ``B`` requests drafts for all of them in one drafter pass (``C_d(B)``) and verifies
every request's bonus row and tree in one target forward. Its verification cost depends on the
total number of tree nodes ``N`` of the round (every request's bonus row is always there), on
``B`` (each sequence attends its own cache) and on the contexts. :func:`profile_batch_cost_model`
times exactly those calls of :class:`~caddtree.runtime.lean.LeanTarget` and
:class:`~caddtree.models.batch_proposer.BatchProposer` over a grid of batch sizes, node counts
and context lengths, and fits, per batch size, one convex non-decreasing curve in ``N`` per
context length (:class:`~caddtree.core.cost.ConvexCostModel`, whose ``draft_cost`` is that batch
size's ``C_d``). :class:`~caddtree.engine.batching.BatchDecoder`'s joint budget prices its rounds
with it (:meth:`BatchCostModel.round_cost_table`); between two profiled batch sizes the tables
are interpolated linearly in ``B`` (convex in ``N`` still), beyond the largest the largest's is
used.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..core.cost import ConvexCostModel, cost_model_from_dict
from ..core.profiling import median_time, profiling_tree
from ..models.batch_proposer import BatchProposer, DraftCall
from ..runtime.lean import LeanTarget, Rows
from ..runtime.rows import tree_rows
from ..util.errors import CostModelError, InvalidInputError
from ..util.files import atomic_write_text

__all__ = ["BatchCostModel", "profile_batch_cost_model"]

FORMAT = "caddtree.batch_cost_model"


class BatchCostModel:
    """Per profiled batch size ``B``, the :class:`~caddtree.core.cost.ConvexCostModel` of a round
    of ``B`` requests: verification over the round's total node count, drafting ``C_d(B)``."""

    def __init__(self, models: dict[int, ConvexCostModel], metadata: dict[str, Any] | None = None):
        if not models or min(models) < 1:
            raise CostModelError("a batch cost model needs one model per batch size >= 1")
        self.models = dict(sorted((int(b), m) for b, m in models.items()))
        self.metadata = dict(metadata or {})

    @property
    def batches(self) -> list[int]:
        return list(self.models)

    def _weights(self, batch: int) -> list[tuple[float, ConvexCostModel]]:
        """The profiled models around ``batch`` and their linear weights."""
        sizes = self.batches
        if batch <= sizes[0] or batch >= sizes[-1]:
            return [(1.0, self.models[sizes[0] if batch <= sizes[0] else sizes[-1]])]
        above = next(b for b in sizes if b >= batch)
        below = max(b for b in sizes if b <= batch)
        if above == below:
            return [(1.0, self.models[above])]
        t = (batch - below) / (above - below)
        return [(1.0 - t, self.models[below]), (t, self.models[above])]

    def draft_cost(self, batch: int) -> float:
        """``C_d`` of a drafter pass of ``batch`` sequences, seconds."""
        return float(sum(w * m.draft_cost for w, m in self._weights(batch)))

    def verify_cost_table(self, batch: int, context_length: int, max_n: int) -> np.ndarray:
        """Seconds to verify ``batch`` bonus rows and ``n = 0 .. max_n`` tree nodes in all, at a
        mean context of ``context_length``."""
        return sum(w * m.verify_cost_table(context_length, max_n) for w, m in self._weights(batch))

    def round_cost_table(self, batch: int, context_length: int, max_n: int) -> np.ndarray:
        """:meth:`verify_cost_table` plus a drafter pass of ``batch`` sequences."""
        return self.verify_cost_table(batch, context_length, max_n) + self.draft_cost(batch)

    def best_batch(self, context_length: int, tolerance: float = 0.05) -> int:
        """The profiled batch size whose plain round (one row per request, no drafting) gives
        the most tokens per second at ``context_length``; the smallest within ``tolerance`` of
        the best, since a larger batch costs each request latency and memory."""
        rates = {
            b: b / float(self.verify_cost_table(b, context_length, 0)[0]) for b in self.batches
        }
        best = max(rates.values())
        return min(b for b, rate in rates.items() if rate >= (1 - tolerance) * best)

    def fit_report(self) -> str:
        lines = []
        for batch, model in self.models.items():
            lines.append(f"batch {batch}: C_d {model.draft_cost * 1e3:.2f} ms")
            lines.append(model.fit_report())
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": 1,
            "batches": {str(b): m.to_dict() for b, m in self.models.items()},
            "metadata": self.metadata,
        }

    def save(self, path: str | os.PathLike[str]) -> Path:
        path = Path(path)
        atomic_write_text(path, json.dumps(self.to_dict(), indent=1) + "\n")
        return path

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> BatchCostModel:
        """Read a model :meth:`save` wrote (JSON only; each batch size's model is checked as
        :func:`~caddtree.core.cost.load_cost_model` checks a file)."""
        path = Path(path)
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise CostModelError(f"cannot read a batch cost model from {path}: {exc}") from None
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise CostModelError(f"{path} is not a caddtree batch cost model ({FORMAT})")
        models = {}
        for key, entry in dict(data.get("batches") or {}).items():
            model = cost_model_from_dict(entry, f"{path} (batch {key})")
            if not isinstance(model, ConvexCostModel) or not str(key).isdigit():
                raise CostModelError(f"{path}: batch {key!r} is not a convex cost model")
            models[int(key)] = model
        return cls(models, data.get("metadata"))


def _split(total: int, parts: int) -> list[int]:
    """``total`` nodes over ``parts`` requests, as evenly as they go."""
    return [total // parts + (i < total % parts) for i in range(parts)]


def _round_rows(
    starts: Sequence[int], nodes: Sequence[int], bonus: int, vocab: int, depth: int, device: Any
) -> Rows:
    """A verification call of one bonus row and a profiling tree of ``nodes[s]`` nodes after
    ``starts[s]`` entries in each slot ``s``."""

    sequences = []
    for slot, (start, n) in enumerate(zip(starts, nodes)):
        tree = profiling_tree(n, depth, vocab, seed=slot)
        sequences.append(tree_rows(slot, start, bonus, tree))
    return Rows.batch(sequences, device)


@torch.no_grad()
def profile_batch_cost_model(
    target: LeanTarget,
    proposer: BatchProposer,
    *,
    batches: Sequence[int] = (1, 2, 4, 8),
    node_counts: Sequence[int] = (0, 4, 8, 16, 32, 64, 96, 128),
    context_lengths: Sequence[int] = (0, 256, 512),
    trials: int = 3,
    warmup: int = 1,
    seed: int = 0,
    progress: bool = True,
) -> BatchCostModel:
    """Time ``target``'s verification of rounds of ``B`` sequences (each a bonus row and an even
    share of ``N`` nodes of a profiling tree, every sequence at the same context) and
    ``proposer``'s pass of ``B`` sequences, for every ``B`` in ``batches``, and fit a
    :class:`BatchCostModel`. ``proposer`` needs ``max(batches)`` slots; the target's cache is
    reserved for them and released at the end."""
    from tqdm.auto import tqdm

    batches = sorted({int(b) for b in batches})
    if not batches or batches[0] < 1 or batches[-1] > proposer.slots:
        raise InvalidInputError(f"batch sizes must be 1 .. {proposer.slots} (the drafter's slots)")
    lengths, counts = sorted({max(1, int(n)) for n in context_lengths}), sorted(set(node_counts))
    depth, device = proposer.block_size - 1, target.device
    vocab = int(target.model.config.vocab_size)
    gen = torch.Generator().manual_seed(seed)
    context = torch.randint(0, vocab, (lengths[-1],), generator=gen).tolist()
    bonus = int(context[-1])
    bar = tqdm(
        total=len(batches) * (len(lengths) * len(counts) + 1),
        desc="profiling batched rounds",
        unit="point",
        disable=not progress,
    )
    start = max(1, lengths[-1] - 4)  # each slot's drafter cache holds the context before it
    target.compile_batch(batches[-1], progress)  # where the layers are compiled: no-op else
    target.reserve(batches[-1], lengths[-1] + max(counts) + 2)
    models, raw = {}, {}
    try:
        for batch in batches:
            features = None
            for slot in range(batch):
                rows = Rows.batch([(slot, 0, context, range(len(context)), None)], device)
                _, features = target.forward(rows, slice(len(context) - 1, len(context)))
            measured = {}
            for length in reversed(lengths):
                times = []
                for total in counts:
                    split = _split(total, batch)
                    rows = _round_rows([length] * batch, split, bonus, vocab, depth, device)
                    times.append(
                        median_time(lambda r=rows: target.forward(r), warmup, trials, [device])
                    )
                    bar.update(1)
                measured[length] = (counts, times)
            for slot in range(batch):
                proposer.reset(slot)
                proposer.propose([DraftCall(slot, bonus, features[:start])])
            calls = [DraftCall(s, bonus, features[start:]) for s in range(batch)]

            def draft(calls: list[DraftCall] = calls) -> None:
                proposer.lengths[: len(calls)] = [start] * len(calls)
                for logits in proposer.propose(calls):
                    logits.rows()

            draft_cost = median_time(draft, warmup, trials, [device])
            bar.update(1)
            models[batch] = ConvexCostModel.fit(measured, draft_cost)
            raw[str(batch)] = {str(k): v[1] for k, v in measured.items()}
    finally:
        bar.close()
        target.release()
    meta = {"node_counts": counts, "context_lengths": lengths, "trials": trials, "raw": raw}
    return BatchCostModel(models, meta)
