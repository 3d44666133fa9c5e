"""The verifier protocol every target runtime keeps (:class:`Verifier`): prefill, verify a draft
tree in one forward, commit the accepted path, discard or truncate, with the KV cache always
holding exactly what sequential decoding would have left. A runtime supplies the forward and its
cache (``_new_cache``, ``_forward``, ``_compact``): transformers' in
:class:`caddtree.models.target.TreeVerifier`, caddtree's own in
:class:`caddtree.runtime.lean.LeanVerifier`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ..core.tree import DraftTree, verification_rows
from ..util.errors import InvalidInputError

__all__ = ["Verifier", "tree_position_ids"]


def tree_position_ids(tree: DraftTree, start: int) -> np.ndarray:
    """Positions ``start + depth`` of ``[bonus] + nodes`` (the bonus has depth 0), int64 [n+1]."""
    return start + np.concatenate(([0], tree.depths)).astype(np.int64)


class Verifier:
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

    A runtime sets ``runtime`` (its name, ``--runtime``) and implements the hooks below.
    """

    runtime = ""
    """The name of the forward this verifier runs (``--runtime``)."""

    def _setup(self, model: Any, feature_layer_ids: Sequence[int]) -> None:
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

    # ---- the runtime's hooks ---------------------------------------------------------------------

    def packed_layers(self) -> int:
        """Linear layers the runtime packed itself."""
        return 0

    def cache_capacity(self) -> int:
        """Positions the KV cache has room for without growing (0: it grows as it fills)."""
        raise NotImplementedError

    def cache_bytes(self) -> int:
        """Bytes of keys and values the KV cache holds now."""
        raise NotImplementedError

    def _new_cache(self, reserve: int | None) -> None:
        """A new, empty KV cache with room for ``reserve`` positions (``None``: as needed)."""
        raise NotImplementedError

    def _forward(
        self, ids: torch.Tensor, positions: torch.Tensor, tree: DraftTree | None, last_only: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One forward over ``ids`` [q] at ``positions`` [q], appended to the cache after the
        committed context: causal among themselves when ``tree`` is ``None`` (a prefill), else
        ``[bonus] + tree`` under tree attention. Returns logits [q, V] (only the last row, [1, V],
        when ``last_only``) and the context features [q, k*H]."""
        raise NotImplementedError

    def _compact(self, prefix_length: int, keep: Sequence[int]) -> None:
        """Keep the first ``prefix_length`` cache entries, then the ones at ``keep`` after them."""
        raise NotImplementedError

    # ---- the protocol ---------------------------------------------------------------------------

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
