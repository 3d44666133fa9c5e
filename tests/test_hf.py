"""``model.generate(..., custom_generate=caddtree.hf.generate)``: caddtree inside transformers.

Every method must give ``generate``'s own greedy output (with its logits processors, EOS and stop
criteria), sample from its processed distribution, feed its streamers and return its output
types; what it cannot do must fail clearly instead of being ignored.
"""

from __future__ import annotations

import copy
import pickle
import threading

import numpy as np
import pytest
import torch
from transformers import (
    GenerationConfig,
    StoppingCriteriaList,
    StopStringCriteria,
    TextIteratorStreamer,
    TextStreamer,
)
from transformers.generation.streamers import BaseStreamer

import caddtree
import caddtree.hf
from caddtree import InvalidInputError, SpeculativeGenerator
from caddtree.core.sampling import Sampler
from caddtree.hf import CaddtreeGenerateOutput
from sampling_checks import (
    COST,
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
from tiny_models import MASK_TOKEN_ID, VOCAB, new_drafter, qwen3_target
from tiny_tokenizer import tiny_tokenizer

PROMPT = [70, 2, 2, 9, 31, 12, 60, 1, 0, 33]


def uniform_drafter(target, **kwargs):
    """A drafter whose draft is uniform over the vocabulary (its final norm is zero, so every
    position's hidden state, and logit, is 0). With block size 2 and a DDTree budget of the
    vocabulary size, every round's tree holds every next token: the walk always accepts a node,
    and the round's second token is chosen at that node's row."""
    drafter = new_drafter(target, block_size=2, **kwargs)
    with torch.no_grad():
        drafter.norm.weight.zero_()
    return drafter


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer(MASK_TOKEN_ID)


def prepared_processors(model, prompt, **settings):
    """The logits processors ``model.generate(**settings)`` prepares (and hands to caddtree)."""
    seen = []

    def probe(model, input_ids, logits_processor=None, **kwargs):
        seen.append(logits_processor)
        return input_ids

    model.generate(torch.tensor([prompt]), custom_generate=probe, max_new_tokens=1, **settings)
    return seen[0]


def ours(model, prompt, drafter=None, **kwargs):
    """``model.generate`` through caddtree (no EOS unless given)."""
    return model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        custom_generate=caddtree.hf.generate,
        assistant_model=drafter,
        pad_token_id=0,
        **{"eos_token_id": None, **kwargs},
    )


def ours_tokens(model, prompt, drafter=None, **kwargs):
    """``ours`` with ``return_dict_in_generate``: the generated tokens (a list) and caddtree's
    statistics of the call."""
    out = ours(model, prompt, drafter, return_dict_in_generate=True, **kwargs)
    return out.sequences[0, len(prompt) :].tolist(), out.caddtree


class RecordingStreamer(BaseStreamer):
    """Keeps what a streamer is given."""

    def __init__(self):
        self.puts, self.ended = [], 0

    def put(self, value):
        self.puts.append(value.clone())

    def end(self):
        self.ended += 1


# ---- what transformers passes to a custom_generate callable ---------------------------------------


def test_transformers_does_not_pass_assistant_model_streamer_or_tokenizer(qwen3, tokenizer):
    """transformers 5.23 drops these three for a callable (see caddtree.hf); if this fails, it
    passes them now and the frame lookup / the stop_strings note of caddtree.hf can go."""
    seen = {}

    def probe(model, input_ids, assistant_model=None, streamer=None, tokenizer=None, **kwargs):
        seen.update(assistant_model=assistant_model, streamer=streamer, tokenizer=tokenizer)
        return input_ids

    qwen3.generate(
        torch.tensor([PROMPT]),
        custom_generate=probe,
        assistant_model=qwen3,
        streamer=RecordingStreamer(),
        tokenizer=tokenizer,
        max_new_tokens=2,
    )
    assert seen == {"assistant_model": None, "streamer": None, "tokenizer": None}


