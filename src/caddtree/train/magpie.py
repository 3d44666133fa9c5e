"""Self-synthesised training prompts (the Magpie method) and user prompt files.

Magpie: an instruction-tuned target, given only its chat template up to the start of a user turn
(the *pre-query template*), writes a plausible user query itself. Sampled at temperature 1 with a
few system prompts that steer it toward code, math, explanation, writing and everyday questions
(and with none; later also role-play, extraction, reasoning, STEM and humanities), it yields
as many distinct prompts as one cares to generate, offline and in the target's own
distribution. Queries are then filtered (:func:`filter_queries`): unfinished,
degenerate (repetitive, too short or too long, leaking template markers) and near-duplicate
queries (word 3-gram Jaccard similarity) are dropped. The caller also drops every query that
overlaps a benchmark prompt (:class:`caddtree.train.prompts.OverlapIndex`).

Generation is resumable: raw queries go to a JSON-lines file, rewritten atomically after each
batch; each batch is seeded from ``(seed, batch index)``, so a resumed run produces what an
uninterrupted one would.

:func:`read_prompt_file` reads a user's own prompts (``--prompts FILE.jsonl``).
"""

from __future__ import annotations

import json
import os
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..util.errors import InvalidInputError
from ..util.files import atomic_write_text, read_packed
from .data import engine_responses, resolve_generator

__all__ = [
    "PERSONAS",
    "MagpieFilterReport",
    "Persona",
    "assistant_turns",
    "filter_queries",
    "generate_queries",
    "persona_of_batch",
    "read_raw_queries",
    "sample_messages",
    "found_user_messages",
    "user_messages",
    "pre_query_ids",
    "read_prompt_file",
]


@dataclass(frozen=True)
class Persona:
    """A system prompt that steers Magpie queries (``system=None``: the template's own default,
    or no system turn), in the rotation from batch ``since_batch`` on."""

    name: str
    system: str | None
    since_batch: int = 0


# The rotation of system prompts. A persona that joins later (``since_batch`` > 0) changes no
# batch before it, so a query file made before it joined grows to what a fresh run would make.
PERSONAS: tuple[Persona, ...] = (
    Persona("none", None),
    Persona(
        "code",
        "You are an expert Python programmer. Users ask you to write, fix, explain and test "
        "code, and you answer with working code and a short explanation.",
    ),
    Persona(
        "math",
        "You are a patient math tutor. Users ask you arithmetic, algebra and word problems, "
        "and you solve them step by step.",
    ),
    Persona(
        "explain",
        "You are a knowledgeable teacher. Users ask you to explain ideas from science, "
        "history, technology and everyday life.",
    ),
    Persona(
        "writing",
        "You are a writing assistant. Users ask you to write, rewrite, summarise or "
        "continue emails, stories, essays, poems and posts.",
    ),
    Persona(
        "everyday",
        "You are a friendly assistant. Users ask you everyday questions about cooking, "
        "travel, health, money, hobbies and advice.",
    ),
    # from batch 94 on (after the 12,032 queries of the built-in drafter's first data), the kinds
    # of request MT-Bench also asks for
    Persona(
        "roleplay",
        "You are an actor who stays in character. Users ask you to play someone, a famous "
        "person, a job or a character from a story, and to answer as that person would.",
        since_batch=94,
    ),
    Persona(
        "extraction",
        "You are a careful data assistant. Users give you a short text, list or table and ask "
        "you to pull out, classify, count or reformat what is in it, often as JSON.",
        since_batch=94,
    ),
    Persona(
        "reasoning",
        "You are a logical thinker. Users give you puzzles, riddles and questions about order, "
        "dates, relations and cause and effect, and you reason them out step by step.",
        since_batch=94,
    ),
    Persona(
        "stem",
        "You are a scientist and engineer. Users ask you about physics, chemistry, biology, "
        "engineering and computing, from homework problems to designs.",
        since_batch=94,
    ),
    Persona(
        "humanities",
        "You are a humanities scholar. Users ask you about history, philosophy, literature, "
        "art, economics and society, and for essays and arguments about them.",
        since_batch=94,
    ),
)


def persona_of_batch(personas: Sequence[Persona], batch: int) -> Persona:
    """The persona of Magpie batch ``batch``: the personas in the rotation by then (``since_batch``
    at most ``batch``), taken in turn (``batch`` modulo their number)."""
    active = [p for p in personas if p.since_batch <= batch]
    if not active:
        raise InvalidInputError(f"no persona is in the rotation at batch {batch}")
    return active[batch % len(active)]


