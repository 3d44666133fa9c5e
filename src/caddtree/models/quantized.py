"""Linear layers computed on GGUF's quantized blocks (Q4_0, Q4_1, Q8_0), on the CPU.

A GGUF file stores most weights in blocks of 32 columns of one output row: integers of 4 or 8
bits with a float16 scale (and, in Q4_1, a float16 minimum). :func:`pack_blocks` lays a weight's
blocks out once for caddtree's kernel (``csrc/linear_q.cpp``; the bytes are the file's, reordered,
plus nothing), and :class:`QuantLinear` multiplies bfloat16 rows by it without ever widening the
weight: each row's inputs are quantized per block to int8 (as llama.cpp does), each block's dot
product is an exact integer sum (AVX512-VNNI; AVX2's byte products in the AVX2 build, to the
same bits), and the float32 sums over blocks are rounded once to bfloat16. A row gets the same bits alone or among others, as with the bfloat16 kernel, so plain
decoding and tree verification agree token for token.

:func:`quantized_unsupported` says why a weight cannot be computed here; the caller then keeps
the bfloat16 path (``--dequantize``).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np
import torch

from .kernels import kernel_available

__all__ = [
    "BLOCK",
    "QUANT_KINDS",
    "QuantLinear",
    "block_bytes",
    "kind_name",
    "pack_blocks",
    "quantized_kernel_available",
    "quantized_unsupported",
]

BLOCK = 32
"""Columns per quantization block."""

GROUP = 32
"""Outputs per group of the packed layout (the last group padded with zero blocks)."""

QUANT_KINDS = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 8}
"""The block formats the kernel computes, by name, with ggml's type id (what the kernel takes)."""

_FILE_BLOCK_BYTES = {2: 18, 3: 20, 8: 34}  # bytes of one block of one row in a GGUF file


def kind_name(kind: int) -> str:
    """``"Q4_1"`` for ggml's type id 3, ``"Q6_K"`` for 14, and so on."""
    import gguf

    try:
        return gguf.GGMLQuantizationType(kind).name
    except ValueError:
        return f"type {kind}"


def block_bytes(kind: int) -> int:
    """Bytes of one column block of one group of 32 outputs in the packed layout."""
    return 64 + (64 if kind == 3 else 0) + (1024 if kind == 8 else 512)


@functools.cache
def quantized_kernel_available() -> bool:
    """Whether the quantized kernel runs here: caddtree's kernels are built and probed (the
    AVX512-BF16 build computes blocks with AVX512-VNNI, which all its CPUs have; the AVX2 build
    with AVX2's byte products, to the same bits)."""
    return kernel_available() and hasattr(torch.ops.caddtree, "linear_q")


def quantized_unsupported(kind: int, shape: tuple[int, int]) -> str | None:
    """Why a weight of ggml type ``kind`` and shape ``[N, K]`` cannot run on the quantized
    kernel here, or ``None`` if it can."""
    if kind not in QUANT_KINDS.values():
        return f"its type {kind_name(kind)} is not one of {', '.join(QUANT_KINDS)}"
    if shape[1] % BLOCK:
        return f"its {shape[1]} input columns are not a whole number of {BLOCK}-column blocks"
    if not quantized_kernel_available():
        return "caddtree's kernels do not run here (they need AVX2 or AVX512-BF16, and g++)"
    return None


def pack_blocks(raw: np.ndarray, kind: int) -> torch.Tensor:
    """A weight's GGUF blocks ``raw`` (uint8 [N, K / 32 * block size], rows in output order) laid
    out for :class:`QuantLinear`: uint8 [ceil(N / 32), K / 32, :func:`block_bytes`] (see
    ``csrc/linear_q.cpp`` for the layout)."""
    if kind not in _FILE_BLOCK_BYTES:
        raise ValueError(f"cannot pack {kind_name(kind)} blocks")
    size = _FILE_BLOCK_BYTES[kind]
    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    n = raw.shape[0]
    if raw.ndim != 2 or raw.shape[1] % size:
        raise ValueError(
            f"{kind_name(kind)} rows must be whole {size}-byte blocks, got {raw.shape}"
        )
    nb = raw.shape[1] // size
    groups = -(-n // GROUP)
    blocks = np.zeros((groups * GROUP, nb, size), dtype=np.uint8)  # padding: zero scales
    blocks[:n] = raw.reshape(n, nb, size)
    blocks = blocks.reshape(groups, GROUP, nb, size).transpose(0, 2, 1, 3)  # [G, nb, 32, size]
    scales = blocks[..., : 4 if kind == 3 else 2]
    parts = [scales[..., 0:2].reshape(groups, nb, 64)]  # d of the 32 outputs
    if kind == 3:
        parts.append(scales[..., 2:4].reshape(groups, nb, 64))  # m of the 32 outputs
    ints = blocks[..., 4 if kind == 3 else 2 :]
    if kind == 8:
        ints = ints ^ np.uint8(0x80)  # signed q as unsigned q + 128
    steps = ints.shape[-1] // 4  # 4-byte columns per output: 4 (Q4), 8 (Q8)
    ints = ints.reshape(groups, nb, 2, 16, steps, 4).transpose(0, 1, 2, 4, 3, 5)
    parts.append(ints.reshape(groups, nb, -1))
    return torch.from_numpy(np.ascontiguousarray(np.concatenate(parts, -1)))


class QuantLinear(NamedTuple):
    """A linear layer over a :func:`pack_blocks` weight: ``x`` bfloat16 [..., K] -> [..., n]."""

    packed: torch.Tensor
    kind: int
    n: int
    bias: torch.Tensor | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.caddtree.linear_q(x, self.packed, self.kind, self.n, self.bias)
