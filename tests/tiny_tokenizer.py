"""A character-level tokenizer for the tiny test models (built in code: no downloads).

Ids: 0 = <unk>, 1 = <eos>, then one id per character; everything stays below the tiny models'
mask token (the last id of their vocabulary). It has a small chat template, so the chat path of the
API is exercised too.
"""

from __future__ import annotations

import string

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

CHARS = string.ascii_lowercase + string.digits + " .,!?'-:;()\n" + string.ascii_uppercase
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'][0] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}a: {% endif %}"
)


def tiny_tokenizer(vocab_limit: int) -> PreTrainedTokenizerFast:
    vocab = {"<unk>": 0, "<eos>": 1}
    for ch in CHARS:
        if len(vocab) >= vocab_limit:
            break
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(".|\n"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<unk>")
    fast.chat_template = CHAT_TEMPLATE
    return fast
