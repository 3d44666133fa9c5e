"""The OpenAI request fields the server reads, checked, and the response shapes it writes.

Request fields (chat: ``/v1/chat/completions``; completion: ``/v1/completions``):

* OpenAI's: ``model``, ``messages`` (chat) or ``prompt`` (completion: a string, token ids, or a
  list of one of them), ``max_completion_tokens`` / ``max_tokens``, ``temperature`` (0 to 2),
  ``top_p``, ``stop`` (a string or a list of strings), ``seed``, ``stream``,
  ``stream_options.include_usage``, ``n`` (must be 1);
* vLLM's and SGLang's sampling extras: ``top_k`` (0 or -1: off), ``min_p``,
  ``repetition_penalty``, ``ignore_eos``, ``chat_template_kwargs`` (chat);
* caddtree's: ``method`` (``ar``, ``dflash``, ``ddtree``, ``caddtree``, ``lookup``), ``budget``
  (ddtree's node budget), ``max_budget`` (caddtree's largest tree), ``cost_model`` (the name of a
  cost-model file in the server's ``--cost-model-dir``, for caddtree), ``lookup`` (true or false:
  copies from the context join ddtree's and caddtree's trees; default the server's ``--lookup``).

Fields that would change the output in ways caddtree does not implement (``logprobs``,
``presence_penalty``/``frequency_penalty`` other than 0, ``echo``, ``suffix``, ``tools``, a JSON
``response_format``) are refused with a 400 rather than silently ignored; other unknown fields are
ignored, as OpenAI-compatible servers do.
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..util.checks import check_method, is_int, is_number, stop_limit_problem
from ..util.errors import InvalidInputError

DEFAULT_MAX_REQUEST_BYTES = 2**21
"""The largest request body ``caddtree serve`` reads by default (2 MiB: a prompt that fills the
context of any model served here takes far less)."""

__all__ = [
    "OpenAIError",
    "OpenAIRequest",
    "StopText",
    "cut_at_stop",
    "error_body",
    "finite",
    "parse_request",
]


class OpenAIError(Exception):
    """An error response: HTTP ``status`` with OpenAI's ``{"error": {...}}`` body."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,  # noqa: A002 - OpenAI's field name
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(
    message: str,
    type: str = "invalid_request_error",  # noqa: A002
    param: str | None = None,
    code: str | None = None,
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def finite(value: Any) -> Any:
    """``value`` with every NaN or infinite float replaced by ``None`` (JSON has neither)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


# ---- the request ----------------------------------------------------------------------------------


@dataclass
class OpenAIRequest:
    """A checked OpenAI request body (what the client asked; :class:`caddtree.engine.batching.
    GenerationRequest` is what is decoded). ``prompt`` is a list of chat messages (chat), or a string or token ids
    (completion). Sampling fields are ``None`` where the request left them out."""

    kind: str  # "chat" or "completion"
    prompt: Any
    model: str | None = None
    stream: bool = False
    include_usage: bool = False
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    ignore_eos: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    method: str | None = None
    budget: int | None = None
    max_budget: int | None = None
    cost_model: str | None = None
    lookup: bool | None = None


_MISSING = object()


class _Fields:
    """Typed access to the request body with OpenAI-style 400 errors naming the field."""

    def __init__(self, body: dict[str, Any]):
        self.body = body

    def get(self, name: str) -> Any:
        value = self.body.get(name, _MISSING)
        return None if value is _MISSING else value

    def number(
        self,
        name: str,
        default: float | None,
        low: float,
        high: float,
        *,
        low_open: bool = False,
    ) -> float | None:
        value = self.get(name)
        if value is None:
            return default
        ok = is_number(value) and math.isfinite(value)
        ok = ok and (value > low if low_open else value >= low) and value <= high
        if not ok:
            left = "(" if low_open else "["
            right = "]" if math.isfinite(high) else ")"
            raise OpenAIError(
                f"{name} must be a number in {left}{low:g}, {high:g}{right}, got {value!r}",
                param=name,
            )
        return float(value)

    def integer(self, name: str, minimum: int) -> int | None:
        value = self.get(name)
        if value is None:
            return None
        if not is_int(value) or value < minimum:
            what = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
            raise OpenAIError(f"{name} must be {what}, got {value!r}", param=name)
        return int(value)

    def boolean(self, name: str) -> bool:
        value = self.get(name)
        if value is None:
            return False
        if not isinstance(value, bool):
            raise OpenAIError(f"{name} must be true or false, got {value!r}", param=name)
        return value

    def string(self, name: str) -> str | None:
        value = self.get(name)
        if value is not None and not isinstance(value, str):
            raise OpenAIError(f"{name} must be a string, got {value!r}", param=name)
        return value

    def unsupported(self, name: str, neutral: tuple[Any, ...], what: str) -> None:
        value = self.get(name)
        if value is not None and value not in neutral:
            raise OpenAIError(f"{name} is not supported by caddtree serve ({what})", param=name)


def _message_content(content: Any, index: int) -> str:
    """A message's text: a string, or OpenAI's list of ``{"type": "text", "text": ...}`` parts."""
    param = f"messages[{index}].content"
    if content is None:
        raise OpenAIError(
            f"{param} is null; send the message's text as a string (or a list of text parts). "
            "Null content is allowed only on an assistant message carrying tool_calls, and "
            "caddtree serve makes no tool calls",
            param=param,
        )
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text"):
                raise OpenAIError(f"{param}: only text content parts are supported", param=param)
            text = part.get("text")
            if not isinstance(text, str):
                raise OpenAIError(f"{param}: a text part needs a string 'text'", param=param)
            texts.append(text)
        return "".join(texts)
    raise OpenAIError(f"{param} must be a string or a list of text parts", param=param)


def _messages(value: Any) -> list[dict[str, str]]:
    if value is None:
        raise OpenAIError(
            "messages is required: a list of {role, content} objects", param="messages"
        )
    if not isinstance(value, list) or not value:
        raise OpenAIError(
            "messages must be a non-empty list of {role, content} objects", param="messages"
        )
    out = []
    for i, message in enumerate(value):
        if not isinstance(message, dict):
            raise OpenAIError(f"messages[{i}] must be an object", param=f"messages[{i}]")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise OpenAIError(f"messages[{i}].role must be a string", param=f"messages[{i}].role")
        if "content" not in message:
            raise OpenAIError(
                f"messages[{i}] has no content; send the message's text as a string",
                param=f"messages[{i}].content",
            )
        out.append({"role": role, "content": _message_content(message["content"], i)})
    return out


def _completion_prompt(value: Any) -> str | list[int]:
    """A completion prompt: a string, a list of token ids, or a list holding one of those."""
    if value is None:
        raise OpenAIError("prompt is required: a string or a list of token ids", param="prompt")
    if isinstance(value, list) and value and all(is_int(t) for t in value):
        return [int(t) for t in value]
    if isinstance(value, list):
        if len(value) != 1:
            raise OpenAIError(
                "prompt must be one string or one list of token ids (batches are not supported; "
                "send one request per prompt)",
                param="prompt",
            )
        value = value[0]
        if isinstance(value, list) and value and all(is_int(t) for t in value):
            return [int(t) for t in value]
    if not isinstance(value, str):
        raise OpenAIError("prompt must be a string or a list of token ids", param="prompt")
    return value


def _stop(value: Any) -> list[str]:
    if value is None:
        return []
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise OpenAIError("stop must be a non-empty string or a list of them", param="stop")
    problem = stop_limit_problem(stops)
    if problem is not None:
        raise OpenAIError(problem, param="stop")
    return list(dict.fromkeys(stops))


def parse_request(body: Any, kind: str) -> OpenAIRequest:
    """Check the JSON ``body`` of a ``kind`` (``"chat"`` or ``"completion"``) request."""
    if not isinstance(body, dict):
        raise OpenAIError("the request body must be a JSON object")
    f = _Fields(body)
    model = f.string("model")
    _refuse_unsupported(f)
    prompt, template_kwargs = _request_prompt(f, kind)
    stream, include_usage = _stream_fields(f)

    max_tokens = f.integer("max_completion_tokens", 1)
    if max_tokens is None:
        max_tokens = f.integer("max_tokens", 1)

    top_k = f.get("top_k")
    if top_k is not None and (not is_int(top_k) or top_k < -1):
        raise OpenAIError(
            f"top_k must be an integer >= 0 (0 or -1: off), got {top_k!r}", param="top_k"
        )
    seed = f.get("seed")
    if seed is not None and (not is_int(seed) or not 0 <= seed < 2**64):
        raise OpenAIError(f"seed must be an integer in [0, 2**64), got {seed!r}", param="seed")

    method, budget, cost_model = _method_fields(f)

    return OpenAIRequest(
        kind=kind,
        prompt=prompt,
        model=model,
        stream=stream,
        include_usage=include_usage,
        max_tokens=max_tokens,
        temperature=f.number("temperature", None, 0.0, 2.0),
        top_p=f.number("top_p", 1.0, 0.0, 1.0, low_open=True),
        top_k=0 if top_k in (None, -1) else int(top_k),
        min_p=f.number("min_p", 0.0, 0.0, 1.0),
        repetition_penalty=f.number("repetition_penalty", 1.0, 0.0, math.inf, low_open=True),
        stop=_stop(f.get("stop")),
        seed=None if seed is None else int(seed),
        ignore_eos=f.boolean("ignore_eos"),
        chat_template_kwargs=template_kwargs,
        method=method,
        budget=budget,
        max_budget=f.integer("max_budget", 1),
        cost_model=cost_model,
        lookup=_lookup_field(f, method),
    )


def _refuse_unsupported(f: _Fields) -> None:
    """Refuse the fields that would change the output in ways caddtree does not implement."""
    n = f.integer("n", 1)
    if n is not None and n != 1:
        raise OpenAIError("n must be 1: caddtree serve makes one choice per request", param="n")
    if f.integer("best_of", 1) not in (None, 1):
        raise OpenAIError("best_of must be 1", param="best_of")
    f.unsupported("logprobs", (False, 0), "no log-probabilities are returned")
    f.unsupported("top_logprobs", (0,), "no log-probabilities are returned")
    f.unsupported("presence_penalty", (0, 0.0), "use repetition_penalty")
    f.unsupported("frequency_penalty", (0, 0.0), "use repetition_penalty")
    f.unsupported("logit_bias", ({},), "no logit bias")
    f.unsupported("tools", ([],), "no tool calls")
    f.unsupported("functions", ([],), "no function calls")
    f.unsupported("echo", (False,), "the prompt is not echoed")
    f.unsupported("suffix", ("",), "no insertion")
    response_format = f.get("response_format")
    if response_format is not None and not (
        isinstance(response_format, dict) and response_format.get("type") == "text"
    ):
        raise OpenAIError(
            "response_format is not supported by caddtree serve (plain text only)",
            param="response_format",
        )


def _request_prompt(f: _Fields, kind: str) -> tuple[Any, dict[str, Any] | None]:
    """The prompt (chat messages, or a completion prompt) and the chat template's extra
    arguments (``None`` for a completion)."""
    if kind == "chat":
        prompt: Any = _messages(f.get("messages"))
        template_kwargs = f.get("chat_template_kwargs")
        if template_kwargs is not None and not isinstance(template_kwargs, dict):
            raise OpenAIError(
                "chat_template_kwargs must be an object", param="chat_template_kwargs"
            )
    else:
        prompt = _completion_prompt(f.get("prompt"))
        template_kwargs = None
    return prompt, template_kwargs


def _stream_fields(f: _Fields) -> tuple[bool, bool]:
    """``stream``, and ``stream_options.include_usage`` (allowed with ``stream`` only)."""
    stream = f.boolean("stream")
    include_usage = False
    options = f.get("stream_options")
    if options is not None:
        if not stream:
            raise OpenAIError(
                "stream_options is only allowed with stream=true", param="stream_options"
            )
        if not isinstance(options, dict):
            raise OpenAIError("stream_options must be an object", param="stream_options")
        include_usage = _Fields(options).boolean("include_usage")
    return stream, include_usage


def _method_fields(f: _Fields) -> tuple[str | None, int | None, str | None]:
    """caddtree's ``method``, and ``budget`` and ``cost_model`` where the method takes them."""
    method = f.string("method")
    if method is not None:
        try:
            check_method(method)
        except InvalidInputError as exc:
            raise OpenAIError(str(exc), param="method") from None
    budget = f.integer("budget", 1)
    if budget is not None and method not in (None, "ddtree"):
        raise OpenAIError(f"budget only applies to method 'ddtree', not {method!r}", param="budget")
    cost_model = f.string("cost_model")
    if cost_model is not None and method not in (None, "caddtree"):
        raise OpenAIError(
            f"cost_model only applies to method 'caddtree', not {method!r}", param="cost_model"
        )
    return method, budget, cost_model


def _lookup_field(f: _Fields, method: str | None) -> bool | None:
    """caddtree's ``lookup`` (``None`` where the request leaves it out)."""
    lookup = f.get("lookup")
    if lookup is None:
        return None
    if not isinstance(lookup, bool):
        raise OpenAIError(f"lookup must be true or false, got {lookup!r}", param="lookup")
    if lookup and method not in (None, "ddtree", "caddtree"):
        raise OpenAIError(
            f"lookup adds copies from the context to the trees of ddtree and caddtree, not of "
            f"{method!r} (method 'lookup' decodes with copies alone)",
            param="lookup",
        )
    return lookup


# ---- stop strings in text --------------------------------------------------------------------------


def cut_at_stop(text: str, stops: Sequence[str]) -> tuple[str, bool]:
    """``text`` up to (not including) the first occurrence of any of ``stops``; and whether one
    occurred."""
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return (text[: min(hits)], True) if hits else (text, False)


class StopText:
    """Streams text so that no part of a stop string reaches the client.

    ``push(piece)`` returns the text that is now safe to send: it holds back the last
    ``len(longest stop) - 1`` characters (they may be the start of a stop string) and cuts the
    text where a stop string begins, after which it returns nothing. Without stop strings it
    passes text through.
    """

    def __init__(self, stops: Sequence[str]):
        self.stops = list(stops)
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.text = ""
        self.sent = 0
        self.stopped = False

    def push(self, piece: str) -> str:
        if self.stopped:
            return ""
        self.text += piece
        if not self.stops:
            end = len(self.text)
        else:
            start = max(0, self.sent - self.hold)
            hits = [i for i in (self.text.find(s, start) for s in self.stops) if i >= 0]
            if hits:
                end, self.stopped = max(min(hits), self.sent), True
            else:
                end = max(self.sent, len(self.text) - self.hold)
        out = self.text[self.sent : end]
        self.sent = end
        return out

    def finish(self, final_text: str) -> str:
        """What is left to send once the whole answer, ``final_text``, is known."""
        sent = self.text[: self.sent]
        final, _ = cut_at_stop(final_text, self.stops)
        self.stopped = True
        return final[len(sent) :] if final.startswith(sent) else ""


# ---- responses ----------------------------------------------------------------------------------------


def new_id(kind: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def completion_body(
    kind: str,
    request_id: str,
    model: str,
    text: str,
    finish: str,
    usage_: dict[str, int],
    stats: dict[str, Any],
) -> dict[str, Any]:
    """The non-streaming response: a ``chat.completion`` or a ``text_completion``."""
    if kind == "chat":
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": None,
            "finish_reason": finish,
        }
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        obj = "text_completion"
    return {
        "id": request_id,
        "object": obj,
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
        "usage": usage_,
        "caddtree": finite(stats),
    }


def chunk_body(
    kind: str,
    request_id: str,
    created: int,
    model: str,
    *,
    text: str | None = None,
    role: bool = False,
    finish: str | None = None,
    include_usage: bool = False,
) -> dict[str, Any]:
    """One streamed chunk: a ``chat.completion.chunk`` or a ``text_completion``."""
    if kind == "chat":
        delta: dict[str, Any] = {}
        if role:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        choice: dict[str, Any] = {
            "index": 0,
            "delta": delta,
            "logprobs": None,
            "finish_reason": finish,
        }
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        obj = "text_completion"
    body = {
        "id": request_id,
        "object": obj,
        "created": created,
        "model": model,
        "choices": [choice],
    }
    if include_usage:
        body["usage"] = None
    return body
