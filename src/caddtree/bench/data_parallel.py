"""The benchmark under ``torchrun``: gathering every rank's records on rank 0 (the process group
and its collectives: :mod:`caddtree.util.ranks`).

Under ``torchrun --nproc-per-node N`` (one machine) or ``--nnodes M`` (several) the runner splits
the work items round-robin over the ranks (gloo on CPUs, nccl on GPUs with one GPU per local
rank). Each rank appends its records to its own ``results.rankK.jsonl``, so a rank that dies
loses nothing it finished; at the end rank 0 gathers the records with ``gather_object`` (no
shared file system needed), writes the merged ``results.jsonl`` and the per-rank files go. Each
rank's machine description goes into the run's metadata (``machines``, by rank), and each record
names its ``rank``, so that ``caddtree report`` can refuse to pool timings of different machines
unless told to. Rank 0's view of what is done is the one every rank splits the work by, so nodes
need no shared file system; a part file left on another node by a rank that died is not seen by
rank 0, and that rank's finished work is done again.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..util.ranks import DistInfo, init_distributed
from .results import rank_path, read_records, record_key, tree_key, trees_path, write_jsonl

__all__ = ["gather_records", "init_distributed"]  # init_distributed: caddtree.bench's name


def gather_records(
    out: Path, info: DistInfo, records: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """Collect every rank's records (and draft trees) on rank 0, which writes the merged files;
    then the per-rank files go. Returns the merged records on rank 0, this rank's elsewhere."""
    import torch.distributed as dist

    trees = read_records(rank_path(out, info.rank, trees=True))
    gathered: list[Any] | None = [None] * info.world if info.rank == 0 else None
    dist.gather_object((records, trees), gathered, dst=0)
    if info.rank == 0:
        merged: dict[tuple, dict[str, Any]] = {}
        merged_trees = {tree_key(t): t for t in read_records(trees_path(out))}
        for recs, trs in gathered:
            merged.update((record_key(r), r) for r in recs)
            merged_trees.update((tree_key(t), t) for t in trs)
        records = sorted(
            merged.values(), key=lambda r: (r["temperature"], r["dataset"], r["prompt_index"])
        )
        write_jsonl(out, records)
        if merged_trees:
            write_jsonl(trees_path(out), merged_trees.values())
    dist.barrier()  # the merged file is complete before any per-rank file goes
    rank_path(out, info.rank).unlink(missing_ok=True)
    rank_path(out, info.rank, trees=True).unlink(missing_ok=True)
    return records
