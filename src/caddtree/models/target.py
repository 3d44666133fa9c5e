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

import numpy as np
import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import Cache, DynamicLayer

from ..core.tree import DraftTree, verification_rows
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


def tree_position_ids(tree: DraftTree, start: int) -> np.ndarray:
    """Positions ``start + depth`` of ``[bonus] + nodes`` (the bonus has depth 0), int64 [n+1]."""
    return start + np.concatenate(([0], tree.depths)).astype(np.int64)


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


class TreeVerifier:
    """Verifies draft trees with a causal LM and keeps its KV cache on the committed sequence.

    Protocol (``k*H`` = number of feature layers times hidden size)::

        logits, feats = verifier.prefill(prompt_ids)      # logits [V] after the prompt, feats [1,T,k*H]
        bonus = choose(logits)
        loop:
            logits, feats = verifier.verify(bonus, tree)  # [n+1, V], [n+1, k*H] for [bonus] + nodes
            nodes, next_bonus = walk(tree, logits)        # nodes: the accepted path's node
                                                          #   indices, from the root down
            new_feats = verifier.commit(nodes)            # [1, 1 + len(nodes), k*H]
            bonus = next_bonus

    Row ``i`` of ``verify``'s logits is the target's next-token distribution after token ``i`` of
    ``[bonus] + nodes`` (so node ``k`` is row ``k + 1``) (after the prefix, the bonus and node ``i``'s ancestors). After ``commit`` the
    cache holds the committed tokens plus ``bonus`` and the accepted nodes, exactly as sequential
    decoding would have left it; ``context_length`` counts them. ``commit`` returns the context
    features of the newly committed tokens, which is what ``DFlashProposer.propose`` takes next.
    An empty tree (plain autoregressive decoding) verifies just the bonus.

    Per round: one forward; a few small host-to-device copies (tokens with positions, the tree
    visibility, the accepted indices) and no device-to-host synchronisation; one gather per layer
    in ``commit``, none when the accepted path is the first nodes in order (as for a chain).

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

    def _setup(self, model: PreTrainedModel, feature_layer_ids: Sequence[int]) -> None:
        """What every runtime keeps: the model, its feature layers, window, device and dtype."""
        config = model.config.get_text_config()
        n_layers = int(config.num_hidden_layers)
        ids = tuple(int(i) for i in feature_layer_ids)
        if any(not 0 <= i < n_layers for i in ids):
            raise InvalidInputError(
                f"feature layer ids {list(ids)} are not all layers of a {n_layers}-layer model"
            )
        self.model = model
        self.feature_layer_ids = ids
        self.max_positions: int | None = getattr(config, "max_position_embeddings", None)
        embeddings = model.get_input_embeddings().weight
        self.device, self.dtype = embeddings.device, embeddings.dtype

    @property
    def context_length(self) -> int:
        """Committed tokens in the KV cache (prompt + every committed bonus and accepted node)."""
        return self._length

    def reset(self, reserve: int | None = None) -> None:
        """Empty the KV cache (call before a new prompt). ``reserve``: the most positions the
        coming generation may fill (prompt, output and its largest tree); on the CPU its cache then
        writes in place into room reserved once (:mod:`caddtree.models.kvcache`) rather than
        re-copying itself every round."""
        self._new_cache(reserve)
        self._length = 0
        self._pending: tuple[DraftTree, torch.Tensor] | None = None

    # ---- the runtime: transformers' forward (a subclass may run another) ------------------------

    runtime = "transformers"
    """The name of the forward this verifier runs (``--runtime``)."""

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
        """One forward over ``ids`` [q] at ``positions`` [q], appended to the cache after the
        committed context: causal among themselves when ``tree`` is ``None`` (a prefill), else
        ``[bonus] + tree`` under tree attention. Returns logits [q, V] (only the last row, [1, V],
        when ``last_only``) and the context features [q, k*H]."""
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

    @torch.no_grad()
    def prefill(self, input_ids: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``input_ids`` (a 1D sequence or [1, T]) to the committed context.

        Returns the logits after the last token [V] and the context features of the ``T`` new
        tokens [1, T, k*H]. Usually called once, after :meth:`reset`, with the prompt.
        """
        if self._pending is not None:
            raise InvalidInputError("commit() the pending verification before prefilling")
        ids = torch.as_tensor(input_ids, dtype=torch.long).reshape(-1).to(self.device)
        n_new = ids.shape[0]
        if n_new == 0:
            raise InvalidInputError("prefill needs at least one token")
        self._check_positions(self._length + n_new, f"the prompt is too long: {n_new} tokens")
        positions = torch.arange(self._length, self._length + n_new, device=self.device)
        logits, features = self._forward(ids, positions, None, last_only=True)
        self._length += n_new
        return logits[-1], features[None]

    @torch.no_grad()
    def verify(self, bonus_token: int, tree: DraftTree) -> tuple[torch.Tensor, torch.Tensor]:
        """One forward over ``[bonus] + nodes`` with tree attention; see the class docstring.

        Returns logits [n+1, V] and context features [n+1, k*H] for ``[bonus] + nodes``. The KV
        cache keeps all ``n+1`` entries until :meth:`commit`.
        """
        if self._pending is not None:
            raise InvalidInputError("commit() the previous verification before verifying again")
        start = self._length
        self._check_positions(
            start + tree.max_depth + 1,
            f"the context is too long to verify a depth-{tree.max_depth} tree after {start} tokens",
        )
        ids_and_positions = np.stack(
            (np.concatenate(([int(bonus_token)], tree.token_ids)), tree_position_ids(tree, start))
        )
        ids, positions = torch.from_numpy(ids_and_positions).to(self.device, non_blocking=True)
        logits, features = self._forward(ids, positions, tree, last_only=False)
        self._pending = (tree, features[None])
        return logits, features

    @torch.no_grad()
    def commit(self, nodes: Sequence[int]) -> torch.Tensor:
        """Keep the bonus token and the accepted ``nodes`` of the last :meth:`verify` in the KV
        cache.

        ``nodes`` are tree node indices along a path from the root down (``[]``: the bonus token
        alone; ``[0, 3]``: node 0 and its child node 3). Returns the context features of the
        committed tokens, ``[1, 1 + len(nodes), k*H]``.
        """
        tree, features = self._verification()
        nodes = [int(k) for k in nodes]
        _check_path(tree, nodes)  # a refused path leaves the verification pending
        self._pending = None
        rows = verification_rows(nodes)
        self._compact(self._length, rows)
        self._length += len(rows)
        if nodes == list(range(len(nodes))):
            return features[:, : len(rows)]
        return features[:, torch.tensor(rows, device=features.device)]

    def discard(self) -> None:
        """Drop the last :meth:`verify` from the KV cache: the context is as before it."""
        self._verification()
        self._pending = None
        self._compact(self._length, [])

    def _verification(self) -> tuple[DraftTree, torch.Tensor]:
        """The pending verification's tree and features."""
        if self._pending is None:
            raise InvalidInputError("commit() or discard() needs a verify() first")
        return self._pending

    def truncate(self, length: int) -> None:
        """Keep only the first ``length`` committed tokens in the KV cache (the cache then holds
        what a prefill of those tokens alone would have left: the model is causal)."""
        if self._pending is not None:
            raise InvalidInputError("commit() the pending verification before truncating")
        if not 0 <= int(length) <= self._length:
            raise InvalidInputError(
                f"cannot truncate a {self._length}-token context to {length} tokens"
            )
        self._compact(int(length), [])
        self._length = int(length)

    # ---- internals ------------------------------------------------------------------------------

    def _hidden_state_selection(self) -> list[int] | bool:
        # transformers 5 keeps only the listed hidden states (others are None); older 5.x releases
        # treat any non-empty list as True. Either way ``hidden_states[id + 1]`` is layer id's output.
        return [i + 1 for i in self.feature_layer_ids] if self.feature_layer_ids else False

    def _features(self, hidden_states: Any, ids: torch.Tensor) -> torch.Tensor:
        if not self.feature_layer_ids:
            return ids.new_zeros((1, ids.shape[1], 0), dtype=self.dtype)
        return extract_context_features(hidden_states, self.feature_layer_ids)

    def _check_positions(self, needed: int, problem: str) -> None:
        if self.max_positions is not None and needed > self.max_positions:
            raise InvalidInputError(
                f"{problem}: {needed} positions exceed the context window of "
                f"{self.max_positions} (the model's max_position_embeddings, unless "
                "context_window= set another)"
            )


def _check_path(tree: DraftTree, nodes: list[int]) -> None:
    """Raise unless ``nodes`` is a path of ``tree`` from the root down."""
    parent = -1
    for node in nodes:
        if not 0 <= node < len(tree) or int(tree.parents[node]) != parent:
            where = "the root" if parent < 0 else f"node {parent}"
            raise InvalidInputError(
                f"{nodes} is not a path of the verified tree from its root: node {node} is not "
                f"a child of {where}"
            )
        parent = node
