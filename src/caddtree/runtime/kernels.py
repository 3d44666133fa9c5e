"""caddtree's own bfloat16 kernels for the CPU (C++ in ``csrc/``): a linear layer for a few rows
and attention for a few rows over a cache, in two builds of the same operators and weight layout:

* ``avx512-bf16`` (``linear_bf16.cpp``, ``attention_bf16.cpp``), for CPUs with AVX512-BF16, whose
  ``vdpbf16ps`` multiplies bfloat16 pairs directly;
* ``avx2`` (``linear_avx2.cpp``, ``attention_avx2.cpp``), for CPUs with AVX2, FMA and F16C but no
  AVX512-BF16 (most CPUs in use), which widen bfloat16 to float32 by a shift and use FMAs. There
  torch's own bfloat16 linear has no packed oneDNN path and costs several times as much.

:func:`kernel_variant` says which one this CPU takes.

A decoding step or a tree verification multiplies a few rows by every weight of the model: the
work is reading the weights once. oneDNN's packed linear (:mod:`caddtree.runtime.packing`) reads
them at the machine's bandwidth too, but pays a fixed cost per call that, over every linear
call of a forward of a small target, is a large share of it; SDPA's flash kernel likewise
spends most of a few-row attention call on its set-up. The kernels here start with no set-up but
their parallel loop; ``benchmarks/linear_kernel.py`` and ``benchmarks/vs_llamacpp.py`` measure
them.

They are built together once per machine (with the C++ compiler inductor also uses),
cached as ``<cache root>/kernels/<key>/caddtree_kernels.so`` (the key covers the build's sources
and flags, the torch build and the compiler), loaded with ``torch.ops.load_library`` and checked on probes against
``F.linear`` and SDPA before anything uses them. The linear kernel applies to bfloat16 weights on
the CPU whose input size is even (:func:`pack_rows`), the attention kernel to head sizes that are
multiples of 16 up to 256 (:func:`attention_fits`); everything else keeps oneDNN, ``F.linear`` and
SDPA. ``CADDTREE_KERNELS=0`` turns them off.

Both give a row the same bits whatever else is in the call (see the sources), so plain decoding
and tree verification through them agree exactly.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import subprocess
from importlib import resources
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F

from ..core.sampling import use_argmax_kernel
from ..util.defaults import cache_root
from ..util.files import atomic_write

__all__ = [
    "GROUP",
    "amx_in_use",
    "attention_fits",
    "cxx_compiler",
    "kernel_available",
    "kernel_in_use",
    "kernel_variant",
    "pack_rows",
    "rows_apply",
    "rows_linear",
    "source_digest",
    "tree_attention",
    "tree_attention_batch",
]

logger = logging.getLogger(__name__)

GROUP = 32
"""Output rows per group of the packed layout (``pack_rows``; the last group is padded)."""

_BUILD_TIMEOUT_S = 600


class _Variant(NamedTuple):
    """One build of the kernels: its sources (the same operators and weight layout) and the
    instruction sets it is compiled for."""

    name: str
    sources: tuple[str, ...]
    flags: tuple[str, ...]


_AVX512_BF16 = _Variant(
    "avx512-bf16",
    (
        "ops.cpp",
        "amx.h",
        "linear_op.h",
        "attention_op.h",
        "attention_steps.h",
        "round_bf16.h",
        "linear_bf16.cpp",
        "attention_bf16.cpp",
        "linear_q_op.h",
        "linear_q.cpp",
    ),
    ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mavx512vnni", "-mfma", "-mf16c"),
)
_AVX2 = _Variant(
    "avx2",
    (
        "ops.cpp",
        "linear_op.h",
        "attention_op.h",
        "attention_steps.h",
        "linear_q_op.h",
        "linear_avx2.cpp",
        "attention_avx2.cpp",
        "linear_q_avx2.cpp",
    ),
    ("-mavx2", "-mfma", "-mf16c"),
)


@functools.cache
def _variant() -> _Variant | None:
    """The build this CPU runs: AVX512-BF16's where it has it, else AVX2's (with FMA and F16C,
    which every AVX2 CPU of the last decade has), else none."""
    if torch.cpu._is_avx512_bf16_supported():
        return _AVX512_BF16
    if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512") and _cpu_flags() >= {
        "fma",
        "f16c",
    }:
        return _AVX2
    return None


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def kernel_variant() -> str | None:
    """Which build of the kernels this CPU takes (``"avx512-bf16"`` or ``"avx2"``), or ``None``."""
    variant = _variant()
    return None if variant is None else variant.name


def _sources() -> dict[str, bytes]:
    folder = resources.files("caddtree.runtime").joinpath("csrc")
    variant = _variant() or _AVX512_BF16
    return {name: folder.joinpath(name).read_bytes() for name in variant.sources}


def cxx_compiler() -> str | None:
    """The C++ compiler found here (``$CXX``, else g++, c++ or clang++), as inductor would use."""
    names = (os.environ.get("CXX"), "g++", "c++", "clang++")
    return next((path for path in map(shutil.which, filter(None, names)) if path), None)


def _compiler_version(cxx: str) -> str:
    try:
        done = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=60)
        return done.stdout.splitlines()[0] if done.stdout else ""
    except (OSError, subprocess.SubprocessError):
        return ""


def _command(cxx: str, sources: list[Path], output: str) -> list[str]:
    from torch.utils.cpp_extension import include_paths, library_paths

    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    libs = library_paths()
    return [
        cxx,
        "-O3",
        "-std=c++20",
        "-shared",
        "-fPIC",
        "-fopenmp",
        *(_variant() or _AVX512_BF16).flags,
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        *(f"-I{path}" for path in include_paths()),
        *map(str, sources),
        *(f"-L{path}" for path in libs),
        *(f"-Wl,-rpath,{path}" for path in libs),
        "-lc10",
        "-ltorch_cpu",
        "-ltorch",
        "-o",
        output,
    ]


def source_digest() -> str:
    """A digest of this CPU's build's sources (what its speed and numbers follow from)."""
    return hashlib.sha256(b"\0".join(_sources().values())).hexdigest()[:16]


def _key(cxx: str) -> str:
    """The build's cache key: its sources, flags, torch and compiler."""
    flags = (_variant() or _AVX512_BF16).flags
    parts = (source_digest(), torch.__version__, _compiler_version(cxx), *flags)
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def _library(cxx: str) -> Path:
    """Where the kernels built from these sources, torch and compiler live (built now if
    missing)."""
    sources = _sources()
    path = cache_root() / "kernels" / _key(cxx) / "caddtree_kernels.so"
    if path.is_file():
        return path
    from filelock import FileLock

    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(path.parent / ".build.lock")):
        if not path.is_file():
            logger.info(
                "building caddtree's bfloat16 kernels for this CPU (once; later runs load them)"
            )
            files = []
            for name, text in sources.items():
                files.append(
                    atomic_write(path.parent / name, lambda tmp, t=text: Path(tmp).write_bytes(t))
                )
            units = [file for file in files if file.suffix == ".cpp"]  # headers are included
            atomic_write(path, lambda tmp: _compile(cxx, units, tmp))
    return path


