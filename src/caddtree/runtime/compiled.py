"""The lean runtime's decoder layers compiled by ``torch.compile`` (inductor): the ``compiled``
runtime.

:class:`~caddtree.runtime.lean.LeanTarget` pays a fixed cost per torch call (about 40 calls per
decoder layer: norms, rotary, cache writes, attention, residuals), and on a small model on a CPU
that cost is a large share of a forward. Compiled, the elementwise work of a layer is fused into a
few C++ loops and the layer loop runs as generated C++ (``cpp_wrapper``), calling the same packed
linear kernels (:func:`~caddtree.runtime.packing.packed_linear`: caddtree's bfloat16 kernel, a
custom op inductor calls as it is, or oneDNN's) and the same attention kernel as the eager
runtime.

Two graphs serve every call of one sequence (cache slot 0 of a one-slot cache) after the prompt:
**one row** (plain decoding, and trees of the root alone) and **a tree of n >= 2 rows**. Where the
target uses caddtree's attention kernel (bfloat16 on CPUs with AVX512-BF16 or AVX2,
:func:`~caddtree.runtime.kernels.tree_attention`), both attend with it; elsewhere one row attends
without a mask, as products and sums that inductor fuses (:func:`_attend_one_row`, since for one
query the flash kernel's fixed cost per call is most of its time), and a tree with the flash
kernel under its boolean mask. Inductor rounds to the dtype between fused operations as eager
code does (``emulate_precision_casts``): with caddtree's kernels a row then gets the same bits in
either graph, so plain decoding and tree verification agree exactly in bfloat16 too.

Both are compiled once for every context length, cache capacity and (the tree graph) row count:
those sizes are dynamic in the graphs, so a generation never waits for a recompile. A prompt (a
causal prefill), several sequences per call and calls that want only some rows' logits run the
eager runtime. The arithmetic is the eager runtime's: :func:`~caddtree.runtime.lean.decoder_layer`
is traced as it is, only its cache step (:func:`_attend`) is written for static graphs.

**Calls skip the frame evaluation.** ``torch.compile`` checks, before every call, the guards of
every graph it compiled for the function, over hundreds of weight tensors and a cache per layer.
A call here goes straight to the code dynamo compiled for the graph it expects once dynamo's own
guards for that graph pass (:meth:`CompiledLayers._run`), and checks those guards again only when
the cache tensors were replaced; any other call goes through ``torch.compile`` as usual.

**Weights stay inputs.** The graphs take the packed weights as inputs instead of freezing them
into the graph (inductor's ``freezing``), so that inductor's on-disk caches (FX graph and
AOTAutograd) keep the compiled code between processes: the first run on a machine compiles, and
later runs load the compiled code instead. Inductor lowers oneDNN's
packed linear only for frozen weights; :func:`_lower_unfrozen_packed_linear` makes it call the
same kernel for weights given as inputs. The cache is ``$TORCHINDUCTOR_CACHE_DIR`` when set to
other than torch's default, else
``<caddtree cache>/inductor`` (:func:`caddtree.util.defaults.cache_root`).

**Where it runs.** ``runtime="auto"`` picks it on the CPU for bfloat16 targets whose linear
layers are packed, where a C++ compiler is present (inductor needs one); float32 stays eager
unless asked for by name, as compiling it did not pay on the CPU (``benchmarks/vs_llamacpp.py
--runtime lean compiled`` compares them). On CUDA the
same graphs compile without CUDA graphs (their dynamic sizes would re-record per length); that
path has not been run yet, as no GPU has been available to this project.

Compiled bfloat16 logits differ from eager bfloat16 in the last bits (another order of the same
sums), so every method of a generator runs through the same runtime: plain decoding and tree
verification through the same graphs, and outputs stay lossless against plain decoding on it.
"""

from __future__ import annotations

import inspect
import logging
import os
import time
import types
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F

from ..util.defaults import cache_root
from .kernels import cxx_compiler, tree_attention, tree_attention_batch
from .layers import LayerWeights, Shape, decoder_layer, rms_norm

__all__ = ["CompiledLayers", "compile_progress", "compile_unsupported"]

logger = logging.getLogger(__name__)

