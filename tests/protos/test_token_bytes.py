"""Raw token bytes for logprobs: a character split over tokens comes back whole when the tokens'
bytes are joined, for a byte-level BPE vocabulary (the embedded model's) and for SentencePiece
byte pieces."""

from __future__ import annotations

import os

import pytest
from tokenizers import Tokenizer

from protos.token_bytes import TokenBytes, byte_level_alphabet, is_byte_level
from services.model_files import prepare_model

TEXTS = [
    "I love 😀 and 日本語",
    "naïve café — “quoted”",
    "tab\tnew\nline  spaces",
    "👩‍👩‍👧 Ünïcödé ✓",
]


def test_byte_level_alphabet_is_gpt2s_bijection() -> None:
    alphabet = byte_level_alphabet()
    assert sorted(alphabet.values()) == list(range(256))
    assert alphabet["Ġ"] == 0x20 and alphabet["Ċ"] == 0x0A and alphabet["ð"] == 0xF0
    assert alphabet["A"] == 0x41 and alphabet["ĉ"] == 0x09


@pytest.fixture(scope="module")
def embedded_tokenizer() -> Tokenizer:
    return Tokenizer.from_file(os.path.join(prepare_model("embedded").hf_dir, "tokenizer.json"))


@pytest.mark.parametrize("text", TEXTS)
def test_byte_level_pieces_rebuild_the_text(embedded_tokenizer: Tokenizer, text: str) -> None:
    tok = embedded_tokenizer
    assert is_byte_level(tok.decoder)
    token_bytes = TokenBytes(tok.id_to_token, byte_level=True)
    ids = tok.encode(text, add_special_tokens=False).ids
    texts = [tok.decode([i]) for i in ids]
    assert b"".join(token_bytes(i, t) for i, t in zip(ids, texts, strict=True)) == text.encode()
    if "😀" in text or "👩" in text:  # these split over tokens: the vocabulary path ran
        assert any("\ufffd" in t for t in texts)


def test_sentencepiece_byte_pieces() -> None:
    """A byte-fallback vocabulary: id 7 is the byte 0xE2, id 8 is '▁hello'."""
    tb = TokenBytes({7: "<0xE2>", 8: "▁hello"}.get, byte_level=False)
    assert tb(7, "\ufffd") == b"\xe2"
    assert tb(8, " hello") == b" hello"  # whole text needs no vocabulary lookup