def _compile(cxx: str, sources: list[Path], output: str) -> None:
    done = subprocess.run(
        _command(cxx, sources, output), capture_output=True, text=True, timeout=_BUILD_TIMEOUT_S
    )
    if done.returncode != 0:
        raise RuntimeError(f"{cxx} failed ({done.returncode}): {done.stderr[-2000:]}")


def _unavailable() -> str | None:
    """Why the kernels cannot be used here (``None``: they may be built)."""
    if os.environ.get("CADDTREE_KERNELS", "").strip().lower() in ("0", "off", "false", "no"):
        return "CADDTREE_KERNELS turns it off"
    if _variant() is None:
        return "this CPU has neither AVX512-BF16 nor AVX2 with FMA and F16C"
    if cxx_compiler() is None:
        return "no C++ compiler was found (install g++ or set CXX)"
    return None


def _register_fakes() -> None:
    @torch.library.register_fake("caddtree::linear_bf16")
    def _(
        x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, n: int = -1
    ) -> torch.Tensor:
        return x.new_empty((*x.shape[:-1], w.shape[0] * GROUP if n < 0 else n))

    if hasattr(torch.ops.caddtree, "linear_q"):

        @torch.library.register_fake("caddtree::linear_q")
        def _(
            x: torch.Tensor, w: torch.Tensor, kind: int, n: int, bias: torch.Tensor | None = None
        ) -> torch.Tensor:
            return x.new_empty((*x.shape[:-1], n))

    @torch.library.register_fake("caddtree::tree_attention")
    def _(
        q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scale: float
    ) -> torch.Tensor:
        return q.new_empty((q.shape[0], q.shape[1] * q.shape[2]))

    @torch.library.register_fake("caddtree::tree_attention_batch")
    def _(
        q: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        mask: torch.Tensor,
        seqs: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        return q.new_empty((q.shape[0], q.shape[1] * q.shape[2]))


def _probe() -> bool:
    """The kernel against ``F.linear`` on random probes (70 inputs: vector passes; 64: AMX where
    it is used), and a row alone against the same row among others (bit for bit)."""
    generator = torch.Generator().manual_seed(0)
    for k in (70, 64):
        weight = torch.randn(2 * GROUP - 3, k, generator=generator).bfloat16()
        bias = torch.randn(2 * GROUP - 3, generator=generator).bfloat16()
        x = torch.randn(19, k, generator=generator).bfloat16()
        packed = pack_rows(weight, check=False)
        n = weight.shape[0]
        out = rows_linear(x, packed, bias, n)
        reference = F.linear(x.float(), weight.float(), bias.float())
        close = torch.allclose(out.float(), reference, rtol=1e-2, atol=1e-2)
        alone = torch.cat([rows_linear(x[i : i + 1], packed, bias, n) for i in range(x.shape[0])])
        if not (close and torch.equal(alone, out)):
            return False
    return True


def _probe_attention() -> bool:
    """The attention kernel against SDPA in float32 on a random tree-like probe, and a row alone
    against the same row among others (bit for bit)."""
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(5, 4, 32, generator=generator).bfloat16()
    keys, values = (torch.randn(2, 40, 32, generator=generator).bfloat16() for _ in range(2))
    mask = torch.rand(5, 37, generator=generator) < 0.7
    mask[:, 0] = True
    out = tree_attention(q, keys, values, mask, 0.125)
    reference = F.scaled_dot_product_attention(
        q.float().transpose(0, 1),
        keys[:, :37].float().repeat_interleave(2, 0),
        values[:, :37].float().repeat_interleave(2, 0),
        attn_mask=mask,
        scale=0.125,
    ).transpose(0, 1)
    close = torch.allclose(out.float(), reference.reshape(5, -1), rtol=1e-2, atol=1e-2)
    alone = torch.cat(
        [tree_attention(q[i : i + 1], keys, values, mask[i : i + 1], 0.125) for i in range(5)]
    )
    return bool(close and torch.equal(alone, out))


def _probe_argmax() -> bool:
    """The argmax kernel against torch's on random rows with ties (first index wins)."""
    logits = torch.randn(6, 100, generator=torch.Generator().manual_seed(0)).bfloat16()
    logits[1, [5, 70]] = logits[1].max() + 1
    return torch.equal(torch.ops.caddtree.argmax_rows(logits), torch.argmax(logits.float(), -1))


@functools.cache
def kernel_available() -> bool:
    """Whether the kernels are built, loaded and passed their probes in this process (built on
    first use; a failure is logged once and leaves bfloat16 to oneDNN and SDPA)."""
    reason = _unavailable()
    if reason is not None:
        logger.debug("caddtree's bfloat16 kernels are not used: %s", reason)
        return False
    try:
        if not hasattr(torch.ops.caddtree, "linear_bf16"):
            torch.ops.load_library(str(_library(cxx_compiler())))
            _register_fakes()
        if _probe() and _probe_attention():
            if hasattr(torch.ops.caddtree, "argmax_rows") and _probe_argmax():
                use_argmax_kernel(torch.ops.caddtree.argmax_rows)
            return True
        logger.warning("caddtree's bfloat16 kernels failed their probes; oneDNN and SDPA are used")
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        logger.warning("caddtree's bfloat16 kernels are not used: %s", exc)
    return False


def amx_in_use() -> bool:
    """Whether the linear kernel runs on the CPU's AMX tile unit (Intel Xeon since Sapphire
    Rapids; for weights of a multiple of 32 inputs), decided once per process:
    ``CADDTREE_AMX=0`` turns it off."""
    return kernel_available() and bool(torch.ops.caddtree.amx_in_use())


def kernel_in_use(dtype: torch.dtype) -> bool:
    """Whether packed CPU layers of ``dtype`` run on the kernel (bfloat16 where it is available)."""
    return dtype is torch.bfloat16 and kernel_available()


def rows_apply(weight: torch.Tensor, *, check: bool = True) -> bool:
    """Whether :func:`pack_rows` lays ``weight`` out: bfloat16 [N, K] on the CPU, N > 0 and K
    even, and (``check``) the kernel available."""
    if weight.dtype is not torch.bfloat16 or weight.device.type != "cpu" or weight.dim() != 2:
        return False
    n, k = weight.shape
    return not (k % 2 or n == 0 or (check and not kernel_available()))


def pack_rows(weight: torch.Tensor, *, check: bool = True) -> torch.Tensor | None:
    """``weight`` [N, K] laid out for the kernel, [ceil(N/32), K/2, 32, 2] (a copy, the last
    group padded with zero rows), or ``None`` where the kernel does not apply: not bfloat16 on
    the CPU, K odd, or the kernel unavailable (``check``)."""
    if not rows_apply(weight, check=check):
        return None
    n, k = weight.shape
    groups = -(-n // GROUP)
    with torch.no_grad():
        padded = weight.detach()
        if groups * GROUP != n:
            padded = torch.cat((padded, padded.new_zeros(groups * GROUP - n, k)))
        grouped = padded.reshape(groups, GROUP, k // 2, 2)
        return grouped.permute(0, 2, 1, 3).contiguous()


def attention_fits(head_dim: int, heads: int, kv_heads: int) -> bool:
    """Whether :func:`tree_attention` serves a model of this attention shape."""
    return head_dim % 16 == 0 and 16 <= head_dim <= 256 and heads % kv_heads == 0


def tree_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """Attention of rows ``q`` [n, H, D] over the first ``L = mask.shape[-1]`` entries of
    ``keys``/``values`` [kv, S, D] (views into a cache; query head ``h`` reads key/value head
    ``h // (H / kv)``), each row over the entries its ``mask`` row [.., n, L] allows; returns
    [n, H*D]. bfloat16, on the CPU; a row's result is the same bits alone or among others."""
    return torch.ops.caddtree.tree_attention(q, keys, values, mask, scale)


def tree_attention_batch(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    seqs: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """:func:`tree_attention` of several sequences in one call: ``q`` [N, H, D] holds each
    sequence's rows in turn, ``seqs`` [B, 3] int64 gives per sequence its cache slot, its number
    of rows and the entries ``L_b`` it attends, ``keys``/``values`` are a layer's whole cache
    [slots, kv, S, D], and ``mask`` [N, L >= L_b] says which of its slot's first ``L_b`` entries
    each row sees. Each row's result is the same bits as in :func:`tree_attention` of its
    sequence alone."""
    return torch.ops.caddtree.tree_attention_batch(q, keys, values, mask, seqs, scale)


def rows_linear(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None, n: int = -1
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with the weight's :func:`pack_rows` copy; ``n``: the
    weight's output size, where it is not a multiple of 32 (-1: the packed rows')."""
    return torch.ops.caddtree.linear_bf16(x, packed, bias, n)
