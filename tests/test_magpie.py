"""Self-synthesised prompts (Magpie) and user prompt files: the pre-query template, resumable
sampling, the quality and near-duplicate filter, and clear errors for bad prompt files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from caddtree import CaddtreeError
from caddtree.train.magpie import (
    PERSONAS,
    Persona,
    assistant_turns,
    filter_queries,
    generate_queries,
    persona_of_batch,
    pre_query_ids,
    read_prompt_file,
    read_raw_queries,
    user_messages,
)
from caddtree.train.prompts import OverlapIndex, build_training_prompts
from tiny_models import MASK_TOKEN_ID, qwen3_target
from tiny_tokenizer import tiny_tokenizer


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer(MASK_TOKEN_ID)


def test_pre_query_template_stops_where_the_user_turn_starts(tok):
    assert tok.decode(pre_query_ids(tok)) == "u: "
    assert tok.decode(pre_query_ids(tok, "be brief")) == "s: be brief\nu: "


@pytest.mark.parametrize("generator", ["auto", "hf"])
def test_generation_resumes_to_the_same_queries(tok, tmp_path, generator):
    target = qwen3_target()
    personas = {"none": None, "short": "be brief"}
    kwargs = dict(
        personas=personas,
        batch_size=4,
        max_new_tokens=12,
        stop_token_ids=[1],
        progress=False,
        generator=generator,
    )
    straight = generate_queries(target, tok, 12, tmp_path / "a.jsonl", seed=3, **kwargs)
    assert len(straight) == 12
    assert [r["persona"] for r in straight[::4]] == ["none", "short", "none"]
    assert all(set(r) == {"batch", "persona", "query", "finished", "generator"} for r in straight)
    # auto: caddtree's batched decoder, which runs the tiny target
    assert {r["generator"] for r in straight} == {"engine" if generator == "auto" else "hf"}
    # the rows of one batch share a prompt but not a random stream
    assert len({r["query"] for r in straight[:4]}) > 1
    # an interrupted run: only the first batch was saved
    lines = (tmp_path / "a.jsonl").read_text().splitlines()
    (tmp_path / "b.jsonl").write_text("\n".join(lines[:4]) + "\n")
    resumed = generate_queries(target, tok, 12, tmp_path / "b.jsonl", seed=3, **kwargs)
    assert resumed == straight
    other_seed = generate_queries(target, tok, 12, tmp_path / "c.jsonl", seed=4, **kwargs)
    assert [r["query"] for r in other_seed] != [r["query"] for r in straight]


def test_an_unknown_generator_is_a_clear_error(tok, tmp_path):
    with pytest.raises(CaddtreeError, match="unknown generator 'vllm': use auto, engine or hf"):
        generate_queries(qwen3_target(), tok, 4, tmp_path / "q.jsonl", generator="vllm")
    assert not (tmp_path / "q.jsonl").exists()  # refused before anything was written


def test_a_persona_that_joins_later_changes_no_earlier_batch(tok, tmp_path):
    personas = [Persona("a", None), Persona("b", "be brief"), Persona("c", "be kind", 3)]
    names = [persona_of_batch(personas, b).name for b in range(9)]
    assert names == ["a", "b", "a", "a", "b", "c", "a", "b", "c"]
    # so a query file made before "c" joined is a prefix of what a run with "c" makes
    target = qwen3_target()
    kwargs = dict(batch_size=2, max_new_tokens=6, stop_token_ids=[1], progress=False, seed=1)
    before = generate_queries(target, tok, 6, tmp_path / "q.jsonl", personas=personas[:2], **kwargs)
    grown = generate_queries(target, tok, 12, tmp_path / "q.jsonl", personas=personas, **kwargs)
    fresh = generate_queries(target, tok, 12, tmp_path / "f.jsonl", personas=personas, **kwargs)
    assert grown[:6] == before and grown == fresh
    assert [r["persona"] for r in grown[::2]] == names[:6]
    with pytest.raises(CaddtreeError, match="no persona is in the rotation at batch 0"):
        persona_of_batch([Persona("late", None, 5)], 0)


COMMITTED = Path(__file__).resolve().parents[1] / "training-data/smollm2-135m-instruct"


def test_the_committed_magpie_queries_keep_their_personas():
    # the built-in drafter's first data was sampled with the first six personas, before the
    # others joined at batch 94: the rotation must still give each batch the persona it had
    records = read_raw_queries(COMMITTED / "magpie_raw.jsonl")
    assert all(persona_of_batch(PERSONAS, r["batch"]).name == r["persona"] for r in records)
    first = {r["persona"] for r in records if r["batch"] < 94}
    assert first == {p.name for p in PERSONAS if p.since_batch == 0}
    # and every persona takes its turn once all have joined
    later = {persona_of_batch(PERSONAS, b).name for b in range(94, 94 + len(PERSONAS))}
    assert later == {p.name for p in PERSONAS}


def test_no_committed_training_prompt_overlaps_a_benchmark():
    from transformers import AutoTokenizer

    from caddtree.train.data import TrainingData
    from caddtree.util.defaults import default_target_dir

    data = TrainingData.load(COMMITTED / "data.safetensors")
    tokenizer = AutoTokenizer.from_pretrained(default_target_dir())
    index = OverlapIndex.from_benchmarks()
    found = [
        i
        for i, (seq, p) in enumerate(zip(data.sequences, data.prompt_lengths))
        if any(index.overlaps(t) for t in user_messages(tokenizer, seq[:p].tolist()))
    ]
    assert len(data.sequences) >= 10_000 and found == []


def test_user_messages_finds_each_user_turn_of_a_chat_prompt():
    from transformers import AutoTokenizer

    from caddtree.train.data import chat_prompt_ids
    from caddtree.util.defaults import default_target_dir

    tokenizer = AutoTokenizer.from_pretrained(default_target_dir())
    chat = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "first question,\nover two lines"},
        {"role": "assistant", "content": "an answer"},
        {"role": "user", "content": "a follow-up"},
    ]
    ids = chat_prompt_ids(tokenizer, chat)
    assert user_messages(tokenizer, ids) == ["first question,\nover two lines", "a follow-up"]
    assert assistant_turns(tokenizer, ids) == 2
    assert assistant_turns(tokenizer, chat_prompt_ids(tokenizer, "one question")) == 1


def rec(query, finished=True, persona="none"):
    return {"batch": 0, "persona": persona, "query": query, "finished": finished}


def test_filter_drops_degenerate_and_near_duplicate_queries():
    records = [
        rec("How do I sort a list of dictionaries by a key in Python?"),
        rec("How do I sort a list of dictionaries by a key in Python 3?"),  # near-duplicate
        rec("how do i SORT a list of dictionaries by a key in python?!"),  # same words
        rec("Write a short poem about the sea at night, with a rhyme in every line."),
        rec("What is the capital of France and why is it famous?", finished=False),
        rec("hi there"),  # too short
        rec("buy now " * 20),  # repetitive
        rec("Tell me about <|im_start|> tokens please, in detail."),  # template markers
        rec("Explain how vaccines train the immune system, step by step.", persona="explain"),
    ]
    report = filter_queries(records)
    assert report.kept == [
        "How do I sort a list of dictionaries by a key in Python?",
        "Write a short poem about the sea at night, with a rhyme in every line.",
        "Explain how vaccines train the immune system, step by step.",
    ]
    assert report.dropped == {
        "near-duplicate": 2,
        "unfinished": 1,
        "length": 1,
        "repetitive": 1,
        "markers": 1,
    }
    assert report.per_persona == {"none": 2, "explain": 1}


def test_prompt_file_reads_prompts_and_chats(tmp_path):
    path = tmp_path / "p.jsonl"
    chat = [{"role": "system", "content": "be kind"}, {"role": "user", "content": "hello"}]
    path.write_text(
        json.dumps({"prompt": "Write a limerick."}) + "\n\n" + json.dumps({"messages": chat}) + "\n"
    )
    assert read_prompt_file(path) == ["Write a limerick.", chat]


@pytest.mark.parametrize(
    "line, message",
    [
        ("{not json", "line 2: not valid JSON"),
        ('{"text": "hi"}', 'line 2: expected an object with exactly one of "prompt" or "messages"'),
        ('{"prompt": "a", "messages": []}', "line 2: expected an object with exactly one"),
        ('{"prompt": 3}', 'line 2: "prompt" must be a non-empty string'),
        ('{"messages": [{"role": "user"}]}', 'line 2: "messages" must be a non-empty list'),
        (
            '{"messages": [{"role": "assistant", "content": "x"}]}',
            'line 2: the last of "messages" must be a user turn',
        ),
        ("[1, 2]", "line 2: expected an object"),
    ],
)
def test_bad_prompt_file_lines_are_named(tmp_path, line, message):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "fine"}\n' + line + "\n")
    with pytest.raises(CaddtreeError) as err:
        read_prompt_file(path)
    assert message in str(err.value) and str(path) in str(err.value)


def test_missing_or_empty_prompt_file_is_a_clear_error(tmp_path):
    with pytest.raises(CaddtreeError, match="cannot read the prompt file"):
        read_prompt_file(tmp_path / "nope.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(CaddtreeError, match="holds no prompts"):
        read_prompt_file(tmp_path / "empty.jsonl")


def test_chat_prompts_are_checked_against_benchmarks_turn_by_turn():
    bench = (
        "Compose an engaging travel blog post about a recent trip to Hawaii, highlighting culture."
    )
    index = OverlapIndex([bench])
    chat_hit = [{"role": "system", "content": "x"}, {"role": "user", "content": bench}]
    chat_ok = [{"role": "user", "content": "Plan a weekend in Lisbon for two people."}]
    result = build_training_prompts(
        sources={"file": lambda: [chat_hit, chat_ok, chat_ok]}, benchmark_index=index
    )
    assert result.prompts == [chat_ok] and result.overlap == 1 and result.duplicates == 1


def test_followups_continue_conversations_and_resume(tok, tmp_path):
    """Second turns: the conversations are the data's finished single-turn samples in order; the
    next user messages are sampled resumably (a grown count keeps the earlier records), and the
    filtered ones become [user, assistant, user] prompts."""
    import torch

    from caddtree.train.data import TrainingData, chat_prompt_ids
    from caddtree.train.followups import (
        conversation_digest,
        conversations,
        followup_prompts,
        generate_followups,
    )

    stop = 1
    seqs, lengths = [], []
    for i, (text, finished) in enumerate(
        [("hello there", True), ("what now", False), ("tell me more", True), ("and so", True)]
    ):
        prompt = chat_prompt_ids(tok, text)
        answer = tok(f"answer number {i}", add_special_tokens=False)["input_ids"]
        seqs.append(torch.tensor(prompt + answer + ([stop] if finished else [])))
        lengths.append(len(prompt))
    system_only = chat_prompt_ids(tok, [{"role": "system", "content": "no user message here"}])
    seqs.insert(1, torch.tensor(system_only + [5, 6, stop]))  # one turn, no user message found
    lengths.insert(1, len(system_only))
    data = TrainingData(seqs, lengths, {"stops": [stop]})
    chats = conversations(data, tok, 3)
    assert [c[1]["content"] for c in chats] == [
        "answer number 0",
        "answer number 2",
        "answer number 3",
    ]
    assert [c[0]["content"] for c in chats] == ["hello there", "tell me more", "and so"]
    assert all([m["role"] for m in c] == ["user", "assistant"] for c in chats)

    target = qwen3_target()
    kwargs = dict(batch_size=2, max_new_tokens=8, stop_token_ids=[stop], progress=False, seed=2)
    first = generate_followups(target, tok, chats[:2], tmp_path / "f.jsonl", **kwargs)
    grown = generate_followups(target, tok, chats, tmp_path / "f.jsonl", **kwargs)
    assert grown[:2] == first and [r["conversation"] for r in grown] == [0, 1, 2]
    assert {r["generator"] for r in grown} == {"engine"}
    again = generate_followups(target, tok, chats, tmp_path / "f.jsonl", **kwargs)
    assert again == grown  # nothing left to sample
    changed = [chats[0], [chats[1][0], {"role": "assistant", "content": "another answer"}]]
    redone = generate_followups(target, tok, changed, tmp_path / "f.jsonl", **kwargs)
    assert redone[0] == grown[0] and len(redone) == 2  # sampled again from the changed one on
    assert redone[1]["digest"] == conversation_digest(changed[1]) != grown[1]["digest"]
    questions = [
        "Could you show the same idea with a worked example?",
        "Why does that happen, and is there another way?",
        "Which of these would you pick for a small team, and when?",
    ]
    records = [dict(r, query=q, finished=True) for r, q in zip(grown, questions)]
    records[1]["finished"] = False
    prompts = followup_prompts(chats, records)
    assert [p[:2] for p in prompts] == [chats[0], chats[2]]
    assert [p[2] for p in prompts] == [
        {"role": "user", "content": records[0]["query"]},
        {"role": "user", "content": records[2]["query"]},
    ]