_SENTINEL = "\x00MAGPIE-QUERY\x00"


def pre_query_ids(
    tokenizer: Any, system: str | None = None, history: Sequence[dict[str, str]] = ()
) -> list[int]:
    """Token ids of the chat template up to where the user's next message starts: the first
    one (after ``system`` when given), or the one after the conversation ``history``.

    Renders a conversation with a placeholder user message and keeps the text before the
    placeholder, so any chat template works, not only ChatML.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise InvalidInputError("Magpie prompts need a target whose tokenizer has a chat template")
    messages = [] if system is None else [{"role": "system", "content": system}]
    messages += [*history, {"role": "user", "content": _SENTINEL}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    head, found, _ = text.partition(_SENTINEL)
    if not found:
        raise InvalidInputError("the chat template does not include the user's message as is")
    return [int(t) for t in tokenizer(head, add_special_tokens=False)["input_ids"]]


def assistant_turns(tokenizer: Any, prompt_ids: Sequence[int]) -> int:
    """How many assistant turns a chat prompt's token ids open, its generation prompt counted
    (1 for a single question): the text the chat template puts between a user message and the
    assistant's, counted in the decoded prompt (1 without a chat template)."""
    if not getattr(tokenizer, "chat_template", None):
        return 1
    probe = tokenizer.apply_chat_template(
        [{"role": "user", "content": _SENTINEL}, {"role": "assistant", "content": _SENTINEL}],
        tokenize=False,
    )
    opener = probe.split(_SENTINEL)[1]
    return tokenizer.decode(list(prompt_ids), skip_special_tokens=False).count(opener)


def user_messages(tokenizer: Any, prompt_ids: Sequence[int]) -> list[str]:
    """The user's messages in a chat prompt's token ids (:func:`found_user_messages`); the whole
    decoded prompt where they are not found."""
    found = found_user_messages(tokenizer, prompt_ids)
    return found or [tokenizer.decode(list(prompt_ids), skip_special_tokens=False)]


def found_user_messages(tokenizer: Any, prompt_ids: Sequence[int]) -> list[str]:
    """The user's messages in a chat prompt's token ids, found by the text the chat template puts
    around a user message (from the last special token before it to the first after it, or all
    of the text before and after it where the template has none); none where the tokenizer has
    no template or the prompt does not hold its markers."""
    if not getattr(tokenizer, "chat_template", None):
        return []
    probe = tokenizer.apply_chat_template(
        [{"role": "user", "content": _SENTINEL}], tokenize=False, add_generation_prompt=False
    )
    head, found, tail = probe.partition(_SENTINEL)
    specials = [s for s in tokenizer.all_special_tokens if s]
    starts = [head.rfind(s) for s in specials if s in head] or [0]
    ends = [tail.find(s) + len(s) for s in specials if s in tail] or [len(tail)]
    opener, closer = head[max(starts) :], tail[: min(ends)]
    if not found or not opener or not closer:
        return []
    text = tokenizer.decode(list(prompt_ids), skip_special_tokens=False)
    return re.findall(re.escape(opener) + "(.*?)" + re.escape(closer), text, flags=re.DOTALL)


