"""The command line: sub-commands run, and errors come out as one clear line."""

from __future__ import annotations

import subprocess
import sys

from caddtree.cli import main


def test_tree_demo_runs(capsys):
    assert main(["tree-demo", "--rounds", "3", "--vocab", "500"]) == 0
    out = capsys.readouterr().out
    assert "CaDDTree n*" in out and "R2" in out
    rows = [line for line in out.splitlines() if line.strip()[:1].isdigit() and "|" in line]
    assert len(rows) == 3


def test_console_entry_point_reports_usage_errors():
    proc = subprocess.run(
        [sys.executable, "-m", "caddtree.cli", "no-such-command"], capture_output=True, text=True
    )
    assert proc.returncode == 2
    assert "invalid choice" in proc.stderr and "Traceback" not in proc.stderr


# ---- generate on the tiny saved pair -------------------------------------------------------------

import json  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from caddtree import ConvexCostModel, load_cost_model  # noqa: E402


@pytest.fixture(scope="module")
def cost_file(tmp_path_factory):
    n = np.array([0, 4, 16, 64, 256])
    model = ConvexCostModel.fit({0: (n, 0.01 + 1e-4 * n + 1e-7 * n**2)}, draft_cost=0.003)
    return str(model.save(tmp_path_factory.mktemp("cost") / "cost.json"))


def generate_json(capsys, dirs, *extra):
    target, draft = dirs
    argv = ["generate", "--target", str(target), "--draft", str(draft), "--dtype", "float64"]
    argv += ["--device", "cpu", "--json", "--max-new-tokens", "20", *extra]
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def test_generate_json_all_methods_agree(capsys, tiny_pair_dirs, cost_file):
    outputs = {}
    for method, extra in [
        ("ar", []),
        ("dflash", []),
        ("ddtree", ["--budget", "8", "--no-lookup"]),
        ("caddtree", ["--cost-model", cost_file, "--no-lookup"]),
        ("lookup", []),
        ("caddtree", ["--cost-model", cost_file]),  # copies join ddtree's and caddtree's trees
    ]:
        out = generate_json(capsys, tiny_pair_dirs, "--method", method, *extra, "hello there")
        assert out["method"] == method
        assert out["lookup"] == (method in ("ddtree", "caddtree") and "--no-lookup" not in extra)
        assert isinstance(out["text"], str) and len(out["token_ids"]) >= 1
        stats = out["stats"]
        for key in ("tau", "ms_per_token", "rounds", "budget_mean", "budget_std"):
            assert isinstance(stats[key], (int, float)), key
        assert stats["ms_per_token"] > 0 and stats["rounds"] >= 1
        assert stats["copied_accepted_tokens"] <= stats["accepted_tokens"]
        if method != "lookup":
            assert (stats["copied_tokens"] > 0) == out["lookup"]
        outputs[method] = out["token_ids"]
    assert outputs["lookup"] == outputs["ar"]
    assert outputs["dflash"] == outputs["ar"]
    assert outputs["ddtree"] == outputs["ar"]
    assert outputs["caddtree"] == outputs["ar"]


def test_lookup_is_refused_where_the_method_has_no_tree_to_add_copies_to(generate_argv, capsys):
    assert main(generate_argv("--method", "dflash", "--lookup", "hi")) == 2
    assert "--lookup adds copies" in capsys.readouterr().err


def test_a_drafter_in_another_dtype_is_asked_for_by_name(generate_argv, capsys, cost_file):
    outputs = {}
    for option in ("same", "float32"):
        argv = generate_argv("--draft-dtype", option, "--cost-model", cost_file, "--json")
        argv += ["--max-new-tokens", "30", "hi"]
        assert main(argv) == 0
        outputs[option] = json.loads(capsys.readouterr().out)["token_ids"]
    assert outputs["float32"] == outputs["same"]
    assert main(generate_argv("--draft-dtype", "float13", "hi")) == 2
    err = capsys.readouterr().err
    assert "unknown dtype 'float13'" in err and "Traceback" not in err


