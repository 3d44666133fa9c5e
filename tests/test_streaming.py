"""Streaming decodes multi-byte characters whole, however the rounds split their tokens."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from caddtree.util.streaming import IncrementalDecoder


def byte_level_tokenizer() -> PreTrainedTokenizerFast:
    """One token per byte (GPT-2's byte alphabet, no merges): every non-ASCII character spans
    several tokens, the hardest case for streaming."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    vocab["<eos>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


TOKENIZER = byte_level_tokenizer()
TEXT = "用中文回答：天空为什么是蓝色的？\nCafé ☕ — naïve 🎉\nend"


def stream(ids, cuts):
    decoder = IncrementalDecoder(TOKENIZER)
    pieces, start = [], 0
    for cut in [*cuts, len(ids)]:
        pieces.append(decoder.push(ids[start:cut]))
        start = cut
    pieces.append(decoder.flush())
    return pieces


def test_every_multibyte_character_spans_several_tokens():
    ids = TOKENIZER.encode(TEXT)
    assert len(ids) == len(TEXT.encode("utf-8"))
    # decoding one token alone breaks a character: this is the failure streaming must avoid
    assert "\ufffd" in TOKENIZER.decode(ids[:1] + ids[1:2])


def test_one_token_per_round_streams_the_exact_text():
    ids = TOKENIZER.encode(TEXT)
    pieces = stream(ids, range(1, len(ids)))
    assert "".join(pieces) == TEXT
    assert not any("\ufffd" in p for p in pieces)
    assert pieces[-1] == ""  # nothing was left held back once the last character was complete


@settings(max_examples=60, deadline=None)
@given(
    text=st.text(
        alphabet=st.characters(exclude_categories=("Cs",), exclude_characters="\ufffd"),
        max_size=40,
    ),
    data=st.data(),
)
def test_any_split_streams_the_exact_text(text, data):
    ids = TOKENIZER.encode(text)
    cuts = sorted(data.draw(st.sets(st.integers(0, max(len(ids), 0)), max_size=len(ids))))
    pieces = stream(ids, cuts)
    assert "".join(pieces) == TOKENIZER.decode(ids)
    assert not any("\ufffd" in p for p in pieces)


def test_an_unfinished_character_is_flushed_at_the_end():
    ids = TOKENIZER.encode("ok 天")[:-1]  # the generation stopped inside a character
    decoder = IncrementalDecoder(TOKENIZER)
    assert decoder.push(ids) == "ok "
    assert decoder.flush() == "\ufffd"


def test_special_tokens_are_skipped():
    ids = TOKENIZER.encode("hi") + [TOKENIZER.convert_tokens_to_ids("<eos>")]
    assert "".join(stream(ids, [1, 2])) == "hi"


# ---- `caddtree generate` streams through the incremental decoder --------------------------------


class _ByteLevelGenerator:
    """Stands in for a loaded SpeculativeGenerator: its "generation" hands TEXT's byte tokens to
    the callback two at a time, so most multi-byte characters are split between rounds."""

    def __init__(self):
        import torch

        self.tokenizer = TOKENIZER
        self.cost_model = None
        self.verifier = type("Verifier", (), {"dtype": torch.float32})()

    def generate(self, prompt, method="ar", callback=None, **kwargs):
        from caddtree.api import GenerationResult
        from caddtree.engine.decoding import GenerationStats

        ids = TOKENIZER.encode(TEXT)
        callback(None, ids[:1])
        for start in range(1, len(ids), 2):
            callback(None, ids[start : start + 2])
        stats = GenerationStats.from_rounds(method, [], len(ids), 1.0, 0.25, "max_new_tokens")
        return GenerationResult(TOKENIZER.decode(ids), ids, [0], method, stats)


def test_the_cli_streams_whole_characters(capsys, monkeypatch, tmp_path):
    from caddtree.api import SpeculativeGenerator
    from caddtree.cli import main

    monkeypatch.setattr(
        SpeculativeGenerator,
        "from_pretrained",
        classmethod(lambda cls, *a, **k: _ByteLevelGenerator()),
    )
    assert main(["generate", "--target", str(tmp_path), "--method", "ar", "hi"]) == 0
    out, err = capsys.readouterr()
    assert out == TEXT + "\n"  # streamed piece by piece, never a broken character
    assert "\ufffd" not in out
    # per-round decoding would have broken characters: the check has teeth
    ids = TOKENIZER.encode(TEXT)
    naive = TOKENIZER.decode(ids[:1]) + "".join(
        TOKENIZER.decode(ids[s : s + 2]) for s in range(1, len(ids), 2)
    )
    assert "\ufffd" in naive
    assert "TTFT 250 ms" in err
