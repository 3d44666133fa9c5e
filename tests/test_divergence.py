"""Explaining why a method's greedy output differs from AR's (``generate --compare-ar``)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from caddtree import InvalidInputError
from caddtree.api import SpeculativeGenerator
from caddtree.bench.divergence import NEAR_TIE_ULPS, explain_divergence, near_tie_threshold
from caddtree.cli import main
from tiny_models import MASK_TOKEN_ID, VOCAB, new_drafter, qwen3_target
from tiny_tokenizer import tiny_tokenizer

PROMPT = [5, 17, 3, 44, 8, 21, 30]
N_NEW = 12


def make_gen(dtype=torch.float64, tie=None):
    """A tiny generator; ``tie=(a, b)`` copies lm_head row ``a`` onto row ``b`` so that tokens
    ``a`` and ``b`` always get exactly the same logit."""
    target = qwen3_target()
    if tie is not None:
        with torch.no_grad():
            target.lm_head.weight[tie[1]] = target.lm_head.weight[tie[0]]
    drafter = new_drafter(target)
    return SpeculativeGenerator(target.to(dtype), tiny_tokenizer(MASK_TOKEN_ID), drafter.to(dtype))


@pytest.fixture(scope="module")
def gen():
    return make_gen()


def ar_ids(gen):
    return gen.generate(PROMPT, "ar", max_new_tokens=N_NEW, stop_token_ids=()).token_ids


@torch.no_grad()
def plain_logits(gen, ids):
    """The target's next-token logits after ``ids`` from one ordinary causal forward, no cache."""
    return gen.target(input_ids=torch.tensor([ids])).logits[0, -1].double()


def top2_gap(logits):
    top = torch.topk(logits, 2).values
    return float(top[0] - top[1])


def test_identical_outputs_give_no_report(gen):
    ar = ar_ids(gen)
    assert explain_divergence(gen, PROMPT, ar, list(ar)) is None
    # and the real thing: a float64 speculative run is AR token for token, so no report either
    dflash = gen.generate(PROMPT, "dflash", max_new_tokens=N_NEW, stop_token_ids=()).token_ids
    assert dflash == ar
    assert explain_divergence(gen, PROMPT, ar, dflash, method="dflash") is None


def test_a_flipped_token_is_located_and_measured(gen):
    ar = ar_ids(gen)
    p = 5
    reference = plain_logits(gen, PROMPT + ar[:p])
    assert int(reference.argmax()) == ar[p]
    runner_up = int(torch.topk(reference, 2).indices[1])
    method = ar[:p] + [runner_up] + ar[p + 1 :]

    div = explain_divergence(gen, PROMPT, ar, method, method="ddtree", tree_nodes=20)
    assert div is not None
    assert (div.position, div.ar_token, div.method_token) == (p, ar[p], runner_up)
    assert div.ar_text == gen.tokenizer.decode([ar[p]])
    assert div.method_text == gen.tokenizer.decode([runner_up])
    expected = top2_gap(reference)
    assert expected > 0
    for gap in (div.ar_top2_gap, div.tree_top2_gap, div.ar_pair_gap):
        assert math.isfinite(gap)
        assert gap == pytest.approx(expected, rel=1e-9)  # float64: every forward agrees
    assert div.ar_top_logit == pytest.approx(float(reference.max()), rel=1e-9)
    assert div.ar_replay_token == div.tree_token == ar[p]
    assert div.tree_queries == 20 + 1  # padded to the requested tree size, plus the bonus
    # a float64 difference is never a rounding artefact
    assert div.dtype == "float64" and not div.near_tie and "likely a bug" in div.verdict
    text = div.describe()
    assert f"first difference at generated token {p}" in text and div.verdict in text
    assert "it picks AR's token" in text
    assert json.loads(json.dumps(div.to_dict()))["method_token"] == runner_up


def test_pair_gap_is_measured_against_the_method_token(gen):
    ar = ar_ids(gen)
    p = 2
    reference = plain_logits(gen, PROMPT + ar[:p])
    worst = int(reference.argmin())
    div = explain_divergence(gen, PROMPT, ar, ar[:p] + [worst], window=3)
    assert div.position == p and div.method_token == worst
    assert div.ar_pair_gap == pytest.approx(float(reference.max() - reference.min()), rel=1e-9)
    assert div.ar_top2_gap == pytest.approx(top2_gap(reference), rel=1e-9)
    assert div.tree_queries == 3 + 2  # the window's 3 tokens and both candidates below them
    assert f"over method's: {div.ar_pair_gap:.4g}" in div.describe()


def test_an_output_that_stops_early(gen):
    ar = ar_ids(gen)
    div = explain_divergence(gen, PROMPT, ar, ar[:7])
    assert div.position == 7 and div.ar_token == ar[7] and div.method_token is None
    assert div.ar_top2_gap == pytest.approx(top2_gap(plain_logits(gen, PROMPT + ar[:7])), rel=1e-9)
    assert "(end of output)" in div.describe()


def test_the_cache_is_left_empty(gen):
    ar = ar_ids(gen)
    explain_divergence(gen, PROMPT, ar, ar[:3] + [(ar[3] + 1) % VOCAB])
    assert gen.verifier.context_length == 0
    assert ar_ids(gen) == ar  # the generator still works and is unchanged