def test_generate_matches_python_api(capsys, tiny_pair_dirs):
    from caddtree import SpeculativeGenerator

    target, draft = tiny_pair_dirs
    gen = SpeculativeGenerator.from_pretrained(target, draft, dtype="float64", device="cpu")
    api = gen.generate("hello there", method="ddtree", budget=8, max_new_tokens=20)
    cli = generate_json(
        capsys, tiny_pair_dirs, "--method", "ddtree", "--budget", "8", "hello there"
    )
    assert api.token_ids == cli["token_ids"] and api.text == cli["text"]
    # the chat template was applied: the prompt starts with "u: "
    assert gen.tokenizer.decode(api.prompt_ids).startswith("u: hello there")
    raw = gen.generate("hello there", method="ar", chat=False, max_new_tokens=3)
    assert raw.prompt_ids == gen.tokenizer("hello there")["input_ids"]
    streamed = []
    gen.generate("hi", method="dflash", max_new_tokens=9, callback=lambda s, t: streamed.extend(t))
    assert len(streamed) == 9


def test_generate_console_script_prints_json(tiny_pair_dirs):
    target, draft = tiny_pair_dirs
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "caddtree.cli",
            "generate",
            "--target",
            str(target),
            "--draft",
            str(draft),
            "--method",
            "dflash",
            "--dtype",
            "float64",
            "--max-new-tokens",
            "5",
            "--json",
            "hi",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["method"] == "dflash" and len(out["token_ids"]) == 5


def failing_generate(capsys, dirs, *args) -> str:
    """Run `caddtree generate` on the tiny pair, expect exit status 2, return stderr."""
    target, draft = dirs
    argv = ["generate", "--target", str(target), "--draft", str(draft), *args]
    if "--dtype" not in args:
        argv[1:1] = ["--dtype", "float64"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith("caddtree: error:")
    return err


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--method", "dflash", "--budget", "4"], "--budget only applies"),
        (["--method", "ar", "--max-new-tokens", "0"], "max_new_tokens must be a positive integer"),
        (["--method", "ar", "--max-new-tokens", "500"], "lower max_new_tokens"),
        (["--method", "ar", "--temperature", "-1"], "temperature"),
        (["--method", "ar", "--dtype", "int8"], "unknown dtype"),
        (["--method", "ar", "--max-new-tokens", "1", "x" * 200], "shorten the prompt"),
    ],
)
def test_generate_errors_are_one_line(capsys, tiny_pair_dirs, extra, message):
    args = extra if len(extra[-1]) > 100 else [*extra, "hi"]
    assert message in failing_generate(capsys, tiny_pair_dirs, *args)


def test_caddtree_without_cost_model_profiles_once_and_caches(
    capsys, tiny_pair_dirs, tmp_path, monkeypatch
):
    monkeypatch.setenv("CADDTREE_CACHE", str(tmp_path))
    target, draft = tiny_pair_dirs
    argv = ["generate", "--target", str(target), "--draft", str(draft), "--dtype", "float64"]
    argv += ["--json", "--max-new-tokens", "20", "--method", "caddtree", "--compare-ar", "hi"]
    assert main(argv) == 0
    first = capsys.readouterr()
    assert "profiling it once" in first.err and "cost model saved" in first.err
    files = list((tmp_path / "cost-models").glob("cost-*.json"))
    assert len(files) == 1
    model = load_cost_model(files[0])
    assert model.metadata["node_counts"][-1] >= 64 and len(model.context_lengths) >= 2
    assert main(argv) == 0
    second = capsys.readouterr()
    assert "profiled earlier" in second.err and "profiling it once" not in second.err
    a, b = json.loads(first.out), json.loads(second.out)
    assert a["token_ids"] == b["token_ids"] == b["ar"]["token_ids"]
    assert b["speedup_over_ar"] == b["ar"]["stats"]["ms_per_token"] / b["stats"]["ms_per_token"]


def test_generate_with_a_broken_cost_model_file(capsys, tiny_pair_dirs, tmp_path):
    bad = tmp_path / "cost.json"
    bad.write_text("{ this is not json")
    args = ["--method", "caddtree", "--cost-model", str(bad), "hi"]
    assert "not valid JSON" in failing_generate(capsys, tiny_pair_dirs, *args)


def test_generate_needs_a_drafter_for_a_custom_target(capsys, tiny_pair_dirs):
    target, _ = tiny_pair_dirs
    assert main(["generate", "--target", str(target), "--method", "dflash", "hi"]) == 2
    assert "needs --draft" in capsys.readouterr().err


