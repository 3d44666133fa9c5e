"""Stage 2 of drafter training: the target's context features (hidden states after
``target_layer_ids``) of every token of every sample, computed once (:func:`compute_features`) and
cached in ``features.safetensors`` under a key of the layers, the data and the target
(:func:`cached_features`). When the data grows by appending samples, only the new samples'
features are computed; the file then holds one part per extension, and per
:data:`PART_SAMPLES` samples of a long pass (:func:`load_features`).

When the loss needs the target's distribution (its L1 / LK terms), the same forward also gives
the target's next-token top-k over the draft vocabulary at every response position
(:mod:`caddtree.train.targets`, :func:`compute_features_and_targets`), cached in the same file
and key (:func:`cached_pass`, :func:`load_targets`).
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from ..models.target import extract_context_features
from ..util.files import atomic_write
from ..util.ranks import DistInfo, all_objects, barrier
from .data import TrainingData, target_fingerprint
from .targets import TargetDistributions, TopKSpec, topk_rows

logger = logging.getLogger(__name__)

PART_SAMPLES = 1024
"""Samples per part of a feature cache: the file is saved after each part, so an interrupted
pass loses at most one part's work."""

__all__ = [
    "StepFeatures",
    "cached_features",
    "cached_pass",
    "compute_features",
    "compute_features_and_targets",
    "load_features",
    "load_targets",
    "resolve_feature_mode",
]


class StepFeatures:
    """Context features computed as a step needs them: the frozen target's decoder over the
    step's tokens [b, T] (each sample padded past its end, which no earlier position sees under
    causal attention), features [b, T, k*H] in the target's dtype. No cache is kept but, on the
    CPU, the last call's, which the next call with the same tokens reuses (an evaluation walks
    one sample's blocks in chunks, each asking for that sample's features; on a GPU the pass is
    cheap and the comparison would wait for the device)."""

    def __init__(self, target: Any, layer_ids: Sequence[int]) -> None:
        self.decoder = target.get_decoder()
        self.layer_ids = list(layer_ids)
        self.dtype = target.get_input_embeddings().weight.dtype
        self.last: tuple[torch.Tensor, torch.Tensor] | None = None

    @torch.no_grad()
    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        last = self.last
        if last is not None and last[0].shape == tokens.shape and torch.equal(last[0], tokens):
            return last[1]
        features = _decoder_pass(self.decoder, tokens, self.layer_ids)[0]
        self.last = (tokens, features) if tokens.device.type == "cpu" else None
        return features


def _decoder_pass(
    decoder: Any, ids: torch.Tensor, layer_ids: Sequence[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's decoder alone over ``ids`` [b, T] (its lm_head runs only where a caller
    asks): the context features of ``layer_ids`` [b, T, k*H] and the final hidden states."""
    select = [i + 1 for i in layer_ids]
    out = decoder(input_ids=ids, output_hidden_states=select, use_cache=False)
    return extract_context_features(out.hidden_states, layer_ids), out.last_hidden_state


def feature_row_bytes(target: Any, layer_ids: Sequence[int]) -> int:
    """The bytes of one token's context features of ``layer_ids`` (in the target's dtype)."""
    weight = target.get_input_embeddings().weight
    return len(layer_ids) * int(weight.shape[1]) * weight.element_size()


def free_memory(device: torch.device) -> int | None:
    """Bytes free for new tensors on ``device``: CUDA's free memory, the system's
    ``MemAvailable`` on the CPU (``None`` where it cannot be read)."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    from ..runtime.packing import available_memory

    return available_memory()


def resolve_feature_mode(
    mode: str, target: Any, data: TrainingData, layer_ids: Sequence[int], device: torch.device
) -> str:
    """``"cache"`` or ``"step"`` for a :class:`~caddtree.train.TrainConfig`'s ``features``:
    ``"auto"`` is ``"cache"`` where every sample's features take at most half the memory free on
    ``device`` (CUDA's free memory, the system's ``MemAvailable`` on the CPU), else ``"step"``."""
    if mode != "auto":
        return mode
    need = sum(int(s.shape[0]) for s in data.sequences) * feature_row_bytes(target, layer_ids)
    free = free_memory(device)
    chosen = "cache" if free is None or need <= free / 2 else "step"
    logger.info(
        "context features: %s (all samples' features: %.1f GB; free: %s)",
        "cached" if chosen == "cache" else "computed per step",
        need / 1e9,
        "unknown" if free is None else f"{free / 1e9:.1f} GB",
    )
    return chosen


