"""Stage 3 of drafter training: the optimiser loop and its checkpoints.

Each step draws random *anchor* positions inside responses and takes the anchor-block loss of
:mod:`caddtree.train.loss` (blocks of ``[anchor token, MASK x (B-1)]`` that see the context
features before their anchor, cross-entropy through the target's frozen ``lm_head``, near
positions weighted most). AdamW with linear warm-up then cosine decay, gradient clipping.

Determinism: with the same seed, data, and machine, the anchors, the sample order and the initial
weights are the same, and a resumed run continues exactly as an uninterrupted one would (the
per-step random state is derived from ``(seed, step)``, and the optimiser state is checkpointed).

Checkpoints are in the released DFlash format (``config.json`` + ``model.safetensors``), so a
trained drafter loads like any released one. Nothing here unpickles: optimiser state is stored as
safetensors plus JSON.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from ..models.dflash import (
    DFlashDraftModel,
    check_drafter_fits_target,
    default_target_layer_ids,
)
from ..util.checks import is_int, is_number
from ..util.errors import CheckpointError, InvalidInputError
from ..util.files import atomic_write_text, recover_directory, replace_directory
from ..util.ranks import DistInfo, from_rank0
from .batch import by_length
from .data import TrainingData, choose_draft_vocab, describe_differences, split_samples
from .features import cached_pass, resolve_feature_mode
from .loss import AnchorBlockLoss
from .steps import Loop, run_steps
from .targets import DEFAULT_TOPK, TopKSpec

__all__ = [
    "TrainConfig",
    "load_trained_drafter",
    "train_drafter",
]

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------------------


@dataclass
class TrainConfig:
    """Hyper-parameters of drafter training (the defaults follow the published recipe)."""

    block_size: int = 16
    num_layers: int = 1
    target_layer_ids: list[int] | None = None  # default: spread over the target (see dflash.py)
    num_feature_layers: int = 3  # how many target layers feed the drafter when ids are not given
    mask_token_id: int | None = None  # default: a token the target's vocabulary has but rarely uses
    steps: int = 1000
    anchors_per_sample: int = 32  # blocks drawn from one sample per forward
    samples_per_step: int = 4  # gradient accumulation over this many samples
    learning_rate: float = 6e-4
    warmup_steps: int = 50
    weight_decay: float = 0.0
    gamma: float = 7.0  # position-weight decay of the loss ("decay" weighting)
    # How block positions weigh in the loss: "decay" (exp(-(k-1)/gamma), the published DFlash
    # recipe) or "dpace" (D-PACE: each position by its expected contribution to the accepted
    # length under the drafter's current confidences, smoothed by dpace_alpha)
    loss_weighting: str = "decay"
    dpace_alpha: float = 0.5
    grad_clip: float = 1.0
    seed: int = 0
    eval_every: int = 50
    save_every: int = 100
    # steps whose log entries are read back from the device at once (one synchronisation per
    # this many steps; their step_s is the window's mean)
    log_every: int = 10
    eval_fraction: float = 0.05  # samples held out to report acceptance-like accuracy
    # how many of them (the first in split order) an evaluation's loss and accuracy cover; None:
    # all (the walks cover the first WALK_SAMPLES either way)
    eval_samples: int | None = None
    # Draft vocabulary: the smallest set of most frequent response tokens that covers this share
    # of response tokens (plus the stop tokens); None trains over the target's whole vocabulary.
    draft_vocab_coverage: float | None = None
    precision: str = "float32"  # or "bfloat16": autocast of the forward (weights stay float32)
    # compile the drafter's training forward with torch.compile (inductor): fused element-wise
    # work, after a one-time compilation (benchmarks/train_step.py --compile measures the steps)
    compile: bool = False
    # Where the drafter's inputs, the target's context features, come from: "cache" computes them
    # once for every sample and keeps them (in RAM or device memory, and features.safetensors);
    # "step" runs the frozen target on each step's samples instead (no cache: for data whose
    # features outgrow the memory, at the price of a target forward per step); "auto" takes
    # "cache" where it fits in half the free memory of the device (resolve_feature_mode)
    features: str = "auto"
    # The loss: ce_weight x cross-entropy + l1_weight x L1 (sum |p - q| = 2 TV between the
    # target's and the drafter's distributions over the draft vocabulary) + lk_weight x LK
    # (-log(1 - TV), arXiv 2602.23881), each a position-weighted mean (caddtree.train.loss).
    # DSpark trains with ce_weight 0.1 and l1_weight 0.9.
    ce_weight: float = 1.0
    l1_weight: float = 0.0
    lk_weight: float = 0.0
    # How many of the target's most likely draft-vocabulary tokens the feature pass stores per
    # response position (caddtree.train.targets); None: DEFAULT_TOPK when the L1 or LK term is
    # used, none otherwise; 0: none. With them the evaluation also reports 1 - TV per position.
    target_topk: int | None = None

    def topk(self) -> int:
        """How many of the target's next-token probabilities are stored per position (0: none)."""
        return effective_topk(asdict(self))

    def validate(self) -> None:
        self._validate_loss()
        checks = {
            "block_size": self.block_size >= 2,
            "num_layers": self.num_layers >= 1,
            "steps": self.steps >= 1,
            "anchors_per_sample": self.anchors_per_sample >= 1,
            "samples_per_step": self.samples_per_step >= 1,
            "learning_rate": self.learning_rate > 0,
            "warmup_steps": self.warmup_steps >= 0,
            "gamma": self.gamma > 0,
            "grad_clip": self.grad_clip > 0,
            "eval_fraction": 0 <= self.eval_fraction < 1,
            "save_every": self.save_every >= 1,
            "eval_every": self.eval_every >= 1,
            "eval_samples": self.eval_samples is None or self.eval_samples >= 1,
            "log_every": self.log_every >= 1,
            "draft_vocab_coverage": self.draft_vocab_coverage is None
            or 0 < self.draft_vocab_coverage <= 1,
            "precision": self.precision in ("float32", "bfloat16"),
            "features": self.features in ("auto", "cache", "step"),
            "loss_weighting": self.loss_weighting in ("decay", "dpace"),
            "dpace_alpha": 0 < self.dpace_alpha <= 1,
        }
        bad = [k for k, ok in checks.items() if not ok]
        if bad:
            raise InvalidInputError(f"invalid training settings: {', '.join(bad)} ({self})")

    def _validate_loss(self) -> None:
        """Check the loss's weights and top-k, naming the option and the value."""
        weights = {"ce_weight": self.ce_weight, "l1_weight": self.l1_weight}
        weights["lk_weight"] = self.lk_weight
        for name, value in weights.items():
            if not (is_number(value) and math.isfinite(value) and value >= 0):
                raise InvalidInputError(
                    f"{name} (--{name.replace('_', '-')}) must be a number >= 0, got {value!r}"
                )
        if not any(weights.values()):
            raise InvalidInputError(
                "the loss has no term: --ce-weight, --l1-weight and --lk-weight are all 0"
            )
        k = self.target_topk
        if k is not None and not (is_int(k) and k >= 0):
            raise InvalidInputError(
                f"target_topk (--target-topk) must be an integer >= 0, got {k!r}"
            )
        if self.features == "step" and self.topk():
            raise InvalidInputError(
                "--features step computes no stored distribution of the target, which the L1 "
                "and LK terms and --target-topk need: use --features cache"
            )
        if self.topk() == 0 and (self.l1_weight or self.lk_weight):
            raise InvalidInputError(
                "the L1 and LK terms need the target's distribution: --target-topk 0 leaves "
                "none; give it a k >= 1 or leave it out"
            )