def test_generate_with_a_missing_model(capsys, tmp_path):
    assert main(["generate", "--target", str(tmp_path / "nothing"), "--method", "ar", "hi"]) == 2
    assert "cannot load the target model" in capsys.readouterr().err


def test_train_drafter_on_a_prompt_file_end_to_end(capsys, tiny_pair_dirs, tmp_path):
    """`caddtree train-drafter --prompts FILE` on the tiny target: data, a draft vocabulary,
    training and an exported drafter that loads and carries that vocabulary."""
    target, _ = tiny_pair_dirs
    prompts = tmp_path / "prompts.jsonl"
    lines = [json.dumps({"prompt": f"tell me about {w}"}) for w in ("cats", "dogs", "rain", "sun")]
    lines.append(json.dumps({"messages": [{"role": "user", "content": "count to five"}]}))
    prompts.write_text("\n".join(lines) + "\n")
    out, export = tmp_path / "run", tmp_path / "drafter"
    argv = ["train-drafter", "--target", str(target), "--output", str(out), "--prompts"]
    argv += [str(prompts), "--sharegpt", "0", "--code", "0", "--math", "0", "--dtype", "float64"]
    argv += ["--max-new-tokens", "12", "--steps", "4", "--anchors", "4", "--feature-layers", "2"]
    argv += ["--draft-vocab-coverage", "0.95", "--export", str(export), "--export-dtype", "float64"]
    assert main([*argv, "--device", "cpu"]) == 0
    run = json.loads((out / "run.json").read_text())
    assert run["prompts"]["file"] == 5 and run["prompts"]["total"] == 5
    assert run["device"] == "cpu" and run["dtype"] == "torch.float64"
    config = json.loads((export / "config.json").read_text())
    assert 0 < config["draft_vocab_size"] < 96
    assert run["draft_vocab"]["size"] == config["draft_vocab_size"]
    assert run["draft_vocab"]["coverage"] >= 0.95
    assert (out / "heldout_prompts.jsonl").is_file()
    assert "draft vocabulary" in capsys.readouterr().err


def ten_prompts(folder):
    """A prompt file of ten short questions."""
    prompts = folder / "prompts.jsonl"
    words = ["cats", "dogs", "rain", "sun", "moss", "tea", "owls", "sand", "reed", "figs"]
    prompts.write_text("".join(json.dumps({"prompt": f"tell me about {w}"}) + "\n" for w in words))
    return prompts


def test_train_drafter_grows_its_data_by_appending(capsys, tiny_pair_dirs, tmp_path):
    """A second run into the same directory with larger sources keeps every response made
    before, first and in order, appends the new prompts' responses, and keeps each earlier
    sample's held-out side; smaller sources are refused before anything is changed."""
    from caddtree.train import TrainingData

    target, _ = tiny_pair_dirs
    prompts = ten_prompts(tmp_path)
    out = tmp_path / "run"
    base = ["train-drafter", "--target", str(target), "--output", str(out), "--data-only"]
    base += ["--sharegpt", "0", "--code", "0", "--dtype", "float64", "--max-new-tokens", "6"]
    base += ["--prompts", str(prompts)]
    assert main([*base, "--math", "20"]) == 0
    first = TrainingData.load(out / "data.safetensors")
    held_first = json.loads((out / "split.json").read_text())["heldout"]
    assert len(first.sequences) == 30 and len(held_first) == 1  # 5% of 30

    assert main([*base, "--math", "40"]) == 0
    grown = TrainingData.load(out / "data.safetensors")
    assert len(grown.sequences) == 50
    assert all(torch.equal(a, b) for a, b in zip(first.sequences, grown.sequences))
    record = json.loads((out / "split.json").read_text())
    assert record["samples"] == 50 and set(held_first) <= set(record["heldout"])
    assert len(record["heldout"]) == 2  # plus 5% of the 20 appended

    before = (out / "data.safetensors").read_bytes()
    assert main([*base, "--math", "10"]) == 2
    err = capsys.readouterr().err
    assert "30 of the 50 prompts of the existing data" in err and "Traceback" not in err
    assert (out / "data.safetensors").read_bytes() == before


