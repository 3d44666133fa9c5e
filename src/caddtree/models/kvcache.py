"""A KV cache whose full-attention layers write into room reserved for the whole generation.

transformers' ``DynamicLayer`` appends with ``torch.cat``: each round copies the layer's whole
cache into a fresh tensor one round larger and frees the old one. The allocator is left a trail of
freed blocks that are each a little too small for the next request, and it keeps them: a long
generation peaks well above what its cache holds (``benchmarks/long_generation.py``), and
glibc's own fixed mmap threshold (no heap reuse) trims that excess only at a large cost in time.

A :class:`ReservedLayer` instead asks for room for ``capacity`` positions once (the prompt, every
token the call may add, and the largest tree) and writes each round's keys and values in place
after the last entry; ``keys``/``values`` are views of the buffers' first ``length`` positions,
which is all attention, :func:`~caddtree.models.target.compact_cache` and ``crop`` see. Pages of
``torch.empty`` that were never written cost no memory on Linux, so the process grows with the
positions used, not with the room reserved. Should a call outgrow its room, the buffers move to
ones half as large again (amortised O(1) copies per token); anything that replaces ``keys`` or
``values`` with other tensors (offloading, batch selection) is noticed, and the buffers are rebuilt
from them.

:func:`reserved_cache` builds a ``DynamicCache`` of them. The verifier reserves on the CPU only:
on a GPU the room would be real memory taken up front, and the caching allocator already reuses
freed blocks.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

__all__ = ["ReservedLayer", "return_freed_memory", "reserved_cache"]


class _Slab:
    """The reserved room of every layer of one cache in a single allocation: large enough that
    the allocator maps it on its own (glibc does from 32 MiB) and hands it back to the system
    when the cache is dropped, instead of keeping per-layer blocks on its heap."""

    def __init__(self, layers: int, capacity: int) -> None:
        self.layers, self.capacity = layers, capacity
        self.memory: torch.Tensor | None = None
        self.asked = 0
        self.failed = False  # the room could not be had: layers grow as they fill instead

    def buffers(self, index: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Keys and values buffers of layer ``index`` for states like ``like`` ([..., T, D]), or
        ``None`` when this layer's states differ from the first layer's or every layer has asked
        already (the layer then reserves its own room). Once every layer has asked, the slab
        holds no reference of its own: the layers' views alone keep it alive."""
        if self.asked >= self.layers:
            return None
        self.asked += 1
        shape = (*like.shape[:-2], self.capacity, like.shape[-1])
        if self.memory is None:
            try:
                self.memory = like.new_empty((self.layers, 2, *shape))
            except (RuntimeError, MemoryError):  # more room than the system will map
                self.asked, self.failed = self.layers, True
                return None
        memory = self.memory
        if self.asked == self.layers:
            self.memory = None
        if memory.shape[2:] != shape or memory.dtype != like.dtype or memory.device != like.device:
            return None
        return memory[index, 0], memory[index, 1]


class ReservedLayer(DynamicLayer):
    """A full-attention ``DynamicLayer`` that appends in place into buffers with room for
    ``capacity`` positions (see the module docstring), taken from ``slab`` when given."""

    def __init__(self, capacity: int = 0, slab: _Slab | None = None, index: int = 0) -> None:
        super().__init__()
        self.capacity, self._slab, self._index = int(capacity), slab, index
        self._buffers: tuple[torch.Tensor, torch.Tensor] | None = None

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
            self._buffers = None
        length = self.get_seq_length()
        end = length + key_states.shape[-2]
        if not self._fits(key_states, value_states, end):
            first = self._buffers is None
            reserved = None
            if first and self._slab is not None and end <= self.capacity:
                reserved = self._slab.buffers(self._index, key_states)
            if reserved is None:
                reserve = first and not (self._slab is not None and self._slab.failed)
                capacity = max(self.capacity if reserve else 0, end + end // 2)
                reserved = tuple(
                    new.new_empty((*new.shape[:-2], capacity, new.shape[-1]))
                    for new in (key_states, value_states)
                )
            for old, buffer in zip((self.keys, self.values), reserved):
                if length:
                    buffer[..., :length, :] = old
            self._buffers = (reserved[0], reserved[1])
        key_buffer, value_buffer = self._buffers
        key_buffer[..., length:end, :] = key_states
        value_buffer[..., length:end, :] = value_states
        self.keys = key_buffer[..., :end, :]
        self.values = value_buffer[..., :end, :]
        return self.keys, self.values

    def _fits(self, key_states: torch.Tensor, value_states: torch.Tensor, end: int) -> bool:
        """Whether the buffers exist, still back ``keys``/``values``, and have room up to ``end``
        for states of this shape, dtype and device."""
        if self._buffers is None:
            return False
        for view, buffer, new in zip(
            (self.keys, self.values), self._buffers, (key_states, value_states)
        ):
            if (
                buffer.shape[-2] < end
                or buffer.shape[:-2] != new.shape[:-2]
                or buffer.shape[-1] != new.shape[-1]
                or buffer.dtype != new.dtype
                or buffer.device != new.device
            ):
                return False
            if view.numel() and (
                view.data_ptr() != buffer.data_ptr() or view.stride() != buffer.stride()
            ):
                return False
        return True

    def reset(self) -> None:
        self._buffers = None
        super().reset()


def reserved_cache(config: Any, capacity: int) -> DynamicCache:
    """A ``DynamicCache`` for a model with ``config`` whose full-attention layers are
    :class:`ReservedLayer` s with room for ``capacity`` positions, all in one allocation (layers
    of other kinds, such as sliding windows, are kept as transformers made them)."""
    cache = DynamicCache(config=config)
    slab = _Slab(len(cache.layers), capacity)
    cache.layers = [
        ReservedLayer(capacity, slab, i) if type(layer) is DynamicLayer else layer
        for i, layer in enumerate(cache.layers)
    ]
    return cache


@functools.cache
def _malloc_trim() -> Any:
    """glibc's ``malloc_trim``, or ``None`` where the C library has none (macOS, musl, Windows)."""
    with contextlib.suppress(OSError, AttributeError, TypeError):
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc.malloc_trim
    return None


def return_freed_memory() -> None:
    """Hand the heap memory that a long generation freed back to the system.

    A long generation's short-lived allocations grow with the context (``benchmarks/
    long_generation.py`` measures them), and glibc keeps what they freed on its heap for reuse,
    so the process stays well above its level after such a call. ``malloc_trim(0)`` returns those
    pages; where there is no such call this does nothing.
    """
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