_RECOMPILE_LIMIT = 64

INDUCTOR_OPTIONS = {
    "cpp_wrapper": True,
    "cpp_wrapper_build_separate": True,
    # round to the dtype between fused ops as eager does: the one-row and tree graphs then give
    # a row the same bits (their linear and attention kernels do too), so bfloat16 speculative
    # decoding equals plain decoding token for token on this runtime
    "emulate_precision_casts": True,
}
"""inductor's options for the CPU graphs."""


def compile_unsupported(target: Any) -> str | None:
    """Why a :class:`~caddtree.runtime.lean.LeanTarget`'s layers cannot be compiled here (``None``: they can)."""
    if not hasattr(torch, "compile"):
        return "this PyTorch has no torch.compile"
    if target.device.type == "cpu":
        if target.dtype not in (torch.bfloat16, torch.float32):
            return f"inductor's CPU path is not used for {target.dtype} here (bfloat16, float32)"
        if not target.pack:
            return "its linear layers are not packed for oneDNN (compiled plain linears are slow)"
        if not cxx_compiler():
            return "no C++ compiler was found (inductor needs one: install g++ or set CXX)"
    return None


def _lower_unfrozen_packed_linear() -> None:
    """Let inductor compile oneDNN's packed linear (``mkldnn._linear_pointwise``) whose weight
    is a graph input: its lowering asserts a frozen weight, so for any other weight the op is
    called as it is (an extern kernel), and a fused residual add is split off again."""
    from torch._inductor import lowering
    from torch._inductor.virtualized import V

    unary = torch.ops.mkldnn._linear_pointwise.default
    binary = torch.ops.mkldnn._linear_pointwise.binary
    if getattr(lowering.lowerings.get(unary), "_caddtree", False):
        return
    frozen_unary, frozen_binary = lowering.lowerings[unary], lowering.lowerings[binary]
    call_unary = lowering.fallback_handler(unary, add_to_fallback_set=False)
    add = lowering.lowerings[torch.ops.aten.add.Tensor]

    def frozen(weight: Any) -> bool:
        name = weight.get_name() if hasattr(weight, "get_name") else None
        return name in V.graph.constants

    def lower_unary(x: Any, weight: Any, *args: Any, **kwargs: Any) -> Any:
        if frozen(weight):
            return frozen_unary(x, weight, *args, **kwargs)
        return call_unary(x, weight, *args, **kwargs)

    def lower_binary(
        x: Any, other: Any, weight: Any, bias: Any, attr: str, *a: Any, **k: Any
    ) -> Any:
        if frozen(weight) or attr != "add":
            return frozen_binary(x, other, weight, bias, attr, *a, **k)
        return add(call_unary(x, weight, bias, "none", [], ""), other)

    lower_unary._caddtree = True  # type: ignore[attr-defined]
    lowering.lowerings[unary], lowering.lowerings[binary] = lower_unary, lower_binary


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    shape: Shape,
    keys: torch.Tensor,
    values: torch.Tensor,
    entries: torch.Tensor,
    mask: torch.Tensor,
    fused: bool,
) -> torch.Tensor:
    """Write the rows' keys and values at cache ``entries`` and attend over the first
    ``mask.shape[-1]`` entries: with caddtree's attention kernel where the target uses it
    (``fused``; :func:`~caddtree.runtime.kernels.tree_attention`, the same code for one row and a
    tree), else one row needs no mask (:func:`_attend_one_row`) and a tree takes ``mask``
    [1, 1, n, L]."""
    n, length = q.shape[0], mask.shape[-1]
    keys.index_copy_(2, entries, k.transpose(0, 1)[None])
    values.index_copy_(2, entries, v.transpose(0, 1)[None])
    scale = shape.head_dim**-0.5
    if fused:
        return tree_attention(q, keys[0], values[0], mask, scale)
    k_seen, v_seen = keys[:, :, :length], values[:, :, :length]
    if n == 1:
        return _attend_one_row(q, k_seen[0], v_seen[0], shape, scale)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        k_seen,
        v_seen,
        attn_mask=mask,
        scale=scale,
        enable_gqa=shape.heads != shape.kv_heads,
    )
    return out.transpose(1, 2).reshape(n, -1)


