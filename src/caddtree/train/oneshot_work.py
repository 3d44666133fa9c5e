"""The work of each phase of the one-shot GPU run (:mod:`caddtree.train.oneshot`), each step
bounded by a :class:`Deadline`: it starts a unit of work (a batch, a chunk) only when the time
the last one took still fits before its deadline; training keeps the deadline itself
(``train_drafter``'s ``deadline``).

Only torch, transformers, safetensors and numpy (and ``gguf`` for the GGUF conversion, carried
to the GPU machine as a folder) are needed: nothing here imports the server or the benchmark
packages, and nothing builds caddtree's CPU kernels.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..util.errors import InvalidInputError
from ..util.files import atomic_directory
from .data import TrainingData, target_fingerprint
from .magpie import PERSONAS, filter_queries, generate_queries
from .pieces import assemble_file, read_manifest, stash_pieces

__all__ = [
    "Deadline",
    "Pace",
    "Target",
    "clock",
    "committed_training_data",
    "decode_greedy",
    "features_until",
    "load_target",
    "make_queries",
    "prompt_ids",
    "tau_walks",
    "train_until",
]

logger = logging.getLogger(__name__)

_FILTER_S = 2e-4  # seconds the Magpie filter takes per record, with room to spare
_SAVE_EVERY_S = 60.0  # how often growing data is written out while responses are made


def clock() -> float:
    """Seconds on a clock that only goes forward (the phases' time)."""
    return time.monotonic()


class Deadline:
    """A wall-clock limit: ``left()`` seconds remain; ``allows(estimate)`` says whether a unit of
    work that takes ``estimate`` seconds ends before it."""

    def __init__(self, seconds: float):
        self.end = clock() + max(0.0, float(seconds))

    def left(self) -> float:
        return self.end - clock()

    def allows(self, estimate: float = 0.0) -> bool:
        return self.left() > estimate


class Pace:
    """Seconds per unit of work (a token, a step), from what was measured so far: the slower
    of the mean and the last measurement, so that a slowdown counts at once."""

    def __init__(self) -> None:
        self.units, self.seconds, self.last = 0, 0.0, 0.0

    def record(self, units: int, seconds: float) -> None:
        if units > 0:
            self.units += units
            self.seconds += seconds
            self.last = seconds / units

    def per_unit(self) -> float:
        return max(self.seconds / self.units, self.last) if self.units else 0.0

    def estimate(self, units: int) -> float:
        return units * self.per_unit()


@dataclass
class Target:
    """The target as the run uses it: model, tokenizer, stop token, fingerprint, device."""

    model: Any
    tokenizer: Any
    eos_id: int
    fingerprint: dict[str, str]
    device: torch.device


# ---- the target, from its pieces -----------------------------------------------------------------


def load_target(kit: Path, carried: Path, work: Path, device: str, dtype: str) -> Target:
    """Stash the pieces carried now, join all of them into the GGUF file (checked against the
    manifest), convert it once to a transformers checkpoint in ``work`` as caddtree converts the
    built-in target, and load it in ``dtype`` on ``device``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..util.defaults import _convert_smollm2, check_chat_setup

    manifest = read_manifest(kit / "manifest.json")
    stash_pieces(manifest, carried, work / "pieces")
    gguf = assemble_file(manifest, [work / "pieces", carried], work / "gguf" / manifest.name)
    converted = work / f"converted-{manifest.sha256[:16]}"  # there only once complete
    atomic_directory(converted, lambda tmp: _convert_smollm2(gguf, tmp))
    tokenizer = AutoTokenizer.from_pretrained(converted)
    model = AutoModelForCausalLM.from_pretrained(converted, dtype=getattr(torch, dtype))
    model = model.to(device).eval()
    # transformers compiles the forward for a static cache on a GPU, again for each new shape
    # (batch, prompt length): minutes that the phases' budgets do not have
    model.generation_config.disable_compile = True
    eos_id = check_chat_setup(tokenizer, model.generation_config)
    return Target(model, tokenizer, eos_id, target_fingerprint(model), torch.device(device))


def prompt_ids(tokenizer: Any, text: str) -> list[int]:
    """``text`` as a user turn in the chat template, ready for the assistant's answer (what
    :func:`caddtree.train.data.chat_prompt_ids` gives, without loading the generation API)."""
    from ..engine.tokens import chat_template_ids

    return chat_template_ids(tokenizer, [{"role": "user", "content": text}])


# ---- Magpie queries ------------------------------------------------------------------------------


def make_queries(
    target: Target,
    raw_path: Path,
    deadline: Deadline,
    *,
    seed: int,
    batch_size: int,
    max_new_tokens: int,
    max_queries: int,
    earlier: Sequence[dict],
    avoid: Sequence[str],
) -> tuple[list[str], list[dict], dict]:
    """Magpie queries sampled batch by batch (every persona in the rotation from the first batch)
    into ``raw_path`` until ``deadline`` or ``max_queries``, then filtered as the trainer filters
    them: after the ``earlier`` raw records (the committed data's), so that a near-duplicate of a
    query already trained on is dropped too, and without any that overlaps ``avoid`` (the
    held-out prompts). Returns the kept queries, the new raw records and the phase's figures."""
    from .prompts import OverlapIndex

    personas = {p.name: p.system for p in PERSONAS}
    records: list[dict] = []
    batches, batch_s = 0, 0.0
    while len(records) + batch_size <= max_queries:
        # the filter reads the earlier records twice and the new ones once
        filter_s = _FILTER_S * (2 * len(earlier) + len(records) + batch_size)
        if not deadline.allows(batch_s + filter_s):
            break
        start = clock()
        records = generate_queries(
            target.model,
            target.tokenizer,
            (batches + 1) * batch_size,
            raw_path,
            seed=seed,
            personas=personas,
            batch_size=batch_size,
            max_new_tokens=max_new_tokens,
            stop_token_ids=[target.eos_id],
            progress=False,
            generator="hf",  # a static cache at one batch's width, as rehearsed
        )
        batches = len({r["batch"] for r in records})
        batch_s = clock() - start
    start = clock()
    before = filter_queries(earlier)
    report = filter_queries([*earlier, *records])
    overlap = OverlapIndex(avoid)
    kept = [q for q in report.kept[len(before.kept) :] if not overlap.overlaps(q)]
    figures = {
        "raw": len(records),
        "kept": len(kept),
        "dropped": dict(report.dropped - before.dropped),  # the new records' only
        "dropped_as_held_out": len(report.kept) - len(before.kept) - len(kept),
        "filter_s": round(clock() - start, 2),
    }
    return kept, records, figures


# ---- greedy responses ----------------------------------------------------------------------------


def decode_greedy(
    target: Target,
    prompts: Sequence[list[int]],
    max_new_tokens: int,
    deadline: Deadline,
    *,
    batch_size: int,
    generator: str,
    on_progress: Callable[[dict[int, list[int]]], None] | None = None,
) -> tuple[dict[int, list[int]], dict]:
    """Greedy responses (ending with the stop token, or at ``max_new_tokens``) to ``prompts``,
    by index, for as many as finish before ``deadline``. ``generator`` ``"engine"`` decodes with
    caddtree's batched decoder (continuous batching, plain greedy rounds), ``"hf"`` with
    transformers' ``generate`` in left-padded batches; the engine falls back to ``hf`` for the
    prompts left if it fails, and says so in the figures."""
    figures: dict[str, Any] = {"generator": generator}
    done: dict[int, list[int]] = {}
    if generator == "engine":
        try:
            _engine_decode(target, prompts, max_new_tokens, deadline, batch_size, done, on_progress)
        except Exception as err:  # the other generator still makes data
            logger.exception("the batched decoder failed; going on with transformers' generate")
            figures.update(engine_error=f"{type(err).__name__}: {err}", generator="engine+hf")
            generator = "hf"
        else:
            return done, figures
    if generator != "hf":
        raise InvalidInputError(f"unknown generator {generator!r}: use 'engine' or 'hf'")
    left = [i for i in range(len(prompts)) if i not in done]
    _hf_decode(target, prompts, left, max_new_tokens, deadline, batch_size, done, on_progress)
    return done, figures


def _engine_decode(target, prompts, max_new_tokens, deadline, batch_size, done, on_progress):
    """caddtree's batched decoder (:func:`~caddtree.train.data.engine_responses`): a prompt
    joins while a full response still fits before the deadline (at the rate rounds take now);
    responses cut by the deadline are left out. ``on_progress`` gets the responses every
    minute or so."""
    from .data import engine_responses

    last_report = clock()

    def after_round(made: dict[int, list[int]]) -> None:
        nonlocal last_report
        if on_progress is not None and clock() - last_report > _SAVE_EVERY_S:
            on_progress(made)
            last_report = clock()

    engine_responses(
        target.model,
        prompts,
        done,
        max_new_tokens=max_new_tokens,
        batch_size=batch_size,
        stop_token_ids=[target.eos_id],
        may_start=deadline.allows,
        after_round=after_round,
    )


def _hf_decode(target, prompts, order, max_new_tokens, deadline, batch_size, done, on_progress):
    """transformers' ``generate`` (caddtree's :func:`~caddtree.train.data.generate_responses`),
    batch by batch, shortest prompts first, while a batch's time still fits."""
    from .data import generate_responses

    order = sorted(order, key=lambda i: len(prompts[i]))
    pad = target.tokenizer.pad_token_id
    batch_s, last_report = 0.0, clock()
    for start in range(0, len(order), batch_size):
        if not deadline.allows(batch_s):
            break
        began = clock()
        idx = order[start : start + batch_size]
        made = generate_responses(
            target.model,
            [prompts[i] for i in idx],
            max_new_tokens=max_new_tokens,
            batch_size=batch_size,
            stop_token_ids=[target.eos_id],
            pad_token_id=target.eos_id if pad is None else pad,
            progress=False,
            generator="hf",
        )
        for i, seq, p in zip(idx, made.sequences, made.prompt_lengths):
            done[i] = seq[p:].tolist()
        batch_s = clock() - began
        if on_progress is not None and clock() - last_report > _SAVE_EVERY_S:
            on_progress(done)
            last_report = clock()


# ---- features ------------------------------------------------------------------------------------


def committed_training_data(folder: Path) -> TrainingData | None:
    """The committed data's samples that are not held out (``split.json``), or ``None`` when
    the folder has no data."""
    data_path = folder / "data.safetensors"
    if not TrainingData.exists(data_path):
        return None
    data = TrainingData.load(data_path)
    split = folder / "split.json"
    held = set(json.loads(split.read_text())["heldout"]) if split.is_file() else set()
    keep = [i for i in range(len(data.sequences)) if i not in held]
    return TrainingData(
        [data.sequences[i] for i in keep], [data.prompt_lengths[i] for i in keep], data.meta
    )


@dataclass
class FeatureRoom:
    """How many more tokens' context features the memory holds (shared by the calls of one
    phase); ``None``: no limit."""

    tokens: int | None = None

    def take(self, tokens: int) -> bool:
        """Whether ``tokens`` more fit; if they do, they are counted."""
        if self.tokens is None:
            return True
        if tokens > self.tokens:
            return False
        self.tokens -= tokens
        return True


def feature_room(target: Target, layer_ids: Sequence[int]) -> FeatureRoom:
    """The tokens whose features fit in memory: the features come to the host as they are made
    and the trainer copies them into one tensor on the device, so a GPU run keeps them within
    half the host's available memory and half the device's free memory, a CPU run (two copies in
    the same memory) within a third of the available memory."""
    from .features import feature_row_bytes, free_memory

    on_gpu = target.device.type == "cuda"
    host = free_memory(torch.device("cpu"))
    limits = [] if host is None else [host // (2 if on_gpu else 3)]
    if on_gpu:
        limits.append(free_memory(target.device) // 2)
    row = feature_row_bytes(target.model, layer_ids)
    return FeatureRoom(min(limits) // row if limits else None)


def features_until(
    target: Target,
    data: TrainingData,
    layer_ids: Sequence[int],
    deadline: Deadline,
    *,
    chunk: int,
    max_batch_tokens: int,
    pace: Pace,
    room: FeatureRoom | None = None,
) -> list[torch.Tensor]:
    """The context features of ``data``'s samples, chunk by chunk in order, for as many chunks
    as fit before ``deadline`` at ``pace`` (seconds per token, measured as it goes and shared by
    the calls of one phase) and in ``room``: the features of the first samples, possibly of
    none."""
    from .features import compute_features

    room = room or FeatureRoom()
    features: list[torch.Tensor] = []
    for start in range(0, len(data.sequences), chunk):
        part = TrainingData(
            data.sequences[start : start + chunk], data.prompt_lengths[start : start + chunk]
        )
        tokens = sum(len(s) for s in part.sequences)
        if not deadline.allows(pace.estimate(tokens)) or not room.take(tokens):
            break
        began = clock()
        features.extend(
            compute_features(
                target.model,
                part,
                list(layer_ids),
                max_batch_tokens=max_batch_tokens,
                progress=False,
            )
        )
        pace.record(tokens, clock() - began)
    return features


# ---- training ------------------------------------------------------------------------------------


def train_until(
    target: Target,
    data: TrainingData,
    features: list[torch.Tensor],
    run_dir: Path,
    config: Any,
    deadline: Deadline,
    *,
    init_from: Path,
    after_save: Callable[[Path], None],
) -> dict:
    """Train from ``init_from`` with caddtree's trainer until ``deadline``, in one call: the
    trainer ends before a step that would not finish in time and lowers the schedule's total to
    the steps that fit (``train_drafter``'s ``deadline``). ``after_save`` gets the checkpoint
    folder after each save (every ``config.save_every`` steps and at the end)."""
    from .trainer import train_drafter

    began = clock()
    train_drafter(
        target.model,
        data,
        run_dir,
        config,
        features=features,
        progress=False,
        device=target.device,
        stop_token_ids=[target.eos_id],
        init_from=init_from,
        deadline=deadline.end,
        on_checkpoint=after_save,
    )
    log = _train_log(run_dir / "train_log.jsonl")
    steps = len(log)
    step_s = sum(e["step_s"] for e in log) / steps if steps else 0.0
    last = log[-1] if log else {}
    return {
        "steps": steps,
        "step_s": round(step_s, 4),
        "wall_s": round(clock() - began, 2),
        "last": last,
    }


def _train_log(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# ---- tau -----------------------------------------------------------------------------------------


def tau_walks(
    target: Target,
    drafters: dict[str, Any],
    samples: TrainingData,
    features: list[torch.Tensor],
    budget: int,
    deadline: Deadline,
) -> dict:
    """Tokens per round at DDTree budget ``budget`` of each drafter on ``samples`` (their
    prompts and the target's greedy responses), walked as ``benchmarks/chain_walk.py`` walks
    them (the trainer's ``walks``), sample by sample for all drafters at once: the first sample
    always, the others while the time a sample took still fits before ``deadline``. ``tau``
    leaves the prefill's token out (the engine's), ``tau_with_prefill`` counts it (``caddtree
    bench``'s pooled figure)."""
    from .loss import AnchorBlockLoss
    from .trainer import TrainConfig

    losses = {}
    for name, drafter in drafters.items():
        config = TrainConfig(block_size=drafter.block_size, precision="float32")
        losses[name] = AnchorBlockLoss(
            drafter, target.model, features, samples, config, target.device
        )
    rounds: dict[str, list[int]] = {name: [] for name in drafters}
    walked, sample_s = 0, 0.0
    for i in range(len(features)):
        if i and not deadline.allows(sample_s):  # the first sample always, so there is a tau
            break
        began = clock()
        for name, loss in losses.items():
            rounds[name].extend(loss.walks(i, [budget])[0])
        walked += 1
        sample_s = clock() - began
    out: dict[str, Any] = {"samples": walked, "budget": budget}
    for name, counts in rounds.items():
        out[name] = {
            "rounds": len(counts),
            "tau": round(sum(counts) / len(counts), 4) if counts else None,
            "tau_with_prefill": round((sum(counts) + walked) / len(counts), 4) if counts else None,
        }
    return out
