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
        ("ddtree", ["--budget", "8"]),
        ("caddtree", ["--cost-model", cost_file]),
    ]:
        out = generate_json(capsys, tiny_pair_dirs, "--method", method, *extra, "hello there")
        assert out["method"] == method
        assert isinstance(out["text"], str) and len(out["token_ids"]) >= 1
        stats = out["stats"]
        for key in ("tau", "ms_per_token", "rounds", "budget_mean", "budget_std"):
            assert isinstance(stats[key], (int, float)), key
        assert stats["ms_per_token"] > 0 and stats["rounds"] >= 1
        outputs[method] = out["token_ids"]
    assert outputs["dflash"] == outputs["ar"]
    assert outputs["ddtree"] == outputs["ar"]
    assert outputs["caddtree"] == outputs["ar"]


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
