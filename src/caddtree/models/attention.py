"""Attention for grouped-query targets on the CPU: tree masks and single queries without copies.

A grouped-query model (SmolLM2: 9 query heads over 3 key/value heads; Qwen3: 4 or more query heads
per key/value head) shares each key/value head among several query heads. :data:`GQA_SDPA`
(``"caddtree_sdpa"``) is transformers' SDPA attention with two CPU paths of its own:

* **A tree mask** (a 4D mask over several queries, :func:`caddtree.models.target.tree_attention_mask`):
  transformers' SDPA expands the shared heads into full copies (``repeat_kv``) whenever it is given
  a mask, so every verification would copy the whole KV cache of every layer, a cost that grows
  with the context. PyTorch's ``scaled_dot_product_attention`` reads grouped heads in place when
  asked (``enable_gqa=True``); transformers asks only without a mask, because on CUDA a mask with
  grouped heads falls back to the slow math kernel. On the CPU it does not.
* **A single query** (plain decoding's step, a round that verifies only the bonus token): the
  CPU's flash kernel with ``enable_gqa=True`` spends per query head what a longer query block
  would share, and grows steeply with the context. The query heads that share a key/value head
  are stacked as that head's queries instead (``[b, h_kv, groups, d]``), one flash call per
  key/value head, several times faster at long contexts (``benchmarks/attention_gqa.py
  --single-query`` measures both). The same kernel computes the same softmax in float32, over the
  same keys.

Everything else (the prompt; CUDA; position biases; a paged cache; one key/value head per query
head) goes to transformers' own SDPA function unchanged, and masks are built as for ``"sdpa"``.
On the built-in target one verification's logits were identical to the bit to transformers' SDPA
(``benchmarks/attention_gqa.py`` checks it and times both). Importing this module registers the
name with transformers' ``AttentionInterface`` and ``AttentionMaskInterface``;
:meth:`caddtree.SpeculativeGenerator.from_pretrained` loads CPU targets with it.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

__all__ = ["GQA_SDPA", "gqa_sdpa_attention", "preferred_attention"]

GQA_SDPA = "caddtree_sdpa"

# SDPA's enable_gqa argument exists from torch 2.5 on
_TORCH_HAS_GQA = tuple(int(p) for p in torch.__version__.split(".")[:2] if p.isdigit()) >= (2, 5)


def gqa_sdpa_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: ``query`` [b, h, q, d], ``key``/``value``
    [b, h_kv, k, d]; returns ``([b, q, h, d], None)``. See the module docstring."""
    groups = getattr(module, "num_key_value_groups", 1)
    own_path = (
        groups > 1
        and query.device.type == "cpu"
        and kwargs.get("position_bias") is None
        and kwargs.get("cache") is None
        and kwargs.get("softcap") is None
        and not kwargs.get("output_attentions", False)
    )
    if own_path and query.shape[2] == 1 and _one_query_mask(attention_mask):
        batch, heads, _, dim = query.shape
        out = torch.nn.functional.scaled_dot_product_attention(
            query.reshape(batch, heads // groups, groups, dim),
            key,
            value,
            attn_mask=attention_mask,  # [b, 1, 1, k] or None: the same for every stacked query
            dropout_p=dropout,
            scale=scaling,
        )
        return out.reshape(batch, 1, heads, dim), None
    if (
        own_path
        and _TORCH_HAS_GQA
        and isinstance(attention_mask, torch.Tensor)
        and attention_mask.ndim == 4
    ):
        out = torch.nn.functional.scaled_dot_product_attention(
            query,
            key,
            value,
            attn_mask=attention_mask,
            dropout_p=dropout,
            scale=scaling,
            enable_gqa=True,
        )
        return out.transpose(1, 2).contiguous(), None
    return sdpa_attention_forward(
        module,
        query,
        key,
        value,
        attention_mask,
        dropout=dropout,
        scaling=scaling,
        is_causal=is_causal,
        **kwargs,
    )


def _one_query_mask(mask: torch.Tensor | None) -> bool:
    """Whether ``mask`` lets a single query's stacked heads share it: none, or one row ``[b, 1, 1,
    k]`` (a head-specific or boolean-broadcast mask goes to transformers' path)."""
    return mask is None or (
        isinstance(mask, torch.Tensor) and mask.ndim == 4 and mask.shape[1] == mask.shape[2] == 1
    )


def preferred_attention(device: torch.device) -> str:
    """The attention implementation caddtree loads a target with on ``device``: :data:`GQA_SDPA`
    on the CPU, transformers' ``"sdpa"`` elsewhere."""
    return GQA_SDPA if device.type == "cpu" else "sdpa"


AttentionInterface.register(GQA_SDPA, gqa_sdpa_attention)
AttentionMaskInterface.register(GQA_SDPA, sdpa_mask)