def test_bad_arguments(gen):
    with pytest.raises(InvalidInputError, match="prompt is empty"):
        explain_divergence(gen, [], [1], [2])
    with pytest.raises(InvalidInputError, match="window"):
        explain_divergence(gen, PROMPT, [1], [2], window=0)
    with pytest.raises(InvalidInputError, match="floating-point"):
        near_tie_threshold(torch.int64, 1.0)


def test_near_tie_threshold_is_a_few_ulps_of_the_top_logit():
    assert near_tie_threshold(torch.bfloat16, 20.0) == NEAR_TIE_ULPS * 2**-7 * 20.0
    assert near_tie_threshold(torch.bfloat16, -20.0) == near_tie_threshold(torch.bfloat16, 20.0)
    assert near_tie_threshold(torch.bfloat16, 0.01) == NEAR_TIE_ULPS * 2**-7  # floor at |x| = 1
    assert near_tie_threshold(torch.float16, 20.0) == NEAR_TIE_ULPS * 2**-10 * 20.0
    assert near_tie_threshold(torch.float32, 20.0) < 1e-4


def tied_divergence(dtype):
    """A divergence at an exact tie: lm_head rows of two tokens are equal, AR takes one of them
    and the 'method' the other."""
    a = ar_ids(make_gen(dtype))[4]  # the tie changes nothing before AR first picks a or b
    b = (a + 7) % VOCAB
    gen = make_gen(dtype, tie=(a, b))
    ar = ar_ids(gen)
    p = next(i for i, t in enumerate(ar) if t in (a, b))
    other = b if ar[p] == a else a
    return explain_divergence(gen, PROMPT, ar, ar[:p] + [other] + ar[p + 1 :]), p, ar[p], other


def test_a_bfloat16_tie_is_called_a_near_tie_and_a_float64_one_a_bug():
    div, p, ar_token, other = tied_divergence(torch.bfloat16)
    assert (div.position, div.ar_token, div.method_token) == (p, ar_token, other)
    assert div.dtype == "bfloat16"
    assert abs(div.ar_pair_gap) <= div.threshold
    assert div.threshold == near_tie_threshold(torch.bfloat16, div.ar_top_logit)
    assert div.near_tie and div.verdict.startswith("bfloat16 near-tie: not a bug")

    div64, *_ = tied_divergence(torch.float64)
    assert div64.ar_pair_gap == 0.0
    assert not div64.near_tie and "likely a bug" in div64.verdict


def test_a_large_bfloat16_gap_is_a_real_discrepancy():
    gen = make_gen(torch.bfloat16)
    ar = ar_ids(gen)
    p = 3
    reference = plain_logits(gen, PROMPT + ar[:p])
    worst = int(reference.argmin())
    div = explain_divergence(gen, PROMPT, ar, ar[:p] + [worst])
    assert div.ar_pair_gap > div.threshold
    # bf16 forwards of different shapes (and compiled against eager) agree to within rounding
    assert div.ar_pair_gap == pytest.approx(float(reference.max() - reference.min()), abs=0.25)
    assert not div.near_tie and div.verdict.startswith("real discrepancy")


# ---- the command line ------------------------------------------------------------------------------


def compare_ar_argv(generate_argv, *options):
    """``caddtree generate --method dflash --compare-ar`` on the tiny pair, greedy, 16 tokens."""
    return generate_argv(
        "--method", "dflash", "--compare-ar", "--max-new-tokens", "16", *options, "hello"
    )


def test_cli_json_has_no_divergence_when_outputs_match(capsys, generate_argv):
    assert main(compare_ar_argv(generate_argv, "--json")) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["token_ids"] == out["ar"]["token_ids"]
    assert "divergence" in out and out["divergence"] is None


def test_cli_reports_a_divergence(capsys, generate_argv, monkeypatch):
    """Make the speculative run's output differ from AR's and check what the user is told."""
    original = SpeculativeGenerator.generate
    flipped = {}

    def generate(self, prompt, method="caddtree", **kwargs):
        result = original(self, prompt, method, **kwargs)
        if method != "ar":
            p = len(result.token_ids) // 2
            flipped.update(position=p, ar_token=result.token_ids[p])
            result.token_ids[p] = (result.token_ids[p] + 1) % MASK_TOKEN_ID
            flipped["method_token"] = result.token_ids[p]
        return result

    monkeypatch.setattr(SpeculativeGenerator, "generate", generate)
    assert main(compare_ar_argv(generate_argv, "--json")) == 0
    report = json.loads(capsys.readouterr().out)["divergence"]
    assert {k: report[k] for k in flipped} == flipped
    assert report["method"] == "dflash" and report["dtype"] == "float64"
    assert math.isfinite(report["ar_top2_gap"]) and math.isfinite(report["tree_top2_gap"])
    assert "likely a bug" in report["verdict"]

    assert main(compare_ar_argv(generate_argv, "--no-stream")) == 0
    err = capsys.readouterr().err
    assert "(outputs differ)" in err
    assert f"first difference at generated token {flipped['position']}" in err
    assert "top-2 logit gap there" in err and "likely a bug" in err
