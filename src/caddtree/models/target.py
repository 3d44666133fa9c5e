"""Target-side helpers for tree verification with any transformers causal LM.

One decoding round verifies the bonus token ``b`` and a :class:`~caddtree.core.tree.DraftTree` of ``n``
nodes in **one** target forward pass over the ``q = n + 1`` tokens ``[b] + nodes``:

* **Tree attention** (:func:`tree_attention_mask`): a 4D additive float mask ``[1, 1, q, past + q]``,
  0 where visible and the dtype's minimum elsewhere. Every token sees the whole committed cache, and
  inside the tree its ancestors and itself (``DraftTree.visibility_mask``). transformers 5 passes a
  user-supplied 4D mask through unchanged (``masking_utils._preprocess_mask_arguments``) to the
  SDPA kernel or adds it to the scores (eager), so the model must use ``sdpa`` or ``eager``
  attention, or caddtree's ``caddtree_sdpa`` (:mod:`caddtree.models.attention`: SDPA that reads
  grouped-query heads in place under a mask on the CPU); FlashAttention-2 cannot take arbitrary
  masks.
* **Positions** (:func:`tree_position_ids`): ``start + depth`` with the bonus at depth 0, so each
  token has the position it would have in sequential decoding.
* **KV-cache compaction** (:func:`compact_cache`): after the walk, keep the committed prefix plus
  the accepted path ``[b, s_1, .., s_m]`` in order, exactly the cache sequential decoding would
  have built.
* **Context features** (:func:`extract_context_features`): the hidden states after the drafter's
  ``target_layer_ids``, concatenated, for the drafter's next round.

:class:`TreeVerifier` ties these together around a ``DynamicCache``.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import Cache, DynamicLayer

from ..core.tree import DraftTree
from ..runtime.verifier import Verifier, tree_position_ids
from ..util.errors import InvalidInputError
from .attention import GQA_SDPA
from .kvcache import ReservedLayer, reserved_cache

__all__ = [
    "CACHE_ARGUMENTS",
    "TreeVerifier",
    "cache_argument",
    "compact_cache",
    "extract_context_features",
    "tree_attention_mask",
    "tree_position_ids",
]

SUPPORTED_ATTENTION = ("sdpa", "eager", GQA_SDPA)

CACHE_ARGUMENTS = ("cache", "past_key_values")
"""The names of a transformers model's KV-cache input: ``cache`` from transformers 5.24 on,
``past_key_values`` before (5.24 still takes it, with a deprecation warning)."""


def cache_argument(model: torch.nn.Module) -> str:
    """The name under which ``model.forward`` takes its KV cache (see :data:`CACHE_ARGUMENTS`),
    read from its signature, so that no transformers release warns about a deprecated name."""
    parameters = inspect.signature(model.forward).parameters
    return next((name for name in CACHE_ARGUMENTS if name in parameters), CACHE_ARGUMENTS[-1])


def tree_attention_mask(
    tree: DraftTree, past_length: int, dtype: torch.dtype, device: torch.device | str
) -> torch.Tensor:
    """Additive tree-attention mask ``[1, 1, n+1, past_length + n+1]`` over ``[bonus] + nodes``.

    Entry ``[0, 0, i, j]`` is 0 where query ``i`` may attend to key ``j`` and
    ``torch.finfo(dtype).min`` elsewhere. Keys ``0 .. past_length-1`` are the committed cache
    (visible to all); key ``past_length + j`` is tree token ``j`` (0 = bonus, node ``k`` = ``k+1``),
    visible to query ``i`` when it is ``i`` or an ancestor of ``i``. One host-to-device copy.
    """
    visible = torch.from_numpy(tree.visibility_mask()).to(device, non_blocking=True)
    q = visible.shape[0]
    mask = torch.zeros((1, 1, q, past_length + q), dtype=dtype, device=device)
    mask[0, 0, :, past_length:].masked_fill_(~visible, torch.finfo(dtype).min)
    return mask


def extract_context_features(
    hidden_states: Sequence[torch.Tensor | None], layer_ids: Sequence[int]
) -> torch.Tensor:
    """Concatenate ``hidden_states[id + 1]`` over ``layer_ids``: [b, s, k*H].

    ``hidden_states`` is the tuple of a transformers forward with ``output_hidden_states``;
    entry ``id + 1`` is the output of decoder layer ``id`` (entry 0 is the embeddings).
    """
    return torch.cat([hidden_states[i + 1] for i in layer_ids], dim=-1)


@torch.inference_mode()
def compact_cache(cache: Cache, prefix_length: int, keep: Sequence[int] = ()) -> None:
    """Keep cache positions ``0 .. prefix_length-1`` then ``prefix_length + keep[i]``, in order.

    Everything after is dropped; ``keep=()`` truncates the cache to ``prefix_length`` tokens.
    ``keep`` are offsets into the entries appended after the prefix (for tree verification:
    indices into ``[bonus] + nodes``). When ``keep`` is ``0, 1, .., m-1`` this is a plain
    truncation (no copy); otherwise one gather per layer, written in place after the prefix.
    Works on every layer of a ``DynamicCache`` of full-attention layers; other layer types
    (sliding windows, static or quantized caches) raise :class:`InvalidInputError`.
    Runs in inference mode, so that it may write in place whether the cache was filled inside
    ``torch.inference_mode`` or only under ``torch.no_grad``.
    """
    keep = [int(i) for i in keep]
    new_length = prefix_length + len(keep)
    needed = prefix_length + (max(keep) + 1 if keep else 0)  # entries the cache must hold
    if prefix_length < 0 or (keep and min(keep) < 0):
        raise InvalidInputError(f"cannot keep {keep} after {prefix_length} tokens")
    contiguous = keep == list(range(len(keep)))
    index: torch.Tensor | None = None
    for layer_idx, layer in enumerate(cache.layers):
        if not getattr(layer, "is_initialized", False):
            continue
        _check_full_attention(layer_idx, layer)
        length = layer.keys.shape[-2]
        if max(needed, new_length) > length:
            raise InvalidInputError(
                f"cannot keep {keep} after {prefix_length} tokens of a {length}-token cache"
            )
        if not contiguous:
            if index is None or index.device != layer.keys.device:
                index = torch.tensor(keep, device=layer.keys.device) + prefix_length
            # index_select copies first, so writing over the same range in place is safe
            layer.keys[..., prefix_length:new_length, :] = layer.keys.index_select(-2, index)
            layer.values[..., prefix_length:new_length, :] = layer.values.index_select(-2, index)
        layer.keys = layer.keys[..., :new_length, :]
        layer.values = layer.values[..., :new_length, :]


def _check_full_attention(layer_idx: int, layer: Any) -> None:
    if type(layer) not in (DynamicLayer, ReservedLayer):
        raise InvalidInputError(
            f"KV-cache layer {layer_idx} is a {type(layer).__name__}; tree verification and "
            "compaction need full-attention DynamicCache layers (no sliding windows)"
        )


class TreeVerifier(Verifier):
    """:class:`~caddtree.runtime.verifier.Verifier` on transformers' forward and a
    ``DynamicCache`` (or caddtree's reserved cache on the CPU).

    Args:
        model: a transformers causal LM using ``sdpa`` or ``eager`` attention.
        feature_layer_ids: target layers whose outputs form the context features, in order (the
            drafter's ``target_layer_ids``); may be empty when no drafter needs features.
    """

    def __init__(self, model: PreTrainedModel, feature_layer_ids: Sequence[int]) -> None:
        attention = getattr(model.config, "_attn_implementation", None)
        if attention not in SUPPORTED_ATTENTION:
            raise InvalidInputError(
                f"tree verification needs attn_implementation 'sdpa', 'eager' or "
                f"'{GQA_SDPA}' (arbitrary 4D masks); the model uses {attention!r}: load it with "
                "attn_implementation='sdpa'"
            )
        self._setup(model, feature_layer_ids)
        self._cache_name = cache_argument(model)
        self.reset()
        for layer_idx, layer in enumerate(self.cache.layers):
            _check_full_attention(layer_idx, layer)

    runtime = "transformers"

    def packed_layers(self) -> int:
        """Linear layers the runtime packed itself (transformers' are packed on the model)."""
        return 0

    def cache_capacity(self) -> int:
        """Positions the KV cache has room for without growing (0: it grows as it fills)."""
        return int(getattr(self.cache.layers[0], "capacity", 0)) if self.cache.layers else 0

    def cache_bytes(self) -> int:
        """Bytes of keys and values the KV cache holds now."""
        return sum(
            layer.keys.nbytes + layer.values.nbytes
            for layer in self.cache.layers
            if getattr(layer, "is_initialized", False)
        )

    def _new_cache(self, reserve: int | None) -> None:
        if reserve is not None and self.device.type == "cpu":
            self.cache = reserved_cache(self.model.config, reserve)
        else:
            self.cache = DynamicCache(config=self.model.config)

    def _forward(
        self, ids: torch.Tensor, positions: torch.Tensor, tree: DraftTree | None, last_only: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`Verifier._forward` on transformers' model, the tree as a 4D mask."""
        start = self._length
        # A lone token needs no mask; passing none keeps transformers' fastest path.
        mask = tree_attention_mask(tree, start, self.dtype, self.device) if tree else None
        out = self.model(
            input_ids=ids[None],
            position_ids=positions[None],
            attention_mask=mask,
            **{self._cache_name: self.cache},
            use_cache=True,
            output_hidden_states=self._hidden_state_selection(),
            logits_to_keep=1 if last_only else 0,
        )
        return out.logits[0], self._features(out.hidden_states, ids[None])[0]

    def _compact(self, prefix_length: int, keep: Sequence[int]) -> None:
        """Keep the first ``prefix_length`` cache entries, then the ones at ``keep`` after them."""
        compact_cache(self.cache, prefix_length, keep)

    def _hidden_state_selection(self) -> list[int] | bool:
        # transformers 5 keeps only the listed hidden states (others are None); older 5.x releases
        # treat any non-empty list as True. Either way ``hidden_states[id + 1]`` is layer id's output.
        return [i + 1 for i in self.feature_layer_ids] if self.feature_layer_ids else False

    def _features(self, hidden_states: Any, ids: torch.Tensor) -> torch.Tensor:
        if not self.feature_layer_ids:
            return ids.new_zeros((1, ids.shape[1], 0), dtype=self.dtype)
        return extract_context_features(hidden_states, self.feature_layer_ids)