# --------------------------------------------------------------------------------------------------
# Stage 3: training
# --------------------------------------------------------------------------------------------------


def effective_topk(settings: dict) -> int:
    """:meth:`TrainConfig.topk` of a config's settings (a checkpoint's, with the defaults of the
    settings it predates)."""
    k = settings.get("target_topk")
    if k is not None:
        return k
    distribution = settings.get("l1_weight", 0) > 0 or settings.get("lk_weight", 0) > 0
    return DEFAULT_TOPK if distribution else 0


def _save_checkpoint(
    directory: Path, drafter, optimizer, config: TrainConfig, log: list[dict]
) -> None:
    """Atomic checkpoint: drafter (released format), optimiser state (safetensors + JSON). The
    previous checkpoint stays whole until this one is in place (:func:`replace_directory`)."""

    def write(tmp: Path) -> None:
        drafter.save_pretrained(tmp)
        tensors, state_meta = {}, {}
        for pid, state in optimizer.state_dict()["state"].items():
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    tensors[f"{pid}.{key}"] = value.contiguous()
                else:
                    state_meta[f"{pid}.{key}"] = value
        save_file(tensors, tmp / "optimizer.safetensors")
        (tmp / "trainer_state.json").write_text(
            json.dumps(
                {
                    "step": len(log),
                    "config": asdict(config),
                    "optimizer_scalars": state_meta,
                    "param_groups": optimizer.state_dict()["param_groups"],
                    "log": log,
                },
                indent=1,
            )
        )

    replace_directory(directory, write)


