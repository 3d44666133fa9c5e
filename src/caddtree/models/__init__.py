"""Models: the DFlash drafter and the transformers verifier (caddtree's own target runtime is
:mod:`caddtree.runtime`).

* :class:`DFlashDraftModel` (``dflash``) - loads and saves released DFlash checkpoints;
  :class:`DFlashProposer` (``proposer``) runs it once per round and returns draft logits.
* :class:`TreeVerifier` (``target``) - the verifier protocol
  (:class:`~caddtree.runtime.verifier.Verifier`) on transformers' forward: prefill, one-pass tree
  verification and KV-cache compaction for any transformers causal LM with ``sdpa`` or ``eager``
  attention, built on :func:`tree_attention_mask`, :func:`tree_position_ids`,
  :func:`compact_cache` and :func:`extract_context_features`.
"""

from .dflash import (
    DFLASH_ARCHITECTURE,
    DFlashDraftModel,
    DFlashSettings,
    check_drafter_fits_target,
    default_target_layer_ids,
)
from .proposer import DFlashProposer
from .target import (
    TreeVerifier,
    compact_cache,
    extract_context_features,
    tree_attention_mask,
    tree_position_ids,
)

__all__ = [
    "DFLASH_ARCHITECTURE",
    "DFlashDraftModel",
    "DFlashProposer",
    "DFlashSettings",
    "TreeVerifier",
    "check_drafter_fits_target",
    "compact_cache",
    "default_target_layer_ids",
    "extract_context_features",
    "tree_attention_mask",
    "tree_position_ids",
]
