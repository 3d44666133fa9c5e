"""caddtree's own forward for Llama-family and Qwen3 targets: the ``lean`` runtime.

transformers' forward is the reference, and it pays a fixed cost on every call that a round of
speculative decoding cannot afford on a CPU: its module stack, a ``DynamicCache``, rotary tables
recomputed per call, mask building, per-call checks. On the built-in SmolLM2 target, about half of
a one-token forward was that overhead. :class:`LeanTarget` runs the same arithmetic directly:

* **Weights, laid out once.** q/k/v are fused into one linear and gate/up into another; on the CPU
  each fused weight is packed (:func:`~caddtree.runtime.packing.pack_weight`: for caddtree's
  bfloat16 kernel, :mod:`caddtree.runtime.kernels`, where the CPU has AVX512-BF16 or AVX2, else for
  oneDNN) and only the packed copy is kept (as much memory as packing the model's own layers took). Where nothing
  is packed (CUDA, float64) the stacked q/k/v and gate/up weights are a second copy of the
  model's; o, down, the LM head and the embeddings are the model's own tensors.
* **A static KV cache**: per layer one key and one value tensor ``[slots, kv_heads, capacity,
  head_dim]``, written by position index. Row ``j`` of a call for sequence ``s`` is written at
  ``start_s + j``; :meth:`LeanTarget.compact` moves an accepted tree path in place. Nothing is
  concatenated per step; the cache grows (copied once into room half as large again) only when a
  call outgrows it.
* **Rotary tables** computed once by the model's own rotary module (so every static RoPE type the
  model supports is reproduced exactly), extended when a longer context asks for more.
* **Grouped-query attention** without repeated keys/values: one row per sequence stacks the query
  heads that share a key/value head as that head's queries (no mask needed); more rows go to
  ``scaled_dot_product_attention(..., enable_gqa=True)`` under a boolean mask.
* **Several sequences per call** (:class:`Rows`): each sequence owns a cache slot; its rows attend
  to its slot's first ``start`` entries and, among themselves, as its ``visibility`` says (a tree's
  ancestors, or causally for a prompt). The linear layers run once over all rows of all sequences.

It reproduces transformers' arithmetic op for op (RMSNorm in float32 as transformers computes it,
the same rotary tables and rotation), so float64 logits equal transformers' to rounding. The
hidden states after the drafter's feature layers come out of the same pass.

:func:`lean_unsupported` says why a model cannot run here (another architecture, a RoPE that
depends on the sequence length, sliding windows, ...); such models keep transformers' forward.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..core.tree import DraftTree
from ..util.errors import InvalidInputError
from .kernels import attention_fits, kernel_in_use, tree_attention, tree_attention_batch
from .layers import (
    Linear,
    Shape,
    decoder_layer,
    layer_weights,
    packed_layers_fit,
    quantized_linear,
    rms_norm,
    rotary_tables,
    weight_format,
)
from .quantized import QuantLinear, QuantStack
from .rows import Rows
from .verifier import Verifier

if TYPE_CHECKING:
    from .compiled import CompiledLayers
    from .gguf_blocks import Blocks

__all__ = ["LEAN_MODEL_TYPES", "LeanTarget", "LeanVerifier", "Rows", "lean_unsupported"]

logger = logging.getLogger(__name__)

LEAN_MODEL_TYPES = ("llama", "qwen3")
"""``config.model_type`` values the lean runtime runs (Llama family: Llama 2/3, SmolLM2, ...)."""

_STATIC_ROPE = ("default", "linear", "llama3", "yarn", None)
_MIN_CAPACITY = 256


def lean_unsupported(model: Any) -> str | None:
    """Why ``model`` cannot run on :class:`LeanTarget`, or ``None`` if it can."""
    config = model.config.get_text_config()
    kind = getattr(config, "model_type", None)
    if kind not in LEAN_MODEL_TYPES:
        return f"its architecture ({kind!r}) is not one of {', '.join(LEAN_MODEL_TYPES)}"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"its activation is {config.hidden_act!r}, not silu"
    rope = (getattr(config, "rope_parameters", None) or {}).get("rope_type", "default")
    if rope not in _STATIC_ROPE:
        return f"its RoPE type {rope!r} depends on the sequence length"
    types = set(getattr(config, "layer_types", None) or ["full_attention"])
    if types != {"full_attention"} or getattr(config, "use_sliding_window", False):
        return "it has sliding-window layers"
    if (getattr(config, "pretraining_tp", 1) or 1) != 1:
        return "it splits its linear layers (pretraining_tp > 1)"
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None or not isinstance(getattr(model, "lm_head", None), nn.Module):
        return "it does not have the model.layers / lm_head layout of transformers' Llama"
    for layer in layers:
        attention, mlp = layer.self_attn, layer.mlp
        for linear in (attention.q_proj, attention.k_proj, attention.v_proj, attention.o_proj):
            if not isinstance(linear, nn.Linear):
                return f"its attention projections are {type(linear).__name__}, not nn.Linear"
        for linear in (mlp.gate_proj, mlp.up_proj, mlp.down_proj):
            if not isinstance(linear, nn.Linear):
                return f"its MLP projections are {type(linear).__name__}, not nn.Linear"
    weight = model.get_input_embeddings().weight
    if not weight.dtype.is_floating_point or weight.device.type not in ("cpu", "cuda"):
        return f"its weights are {weight.dtype} on {weight.device.type}"
    return None


class LeanTarget:
    """The forward of a Llama-family or Qwen3 causal LM (see the module docstring).

    Args:
        model: a transformers ``LlamaForCausalLM`` / ``Qwen3ForCausalLM`` (or one of the same
            layout); :func:`lean_unsupported` must say ``None``. Its weights are read once, here:
            rebuild the runtime after changing them.
        feature_layer_ids: decoder layers whose outputs :meth:`forward` returns, concatenated.
        pack: on the CPU, keep the fused weights packed for oneDNN.
        blocks: a GGUF file's weights of this model (:func:`~caddtree.runtime.gguf_blocks.read_blocks`,
            checked against it): in bfloat16 on the CPU, every linear layer and the LM head whose
            blocks the quantized kernel takes runs on them (:mod:`caddtree.runtime.quantized`);
            :attr:`weight_format` says what runs.
    """

    def __init__(
        self,
        model: Any,
        feature_layer_ids: Sequence[int],
        *,
        pack: bool = True,
        compile: bool = False,
        progress: bool = True,
        blocks: dict[str, Blocks] | None = None,
    ) -> None:
        reason = lean_unsupported(model)
        if reason is not None:
            raise InvalidInputError(f"the lean runtime cannot run this model: {reason}")
        config = model.config.get_text_config()
        self.model = model
        self.feature_layer_ids = tuple(int(i) for i in feature_layer_ids)
        self.heads = int(config.num_attention_heads)
        self.kv_heads = int(config.num_key_value_heads)
        self.head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // self.heads)
        self.eps = float(config.rms_norm_eps)
        self.scale = self.head_dim**-0.5
        embeddings = model.get_input_embeddings().weight
        self.device, self.dtype = embeddings.device, embeddings.dtype
        self.pack = bool(pack) and packed_layers_fit(model)
        # caddtree's attention kernel (bfloat16 on CPUs with AVX512-BF16 or AVX2), for all but prompts
        self.fused_attention = (
            self.device.type == "cpu"
            and kernel_in_use(self.dtype)
            and attention_fits(self.head_dim, self.heads, self.kv_heads)
        )
        if blocks and (self.device.type != "cpu" or self.dtype is not torch.bfloat16):
            raise InvalidInputError(
                "quantized weights run in bfloat16 on the CPU; load the model with "
                "dtype=bfloat16 on the CPU, or de-quantize them"
            )
        self.layers = [
            layer_weights(layer, self.heads, self.kv_heads, self.pack, blocks, f"model.layers.{i}.")
            for i, layer in enumerate(model.model.layers)
        ]
        head = (blocks or {}).get("lm_head.weight")
        self.head = quantized_linear([head]) if head is not None else None
        self.weight_format = weight_format(self.layers, self.head, self.dtype)
        self.shape = Shape(self.heads, self.kv_heads, self.head_dim, self.eps)
        self.slots, self.capacity = 0, 0
        self._written: list[int] = []
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self._cos = self._sin = torch.empty(0)
        self.final_norm_weight = model.model.norm.weight.detach()
        self.compiled: CompiledLayers | None = None
        if compile:
            self.compile(progress)

    def release_quantized_sources(self) -> int:
        """Free the model's own weights of the linear layers that run on a file's blocks here
        (moved to the meta device: the model's transformers forward cannot run after this, the
        runtime never calls it). Returns how many were freed. For a model loaded only to serve
        this runtime (``SpeculativeGenerator.from_pretrained`` calls it)."""
        from .layers import FUSED_LINEARS

        freed = 0
        for layer, weights in zip(self.model.model.layers, self.layers):
            for key, names in FUSED_LINEARS.items():
                if isinstance(getattr(weights, key), QuantLinear | QuantStack):
                    for name in names:
                        module = layer.get_submodule(name)
                        module.weight = nn.Parameter(module.weight.to("meta"), requires_grad=False)
                        freed += 1
        return freed

    def compile(self, progress: bool = True) -> None:
        """Compile the layers (:mod:`caddtree.runtime.compiled`) before the cache is reserved;
        refused, with the reason, where they cannot be."""
        from .compiled import CompiledLayers, compile_progress, compile_unsupported

        reason = compile_unsupported(self)
        if reason is not None:
            raise InvalidInputError(f"the compiled runtime cannot run this model: {reason}")
        self.compiled = CompiledLayers(self)
        with compile_progress(progress, 2) as bar:
            for n, what in ((1, "one row"), (2, "tree rows")):
                bar.set_postfix_str(what)
                self._warm_up(n)
                bar.update()

    def compile_batch(self, slots: int, progress: bool = True) -> None:
        """Compile (or load from inductor's disk cache) the compiled runtime's batch graph for a
        cache of ``slots`` slots now, on a scratch cache, so that no round waits for it; nothing
        where the layers are not compiled, the graph would not serve (no attention kernel) or
        ``slots`` is 1 (the one-sequence graphs serve)."""
        if self.compiled is None or not self.fused_attention or slots < 2:
            return
        from .compiled import compile_progress

        kept = (self.keys, self.values, self._written, self.slots, self.capacity)
        self.release()
        self.reserve(max(slots, kept[3]), 0)  # the slots reserve() will give (never fewer)
        try:
            with compile_progress(progress, 2) as bar:
                bar.set_postfix_str(f"batches of up to {slots} sequences")
                tree = np.tril(np.ones((3, 3), dtype=bool))
                # sizes all different (rows 5, sequences 2, length 7), so none is tied to another
                sequences = [(0, 2, [0, 0], [2, 3], tree[:2, :2]), (1, 4, [0] * 3, [4, 5, 6], tree)]
                self.forward(Rows.batch(sequences, self.device))
                bar.update()
                self.forward(Rows.batch([(1, 3, [0], [3], None)], self.device))  # a lone row
                bar.update()
        finally:
            self.keys, self.values, self._written, self.slots, self.capacity = kept

    def _warm_up(self, n: int) -> None:
        """Compile (or load from inductor's on-disk cache) the graph of ``n`` rows now, on a
        scratch cache, so that no generation waits for it. Two cache entries come first: sizes
        0 and 1 would be specialised in the graphs."""
        if self.slots or self.capacity:
            raise RuntimeError("compile the layers before the cache is reserved")
        self.reserve(1, 0)
        try:
            tokens = torch.zeros(n, dtype=torch.long, device=self.device)
            positions = torch.arange(2, 2 + n, device=self.device)
            visibility = None if n == 1 else np.tril(np.ones((n, n), dtype=bool))
            self.forward(Rows.single(tokens, positions, 2, visibility))
        finally:
            self.release()

    # ---- the cache ------------------------------------------------------------------------------

    def reserve(self, slots: int, capacity: int, keep: Sequence[int] = ()) -> None:
        """Make room for ``slots`` sequences of ``capacity`` cache entries each (never less than
        there is). ``keep``: per slot, how many entries hold data to carry into a larger cache."""
        capacity = max(int(capacity), _MIN_CAPACITY)
        if slots <= self.slots and capacity <= self.capacity:
            return
        slots, capacity = max(slots, self.slots), max(capacity, self.capacity)
        if self.capacity:  # grow by half again at least, so growth copies O(1) per entry
            capacity = max(capacity, self.capacity + self.capacity // 2)
        shape = (slots, self.kv_heads, capacity, self.head_dim)
        old = (self.keys, self.values)
        self.keys = [torch.empty(shape, dtype=self.dtype, device=self.device) for _ in self.layers]
        self.values = [
            torch.empty(shape, dtype=self.dtype, device=self.device) for _ in self.layers
        ]
        if self.compiled is not None:  # one graph for every capacity: no recompile on growth
            for cache in self.keys + self.values:
                torch._dynamo.mark_dynamic(cache, 2)
        for slot, used in enumerate(keep):
            if used:
                for new, prev in zip(self.keys + self.values, old[0] + old[1]):
                    new[slot, :, :used] = prev[slot, :, :used]
        self.slots, self.capacity = slots, capacity
        # Per slot, how many leading entries hold numbers (written, or zeroed): a batched call
        # attends over the longest sequence's keys, and the masked ones must not be NaN (a zero
        # weight times NaN is NaN). Fresh memory is zeroed lazily, only as far as a call reaches.
        self._written = [int(keep[s]) if s < len(keep) else 0 for s in range(slots)]

    def _clear_garbage(self, rows: Rows) -> None:
        """Zero the entries a call attends over that were never written (see :meth:`reserve`);
        then count the call's own rows as written."""
        # a batched call through SDPA attends over the longest sequence's entries; the
        # attention kernel reads each sequence's own
        padded = len(rows.slots) > 1 and not self.fused_attention
        for slot, start, count in zip(rows.slots, rows.starts, rows.counts):
            reach = rows.length if padded else start
            written = self._written[slot]
            if written < reach:
                for cache in self.keys + self.values:
                    cache[slot, :, written:reach] = 0
            self._written[slot] = max(written, reach, start + count)

    def release(self) -> None:
        """Let the cache go (:meth:`reserve` makes a new one)."""
        self.keys, self.values, self._written = [], [], []
        self.slots = self.capacity = 0

    @torch.no_grad()
    def compact(self, slot: int, prefix: int, keep: Sequence[int]) -> None:
        """In ``slot``, move entries ``prefix + keep[i]`` to ``prefix + i`` (an accepted path of
        a verified tree; ``keep`` in increasing order). A prefix of ``0, 1, ..`` moves nothing."""
        self.compact_many([(slot, prefix, keep)])

    @torch.no_grad()
    def compact_many(self, moves: Sequence[tuple[int, int, Sequence[int]]]) -> None:
        """:meth:`compact` of several slots, ``(slot, prefix, keep)`` each, in one gather and
        one scatter per cache tensor."""
        slots: list[int] = []
        targets: list[int] = []
        sources: list[int] = []
        for slot, prefix, keep in moves:
            keep = [int(i) for i in keep]
            if keep != list(range(len(keep))):
                slots += [int(slot)] * len(keep)
                targets += range(prefix, prefix + len(keep))
                sources += [prefix + i for i in keep]
        if not slots:
            return
        index = torch.tensor([slots, targets, sources], device=self.device)
        for cache in self.keys + self.values:
            cache[index[0], :, index[1]] = cache[index[0], :, index[2]]

    def _ensure_positions(self, needed: int) -> None:
        """Rotary tables for positions ``0 .. needed - 1`` at least, by the model's own module."""
        if needed <= self._cos.shape[0]:
            return
        size = max(needed, 2 * self._cos.shape[0], _MIN_CAPACITY)
        rotary = self.model.model.rotary_emb
        self._cos, self._sin = rotary_tables(rotary, size, self.device, self.dtype)

    # ---- the forward ------------------------------------------------------------------------------

    @torch.no_grad()
    def forward(
        self, rows: Rows, logits_rows: torch.Tensor | slice | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run ``rows`` through the model, writing their keys and values into the cache.

        Returns the logits of the rows ``logits_rows`` selects (all when ``None``) [r, V] and the
        feature layers' outputs of every row, concatenated [N, k*H] (``[N, 0]`` without any)."""
        if rows.length > self.capacity or max(rows.slots) >= self.slots:
            raise InvalidInputError(
                f"rows up to cache entry {rows.length} of slot {max(rows.slots)} do not fit a "
                f"cache of {self.slots} slots x {self.capacity} entries; reserve() first"
            )
        self._clear_garbage(rows)
        self._ensure_positions(int(rows.positions.max()) + 1)
        cos, sin = self._cos[rows.positions], self._sin[rows.positions]
        x = self.model.model.embed_tokens(rows.tokens)
        if self.compiled is not None and self.compiled.serves(rows, logits_rows):
            normed, outputs = self.compiled(x, cos, sin, rows)
            normed = normed if logits_rows is None else normed[logits_rows]
        else:
            normed, outputs = self._layers(x, cos, sin, rows, logits_rows)
        features = (
            torch.cat([outputs[i] for i in self.feature_layer_ids], -1)
            if outputs
            else x.new_zeros((x.shape[0], 0))
        )
        head = self.head if self.head is not None else self.model.lm_head
        return head(normed), features

    def _layers(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        rows: Rows,
        logits_rows: torch.Tensor | slice | None,
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """The eager layers: the final norm's output of the ``logits_rows`` (all: ``None``) and
        the feature layers' outputs."""
        outputs: dict[int, torch.Tensor] = {}
        last = len(self.layers) - 1
        for index, layer in enumerate(self.layers):
            attend = partial(self._write_and_attend, index, rows)
            x = decoder_layer(layer, self.shape, x, cos, sin, attend)
            if index in self.feature_layer_ids:
                outputs[index] = x
        # transformers' hidden states end with the final norm's output, not the last layer's
        if last in outputs:
            outputs[last] = normed = self._final_norm(x)
            return (normed if logits_rows is None else normed[logits_rows]), outputs
        return self._final_norm(x if logits_rows is None else x[logits_rows]), outputs

    def _final_norm(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.final_norm_weight, self.eps)

    def _write_and_attend(
        self, index: int, rows: Rows, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        self._write(index, k, v, rows)
        return self._attend(index, q, rows)

    def _write(self, index: int, k: torch.Tensor, v: torch.Tensor, rows: Rows) -> None:
        keys, values = self.keys[index], self.values[index]
        if rows.write_index is None:  # one sequence: a slice
            slot, start = rows.slots[0], rows.starts[0]
            end = start + k.shape[0]
            keys[slot, :, start:end] = k.transpose(0, 1)
            values[slot, :, start:end] = v.transpose(0, 1)
        else:
            slots, entries = rows.write_index
            keys[slots, :, entries] = k
            values[slots, :, entries] = v

    def _attend(self, index: int, q: torch.Tensor, rows: Rows) -> torch.Tensor:
        """Attention of the rows' queries ``q`` [N, H, D] over their sequences' caches: [N, H*D].

        The query heads that share a key/value head are stacked as that head's queries (``G``
        heads of ``n`` rows become ``G * n`` rows, the mask repeated to match), so one flash call
        per key/value head serves them: no copied keys, no mask at all for one row per sequence,
        and less time than SDPA's own ``enable_gqa`` for small trees on the CPU
        (``benchmarks/attention_gqa.py``; the same numbers). A causal prompt keeps SDPA's own
        causal mask. Where the target uses caddtree's attention kernel, every call but a prompt
        goes to it instead (:meth:`_attend_fused`)."""
        if self.fused_attention and not rows.causal:
            return self._attend_fused(index, q, rows)
        n_seq, n_max, length = len(rows.slots), rows.n_max, rows.length
        keys, values = self._cached(index, rows.slots, length)
        groups, dim = self.heads // self.kv_heads, self.head_dim
        if n_seq == 1:
            query = q.transpose(0, 1)[None]
        else:
            padded = q.new_zeros((n_seq * n_max, self.heads, dim))
            padded[rows.padded_index] = q
            query = padded.view(n_seq, n_max, self.heads, dim).transpose(1, 2)
        if rows.causal:
            out = F.scaled_dot_product_attention(
                query, keys, values, is_causal=True, scale=self.scale, enable_gqa=groups > 1
            )
        else:
            stacked = query.reshape(n_seq, self.kv_heads, groups * n_max, dim)
            out = F.scaled_dot_product_attention(
                stacked, keys, values, attn_mask=rows.grouped_mask(groups), scale=self.scale
            ).view(n_seq, self.heads, n_max, dim)
        out = out.transpose(1, 2).reshape(n_seq * n_max, self.heads * dim)
        return out if n_seq == 1 else out[rows.padded_index]

    def _attend_fused(self, index: int, q: torch.Tensor, rows: Rows) -> torch.Tensor:
        """:meth:`_attend` by caddtree's attention kernel, reading each sequence's slot in place:
        :func:`~caddtree.runtime.kernels.tree_attention` for one sequence,
        :func:`~caddtree.runtime.kernels.tree_attention_batch` (the same bits per row) for
        several."""
        keys, values = self.keys[index], self.values[index]
        mask, seqs = rows.attention_inputs()
        if len(rows.slots) == 1:
            slot = rows.slots[0]
            return tree_attention(q, keys[slot], values[slot], mask, self.scale)
        return tree_attention_batch(q, keys, values, mask, seqs, self.scale)

    def _cached(
        self, index: int, slots: list[int], length: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [B, kv_heads, length, D] of ``slots``: views when the slots are
        consecutive, else one gather of the first ``length`` entries."""
        keys, values = self.keys[index], self.values[index]
        first = slots[0]
        if slots == list(range(first, first + len(slots))):
            end = first + len(slots)
            return keys[first:end, :, :length], values[first:end, :, :length]
        index_t = torch.tensor(slots, device=keys.device)
        return (
            keys[:, :, :length].index_select(0, index_t),
            values[:, :, :length].index_select(0, index_t),
        )


class LeanVerifier(Verifier):
    """:class:`~caddtree.runtime.verifier.Verifier` on :class:`LeanTarget` (one sequence, in
    slot 0): the same protocol, outputs and lossless guarantees, without transformers' forward.

    ``pack``: on the CPU, keep the fused linear weights packed for oneDNN. ``compile``:
    ``"on"`` compiles the layers (:mod:`caddtree.runtime.compiled`; refused where they cannot be),
    ``"off"`` keeps them eager, ``"auto"`` compiles bfloat16 layers where they can be and falls
    back to eager, with a warning, if compiling fails. ``runtime`` says which runs.
    ``progress``: show the first compile's progress line."""

    def __init__(
        self,
        model: Any,
        feature_layer_ids: Sequence[int],
        *,
        pack: bool = True,
        compile: str = "off",
        progress: bool = True,
        blocks: dict[str, Blocks] | None = None,
    ) -> None:
        self._setup(model, feature_layer_ids)
        self.target = LeanTarget(model, self.feature_layer_ids, pack=pack, blocks=blocks)
        if compile == "on" or (compile == "auto" and self._compiles_well()):
            self._compile(compile, progress)
        self.runtime = "lean" if self.target.compiled is None else "compiled"
        self.reset()

    def _compiles_well(self) -> bool:
        """Whether ``auto`` compiles: bfloat16 layers that can be (float32 stays eager; see
        :mod:`caddtree.runtime.compiled`)."""
        from .compiled import compile_unsupported

        return self.target.dtype is torch.bfloat16 and compile_unsupported(self.target) is None

    def _compile(self, compile: str, progress: bool) -> None:
        try:
            self.target.compile(progress)
        except InvalidInputError:
            raise
        except Exception as error:  # noqa: BLE001 - a compiler failure leaves the eager runtime
            if compile == "on":
                raise
            self.target.compiled = None
            self.target.release()
            logger.warning(
                "compiling the target's layers failed (%s: %s); running them eagerly (runtime "
                "'lean'). Ask for --runtime lean to skip the attempt",
                type(error).__name__,
                str(error).splitlines()[0] if str(error) else "",
            )

    def packed_layers(self) -> int:
        return sum(
            isinstance(linear, Linear) and linear.packed is not None
            for layer in self.target.layers
            for linear in (layer.qkv, layer.o, layer.gate_up, layer.down)
        )

    def cache_capacity(self) -> int:
        return self.target.capacity

    def cache_bytes(self) -> int:
        return sum(t.nbytes for t in self.target.keys + self.target.values)

    def _new_cache(self, reserve: int | None) -> None:
        """Room for ``reserve`` positions; ``None`` lets the cache go (it is made again, as large
        as needed, by the next forward), so that a generation's memory is returned after it."""
        if reserve is None:
            self.target.release()
        else:
            self.target.reserve(1, reserve)

    def _forward(
        self, ids: torch.Tensor, positions: torch.Tensor, tree: DraftTree | None, last_only: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        start, n = self._length, int(ids.shape[0])
        if start + n > self.target.capacity:  # outgrown: carry the committed entries over
            self.target.reserve(1, start + n, keep=[start])
        visibility = tree.visibility_mask() if tree is not None and len(tree) else None
        rows = Rows.single(ids, positions, start, visibility)
        return self.target.forward(rows, slice(n - 1, n) if last_only else None)

    def _compact(self, prefix_length: int, keep: Sequence[int]) -> None:
        self.target.compact(0, prefix_length, keep)