def _recover_checkpoint(directory: Path) -> None:
    """Put back the previous checkpoint if a save was interrupted between its two renames."""
    if recover_directory(directory):
        logger.warning("an interrupted save left the previous checkpoint; resuming from it")


def _load_optimizer_state(directory: Path, optimizer, state: dict) -> None:
    tensors = load_file(directory / "optimizer.safetensors")
    opt_state: dict[int, dict[str, Any]] = {}
    for key, value in tensors.items():
        pid, name = key.split(".", 1)
        opt_state.setdefault(int(pid), {})[name] = value
    for key, value in state["optimizer_scalars"].items():
        pid, name = key.split(".", 1)
        opt_state.setdefault(int(pid), {})[name] = value
    optimizer.load_state_dict({"state": opt_state, "param_groups": state["param_groups"]})


def train_drafter(
    target: Any,
    data: TrainingData,
    output_dir: str | os.PathLike[str],
    config: TrainConfig | None = None,
    *,
    features: list[torch.Tensor] | None = None,
    resume: bool = True,
    progress: bool = True,
    device: torch.device | str | None = None,
    stop_after: int | None = None,
    stop_token_ids: Sequence[int] = (),
    init_from: str | os.PathLike[str] | None = None,
    deadline: float | None = None,
    on_checkpoint: Callable[[Path], None] | None = None,
    ranks: DistInfo | None = None,
) -> dict[str, Any]:
    """Train (or resume training) a DFlash drafter for ``target`` on ``data``.

    Writes ``output_dir/checkpoint`` (the drafter in the released format, optimiser and trainer
    state) every ``save_every`` steps and at the end, ``output_dir/features.safetensors`` (the
    context features, and the target's top-k where ``config`` asks; ``features`` given replace
    them) and ``output_dir/train_log.jsonl``. Returns the last log entry. ``stop_after`` ends this call after that many steps (a
    later call resumes); an interrupt (Ctrl-C) also saves a checkpoint before it propagates.
    ``stop_token_ids`` always join a draft vocabulary. ``init_from`` starts a new run from the
    weights of a drafter in the released format (for example the one shipped, to train it
    further in a later session on a fresh machine) instead of random weights; its architecture
    and draft vocabulary are kept (a drafter with fewer layers than ``config.num_layers`` is
    grown with :func:`grow_drafter`), and a fresh optimiser starts. A resumed run
    with the same settings continues exactly as an uninterrupted one would; ``steps`` may change
    on resume, and the learning-rate schedule then follows the new total.

    ``deadline`` (a :func:`time.monotonic` time) ends the call, and the learning-rate schedule,
    where the latest pace says (:class:`~caddtree.train.steps.Clock`; each log entry has its
    ``schedule_steps``; a later call resumes with the schedule of its own ``steps``).
    ``on_checkpoint`` is called with the checkpoint's folder after each save (to copy it
    elsewhere as the run goes). ``config`` is not changed (the run works on a copy).

    ``ranks`` (under ``torchrun``): the ranks share the feature pass and each batch (the same
    batch, loss and steps as one process; ``DistributedDataParallel``); rank 0 alone writes the
    files, and every rank reads the run's folder (one machine, or a shared file system).
    """
    config = replace(config) if config is not None else TrainConfig()
    config.validate()
    ranks = ranks if ranks is not None else DistInfo()
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    ckpt = out / "checkpoint"
    device = torch.device(device or target.get_input_embeddings().weight.device)

    drafter, state = _starting_drafter(
        target, data, config, ckpt, resume=resume, init_from=init_from, stop_ids=stop_token_ids
    )
    config.target_layer_ids = list(drafter.target_layer_ids)
    config.mask_token_id = drafter.mask_token_id
    check_drafter_fits_target(drafter, target.config)
    drafter.to(device).train()

    features, targets = _inputs(target, data, drafter, config, out, progress, ranks, features)
    train_ids, eval_ids = _split(data, config, out, ranks)
    trainer = AnchorBlockLoss(drafter, target, features, data, config, device, targets, ranks)
    if ranks.distributed:
        trainer.forward = _data_parallel(drafter, config)
    optimizer = _optimizer(drafter, config, device)
    start, log = _resume_point(ckpt, optimizer, state, config)
    log_path = out / "train_log.jsonl"
    # the file starts as the checkpoint's log: steps run after the last checkpoint by an
    # interrupted call are run again, and must not appear twice in the learning curve
    if ranks.rank == 0:
        atomic_write_text(log_path, "".join(json.dumps(e) + "\n" for e in log))
    end = config.steps if stop_after is None else min(config.steps, start + stop_after)

    write_checkpoint = partial(_save_checkpoint, ckpt, drafter, optimizer, config)
    loop = Loop(trainer, optimizer, train_ids, eval_ids, ckpt, log_path, write_checkpoint)
    loop.deadline, loop.on_checkpoint, loop.ranks = deadline, on_checkpoint, ranks
    return run_steps(loop, log, start, end, progress)


