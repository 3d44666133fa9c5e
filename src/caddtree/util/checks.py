"""The one home of the library's argument checks, run before any model work.

``True`` is an ``int`` to Python and NumPy integers are not, so "is this an integer" is easy to get
wrong in a one-line check; every module asks here instead. The error messages name the argument
and say what it must be, so a caller can fix the call without reading the code. The checks of a
generation's arguments (tree budgets, sampling, prompt text and token ids) are here too, so that
`caddtree generate` can run them before it imports torch or loads a model: this module imports
neither.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from .errors import CaddtreeError, InvalidInputError

# The decoding methods: one round loop, four tree policies (caddtree.engine.decoding).
METHODS = ("ar", "dflash", "ddtree", "caddtree", "lookup")
DRAFTLESS_METHODS = ("ar", "lookup")
"""The methods that need no drafter: plain decoding, and copies from the context alone."""
DEFAULT_DDTREE_BUDGET = 64
"""The node budget of ``method="ddtree"`` when none is given (every front door's default)."""
RUNTIMES = ("auto", "compiled", "lean", "transformers")
"""The target's forward (``runtime=``, ``--runtime``): ``lean`` is caddtree's own
(:mod:`caddtree.runtime.lean`: Llama family and Qwen3), ``compiled`` the same compiled by inductor
(:mod:`caddtree.runtime.compiled`), ``transformers`` the model's own, ``auto`` the lean one on the
CPU wherever it runs the model, compiled where that wins (on CUDA only by name: untested there
yet)."""

__all__ = [
    "DEFAULT_DDTREE_BUDGET",
    "DRAFTLESS_METHODS",
    "METHODS",
    "RUNTIMES",
    "check_method",
    "check_runtime",
    "MAX_REPETITION_PENALTY",
    "MAX_TREE_NODES",
    "MIN_REPETITION_PENALTY",
    "MAX_STOP_LENGTH",
    "MAX_STOP_STRINGS",
    "MIN_TEMPERATURE",
    "RESERVED_CHAT_TEMPLATE_KWARGS",
    "check_chat_template_kwargs",
    "check_int",
    "check_sampling",
    "check_stop",
    "check_text",
    "check_tree_budgets",
    "is_int",
    "is_number",
    "prefix_count",
    "stop_limit_problem",
    "token_ids",
]


def is_int(value: Any) -> bool:
    """An integer (Python or NumPy), and not a bool."""
    return not isinstance(value, (bool, np.bool_)) and isinstance(value, (int, np.integer))


def is_number(value: Any) -> bool:
    """A real number (Python or NumPy, integer or float), and not a bool."""
    return not isinstance(value, (bool, np.bool_)) and isinstance(
        value, (int, float, np.integer, np.floating)
    )


def _describe(minimum: int) -> str:
    return {0: "a non-negative integer", 1: "a positive integer"}.get(
        minimum, f"an integer >= {minimum}"
    )


def check_int(
    name: str,
    value: Any,
    *,
    minimum: int = 1,
    allow_none: bool = False,
    error: type[CaddtreeError] = InvalidInputError,
) -> int | None:
    """``value`` as an ``int`` if it is an integer of at least ``minimum`` (``None`` passes when
    ``allow_none``); otherwise ``error`` saying ``"{name} must be a positive integer, got ..."``."""
    if value is None and allow_none:
        return None
    if not is_int(value) or value < minimum:
        or_none = " or None" if allow_none else ""
        raise error(f"{name} must be {_describe(minimum)}{or_none}, got {value!r}")
    return int(value)


# ---- the arguments of a generation ---------------------------------------------------------------


def check_runtime(runtime: Any) -> str:
    """``runtime`` if it is one of :data:`RUNTIMES`; otherwise an error that lists them."""
    if runtime not in RUNTIMES:
        raise InvalidInputError(f"unknown runtime {runtime!r}; choose one of {', '.join(RUNTIMES)}")
    return runtime


def check_method(method: Any) -> str:
    """``method`` if it is one of :data:`METHODS`; otherwise an error that lists them."""
    if method not in METHODS:
        raise InvalidInputError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")
    return method


MAX_TREE_NODES = 4096
"""The largest draft tree a round may verify (``budget`` of DDTree, ``max_budget`` of CaDDTree):
4096 nodes, the profiling limit and 4x the paper's largest tree. Verifying ``n`` nodes builds an
``n x n`` tree-attention mask and appends ``n`` entries to every layer's KV cache, so a typo such as
``budget=1000000`` would otherwise ask for hundreds of GiB."""

MIN_TEMPERATURE = 1e-6
"""The smallest sampling temperature above 0. Sampling divides the logits by the temperature; far
below this, the scaled logits overflow to infinity (``1e-320`` gives NaN probabilities) while the
distribution is already greedy decoding's, so use ``temperature=0`` for that."""


def prefix_count(depth: int, vocab: int, cap: int = MAX_TREE_NODES) -> int:
    """How many distinct draft prefixes (tree nodes) ``depth`` positions over ``vocab`` tokens
    allow, ``vocab + vocab**2 + ... + vocab**depth``, counted only up to ``cap + 1``."""
    total, level = 0, 1
    for _ in range(max(int(depth), 0)):
        level *= max(int(vocab), 0)
        total += level
        if total > cap or level == 0:
            break
    return min(total, cap + 1)


def check_tree_budgets(
    method: str,
    budget: Any,
    max_budget: Any,
    *,
    block_size: int | None = None,
    vocab: int | None = None,
    names: tuple[str, str] = ("budget", "max_budget"),
) -> int:
    """Check the tree size arguments of ``method`` and return the ``max_budget`` to use.

    A tree holds at most :data:`MAX_TREE_NODES` nodes, and no more than the distinct prefixes the
    drafter's block allows (:func:`prefix_count` of ``block_size - 1`` positions over the
    ``vocab`` tokens it scores, when both are given). A DDTree ``budget`` beyond either is refused
    (it asks for a tree that cannot be built); a CaDDTree ``max_budget`` is a ceiling, refused
    beyond :data:`MAX_TREE_NODES` and lowered to the prefix count. ``names`` are the argument
    names used in messages (``("--budget", "--max-budget")`` for the command line). Arguments of
    other methods are left to :func:`caddtree.engine.decoding.make_policy`.
    """
    holds = MAX_TREE_NODES
    why = (
        f"the limit of {MAX_TREE_NODES} nodes per tree (MAX_TREE_NODES; the paper uses up to 1024)"
    )
    if block_size is not None and vocab is not None:
        room = prefix_count(block_size - 1, vocab)
        if room < holds:
            holds = room
            why = (
                f"the {room} distinct prefixes the drafter's block of {block_size} positions "
                f"over {vocab} tokens can hold"
            )
    if method == "ddtree" and budget is not None:
        check_int(names[0], budget)
        if budget > holds:
            raise InvalidInputError(f"{names[0]} {budget} is above {why}; use at most {holds}")
    if method != "caddtree":
        return max_budget
    check_int(names[1], max_budget)
    if max_budget > MAX_TREE_NODES:
        raise InvalidInputError(
            f"{names[1]} {max_budget} is above the limit of {MAX_TREE_NODES} nodes per tree "
            f"(MAX_TREE_NODES; the paper uses up to 1024); use at most {MAX_TREE_NODES}"
        )
    return int(min(max_budget, holds))


MIN_REPETITION_PENALTY = 1e-6
MAX_REPETITION_PENALTY = 1e6
"""The range of ``repetition_penalty``. The penalty divides positive and multiplies negative
float32 scores; far outside this range the scores overflow (a penalty of ``1e-320`` is 0 in
float32), and within it a penalty already removes or favours repeats as much as it can."""

RESERVED_CHAT_TEMPLATE_KWARGS = ("conversation", "messages", "tokenize", "return_dict")
"""Arguments of ``apply_chat_template`` that caddtree sets itself and a caller may not override
through ``chat_template_kwargs``."""


def _number(name: str, value: Any) -> float:
    """``value`` as a float when it is a finite real number (not a bool)."""
    if isinstance(value, (bool, np.bool_)):
        raise InvalidInputError(f"{name} must be a number, not True/False")
    if not is_number(value) or not np.isfinite(float(value)):
        raise InvalidInputError(f"{name} must be a finite number, got {value!r}")
    return float(value)


def check_sampling(
    temperature: Any = 0.0,
    top_p: Any = 1.0,
    top_k: Any = 0,
    min_p: Any = 0.0,
    repetition_penalty: Any = 1.0,
    seed: Any = None,
) -> dict[str, Any]:
    """The sampling settings of a generation, checked, as a dict of plain Python numbers.

    ``temperature`` 0 (greedy decoding) or in ``[MIN_TEMPERATURE, inf)``; ``top_p`` in ``(0, 1]``
    (1 = off); ``top_k`` an integer >= 0 (0 = off); ``min_p`` in ``[0, 1)`` (0 = off);
    ``repetition_penalty`` in ``[MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY]`` (1 = off);
    ``seed`` ``None`` or an integer in ``[0, 2**64)``. The meaning of each is transformers'
    (``model.generate(do_sample=temperature > 0, temperature=..., top_k=..., ...)``).
    """
    t = _number("temperature", temperature)
    if t < 0:
        raise InvalidInputError(f"temperature must be a finite number >= 0, got {temperature!r}")
    if 0 < t < MIN_TEMPERATURE:
        raise InvalidInputError(
            f"temperature {temperature!r} is too small to sample with (the scaled logits "
            f"overflow); use 0 for greedy decoding or at least {MIN_TEMPERATURE:g}"
        )
    p = _number("top_p", top_p)
    if not 0 < p <= 1:
        raise InvalidInputError(f"top_p must be in (0, 1] (1 = off), got {top_p!r}")
    if not is_int(top_k) or top_k < 0:
        raise InvalidInputError(f"top_k must be an integer >= 0 (0 = off), got {top_k!r}")
    m = _number("min_p", min_p)
    if not 0 <= m < 1:
        raise InvalidInputError(f"min_p must be a number in [0, 1) (0 = off), got {min_p!r}")
    r = _number("repetition_penalty", repetition_penalty)
    if not MIN_REPETITION_PENALTY <= r <= MAX_REPETITION_PENALTY:
        raise InvalidInputError(
            f"repetition_penalty must be a number > 0 (1 = off, above 1 discourages repeats) "
            f"between {MIN_REPETITION_PENALTY:g} and {MAX_REPETITION_PENALTY:g}, got "
            f"{repetition_penalty!r}"
        )
    if seed is not None and (not is_int(seed) or not 0 <= seed < 2**64):
        raise InvalidInputError(f"seed must be an integer in [0, 2**64) or None, got {seed!r}")
    return {
        "temperature": t,
        "top_p": p,
        "top_k": int(top_k),
        "min_p": m,
        "repetition_penalty": r,
        "seed": None if seed is None else int(seed),
    }


MAX_STOP_STRINGS = 16
"""The most stop strings one generation takes (OpenAI's API takes 4)."""
MAX_STOP_LENGTH = 512
"""The most characters of one stop string."""


def stop_limit_problem(items: Sequence[Any]) -> str | None:
    """What is wrong with the number or length of stop strings ``items``, or ``None``."""
    if len(items) > MAX_STOP_STRINGS:
        return f"{len(items)} stop strings were given; at most {MAX_STOP_STRINGS} are taken"
    longest = max((len(s) for s in items if isinstance(s, str)), default=0)
    if longest > MAX_STOP_LENGTH:
        return (
            f"a stop string of {longest} characters was given; at most {MAX_STOP_LENGTH} are taken"
        )
    return None


def check_stop(stop: Any) -> list[str]:
    """Stop strings as a list: ``None`` is none, a string is one, a list or tuple holds several
    (at most :data:`MAX_STOP_STRINGS` of at most :data:`MAX_STOP_LENGTH` characters). Each must
    be a non-empty string of valid UTF-8."""
    if stop is None:
        return []
    items = [stop] if isinstance(stop, str) else stop
    if not isinstance(items, (list, tuple)):
        raise InvalidInputError(
            f"stop must be a string or a list of strings, got a value of type {type(stop).__name__}"
        )
    problem = stop_limit_problem(items)
    if problem is not None:
        raise InvalidInputError(problem)
    out = []
    for item in items:
        if not isinstance(item, str) or not item:
            raise InvalidInputError(
                f"stop strings must be non-empty strings, got {item!r} in stop={stop!r}"
            )
        out.append(check_text(item, f"the stop string {item!r}"))
    return out


def check_chat_template_kwargs(value: Any) -> dict[str, Any]:
    """Extra keyword arguments for the tokenizer's chat template (e.g. ``{"enable_thinking":
    False}`` for Qwen3) as a dict: ``None`` is none. Keys are strings, and not one of
    :data:`RESERVED_CHAT_TEMPLATE_KWARGS`."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InvalidInputError(
            "chat_template_kwargs must be a dict of keyword arguments for the chat template "
            f'(e.g. {{"enable_thinking": False}}), got a value of type {type(value).__name__}'
        )
    for key in value:
        if not isinstance(key, str):
            raise InvalidInputError(f"chat_template_kwargs keys must be strings, got {key!r}")
        if key in RESERVED_CHAT_TEMPLATE_KWARGS:
            raise InvalidInputError(
                f"chat_template_kwargs may not set {key!r}: caddtree sets "
                f"{', '.join(RESERVED_CHAT_TEMPLATE_KWARGS)} itself"
            )
    return dict(value)


def check_text(text: str, what: str = "the prompt") -> str:
    """Return ``text`` when it can be encoded as UTF-8. Python keeps bytes that are not UTF-8 (a
    command-line argument in Latin-1, say) as lone surrogates, which tokenizers cannot take."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        code = ord(text[exc.start])
        if 0xDC80 <= code <= 0xDCFF:  # a byte that was not UTF-8, kept by surrogateescape
            found = f"byte 0x{code - 0xDC00:02x} at character {exc.start}"
        else:
            found = f"the lone surrogate U+{code:04X} at character {exc.start}"
        raise InvalidInputError(
            f"{what} is not valid UTF-8 text ({found}); give it in UTF-8 (check the terminal's "
            "or the file's encoding)"
        ) from None
    return text


def token_ids(ids: Any, vocab_size: int, what: str = "token ids") -> list[int]:
    """Token ids as a list of ints: from a list or tuple of integers, or a 1-D integer torch
    tensor or numpy array. Refuses bytes, floats, booleans, nested lists and ids outside
    ``[0, vocab_size)`` with an :class:`InvalidInputError` naming ``what`` and the problem."""
    if isinstance(ids, (bytes, bytearray, memoryview)):
        raise InvalidInputError(
            f"{what} given as bytes are ambiguous: decode bytes to str for text, or pass token ids "
            "as a list of ints"
        )
    torch = sys.modules.get("torch")  # a tensor can only come from a torch already imported
    tensor_types = (torch.Tensor,) if torch is not None else ()
    if isinstance(ids, (*tensor_types, np.ndarray)):
        integer = (
            not (ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool)
            if isinstance(ids, tensor_types)
            else ids.dtype.kind in "iu"
        )
        kind = type(ids).__name__
        if not integer:
            raise InvalidInputError(f"{what} must be integers, got a {kind} of {ids.dtype}")
        if ids.ndim != 1:
            raise InvalidInputError(
                f"{what} must be 1-D, got a {kind} of shape {tuple(ids.shape)} (for a batch of "
                "one, pass ids[0])"
            )
        out = [int(t) for t in ids.tolist()]
    elif isinstance(ids, (list, tuple)):
        for t in ids:
            if isinstance(t, (bool, np.bool_)) or not isinstance(t, (int, np.integer)):
                raise InvalidInputError(
                    f"{what} must be integers, got {t!r} ({type(t).__name__}) in the list"
                )
        out = [int(t) for t in ids]
    else:
        raise InvalidInputError(
            f"{what} must be a list of ints or a 1-D integer tensor or array, got a value of type "
            f"{type(ids).__name__}"
        )
    bad = [t for t in out if not 0 <= t < vocab_size]
    if bad:
        raise InvalidInputError(
            f"token id {bad[0]} is outside the vocabulary of {vocab_size} tokens"
        )
    return out


def chat_messages(prompt: Any) -> list[dict[str, str]] | None:
    """``prompt`` as a list of chat messages when it is one (every item a dict), else ``None``;
    messages without a string ``role`` and ``content`` are refused."""
    if not isinstance(prompt, (list, tuple)) or not prompt:
        return None
    dicts = [isinstance(m, dict) for m in prompt]
    if not any(dicts):
        return None
    if not all(dicts):
        raise InvalidInputError("a prompt mixes chat messages (dicts) with other items")
    for i, message in enumerate(prompt):
        role, content = message.get("role"), message.get("content")
        if not isinstance(role, str) or not isinstance(content, str):
            raise InvalidInputError(
                f'chat message {i} needs a string "role" and a string "content", got {message!r}'
            )
        check_text(content, f"chat message {i}")
    return list(prompt)