def test_train_drafter_trains_on_a_runs_data_as_it_is(capsys, tiny_pair_dirs, tmp_path):
    """--train-only reads no prompt source (so needs none of the benchmark packages the overlap
    check loads): it trains on the run's data, checked against the target, and refuses a run
    without data or with another dtype's responses, before any training."""
    target, _ = tiny_pair_dirs
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"say {w}"}) + "\n" for w in "abcdefgh"))
    out = tmp_path / "run"
    common = ["train-drafter", "--target", str(target), "--output", str(out)]
    made = [*common, "--data-only", "--sharegpt", "0", "--code", "0", "--math", "0"]
    made += ["--prompts", str(prompts), "--dtype", "float64", "--max-new-tokens", "6"]
    assert main(made) == 0
    train = [*common, "--train-only", "--dtype", "float64", "--steps", "2", "--anchors", "2"]
    train += ["--feature-layers", "2", "--device", "cpu"]
    per_step = ["--features", "step", "--eval-samples", "1", "--time-limit", "30"]
    assert main([*train, "--max-prompts", "6", *per_step]) == 0
    run = json.loads((out / "run.json").read_text())
    assert run["prompts"]["total"] == 6 and run["final"]["step"] == 2
    assert run["config"]["features"] == "step" and not (out / "features.safetensors").exists()
    assert run["response_tokens"] > 0 and (out / "checkpoint").is_dir()

    empty = [*train[:4], str(tmp_path / "empty"), *train[5:]]
    assert main(empty) == 2
    err = capsys.readouterr().err
    assert "--train-only trains on the run's data" in err and "Traceback" not in err
    other = [*train[:7], "float32", *train[8:]]
    assert main(other) == 2
    err = capsys.readouterr().err
    assert "dtype: saved 'float64', now 'float32'" in err and "Traceback" not in err
    with pytest.raises(SystemExit):  # one or the other
        main([*train, "--data-only"])


