"""A GGUF file's quantized weights as the lean runtime takes them: blocks, not floats.

:func:`read_blocks` maps a Llama-family or Qwen3 GGUF's linear weights (the decoder layers'
projections and the output head) to the transformers parameter names the lean runtime knows, as
:class:`Blocks` (the file's bytes, memory-mapped, with ggml's type id). Llama files store the q
and k projections with their rows permuted for ggml's rotary layout; the rows come back in
transformers' order here, as transformers' own GGUF loader puts them (rows move whole, so blocks
are untouched). :func:`check_blocks` compares a few rows of each weight, de-quantized by the
``gguf`` package, with the model the runtime was built from, so a file that does not hold the
model's weights is refused rather than run. :func:`quantized_blocks` does both for a model
loaded from a file (:func:`gguf_location`, :func:`gguf_source` say which file), where the
quantized kernel runs.
"""

from __future__ import annotations

import json
import logging
import os
import re
import struct
from collections.abc import Iterable
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from ..util.errors import CheckpointError

logger = logging.getLogger(__name__)

__all__ = [
    "Blocks",
    "check_blocks",
    "gguf_location",
    "gguf_source",
    "quantized_blocks",
    "read_blocks",
]

_LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_ARCHITECTURES = ("llama", "qwen3")


class Blocks(NamedTuple):
    """One weight [n, k] in a file's blocks: ``raw`` uint8 [n, bytes per row], ggml type id."""

    raw: np.ndarray
    kind: int
    shape: tuple[int, int]


def _field(reader: Any, key: str) -> Any:
    field = reader.fields.get(key)
    if field is None:
        return None
    value = field.parts[field.data[0]]
    return bytes(value).decode() if field.types and field.types[0].name == "STRING" else value[0]


def _unpermute(rows: np.ndarray, heads: int) -> np.ndarray:
    """Rows of a Llama q or k weight from ggml's rotary order back to transformers' order."""
    half = rows.shape[0] // heads // 2
    order = np.arange(rows.shape[0]).reshape(heads, half, 2).swapaxes(1, 2).reshape(-1)
    return rows[order]


def read_blocks(path: str | os.PathLike[str]) -> dict[str, Blocks]:
    """The linear weights of the GGUF at ``path`` by transformers parameter name
    (``model.layers.3.mlp.up_proj.weight``, ``lm_head.weight``; a file without an output tensor
    ties the head to ``token_embd``). Raises :class:`~caddtree.util.errors.CheckpointError` for a
    file that cannot be read or an architecture other than Llama or Qwen3."""
    import gguf

    try:
        reader = gguf.GGUFReader(os.fspath(path))
    except (OSError, ValueError, KeyError, IndexError, struct.error) as exc:
        raise CheckpointError(f"{path}: not a readable GGUF file ({exc})") from None
    arch = _field(reader, "general.architecture")
    if arch not in _ARCHITECTURES:
        raise CheckpointError(
            f"{path}: its architecture {arch!r} is not one caddtree computes on quantized blocks "
            f"({', '.join(_ARCHITECTURES)}); pass --dequantize to run it in bfloat16"
        )
    heads = _field(reader, f"{arch}.attention.head_count")
    if heads is None:
        raise CheckpointError(f"{path}: no {arch}.attention.head_count in the file's metadata")
    heads = int(heads)
    kv_heads = int(_field(reader, f"{arch}.attention.head_count_kv") or heads)
    out: dict[str, Blocks] = {}
    tensors = {t.name: t for t in reader.tensors}
    for name, tensor in tensors.items():
        found = re.fullmatch(r"blk\.(\d+)\.(\w+)\.weight", name)
        if found and found.group(2) in _LAYER_TENSORS:
            hf = f"model.layers.{found.group(1)}.{_LAYER_TENSORS[found.group(2)]}.weight"
        elif name == "output.weight" or (
            name == "token_embd.weight" and "output.weight" not in tensors
        ):
            hf = "lm_head.weight"
        else:
            continue
        raw = np.asarray(tensor.data).view(np.uint8).reshape(int(tensor.shape[1]), -1)
        if arch == "llama" and found and found.group(2) in ("attn_q", "attn_k"):
            raw = _unpermute(raw, heads if found.group(2) == "attn_q" else kv_heads)
        out[hf] = Blocks(raw, int(tensor.tensor_type), (int(tensor.shape[1]), int(tensor.shape[0])))
    return out


