"""The raw bytes of one token, for the ``bytes`` of OpenAI's logprobs.

A token decoded alone is text, except where it holds only part of a multi-byte character (an
emoji or a CJK character split over tokens): there it decodes to U+FFFD and its text says
nothing. Its bytes come from its vocabulary entry instead:

- byte-level BPE (GPT-2, Llama 3, Qwen, SmolLM): every byte is spelled as one printable
  character of a fixed 256-character alphabet (``Ġ`` for a space), read back byte by byte;
- SentencePiece byte fallback (Llama 2, Mistral): a byte is a token of its own, ``<0xE2>``.

Any other token is its text in UTF-8.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from typing import Any

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@functools.cache
def byte_level_alphabet() -> dict[str, int]:
    """Character -> byte of byte-level BPE: printable Latin-1 bytes stand for themselves, the
    other 68 (controls, space, NBSP, soft hyphen) for the characters from U+0100 on, in order."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    alphabet = {chr(b): b for b in printable}
    rest = (b for b in range(256) if b not in set(printable))
    alphabet.update({chr(0x100 + i): b for i, b in enumerate(rest)})
    return alphabet


def is_byte_level(decoder: Any) -> bool:
    """Whether a ``tokenizers`` decoder is byte-level BPE's."""
    return type(decoder).__name__ == "ByteLevel"


class TokenBytes:
    """``token_bytes(token_id, text)``: the bytes of a token whose decoded text is ``text``.

    ``piece`` gives a token's vocabulary entry (``convert_ids_to_tokens`` of a transformers
    tokenizer, ``id_to_token`` of a ``tokenizers.Tokenizer``); ``byte_level`` says whether its
    decoder is byte-level BPE's."""

    def __init__(self, piece: Callable[[int], Any], byte_level: bool) -> None:
        self.piece = piece
        self.byte_level = byte_level

    @classmethod
    def of(cls, tokenizer: Any) -> TokenBytes:
        """For a transformers tokenizer (its fast backend tells the decoder)."""
        backend = getattr(tokenizer, "backend_tokenizer", None)
        return cls(
            tokenizer.convert_ids_to_tokens, is_byte_level(getattr(backend, "decoder", None))
        )

    def __call__(self, token_id: int, text: str) -> bytes:
        if "\ufffd" not in text:
            return text.encode("utf-8")
        piece = self.piece(token_id)
        if not isinstance(piece, str):
            return text.encode("utf-8")
        if m := _BYTE_PIECE.fullmatch(piece):
            return bytes([int(m.group(1), 16)])
        alphabet = byte_level_alphabet()
        if self.byte_level and all(ch in alphabet for ch in piece):
            return bytes(alphabet[ch] for ch in piece)
        return text.encode("utf-8")
