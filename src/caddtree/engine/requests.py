"""The one request type: what to decode, checked once, and (filled in) what came of it.

:meth:`caddtree.api.SpeculativeGenerator.request` makes a :class:`GenerationRequest` from
``generate``'s arguments (:func:`encode_prompt`, :func:`build_request`); ``generate`` decodes it
with :func:`caddtree.engine.decoding.decode`, and :class:`caddtree.engine.batching.BatchDecoder`
decodes many together (``caddtree serve --max-batch``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..core.sampling import Sampler
from ..util.checks import (
    chat_messages,
    check_chat_template_kwargs,
    check_int,
    check_stop,
    check_text,
    token_ids,
)
from ..util.errors import InvalidInputError
from .decoding import GenerationResult, GenerationStats, RoundStats, TreePolicy, criteria_list
from .tokens import chat_template_ids, stop_string_criterion

__all__ = [
    "GenerationRequest",
    "RequestSettings",
    "build_request",
    "draft_block",
    "encode_prompt",
]


@dataclass(eq=False)
class GenerationRequest:
    """One request: what to decode, and (filled in by :class:`~caddtree.engine.batching.BatchDecoder`)
    its output.

    ``prompt_ids`` and ``policy`` (:func:`caddtree.engine.decoding.make_policy`) say what; at most
    ``max_new_tokens`` tokens come out, and a token of ``stop_token_ids`` ends the output after
    itself, and so does one at which a criterion of ``stopping_criteria`` fires (transformers'
    form, as :func:`~caddtree.engine.decoding.decode` takes them). ``sampler`` chooses the target's tokens (greedy by
    default; give each sampled request its own seeded sampler).
    :meth:`caddtree.api.SpeculativeGenerator.request` makes one from ``generate``'s arguments. ``output``, ``stop_reason`` (``None`` while it runs), ``rounds``
    (verification rounds) and ``accepted`` (draft tokens accepted) are filled in as it decodes.
    """

    prompt_ids: Sequence[int]
    policy: TreePolicy
    max_new_tokens: int
    sampler: Sampler = field(default_factory=Sampler)
    stop_token_ids: frozenset[int] = frozenset()
    stopping_criteria: list[Callable[..., Any]] = field(default_factory=list)
    output: list[int] = field(default_factory=list)
    stop_reason: str | None = None
    rounds: int = 0
    accepted: int = 0
    round_stats: list[RoundStats] = field(default_factory=list)
    started: float = 0.0  # perf_counter when its prefill began
    prefill_s: float = 0.0  # its prefill and first token
    wall_s: float = 0.0  # from its prefill to its last token

    def decode_settings(self) -> dict[str, Any]:
        """What :func:`~caddtree.engine.decoding.decode` takes of this request besides the prompt
        and the policy."""
        return {
            "max_new_tokens": self.max_new_tokens,
            "sampler": self.sampler,
            "stop_token_ids": self.stop_token_ids,
            "stopping_criteria": self.stopping_criteria,
        }

    def result(self) -> GenerationResult:
        """The finished request as :func:`~caddtree.engine.decoding.decode`'s result (no text)."""
        stats = GenerationStats.from_rounds(
            self.policy.name,
            self.round_stats,
            len(self.output),
            self.wall_s,
            self.prefill_s,
            self.stop_reason or "cancelled",
        )
        return GenerationResult(
            "", list(self.output), list(self.prompt_ids), self.policy.name, stats
        )

    @property
    def tau(self) -> float:
        """Tokens committed per verification round (the prefill's token left out)."""
        return (len(self.output) - 1) / self.rounds if self.rounds else float("nan")


def draft_block(proposer: Any, vocab: int) -> dict[str, int]:
    """The drafter's block size and the number of tokens it scores (its draft vocabulary, or the
    target's ``vocab``), for :func:`~caddtree.util.checks.check_tree_budgets`; empty without a
    drafter."""
    if proposer is None:
        return {}
    scored = len(proposer.token_map) if proposer.token_map is not None else vocab
    return {"block_size": proposer.block_size, "vocab": scored}


def _no_template_kwargs(kwargs: dict[str, Any], why: str) -> None:
    """Refuse chat-template arguments where no chat template is applied: they would be lost."""
    if kwargs:
        raise InvalidInputError(
            f"chat_template_kwargs ({', '.join(sorted(kwargs))}) only apply with the chat "
            f"template, and {why}; leave them out, or give text or chat messages with chat=True"
        )