def test_assistant_model_and_streamer_given_to_generate_are_used(qwen3, drafter):
    streamer = RecordingStreamer()
    out = ours(
        qwen3,
        PROMPT,
        drafter,
        method="ddtree",
        budget=8,
        max_new_tokens=20,
        streamer=streamer,
        return_dict_in_generate=True,
    )
    assert out.caddtree.method == "ddtree" and out.caddtree.draft_tokens > 0  # it drafted
    new = out.sequences[0, len(PROMPT) :].tolist()
    assert streamer.puts[0].tolist() == [PROMPT]  # generate's own put of the prompt
    assert all(p.ndim == 1 and p.dtype == torch.long for p in streamer.puts[1:])
    assert torch.cat(streamer.puts[1:]).tolist() == new
    assert len(streamer.puts) == 1 + 1 + out.caddtree.rounds  # prompt, prefill, every round
    assert streamer.ended == 1
    # drafter= works as well, and called directly there is no generate frame to read
    config = GenerationConfig(max_new_tokens=20, do_sample=False)
    direct = caddtree.hf.generate(
        qwen3, torch.tensor([PROMPT]), generation_config=config, drafter=drafter, method="dflash"
    )
    assert direct[0, len(PROMPT) :].tolist() == new
    assert caddtree.hf._generate_call_arguments(qwen3) == {}
    assert caddtree.hf is caddtree.__getattr__("hf")  # reachable as caddtree.hf


# ---- greedy: generate's tokens -------------------------------------------------------------------


@pytest.mark.parametrize(("method", "kwargs"), METHODS, ids=[m for m, _ in METHODS])
def test_greedy_equals_generate(qwen3, drafter, method, kwargs):
    n_new = 30
    for settings in ({}, {"repetition_penalty": 1.3}):
        reference = hf_generate(qwen3, PROMPT, n_new, do_sample=False, **settings)
        tokens, stats = ours_tokens(
            qwen3,
            PROMPT,
            drafter,
            method=method,
            max_new_tokens=n_new,
            do_sample=False,
            **settings,
            **kwargs,
        )
        assert tokens == reference, settings
        assert stats.method == method and stats.stop_reason == "max_new_tokens"
        assert stats.new_tokens == n_new


def test_greedy_tokens_chosen_inside_trees_equal_generate(qwen3):
    """A drafter whose trees are always accepted one node deep, with a repetition penalty."""
    drafter = uniform_drafter(qwen3)
    reference = hf_generate(qwen3, PROMPT, 25, do_sample=False, repetition_penalty=1.3)
    tokens, stats = ours_tokens(
        qwen3,
        PROMPT,
        drafter,
        method="ddtree",
        budget=VOCAB,
        max_new_tokens=25,  # the prefill's token, then 12 rounds of two
        repetition_penalty=1.3,
    )
    assert tokens == reference
    assert stats.accepted_tokens == stats.rounds == 12


