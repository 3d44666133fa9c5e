"""Train a DFlash drafter for a given target (the recipe reported for the released drafters).

==============  ===================================================================================
``prompts``     training prompts from sources that are not benchmarks, benchmark overlap dropped
``magpie``      prompts the target writes itself (Magpie), and users' prompt files
``data``        stage 1: the frozen target's responses (``data.safetensors``); draft vocabulary
``features``    stage 2: the target's context features of every token (``features.safetensors``)
``targets``     stage 2, optional: the target's next-token top-k over the draft vocabulary at
                every response position (stored with the features), for the L1 / LK terms
``loss``        stage 3's anchor-block loss, and the held-out figures (chain walk) made with it
``trainer``     stage 3: AdamW over that loss, checkpoints in the released format
                (``checkpoint/``)
==============  ===================================================================================

Each stage is cached in the output directory, so an interrupted run resumes where it stopped.

The names in ``__all__`` can be imported from this package (``from caddtree.train import
train_drafter``); each one loads only the module that defines it, so reading prompts does not
import torch.
"""

from __future__ import annotations

from ..util.lazy import lazy_exports

_EXPORTS = {
    "TrainingData": "data",
    "chat_prompt_ids": "data",
    "choose_draft_vocab": "data",
    "draft_vocab_coverage": "data",
    "generate_responses": "data",
    "prepare_data": "data",
    "target_fingerprint": "data",
    "compute_features": "features",
    "compute_features_and_targets": "features",
    "load_features": "features",
    "load_targets": "features",
    "TargetDistributions": "targets",
    "TopKSpec": "targets",
    "TrainConfig": "trainer",
    "AnchorBlockLoss": "loss",
    "build_training_batch": "loss",
    "load_trained_drafter": "trainer",
    "split_samples": "data",
    "train_drafter": "trainer",
    "build_training_prompts": "prompts",
    "training_prompts": "prompts",
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
