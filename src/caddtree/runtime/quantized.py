"""Linear layers computed on GGUF's quantized blocks, on the CPU: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0
and the K formats of Q4_K_M, Q5_K_M and Q6_K files (Q4_K, Q5_K, Q6_K).

A GGUF file stores most weights in blocks of 32 columns of one output row: integers of 4 to 8
bits with a float16 scale (and, in Q4_1 and Q5_1, a float16 minimum); the K formats group 8 or 16
such blocks under one float16 scale with small integer scales per block. :func:`pack_blocks` lays
a weight's blocks out once for caddtree's kernel (``csrc/linear_q.cpp``): Q4_0, Q4_1, Q5_0, Q5_1 and
Q8_0 as the file's bytes, reordered (5-bit integers as nibbles plus a word of fifth bits);
Q6_K's integers widened to a byte each; the K formats' block scales multiplied out to float32
(exact). And :class:`QuantLinear` multiplies bfloat16 rows by it without ever widening the
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
    "QuantStack",
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

QUANT_KINDS = {
    "Q4_0": 2,
    "Q4_1": 3,
    "Q5_0": 6,
    "Q5_1": 7,
    "Q8_0": 8,
    "Q4_K": 12,
    "Q5_K": 13,
    "Q6_K": 14,
}
"""The block formats the kernel computes, by name, with ggml's type id (what the kernel takes)."""


class _Format(NamedTuple):
    file_bytes: int  # bytes of one block of one row in a GGUF file
    columns: int  # columns of that block (32, or a K format's 256)
    arrays: int  # scale arrays in the packed layout: d, and m or a second d
    scale_bytes: int  # 2 (float16) or 4 (float32)
    nibbles: bool  # integers packed 4 bits each (else one byte each)
    fifth_bits: bool = False  # nibbles plus a 32-bit word of fifth bits per output and block


_FORMATS = {
    2: _Format(18, 32, 1, 2, True),
    3: _Format(20, 32, 2, 2, True),
    6: _Format(22, 32, 1, 2, True, True),
    7: _Format(24, 32, 2, 2, True, True),
    8: _Format(34, 32, 1, 2, False),
    12: _Format(144, 256, 2, 4, True),
    13: _Format(176, 256, 2, 4, True, True),
    14: _Format(210, 256, 2, 4, False),
}


def kind_name(kind: int) -> str:
    """``"Q4_1"`` for ggml's type id 3, ``"Q6_K"`` for 14, and so on."""
    import gguf

    try:
        return gguf.GGMLQuantizationType(kind).name
    except ValueError:
        return f"type {kind}"


def block_bytes(kind: int) -> int:
    """Bytes of one column block of one group of 32 outputs in the packed layout."""
    fmt = _FORMATS[kind]
    ints = 512 if fmt.nibbles else 1024
    return 32 * fmt.arrays * fmt.scale_bytes + ints + (128 if fmt.fifth_bits else 0)


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
    columns = _FORMATS[kind].columns
    if shape[1] % columns:
        return f"its {shape[1]} input columns are not a whole number of {columns}-column blocks"
    if not quantized_kernel_available():
        return "caddtree's kernels do not run here (they need AVX2 or AVX512-BF16, and g++)"
    return None


