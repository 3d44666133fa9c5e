"""The arithmetic of a Llama-family / Qwen3 decoder layer, shared by the lean runtime's eager
forward (:mod:`caddtree.runtime.lean`) and its compiled graphs (:mod:`caddtree.runtime.compiled`):
fused linear layers (packed on the CPU), RMSNorm, rotary embedding and the layer itself,
with the cache's part (writing keys and values, attending) left to the caller (:data:`Attend`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .packing import pack_weight, packed_linear, packing_fits
from .quantized import QuantLinear, QuantStack, kind_name, pack_blocks, quantized_unsupported

if TYPE_CHECKING:
    from .gguf_blocks import Blocks

__all__ = [
    "FUSED_LINEARS",
    "Attend",
    "LayerWeights",
    "Linear",
    "Shape",
    "decoder_layer",
    "fused_linear",
    "layer_weights",
    "packed_layers_fit",
    "rms_norm",
    "rotary_tables",
    "rotate",
]


class Linear(NamedTuple):
    """A linear layer over a weight made here (a fused one): its packed copy alone where packing
    applies (:meth:`of`; caddtree's bfloat16 kernel or oneDNN, see
    :func:`~caddtree.runtime.packing.pack_weight`), else the plain weight. A tuple of tensors, so that a compiled
    graph taking it checks no more than its tensors."""

    packed: torch.Tensor | None
    weight: torch.Tensor | None
    bias: torch.Tensor | None

    @classmethod
    def of(cls, weight: torch.Tensor, bias: torch.Tensor | None, pack: bool) -> Linear:
        # whole row groups only: the graphs call it without an output size
        packed = pack_weight(weight, padded=False) if pack else None
        return cls(packed, None if packed is not None else weight, bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return packed_linear(x, self.packed, self.bias)
        return F.linear(x, self.weight, self.bias)


def fused_linear(linears: Sequence[nn.Linear], pack: bool) -> Linear:
    """One linear layer computing ``linears`` side by side (their outputs concatenated). A single
    layer's weight is used as it is (no copy); several are stacked into a new weight, which on a
    device without packing is a second copy of theirs (see the module docstring)."""
    if len(linears) == 1:
        return Linear.of(linears[0].weight.detach(), _fused_bias(linears), pack)
    weight = torch.cat([linear.weight.detach() for linear in linears])
    return Linear.of(weight, _fused_bias(linears), pack)


def _fused_bias(linears: Sequence[nn.Linear]) -> torch.Tensor | None:
    """The biases of ``linears`` side by side (zeros for those without), or ``None`` if none has
    one."""
    biases = [linear.bias for linear in linears]
    if all(b is None for b in biases):
        return None
    return torch.cat(
        [
            b.detach() if b is not None else linear.weight.new_zeros(linear.out_features)
            for b, linear in zip(biases, linears)
        ]
    )


def quantized_linear(
    parts: Sequence[Blocks], bias: torch.Tensor | None = None
) -> QuantLinear | QuantStack | None:
    """The weights ``parts`` (a GGUF file's blocks) computed side by side on the quantized
    kernel: one :class:`~caddtree.runtime.quantized.QuantLinear` where they share a type, else a
    :class:`~caddtree.runtime.quantized.QuantStack` of one per run of a type; ``None`` where one
    of them is of a type the kernel does not take here."""
    if any(quantized_unsupported(part.kind, part.shape) for part in parts):
        return None
    linears, start = [], 0
    for run in _runs_of_one_kind(parts):
        rows = sum(part.shape[0] for part in run)
        raw = np.concatenate([part.raw for part in run]) if len(run) > 1 else run[0].raw
        part_bias = None if bias is None else bias[start : start + rows]
        linears.append(QuantLinear(pack_blocks(raw, run[0].kind), run[0].kind, rows, part_bias))
        start += rows
    return linears[0] if len(linears) == 1 else QuantStack(tuple(linears))


def _runs_of_one_kind(parts: Sequence[Blocks]) -> list[list[Blocks]]:
    runs: list[list[Blocks]] = []
    for part in parts:
        if runs and runs[-1][0].kind == part.kind:
            runs[-1].append(part)
        else:
            runs.append([part])
    return runs


def weight_format(
    layers: Sequence[LayerWeights], head: QuantLinear | QuantStack | None, dtype: torch.dtype
) -> str:
    """What the linear layers and the head compute on: ``"bfloat16"`` (the dtype's name) where
    none is quantized, the block type's name where all are (``"Q8_0"``), else the names of the mix
    (``"Q4_1+Q8_0"``: the built-in file's Q8_0 head; ``"Q4_0+bfloat16"``: a head the kernel does not
    take, run in the model's dtype)."""
    linears = [
        linear for layer in layers for linear in (layer.qkv, layer.o, layer.gate_up, layer.down)
    ]
    names = {
        name
        for linear in (*linears, head)
        for name in (
            [kind_name(kind) for kind in linear.kinds]
            if isinstance(linear, QuantLinear | QuantStack)
            else [str(dtype).split(".")[-1]]
        )
    }
    return "+".join(sorted(names))


def packed_layers_fit(model: Any) -> bool:
    """Whether packed copies of the decoder layers' linear weights fit in memory
    (:func:`~caddtree.runtime.packing.packing_fits`)."""
    needed = sum(
        m.weight.numel() * m.weight.element_size()
        for m in model.model.layers.modules()
        if isinstance(m, nn.Linear)
    )
    return packing_fits(needed, "the lean runtime's linear weights")


class LayerWeights(NamedTuple):
    input_norm: torch.Tensor
    qkv: Linear | QuantLinear | QuantStack
    qk_norm: torch.Tensor | None  # Qwen3: q_norm's weight for each query head, then k_norm's
    o: Linear | QuantLinear | QuantStack
    post_norm: torch.Tensor
    gate_up: Linear | QuantLinear | QuantStack
    down: Linear | QuantLinear | QuantStack


FUSED_LINEARS = {  # the lean layers' fused linears, of the model's submodules
    "qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "o": ("self_attn.o_proj",),
    "gate_up": ("mlp.gate_proj", "mlp.up_proj"),
    "down": ("mlp.down_proj",),
}


def layer_weights(
    layer: Any,
    heads: int,
    kv_heads: int,
    pack: bool,
    blocks: dict[str, Blocks] | None = None,
    prefix: str = "",
) -> LayerWeights:
    """The weights of a transformers decoder layer of the Llama / Qwen3 layout (``self_attn``
    with ``q/k/v/o_proj`` and, in Qwen3, ``q_norm``/``k_norm``; ``mlp`` with ``gate/up/down_proj``;
    ``input_layernorm``, ``post_attention_layernorm``), fused and packed (:func:`fused_linear`).
    A DFlash drafter's layers have the same layout.

    ``blocks``: a GGUF file's weights by parameter name (``prefix`` + ``self_attn.q_proj.weight``,
    ...); each fused linear whose parts it holds, of one type the quantized kernel takes, is
    computed on those blocks (:func:`quantized_linear`) instead."""
    attention = layer.self_attn
    linears = {
        key: _layer_linear(layer, names, pack, blocks, prefix)
        for key, names in FUSED_LINEARS.items()
    }
    q_norm = getattr(attention, "q_norm", None)
    qk_norm = None
    if q_norm is not None:
        qk_norm = torch.cat(
            (
                q_norm.weight.detach().expand(heads, -1),
                attention.k_norm.weight.detach().expand(kv_heads, -1),
            )
        )
    return LayerWeights(
        layer.input_layernorm.weight.detach(),
        linears["qkv"],
        qk_norm,
        linears["o"],
        layer.post_attention_layernorm.weight.detach(),
        linears["gate_up"],
        linears["down"],
    )


def _layer_linear(
    layer: Any, names: Sequence[str], pack: bool, blocks: dict[str, Blocks] | None, prefix: str
) -> Linear | QuantLinear | QuantStack:
    """The fused linear of ``layer``'s submodules ``names``: on a file's blocks where it can be
    (:func:`quantized_linear`), else :func:`fused_linear`."""
    modules = [layer.get_submodule(name) for name in names]
    parts = [(blocks or {}).get(f"{prefix}{name}.weight") for name in names]
    if all(part is not None for part in parts):
        quantized = quantized_linear(parts, _fused_bias(modules))
        if quantized is not None:
            return quantized
    return fused_linear(modules, pack)


def rotary_tables(
    rotary: nn.Module, size: int, device: torch.device, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos`` and signed ``sin`` [size, 1, D] of positions ``0 .. size - 1`` for :func:`rotate`,
    computed by the model's own rotary module (so every static RoPE type it supports comes out
    exactly as transformers' forward has it)."""
    positions = torch.arange(size, device=device)[None]
    cos, sin = rotary(torch.empty(0, dtype=dtype, device=device), positions)
    half = sin.shape[-1] // 2
    signed = torch.cat((-sin[..., :half], sin[..., half:]), -1)
    return cos[0].unsqueeze(1), signed[0].unsqueeze(1)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Llama RMSNorm: normalised in float32, scaled in the input dtype. Op for op
    in float64 (whose tests compare with transformers to rounding); torch's own kernel, one call
    instead of eight, in the dtypes that compute in float32 anyway (float32: the same numbers;
    half dtypes: one rounding fewer). ``weight`` [D], or [heads, D] for x [..., heads, D]."""
    if x.dtype is not torch.float64:
        if weight.ndim == 1:
            return F.rms_norm(x, weight.shape, weight, eps)
        return F.rms_norm(x, x.shape[-1:], None, eps) * weight  # a weight per head
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """RoPE as transformers applies it, ``x * cos + rotate_half(x) * sin``, in three ops:
    ``rotate_half(x) * sin`` is ``[x2, x1] * [-sin_1, sin_2]`` (``signed_sin``), and swapping the
    halves is a flip of the ``[2, D/2]`` view."""
    shape = x.shape
    swapped = x.unflatten(-1, (2, shape[-1] // 2)).flip(-2).reshape(shape)
    return torch.addcmul(x * cos, swapped, signed_sin)


class Shape(NamedTuple):
    """A model's attention shape and norm epsilon, as the decoder layers need them."""

    heads: int
    kv_heads: int
    head_dim: int
    eps: float

    @property
    def qk_v_sizes(self) -> tuple[int, int]:
        """Widths of the fused q/k/v output's two parts: q and k together, then v."""
        return ((self.heads + self.kv_heads) * self.head_dim, self.kv_heads * self.head_dim)


Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""``attend(q [N, H, D], k [N, kv, D], v [N, kv, D]) -> [N, H*D]``: stores a layer's new keys and
values in its cache and returns the rows' attention output."""


def decoder_layer(
    layer: LayerWeights,
    shape: Shape,
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    attend: Attend,
    context: torch.Tensor | None = None,
) -> torch.Tensor:
    """One decoder layer over rows ``x`` [N, hidden] whose rotary tables are ``cos``/``sin``;
    ``attend`` does the cache's part (eager: :class:`LeanTarget`; compiled:
    :mod:`caddtree.runtime.compiled`; the drafter: :mod:`caddtree.models.batch_proposer`).

    ``context`` [C, hidden]: rows that only give keys and values, ahead of ``x``'s (a DFlash
    drafter's projected context features, which enter its q/k/v projection without the input
    norm). ``cos``/``sin`` then cover ``C + N`` rows, and ``attend`` gets the queries of ``x``'s
    rows and the keys and values of all ``C + N``."""
    normed = rms_norm(x, layer.input_norm, shape.eps)
    if context is not None:
        normed = torch.cat((context, normed))
    n = normed.shape[0]
    # q and k are neighbours in the fused output: normed (Qwen3) and rotated together
    qk, v = layer.qkv(normed).split(shape.qk_v_sizes, -1)
    qk = qk.view(n, shape.heads + shape.kv_heads, shape.head_dim)
    v = v.view(n, shape.kv_heads, shape.head_dim)
    if layer.qk_norm is not None:
        qk = rms_norm(qk, layer.qk_norm, shape.eps)
    q, k = rotate(qk, cos, sin).split((shape.heads, shape.kv_heads), 1)
    if context is not None:
        q = q[context.shape[0] :]
    x = x + layer.o(attend(q, k, v))
    gate, up = layer.gate_up(rms_norm(x, layer.post_norm, shape.eps)).chunk(2, -1)
    return x + layer.down(F.silu(gate) * up)