def read_raw_queries(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The records of ``path``, or of its committed ``path.xz`` where ``path`` is absent."""
    raw = read_packed(path)
    records = []
    for line in ("" if raw is None else raw.decode("utf-8")).splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a torn line cannot occur with atomic rewrites, but never trust a file
    return records


def generate_queries(
    target: Any,
    tokenizer: Any,
    count: int,
    path: str | os.PathLike[str],
    *,
    seed: int = 0,
    personas: Sequence[Persona] | dict[str, str | None] | None = None,
    batch_size: int = 128,
    max_new_tokens: int = 64,
    stop_token_ids: Sequence[int] = (),
    progress: bool = True,
    generator: str = "auto",
) -> list[dict[str, Any]]:
    """Sample at least ``count`` raw user queries from ``target`` (resumable through ``path``).

    Batch ``b`` uses :func:`persona_of_batch` (``personas``: :data:`PERSONAS` by default, or a
    dict of name to system prompt, all in the rotation from batch 0) and the random seed
    ``(seed, b)``, sampled by ``generator`` (:func:`~caddtree.train.data.resolve_generator`;
    :func:`sample_messages`). Each record is ``{"batch", "persona", "query", "finished",
    "generator"}``; ``finished`` is whether the query ended with a stop token within
    ``max_new_tokens`` (records written before the field existed have no ``generator``: they
    are transformers' ``"hf"``).
    """
    from tqdm.auto import tqdm

    personas = PERSONAS if personas is None else personas
    if isinstance(personas, dict):
        personas = [Persona(name, system) for name, system in personas.items()]
    if not personas:
        raise InvalidInputError("need at least one persona")
    path = Path(path)
    records = read_raw_queries(path)
    done_batches = {r["batch"] for r in records}
    n_batches = -(-count // batch_size)
    stops = {int(t) for t in stop_token_ids}
    todo = [b for b in range(n_batches) if b not in done_batches]
    bar = tqdm(
        total=n_batches * batch_size,
        initial=(n_batches - len(todo)) * batch_size,
        desc="Magpie queries",
        unit="query",
        disable=not progress,
    )
    generator = resolve_generator(target, generator)
    for b in todo:
        persona = persona_of_batch(personas, b)
        prefix = pre_query_ids(tokenizer, persona.system)
        sampled = sample_messages(
            target,
            tokenizer,
            [prefix] * batch_size,
            max_new_tokens,
            stops,
            seed=seed * 1_000_003 + b,
            generator=generator,
        )
        for text, finished in sampled:
            records.append(
                {
                    "batch": b,
                    "persona": persona.name,
                    "query": text,
                    "finished": finished,
                    "generator": generator,
                }
            )
        atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in records))
        bar.update(batch_size)
    bar.close()
    return records


def sample_messages(
    target: Any,
    tokenizer: Any,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    stops: set[int],
    *,
    seed: int,
    pad_token_id: int | None = None,
    generator: str = "auto",
) -> list[tuple[str, bool]]:
    """The messages ``target`` writes after each of ``prompts`` (token ids) at temperature 1:
    each message's text (stripped) and whether it ended with a stop token within
    ``max_new_tokens``. ``generator`` (:func:`~caddtree.train.data.resolve_generator`):
    ``"hf"``, transformers' ``generate`` on left-padded rows with torch's generator seeded with
    ``seed``; ``"engine"``, caddtree's batched decoder with row ``i`` sampled from its own
    generator, seeded with ``(seed, i)``."""
    if resolve_generator(target, generator) == "engine":
        rows = _engine_samples(target, prompts, max_new_tokens, stops, seed)
    else:
        rows = _hf_samples(target, prompts, max_new_tokens, stops, seed, pad_token_id)
    messages = []
    for row in rows:
        cut = next((j for j, t in enumerate(row) if t in stops), None)
        text = tokenizer.decode(row if cut is None else row[:cut], skip_special_tokens=False)
        messages.append((text.strip(), cut is not None))
    return messages


def _engine_samples(
    target: Any, prompts: Sequence[Sequence[int]], max_new_tokens: int, stops: set[int], seed: int
) -> list[list[int]]:
    from ..core.sampling import Sampler

    done: dict[int, list[int]] = {}
    engine_responses(
        target,
        prompts,
        done,
        max_new_tokens=max_new_tokens,
        batch_size=len(prompts),
        stop_token_ids=sorted(stops),
        sampler_of=lambda i: Sampler(temperature=1.0, seed=seed * 65_537 + i),
    )
    return [done[i] for i in range(len(prompts))]


def _hf_samples(
    target: Any,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    stops: set[int],
    seed: int,
    pad_token_id: int | None,
) -> list[list[int]]:
    import torch

    device = target.get_input_embeddings().weight.device
    pad = pad_token_id if pad_token_id is not None else (min(stops) if stops else 0)
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):  # left-padded
        ids[row, width - len(prompt) :] = torch.tensor(list(prompt))
        mask[row, width - len(prompt) :] = 1
    same_length = all(len(p) == width for p in prompts)
    extra = {"cache_implementation": "static"} if same_length else {}
    torch.manual_seed(seed)
    with torch.inference_mode():
        out = target.generate(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            do_sample=True,
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            max_new_tokens=max_new_tokens,
            eos_token_id=sorted(stops) or None,
            pad_token_id=pad,
            **extra,
        )
    return out[:, width:].tolist()


# ---- filtering ----------------------------------------------------------------------------------

_WORD = re.compile(r"\w+")


def _shingles(text: str, n: int = 3) -> set[tuple[str, ...]]:
    words = _WORD.findall(text.casefold())
    if len(words) < n:
        return {tuple(words)} if words else set()
    return {tuple(words[i : i + n]) for i in range(len(words) - n + 1)}


def _degenerate(text: str, min_chars: int, max_chars: int) -> str | None:
    """Why ``text`` is no usable query, or ``None``."""
    if not min_chars <= len(text) <= max_chars:
        return "length"
    if "<|" in text or "|>" in text or "\ufffd" in text:
        return "markers"
    words = _WORD.findall(text.casefold())
    if len(words) < 4:
        return "length"
    if len(words) >= 12:
        grams = [tuple(words[i : i + 3]) for i in range(len(words) - 2)]
        if len(set(grams)) < 0.6 * len(grams) or len(set(words)) < 0.3 * len(words):
            return "repetitive"
    return None


@dataclass
class MagpieFilterReport:
    """What :func:`filter_queries` kept and why it dropped the rest (counts per reason)."""

    kept: list[str]
    dropped: Counter = field(default_factory=Counter)
    per_persona: Counter = field(default_factory=Counter)
    kept_records: list[int] = field(default_factory=list)  # where each kept query came from


def filter_queries(
    records: Sequence[dict[str, Any]],
    *,
    min_chars: int = 15,
    max_chars: int = 1500,
    max_jaccard: float = 0.5,
    rare_shingle: int = 200,
) -> MagpieFilterReport:
    """Keep finished, non-degenerate queries that are no near-duplicate of one kept earlier.

    Two queries are near-duplicates when the Jaccard similarity of their word 3-gram sets is at
    least ``max_jaccard``. Candidates are found through shingles shared by at most
    ``rare_shingle`` kept queries (a near-duplicate shares its rare shingles too), then compared
    exactly.
    """
    report = MagpieFilterReport([])
    kept_shingles: list[set] = []
    index: dict[tuple[str, ...], list[int]] = {}
    for position, rec in enumerate(records):
        text = rec["query"]
        if not rec.get("finished", True):
            report.dropped["unfinished"] += 1
            continue
        why = _degenerate(text, min_chars, max_chars)
        if why:
            report.dropped[why] += 1
            continue
        sh = _shingles(text)
        candidates = Counter(
            j for s in sh for j in index.get(s, ()) if len(index[s]) <= rare_shingle
        )
        duplicate = False
        for j, _ in candidates.most_common(20):
            other = kept_shingles[j]
            inter = len(sh & other)
            if inter / (len(sh) + len(other) - inter) >= max_jaccard:
                duplicate = True
                break
        if duplicate:
            report.dropped["near-duplicate"] += 1
            continue
        k = len(kept_shingles)
        kept_shingles.append(sh)
        for s in sh:
            index.setdefault(s, []).append(k)
        report.kept.append(text)
        report.kept_records.append(position)
        report.per_persona[rec.get("persona", "?")] += 1
    return report


# ---- user prompt files --------------------------------------------------------------------------


def read_prompt_file(path: str | os.PathLike[str]) -> list[str | list[dict[str, str]]]:
    """Prompts from a JSON-lines file: one ``{"prompt": "..."}`` or ``{"messages": [...]}`` per
    line (blank lines skipped). ``messages`` is a chat ending with a user turn; each message has
    a ``role`` and a string ``content``. A bad line raises :class:`InvalidInputError` naming it."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as err:
        raise InvalidInputError(f"cannot read the prompt file {path}: {err}") from err
    prompts: list[str | list[dict[str, str]]] = []
    for no, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}, line {no}"
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as err:
            raise InvalidInputError(f"{where}: not valid JSON ({err.msg})") from err
        if not isinstance(rec, dict) or ("prompt" in rec) == ("messages" in rec):
            raise InvalidInputError(
                f'{where}: expected an object with exactly one of "prompt" or "messages"'
            )
        if "prompt" in rec:
            if not isinstance(rec["prompt"], str) or not rec["prompt"].strip():
                raise InvalidInputError(f'{where}: "prompt" must be a non-empty string')
            prompts.append(rec["prompt"])
            continue
        msgs = rec["messages"]
        if (
            not isinstance(msgs, list)
            or not msgs
            or not all(
                isinstance(m, dict)
                and isinstance(m.get("role"), str)
                and isinstance(m.get("content"), str)
                for m in msgs
            )
        ):
            raise InvalidInputError(
                f'{where}: "messages" must be a non-empty list of {{"role": str, "content": str}}'
            )
        if msgs[-1]["role"] != "user":
            raise InvalidInputError(f'{where}: the last of "messages" must be a user turn')
        prompts.append([{"role": m["role"], "content": m["content"]} for m in msgs])
    if not prompts:
        raise InvalidInputError(f"the prompt file {path} holds no prompts")
    return prompts
