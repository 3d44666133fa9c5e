"""Stage 2 of drafter training: the target's context features (hidden states after
``target_layer_ids``) of every token of every sample, computed once (:func:`compute_features`) and
cached in ``features.safetensors`` under a key of the layers, the data and the target
(:func:`cached_features`). When the data grows by appending samples, only the new samples'
features are computed; the file then holds one part per extension (:func:`load_features`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from ..models.target import extract_context_features
from ..util.files import atomic_write
from .data import TrainingData, target_fingerprint

__all__ = ["cached_features", "compute_features", "load_features"]


@torch.inference_mode()
def compute_features(
    target: Any,
    data: TrainingData,
    layer_ids: Sequence[int],
    *,
    max_batch_tokens: int = 4096,
    progress: bool = True,
) -> list[torch.Tensor]:
    """Context features [T, k*H] of every sequence (stored in the target's dtype, on the CPU).

    Sequences of similar length run together, right-padded to the longest, up to
    ``max_batch_tokens`` tokens per forward: under causal attention a position never sees the
    padding after it, so each row's features are those of the sequence alone.
    """
    from tqdm.auto import tqdm

    device = target.get_input_embeddings().weight.device
    select = [i + 1 for i in layer_ids]
    order = sorted(range(len(data.sequences)), key=lambda i: len(data.sequences[i]))
    feats: list[torch.Tensor | None] = [None] * len(order)
    bar = tqdm(total=len(order), desc="context features", unit="seq", disable=not progress)
    start = 0
    while start < len(order):
        # sorted by length, so the last sequence of a batch is its longest
        end = start + 1
        while end < len(order) and (end - start + 1) * len(data.sequences[order[end]]) <= (
            max_batch_tokens
        ):
            end += 1
        idx = order[start:end]
        width = len(data.sequences[idx[-1]])
        ids = torch.zeros((len(idx), width), dtype=torch.long)
        for row, i in enumerate(idx):
            ids[row, : len(data.sequences[i])] = data.sequences[i]
        # the decoder alone: the lm_head's logits over the vocabulary are not needed here
        out = target.get_decoder()(
            input_ids=ids.to(device), output_hidden_states=select, use_cache=False
        )
        batch = extract_context_features(out.hidden_states, layer_ids).cpu()
        for row, i in enumerate(idx):
            feats[i] = batch[row, : len(data.sequences[i])].clone()
        bar.update(len(idx))
        start = end
    bar.close()
    return feats


def _data_digest(data: TrainingData, n: int) -> str:
    """A digest of the first ``n`` samples' tokens (what their cached features were computed
    from)."""
    digest = hashlib.sha256()
    for seq in data.sequences[:n]:
        digest.update(len(seq).to_bytes(8, "little"))
        digest.update(seq.to(torch.int32).numpy().tobytes())
    return digest.hexdigest()


def _parts(tensors: dict[str, torch.Tensor]) -> list[tuple[str, str]]:
    """The (features, lengths) tensor names of a cache file's parts, in order."""
    names = [("features", "lengths")]
    while f"features.{len(names)}" in tensors:
        names.append((f"features.{len(names)}", f"lengths.{len(names)}"))
    return names


def _samples(tensors: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """Every sample's features (views) in a cache file's tensors, in sample order."""
    return [
        f
        for feats, lengths in _parts(tensors)
        for f in torch.split(tensors[feats], tensors[lengths].tolist())
    ]


def load_features(path: str | Path) -> list[torch.Tensor]:
    """Every sample's context features from a ``features.safetensors`` file, in sample order."""
    return _samples(load_file(path))


def _cache_key(path: Path) -> dict:
    from safetensors import safe_open

    with safe_open(path, framework="pt") as fh:
        key = json.loads((fh.metadata() or {}).get("key", "{}"))
    return key if isinstance(key, dict) else {}


def cached_features(target, data, layer_ids, path: Path, progress: bool) -> list[torch.Tensor]:
    """The context features of ``data``, read from ``path`` as far as it holds them and computed
    (:func:`compute_features`) for the rest.

    A cache is used when it was made for these layers and this target
    (:func:`target_fingerprint`) from the first samples of ``data`` (same samples, checked by a
    digest of their tokens; files written before the digest existed are checked by their token
    count): then only the samples appended since are computed and added to the file as a new
    part. Anything else is computed afresh and replaces the file.
    """
    fixed = {"layers": list(layer_ids), **target_fingerprint(target)}
    tensors: dict[str, torch.Tensor] = {}
    reused: list[torch.Tensor] = []
    try:
        key = _cache_key(path) if path.is_file() else {}
        n = key.get("n")
        if (
            {k: key.get(k) for k in fixed} == fixed
            and isinstance(n, int)
            and 0 < n <= len(data.sequences)
            and key.get("tokens") == int(sum(len(s) for s in data.sequences[:n]))
            # files from before the digest have none; their token count was checked above
            and key.get("digest") in (None, _data_digest(data, n))
        ):
            tensors = load_file(path)
            reused = _samples(tensors)
            if len(reused) != n:  # a damaged file: start again
                tensors, reused = {}, []
    except Exception:  # an unreadable cache is only lost work: compute the features again
        tensors, reused = {}, []
    if len(reused) == len(data.sequences):
        return reused
    rest = TrainingData(data.sequences[len(reused) :], data.prompt_lengths[len(reused) :])
    new = compute_features(target, rest, layer_ids, progress=progress)
    part = len(_parts(tensors)) if tensors else 0
    suffix = f".{part}" if part else ""
    lengths = [f.shape[0] for f in new]
    tensors[f"features{suffix}"] = torch.cat(new)
    tensors[f"lengths{suffix}"] = torch.tensor(lengths)
    # views into the saved part, so the per-sample copies can go
    new = list(torch.split(tensors[f"features{suffix}"], lengths))
    n = len(data.sequences)
    key = {
        **fixed,
        "n": n,
        "tokens": int(sum(len(s) for s in data.sequences)),
        "digest": _data_digest(data, n),
    }
    atomic_write(path, lambda tmp: save_file(tensors, tmp, metadata={"key": json.dumps(key)}))
    return reused + new