def _attend_one_row(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, shape: Shape, scale: float
) -> torch.Tensor:
    """Attention of one row ``q`` [1, heads, d] over ``keys``, ``values`` [kv_heads, L, d],
    written as products and sums that inductor fuses into a few loops (in float32, as the flash
    kernel accumulates): for one query the flash kernel's fixed cost per call is most of its
    time. The query heads that share a key/value head are that head's ``groups`` queries."""
    groups = shape.heads // shape.kv_heads
    query = q.float().view(shape.kv_heads, groups, 1, shape.head_dim)
    scores = (query * keys.float()[:, None]).sum(-1) * scale  # [kv_heads, groups, L]
    probs = torch.softmax(scores, -1)
    out = (probs[..., None] * values.float()[:, None]).sum(-2)  # [kv_heads, groups, d]
    return out.reshape(1, -1).to(q.dtype)


def _stack(
    layers: Sequence[LayerWeights],
    shape: Shape,
    feature_ids: tuple[int, ...],
    final_norm: torch.Tensor,
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    attend_in: Callable[[int], Callable[..., torch.Tensor]],
) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """Every decoder layer (layer ``i`` attending by ``attend_in(i)``), then the final norm.
    Returns the normed last hidden state and the feature layers' outputs (the last layer's is
    the normed one)."""
    outputs: dict[int, torch.Tensor] = {}
    for index, layer in enumerate(layers):
        x = decoder_layer(layer, shape, x, cos, sin, attend_in(index))
        if index in feature_ids:
            outputs[index] = x
    normed = rms_norm(x, final_norm, shape.eps)
    if len(layers) - 1 in outputs:
        outputs[len(layers) - 1] = normed
    return normed, outputs


def _layers(
    layers: Sequence[LayerWeights],
    shape: Shape,
    feature_ids: tuple[int, ...],
    final_norm: torch.Tensor,
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    entries: torch.Tensor,
    mask: torch.Tensor,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    fused_attention: bool,
) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """What the one-sequence graphs compute (slot 0 of a one-slot cache; see :func:`_stack`)."""
    _one_capacity(keys, values)

    def attend_in(index: int) -> Callable[..., torch.Tensor]:
        return partial(
            _attend,
            shape=shape,
            keys=keys[index],
            values=values[index],
            entries=entries,
            mask=mask,
            fused=fused_attention,
        )

    return _stack(layers, shape, feature_ids, final_norm, x, cos, sin, attend_in)


