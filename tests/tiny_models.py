"""Tiny random-weight models for tests (float64, deterministic, built from configs: no downloads).

* :func:`qwen3_target` / :func:`llama_target` - 4-layer causal LMs with grouped-query attention.
* :func:`saved_drafter` - a DFlash drafter for a target, written in the released checkpoint
  format and loaded back through ``DFlashDraftModel.from_pretrained``.
* :func:`training_data` / :func:`train_config` - the drafter-training tests' data (the target's
  greedy responses to random prompts) and their small training settings.

Weights are re-drawn with a seeded generator at a larger scale than transformers' init (and norm
weights away from 1), so that a wrong mask, position or cache entry changes the outputs visibly.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from caddtree.models import DFlashDraftModel

VOCAB = 96
HIDDEN = 32
MASK_TOKEN_ID = VOCAB - 1
MAX_POSITIONS = 64
FEATURE_LAYER_IDS = (0, 2)

_COMMON = {
    "vocab_size": VOCAB,
    "hidden_size": HIDDEN,
    "intermediate_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 16,
    "max_position_embeddings": MAX_POSITIONS,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    "tie_word_embeddings": False,
}


def randomize_(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Redraw every parameter from a seeded generator: N(0, 0.2) matrices, 1 + N(0, 0.1) norms."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen, dtype=torch.float64)
            if "norm" in name:
                param.copy_(1.0 + 0.1 * noise)
            else:
                param.copy_(0.2 * noise)
    return model.eval()


def qwen3_target(attn_implementation: str = "sdpa", seed: int = 0, **overrides) -> PreTrainedModel:
    config = Qwen3Config(**{**_COMMON, **overrides}, attn_implementation=attn_implementation)
    return randomize_(Qwen3ForCausalLM(config).to(torch.float64), seed)


def llama_target(attn_implementation: str = "sdpa", seed: int = 1, **overrides) -> PreTrainedModel:
    config = LlamaConfig(**{**_COMMON, **overrides}, attn_implementation=attn_implementation)
    return randomize_(LlamaForCausalLM(config).to(torch.float64), seed)


def new_drafter(target: PreTrainedModel, seed: int = 2, **kwargs) -> DFlashDraftModel:
    """A random float64 drafter for ``target``: 2 layers reading target layers 0 and 2, B = 6."""
    kwargs = {
        "mask_token_id": MASK_TOKEN_ID,
        "num_layers": 2,
        "block_size": 6,
        "target_layer_ids": FEATURE_LAYER_IDS,
        **kwargs,
    }
    drafter = DFlashDraftModel.for_target(target.config, dtype=torch.float64, **kwargs)
    return randomize_(drafter, seed)


def saved_drafter(target: PreTrainedModel, directory: Path, seed: int = 2, **kwargs):
    """Save a random drafter in the released format to ``directory``; return (original, loaded)."""
    drafter = new_drafter(target, seed, **kwargs)
    drafter.save_pretrained(directory)
    loaded = DFlashDraftModel.from_pretrained(directory, dtype=torch.float64)
    return drafter, loaded.eval()


def training_data(target: PreTrainedModel, samples: int = 40):
    """The target's greedy responses (24 new tokens) to ``samples`` random prompts of 3-7 tokens."""
    from caddtree.train.data import generate_responses

    gen = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(
            2, 90, (int(torch.randint(3, 8, (1,), generator=gen)),), generator=gen
        ).tolist()
        for _ in range(samples)
    ]
    return generate_responses(target, prompts, max_new_tokens=24, batch_size=8, progress=False)


def train_config(**overrides):
    """Training settings small enough for a test (blocks of 6, 2 samples x 8 blocks per step)."""
    from caddtree.train.trainer import TrainConfig

    base = dict(
        block_size=6,
        num_layers=1,
        num_feature_layers=2,
        mask_token_id=MASK_TOKEN_ID,
        steps=60,
        anchors_per_sample=8,
        samples_per_step=2,
        warmup_steps=5,
        learning_rate=3e-3,
        eval_every=10,
        save_every=30,
        eval_fraction=0.2,
    )
    base.update(overrides)
    return TrainConfig(**base)
