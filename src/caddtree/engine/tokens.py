"""The tokenizer's side of a request: its EOS ids, stop strings it can write, chat templates."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..util.checks import check_chat_template_kwargs
from ..util.errors import InvalidInputError
from .decoding import StopStrings

__all__ = [
    "CHAT_ROLES",
    "chat_template_ids",
    "check_chat_roles",
    "eos_token_ids",
    "stop_string_criterion",
]

CHAT_ROLES = ("system", "user", "assistant")
"""The roles every chat template takes."""

TEMPLATE_ROLES = ("tool", "developer")
"""Roles taken only where the chat template names them (a template that writes any role as it is
would pass an unknown one to the model as text it never saw in training)."""


def eos_token_ids(tokenizer: Any, model: Any) -> set[int]:
    """EOS ids from ``tokenizer`` and from ``model.generation_config`` (int or list; either may
    be missing)."""
    ids: set[int] = set()
    gen_config = getattr(model, "generation_config", None)
    for value in (
        getattr(tokenizer, "eos_token_id", None),
        getattr(gen_config, "eos_token_id", None),
    ):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return ids


def stop_string_criterion(tokenizer: Any, stop_strings: list[str]) -> StopStrings:
    """A :class:`~caddtree.engine.decoding.StopStrings` criterion for ``stop_strings`` (checked with
    :func:`check_stop`), or a clear error when ``tokenizer`` cannot write one of them (its
    characters encode to the unknown token), which could then never stop generation."""
    unknown = getattr(tokenizer, "unk_token_id", None)
    for stop in stop_strings:
        if unknown is not None and unknown in tokenizer.encode(stop, add_special_tokens=False):
            raise InvalidInputError(
                f"the tokenizer cannot write the stop string {stop!r} (its characters are not in "
                "the vocabulary), so it could never stop generation; leave it out"
            )
    return StopStrings(tokenizer, stop_strings)


def template_roles(tokenizer: Any) -> tuple[str, ...]:
    """The roles ``tokenizer``'s chat template takes: :data:`CHAT_ROLES`, and those of
    :data:`TEMPLATE_ROLES` it names as a quoted string."""
    template = getattr(tokenizer, "chat_template", None) or ""
    if isinstance(template, dict):  # several named templates
        template = "\n".join(str(t) for t in template.values())
    named = [r for r in TEMPLATE_ROLES if f"'{r}'" in template or f'"{r}"' in template]
    return CHAT_ROLES + tuple(named)


def check_chat_roles(tokenizer: Any, messages: Sequence[dict[str, str]]) -> None:
    """Refuse, with what to send instead, a message whose role the chat template does not take."""
    roles = template_roles(tokenizer)
    for i, message in enumerate(messages):
        role = message.get("role")
        if role not in roles:
            listed = ", ".join(f'"{r}"' for r in roles)
            raise InvalidInputError(
                f"chat message {i} has the role {role!r}, which this model's chat template does "
                f'not take; use one of {listed} (a user\'s text as "user", instructions as '
                '"system")'
            )


def chat_template_ids(
    tokenizer: Any,
    messages: Sequence[dict[str, str]],
    chat_template_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    """Token ids of ``messages`` in the tokenizer's chat template, ready for the assistant turn.

    ``chat_template_kwargs`` go to ``apply_chat_template`` and so to the template (e.g.
    ``{"enable_thinking": False}`` for Qwen3; ``add_generation_prompt`` may be overridden too).
    Roles are checked with :func:`check_chat_roles`."""
    kwargs = {"add_generation_prompt": True, **check_chat_template_kwargs(chat_template_kwargs)}
    check_chat_roles(tokenizer, messages)
    ids = tokenizer.apply_chat_template(list(messages), tokenize=True, return_dict=False, **kwargs)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # some versions return a BatchEncoding
        ids = ids["input_ids"]
    return [int(t) for t in ids]