def check_blocks(blocks: dict[str, Blocks], model: Any, rows: int = 4) -> None:
    """Refuse (:class:`~caddtree.util.errors.CheckpointError`) blocks that are not ``model``'s
    weights: every linear weight of the model must be there, of its shape, and its first and last
    ``rows`` rows and 17 rows spread over it (rows of every part of a q or k weight, which a wrong
    head count would un-permute wrongly), de-quantized, must round to the model's values in the
    model's dtype."""
    import gguf

    for name, weight in _linear_weights(model):
        block = blocks.get(name)
        if block is None:
            raise CheckpointError(f"the GGUF file has no tensor for {name}")
        if block.shape != tuple(weight.shape):
            raise CheckpointError(
                f"the GGUF tensor for {name} is {list(block.shape)}, the model's {list(weight.shape)}"
            )
        count = len(block.raw)
        spread = np.linspace(0, count - 1, 17).astype(int)  # every head of a q or k weight
        picked = sorted({*range(min(rows, count)), *range(max(count - rows, 0), count), *spread})
        values = gguf.quants.dequantize(block.raw[picked], gguf.GGMLQuantizationType(block.kind))
        expected = weight[picked].detach().to("cpu", torch.float32)
        if not torch.equal(torch.from_numpy(values).to(weight.dtype).float(), expected):
            raise CheckpointError(
                f"the GGUF tensor for {name} does not hold the model's weights (rows of it "
                "differ); load the model from the same file"
            )


def _linear_weights(model: Any) -> Iterable[tuple[str, torch.Tensor]]:
    for i, layer in enumerate(model.model.layers):
        for suffix in _LAYER_TENSORS.values():
            module = layer.get_submodule(suffix)
            yield f"model.layers.{i}.{suffix}.weight", module.weight
    yield "lm_head.weight", model.lm_head.weight


def gguf_location(
    target: str | os.PathLike[str], gguf_file: str | None
) -> tuple[str | os.PathLike[str], str | None]:
    """``(directory, file name)`` for a target given as the path of a ``.gguf`` file; else the
    arguments as they are."""
    path = Path(target).expanduser()
    if gguf_file is None and path.suffix.lower() == ".gguf" and path.is_file():
        return str(path.parent), path.name
    return target, gguf_file


def gguf_source(target: str | os.PathLike[str], gguf_file: str | None) -> Path | None:
    """The GGUF file a target is read from: ``gguf_file`` in ``target``'s directory, or the file
    the built-in target was converted from (named in its cache marker); else ``None``."""
    from ..util.defaults import CACHE_MARKER

    if gguf_file:
        return Path(target) / gguf_file
    try:
        marker = json.loads((Path(target) / CACHE_MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    source = marker.get("gguf_file") if isinstance(marker, dict) else None
    return Path(source) if isinstance(source, str) and Path(source).is_file() else None


def quantized_blocks(path: Path | None, model: Any) -> dict[str, Any] | None:
    """The quantized weights of the GGUF at ``path`` for ``model`` (checked against it), where
    caddtree's kernel computes them here: a bfloat16 model on a CPU where caddtree's kernels run
    (AVX512-BF16 or AVX2).
    Elsewhere ``None``, with a note of why (the model then runs de-quantized)."""
    from .quantized import QUANT_KINDS, kind_name, quantized_kernel_available

    weight = model.get_input_embeddings().weight
    if path is None or weight.device.type != "cpu" or weight.dtype is not torch.bfloat16:
        return None
    if not quantized_kernel_available():
        logger.warning(
            "%s runs de-quantized to bfloat16: caddtree's quantized kernel needs a CPU with "
            "AVX2 or AVX512-BF16 and a C++ compiler",
            path.name,
        )
        return None
    blocks = read_blocks(path)
    check_blocks(blocks, model)
    others = sorted(
        {kind_name(b.kind) for b in blocks.values() if b.kind not in QUANT_KINDS.values()}
    )
    if others:
        logger.warning(
            "%s: its %s tensors run de-quantized to bfloat16 (caddtree computes %s blocks as "
            "they are); a file of those types runs faster",
            path.name,
            ", ".join(others),
            ", ".join(QUANT_KINDS),
        )
    return blocks