def _split(data: TrainingData, config: TrainConfig, out: Path, ranks: DistInfo):
    """The training samples (ordered by length) and the held-out ones, as rank 0 records them
    in the run's ``split.json``."""
    split = split_samples(data, config, out / "split.json") if ranks.rank == 0 else None
    train_ids, eval_ids = from_rank0(ranks, split)
    return by_length(train_ids, [len(s) for s in data.sequences]), eval_ids


def _data_parallel(drafter: DFlashDraftModel, config: TrainConfig) -> Any:
    """The drafter's forward under ``DistributedDataParallel`` (compiled where ``config`` asks).
    Its buffers are constants, so they are not broadcast each forward, and the ranks may run
    different numbers of forwards (evaluation walks)."""
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(drafter, broadcast_buffers=False)
    return torch.compile(ddp, dynamic=True) if config.compile else ddp


def _optimizer(drafter: DFlashDraftModel, config: TrainConfig, device: torch.device) -> Any:
    """AdamW over the drafter's weights, fused (one kernel for all parameters) where it can be."""
    return torch.optim.AdamW(
        drafter.parameters(),
        lr=config.learning_rate,
        weight_decay=config.weight_decay,
        betas=(0.9, 0.95),
        fused=device.type in ("cpu", "cuda"),
    )


def _resume_point(
    ckpt: Path, optimizer: Any, state: dict | None, config: TrainConfig
) -> tuple[int, list[dict]]:
    """The step a run starts at and its log so far: 0 and none for a new run, else the
    checkpoint's (its optimiser state loaded)."""
    if state is None:
        return 0, []
    _load_optimizer_state(ckpt, optimizer, state)
    start = int(state["step"])
    logger.info("resuming from step %d of %d (%s)", start, config.steps, ckpt)
    return start, list(state["log"])