def _one_capacity(keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
    """Tell the graph that every cache holds as many entries as the first: each cache's length
    is dynamic, and without this each would be a size of its own that every call passes in."""
    for cache in (*keys[1:], *values):
        torch._check(cache.shape[2] == keys[0].shape[2])


def _batch_layers(
    layers: Sequence[LayerWeights],
    shape: Shape,
    feature_ids: tuple[int, ...],
    final_norm: torch.Tensor,
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    slots: torch.Tensor,
    entries: torch.Tensor,
    mask: torch.Tensor,
    seqs: torch.Tensor,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """What the batch graph computes: rows of several sequences in a cache of several slots,
    each row's keys and values written at (``slots``, ``entries``) and its attention by
    :func:`~caddtree.runtime.kernels.tree_attention_batch` under ``mask`` [N, L] and ``seqs``."""
    _one_capacity(keys, values)
    scale = shape.head_dim**-0.5

    def attend_in(index: int) -> Callable[..., torch.Tensor]:
        cache_k, cache_v = keys[index], values[index]

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            cache_k[slots, :, entries] = k
            cache_v[slots, :, entries] = v
            return tree_attention_batch(q, cache_k, cache_v, mask, seqs, scale)

        return attend

    return _stack(layers, shape, feature_ids, final_norm, x, cos, sin, attend_in)


_ARGUMENTS = {fn: tuple(inspect.signature(fn).parameters) for fn in (_layers, _batch_layers)}


def _choose_inductor_cache() -> None:
    """Point inductor's caches at ``<caddtree cache>/inductor`` unless the user chose a directory:
    torch fills ``$TORCHINDUCTOR_CACHE_DIR`` in with its default (a temporary directory, gone at
    the next boot) as soon as it is imported, so that default counts as not chosen."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    if os.environ.get("TORCHINDUCTOR_CACHE_DIR") in (None, "", default_cache_dir()):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_root() / "inductor")


def _compiled_code(
    fn: Callable[..., Any], args: tuple[Any, ...]
) -> tuple[Callable[..., Any], Any] | None:
    """The code dynamo compiled for ``fn`` (:func:`_layers`, :func:`_batch_layers`) whose guards
    pass for ``args``, as a function,
    and those guards; ``None`` where this torch does not expose them or no graph's guards pass
    (then every call of that kind goes through ``torch.compile``'s frame evaluation).

    Dynamo's frame evaluation checks the guards of every graph compiled for a function before it
    runs one, which for these graphs (hundreds of weight tensors, a cache per layer) costs a
    sizeable share of a one-row forward; :meth:`CompiledLayers._run` checks only the guards of
    the graph it expects, with dynamo's own guard manager, and runs dynamo's code for it."""
    try:
        from torch._dynamo.eval_frame import _debug_get_cache_entry_list

        local = dict(zip(_ARGUMENTS[fn], args))
        for entry in _debug_get_cache_entry_list(fn.__code__):
            if entry.guard_manager.check(local):
                code = types.FunctionType(entry.code, fn.__globals__, fn.__name__)
                return code, entry.guard_manager
    except (ImportError, AttributeError, TypeError):  # another torch: no shortcut
        logger.debug("dynamo's compiled code is not reachable; calls go through torch.compile")
    return None


class CompiledLayers:
    """The compiled layers of one :class:`~caddtree.runtime.lean.LeanTarget` (see the module
    docstring); :meth:`serves` says which calls (:class:`~caddtree.runtime.lean.Rows`) they take,
    :meth:`__call__` runs one. The target compiles both graphs when it makes them
    (:meth:`~caddtree.runtime.lean.LeanTarget.compile`)."""

    def __init__(self, target: Any) -> None:
        _choose_inductor_cache()
        if target.device.type == "cpu":
            _lower_unfrozen_packed_linear()
        self.target = target
        # Dynamo keeps up to recompile_limit graphs per function: two per model shape here
        # (one row, trees), so a process running several models needs more than the default 8.
        limit = torch._dynamo.config.recompile_limit
        torch._dynamo.config.recompile_limit = max(limit, _RECOMPILE_LIMIT)
        options = dict(INDUCTOR_OPTIONS)
        # per graph kind: the code dynamo made for it and its guards, and the stamp under which
        # those guards last passed (see _run)
        self._known: dict[str, tuple[Callable[..., Any], Any] | None] = {}
        self._checked: dict[str, tuple[Any, ...]] = {}
        compile_options = options if target.device.type == "cpu" else None
        self._graphs = {
            fn: torch.compile(fn, dynamic=False, fullgraph=True, options=compile_options)
            for fn in (_layers, _batch_layers)
        }

    def serves(self, rows: Any, logits_rows: Any) -> bool:
        """Whether a call goes to the graphs (not a causal prefill, every row's logits wanted or
        one row, two cache entries attended at least: the graphs specialise sizes 0 and 1): one
        sequence in a one-slot cache after its prompt, or (:meth:`serves_batch`) two or more rows
        of any sequences of a cache of several slots."""
        if rows.causal or rows.length < 2:
            return False
        if not (logits_rows is None or rows.counts[0] == 1):
            return False
        return self._one_sequence(rows) or self.serves_batch(rows)

    def _one_sequence(self, rows: Any) -> bool:
        return self.target.slots == 1 and len(rows.slots) == 1

    def serves_batch(self, rows: Any) -> bool:
        """Whether the batch graphs take ``rows`` (see :meth:`serves`): calls of a cache of
        several slots, where the target attends with caddtree's attention kernel."""
        return (
            self.target.fused_attention
            and not self._one_sequence(rows)
            and not rows.causal
            and rows.length >= 2
        )

    @torch.no_grad()
    def __call__(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rows: Any
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        if not self._one_sequence(rows):
            return self._batch_call(x, cos, sin, rows)
        target, n, start = self.target, x.shape[0], rows.starts[0]
        entries = torch.arange(start, start + n, device=x.device)
        mask = rows.mask
        if mask is None:  # one row: the mask only carries the attended length
            mask = torch.ones((1, 1, 1, start + n), dtype=torch.bool, device=x.device)
        torch._dynamo.mark_dynamic(mask, 3)  # the attended length
        if n > 1:  # the tree graph: any number of rows
            for tensor in (x, cos, sin, entries):
                torch._dynamo.mark_dynamic(tensor, 0)
            torch._dynamo.mark_dynamic(mask, 2)
        args = (
            target.layers,
            target.shape,
            target.feature_layer_ids,
            target.final_norm_weight,
            x,
            cos,
            sin,
            entries,
            mask,
            target.keys,
            target.values,
            target.fused_attention,
        )
        return self._run("row" if n == 1 else "tree", _layers, args)

    def _batch_call(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rows: Any
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """The batch graphs: one for a lone row (a cache of several slots holding one
        sequence that decodes plainly), one for every other number of rows; both for any number
        of sequences (``seqs`` has 2 entries at least: a lone sequence gets an empty partner)
        and any context."""
        target, n = self.target, x.shape[0]
        slots, entries = rows.cache_entries()
        mask, seqs = rows.attention_inputs()
        for tensor in (x, cos, sin, slots, entries, mask) if n > 1 else ():
            torch._dynamo.mark_dynamic(tensor, 0)
        torch._dynamo.mark_dynamic(seqs, 0)
        torch._dynamo.mark_dynamic(mask, 1)
        args = (
            target.layers,
            target.shape,
            target.feature_layer_ids,
            target.final_norm_weight,
            x,
            cos,
            sin,
            slots,
            entries,
            mask,
            seqs,
            target.keys,
            target.values,
        )
        return self._run("batch" if n > 1 else "batch row", _batch_layers, args)

    def _run(
        self, kind: str, fn: Callable[..., Any], args: tuple[Any, ...]
    ) -> tuple[torch.Tensor, dict[int, Any]]:
        """Run the graph of ``kind`` on ``args``: straight through the code dynamo compiled for
        it when dynamo's own guards for that code pass, else through ``torch.compile``'s frame
        evaluation (which compiles or picks the graph), remembering the code that ran.

        The guards cover hundreds of tensors (every weight, every cache) and cost a noticeable
        share of a small forward, yet between two calls only the per-call inputs change, and
        those this class makes the same way every time. So once the guards passed, they are
        checked again only when the cache tensors were replaced (:meth:`_stamp`); the weights
        are read once and never change (see :class:`~caddtree.runtime.lean.LeanTarget`)."""
        known = self._known.get(kind, ())
        if known is None:  # this torch exposes no compiled code: no shortcut
            return self._graphs[fn](*args)
        stamp = self._stamp()
        if known and (
            self._checked.get(kind) == stamp or known[1].check(dict(zip(_ARGUMENTS[fn], args)))
        ):
            self._checked[kind] = stamp
            return known[0](*args)
        out = self._graphs[fn](*args)
        self._known[kind] = _compiled_code(fn, args)  # found by its guards passing for args
        self._checked[kind] = stamp
        return out

    def _stamp(self) -> tuple[Any, ...]:
        """What the guards see beyond the per-call inputs: the cache tensors (replaced when the
        cache grows or is released) and the autograd mode."""
        target = self.target
        return (
            id(target.keys),
            id(target.values),
            target.slots,
            target.capacity,
            torch.is_grad_enabled(),
            torch.is_inference_mode_enabled(),
        )


@contextmanager
def compile_progress(progress: bool, total: int) -> Iterator[Any]:
    """A progress line for compiling ``total`` graphs (silent where ``progress`` is false),
    closed after them, with the time taken logged."""
    from tqdm.auto import tqdm

    began = time.perf_counter()
    bar = tqdm(
        total=total,
        desc="preparing the target's compiled layers (a machine's first run compiles them, 1-2 min)",
        leave=False,
        disable=not progress,
    )
    try:
        yield bar
    finally:
        bar.close()
    logger.info("compiled layers ready in %.1f s", time.perf_counter() - began)
