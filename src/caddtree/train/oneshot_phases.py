"""The phases of the one-shot GPU run (:mod:`caddtree.train.oneshot`): each takes the run's
:class:`State` and its deadline, leaves what it made in the state, and returns its figures."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from ..util.files import atomic_write, atomic_write_text
from .data import TrainingData
from .magpie import read_raw_queries
from .oneshot_work import (
    Deadline,
    Pace,
    Target,
    committed_training_data,
    decode_greedy,
    feature_room,
    features_until,
    load_target,
    make_queries,
    prompt_ids,
    tau_walks,
    train_until,
)

__all__ = [
    "OUTPUT_LIMITS",
    "State",
    "assemble",
    "data_shards",
    "evaluate",
    "features",
    "pack",
    "queries",
    "responses",
    "train",
]

# what one command may send back: files, bytes per file
OUTPUT_LIMITS = (8, 16 << 20)
SHARD_BYTES = 15 << 20  # one data file's token bytes at most (int32 ids)
MAX_DATA_SHARDS = 3
RAW_QUERIES_BYTES = 12 << 20


class State:
    """What the phases hand on: the target, the drafters, the data and their features."""

    def __init__(self, settings: Any):
        self.settings = settings
        self.target: Target | None = None
        self.shipped: Any = None  # the drafter training starts from
        self.queries: list[str] = []
        self.eval_prompts = _read_prompts(settings.eval_prompts)
        self.eval_data: TrainingData | None = None
        self.new_data: TrainingData | None = None
        self.train_data: TrainingData | None = None
        self.train_features: list[torch.Tensor] | None = None
        self.eval_features: list[torch.Tensor] | None = None
        self.checkpoint: Path | None = None


def _read_prompts(path: Path) -> list[str]:
    """The held-out prompts, none where the file is missing (the run then measures no tau)."""
    if not Path(path).is_file():
        return []
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    return [json.loads(line)["prompt"] for line in lines if line.strip()]


# ---- outputs (what comes back) --------------------------------------------------------------


def data_shards(data: TrainingData, limit: int = SHARD_BYTES) -> list[tuple[int, int]]:
    """``(start, stop)`` sample ranges of ``data`` whose token ids fit ``limit`` bytes each."""
    ranges, start, size = [], 0, 0
    for i, seq in enumerate(data.sequences):
        need = 4 * len(seq) + 16
        if size + need > limit and i > start:
            ranges.append((start, i))
            start, size = i, 0
        size += need
    if start < len(data.sequences):
        ranges.append((start, len(data.sequences)))
    return ranges


def write_data(out: Path, data: TrainingData) -> list[str]:
    """``data`` in shards ``data-NN.safetensors`` (each written whole, then renamed); the
    responses phase makes no more data than :data:`MAX_DATA_SHARDS` shards hold."""
    names = []
    for n, (a, b) in enumerate(data_shards(data)[:MAX_DATA_SHARDS]):
        shard = TrainingData(data.sequences[a:b], data.prompt_lengths[a:b], data.meta)
        name = f"data-{n:02d}.safetensors"
        shard.save(out / name)
        names.append(name)
    return names


def copy_checkpoint(checkpoint: Path, out: Path, scratch: Path) -> None:
    """The drafter of a training checkpoint in bfloat16, as the shipped one is (its config and
    weights, not the optimiser's state), into ``out/drafter``: saved in ``scratch`` first, then
    each file copied in under a temporary name and renamed."""
    from .trainer import load_trained_drafter

    shutil.rmtree(scratch, ignore_errors=True)
    load_trained_drafter(checkpoint).to(torch.bfloat16).save_pretrained(scratch)
    target = out / "drafter"
    target.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "model.safetensors"):
        atomic_write(target / name, lambda tmp, n=name: shutil.copyfile(scratch / n, tmp))


def output_files(out: Path) -> list[dict]:
    """Every file under ``out`` with its size, and whether the limits on what comes back
    hold for it."""
    files = sorted(p for p in out.rglob("*") if p.is_file())
    limit_files, limit_bytes = OUTPUT_LIMITS
    return [
        {
            "file": str(p.relative_to(out)),
            "bytes": p.stat().st_size,
            "fits": i < limit_files and p.stat().st_size <= limit_bytes,
        }
        for i, p in enumerate(files)
    ]


# ---- the phases ----------------------------------------------------------------------------------


def assemble(state: State, deadline: Deadline) -> dict:
    """The target from its pieces, and the drafter to start from (without which data is still
    made, but nothing is trained or measured)."""
    from .trainer import load_trained_drafter

    s = state.settings
    state.target = load_target(s.kit, s.carried, s.work, s.device, s.dtype)
    figures: dict[str, Any] = {"held_out_prompts": len(state.eval_prompts)}
    try:
        state.shipped = load_trained_drafter(s.drafter).float().to(s.device).eval()
    except Exception as err:
        figures["drafter_error"] = f"{type(err).__name__}: {err}"
    committed = _committed_meta(s.committed)
    figures |= {
        "fingerprint": state.target.fingerprint,
        "same_target_as_committed_data": {k: committed.get(k) for k in state.target.fingerprint}
        == state.target.fingerprint,
        "device_name": _device_name(state.target.device),
    }
    return figures


def _committed_meta(folder: Path | None) -> dict:
    return {} if folder is None else TrainingData.read_meta(Path(folder) / "data.safetensors")


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return device.type


def queries(state: State, deadline: Deadline) -> dict:
    """Magpie queries; their raw records go to the output folder."""
    s = state.settings
    earlier = read_raw_queries(Path(s.committed) / "magpie_raw.jsonl") if s.committed else []
    raw_path = s.work / f"magpie-seed{s.seed}-batch{s.query_batch}.jsonl"
    kept, records, figures = make_queries(
        state.target,
        raw_path,
        deadline,
        seed=s.seed,
        batch_size=s.query_batch,
        max_new_tokens=s.query_tokens,
        max_queries=s.max_queries,
        earlier=earlier,
        avoid=state.eval_prompts,
    )
    state.queries = kept
    lines, size = [], 0
    for record in records:
        line = json.dumps(record) + "\n"
        size += len(line.encode())
        if size > RAW_QUERIES_BYTES:
            break
        lines.append(line)
    atomic_write_text(s.out / "magpie_raw.jsonl", "".join(lines))
    figures["raw_returned"] = len(lines)
    return figures


def responses(state: State, deadline: Deadline) -> dict:
    """Greedy responses to the held-out prompts, then to the queries; the data is written to
    the output folder every minute and at the end."""
    s, target = state.settings, state.target
    tokenizer = target.tokenizer
    eval_ids = [prompt_ids(tokenizer, p) for p in state.eval_prompts]
    kwargs = {"batch_size": s.response_batch, "generator": s.generator}
    began = time.monotonic()
    eval_done, _ = decode_greedy(target, eval_ids, s.eval_tokens, deadline, **kwargs)
    state.eval_data = _samples(eval_ids, eval_done, {})
    ids = [prompt_ids(tokenizer, q) for q in state.queries]
    ids = [p for p in ids if len(p) <= s.max_prompt_tokens]
    mean = sum(map(len, ids)) / len(ids) if ids else 0
    room = MAX_DATA_SHARDS * SHARD_BYTES // 4  # token ids the data files may hold
    ids = ids[: int(room // (mean + s.response_tokens)) if ids else 0]
    meta = _data_meta(state)

    def save(done: dict[int, list[int]]) -> None:
        write_data(s.out, _samples(ids, done, meta))

    began_train = time.monotonic()
    done, figures = decode_greedy(
        target, ids, s.response_tokens, deadline, on_progress=save, **kwargs
    )
    made = sum(len(r) for r in done.values())
    seconds = time.monotonic() - began_train
    meta["generator"] = figures["generator"]  # "engine+hf" where the engine failed part way
    meta["generators"] = [
        {
            "first": 0,
            "end": len(done),
            "generator": figures["generator"],
            "batch_size": s.response_batch,
            "seconds": round(seconds, 1),
            "response_tokens": made,
        }
    ]
    state.new_data = _samples(ids, done, meta)
    files = write_data(s.out, state.new_data)
    figures.update(
        held_out_samples=len(state.eval_data.sequences),
        held_out_s=round(began_train - began, 2),
        prompts=len(ids),
        samples=len(done),
        response_tokens=made,
        tokens_per_s=round(made / seconds, 1) if seconds > 0 else None,
        files=files,
    )
    return figures


def _samples(ids: list[list[int]], done: dict[int, list[int]], meta: dict) -> TrainingData:
    order = sorted(done)
    seqs = [torch.tensor(ids[i] + done[i], dtype=torch.long) for i in order]
    return TrainingData(seqs, [len(ids[i]) for i in order], dict(meta))


def _data_meta(state: State) -> dict:
    """The settings the trainer checks data against, and where the data came from."""
    s, target = state.settings, state.target
    return {
        "max_new_tokens": s.response_tokens,
        "stops": [target.eos_id],
        **target.fingerprint,
        "source": "magpie: queries the target sampled at temperature 1 under every persona",
        "seed": s.seed,
        "generator": s.generator,
        "device": _device_name(target.device),
        "benchmark_overlap_checked": False,
    }


def features(state: State, deadline: Deadline) -> dict:
    """Features of the held-out samples, the new data, then the committed training samples."""
    s, target = state.settings, state.target
    layers = list(state.shipped.target_layer_ids)
    room = feature_room(target, layers)
    kwargs = {"chunk": s.feature_chunk, "max_batch_tokens": s.feature_batch_tokens, "pace": Pace()}
    kwargs["room"] = room
    figures: dict[str, Any] = {"room_tokens": room.tokens}
    if state.eval_data is not None and state.eval_data.sequences:
        state.eval_features = features_until(target, state.eval_data, layers, deadline, **kwargs)
        state.eval_data = _first(state.eval_data, len(state.eval_features))
        figures["held_out"] = len(state.eval_features)
    parts = [("new", state.new_data), ("committed", committed_training_data_of(s))]
    seqs, lengths, feats = [], [], []
    for name, data in parts:
        if data is None or not data.sequences:
            figures[name] = 0
            continue
        got = features_until(target, data, layers, deadline, **kwargs)
        seqs += data.sequences[: len(got)]
        lengths += data.prompt_lengths[: len(got)]
        feats += got
        figures[name] = len(got)
    if feats:
        meta = dict(state.new_data.meta) if state.new_data else {}
        state.train_data = TrainingData(seqs, lengths, meta)
        state.train_features = feats
    figures["train_tokens"] = sum(len(q) for q in seqs)
    return figures


def committed_training_data_of(settings: Any) -> TrainingData | None:
    if settings.committed is None:
        return None
    return committed_training_data(Path(settings.committed))


def _first(data: TrainingData, n: int) -> TrainingData:
    return TrainingData(data.sequences[:n], data.prompt_lengths[:n], data.meta)


def train(state: State, deadline: Deadline) -> dict:
    """caddtree's trainer from the shipped drafter until the deadline."""
    from .trainer import TrainConfig

    s = state.settings
    drafter = state.shipped
    config = TrainConfig(
        block_size=drafter.block_size,
        num_layers=drafter.config.num_hidden_layers,
        steps=10_000,
        samples_per_step=s.samples_per_step,
        anchors_per_sample=s.anchors_per_sample,
        learning_rate=s.learning_rate,
        warmup_steps=s.warmup_steps,
        eval_fraction=0.0,
        eval_every=1_000_000,
        save_every=s.save_every,
        seed=s.seed,
        precision="bfloat16" if state.target.device.type == "cuda" else "float32",
    )
    run_dir = s.work / f"train-{time.strftime('%Y%m%d-%H%M%S')}"

    def after_save(checkpoint: Path) -> None:
        copy_checkpoint(checkpoint, s.out, s.work / "drafter-bf16")
        state.checkpoint = checkpoint

    figures = train_until(
        state.target,
        state.train_data,
        state.train_features,
        run_dir,
        config,
        deadline,
        init_from=s.drafter,
        after_save=after_save,
    )
    figures.update(samples=len(state.train_data.sequences), run_dir=str(run_dir))
    return figures


def evaluate(state: State, deadline: Deadline) -> dict:
    """tau of the shipped drafter and of the trained one (as it came back) on the held-out
    samples."""
    from .trainer import load_trained_drafter

    s = state.settings
    drafters = {"shipped": state.shipped}
    if state.checkpoint is not None:  # the drafter as it came back, in bfloat16
        returned = load_trained_drafter(s.out / "drafter")
        drafters["trained"] = returned.float().to(s.device).eval()
    figures = tau_walks(
        state.target, drafters, state.eval_data, state.eval_features, s.eval_budget, deadline
    )
    return figures


def pack(state: State, deadline: Deadline, report: dict) -> dict:
    """The list of what comes back, checked against the limits on it."""
    files = output_files(state.settings.out)
    limit_files, limit_bytes = OUTPUT_LIMITS
    figures = {
        "files": files,
        "within_limits": len(files) <= limit_files
        and all(f["bytes"] <= limit_bytes for f in files),
    }
    report["files"] = files
    return figures