def pack_blocks(raw: np.ndarray, kind: int) -> torch.Tensor:
    """A weight's GGUF blocks ``raw`` (uint8 [N, bytes per row], rows in output order) laid out
    for :class:`QuantLinear`: uint8 [ceil(N / 32), K / 32, :func:`block_bytes`] (see
    ``csrc/linear_q.cpp`` for the layout)."""
    if kind not in _FORMATS:
        raise ValueError(f"cannot pack {kind_name(kind)} blocks")
    fmt = _FORMATS[kind]
    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    if raw.ndim != 2 or raw.shape[1] % fmt.file_bytes:
        raise ValueError(
            f"{kind_name(kind)} rows must be whole {fmt.file_bytes}-byte blocks, got {raw.shape}"
        )
    n = raw.shape[0]
    blocks = _blocks_of_32(raw.reshape(n, -1, fmt.file_bytes), kind)  # [n, K / 32, size]
    nb, size = blocks.shape[1:]
    groups = -(-n // GROUP)
    padded = np.zeros((groups * GROUP, nb, size), dtype=np.uint8)  # padding: zero scales
    padded[:n] = blocks
    padded = padded.reshape(groups, GROUP, nb, size).transpose(0, 2, 1, 3)  # [G, nb, 32, size]
    width = fmt.scale_bytes
    parts = [  # each scale array: its 32 outputs' values in a row
        padded[..., a * width : (a + 1) * width].reshape(groups, nb, 32 * width)
        for a in range(fmt.arrays)
    ]
    head, ints = fmt.arrays * width, 16 if fmt.nibbles else 32
    steps = ints // 4  # 4-byte columns per output: 4 (nibbles), 8 (bytes)
    loads = padded[..., head : head + ints].reshape(groups, nb, 2, 16, steps, 4)
    parts.append(loads.transpose(0, 1, 2, 4, 3, 5).reshape(groups, nb, -1))
    if fmt.fifth_bits:  # each half's 16 words in a row
        parts.append(padded[..., head + ints :].reshape(groups, nb, 128))
    return torch.from_numpy(np.ascontiguousarray(np.concatenate(parts, -1)))


def _blocks_of_32(blocks: np.ndarray, kind: int) -> np.ndarray:
    """A weight's file blocks ``[n, count, file bytes]`` as blocks of 32 columns in the packed
    layout's terms, ``[n, K / 32, scale arrays + integers]``: the scales (float16 or float32) as
    bytes, then the integers u: 16 bytes of nibbles in Q4_0's order (column i low, i + 16 high)
    and, in 5-bit formats, a little-endian 32-bit word of fifth bits (bit i: column i); or 32
    bytes (Q8_0's signed q as u = q + 128)."""
    if kind in (2, 3):
        return blocks  # the file's blocks are these
    if kind == 8:
        out = blocks.copy()
        out[..., 2:] ^= np.uint8(0x80)
        return out
    if kind in (6, 7):  # d (m) | fifth bits | nibbles: the same bytes, the word last
        head = 4 if kind == 7 else 2
        return np.concatenate(
            [blocks[..., :head], blocks[..., head + 4 :], blocks[..., head : head + 4]], -1
        )
    if kind == 14:
        return _q6_k(blocks)
    return _q45_k(blocks, fifth_bits=kind == 13)


def _join(scales: list[np.ndarray], ints: np.ndarray) -> np.ndarray:
    """Per-block scale values (each [n, nb], float16 or float32) and integers [n, nb, bytes]
    as one byte array [n, nb, size]."""
    parts = [np.ascontiguousarray(a).view(np.uint8).reshape(*a.shape, -1) for a in scales]
    return np.concatenate([*parts, ints.astype(np.uint8)], -1)


def _k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 8 six-bit scales and minimums [..., 8] of a Q4_K or Q5_K super-block's 12 bytes."""
    a, b, c = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    scales = np.concatenate([a & 63, (c & 0x0F) | ((a >> 6) << 4)], -1)
    mins = np.concatenate([b & 63, (c >> 4) | ((b >> 6) << 4)], -1)
    return scales, mins


def _f16(blocks: np.ndarray, at: int) -> np.ndarray:
    return blocks[..., at : at + 2].copy().view(np.float16)[..., 0].astype(np.float32)


def _q45_k(blocks: np.ndarray, fifth_bits: bool) -> np.ndarray:
    """Q4_K (d, dmin, 12 bytes of scales, 128 of nibbles) and Q5_K (the same with 32 bytes of
    fifth bits before the nibbles) per block of 32: dw = d * scale, mw = -dmin * min, u."""
    n, count = blocks.shape[:2]
    scales, mins = _k_scales(blocks[..., 4:16])
    dw = _f16(blocks, 0)[..., None] * scales  # exact: 11 bits times 6
    mw = -(_f16(blocks, 2)[..., None] * mins)
    nibbles = blocks[..., -128:].reshape(n, count, 4, 32)  # 4 chunks of 64 columns
    u = np.stack([nibbles & 0x0F, nibbles >> 4], 3).reshape(n, count * 8, 32)  # block, column
    ints = [u[..., :16] | (u[..., 16:] << 4)]
    if fifth_bits:  # byte l's bit j: column l of block j of the super-block
        bits = np.unpackbits(blocks[..., 16:48, None], axis=-1, bitorder="little")  # [.., 32, 8]
        words = np.packbits(bits.transpose(0, 1, 3, 2), axis=-1, bitorder="little")  # [.., 8, 4]
        ints.append(words.reshape(n, count * 8, 4))
    return _join([dw.reshape(n, -1), mw.reshape(n, -1)], np.concatenate(ints, -1))


def _q6_k(blocks: np.ndarray) -> np.ndarray:
    """Q6_K (128 bytes of low nibbles, 64 of 2-bit highs, 16 int8 scales, d) per block of 32:
    dw0, dw1 = d * scale of columns 0..15 and 16..31, and u (w = dw (u - 32))."""
    n, count = blocks.shape[:2]
    low = blocks[..., :128].reshape(n, count, 2, 2, 32)  # [half, 32-byte run, l]
    high = blocks[..., 128:192].reshape(n, count, 2, 1, 32)
    nibble = np.stack([low & 0x0F, low >> 4], 3).reshape(n, count, 2, 4, 32)  # columns 32j + l
    shifts = np.array([0, 2, 4, 6], dtype=np.uint8)[:, None]
    u = nibble | (((high >> shifts) & 3) << 4)  # [n, count, half, j, l]: column 128 half + 32 j + l
    scale = blocks[..., 192:208].view(np.int8).astype(np.float32) * _f16(blocks, 208)[..., None]
    scale = scale.reshape(n, count * 8, 2)
    return _join([scale[..., 0], scale[..., 1]], u.reshape(n, count * 8, 32))


class QuantLinear(NamedTuple):
    """A linear layer over a :func:`pack_blocks` weight: ``x`` bfloat16 [..., K] -> [..., n]."""

    packed: torch.Tensor
    kind: int
    n: int
    bias: torch.Tensor | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.caddtree.linear_q(x, self.packed, self.kind, self.n, self.bias)

    @property
    def kinds(self) -> tuple[int, ...]:
        return (self.kind,)


class QuantStack(NamedTuple):
    """Linear layers on blocks of different formats computed side by side, their outputs
    concatenated: a fused linear whose parts a file stores in different types (a Q4_K_M file's
    q and k projections in Q4_K, its v in Q6_K)."""

    parts: tuple[QuantLinear, ...]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([part(x) for part in self.parts], -1)

    @property
    def kinds(self) -> tuple[int, ...]:
        return tuple(part.kind for part in self.parts)