def test_eos_and_stop_strings_end_where_generate_ends(qwen3, drafter, tokenizer):
    n_new = 30
    free = hf_generate(qwen3, PROMPT, n_new, do_sample=False)
    eos = free[12]
    first = free.index(eos)
    assert hf_generate(qwen3, PROMPT, n_new, do_sample=False, eos_token_id=eos) == free[: first + 1]
    stop, _ = char_stop(tokenizer, free, 7)
    reference_stop = hf_generate(
        qwen3, PROMPT, n_new, do_sample=False, stop_strings=stop, tokenizer=tokenizer
    )
    assert len(reference_stop) < n_new
    for method, kwargs in METHODS:
        common = {"method": method, "max_new_tokens": n_new, **kwargs}
        tokens, stats = ours_tokens(qwen3, PROMPT, drafter, eos_token_id=eos, **common)
        assert tokens == free[: first + 1], method  # EOS kept
        assert stats.stop_reason == "stop_token"
        criteria = StoppingCriteriaList([StopStringCriteria(tokenizer, [stop])])
        tokens, stats = ours_tokens(qwen3, PROMPT, drafter, stopping_criteria=criteria, **common)
        assert tokens == reference_stop, method
        assert stats.stop_reason == "stop_string"
    # transformers does not pass tokenizer= on (see above): stop_strings say how to give them
    with pytest.raises(InvalidInputError, match=r"StopStringCriteria\(tokenizer"):
        ours(qwen3, PROMPT, drafter, method="dflash", max_new_tokens=5, stop_strings=stop)
    with pytest.raises(InvalidInputError, match="transformers does not pass tokenizer="):
        ours(
            qwen3,
            PROMPT,
            drafter,
            method="dflash",
            max_new_tokens=5,
            stop_strings=[stop],
            tokenizer=tokenizer,
        )
    # where the tokenizer does arrive (a direct call), stop_strings work
    config = GenerationConfig(max_new_tokens=n_new, do_sample=False)
    out = caddtree.hf.generate(
        qwen3,
        torch.tensor([PROMPT]),
        generation_config=config,
        drafter=drafter,
        method="ddtree",
        stop_strings=stop,
        tokenizer=tokenizer,
    )
    assert out[0, len(PROMPT) :].tolist() == reference_stop
    with pytest.raises(InvalidInputError, match="takes generation settings in generation_config="):
        caddtree.hf.generate(qwen3, torch.tensor([PROMPT]), method="ar", max_new_tokens=3)


# ---- sampling: the processed target's tokens and distribution -------------------------------------


@pytest.mark.parametrize(
    "settings",
    [
        {"top_k": 3},
        {"top_p": 0.5},
        {"min_p": 0.2},
        {"temperature": 0.8, "top_k": 6, "top_p": 0.8, "min_p": 0.1, "repetition_penalty": 1.2},
    ],
    ids=["top_k", "top_p", "min_p", "all"],
)
def test_sampled_tokens_lie_in_the_set_the_processors_allow(settings):
    model = sharp_qwen3()
    drafter = uniform_drafter(model)
    prompt = [5, 17, 3]
    processors = prepared_processors(model, prompt, do_sample=True, **settings)
    sizes, accepted = [], 0
    for seed in range(2):
        torch.manual_seed(seed)
        tokens, stats = ours_tokens(
            model,
            prompt,
            drafter,
            method="ddtree",
            budget=VOCAB,
            max_new_tokens=30,
            do_sample=True,
            **settings,
        )
        accepted += stats.accepted_tokens
        for i, (token, allowed) in enumerate(
            zip(tokens, allowed_sets(model, prompt, tokens, processors))
        ):
            assert token in allowed, (seed, i)
            sizes.append(len(allowed))
    assert accepted >= 20  # half the tokens were chosen at accepted tree nodes
    assert np.mean(sizes) < VOCAB / 8  # the allowed sets are small: the check has teeth


def test_sampled_tokens_are_distributed_as_the_processed_target():
    """1,200 generations of three tokens through ``generate``; each token's marginal against the
    exact one under the processors ``generate`` prepares, chi-square at alpha = 1e-3. The third
    token is chosen at the row of an accepted tree node (its context: the prompt, token 1 and the
    node's token 2). The same check must reject the unprocessed target and the processed target
    that forgets the node's own token (the repetition penalty's context)."""
    vocab = 16
    model, prompt = marginal_target(vocab), MARGINAL_PROMPT
    drafter = uniform_drafter(model, mask_token_id=vocab - 1, num_layers=1, target_layer_ids=(0,))
    n = 1200
    counts = np.zeros((3, vocab))
    torch.manual_seed(0)
    for _ in range(n):
        tokens, stats = ours_tokens(
            model,
            prompt,
            drafter,
            method="ddtree",
            budget=vocab,
            max_new_tokens=3,
            do_sample=True,
            **MARGINAL_SETTINGS,
        )
        assert stats.per_round[0].accepted == 1
        for k, token in enumerate(tokens):
            counts[k, token] += 1
    prepared = prepared_processors(model, prompt, do_sample=True, **MARGINAL_SETTINGS)
    assert len(prepared) == 5  # the five settings, nothing else
    reference = Sampler.from_processors(prepared, do_sample=True)
    assert_three_token_marginals(model, prompt, counts, reference)