def encode_prompt(
    tokenizer: Any,
    vocab: int,
    prompt: Any,
    chat: bool | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    """:meth:`SpeculativeGenerator.encode <caddtree.api.SpeculativeGenerator.encode>` with
    ``tokenizer`` (may be ``None``) and a target of ``vocab`` tokens."""
    template_kwargs = check_chat_template_kwargs(chat_template_kwargs)
    messages = chat_messages(prompt)
    if isinstance(prompt, str) or messages is not None:
        if tokenizer is None:
            raise InvalidInputError("this generator has no tokenizer; pass token ids instead")
        if messages is None:
            messages = [{"role": "user", "content": check_text(prompt)}]
        has_template = getattr(tokenizer, "chat_template", None) is not None
        if chat is None:
            chat = has_template
        if chat:
            if not has_template:
                raise InvalidInputError("the tokenizer has no chat template; use chat=False")
            return chat_template_ids(tokenizer, messages, template_kwargs)
        if not isinstance(prompt, str):
            raise InvalidInputError("chat messages need chat=True and a chat template")
        _no_template_kwargs(template_kwargs, "the prompt is not wrapped in the chat template")
        return [int(t) for t in tokenizer(prompt, add_special_tokens=True)["input_ids"]]
    if not isinstance(prompt, (list, tuple, torch.Tensor, np.ndarray, bytes, bytearray)):
        raise InvalidInputError(
            "a prompt is a string, a list of chat messages, or token ids (a list of ints, or "
            f"a 1-D integer tensor or array), got a value of type {type(prompt).__name__}"
        )
    _no_template_kwargs(template_kwargs, "a prompt of token ids is used as it is")
    return token_ids(prompt, vocab, "a prompt's token ids")


@dataclass(frozen=True)
class RequestSettings:
    """What :meth:`SpeculativeGenerator.generate <caddtree.api.SpeculativeGenerator.generate>`
    and ``request`` take besides the prompt and the method, with their defaults. The tree:
    ``budget`` (DDTree's), ``cost_model`` (CaDDTree's, a model or a file), ``max_budget``.
    Sampling, as transformers' ``generate``: ``temperature`` (0: greedy), ``top_p`` (1: off),
    ``top_k`` (0: off), ``min_p`` (0: off), ``repetition_penalty`` (1: off), ``seed``. The end:
    ``max_new_tokens``, ``stop_token_ids`` (``None``: the model's EOS; ``()``: none), ``stop``
    (strings: the output ends after the token that completes one, kept), ``stopping_criteria``
    (transformers-style). The prompt: ``chat``, ``chat_template_kwargs`` (see
    :func:`encode_prompt`). ``lookup``: DDTree's and CaDDTree's trees take copies from the
    context too. ``gate``: CaDDTree runs the drafter only in rounds where it pays (``False``:
    every round, as the paper's Algorithm 1; ``None``: with ``lookup`` only;
    :class:`~caddtree.engine.policies.DraftGate`). In a batch (the server, ``BatchDecoder``),
    whose rounds have no per-request time, only rounds with copies are gated."""

    budget: int | None = None
    cost_model: Any = None
    max_budget: int = 1024
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    max_new_tokens: int = 256
    stop_token_ids: Iterable[int] | None = None
    stop: str | Sequence[str] | None = None
    stopping_criteria: Iterable[Callable[..., Any]] | None = None
    chat: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    seed: int | None = None
    lookup: bool = False
    gate: bool | None = None

    @classmethod
    def of(cls, settings: dict[str, Any], caller: str = "request") -> RequestSettings:
        """``settings`` by name; a name that is not a setting is a ``TypeError``, as Python's
        for an unexpected keyword argument of ``caller``, with the list of settings."""
        known = cls.__dataclass_fields__
        unknown = sorted(set(settings) - set(known))
        if unknown:
            raise TypeError(
                f"{caller}() got an unexpected keyword argument {unknown[0]!r}; the settings "
                f"are {', '.join(known)}"
            )
        return cls(**settings)


def build_request(
    policy: TreePolicy,
    settings: RequestSettings,
    encode: Callable[[], list[int]],
    *,
    tokenizer: Any,
    vocab: int,
    device: Any,
    default_stops: set[int],
) -> GenerationRequest:
    """The request of ``policy`` and the prompt ``encode()`` gives, every setting checked (the
    sampler's first, then the stop strings, the prompt, the stop tokens, ``max_new_tokens``)."""
    s = settings
    sampler = Sampler(
        s.temperature,
        s.top_p,
        seed=s.seed,
        device=device,
        top_k=s.top_k,
        min_p=s.min_p,
        repetition_penalty=s.repetition_penalty,
    )
    stop_strings = check_stop(s.stop)
    if stop_strings and tokenizer is None:
        raise InvalidInputError(
            "stop strings need a tokenizer and this generator has none; use stop_token_ids"
        )
    prompt_ids = encode()
    stops, stop_token_ids = set(default_stops), s.stop_token_ids
    if stop_token_ids is not None:
        if isinstance(stop_token_ids, Iterable) and not isinstance(
            stop_token_ids, (str, bytes, bytearray, torch.Tensor, np.ndarray)
        ):
            stop_token_ids = list(stop_token_ids)  # a set, a generator ...
        stops = set(token_ids(stop_token_ids, vocab, "stop_token_ids"))
    criteria = criteria_list(s.stopping_criteria)
    if stop_strings:
        criteria.insert(0, stop_string_criterion(tokenizer, stop_strings))
    check_int("max_new_tokens", s.max_new_tokens)
    return GenerationRequest(
        prompt_ids,
        policy,
        s.max_new_tokens,
        sampler=sampler,
        stop_token_ids=frozenset(stops),
        stopping_criteria=criteria,
    )
