"""Streaming text out of a generation that produces a few token ids per round.

A byte-level tokenizer (GPT-2 style, as SmolLM2's and Qwen3's are) spreads one multi-byte character
over several tokens, and a round may end between them. Decoding each round's tokens on their own
then prints U+FFFD replacement characters in the middle of Chinese, emoji or accented text.
:class:`IncrementalDecoder` decodes the tokens of the current line together and holds back a
trailing incomplete character until the token that completes it arrives, as transformers'
streamers do.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

__all__ = ["IncrementalDecoder"]

_REPLACEMENT = "\ufffd"


class IncrementalDecoder:
    """Turns token ids that arrive in pieces into text that never splits a character.

    ``push(ids)`` returns the text that is now final; ``flush()`` returns what was held back (call
    it once, at the end). The concatenation of every returned piece equals
    ``tokenizer.decode(all_ids)`` for byte-level tokenizers. The decoded window restarts after each
    newline, so a long generation does not decode its whole output every round.
    """

    def __init__(self, tokenizer: Any, *, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._line: list[int] = []  # ids since the last emitted newline
        self._emitted = 0  # characters of the decoded line already returned

    def _decode(self) -> str:
        return self._tokenizer.decode(self._line, skip_special_tokens=self._skip)

    def push(self, token_ids: Iterable[int]) -> str:
        self._line.extend(int(t) for t in token_ids)
        text = self._decode()
        end = len(text)
        while end > self._emitted and text[end - 1] == _REPLACEMENT:
            end -= 1  # possibly the first bytes of a character whose last bytes are still to come
        piece = text[self._emitted : end]
        if end == len(text) and text.endswith("\n"):
            self._line, self._emitted = [], 0
        else:
            self._emitted = end
        return piece

    def flush(self) -> str:
        """The rest of the text, including a replacement character that never got completed."""
        piece = self._decode()[self._emitted :]
        self._line, self._emitted = [], 0
        return piece