# ---- streamers and outputs ------------------------------------------------------------------------


def test_text_streamers_receive_exactly_the_generated_text(qwen3, drafter, tokenizer, capsys):
    prompt = tokenizer("hello there")["input_ids"]
    kwargs = {"method": "ddtree", "budget": 8, "max_new_tokens": 25}
    new = ours(qwen3, prompt, drafter, **kwargs)[0, len(prompt) :].tolist()
    text = tokenizer.decode(new)
    assert len(text) > 10
    capsys.readouterr()
    ours(qwen3, prompt, drafter, streamer=TextStreamer(tokenizer, skip_prompt=True), **kwargs)
    assert capsys.readouterr().out == text + "\n"

    streamer = TextIteratorStreamer(tokenizer, skip_prompt=True, timeout=60)
    results = []
    thread = threading.Thread(
        target=lambda: results.append(ours(qwen3, prompt, drafter, streamer=streamer, **kwargs))
    )
    thread.start()
    streamed = "".join(streamer)
    thread.join()
    assert streamed == text
    assert results[0][0, len(prompt) :].tolist() == new


def test_return_dict_has_generates_scores_logits_and_the_statistics(qwen3, drafter):
    """Scores and logits of every token, those chosen at accepted tree nodes included."""
    n_new = 13
    settings = {"do_sample": False, "repetition_penalty": 1.3, "max_new_tokens": n_new}
    flags = {"return_dict_in_generate": True, "output_scores": True, "output_logits": True}
    reference = qwen3.generate(
        torch.tensor([PROMPT]),
        attention_mask=torch.ones(1, len(PROMPT), dtype=torch.long),
        pad_token_id=0,
        eos_token_id=None,
        **settings,
        **flags,
    )
    uniform = uniform_drafter(qwen3)
    out = ours(qwen3, PROMPT, uniform, method="ddtree", budget=VOCAB, **settings, **flags)
    assert isinstance(out, CaddtreeGenerateOutput)
    assert out.caddtree.accepted_tokens == 6  # tokens 3, 5, ... came from tree nodes' rows
    assert torch.equal(out.sequences, reference.sequences)
    assert len(out.scores) == len(out.logits) == n_new
    for name in ("scores", "logits"):
        for mine, theirs in zip(getattr(out, name), getattr(reference, name)):
            assert mine.shape == theirs.shape == (1, VOCAB) and mine.dtype == theirs.dtype
            torch.testing.assert_close(mine, theirs)
    # the penalty changed the scores: they are the processed ones
    assert not torch.equal(out.scores[3], out.logits[3])
    stats = out.caddtree
    assert stats.new_tokens == n_new and stats.stop_reason == "max_new_tokens"
    assert stats.tau == pytest.approx((n_new - 1) / stats.rounds)
    plain = ours(qwen3, PROMPT, drafter, method="dflash", max_new_tokens=5)
    assert isinstance(plain, torch.Tensor) and plain.shape == (1, len(PROMPT) + 5)
    only = ours(qwen3, PROMPT, None, method="ar", max_new_tokens=5, return_dict_in_generate=True)
    assert only.scores is None and only.logits is None and only.caddtree.method == "ar"


