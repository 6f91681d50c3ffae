"""Raw token bytes for logprobs: a character split over tokens comes back whole when the tokens'
bytes are joined, for the embedded (byte-level BPE) tokenizer and for SentencePiece byte pieces."""

from __future__ import annotations

import pytest

from services.engine.llm import LLM
from services.engine.token_bytes import TokenBytes, byte_level_alphabet

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


@pytest.mark.parametrize("text", TEXTS)
def test_engine_token_bytes_rebuild_the_text(llm: LLM, text: str) -> None:
    engine = llm.engine
    ids = engine.tokenizer.encode(text, add_special_tokens=False)
    pieces = [engine._token_logprob(i, -1.0) for i in ids]
    assert b"".join(p.token_bytes for p in pieces) == text.encode("utf-8")
    if "😀" in text or "👩" in text:  # these split over tokens: the vocabulary path ran
        assert any("\ufffd" in p.token for p in pieces)


class _SentencePieceLike:
    """A byte-fallback vocabulary: id 7 is the byte 0xE2, id 8 is '▁hello'."""

    def convert_ids_to_tokens(self, token_id: int) -> str:
        return {7: "<0xE2>", 8: "▁hello"}[token_id]


def test_sentencepiece_byte_pieces() -> None:
    tb = TokenBytes(_SentencePieceLike())
    assert tb(7, "\ufffd") == b"\xe2"
    assert tb(8, " hello") == b" hello"  # whole text needs no vocabulary lookup
