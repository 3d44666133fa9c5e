"""Stage 2 of drafter training: the target's context features (hidden states after
``target_layer_ids``) of every token of every sample, computed once (:func:`compute_features`) and
cached in ``features.safetensors`` under a key of the layers, the data and the target
(:func:`cached_features`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from ..files import atomic_write
from ..models.target import extract_context_features
from .data import TrainingData, target_fingerprint

__all__ = ["cached_features", "compute_features"]


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


def cached_features(target, data, layer_ids, path: Path, progress: bool) -> list[torch.Tensor]:
    """The context features of ``data`` from ``path`` when it holds them for these layers, this
    data (sample and token counts) and this target (:func:`target_fingerprint`); otherwise
    computed (:func:`compute_features`) and saved there."""
    key = json.dumps(
        {
            "layers": list(layer_ids),
            "n": len(data.sequences),
            "tokens": int(sum(len(s) for s in data.sequences)),
            **target_fingerprint(target),
        }
    )
    if path.is_file():
        from safetensors import safe_open

        with safe_open(path, framework="pt") as fh:
            if (fh.metadata() or {}).get("key") == key:
                tensors = load_file(path)
                return list(torch.split(tensors["features"], tensors["lengths"].tolist()))
    feats = compute_features(target, data, layer_ids, progress=progress)
    flat = torch.cat(feats)
    lengths = torch.tensor([f.shape[0] for f in feats])
    atomic_write(
        path,
        lambda tmp: save_file({"features": flat, "lengths": lengths}, tmp, metadata={"key": key}),
    )
    return feats
