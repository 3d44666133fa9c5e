"""The DFlash block-diffusion drafter, loadable from released DFlash checkpoints as they are.

Architecture (paper, Section 2.2). A DFlash drafter is a stack of
Qwen3-style decoder layers with no embedding and no output head of its own: it embeds its block with
the *target's* ``embed_tokens`` and reads its logits through the *target's* ``lm_head``. It is
conditioned on **context features**: the target's hidden states after the layers
``target_layer_ids`` (``hidden_states[id + 1]`` of a transformers forward), concatenated over the
``k`` ids into ``[.., k*H]`` and projected to ``H`` by ``fc`` then ``hidden_norm``. In every drafter
layer

* queries come from the ``B`` block positions only;
* keys and values come from ``[context features ; block positions]`` (the context features enter
  ``k_proj``/``v_proj`` directly, without the layer's input norm);
* attention is **not** causal: every block position sees the whole context and the whole block;
* rotary positions: context token ``j`` sits at its absolute position ``j``, the block continues
  right after the context.

Keys and values of context positions depend only on that position's feature (not on other tokens),
so the drafter caches them in its own KV cache and only ever appends the features of newly committed
tokens. Block keys/values are dropped after each pass.

Checkpoint format (``config.json`` + ``model.safetensors``), as released::

    architectures: ["DFlashDraftModel"], model_type: "qwen3", num_target_layers: int,
    block_size: int                       (top level, or inside dflash_config in newer releases)
    dflash_config: {mask_token_id: int, target_layer_ids: [int, ...] (optional)}

    fc.weight [H, k*H], hidden_norm.weight, norm.weight,
    layers.{i}.input_layernorm.weight, layers.{i}.post_attention_layernorm.weight,
    layers.{i}.mlp.{gate,up,down}_proj.weight, layers.{i}.self_attn.{q,k,v,o}_proj.weight,
    layers.{i}.self_attn.{q,k}_norm.weight

**Draft vocabulary** (optional; the EAGLE-3 / FR-Spec convention). A drafter may score only ``K``
of the target's ``V`` tokens (the most frequent ones of its training responses, plus the stop
tokens): ``config.json`` then has ``draft_vocab_size: K`` and the weights a buffer ``d2t``, int64
``[K]``, with ``target id = draft id + d2t[draft id]``. The drafter reads its logits through those
``K`` rows of the target's lm_head, trees are built over draft ids and mapped to target ids before
verification. Checkpoints without ``draft_vocab_size`` (the released DFlash drafters) use the full
vocabulary.

:class:`DFlashDraftModel` is the ``torch`` module (load with ``from_pretrained``, save with
``save_pretrained``); :class:`~caddtree.models.proposer.DFlashProposer` runs it once per decoding
round.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel, Qwen3Config
from transformers.cache_utils import Cache
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3MLP,
    Qwen3RMSNorm,
    Qwen3RotaryEmbedding,
    eager_attention_forward,
    rotate_half,
)

from ..util.checks import is_int
from ..util.errors import CheckpointError, InvalidInputError
from .checkpoints import check_model_location, checkpoint_errors

__all__ = [
    "DFLASH_ARCHITECTURE",
    "DFlashDraftModel",
    "DFlashSettings",
    "check_drafter_fits_target",
    "default_target_layer_ids",
    "draft_lm_head",
]

DFLASH_ARCHITECTURE = "DFlashDraftModel"


# --------------------------------------------------------------------------------------------------
# DFlash settings in config.json
# --------------------------------------------------------------------------------------------------


def default_target_layer_ids(num_target_layers: int, num_ids: int) -> list[int]:
    """Target layers whose outputs feed the drafter when a checkpoint does not list them.

    The released rule: ``num_ids`` ids (one per drafter layer) spread evenly from layer 1 to layer
    ``num_target_layers - 3`` and rounded; with a single id, the middle layer
    ``num_target_layers // 2``. For example 36 target layers and 5 ids give ``[1, 9, 17, 25, 33]``.
    """
    if num_target_layers < 1 or num_ids < 1:
        raise InvalidInputError(
            f"need at least one target layer and one id; got {num_target_layers} and {num_ids}"
        )
    if num_ids == 1:
        return [num_target_layers // 2]
    first, last = 1, num_target_layers - 3
    return [int(round(first + i * (last - first) / (num_ids - 1))) for i in range(num_ids)]


@dataclass(frozen=True)
class DFlashSettings:
    """The DFlash-specific fields of a drafter's ``config.json``, validated.

    Attributes:
        block_size: ``B``, the drafted block: the bonus token plus ``B - 1`` masked positions.
        mask_token_id: token id of the MASK placeholder, embedded by the target's ``embed_tokens``.
        target_layer_ids: the ``k`` target layers whose outputs are the context features.
        num_target_layers: the number of layers of the target the drafter was trained for, if known.
        draft_vocab_size: ``K`` when the drafter scores a draft vocabulary of ``K`` target tokens
            (see the module docstring), else ``None`` (the full vocabulary).
    """

    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    num_target_layers: int | None
    draft_vocab_size: int | None = None

    @classmethod
    def from_config(cls, config: PretrainedConfig) -> DFlashSettings:
        """Read the settings; accept ``block_size`` at top level or inside ``dflash_config``."""
        dflash = getattr(config, "dflash_config", None)
        if not isinstance(dflash, dict):
            raise CheckpointError(
                "the drafter config has no 'dflash_config' section (with 'mask_token_id'); "
                "is this a DFlash checkpoint?"
            )
        block_size = dflash.get("block_size", getattr(config, "block_size", None))
        if block_size is None:
            raise CheckpointError(
                "the drafter config has no 'block_size' (neither at top level nor in dflash_config)"
            )
        mask_token_id = dflash.get("mask_token_id")
        if mask_token_id is None:
            raise CheckpointError("the drafter config has no 'dflash_config.mask_token_id'")
        num_target_layers = getattr(config, "num_target_layers", None)
        layer_ids = dflash.get("target_layer_ids")
        if layer_ids is None:
            if num_target_layers is None:
                raise CheckpointError(
                    "the drafter config has neither 'dflash_config.target_layer_ids' nor "
                    "'num_target_layers' to derive them from"
                )
            layer_ids = default_target_layer_ids(
                int(num_target_layers), int(config.num_hidden_layers)
            )
        if not is_int(block_size) or block_size < 2:
            raise CheckpointError(f"block_size must be an integer >= 2, got {block_size!r}")
        if not is_int(mask_token_id) or mask_token_id < 0:
            raise CheckpointError(
                f"mask_token_id must be a non-negative integer, got {mask_token_id!r}"
            )
        if (
            not isinstance(layer_ids, (list, tuple))
            or not layer_ids
            or not all(is_int(i) and i >= 0 for i in layer_ids)
        ):
            raise CheckpointError(
                f"target_layer_ids must be a non-empty list of layer indices, got {layer_ids!r}"
            )
        if num_target_layers is not None and not is_int(num_target_layers):
            raise CheckpointError(
                f"num_target_layers must be an integer, got {num_target_layers!r}"
            )
        draft_vocab = getattr(config, "draft_vocab_size", None)
        if draft_vocab is not None and (not is_int(draft_vocab) or draft_vocab < 1):
            raise CheckpointError(
                f"draft_vocab_size must be a positive integer, got {draft_vocab!r}"
            )
        return cls(
            block_size=int(block_size),
            mask_token_id=int(mask_token_id),
            target_layer_ids=tuple(int(i) for i in layer_ids),
            num_target_layers=None if num_target_layers is None else int(num_target_layers),
            draft_vocab_size=draft_vocab,
        )


# config.json fields that size the drafter's layers (head_dim may be absent: hidden / heads)
_SIZE_FIELDS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
)


# --------------------------------------------------------------------------------------------------
# The model
# --------------------------------------------------------------------------------------------------


def additive_mask(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask (True: seen) as the additive one eager attention adds to its scores."""
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill_(
        ~visible, torch.finfo(dtype).min
    )


