"""Weights written as GGUF's K-format blocks (Q4_K, Q5_K, Q6_K), which the gguf package reads
but does not write: a plain round-to-nearest quantizer per super-block of 256 columns, enough to
make valid blocks of realistic values for the kernel's tests (llama.cpp's quantizer searches its
scales; the file layout is the same)."""

from __future__ import annotations

import numpy as np

SUPER = 256


def _f16(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16)


def _f16_bytes(values: np.ndarray) -> np.ndarray:
    return _f16(values)[..., None].view(np.uint8)


def _k_scale_bytes(scales: np.ndarray, mins: np.ndarray) -> np.ndarray:
    """8 six-bit scales and minimums [..., 8] packed into Q4_K's 12 bytes."""
    a = (scales[..., :4] & 63) | ((scales[..., 4:] >> 4) << 6)
    b = (mins[..., :4] & 63) | ((mins[..., 4:] >> 4) << 6)
    c = (scales[..., 4:] & 0x0F) | ((mins[..., 4:] & 0x0F) << 4)
    return np.concatenate([a, b, c], -1).astype(np.uint8)


def _scaled_minimum(w: np.ndarray, levels: int):
    """Per block of 32 (w [n, count, 8, 32]): integers u in 0..levels, six-bit scales and
    minimums, and the float16 d and dmin of each super-block."""
    low = np.minimum(w.min(-1), 0)
    step = (w.max(-1) - low) / levels
    d = _f16(step.max(-1) / 63).astype(np.float32)
    dmin = _f16(-low.min(-1) / 63).astype(np.float32)
    safe = np.where(d == 0, 1, d)[..., None]
    scales = np.clip(np.rint(step / safe), 0, 63).astype(np.uint8)
    mins = np.clip(np.rint(-low / np.where(dmin == 0, 1, dmin)[..., None]), 0, 63).astype(np.uint8)
    dw = (d[..., None] * scales)[..., None]
    mw = (dmin[..., None] * mins)[..., None]
    u = np.clip(np.rint((w + mw) / np.where(dw == 0, 1, dw)), 0, levels).astype(np.uint8)
    return u, scales, mins, d, dmin


def quantize_k(weight: np.ndarray, name: str) -> np.ndarray:
    """``weight`` float [n, k] (k a multiple of 256) as the blocks of ``name`` (``"Q4_K"``,
    ``"Q5_K"``, ``"Q6_K"``): uint8 [n, k / 256 * block bytes]."""
    n, k = weight.shape
    if k % SUPER:
        raise ValueError(f"{name} needs whole {SUPER}-column super-blocks, got {k} columns")
    w = weight.astype(np.float32).reshape(n, k // SUPER, 8, 32)
    if name == "Q6_K":
        return _q6_k(w.reshape(n, k // SUPER, 16, 16)).reshape(n, -1)
    levels = 15 if name == "Q4_K" else 31
    u, scales, mins, d, dmin = _scaled_minimum(w, levels)
    chunks = u.reshape(n, k // SUPER, 4, 2, 32)  # [chunk of 64, low/high half, l]
    nibbles = (chunks[..., 0, :] & 0x0F) | ((chunks[..., 1, :] & 0x0F) << 4)
    parts = [_f16_bytes(d), _f16_bytes(dmin), _k_scale_bytes(scales, mins)]
    if name == "Q5_K":
        bits = (chunks >> 4).reshape(n, k // SUPER, 8, 32).transpose(0, 1, 3, 2)  # [.., l, 2c+h]
        parts.append(np.packbits(bits, axis=-1, bitorder="little")[..., 0])
    parts.append(nibbles.reshape(n, k // SUPER, 128))
    return np.concatenate([p.reshape(n, k // SUPER, -1) for p in parts], -1).reshape(n, -1)


def _q6_k(w: np.ndarray) -> np.ndarray:
    """Q6_K from w [n, count, 16, 16]: int8 scales per 16 columns under a float16 d, negative
    where the group's largest magnitude is positive (which maps it to -32, as llama.cpp's
    quantizer does), so both signs of scale occur."""
    n, count = w.shape[:2]
    largest = np.take_along_axis(w, np.abs(w).argmax(-1)[..., None], -1)[..., 0]
    step = -largest / 32
    d = _f16(np.abs(step).max(-1) / 127).astype(np.float32)
    scales = np.clip(np.rint(step / np.where(d == 0, 1, d)[..., None]), -128, 127)
    dw = (d[..., None] * scales)[..., None]
    u = np.clip(np.rint(w / np.where(dw == 0, 1, dw)) + 32, 0, 63).astype(np.uint8)
    u = u.reshape(n, count, 2, 4, 32)  # [half, j, l]: column 128 half + 32 j + l
    low = (u[:, :, :, 0:2] & 0x0F) | ((u[:, :, :, 2:4] & 0x0F) << 4)  # runs 0, 1
    high = sum(((u[:, :, :, j] >> 4) << (2 * j)) for j in range(4)).astype(np.uint8)
    parts = [
        low.reshape(n, count, 128),
        high.reshape(n, count, 64),
        scales.astype(np.int8).view(np.uint8).reshape(n, count, 16),
        _f16_bytes(d).reshape(n, count, 2),
    ]
    return np.concatenate(parts, -1).reshape(n, -1)