def test_verifier_and_proposer_are_built_once_per_model_and_drafter(monkeypatch):
    model = qwen3_target(seed=4)
    first, second = new_drafter(model), new_drafter(model, seed=5)
    calls = []

    def cached_cost_model(self, *args, **kwargs):
        calls.append(self)
        return COST

    monkeypatch.setattr(SpeculativeGenerator, "cached_cost_model", cached_cost_model)
    ours(model, PROMPT, first, method="caddtree", max_new_tokens=4)
    gen = model.__dict__[caddtree.hf._SLOT].generator
    ours(model, PROMPT, first, method="caddtree", max_new_tokens=4)
    ours(model, PROMPT, None, method="ar", max_new_tokens=4)
    assert model.__dict__[caddtree.hf._SLOT].generator is gen and gen.drafter is first
    assert calls == [gen]  # the cached cost model was looked up once, then kept
    assert gen.verifier.context_length == 0 and gen.proposer.context_length == 0  # caches freed
    ours(model, PROMPT, second, method="dflash", max_new_tokens=4)
    assert model.__dict__[caddtree.hf._SLOT].generator.drafter is second
    # copies and pickles of the model do not carry the generator along
    assert copy.deepcopy(model).__dict__[caddtree.hf._SLOT].generator is None
    slot = model.__dict__[caddtree.hf._SLOT]
    assert pickle.loads(pickle.dumps(slot)).generator is None


# ---- what it cannot do: clear errors ---------------------------------------------------------------


def test_unsupported_requests_fail_clearly(qwen3, drafter):
    two = torch.tensor([PROMPT, PROMPT[::-1]])
    cases = [
        (dict(inputs=two, attention_mask=torch.ones_like(two)), "batch size 1"),
        (
            dict(inputs=torch.tensor([PROMPT]), attention_mask=torch.tensor([[0] + [1] * 9])),
            "padding",
        ),
        (dict(num_beams=2), "beam search"),
        (
            dict(do_sample=True, num_return_sequences=2, method="ar", assistant_model=None),
            "one sequence per call",
        ),
        (dict(output_attentions=True, return_dict_in_generate=True), "output_attentions"),
        (dict(method="ddtree", assistant_model=None), "needs a DFlash drafter"),
        (dict(assistant_model=qwen3), "must be a caddtree.DFlashDraftModel"),
        (dict(method="beam"), "unknown method"),
        (dict(method="dflash", budget=4), "only applies to method 'ddtree'"),
    ]
    for kwargs, message in cases:
        call = {
            "inputs": torch.tensor([PROMPT]),
            "attention_mask": torch.ones(1, len(PROMPT), dtype=torch.long),
            "custom_generate": caddtree.hf.generate,
            "assistant_model": drafter,
            "method": "dflash",
            "max_new_tokens": 4,
            "pad_token_id": 0,
            "streamer": RecordingStreamer(),
            **kwargs,
        }
        with pytest.raises(InvalidInputError, match=message):
            qwen3.generate(**call)
        assert call["streamer"].ended == 1, message  # the streamer is ended on errors too


def test_an_empty_cache_is_accepted_and_a_filled_one_refused(qwen3, drafter):
    """transformers 5.24 hands the cache to custom_generate as ``cache`` (earlier releases as
    ``past_key_values``); an empty one is what generate prepares, a filled one cannot be used."""
    from transformers import DynamicCache

    from caddtree.models.target import cache_argument

    name = cache_argument(qwen3)
    call = {
        "inputs": torch.tensor([PROMPT]),
        "attention_mask": torch.ones(1, len(PROMPT), dtype=torch.long),
        "custom_generate": caddtree.hf.generate,
        "assistant_model": drafter,
        "method": "ddtree",
        "budget": 4,
        "max_new_tokens": 6,
        "pad_token_id": 0,
    }
    plain = hf_generate(qwen3, PROMPT, 6, do_sample=False)
    out = qwen3.generate(**call, **{name: DynamicCache(config=qwen3.config)})
    assert out[0, len(PROMPT) :].tolist() == plain

    filled = DynamicCache(config=qwen3.config)
    with torch.no_grad():
        qwen3(torch.tensor([PROMPT]), use_cache=True, **{name: filled})
    assert filled.get_seq_length() == len(PROMPT)
    with pytest.raises(InvalidInputError, match=f"cannot continue from a filled {name}"):
        qwen3.generate(**call, **{name: filled})