def _inputs(
    target: Any,
    data: TrainingData,
    drafter: DFlashDraftModel,
    config: TrainConfig,
    out: Path,
    progress: bool,
    ranks: DistInfo,
    features: list[torch.Tensor] | None,
) -> tuple[list[torch.Tensor] | None, Any]:
    """The features the trainer reads (``None``: computed per step) and the target's top-k,
    once ``config.features`` is settled (rank 0's choice, where the ranks' free memory
    differs): from the run's cache (``features.safetensors``) or computed (shared by the ranks
    under torchrun)."""
    layers = config.target_layer_ids
    if features is None:
        device = drafter.fc.weight.device
        mode = resolve_feature_mode(config.features, target, data, layers, device)
        config.features = from_rank0(ranks, mode)
    targets = None
    if config.features != "step" and (features is None or config.topk()):
        path, topk = out / "features.safetensors", _topk_spec(target, drafter, config)
        cached, targets = cached_pass(target, data, layers, path, progress, topk, ranks)
        features = cached if features is None else features
    return features, targets


def _topk_spec(target: Any, drafter: DFlashDraftModel, config: TrainConfig) -> Any:
    """What the feature pass stores of the target's next-token distribution over the drafter's
    vocabulary (``None``: nothing, where the loss needs none)."""
    if not config.topk():
        return None
    vocab = int(target.config.get_text_config().vocab_size)
    return TopKSpec.make(config.topk(), drafter.draft_token_ids, vocab)


def _starting_drafter(
    target: Any,
    data: TrainingData,
    config: TrainConfig,
    ckpt: Path,
    *,
    resume: bool,
    init_from: str | os.PathLike[str] | None,
    stop_ids: Sequence[int],
) -> tuple[DFlashDraftModel, dict | None]:
    """The drafter training starts from, and the trainer state when it resumes a checkpoint:
    the checkpoint's drafter, ``init_from``'s weights, or a new drafter."""
    state = None
    if resume:
        _recover_checkpoint(ckpt)
    if resume and (ckpt / "trainer_state.json").is_file():
        state = json.loads((ckpt / "trainer_state.json").read_text())
        drafter = _resumed_drafter(ckpt, state, config)
    elif init_from is not None:
        drafter = _drafter_from(init_from, config)
    else:
        drafter = _new_drafter(target, data, config, stop_ids)
    return drafter, state


def _drafter_from(init_from: str | os.PathLike[str], config: TrainConfig) -> DFlashDraftModel:
    """The released-format drafter ``init_from`` in float32, grown to ``config.num_layers``."""
    drafter = load_trained_drafter(init_from).float()
    have = drafter.config.num_hidden_layers
    if have > config.num_layers or drafter.block_size != config.block_size:
        raise InvalidInputError(
            f"{init_from} has {have} layers and block size {drafter.block_size}; pass "
            "the same --block-size and at least as many --num-layers"
        )
    if have < config.num_layers:
        drafter = grow_drafter(drafter, config.num_layers)
        logger.info(
            "starting from the weights of %s, grown from %d to %d layers",
            init_from,
            have,
            config.num_layers,
        )
    else:
        logger.info("starting from the weights of %s", init_from)
    return drafter


def _resumed_drafter(ckpt: Path, state: dict, config: TrainConfig) -> DFlashDraftModel:
    # The length of the run and how often it reports may change on resume; settings left as
    # None are derived, and come from the checkpoint.
    free = ("steps", "save_every", "eval_every", "log_every", "precision", "compile", "features")
    free += ("eval_samples",)
    now = {k: v for k, v in asdict(config).items() if k not in free and v is not None}
    # a setting added after the checkpoint was written had its default then
    defaults = asdict(TrainConfig())
    saved = {k: state["config"].get(k, defaults[k]) for k in now}
    # the top-k stored of the target's distribution, also where it was left to its default
    now["target_topk"], saved["target_topk"] = config.topk(), effective_topk(state["config"])
    if saved != now:
        raise InvalidInputError(
            f"{ckpt} was trained with other {describe_differences(saved, now)}; use another output "
            "directory or the same settings"
        )
    return DFlashDraftModel.from_pretrained(ckpt, dtype=torch.float32)