def test_train_drafter_names_the_bad_line_of_a_prompt_file(capsys, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "ok"}\n{"prompt": ""}\n')
    argv = ["train-drafter", "--output", str(tmp_path / "run"), "--prompts", str(prompts)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "line 2" in err and not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--code", "10000000"], "more code prompts than this Python's standard library gives"),
        (["--math", "-1"], "--math must be a non-negative integer"),
        (["--device", "tpu9"], "unknown device 'tpu9'"),
        (["--time-limit", "0"], "--time-limit must be a number of minutes > 0"),
        (["--eval-samples", "0"], "--eval-samples must be"),
        (["--features", "step", "--l1-weight", "0.5"], "use --features cache"),
        pytest.param(
            ["--device", "cuda"],
            "no CUDA device",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present"),
        ),
    ],
)
def test_train_drafter_arguments_are_checked_before_any_work(capsys, tmp_path, extra, message):
    argv = ["train-drafter", "--output", str(tmp_path / "run"), "--target", str(tmp_path / "no")]
    assert main([*argv, *extra]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and not (tmp_path / "run").exists()


# ---- --compare-ar: warm-up, and the fastest AR as the baseline ------------------------------------


def compare_ar_argv(dirs, *extra):
    """`generate --compare-ar` on the tiny pair, run in float32, dflash, 20 new tokens."""
    target, draft = dirs
    argv = ["generate", "--target", str(target), "--draft", str(draft), "--dtype", "float32"]
    argv += ["--device", "cpu", "--method", "dflash", "--max-new-tokens", "20", "--compare-ar"]
    return [*argv, *extra, "hello there"]


def test_ar_baseline_dtypes_rule():
    from caddtree.util.devices import ar_baseline_dtypes
    from caddtree.util.errors import InvalidInputError

    bf16, fp16, fp32, fp64 = torch.bfloat16, torch.float16, torch.float32, torch.float64
    # on the CPU the other of float32 and half precision; on a GPU bfloat16 for float32 only
    assert ar_baseline_dtypes("bfloat16", "cpu") == [bf16, fp32]
    assert ar_baseline_dtypes(fp16, "cpu", None) == [fp16, fp32]
    assert ar_baseline_dtypes("float32", "cpu") == [fp32, bf16]
    assert ar_baseline_dtypes("float32", "cuda") == [fp32, bf16]
    assert ar_baseline_dtypes("float64", "cpu") == [fp64]
    assert ar_baseline_dtypes("bfloat16", "cuda") == [bf16]
    assert ar_baseline_dtypes("bfloat16", "cpu", "same") == [bf16]
    # an explicit list: the run's dtype first, then the list in order, without duplicates
    assert ar_baseline_dtypes("bf16", "cpu", ["float64", "bfloat16", "fp64", "float32"]) == [
        bf16,
        fp64,
        fp32,
    ]
    assert ar_baseline_dtypes("float32", "cuda", ["float32"]) == [fp32]
    for bad in (["int8"], "fastest", ["float32", "auto"]):
        with pytest.raises(InvalidInputError):
            ar_baseline_dtypes("float32", "cpu", bad)


def test_compare_ar_json_reports_every_ar_dtype_against_the_fastest(capsys, tiny_pair_dirs):
    assert main(compare_ar_argv(tiny_pair_dirs, "--ar-dtypes", "float64", "--json")) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["method"] == "dflash" and out["dtype"] == "float32"
    ar, ar64 = out["ar"], out["ar_float64"]
    assert (ar["method"], ar["dtype"]) == ("ar", "float32")
    assert (ar64["method"], ar64["dtype"]) == ("ar", "float64")
    # the lossless check is against AR in the run's dtype: float32 reproduces it exactly
    assert out["token_ids"] == ar["token_ids"] and out["divergence"] is None
    assert ar64["same_tokens_as_method"] == (ar64["token_ids"] == out["token_ids"])
    assert "same_tokens_as_method" not in ar
    ms = {key: out[key]["stats"]["ms_per_token"] for key in ("ar", "ar_float64")}
    assert all(v > 0 for v in ms.values())
    assert out["baseline"] == min(ms, key=ms.get)
    method_ms = out["stats"]["ms_per_token"]
    assert out["speedup_over_ar"] == ms[out["baseline"]] / method_ms
    assert out["speedup_over_same_dtype_ar"] == ms["ar"] / method_ms
    assert out["speedup_over_ar"] <= out["speedup_over_same_dtype_ar"]


def test_compare_ar_text_names_the_baseline(capsys, tiny_pair_dirs):
    assert main(compare_ar_argv(tiny_pair_dirs, "--ar-dtypes", "float64", "--no-stream")) == 0
    err = capsys.readouterr().err.splitlines()
    ms = {}
    for line in err:
        if line.startswith("["):
            head, _, rest = line.partition("] ")
            ms[head[1:]] = float(rest.split(" ms/token")[0].split()[-1])
    assert set(ms) == {"dflash float32", "ar float32", "ar float64"}
    marked = [line for line in err if line.endswith("<- baseline (fastest AR)")]
    assert len(marked) == 1 and marked[0].startswith("[ar ")
    base = marked[0][1 : marked[0].index("]")]
    other = ({"ar float32", "ar float64"} - {base}).pop()
    assert ms[base] <= ms[other]
    (speed,) = [line for line in err if line.startswith("speed-up of dflash over AR")]
    # "speed-up of dflash over AR, same run: 1.23x against AR in float64, the fastest AR (...)"
    assert f"against AR in {base.split()[1]}, the fastest AR" in speed
    factor = float(speed.split("same run: ")[1].split("x")[0])
    # the printed ms have one decimal: compare with the ratio of the printed numbers, loosely
    assert factor == pytest.approx(ms[base] / ms["dflash float32"], rel=0.1, abs=0.06)
    assert f"against AR in {other.split()[1]})" in speed
    (check,) = [line for line in err if line.startswith("lossless check against AR in float32: ")]
    assert "identical output" in check and "AR in float64 gives" in check
    # every timed run's ms/token, and the shown ones are the medians
    (timing,) = [line for line in err if line.startswith("each run timed 3 times")]
    for name, shown in ms.items():
        every = [float(x) for x in timing.split(name + " ")[1].split(";")[0].rstrip(")").split()]
        assert len(every) == 3 and sorted(every)[1] == shown


def test_compare_ar_on_cpu_adds_a_float32_baseline_for_bfloat16(capsys, tiny_pair_dirs):
    argv = compare_ar_argv(tiny_pair_dirs, "--json")
    argv[argv.index("float32")] = "bfloat16"
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["dtype"] == "bfloat16" and out["ar"]["dtype"] == "bfloat16"
    assert out["ar_float32"]["dtype"] == "float32"
    assert out["baseline"] in ("ar", "ar_float32")
    # the divergence report (if any) is about AR in bfloat16, the lossless reference
    assert out["divergence"] is None or out["divergence"]["dtype"] == "bfloat16"
    assert (out["divergence"] is None) == (out["token_ids"] == out["ar"]["token_ids"])
    # --ar-dtypes same: no float32 copy
    assert main([*argv[:-1], "--ar-dtypes", "same", argv[-1]]) == 0
    out = json.loads(capsys.readouterr().out)
    assert "ar_float32" not in out and out["baseline"] == "ar"
    assert out["speedup_over_ar"] == out["speedup_over_same_dtype_ar"]


def test_compare_ar_warms_up_every_run_before_timing(capsys, tiny_pair_dirs, monkeypatch):
    from caddtree import SpeculativeGenerator

    original = SpeculativeGenerator.generate
    calls = []

    def generate(self, prompt, method="caddtree", **kwargs):
        calls.append((method, str(self.verifier.dtype), kwargs["max_new_tokens"], prompt))
        return original(self, prompt, method, **kwargs)

    monkeypatch.setattr(SpeculativeGenerator, "generate", generate)
    assert main(compare_ar_argv(tiny_pair_dirs, "--ar-dtypes", "float64", "--json")) == 0
    out = json.loads(capsys.readouterr().out)
    p = "hello there"
    warm = [("dflash", "torch.float32", 8, p), ("ar", "torch.float32", 8, p)]
    warm.append(("ar", "torch.float64", 8, p))
    timed = [(m, d, 20, p) for m, d, _, _ in warm]
    # then three timed repeats (the default), the order reversed on the second
    assert calls == warm + timed + timed[::-1] + timed
    assert len(out["token_ids"]) == len(out["ar_float64"]["token_ids"]) == 20
    assert out["repeats"] == 3
    every = out["ms_per_token_runs"]
    assert set(every) == {"method", "ar", "ar_float64"}
    # each reported run is the median one of its repeats
    assert all(len(ms) == 3 for ms in every.values())
    for key, record in (("method", out), ("ar", out["ar"]), ("ar_float64", out["ar_float64"])):
        assert record["stats"]["ms_per_token"] == sorted(every[key])[1]
    # --repeats 2: the lower of the two middle runs, and the order alternates once
    calls.clear()
    argv = compare_ar_argv(tiny_pair_dirs, "--ar-dtypes", "float64", "--json", "--repeats", "2")
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert calls == warm + timed + timed[::-1]
    assert out["repeats"] == 2
    assert out["stats"]["ms_per_token"] == min(out["ms_per_token_runs"]["method"])
    # without --compare-ar nothing is timed against anything: no warm-up
    calls.clear()
    argv = compare_ar_argv(tiny_pair_dirs, "--json")
    argv.remove("--compare-ar")
    assert main(argv) == 0
    capsys.readouterr()
    assert calls == [("dflash", "torch.float32", 20, p)]


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--method", "ar", "--ar-dtypes", "float32"], "only applies with --compare-ar"),
        (["--method", "dflash", "--repeats", "2"], "--repeats only applies with --compare-ar"),
        (["--method", "dflash", "--compare-ar", "--repeats", "0"], "--repeats must be"),
        (["--method", "dflash", "--compare-ar", "--ar-dtypes", "int8"], "unknown dtype"),
        (["--method", "dflash", "--compare-ar", "--ar-dtypes", "float32,same"], "cannot be mixed"),
    ],
)
def test_compare_ar_dtype_errors(capsys, tiny_pair_dirs, extra, message):
    assert message in failing_generate(capsys, tiny_pair_dirs, *extra, "hi")


