"""Second turns of conversations (``caddtree train-drafter --followups N``): the target, shown a
conversation of the training data (a user's query and its own answer), writes the user's next
message itself, Magpie's way (:mod:`caddtree.train.magpie`); the conversation with that message
becomes a training prompt, whose response the target writes next. Multi-turn prompts (MT-Bench's
second turns, chats) then have training data of their own shape.

:func:`conversations` picks the conversations from the data, :func:`generate_followups` samples
the messages (resumable through a JSON-lines file, one record per conversation) and
:func:`followup_prompts` filters them and builds the prompts.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..util.files import atomic_write_text
from .data import TrainingData, resolve_generator
from .magpie import (
    assistant_turns,
    filter_queries,
    found_user_messages,
    pre_query_ids,
    read_raw_queries,
    sample_messages,
)

__all__ = ["conversation_digest", "conversations", "followup_prompts", "generate_followups"]

Conversation = list[dict[str, str]]


def conversations(data: TrainingData, tokenizer: Any, count: int) -> list[Conversation]:
    """The first ``count`` samples of ``data`` that ask one question (no earlier turns, one user
    message found by the chat template's markers) and have a finished answer (it ended with a
    stop token), as ``[user, assistant]`` messages, in the data's order (which only grows by
    appending, so a larger ``count`` keeps the earlier conversations first)."""
    found: list[Conversation] = []
    stops = set(data.meta.get("stops", ()))
    for seq, p in zip(data.sequences, data.prompt_lengths):
        if len(found) == count:
            break
        response = seq[p:].tolist()
        prompt = seq[:p].tolist()
        if not response or response[-1] not in stops or assistant_turns(tokenizer, prompt) != 1:
            continue
        turns = found_user_messages(tokenizer, prompt)
        if len(turns) != 1:
            continue
        answer = tokenizer.decode(response[:-1], skip_special_tokens=True).strip()
        if answer:
            found.append(
                [{"role": "user", "content": turns[0]}, {"role": "assistant", "content": answer}]
            )
    return found


def generate_followups(
    target: Any,
    tokenizer: Any,
    chats: Sequence[Conversation],
    path: str | os.PathLike[str],
    *,
    seed: int = 0,
    batch_size: int = 32,
    max_new_tokens: int = 64,
    stop_token_ids: Sequence[int] = (),
    pad_token_id: int = 0,
    progress: bool = True,
    generator: str = "auto",
) -> list[dict[str, Any]]:
    """Sample the user's next message after each conversation of ``chats`` from ``target`` at
    temperature 1 by ``generator`` (:func:`~caddtree.train.magpie.sample_messages`), resumable
    through ``path``: one record ``{"batch", "conversation", "digest", "query", "finished",
    "generator"}`` per conversation, in order. The records there are kept as they are
    up to the first whose conversation is not the one at its place in ``chats`` (its digest
    differs), and the conversations after them sampled in batches from there, the batch starting
    at conversation ``i`` with the random seed ``(seed, i)``, so that prompts made from them
    earlier stay."""
    from tqdm.auto import tqdm

    path = Path(path)
    digests = [conversation_digest(c) for c in chats]
    records = _still_matching(read_raw_queries(path), digests)
    stops = {int(t) for t in stop_token_ids}
    starts = range(len(records), len(chats), batch_size)
    bar = tqdm(total=len(chats), initial=len(records), desc="follow-ups", disable=not progress)
    generator = resolve_generator(target, generator)
    for start in starts:
        prefixes = [pre_query_ids(tokenizer, history=c) for c in chats[start : start + batch_size]]
        sampled = sample_messages(
            target,
            tokenizer,
            prefixes,
            max_new_tokens,
            stops,
            seed=seed * 1_000_003 + 7919 + start,
            pad_token_id=pad_token_id,
            generator=generator,
        )
        for row, (text, finished) in enumerate(sampled):
            index = start + row
            records.append(
                {
                    "batch": start,
                    "conversation": index,
                    "digest": digests[index],
                    "query": text,
                    "finished": finished,
                    "generator": generator,
                }
            )
        atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in records))
        bar.update(len(prefixes))
    bar.close()
    return records


def conversation_digest(chat: Conversation) -> str:
    """A short digest of ``chat``'s messages, kept with its sampled follow-up."""
    text = json.dumps([[m["role"], m["content"]] for m in chat], ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _still_matching(records: list[dict[str, Any]], digests: Sequence[str]) -> list[dict[str, Any]]:
    """The leading ``records`` whose conversations are still those of ``digests``."""
    kept = 0
    while kept < min(len(records), len(digests)) and records[kept].get("digest") == digests[kept]:
        kept += 1
    return records[:kept]


def followup_prompts(
    chats: Sequence[Conversation], records: Sequence[dict[str, Any]]
) -> list[Conversation]:
    """The conversations with the sampled next messages that pass Magpie's filter (finished, not
    degenerate, no near-duplicate of another), each as ``[user, assistant, user]``."""
    report = filter_queries(records)
    return [
        [*chats[records[i]["conversation"]], {"role": "user", "content": query}]
        for i, query in zip(report.kept_records, report.kept)
    ]
