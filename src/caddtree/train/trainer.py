"""Stage 3 of drafter training: the anchor-block loss, the optimiser loop and its checkpoints.

Each step draws random *anchor* positions inside responses. A block is ``[anchor token, MASK x
(B-1)]`` at positions ``anchor .. anchor+B-1``; it sees the context features strictly before its
anchor and itself (bidirectionally), never other blocks (:func:`build_training_batch`). The loss is
cross-entropy through the target's frozen ``lm_head`` on block positions ``1 .. B-1`` (predicting
tokens ``anchor+1 .. anchor+B-1``), weighted by ``exp(-(k - 1) / gamma)`` for position ``k``
(``gamma = 7``), so near positions, which decide acceptance, count most. AdamW with linear warm-up
then cosine decay, gradient clipping.

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
import signal
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from ..errors import CheckpointError, InvalidInputError
from ..files import atomic_write_text, recover_directory, replace_directory
from ..models.dflash import (
    DFlashDraftModel,
    check_drafter_fits_target,
    default_target_layer_ids,
    draft_lm_head,
)
from .data import TrainingData, choose_draft_vocab
from .features import cached_features

__all__ = [
    "TrainConfig",
    "build_training_batch",
    "load_trained_drafter",
    "split_samples",
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
    eval_fraction: float = 0.05  # samples held out to report acceptance-like accuracy
    # Draft vocabulary: the smallest set of most frequent response tokens that covers this share
    # of response tokens (plus the stop tokens); None trains over the target's whole vocabulary.
    draft_vocab_coverage: float | None = None
    precision: str = "float32"  # or "bfloat16": autocast of the forward (weights stay float32)

    def validate(self) -> None:
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
            "draft_vocab_coverage": self.draft_vocab_coverage is None
            or 0 < self.draft_vocab_coverage <= 1,
            "precision": self.precision in ("float32", "bfloat16"),
            "loss_weighting": self.loss_weighting in ("decay", "dpace"),
            "dpace_alpha": 0 < self.dpace_alpha <= 1,
        }
        bad = [k for k, ok in checks.items() if not ok]
        if bad:
            raise InvalidInputError(f"invalid training settings: {', '.join(bad)} ({self})")


# --------------------------------------------------------------------------------------------------
# Stage 3: training
# --------------------------------------------------------------------------------------------------


def build_training_batch(
    tokens: torch.Tensor | Sequence[torch.Tensor],
    anchors: torch.Tensor | Sequence[torch.Tensor],
    block_size: int,
    mask_token_id: int,
    dtype: torch.dtype,
) -> dict[str, torch.Tensor]:
    """Inputs for one drafter forward over anchor blocks of ``b`` sequences at once.

    ``tokens`` is one sequence or a list of ``b``; ``anchors`` the matching anchor positions (one
    tensor per sequence). With ``T`` the longest sequence and ``M`` the most anchors, returns
    ``block_tokens`` [b, M*B], ``position_ids`` [b, T + M*B], an additive ``attention_mask``
    [b, 1, M*B, T + M*B] and ``labels`` [b, M, B-1]. Block ``j`` of a sequence sees that
    sequence's context positions ``< anchors[j]`` and its own ``B`` positions, nothing else;
    labels are the tokens ``anchor+1 .. anchor+B-1`` (``-100`` past the end of the sequence and
    for padding blocks). Context features are padded to ``T`` with anything: no block sees them.
    The caller applies the position weights ``exp(-(k-1)/gamma)``.
    """
    if isinstance(tokens, torch.Tensor):
        tokens, anchors = [tokens], [anchors]
    b, B = len(tokens), block_size
    T = max(int(t.shape[0]) for t in tokens)
    M = max(int(a.shape[0]) for a in anchors)
    offsets = torch.arange(B)
    block_tokens = torch.full((b, M, B), mask_token_id, dtype=torch.long)
    positions = torch.zeros((b, T + M * B), dtype=torch.long)
    visible = torch.zeros((b, M * B, T + M * B), dtype=torch.bool)
    labels = torch.full((b, M, B - 1), -100, dtype=torch.long)
    block_of = torch.arange(M).repeat_interleave(B)
    for r, (seq, anc) in enumerate(zip(tokens, anchors)):
        n, m = int(seq.shape[0]), int(anc.shape[0])
        block_tokens[r, :m, 0] = seq[anc]
        positions[r, :T] = torch.arange(T)
        positions[r, T : T + m * B] = (anc[:, None] + offsets).reshape(-1)
        ctx = torch.arange(T)[None, :] < anc[:, None]  # [m, T]
        visible[r, : m * B, :T] = ctx.repeat_interleave(B, dim=0)
        own = block_of[: m * B, None] == block_of[None, : m * B]
        visible[r, : m * B, T : T + m * B] = own
        target_pos = anc[:, None] + offsets[1:]  # [m, B-1]
        labels[r, :m] = torch.where(
            target_pos < n, seq[target_pos.clamp(max=n - 1)], torch.full_like(target_pos, -100)
        )
    mask = torch.zeros(visible.shape, dtype=dtype).masked_fill_(~visible, torch.finfo(dtype).min)
    return {
        "block_tokens": block_tokens.reshape(b, M * B),
        "position_ids": positions,
        "attention_mask": mask[:, None],
        "labels": labels,
    }


def dpace_weights(ce: torch.Tensor, valid: torch.Tensor, alpha: float) -> torch.Tensor:
    """D-PACE position weights [..., B-1] (arXiv 2605.18810) from the cross-entropies ``ce`` of
    the ``valid`` positions (flat, in the order of ``valid``'s True entries).

    With ``q = exp(-ce)`` the drafter's probability of the label, smoothed to
    ``q~ = (1 - alpha) q + alpha``, position ``j`` weighs ``sum_{m >= j} prod_{i <= m} q~_i``:
    the chance that the chain reaches it times the accepted length it can still add. An invalid
    position (past the sequence, or a label outside the draft vocabulary) ends the chain, as it
    does when decoding. Weights carry no gradient.
    """
    q = torch.zeros(valid.shape, dtype=torch.float32, device=ce.device)
    q[valid] = (1 - alpha) * torch.exp(-ce.float()) + alpha
    reach = torch.cumprod(q, dim=-1)
    return reach.flip(-1).cumsum(-1).flip(-1) * valid


def _lr_at(step: int, config: TrainConfig) -> float:
    if step < config.warmup_steps:
        return config.learning_rate * (step + 1) / config.warmup_steps
    span = max(1, config.steps - config.warmup_steps)
    progress = min(1.0, (step - config.warmup_steps) / span)
    return config.learning_rate * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


class _Trainer:
    def __init__(self, drafter, target, features, data, config, device):
        self.drafter, self.config, self.device = drafter, config, device
        self.embed = target.get_input_embeddings()
        self.embed.requires_grad_(False)
        ids = drafter.draft_token_ids
        # the target's lm_head, or its rows of the draft vocabulary (frozen either way)
        self.lm_head = draft_lm_head(target.get_output_embeddings(), ids).requires_grad_(False)
        self.label_map = None  # target id -> draft id, -100 outside the draft vocabulary
        if ids is not None:
            vocab = int(target.config.get_text_config().vocab_size)
            self.label_map = torch.full((vocab,), -100, dtype=torch.long, device=device)
            self.label_map[ids.to(device)] = torch.arange(ids.numel(), device=device)
        self.features, self.data = features, data
        B = config.block_size
        self.position_weights = torch.exp(
            -torch.arange(B - 1, dtype=torch.float32) / config.gamma
        ).to(device)

    def batch_loss(self, sample_ids: Sequence[int], generator: torch.Generator):
        """Weighted cross-entropy of ``anchors_per_sample`` random blocks of each sample, all in
        one drafter forward; returns the loss and the acceptance statistics of the batch."""
        cfg, dev = self.config, self.device
        seqs, anchors = [], []
        for i in sample_ids:
            tokens = self.data.sequences[i]
            P, T = self.data.prompt_lengths[i], tokens.shape[0]
            candidates = torch.arange(P, T - 1)
            M = min(cfg.anchors_per_sample, candidates.numel())
            perm = torch.randperm(candidates.numel(), generator=generator)[:M]
            seqs.append(tokens)
            anchors.append(candidates[perm].sort().values)
        dtype = self.drafter.fc.weight.dtype
        batch = build_training_batch(
            seqs, anchors, cfg.block_size, self.drafter.mask_token_id, dtype
        )
        T = batch["position_ids"].shape[1] - batch["block_tokens"].shape[1]
        width = self.drafter.fc.in_features
        hidden_in = torch.zeros((len(seqs), T, width), dtype=dtype)
        for r, i in enumerate(sample_ids):
            feats = self.features[i]
            hidden_in[r, : feats.shape[0]] = feats.to(dtype)
        labels = batch["labels"].to(dev)  # [b, M, B-1], target ids
        in_range = labels >= 0
        if self.label_map is not None:
            labels = torch.where(in_range, self.label_map[labels.clamp(min=0)], labels)
        valid = labels >= 0  # scored: inside the sequence and the draft vocabulary
        amp = cfg.precision == "bfloat16"
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=amp):
            noise = self.embed(batch["block_tokens"].to(dev)).to(dtype)
            hidden = self.drafter(
                noise_embedding=noise,
                target_hidden=hidden_in.to(dev),
                position_ids=batch["position_ids"].to(dev),
                attention_mask=batch["attention_mask"].to(dev),
            )
            b, M, B = labels.shape[0], labels.shape[1], cfg.block_size
            h = hidden.view(b, M, B, -1)[:, :, 1:]  # [b, M, B-1, H]
            logits = self.lm_head(h[valid].to(self.lm_head.weight.dtype)).float()
        ce = torch.nn.functional.cross_entropy(logits, labels[valid], reduction="none")
        if cfg.loss_weighting == "dpace":
            w = dpace_weights(ce.detach(), valid, cfg.dpace_alpha)[valid]
        else:
            w = self.position_weights.expand(b, M, -1)[valid]
        loss = (w * ce).sum() / w.sum()
        with torch.no_grad():
            correct = torch.zeros_like(labels, dtype=torch.bool)
            correct[valid] = logits.argmax(-1) == labels[valid]
            # acceptance of a chain draft, block by block: the leading run of correct predictions
            # (a token outside the draft vocabulary ends it, as it would when decoding)
            run = torch.cumprod((correct | ~in_range).float(), dim=-1) * in_range.float()
            blocks = in_range[..., 0]
            stats = {
                "top1": correct[..., 0][blocks].float().mean().item(),
                "accept": run.sum(-1)[blocks].mean().item(),
            }
        return loss, stats


def _save_checkpoint(
    directory: Path, drafter, optimizer, step: int, log: list[dict], config: TrainConfig
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
                    "step": step,
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
) -> dict[str, Any]:
    """Train (or resume training) a DFlash drafter for ``target`` on ``data``.

    Writes ``output_dir/checkpoint`` (the drafter in the released format, plus optimiser and
    trainer state) every ``save_every`` steps and at the end, ``output_dir/features.safetensors``
    (cached context features) and ``output_dir/train_log.jsonl`` (the learning curve). Returns
    the last log entry. ``stop_after`` ends this call after that many steps (a later call
    resumes); an interrupt (Ctrl-C) also saves a checkpoint before it propagates.
    ``stop_token_ids`` always join a draft vocabulary. ``init_from`` starts a new run from the
    weights of a drafter in the released format (for example the one shipped, to train it
    further in a later session on a fresh machine) instead of random weights; its architecture
    and draft vocabulary are kept (a drafter with fewer layers than ``config.num_layers`` is
    grown with :func:`grow_drafter`), and a fresh optimiser starts. A resumed run
    with the same settings continues exactly as an uninterrupted one would; ``steps`` may change
    on resume, and the learning-rate schedule then follows the new total.
    """
    from tqdm.auto import tqdm

    config = config or TrainConfig()
    config.validate()
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    ckpt = out / "checkpoint"
    if device is None:
        device = target.get_input_embeddings().weight.device
    device = torch.device(device)

    state = None
    if resume:
        _recover_checkpoint(ckpt)
    if resume and (ckpt / "trainer_state.json").is_file():
        state = json.loads((ckpt / "trainer_state.json").read_text())
        drafter = _resumed_drafter(ckpt, state, config)
    elif init_from is not None:
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
    else:
        drafter = _new_drafter(target, data, config, stop_token_ids)
    config.target_layer_ids = list(drafter.target_layer_ids)
    config.mask_token_id = drafter.mask_token_id
    check_drafter_fits_target(drafter, target.config)
    drafter.to(device).train()

    if features is None:
        features = cached_features(
            target, data, config.target_layer_ids, out / "features.safetensors", progress
        )
    train_ids, eval_ids = split_samples(data, config)
    trainer = _Trainer(drafter, target, features, data, config, device)
    optimizer = torch.optim.AdamW(
        drafter.parameters(),
        lr=config.learning_rate,
        weight_decay=config.weight_decay,
        betas=(0.9, 0.95),
    )
    log: list[dict] = []
    start = 0
    if state is not None:
        _load_optimizer_state(ckpt, optimizer, state)
        start, log = int(state["step"]), list(state["log"])
        logger.info("resuming from step %d of %d (%s)", start, config.steps, ckpt)

    log_path = out / "train_log.jsonl"
    # the file starts as the checkpoint's log: steps run after the last checkpoint by an
    # interrupted call are run again, and must not appear twice in the learning curve
    atomic_write_text(log_path, "".join(json.dumps(e) + "\n" for e in log))
    end = config.steps if stop_after is None else min(config.steps, start + stop_after)
    bar = tqdm(
        total=config.steps,
        initial=start,
        desc="training drafter",
        unit="step",
        disable=not progress,
    )
    entry: dict[str, Any] = log[-1] if log else {}
    previous_handler = _terminate_as_interrupt()
    try:
        for step in range(start, end):
            entry = _train_step(trainer, optimizer, train_ids, eval_ids, step)
            log.append(entry)
            with open(log_path, "a", encoding="utf-8") as fh:
                fh.write(json.dumps(entry) + "\n")
            bar.set_postfix(loss=f"{entry['loss']:.3f}", acc=f"{entry['train_accept']:.2f}")
            bar.update(1)
            if (step + 1) % config.save_every == 0 or step + 1 == end:
                _save_checkpoint(ckpt, drafter, optimizer, step + 1, log, config)
    except KeyboardInterrupt:
        if len(log) > start:
            _save_checkpoint(ckpt, drafter, optimizer, len(log), log, config)
            logger.warning("interrupted: saved step %d; run again to resume", len(log))
        raise
    finally:
        bar.close()
        if previous_handler is not None:
            signal.signal(signal.SIGTERM, previous_handler)
    return entry


def _terminate_as_interrupt() -> Any:
    """Make SIGTERM (``kill PID``, a job scheduler's stop) behave like Ctrl-C while training, so
    a stopped run saves its checkpoint; background jobs started by a shell ignore Ctrl-C's SIGINT.
    Returns the previous handler (``None`` off the main thread, where handlers cannot be set)."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    return signal.signal(signal.SIGTERM, interrupt)


def _resumed_drafter(ckpt: Path, state: dict, config: TrainConfig) -> DFlashDraftModel:
    # The length of the run and how often it reports may change on resume; settings left as
    # None are derived, and come from the checkpoint.
    free = ("steps", "save_every", "eval_every", "precision")
    now = {k: v for k, v in asdict(config).items() if k not in free and v is not None}
    # a setting added after the checkpoint was written had its default then
    defaults = asdict(TrainConfig())
    saved = {k: state["config"].get(k, defaults[k]) for k in now}
    if saved != now:
        raise InvalidInputError(
            f"{ckpt} was trained with other settings; use another output directory or the "
            f"same settings (saved: {saved})"
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


def split_samples(data: TrainingData, config: TrainConfig) -> tuple[list[int], list[int]]:
    """Deterministic train / held-out split of the samples that have something to learn."""
    usable = [
        i for i, (s, p) in enumerate(zip(data.sequences, data.prompt_lengths)) if len(s) - 1 > p
    ]
    if not usable:
        raise InvalidInputError("no training sample has a response of two or more tokens")
    perm = torch.randperm(len(usable), generator=torch.Generator().manual_seed(config.seed))
    n_eval = int(len(usable) * config.eval_fraction) if len(usable) >= 20 else 0
    order = [usable[i] for i in perm.tolist()]
    return order[n_eval:], order[:n_eval]


def _train_step(trainer: _Trainer, optimizer, train_ids, eval_ids, step: int) -> dict[str, Any]:
    """One optimiser step on ``samples_per_step`` samples drawn with the RNG of ``(seed, step)``."""
    config, drafter = trainer.config, trainer.drafter
    t0 = time.perf_counter()
    step_gen = torch.Generator().manual_seed(config.seed * 1_000_003 + step)
    picks = torch.randint(len(train_ids), (config.samples_per_step,), generator=step_gen).tolist()
    for group in optimizer.param_groups:
        group["lr"] = _lr_at(step, config)
    optimizer.zero_grad(set_to_none=True)
    loss, stats = trainer.batch_loss([train_ids[j] for j in picks], step_gen)
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(drafter.parameters(), config.grad_clip).item()
    optimizer.step()
    entry = {
        "step": step + 1,
        "loss": loss.item(),
        "train_accept": stats["accept"],
        "lr": optimizer.param_groups[0]["lr"],
        "grad_norm": grad_norm,
        "step_s": round(time.perf_counter() - t0, 3),
    }
    if eval_ids and ((step + 1) % config.eval_every == 0 or step + 1 == config.steps):
        entry.update(_evaluate(trainer, eval_ids, config.seed))
    return entry


@torch.no_grad()
def _evaluate(trainer: _Trainer, eval_ids: list[int], seed: int) -> dict[str, float]:
    trainer.drafter.eval()
    g = torch.Generator().manual_seed(seed + 17)
    losses, top1, accept = [], [], []
    size = trainer.config.samples_per_step
    for k in range(0, len(eval_ids), size):
        loss, stats = trainer.batch_loss(eval_ids[k : k + size], g)
        losses.append(loss.item())
        top1.append(stats["top1"])
        accept.append(stats["accept"])
    trainer.drafter.train()
    n = len(losses)
    return {
        "eval_loss": sum(losses) / n,
        "eval_top1": sum(top1) / n,
        "eval_accept": sum(accept) / n,
    }


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