def _new_drafter(
    target: Any, data: TrainingData, config: TrainConfig, stop_token_ids: Sequence[int] = ()
) -> DFlashDraftModel:
    torch.manual_seed(config.seed)
    tcfg = target.config.get_text_config()
    mask_id = config.mask_token_id
    if mask_id is None:
        mask_id = _default_mask_token(target, data)
    layer_ids = config.target_layer_ids or default_target_layer_ids(
        int(tcfg.num_hidden_layers), config.num_feature_layers
    )
    vocab = None
    if config.draft_vocab_coverage is not None:
        vocab, covered = choose_draft_vocab(data, config.draft_vocab_coverage, stop_token_ids)
        logger.info(
            "draft vocabulary: %d of %d tokens, covering %.2f%% of the response tokens",
            len(vocab),
            tcfg.vocab_size,
            100 * covered,
        )
    drafter = DFlashDraftModel.for_target(
        tcfg,
        mask_token_id=mask_id,
        num_layers=config.num_layers,
        block_size=config.block_size,
        target_layer_ids=layer_ids,
        draft_token_ids=vocab,
        dtype=torch.float32,
    )
    # Start the drafter's output norm at a tenth of the target's final norm: a random drafter's
    # hidden states at the full scale the target's lm_head expects give confidently wrong logits
    # (a starting loss of ~70-100 nats on SmolLM2 instead of ~11); training grows it back.
    final_norm = getattr(target.get_decoder(), "norm", None)
    weight = getattr(final_norm, "weight", None)
    if weight is not None and weight.shape == drafter.norm.weight.shape:
        with torch.no_grad():
            drafter.norm.weight.copy_(0.1 * weight.float())
    return drafter


def _default_mask_token(target: Any, data: TrainingData) -> int:
    """A token id the training data never uses, preferring the top of the vocabulary."""
    vocab = int(target.config.get_text_config().vocab_size)
    used = set(torch.cat(data.sequences).tolist()) if data.sequences else set()
    for tok in range(vocab - 1, -1, -1):
        if tok not in used:
            return tok
    raise InvalidInputError("every vocabulary id occurs in the data; pass mask_token_id explicitly")


def grow_drafter(drafter: DFlashDraftModel, num_layers: int) -> DFlashDraftModel:
    """``drafter`` with layers appended up to ``num_layers``, computing the same function.

    Each new layer starts as a copy of the last one with its two output projections
    (attention ``o_proj`` and MLP ``down_proj``) at zero, so that it adds nothing to the
    residual stream: training continues from the smaller drafter's quality and the new layer
    learns only what helps (function-preserving growth, as in progressive stacking).
    """
    have = drafter.config.num_hidden_layers
    if not have <= num_layers:
        raise InvalidInputError(f"cannot grow a {have}-layer drafter to {num_layers} layers")
    config = copy.deepcopy(drafter.config)
    config.num_hidden_layers = num_layers
    if getattr(config, "layer_types", None) is not None:
        config.layer_types = [config.layer_types[0]] * num_layers
    grown = DFlashDraftModel(config).to(drafter.dtype)
    state = drafter.state_dict()
    last = f"layers.{have - 1}."
    for i in range(have, num_layers):
        for key, value in list(state.items()):
            if key.startswith(last):
                new_key = f"layers.{i}." + key[len(last) :]
                zero = key.endswith(("self_attn.o_proj.weight", "mlp.down_proj.weight"))
                state[new_key] = torch.zeros_like(value) if zero else value.clone()
    missing, unexpected = grown.load_state_dict(state, strict=False)
    if unexpected or [k for k in missing if not k.startswith("rotary_emb")]:
        raise CheckpointError(f"growing the drafter left {missing} unset and {unexpected} unused")
    return grown


def load_trained_drafter(directory: str | os.PathLike[str]) -> DFlashDraftModel:
    """Load ``directory`` (a released-format drafter, or a training output with ``checkpoint/``)."""
    path = Path(directory)
    if (path / "checkpoint" / "config.json").is_file():
        path = path / "checkpoint"
    if not (path / "config.json").is_file():
        raise CheckpointError(f"no drafter checkpoint (config.json) in {directory}")
    return DFlashDraftModel.from_pretrained(path)