def _length_batches(data: TrainingData, max_batch_tokens: int) -> list[list[int]]:
    """Sample indices in batches of similar length, up to ``max_batch_tokens`` tokens once padded
    to the longest (a lone sequence longer than that is a batch of its own)."""
    order = sorted(range(len(data.sequences)), key=lambda i: len(data.sequences[i]))
    batches, start = [], 0
    while start < len(order):
        # sorted by length, so the last sequence of a batch is its longest
        end = start + 1
        while end < len(order) and (end - start + 1) * len(data.sequences[order[end]]) <= (
            max_batch_tokens
        ):
            end += 1
        batches.append(order[start:end])
        start = end
    return batches


@torch.inference_mode()
def _feature_pass(
    target: Any,
    data: TrainingData,
    layer_ids: Sequence[int],
    topk: TopKSpec | None,
    max_batch_tokens: int,
    progress: bool,
) -> tuple[list[torch.Tensor], TargetDistributions | None]:
    """Every sample's context features and, with ``topk`` (and samples), the target's
    next-token rows of their response positions (:func:`~caddtree.train.targets.topk_rows`).

    Sequences of similar length run together, right-padded to the longest: under causal
    attention a position never sees the padding after it, so each row's features are those of
    the sequence alone.
    """
    from tqdm.auto import tqdm

    device = target.get_input_embeddings().weight.device
    n = len(data.sequences)
    feats: list[torch.Tensor | None] = [None] * n
    rows: list[dict[str, torch.Tensor] | None] = [None] * n
    bar = tqdm(total=n, desc="context features", unit="seq", disable=not progress)
    for idx in _length_batches(data, max_batch_tokens):
        width = len(data.sequences[idx[-1]])
        ids = torch.zeros((len(idx), width), dtype=torch.long)
        for row, i in enumerate(idx):
            ids[row, : len(data.sequences[i])] = data.sequences[i]
        # the lm_head runs on the response rows only, when asked to
        batch, last_hidden = _decoder_pass(target.get_decoder(), ids.to(device), layer_ids)
        batch = batch.cpu()
        for row, i in enumerate(idx):
            feats[i] = batch[row, : len(data.sequences[i])].clone()
        if topk is not None:
            _response_rows(target, data, idx, last_hidden, topk, rows)
        bar.update(len(idx))
    bar.close()
    if topk is None or n == 0:
        return feats, None
    flat = {name: torch.cat([r[name] for r in rows]) for name in rows[0]}
    return feats, TargetDistributions(flat, _response_row_counts(data, n), topk.key())


def _response_rows(
    target: Any,
    data: TrainingData,
    idx: Sequence[int],
    last_hidden: torch.Tensor,
    topk: TopKSpec,
    rows: list,
) -> None:
    """Set ``rows[i]`` for the samples ``idx`` of a batch from its final hidden states: the
    target's next-token rows of positions ``P .. T-2`` of each (:mod:`caddtree.train.targets`)."""
    spans = [(data.prompt_lengths[i], len(data.sequences[i]) - 1) for i in idx]
    hidden = torch.cat([last_hidden[r, p:t] for r, (p, t) in enumerate(spans)])
    computed = topk_rows(hidden, target.get_output_embeddings(), topk)
    counts = [max(t - p, 0) for p, t in spans]
    split = {name: torch.split(value, counts) for name, value in computed.items()}
    for j, i in enumerate(idx):
        rows[i] = {name: parts[j].clone() for name, parts in split.items()}


def compute_features(
    target: Any,
    data: TrainingData,
    layer_ids: Sequence[int],
    *,
    max_batch_tokens: int = 4096,
    progress: bool = True,
) -> list[torch.Tensor]:
    """Context features [T, k*H] of every sequence (stored in the target's dtype, on the CPU),
    computed ``max_batch_tokens`` tokens per forward at most."""
    return _feature_pass(target, data, layer_ids, None, max_batch_tokens, progress)[0]


def compute_features_and_targets(
    target: Any,
    data: TrainingData,
    layer_ids: Sequence[int],
    topk: TopKSpec,
    *,
    max_batch_tokens: int = 4096,
    progress: bool = True,
) -> tuple[list[torch.Tensor], TargetDistributions]:
    """:func:`compute_features` and, from the same forward, the target's next-token top-k rows
    of every sample's response positions (:class:`~caddtree.train.targets.TargetDistributions`).
    """
    return _feature_pass(target, data, layer_ids, topk, max_batch_tokens, progress)


