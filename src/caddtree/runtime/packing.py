"""Linear layers whose weights are laid out once for oneDNN, on the CPU.

On the CPU, ``torch.nn.functional.linear`` in bfloat16 or float32 hands each call to oneDNN with
the weight in PyTorch's row-major layout, and oneDNN re-lays it out into its blocked format on
every call: for a small model that copy is most of a layer's time. :func:`pack_linear_layers`
does it once per ``nn.Linear`` (``torch.ops.mkldnn._reorder_linear_weight``, the packing
PyTorch's own compiler applies to frozen CPU models) and has the layer call the packed weight
(``torch.ops.mkldnn._linear_pointwise``); ``benchmarks/packed_linear.py`` measures the
forwards with and without it.

A packed layer stays an ``nn.Linear``: its parameters, ``state_dict`` and tied weights are
untouched, and the packed copy lives beside them (one more copy of each packed weight in memory).
The layer falls back to the ordinary ``F.linear`` whenever the packed copy may not be what the
parameter holds (the weight was changed in place, replaced or moved, or its dtype changed), when
the input is on another device or in another dtype, and when autograd needs the graph (gradients
enabled and the input or weight requires them): training through a packed layer is exact.

Packing applies to CPU layers in bfloat16 or float32 only (oneDNN has no float64 kernels), not to
weights created under ``torch.inference_mode()`` (they keep no version counter), and
only where this PyTorch build has the operators and they reproduce ``F.linear`` on a probe input;
elsewhere layers are left as they are. It is skipped, with a warning, when the packed copies would
take more than half the memory the system has available (``MemAvailable``): a model that fills
the machine runs slower rather than not at all.
"""

from __future__ import annotations

import logging
import types
from collections.abc import Iterable
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from .kernels import GROUP, pack_rows, rows_apply, rows_linear

__all__ = [
    "available_memory",
    "pack_linear_layers",
    "pack_weight",
    "packed_linear",
    "packed_linear_count",
    "packing_fits",
    "unpack_linear_layers",
]

logger = logging.getLogger(__name__)

PACKABLE_DTYPES = (torch.bfloat16, torch.float32)
_STATE = "_caddtree_packed"
# float32 packed outputs may differ from plain ones in the last bits (another summation order);
# a probe outside these tolerances means a broken kernel.
_PROBE_TOLERANCE = {torch.bfloat16: 2e-2, torch.float32: 1e-4}


class _Packed(NamedTuple):
    weight: torch.Tensor  # oneDNN's blocked copy (same dtype as the parameter)
    version: int  # the parameter's in-place version counter when packed
    data_ptr: int


def _packed_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    state: _Packed = getattr(self, _STATE)
    weight = self.weight
    dtype = state.weight.dtype
    if (
        x.dtype is dtype
        and x.device.type == "cpu"
        and weight._version == state.version
        and weight.data_ptr() == state.data_ptr
        and weight.dtype is dtype
        and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
    ):
        return packed_linear(x, state.weight, self.bias, self.out_features)
    return F.linear(x, weight, self.bias)


def _pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach())


def _kernels_work(dtype: torch.dtype) -> bool:
    """Whether this build packs ``dtype`` and its packed linear matches ``F.linear`` on a probe."""
    try:
        if not torch.backends.mkldnn.is_available():
            return False
        generator = torch.Generator().manual_seed(0)
        weight = torch.randn(24, 40, generator=generator).to(dtype)
        bias = torch.randn(24, generator=generator).to(dtype)
        x = torch.randn(3, 5, 40, generator=generator).to(dtype)
        with torch.no_grad():
            packed = torch.ops.mkldnn._linear_pointwise(x, _pack(weight), bias, "none", [], "")
            plain = F.linear(x, weight, bias)
        return bool(
            packed.shape == plain.shape
            and torch.allclose(packed.float(), plain.float(), rtol=0, atol=_PROBE_TOLERANCE[dtype])
        )
    except (RuntimeError, AttributeError, NotImplementedError) as exc:
        logger.debug("oneDNN weight packing unavailable for %s: %s", dtype, exc)
        return False


_WORKS: dict[torch.dtype, bool] = {}


def _kernel_packs(weight: torch.Tensor) -> bool:
    """Whether this build's packed kernel serves ``weight``: on the CPU, in a packable dtype, and
    checked against ``F.linear`` on a probe (once per dtype)."""
    if weight.device.type != "cpu" or weight.dtype not in PACKABLE_DTYPES or weight.is_meta:
        return False
    if weight.dtype not in _WORKS:
        _WORKS[weight.dtype] = _kernels_work(weight.dtype)
    return _WORKS[weight.dtype]


