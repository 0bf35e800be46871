from __future__ import annotations

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from tokenizers import decoders as tk_decoders
from transformers import PreTrainedTokenizerFast

from omnistage.entrypoints.detokenizer import IncrementalDetokenizer, StopStringMatcher


@pytest.fixture(scope="module")
def byte_tokenizer():
    """Byte-level BPE with only the 256 byte tokens: every non-ASCII character spans several tokens."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tk_decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def test_incremental_text_equals_full_decode(byte_tokenizer):
    text = "héllo wörld — 你好 🎉 done"
    ids = byte_tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) > len(text)  # multi-byte characters span tokens
    detok = IncrementalDetokenizer(byte_tokenizer)
    pieces = [detok.add([i]) for i in ids]
    assert "".join(pieces) + detok.flush() == text
    assert all("\ufffd" not in p for p in pieces)  # half characters are held back, never sent
    # Chunked arrival gives the same text.
    detok2 = IncrementalDetokenizer(byte_tokenizer)
    out = "".join(detok2.add(ids[i:i + 3]) for i in range(0, len(ids), 3))
    assert out + detok2.flush() == text


def test_stop_strings_hold_back_and_cut():
    m = StopStringMatcher(["STOP", "xy"])
    out = [m.feed(p) for p in ["ab", "cS", "TO", "P and more"]]
    assert out == ["ab", "c", "", ""]
    assert m.stopped and m.flush() == ""
    m = StopStringMatcher(["STOP"])
    assert m.feed("ST") == "" and m.feed("ART") == "START" and m.feed("ST") == "" and m.flush() == "ST"
    assert not m.stopped
    m = StopStringMatcher(["long stop", "op"])
    assert m.feed("a long sto") == "a " and m.feed("p!") == "" and m.stopped  # earliest match wins
    assert StopStringMatcher([]).feed("anything") == "anything"