def _data_digest(data: TrainingData, n: int) -> str:
    """A digest of the first ``n`` samples' tokens (what their cached features were computed
    from)."""
    digest = hashlib.sha256()
    for seq in data.sequences[:n]:
        digest.update(len(seq).to_bytes(8, "little"))
        digest.update(seq.to(torch.int32).numpy().tobytes())
    return digest.hexdigest()


def _suffixes(tensors: dict[str, torch.Tensor]) -> list[str]:
    """The name suffixes of a cache file's parts, in order: ``features``, ``features.1``, ..."""
    suffixes = [""]
    while f"features.{len(suffixes)}" in tensors:
        suffixes.append(f".{len(suffixes)}")
    return suffixes


def _samples(tensors: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """Every sample's features (views) in a cache file's tensors, in sample order."""
    return [
        f
        for s in _suffixes(tensors)
        for f in torch.split(tensors[f"features{s}"], tensors[f"lengths{s}"].tolist())
    ]


def load_features(path: str | Path) -> list[torch.Tensor]:
    """Every sample's context features from a ``features.safetensors`` file, in sample order."""
    return _samples(load_file(path))


def load_targets(path: str | Path) -> TargetDistributions | None:
    """The target's next-token rows stored in a ``features.safetensors`` file (``None`` if it
    has none)."""
    key = _cache_key(Path(path))
    return _targets_in(load_file(path), key) if key.get("next_token") else None


def _targets_in(tensors: dict[str, torch.Tensor], key: dict) -> TargetDistributions:
    """The target's rows in a cache file's ``tensors`` (made under ``key``)."""
    return TargetDistributions.from_parts(tensors, _suffixes(tensors), key["next_token"])


def _cache_key(path: Path) -> dict:
    from safetensors import safe_open

    with safe_open(path, framework="pt") as fh:
        key = json.loads((fh.metadata() or {}).get("key", "{}"))
    return key if isinstance(key, dict) else {}


def _response_row_counts(data: TrainingData, n: int) -> list[int]:
    """How many next-token rows each of the first ``n`` samples has (``T-1-P``)."""
    return [max(len(s) - 1 - p, 0) for s, p in zip(data.sequences[:n], data.prompt_lengths[:n])]


def _usable_cache(
    path: Path, data: TrainingData, fixed: dict, topk: TopKSpec | None
) -> tuple[dict[str, torch.Tensor], dict]:
    """The tensors and key of the cache at ``path`` when they can serve ``data`` (see
    :func:`cached_pass`), else ``({}, {})``."""
    try:
        key = _cache_key(path) if path.is_file() else {}
        n = key.get("n")
        if not (
            {k: key.get(k) for k in fixed} == fixed
            and isinstance(n, int)
            and 0 < n <= len(data.sequences)
            and key.get("tokens") == int(sum(len(s) for s in data.sequences[:n]))
            # files from before the digest have none; their token count was checked above
            and key.get("digest") in (None, _data_digest(data, n))
            # rows of another k or draft vocabulary, or none, cannot serve the loss
            and (topk is None or key.get("next_token") == topk.key())
        ):
            return {}, {}
        tensors = load_file(path)
        if len(_samples(tensors)) != n:  # a damaged file: start again
            return {}, {}
        if key.get("next_token"):
            names = [TargetDistributions.tensor_names(s)["counts"] for s in _suffixes(tensors)]
            counts = torch.cat([tensors[name] for name in names]).tolist()
            if counts != _response_row_counts(data, n):
                return {}, {}
    except Exception:  # an unreadable cache is only lost work: compute it again
        return {}, {}
    return tensors, key


def cached_features(target, data, layer_ids, path: Path, progress: bool) -> list[torch.Tensor]:
    """The context features of ``data``: :func:`cached_pass` without the target's rows."""
    return cached_pass(target, data, layer_ids, path, progress)[0]


def cached_pass(
    target: Any,
    data: TrainingData,
    layer_ids: Sequence[int],
    path: Path,
    progress: bool,
    topk: TopKSpec | None = None,
    ranks: DistInfo | None = None,
) -> tuple[list[torch.Tensor], TargetDistributions | None]:
    """The context features of ``data`` and, with ``topk``, the target's next-token rows
    (:mod:`caddtree.train.targets`), read from ``path`` as far as it holds them and computed
    for the rest in one forward (:func:`compute_features_and_targets`).

    A cache is used when it was made for these layers and this target
    (:func:`target_fingerprint`) from the first samples of ``data`` (same samples, checked by a
    digest of their tokens; files written before the digest existed are checked by their token
    count) and, with ``topk``, holds rows of that ``k`` and draft vocabulary: then only the
    samples appended since are computed and added to the file, in parts of at most
    :data:`PART_SAMPLES` samples, the file saved after each (an interrupted pass resumes after
    its last saved part). Anything else is computed afresh and replaces the file: a cache
    without rows (or with other rows) is never used for a loss that needs them. Without
    ``topk`` a cache's rows are ignored, and dropped from the file if it grows (its new part
    would have none).

    Under torchrun (``ranks``) every rank reads the cache, the ranks share each part's samples
    (every ``world``-th one; with ``topk`` each rank computes the whole part) and gather them,
    and rank 0 alone writes the file.
    """
    ranks = ranks if ranks is not None else DistInfo()
    fixed = {"layers": list(layer_ids), **target_fingerprint(target)}
    tensors, key = _usable_cache(path, data, fixed, topk)
    barrier(ranks)  # every rank has read the cache before rank 0 writes it
    reused = _samples(tensors) if tensors else []
    if topk is None and key.get("next_token") and len(reused) < len(data.sequences):
        tensors = {k: v for k, v in tensors.items() if not k.startswith("next_")}
    if len(reused) == len(data.sequences):
        return reused, _targets_in(tensors, key) if topk is not None else None
    done = len(reused)
    while done < len(data.sequences):  # a part per chunk, each saved: an interrupted pass resumes
        end = min(done + PART_SAMPLES, len(data.sequences))
        new = _add_part(target, data, done, end, layer_ids, topk, tensors, progress, ranks)
        key = _write_cache(path, tensors, fixed, data, end, topk, write=ranks.rank == 0)
        reused += new
        done = end
    return reused, _targets_in(tensors, key) if topk is not None else None


def _add_part(
    target: Any,
    data: TrainingData,
    start: int,
    end: int,
    layer_ids: Sequence[int],
    topk: TopKSpec | None,
    tensors: dict[str, torch.Tensor],
    progress: bool,
    ranks: DistInfo,
) -> list[torch.Tensor]:
    """Compute samples ``start .. end - 1`` and add them to ``tensors`` as the next part; their
    features (views into the part)."""
    rest = TrainingData(data.sequences[start:end], data.prompt_lengths[start:end])
    suffix = f".{len(_suffixes(tensors))}" if tensors else ""
    if topk is None and ranks.distributed:
        new = _shared_features(target, rest, layer_ids, progress, ranks)
    elif topk is None:
        new = compute_features(target, rest, layer_ids, progress=progress)
    else:
        new, computed = compute_features_and_targets(
            target, rest, layer_ids, topk, progress=progress
        )
        tensors.update(computed.named_tensors(suffix))
    lengths = [f.shape[0] for f in new]
    tensors[f"features{suffix}"] = torch.cat(new)
    tensors[f"lengths{suffix}"] = torch.tensor(lengths)
    # views into the saved part, so the per-sample copies can go
    return list(torch.split(tensors[f"features{suffix}"], lengths))


def _shared_features(
    target: Any, rest: TrainingData, layer_ids: Sequence[int], progress: bool, ranks: DistInfo
) -> list[torch.Tensor]:
    """The features of ``rest``, each rank computing every ``world``-th sample from its rank,
    then everyone's gathered in order (on the host: a tensor goes back where it was made)."""
    r, w = ranks.rank, ranks.world
    mine = TrainingData(rest.sequences[r::w], rest.prompt_lengths[r::w])
    computed = compute_features(target, mine, layer_ids, progress=progress and r == 0)
    parts = all_objects(ranks, [f.cpu() for f in computed])
    return [parts[j % w][j // w] for j in range(len(rest.sequences))]


def _write_cache(
    path: Path,
    tensors: dict[str, torch.Tensor],
    fixed: dict,
    data: TrainingData,
    n: int,
    topk: TopKSpec | None,
    write: bool = True,
) -> dict:
    """Save ``tensors``, the cache of the first ``n`` samples of ``data``, atomically (unless
    not ``write``: another rank does); its key."""
    key = {
        **fixed,
        "n": n,
        "tokens": int(sum(len(s) for s in data.sequences[:n])),
        "digest": _data_digest(data, n),
        "next_token": None if topk is None else topk.key(),
    }
    if write:
        atomic_write(path, lambda tmp: save_file(tensors, tmp, metadata={"key": json.dumps(key)}))
    return key
