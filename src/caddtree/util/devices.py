"""Torch dtypes and devices by name, and what a measurement or a cache entry depends on.

:func:`resolve_dtype` and :func:`resolve_device` turn the names commands and the API accept into
torch objects; :func:`ar_baseline_dtypes` picks the dtypes that plain decoding is timed in, to
measure a speed-up fairly; :func:`machine_description` and :func:`weights_digest` identify the
machine and the weights that profiled cost models and cached training data belong to.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from .errors import InvalidInputError

__all__ = [
    "CPU_SLOW_HALF",
    "ar_baseline_dtypes",
    "dtype_name",
    "machine_description",
    "resolve_device",
    "resolve_dtype",
    "weights_digest",
]

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "float64": torch.float64,
    "fp64": torch.float64,
    "double": torch.float64,
}


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """``"auto"``/``None`` means bfloat16 on CUDA and float32 elsewhere."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is None or dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    try:
        return _DTYPES[str(dtype).lower()]
    except KeyError:
        raise InvalidInputError(
            f"unknown dtype {dtype!r}; use one of auto, {', '.join(sorted(set(_DTYPES)))}"
        ) from None


def resolve_draft_dtype(
    choice: str | torch.dtype | None, target_dtype: torch.dtype, device: torch.device
) -> torch.dtype:
    """The drafter's dtype: ``"same"`` (or ``None``) is the target's; ``"auto"`` is bfloat16 beside
    a float32 target on a CPU with AVX512-BF16 (where a bfloat16 pass is the cheaper one; the
    drafter only proposes, so the output is the target's either way), else the target's; any
    other value names a dtype (:func:`resolve_dtype`)."""
    if choice is None or choice == "same":
        return target_dtype
    if choice == "auto":
        fast_bf16 = device.type == "cpu" and torch.cpu._is_avx512_bf16_supported()
        return torch.bfloat16 if target_dtype == torch.float32 and fast_bf16 else target_dtype
    return resolve_dtype(choice, device)


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``: the name :func:`resolve_dtype` accepts back."""
    return str(dtype).removeprefix("torch.")


# Half-precision dtypes that a CPU may run slower than float32: without native bf16/fp16 matrix
# units, PyTorch's CPU kernels convert to float32 and back, so plain decoding in float32 can beat it.
CPU_SLOW_HALF = (torch.bfloat16, torch.float16)


def ar_baseline_dtypes(
    dtype: str | torch.dtype,
    device: str | torch.device,
    extra: str | Sequence[str | torch.dtype] | None = "auto",
) -> list[torch.dtype]:
    """The dtypes to time plain AR decoding in, to measure the speed-up of a run in ``dtype``.

    A speed-up is only fair against the fastest plain decoding a user could pick on that machine.
    The list starts with the run's own dtype, always: that AR run is the lossless reference (the
    output a greedy method must reproduce). ``extra`` says what else to time:

    * ``"auto"`` or ``None``: on a CPU, where either can be the faster plain decoding (it depends
      on the model and on the CPU's bfloat16 support), float32 for a bfloat16 or float16 run and
      bfloat16 for a float32 run; on a GPU, where bfloat16 is the fast path, bfloat16 for a
      float32 run only; nothing for a float64 run (exactness checks);
    * ``"same"``: nothing else;
    * a sequence of dtypes (or names :func:`resolve_dtype` accepts): those, in that order.

    Duplicates are dropped.
    """
    dev = torch.device(device)
    run = resolve_dtype(dtype, dev)
    if extra is None or (isinstance(extra, str) and extra == "auto"):
        if run == torch.float32:
            others = [torch.bfloat16]
        else:
            others = [torch.float32] if dev.type == "cpu" and run in CPU_SLOW_HALF else []
    elif isinstance(extra, str) and extra == "same":
        others = []
    elif isinstance(extra, str):
        raise InvalidInputError(
            f"unknown AR baseline choice {extra!r}: use 'auto', 'same' or a list of dtypes"
        )
    else:
        others = []
        for item in extra:
            if isinstance(item, str) and item.lower() in ("auto", "same"):
                raise InvalidInputError(f"{item!r} cannot be mixed with a list of dtypes")
            others.append(resolve_dtype(item, dev))
    out = [run]
    for item in others:
        if item not in out:
            out.append(item)
    return out


def resolve_device(device: str | torch.device | None) -> torch.device:
    """``None``/``"auto"`` means CUDA when torch sees a CUDA device, else the CPU."""
    if device is None or device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise InvalidInputError(f"unknown device {device!r} (e.g. cpu, cuda, cuda:1)") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise InvalidInputError("device 'cuda' was requested but torch sees no CUDA device")
    return dev


def machine_description(device: torch.device) -> str:
    """What the timings depend on: the accelerator, or the CPU model, its vector instructions
    (torch's capability, and AVX512-BF16 and AMX where it has them: CPUs sold under one name
    differ, and caddtree's kernels follow them) and the thread count."""
    import platform

    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            cpu = next(
                (line.split(":", 1)[1].strip() for line in fh if line.startswith("model name")), cpu
            )
    except OSError:
        pass
    isa = torch.backends.cpu.get_cpu_capability()
    if torch.cpu._is_avx512_bf16_supported():
        isa += "+BF16"
    if torch.cpu._is_amx_tile_supported():
        isa += "+AMX"
    return f"cpu:{cpu}:{isa}:{os.cpu_count()} cores:{torch.get_num_threads()} threads"


def weights_digest(model: torch.nn.Module) -> str:
    """A cheap fingerprint of a model's weights (shapes and a few values of each tensor)."""
    import hashlib

    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        flat = tensor.detach().reshape(-1)
        h.update(name.encode())
        h.update(str(tuple(tensor.shape)).encode())
        h.update(flat[:: max(1, flat.numel() // 64)].float().cpu().numpy().tobytes())
    return h.hexdigest()[:16]