def packing_fits(needed: int, what: str, memory_limit: int | None = None) -> bool:
    """Whether packed copies of ``needed`` bytes may be made: at most ``memory_limit`` bytes
    (default: half of :func:`available_memory`). If not, a warning names ``what`` is left
    unpacked."""
    if memory_limit is None:
        available = available_memory()
        memory_limit = available // 2 if available is not None else needed
    if needed <= memory_limit:
        return True
    logger.warning(
        "not packing %s for oneDNN: the packed copies would take %.1f GiB, more than the %.1f "
        "GiB allowed (by default half the available memory); decoding on the CPU runs slower "
        "without them",
        what,
        needed / 2**30,
        memory_limit / 2**30,
    )
    return False


def pack_weight(weight: torch.Tensor, *, padded: bool = True) -> torch.Tensor | None:
    """A packed copy of a linear ``weight`` [out, in] for :func:`packed_linear`: laid out for
    caddtree's own bfloat16 kernel where it applies (:func:`~caddtree.runtime.kernels.pack_rows`;
    with ``padded`` false, only where ``out`` is a whole number of its row groups, so that no call
    needs to say ``out_features``), else for oneDNN; ``None`` where packing does not apply (not on
    the CPU, another dtype, no working kernel)."""
    if padded or weight.shape[0] % GROUP == 0:
        rows = pack_rows(weight)
        if rows is not None:
            return rows
    if not _kernel_packs(weight):
        return None
    with torch.no_grad():
        return _pack(weight)


def packed_linear(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None, out_features: int = -1
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with the weight's :func:`pack_weight` copy (which kernel
    runs follows from its layout: caddtree's is four-dimensional, oneDNN's two);
    ``out_features``, the weight's output size, is needed where caddtree's layout padded it."""
    if packed.dim() == 4:
        return rows_linear(x, packed, bias, out_features)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def _packable(layer: nn.Module) -> bool:
    if type(layer) is not nn.Linear or hasattr(layer, _STATE):
        return False
    weight = layer.weight
    if weight.is_inference():
        # made under torch.inference_mode(): no version counter, so an in-place change could not
        # be told from the packed copy; left unpacked rather than risk a stale one
        return False
    if layer.bias is not None and layer.bias.dtype is not weight.dtype:
        return False
    return rows_apply(weight) or _kernel_packs(weight)


def _linear_layers(modules: Iterable[nn.Module | None]) -> list[nn.Linear]:
    seen: dict[int, nn.Linear] = {}
    for module in modules:
        if module is None:
            continue
        for layer in module.modules():
            if isinstance(layer, nn.Linear):
                seen.setdefault(id(layer), layer)
    return list(seen.values())


def available_memory() -> int | None:
    """Bytes of memory available to new allocations (Linux ``MemAvailable``), or ``None``."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def pack_linear_layers(*modules: nn.Module | None, memory_limit: int | None = None) -> int:
    """Pack the weight of every plain ``nn.Linear`` in ``modules`` that runs on the CPU in
    bfloat16 or float32 (see the module docstring); returns how many layers are packed now,
    counting ones packed before. Layers already packed, on other devices or in other dtypes, and
    subclasses of ``nn.Linear`` (quantised layers and the like) are left alone.

    ``memory_limit``: the most bytes the packed copies may take (default: half of
    :func:`available_memory`); past it nothing is packed, and a warning says so."""
    layers = _linear_layers(modules)
    todo = [layer for layer in layers if _packable(layer)]
    needed = sum(layer.weight.numel() * layer.weight.element_size() for layer in todo)
    if not packing_fits(needed, "the linear layers' weights", memory_limit):
        todo = []
    for layer in todo:
        weight = layer.weight
        packed = pack_weight(weight)
        if packed is None:
            continue
        setattr(layer, _STATE, _Packed(packed, weight._version, weight.data_ptr()))
        layer.forward = types.MethodType(_packed_forward, layer)
    return sum(hasattr(layer, _STATE) for layer in layers)


def unpack_linear_layers(*modules: nn.Module | None) -> int:
    """Undo :func:`pack_linear_layers` (frees the packed copies); returns how many were packed."""
    count = 0
    for layer in _linear_layers(modules):
        if hasattr(layer, _STATE):
            delattr(layer, _STATE)
            del layer.forward  # the instance attribute; ``nn.Linear.forward`` shows through again
            count += 1
    return count


def packed_linear_count(*modules: Any) -> int:
    """How many ``nn.Linear`` layers of ``modules`` hold a packed weight."""
    return sum(hasattr(layer, _STATE) for layer in _linear_layers(modules))