def _apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [b, heads, s, d] by the rotary angles ``cos``/``sin`` [b, s, d]."""
    return x * cos.unsqueeze(1) + rotate_half(x) * sin.unsqueeze(1)


class DFlashAttention(nn.Module):
    """Attention with queries from the block and keys/values from ``[context ; block]``."""

    def __init__(self, config: Qwen3Config, layer_idx: int) -> None:
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = getattr(config, "head_dim", None) or (
            config.hidden_size // config.num_attention_heads
        )
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.attention_dropout = config.attention_dropout
        self.is_causal = False  # read by transformers' attention functions
        bias = config.attention_bias
        q_out = config.num_attention_heads * self.head_dim
        kv_out = config.num_key_value_heads * self.head_dim
        self.q_proj = nn.Linear(config.hidden_size, q_out, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, kv_out, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, kv_out, bias=bias)
        self.o_proj = nn.Linear(q_out, config.hidden_size, bias=bias)
        self.q_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def forward(
        self,
        hidden_states: torch.Tensor,
        context: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        past_key_values: Cache | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``hidden_states`` [b, q, H] (block), ``context`` [b, c, H] (projected new features).

        ``position_embeddings`` are ``cos, sin`` [b, c + q, d] for ``[context ; block]``.
        """
        b, q, _ = hidden_states.shape
        c = context.shape[1]
        cos, sin = position_embeddings
        queries = self.q_proj(hidden_states).view(b, q, -1, self.head_dim)
        queries = _apply_rotary(self.q_norm(queries).transpose(1, 2), cos[:, c:], sin[:, c:])
        kv_input = torch.cat([context, hidden_states], dim=1)
        keys = self.k_norm(self.k_proj(kv_input).view(b, c + q, -1, self.head_dim))
        keys = _apply_rotary(keys.transpose(1, 2), cos, sin)
        values = self.v_proj(kv_input).view(b, c + q, -1, self.head_dim).transpose(1, 2)
        if past_key_values is not None:
            keys, values = past_key_values.update(keys, values, self.layer_idx)
        attention = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, eager_attention_forward
        )
        out, _ = attention(
            self,
            queries,
            keys,
            values,
            attention_mask,
            dropout=self.attention_dropout if self.training else 0.0,
            scaling=self.scaling,
            is_causal=False,
        )
        return self.o_proj(out.reshape(b, q, -1))