# ---- issue 14: bad input gets a clear answer, and cheap checks come before any model load ----------


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--method", "ddtree", "--budget", "0"], "--budget must be a positive integer, got 0"),
        (["--method", "ddtree", "--budget", "1000000"], "above the limit of 4096 nodes"),
        (["--max-budget", "100000"], "--max-budget 100000 is above the limit of 4096"),
        (["--method", "ar", "--temperature", "1e-320"], "use 0 for greedy decoding"),
        (["--method", "ar", "--seed", "-1"], "seed must be an integer"),
        (["--cost-model", "/no/such/cost.json"], "cost-model file not found"),
        (["--context-window", "1"], "--context-window must be an integer >= 2, got 1"),
    ],
)
def test_cheap_checks_come_before_loading_any_model(capsys, tmp_path, extra, message):
    """The target does not exist: each argument error must be found before anyone looks."""
    missing = str(tmp_path / "no-such-target")
    argv = ["generate", "--target", missing, "--draft", missing, *extra, "hi"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and "no such directory" not in err


def test_a_prompt_that_is_not_utf8_is_refused_before_loading(capsys, tmp_path):
    prompt = b"caf\xe9 \xff".decode("utf-8", "surrogateescape")  # how Python keeps such an argv
    missing = str(tmp_path / "no-such-target")
    assert main(["generate", "--target", missing, "--method", "ar", prompt]) == 2
    err = capsys.readouterr().err
    assert "not valid UTF-8 text (byte 0xe9 at character 3)" in err and "Traceback" not in err


def test_a_missing_local_model_is_no_such_directory(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models").mkdir()
    assert main(["generate", "--target", "models/missing", "--method", "ar", "hi"]) == 2
    assert "cannot load the target model 'models/missing': no such directory" in (
        capsys.readouterr().err
    )


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--block-size", "0"], "--block-size must be between 2 and 64"),
        (["--block-size", "100000"], "--block-size must be between 2 and 64"),
        (["--vocab", "0"], "--vocab must be between 60"),
        (["--vocab", "10000000"], "--vocab must be between 60"),
        (["--rounds", "-1"], "--rounds and --seed must be non-negative"),
        (["--seed", "-3"], "--rounds and --seed must be non-negative"),
    ],
)
def test_tree_demo_refuses_impossible_sizes(capsys, extra, message):
    assert main(["tree-demo", *extra]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_tree_demo_runs_on_the_smallest_block(capsys):
    assert main(["tree-demo", "--rounds", "2", "--block-size", "2", "--vocab", "4"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if "|" in line]
    assert len(rows) == 3  # the header and two rounds


def test_a_closed_pipe_ends_quietly():
    """`caddtree ... | head`: the reader is gone before anything is written."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "caddtree.cli", "tree-demo", "--rounds", "3", "--vocab", "500"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141  # as a process ended by SIGPIPE
    assert err == ""


def test_importing_the_cli_loads_no_torch():
    """Everything slow is imported inside main(), where Ctrl-C is caught."""
    code = "import sys, caddtree.cli; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize(
    "argv",
    [["--help"], ["generate", "--help"], ["tree-demo", "--rounds", "2", "--vocab", "300"]],
)
def test_help_and_tree_demo_load_no_torch(argv):
    """`caddtree --help`, a sub-command's help and the numpy-only tree demo answer without
    torch (issue 11 §4): the parser takes its choices from caddtree.util.checks, not from decoding."""
    code = (
        "import sys, contextlib, io\n"
        "from caddtree.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
        f"    status = main({argv!r})\n"
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stderr


def test_ctrl_c_while_starting_up_is_one_line(capsys, monkeypatch):
    import caddtree.cli

    def interrupted():
        raise KeyboardInterrupt

    monkeypatch.setattr(caddtree.cli, "_build_parser", interrupted)
    try:
        status = main(["tree-demo"])
    except KeyboardInterrupt:
        pytest.fail("a Ctrl-C while the command line was being set up escaped main()")
    assert status == 130
    assert capsys.readouterr().err == "caddtree: interrupted\n"


def test_a_ctrl_c_that_a_library_swallows_still_stops_with_130(capsys):
    """An interrupt caught by code that catches everything (as some imports do) still ends the
    command as interrupted once it returns, and Python's own Ctrl-C handler is put back."""
    import os
    import signal
    import time

    from caddtree.util.logs import run_command

    def swallowing_command() -> int:
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)  # the handler runs here, in the main thread
        except BaseException:  # noqa: BLE001 - what the library under test would do
            pass
        return 0

    # a shell's background job starts with SIGINT ignored; give this test Python's own handler
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        assert run_command(swallowing_command) == 130
        assert capsys.readouterr().err.endswith("caddtree: interrupted\n")
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        assert run_command(lambda: 0) == 0  # no interrupt: the command's own status
    finally:
        signal.signal(signal.SIGINT, before)


def test_ctrl_c_in_the_first_second_prints_no_traceback(tiny_pair_dirs):
    import signal
    import time

    target, draft = tiny_pair_dirs
    argv = ["generate", "--target", str(target), "--draft", str(draft), "--dtype", "float64", "hi"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "caddtree.cli", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # as from a terminal, even where this suite runs as a background job (SIGINT ignored)
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    # interrupt while torch is being imported (inside main, past Python's own start-up): wait
    # until its library is mapped, rather than a fixed time that a loaded machine outlasts
    maps = f"/proc/{proc.pid}/maps"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with open(maps, encoding="utf-8", errors="replace") as fh:
                if "libtorch" in fh.read():
                    break
        except OSError:  # not Linux: fall back to a fixed wait
            time.sleep(0.8)
            break
        time.sleep(0.01)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "Traceback" not in err and err.strip().endswith("caddtree: interrupted")


def test_compare_ar_runs_every_baseline_under_the_raised_context_window(capsys, tiny_pair_dirs):
    """--context-window applies to the AR baselines loaded for --compare-ar too (the tiny target
    holds 64 positions; prompt + 62 new tokens pass it)."""
    extra = ["--max-new-tokens", "62", "--context-window", "128", "--ar-dtypes", "float64"]
    assert main(compare_ar_argv(tiny_pair_dirs, *extra, "--json")) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["prompt_tokens"] + 62 > 64  # the request does not fit the model's own window
    assert out["ar"]["token_ids"] == out["token_ids"]  # lossless past the window
    assert out["ar_float64"]["stats"]["new_tokens"] >= 1


def test_train_drafter_adds_second_turns_of_its_conversations(
    capsys, tiny_pair_dirs, tmp_path, monkeypatch
):
    """--followups N: the target writes the next user message of the first N finished
    conversations of the data, and the kept ones become three-message prompts whose responses
    are appended; a second run with the same options changes nothing. (The tiny target writes
    gibberish that Magpie's filter, tested on its own, would drop: here it keeps every message.)"""
    from transformers import AutoTokenizer

    from caddtree.train import TrainingData, followups
    from caddtree.train.magpie import MagpieFilterReport

    def keep_all(records):
        kept = [i for i, r in enumerate(records) if r["query"]]
        return MagpieFilterReport([records[i]["query"] for i in kept], kept_records=kept)

    monkeypatch.setattr(followups, "filter_queries", keep_all)

    target, _ = tiny_pair_dirs
    prompts = ten_prompts(tmp_path)
    out = tmp_path / "run"
    argv = ["train-drafter", "--target", str(target), "--output", str(out), "--data-only"]
    argv += ["--sharegpt", "0", "--code", "0", "--math", "0", "--dtype", "float64"]
    argv += ["--max-new-tokens", "48", "--prompts", str(prompts), "--followups", "4"]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "follow-ups:" in err
    data = TrainingData.load(out / "data.safetensors")
    tokenizer = AutoTokenizer.from_pretrained(target)
    records = [json.loads(x) for x in (out / "followups_raw.jsonl").read_text().splitlines()]
    assert 0 < len(records) <= 4 and len(data.sequences) == 10 + len(records)
    chats = followups.conversations(
        TrainingData(data.sequences[:10], data.prompt_lengths[:10], data.meta), tokenizer, 4
    )
    assert len(chats) == len(records)
    for k, (chat, record) in enumerate(zip(chats, records)):
        prompt = tokenizer.decode(data.sequences[10 + k][: data.prompt_lengths[10 + k]])
        question, answer, query = chat[0]["content"], chat[1]["content"], record["query"]
        assert question and answer and query and record["conversation"] == k
        # the first turn, its answer, then the sampled message, in that order
        assert prompt.index(question) < prompt.index(answer) < prompt.rindex(query)
    before = (out / "data.safetensors").read_bytes()
    assert main(argv) == 0
    assert (out / "data.safetensors").read_bytes() == before
