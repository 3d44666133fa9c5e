"""Sampling controls, stop strings and generation statistics.

The sampler is transformers' own logits processors, so every method must choose exactly the
tokens ``model.generate`` chooses (greedy, with a repetition penalty) and sample from exactly the
distribution it samples from (temperature, top-k, top-p, min-p, repetition penalty), with each tree
node's own path as context. Stop strings end the output where ``generate(stop_strings=...)`` does.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from transformers import (
    GenerationConfig,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    StoppingCriteriaList,
    StopStringCriteria,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from caddtree import InvalidInputError, SpeculativeGenerator
from caddtree.cli import main
from caddtree.core.sampling import Sampler
from caddtree.engine.decoding import decode, make_policy
from caddtree.models import DFlashProposer
from caddtree.models.drafts import DraftLogits
from oracle import OracleProposer, decode_with
from sampling_checks import (
    MARGINAL_PROMPT,
    MARGINAL_SETTINGS,
    METHODS,
    allowed_sets,
    assert_three_token_marginals,
    char_stop,
    hf_generate,
    marginal_target,
    sharp_qwen3,
)
from tiny_models import MASK_TOKEN_ID, VOCAB
from tiny_tokenizer import tiny_tokenizer

PROMPTS = [[5, 17, 3, 44, 8], [70, 2, 2, 9, 31, 12, 60, 1, 0, 33]]


def run(model, prompt, method, kwargs, proposer, max_new_tokens, sampler, criteria=None, **options):
    """Decode with :func:`decode_with` (no drafter for AR)."""
    proposer = proposer if method != "ar" else None
    return decode_with(
        model,
        prompt,
        method,
        kwargs,
        proposer,
        max_new_tokens,
        sampler=sampler,
        stopping_criteria=criteria,
        **options,
    )


# ---- the sampler is transformers' processors, in transformers' order -------------------------------


def test_the_sampler_builds_the_processors_generate_builds(qwen3):
    """Scores equal those of the processor list ``generate`` prepares for the same settings."""
    settings = {
        "temperature": 0.7,
        "top_k": 9,
        "top_p": 0.8,
        "min_p": 0.05,
        "repetition_penalty": 1.4,
    }
    config = GenerationConfig(do_sample=True, **settings)
    prepared = qwen3._get_logits_processor(generation_config=config, input_ids_seq_length=5)
    assert [type(p) for p in prepared] == [
        RepetitionPenaltyLogitsProcessor,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
        MinPLogitsWarper,
    ]
    ours = Sampler(**settings)
    assert [type(p) for p in ours.processors] == [type(p) for p in prepared]
    wrapped = Sampler.from_processors(prepared, do_sample=True)
    gen = torch.Generator().manual_seed(0)
    for _ in range(5):
        context = torch.randint(0, VOCAB, (1, 12), generator=gen)
        logits = 3 * torch.randn(VOCAB, generator=gen, dtype=torch.float64)
        expected = prepared(context, logits[None].float())[0]
        assert torch.equal(ours.scores(logits, context), expected)
        assert torch.equal(wrapped.scores(logits, context[0].tolist()), expected)
    # nothing to process: plain greedy decoding and plain sampling need no context
    assert Sampler().processors == () and not Sampler().needs_context
    assert Sampler(1.0, seed=1).processors == ()
    # greedy decoding ignores the sampling warpers, as generate(do_sample=False) does
    assert [type(p) for p in Sampler(0.0, 0.5, top_k=3, repetition_penalty=1.2).processors] == [
        RepetitionPenaltyLogitsProcessor
    ]
    with pytest.raises(ValueError, match="need the context"):
        Sampler(repetition_penalty=1.2).choose(logits)


@pytest.mark.parametrize("prompt", PROMPTS, ids=["p5", "p10"])
def test_greedy_with_a_repetition_penalty_equals_generate(qwen3, drafter, prompt, verifier_type):
    n_new = 30
    penalty = 1.3
    reference = hf_generate(qwen3, prompt, n_new, do_sample=False, repetition_penalty=penalty)
    plain = hf_generate(qwen3, prompt, n_new, do_sample=False)
    assert reference != plain  # the penalty changes the output: the test has teeth
    oracle_accepted = 0
    for method, kwargs in METHODS:
        for kind in ("dflash", "oracle"):
            if kind == "dflash":
                proposer = DFlashProposer(drafter, qwen3)
            else:  # drafts greedy decoding's continuation with the penalty: deep acceptance
                proposer = OracleProposer(
                    qwen3, prompt, processors=[RepetitionPenaltyLogitsProcessor(penalty)]
                )
            sampler = Sampler(repetition_penalty=penalty)
            result = run(
                qwen3, prompt, method, kwargs, proposer, n_new, sampler, verifier_type=verifier_type
            )
            assert result.token_ids == reference, (method, kind)
            if kind == "oracle":
                oracle_accepted += result.stats.accepted_tokens
    assert oracle_accepted > 2 * n_new  # most tokens were chosen deep inside trees
    # the processors transformers prepares for generate(), wrapped, give the same output
    config = GenerationConfig(do_sample=False, repetition_penalty=penalty)
    prepared = qwen3._get_logits_processor(generation_config=config, input_ids_seq_length=5)
    sampler = Sampler.from_processors(prepared, do_sample=False)
    proposer = OracleProposer(qwen3, prompt, processors=prepared)
    result = run(qwen3, prompt, "ddtree", {"budget": 8}, proposer, n_new, sampler)
    assert result.token_ids == reference


# ---- sampled tokens: in the allowed set, and distributed as the target's --------------------------


@pytest.mark.parametrize(
    "settings",
    [
        {"temperature": 1.0, "top_k": 3},
        {"temperature": 1.0, "top_p": 0.5},
        {"temperature": 1.0, "min_p": 0.2},
        {"temperature": 0.8, "top_k": 6, "top_p": 0.8, "min_p": 0.1, "repetition_penalty": 1.2},
    ],
    ids=["top_k", "top_p", "min_p", "all"],
)
def test_sampled_tokens_lie_in_the_set_the_warpers_allow(settings):
    model = sharp_qwen3()
    prompt = [5, 17, 3]
    processors = [
        RepetitionPenaltyLogitsProcessor(settings.get("repetition_penalty", 1.0)),
        TemperatureLogitsWarper(settings["temperature"]),
        TopKLogitsWarper(settings.get("top_k", VOCAB)),
        TopPLogitsWarper(settings.get("top_p", 1.0)),
        MinPLogitsWarper(settings.get("min_p", 0.0)),
    ]
    sizes, accepted = [], 0
    for seed in range(3):
        proposer = OracleProposer(model, prompt, block_size=4, mode="target")
        sampler = Sampler(**settings, seed=seed)
        result = run(model, prompt, "ddtree", {"budget": 12}, proposer, 40, sampler)
        accepted += result.stats.accepted_tokens
        for i, (token, allowed) in enumerate(
            zip(result.token_ids, allowed_sets(model, prompt, result.token_ids, processors))
        ):
            assert token in allowed, (seed, i)
            sizes.append(len(allowed))
    assert accepted > 20  # most tokens came from walking the tree, not from the bonus row alone
    assert np.mean(sizes) < VOCAB / 8  # the allowed sets are small: the check has teeth


class UniformProposer:
    """Drafts every token of the vocabulary as equally likely at each position, so a DDTree with
    a budget of the vocabulary size holds every depth-1 continuation: the walk always accepts one
    node, and the round's second token is chosen at that node's row."""

    context_length = 0

    def __init__(self, vocab, block_size=2):
        self.rows = torch.zeros(block_size - 1, vocab, dtype=torch.float64)

    def propose(self, bonus, features):
        return DraftLogits.precomputed(self.rows)

    def reset(self):
        pass

    def crop(self, length):
        pass


def test_sampled_tokens_are_distributed_as_the_processed_target(verifier_type):
    """2,000 generations of three tokens through a DDTree; each token's marginal against the exact
    one under transformers' processors with the right context, chi-square at alpha = 1e-3.

    The first token comes from the prefill, the second from the bonus row, the third from the
    row of the accepted tree node (context: prompt, token 1, and the node's token 2). The same
    check must reject two wrong distributions: the unprocessed target, and the processed target
    that forgets the node's own token in the context (the repetition penalty's context)."""
    vocab = 16
    model, prompt = marginal_target(vocab), MARGINAL_PROMPT
    verifier = verifier_type(model, ())
    policy = make_policy("ddtree", budget=vocab)
    n = 2000
    counts = np.zeros((3, vocab))
    sampler, proposer = Sampler(**MARGINAL_SETTINGS, seed=0), UniformProposer(vocab)
    for _ in range(n):
        result = decode(
            verifier, prompt, policy, proposer=proposer, max_new_tokens=3, sampler=sampler
        )
        assert result.stats.per_round[0].accepted == 1
        for k, token in enumerate(result.token_ids):
            counts[k, token] += 1
    assert_three_token_marginals(model, prompt, counts, Sampler(**MARGINAL_SETTINGS))


# ---- stop strings ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gen(tiny_pair_dirs):
    target, draft = tiny_pair_dirs
    return SpeculativeGenerator.from_pretrained(target, draft, dtype="float64", device="cpu")


def test_stop_strings_end_the_output_where_generate_does(gen):
    n_new = 40
    prompt_ids = gen.encode("hello there")
    free = gen.generate(prompt_ids, method="ar", max_new_tokens=n_new).token_ids
    assert len(free) == n_new
    stop, _ = char_stop(gen.tokenizer, free, 8)
    never = "\n\n\n\n"
    for stops in ([stop], [never, stop], stop, [never]):
        reference = hf_generate(
            gen.target,
            prompt_ids,
            n_new,
            do_sample=False,
            stop_strings=stops,
            tokenizer=gen.tokenizer,
            eos_token_id=gen.tokenizer.eos_token_id,
        )
        cut = stops != [never]
        assert (len(reference) < n_new) == cut
        if cut:
            assert gen.tokenizer.decode(reference).endswith(stop)
        for method, kwargs in METHODS:
            result = gen.generate(
                prompt_ids, method=method, max_new_tokens=n_new, stop=stops, **kwargs
            )
            assert result.token_ids == reference, (method, stops)
            assert result.stats.stop_reason == ("stop_string" if cut else "max_new_tokens")
            assert result.text == gen.tokenizer.decode(reference, skip_special_tokens=True)
    # other criteria of transformers' form pass through generate() too
    result = gen.generate(
        prompt_ids,
        method="dflash",
        max_new_tokens=n_new,
        stopping_criteria=lambda ids, scores: ids.shape[1] >= len(prompt_ids) + 5,
    )
    assert result.token_ids == free[:5] and result.stats.stop_reason == "stopping_criteria"


def test_a_stop_string_inside_an_accepted_path_and_at_the_first_token(qwen3):
    tokenizer = tiny_tokenizer(MASK_TOKEN_ID)
    prompt = PROMPTS[1]  # its greedy output is mostly characters the tokenizer knows
    free = hf_generate(qwen3, prompt, 30, do_sample=False)
    stop, position = char_stop(tokenizer, free, 7)
    reference = hf_generate(
        qwen3, prompt, 30, do_sample=False, stop_strings=stop, tokenizer=tokenizer
    )
    assert len(reference) <= position + 1
    cut_inside_tree = []
    for method, kwargs in METHODS:
        criteria = StoppingCriteriaList([StopStringCriteria(tokenizer, [stop])])
        proposer = OracleProposer(qwen3, prompt)
        result = run(qwen3, prompt, method, kwargs, proposer, 30, Sampler(), criteria)
        assert result.token_ids == reference, method
        assert result.stats.stop_reason == "stop_string"
        last = result.stats.per_round[-1]
        cut_inside_tree.append(last.accepted + 1 > last.committed)
    assert any(cut_inside_tree)  # the oracle drafted past the stop: it was cut inside a path
    # a stop string completed by the prefill's token: no round at all
    first = tokenizer.convert_ids_to_tokens(free[0])
    result = run(
        qwen3,
        prompt,
        "dflash",
        {},
        OracleProposer(qwen3, prompt),
        30,
        Sampler(),
        [StopStringCriteria(tokenizer, [first])],
    )
    assert result.token_ids == free[:1] and result.stats.rounds == 0
    assert result.stats.stop_reason == "stop_string"
    # any callable criterion of transformers' form works; its stop reason is generic
    result = run(
        qwen3,
        prompt,
        "ddtree",
        {"budget": 8},
        OracleProposer(qwen3, prompt),
        30,
        Sampler(),
        lambda ids, scores: ids.shape[1] >= len(prompt) + 7,
    )
    assert result.token_ids == free[:7] and result.stats.stop_reason == "stopping_criteria"


# ---- statistics -----------------------------------------------------------------------------------


def test_statistics_agree_with_the_rounds(qwen3):
    prompt = PROMPTS[1]
    proposer = OracleProposer(qwen3, prompt, mode="noisy", noise=2.0)
    result = run(qwen3, prompt, "ddtree", {"budget": 16}, proposer, 40, Sampler())
    s = result.stats
    rounds = s.per_round
    assert s.draft_tokens == sum(r.budget for r in rounds) > 0
    assert s.accepted_tokens == sum(r.accepted for r in rounds) > 0
    assert s.draft_acceptance_rate == pytest.approx(s.accepted_tokens / s.draft_tokens)
    deepest = max(r.accepted for r in rounds)
    assert len(s.accepted_per_position) == deepest >= 2
    for k, count in enumerate(s.accepted_per_position, start=1):
        assert count == sum(r.accepted >= k for r in rounds)
    assert sum(s.accepted_per_position) == s.accepted_tokens
    assert list(s.accepted_per_position) == sorted(s.accepted_per_position, reverse=True)
    assert s.mean_acceptance_length == s.tau == pytest.approx((s.new_tokens - 1) / s.rounds)
    assert s.ttft_s == s.prefill_s and 0 < s.ttft_s < s.wall_s
    assert s.decode_tokens_per_s == pytest.approx((s.new_tokens - 1) / (s.wall_s - s.ttft_s))
    out = json.loads(json.dumps(s.to_dict(per_round=True)))
    for key in (
        "ttft_s",
        "decode_tokens_per_s",
        "mean_acceptance_length",
        "draft_tokens",
        "accepted_tokens",
        "draft_acceptance_rate",
        "accepted_per_position",
    ):
        assert out[key] == getattr(s, key), key
    # AR drafts nothing; a single token has no decode phase
    ar = run(qwen3, prompt, "ar", {}, None, 5, Sampler()).stats
    assert ar.draft_tokens == ar.accepted_tokens == 0 and ar.draft_acceptance_rate == 0.0
    assert ar.accepted_per_position == [] and ar.tau == 1.0
    one = run(qwen3, prompt, "ar", {}, None, 1, Sampler()).stats
    assert one.rounds == 0 and one.decode_tokens_per_s is None and one.ttft_s > 0


# ---- bad values -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"top_k": -1}, "top_k must be an integer >= 0"),
        ({"top_k": 2.5}, "top_k must be an integer >= 0"),
        ({"top_k": True}, "top_k must be an integer >= 0"),
        ({"min_p": 1.5}, r"min_p must be a number in \[0, 1\)"),
        ({"min_p": 1.0}, r"min_p must be a number in \[0, 1\)"),
        ({"min_p": float("nan")}, "min_p must be a finite number"),
        ({"repetition_penalty": 0}, "repetition_penalty must be a number > 0"),
        ({"repetition_penalty": -1.0}, "repetition_penalty must be a number > 0"),
        ({"repetition_penalty": float("inf")}, "repetition_penalty must be a finite number"),
        ({"repetition_penalty": 1e-320}, "repetition_penalty must be a number > 0"),
        ({"top_p": 0}, r"top_p must be in \(0, 1\]"),
        ({"stop": [""]}, "stop strings must be non-empty strings"),
        ({"stop": ["ok", 3]}, "stop strings must be non-empty strings"),
        ({"stop": 3}, "stop must be a string or a list of strings"),
        ({"stop": ["\x1f"]}, "cannot write the stop string"),
        ({"chat_template_kwargs": [("enable_thinking", False)]}, "must be a dict"),
        ({"chat_template_kwargs": {"tokenize": False}}, "may not set 'tokenize'"),
        ({"chat_template_kwargs": {1: 2}}, "keys must be strings"),
    ],
)
def test_bad_sampling_values_are_refused_clearly(gen, kwargs, message):
    with pytest.raises(InvalidInputError, match=message):
        gen.generate("hi", method="ar", max_new_tokens=2, **kwargs)


def test_chat_template_kwargs_reach_the_template(tiny_pair_dirs):
    target, _ = tiny_pair_dirs
    gen = SpeculativeGenerator.from_pretrained(target, dtype="float64", device="cpu")
    gen.tokenizer.chat_template = (
        "{% for m in messages %}{{ m['content'] }}{% endfor %}"
        "{% if enable_thinking is defined and not enable_thinking %} nothink{% endif %}"
    )
    plain = gen.tokenizer.decode(gen.encode("hi"))
    off = gen.tokenizer.decode(gen.encode("hi", chat_template_kwargs={"enable_thinking": False}))
    assert (plain, off) == ("hi", "hi nothink")
    out = gen.generate(
        "hi", method="ar", max_new_tokens=2, chat_template_kwargs={"enable_thinking": False}
    )
    assert gen.tokenizer.decode(out.prompt_ids) == "hi nothink"
    with pytest.raises(InvalidInputError, match="only apply with the chat template"):
        gen.encode([5, 6], chat_template_kwargs={"enable_thinking": False})
    with pytest.raises(InvalidInputError, match="only apply with the chat template"):
        gen.encode("hi", chat=False, chat_template_kwargs={"enable_thinking": False})


# ---- the command line -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--top-k", "-1"], "top_k must be an integer >= 0"),
        (["--min-p", "1.5"], "min_p must be a number in [0, 1)"),
        (["--repetition-penalty", "0"], "repetition_penalty must be a number > 0"),
        (["--stop", ""], "stop strings must be non-empty strings"),
        (["--chat-template-kwargs", "{enable_thinking: false}"], "is not valid JSON"),
        (["--chat-template-kwargs", "[1]"], "must be a JSON object"),
        (["--chat-template-kwargs", '{"tokenize": true}'], "may not set 'tokenize'"),
        (["--raw", "--chat-template-kwargs", '{"a": 1}'], "only applies with the chat template"),
    ],
)
def test_cli_refuses_bad_sampling_values_in_one_line(capsys, tmp_path, extra, message):
    """Found before any model is looked for (the target does not exist)."""
    missing = str(tmp_path / "no-such-target")
    assert main(["generate", "--target", missing, "--draft", missing, *extra, "hi"]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and "no such directory" not in err
    assert len(err.strip().splitlines()) == 1


def test_cli_sampling_options_match_the_api(capsys, generate_argv, gen):
    options = {
        "temperature": 0.9,
        "top_k": 5,
        "top_p": 0.9,
        "min_p": 0.05,
        "repetition_penalty": 1.2,
        "seed": 3,
        "stop": ["zz", "e"],
    }
    argv = generate_argv("--max-new-tokens", "20", "--method", "ddtree", "--budget", "8", "--json")
    for name, value in options.items():
        for item in value if isinstance(value, list) else [value]:
            argv += [f"--{name.replace('_', '-')}", str(item)]
    assert main([*argv, "hello there"]) == 0
    out = json.loads(capsys.readouterr().out)
    api = gen.generate("hello there", method="ddtree", budget=8, max_new_tokens=20, **options)
    assert out["token_ids"] == api.token_ids and out["text"] == api.text
    assert out["stats"]["stop_reason"] == api.stats.stop_reason
    for key in ("ttft_s", "decode_tokens_per_s", "draft_acceptance_rate", "accepted_per_position"):
        assert key in out["stats"], key


def test_compare_ar_runs_with_the_same_settings(capsys, generate_argv, monkeypatch):
    original = SpeculativeGenerator.generate
    calls = []

    def generate(self, prompt, method="caddtree", **kwargs):
        calls.append(kwargs)
        return original(self, prompt, method, **kwargs)

    monkeypatch.setattr(SpeculativeGenerator, "generate", generate)
    extra = ["--method", "dflash", "--compare-ar", "--ar-dtypes", "same", "--no-stream"]
    extra += ["--repetition-penalty", "1.3", "--top-k", "4", "--stop", "q"]
    extra += ["--chat-template-kwargs", '{"x": 1}']
    assert main(generate_argv("--max-new-tokens", "20", *extra, "hello there")) == 0
    err = capsys.readouterr().err
    keys = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "stop", "seed")
    keys += ("chat", "chat_template_kwargs")
    settings = [{k: c[k] for k in keys} for c in calls]
    assert len(settings) == 8  # the method and AR, each warmed up and then timed 3 times
    assert all(s == settings[0] for s in settings)
    assert settings[0]["repetition_penalty"] == 1.3 and settings[0]["stop"] == ["q"]
    assert settings[0]["chat_template_kwargs"] == {"x": 1}
    # the human summary: a line of speed and acceptance under each run's line
    lines = err.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("[dflash ") or line.startswith("[ar "):
            assert lines[i + 1].startswith("  TTFT ") and " tok/s" in lines[i + 1]
    (dflash,) = [lines[i + 1] for i, line in enumerate(lines) if line.startswith("[dflash ")]
    assert "draft acceptance" in dflash
    assert math.isfinite(float(dflash.split("TTFT ")[1].split(" ms")[0]))