class DFlashDecoderLayer(nn.Module):
    """Pre-norm residual block: ``DFlashAttention`` then the SwiGLU MLP."""

    def __init__(self, config: Qwen3Config, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = DFlashAttention(config, layer_idx)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(
        self,
        hidden_states: torch.Tensor,
        context: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        past_key_values: Cache | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        attended = self.self_attn(
            self.input_layernorm(hidden_states),
            context,
            position_embeddings,
            past_key_values,
            attention_mask,
        )
        hidden_states = hidden_states + attended
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class DFlashDraftModel(PreTrainedModel):
    """A DFlash drafter (see the module docstring for the architecture and checkpoint format).

    Load a released checkpoint with ``DFlashDraftModel.from_pretrained(path_or_hub_id, dtype=...)``;
    write one with ``save_pretrained(dir)`` (``config.json`` + ``model.safetensors`` with exactly
    the released key names). :meth:`for_target` creates a randomly initialised drafter for a
    target (tests, training from scratch).

    Attributes:
        settings: the validated :class:`DFlashSettings`.
        block_size, mask_token_id, target_layer_ids: shortcuts into ``settings``.
    """

    config_class = Qwen3Config
    base_model_prefix = ""
    _no_split_modules = ["DFlashDecoderLayer"]
    _supports_sdpa = True
    _supports_flash_attn = True
    _supports_attention_backend = True

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__(config)
        architectures = getattr(config, "architectures", None) or []
        if architectures and DFLASH_ARCHITECTURE not in architectures:
            raise CheckpointError(
                f"the checkpoint is a {architectures} model, not a {DFLASH_ARCHITECTURE}; "
                "only plain DFlash drafters are supported"
            )
        if getattr(config, "use_sliding_window", False) or getattr(config, "is_causal", False):
            raise CheckpointError(
                "this drafter uses sliding-window or causal attention, which plain DFlash drafters "
                "do not; it is not supported"
            )
        for field in _SIZE_FIELDS:
            value = getattr(config, field, None)
            if not (is_int(value) and value >= 1) and not (field == "head_dim" and value is None):
                raise CheckpointError(f"{field} must be a positive integer, got {value!r}")
        if config.num_attention_heads % config.num_key_value_heads:
            raise CheckpointError(
                f"num_attention_heads ({config.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({config.num_key_value_heads})"
            )
        eps = getattr(config, "rms_norm_eps", None)
        if not (isinstance(eps, (int, float)) and not isinstance(eps, bool) and 0 < eps < 1):
            raise CheckpointError(
                f"rms_norm_eps must be a small positive number (e.g. 1e-6), got {eps!r}"
            )
        self.settings = DFlashSettings.from_config(config)
        self.layers = nn.ModuleList(
            DFlashDecoderLayer(config, i) for i in range(config.num_hidden_layers)
        )
        k = len(self.settings.target_layer_ids)
        self.fc = nn.Linear(k * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config)
        if self.settings.draft_vocab_size is not None:
            # target id = draft id + d2t[draft id] (EAGLE-3's layout); loaded with the weights
            self.register_buffer(
                "d2t", torch.zeros(self.settings.draft_vocab_size, dtype=torch.long)
            )
        self.post_init()

    @property
    def block_size(self) -> int:
        return self.settings.block_size

    @property
    def mask_token_id(self) -> int:
        return self.settings.mask_token_id

    @property
    def target_layer_ids(self) -> tuple[int, ...]:
        return self.settings.target_layer_ids

    @property
    def draft_token_ids(self) -> torch.Tensor | None:
        """Target token id of each draft id, int64 [K] (``None``: the full vocabulary)."""
        if self.settings.draft_vocab_size is None:
            return None
        return torch.arange(self.d2t.shape[0], device=self.d2t.device) + self.d2t

    def forward(
        self,
        noise_embedding: torch.Tensor,
        target_hidden: torch.Tensor,
        position_ids: torch.Tensor,
        past_key_values: Cache | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One drafter pass; returns the final-normed hidden states of the block, [b, q, H].

        Args:
            noise_embedding: target embeddings of the block tokens, [b, q, H].
            target_hidden: raw context features of the ``c`` tokens not yet in
                ``past_key_values`` (possibly ``c = 0``), [b, c, k*H].
            position_ids: positions of ``[context ; block]``, [b or 1, c + q].
            past_key_values: the drafter's cache of earlier context keys/values (appended to:
                afterwards it also holds this pass's context *and block* entries).
            attention_mask: optional additive or boolean mask [b, 1, q, past + c + q], True
                where a position is seen (for training several blocks at once); ``None`` lets
                every block position see everything, which is what decoding needs. A boolean
                mask is made additive for attention implementations other than SDPA (eager
                attention adds the mask to the scores).
        """
        boolean = attention_mask is not None and attention_mask.dtype == torch.bool
        if boolean and self.config._attn_implementation != "sdpa":
            attention_mask = additive_mask(attention_mask, noise_embedding.dtype)
        context = self.hidden_norm(self.fc(target_hidden))
        position_embeddings = self.rotary_emb(noise_embedding, position_ids)
        hidden_states = noise_embedding
        for layer in self.layers:
            hidden_states = layer(
                hidden_states, context, position_embeddings, past_key_values, attention_mask
            )
        return self.norm(hidden_states)

    # ---- construction and loading -----------------------------------------------------------

    @classmethod
    def for_target(
        cls,
        target_config: PretrainedConfig,
        *,
        mask_token_id: int,
        num_layers: int = 1,
        block_size: int = 16,
        target_layer_ids: Sequence[int] | None = None,
        draft_token_ids: Sequence[int] | None = None,
        dtype: torch.dtype | None = None,
        **config_overrides: Any,
    ) -> DFlashDraftModel:
        """A randomly initialised drafter shaped for ``target_config`` (a causal-LM config).

        Hidden size, heads, head size, MLP width, norm epsilon and rotary settings are copied from
        the target; ``config_overrides`` replace any Qwen3Config field. ``target_layer_ids`` defaults
        to :func:`default_target_layer_ids` with one id per drafter layer. The config records
        ``block_size`` at top level, as the released "-b16" drafters do. ``draft_token_ids``
        (distinct target ids, sorted here) makes a drafter with that draft vocabulary.
        """
        target = target_config.get_text_config()
        n_target = int(target.num_hidden_layers)
        if target_layer_ids is None:
            target_layer_ids = default_target_layer_ids(n_target, num_layers)
        head_dim = getattr(target, "head_dim", None) or (
            target.hidden_size // target.num_attention_heads
        )
        fields: dict[str, Any] = {
            "architectures": [DFLASH_ARCHITECTURE],
            "hidden_size": target.hidden_size,
            "intermediate_size": target.intermediate_size,
            "num_hidden_layers": num_layers,
            "num_attention_heads": target.num_attention_heads,
            "num_key_value_heads": getattr(
                target, "num_key_value_heads", target.num_attention_heads
            ),
            "head_dim": head_dim,
            "hidden_act": getattr(target, "hidden_act", "silu"),
            "rms_norm_eps": getattr(target, "rms_norm_eps", 1e-6),
            "max_position_embeddings": getattr(target, "max_position_embeddings", 32768),
            "rope_parameters": getattr(target, "rope_parameters", None),
            "vocab_size": target.vocab_size,
            "tie_word_embeddings": False,
            "block_size": int(block_size),
            "num_target_layers": n_target,
            "dflash_config": {
                "mask_token_id": int(mask_token_id),
                "target_layer_ids": [int(i) for i in target_layer_ids],
            },
        }
        ids = None
        if draft_token_ids is not None:
            ids = torch.tensor(sorted({int(t) for t in draft_token_ids}), dtype=torch.long)
            if ids.numel() == 0 or ids[0] < 0 or ids[-1] >= int(target.vocab_size):
                raise InvalidInputError(
                    f"draft_token_ids must be target token ids in [0, {target.vocab_size})"
                )
            fields["draft_vocab_size"] = int(ids.numel())
        fields.update(config_overrides)
        model = cls(Qwen3Config(**fields))
        if ids is not None:
            model.d2t.copy_(ids - torch.arange(ids.numel()))
        return model if dtype is None else model.to(dtype)

    @classmethod
    def from_pretrained(
        cls, pretrained_model_name_or_path: str | os.PathLike, *args: Any, **kwargs: Any
    ) -> Any:
        """``PreTrainedModel.from_pretrained`` that refuses incomplete or mis-shaped checkpoints.

        Raises :class:`CheckpointError` when the checkpoint cannot be read (a missing directory is
        refused before any hub request, see :func:`~caddtree.models.checkpoints.check_model_location`;
        a truncated weights file or a malformed config.json gets one line, see
        :func:`~caddtree.models.checkpoints.checkpoint_errors`), when ``config.json`` lacks a DFlash
        field, or when a weight is missing (the message names it) or has the wrong shape (unless
        ``ignore_mismatched_sizes=True``). Extra weights are ignored, as usual.
        """
        want_info = kwargs.pop("output_loading_info", False)
        allow_mismatch = kwargs.pop("ignore_mismatched_sizes", False)
        what = "a DFlash drafter from"
        check_model_location(pretrained_model_name_or_path, what)
        with checkpoint_errors(what, pretrained_model_name_or_path):
            # transformers raises a bare RuntimeError on shape mismatches; report them ourselves.
            model, info = super().from_pretrained(
                pretrained_model_name_or_path,
                *args,
                output_loading_info=True,
                ignore_mismatched_sizes=True,
                **kwargs,
            )
        source = str(pretrained_model_name_or_path)
        if info["missing_keys"]:
            missing = ", ".join(sorted(info["missing_keys"]))
            raise CheckpointError(f"the DFlash checkpoint {source!r} is missing weights: {missing}")
        if info["mismatched_keys"] and not allow_mismatch:
            details = "; ".join(
                f"{key}: checkpoint {tuple(got)} vs config {tuple(want)}"
                for key, got, want in sorted(info["mismatched_keys"])
            )
            raise CheckpointError(
                f"the DFlash checkpoint {source!r} does not match its config.json ({details})"
            )
        return (model, info) if want_info else model


# --------------------------------------------------------------------------------------------------
# Fitting a drafter to a target, and its output head
# --------------------------------------------------------------------------------------------------


def check_drafter_fits_target(drafter: DFlashDraftModel, target_config: PretrainedConfig) -> None:
    """Raise :class:`CheckpointError` unless ``drafter`` can draft for a target with this config.

    Checks the hidden size (the drafter reads the target's embeddings and lm_head; with it, ``fc``
    takes ``k * H_target`` features, as ``from_pretrained`` checked against the weights), that every
    target layer id exists (and ``num_target_layers`` agrees, when the checkpoint records it), and
    that the mask token is in the target's vocabulary.
    """
    target = target_config.get_text_config()
    hidden, drafter_hidden = int(target.hidden_size), int(drafter.config.hidden_size)
    if drafter_hidden != hidden:
        raise CheckpointError(
            f"the drafter's hidden size {drafter_hidden} differs from the target's {hidden}; "
            "it was trained for another target"
        )
    ids = drafter.target_layer_ids
    n_layers = int(target.num_hidden_layers)
    expected_layers = drafter.settings.num_target_layers
    if expected_layers is not None and expected_layers != n_layers:
        raise CheckpointError(
            f"the drafter was trained for a target with {expected_layers} layers; "
            f"this target has {n_layers}"
        )
    if max(ids) >= n_layers:
        raise CheckpointError(
            f"the drafter reads target layers {list(ids)} but the target has only {n_layers} layers"
        )
    vocab = int(target.vocab_size)
    if drafter.mask_token_id >= vocab:
        raise CheckpointError(
            f"the drafter's mask_token_id {drafter.mask_token_id} is outside the target's "
            f"vocabulary of {vocab} tokens"
        )
    ids = drafter.draft_token_ids
    if ids is not None and (
        ids.numel() > vocab
        or bool((ids < 0).any())
        or bool((ids >= vocab).any())
        or torch.unique(ids).numel() != ids.numel()
    ):
        raise CheckpointError(
            f"the drafter's draft vocabulary (d2t) does not map to {ids.numel()} distinct token "
            f"ids of the target's vocabulary of {vocab}; the checkpoint is damaged or was made "
            "for another target"
        )


def draft_lm_head(
    lm_head: nn.Module, draft_token_ids: torch.Tensor | None, dtype: torch.dtype | None = None
) -> nn.Module:
    """``lm_head`` itself, or (with a draft vocabulary) a frozen linear layer of its rows
    ``draft_token_ids``, in ``dtype`` (default: the head's): draft logit ``i`` is the target's
    logit of token ``draft_token_ids[i]``."""
    if draft_token_ids is None:
        return lm_head
    weight = lm_head.weight
    rows = draft_token_ids.to(weight.device)
    bias = getattr(lm_head, "bias", None)
    head = nn.Linear(weight.shape[1], rows.numel(), bias=bias is not None)
    head = head.to(device=weight.device, dtype=dtype or weight.dtype)
    with torch.no_grad():
        head.weight.copy_(weight[rows])
        if bias is not None:
            head.bias.copy_(bias[rows])
    return head.requires_grad_(False)
