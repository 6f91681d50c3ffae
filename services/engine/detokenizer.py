"""Incremental detokenization and stop strings, per request.

Text is released as tokens complete characters: what the tokens decode to up to a trailing
run of U+FFFD (a character begun and not finished yet); when a request has stop strings, the last
``max(len(stop)) - 1`` characters are held back until they can no longer start a stop string,
so a stream never shows part of a stop string that is then cut away. When the output ends inside
a character, that character's bytes are never released, as vLLM drops them (its detokenizers
release no text that ends in U+FFFD, and its final text is what they released), so the text is
``tokenizer.decode(output_ids)`` (with the prompt's leading-space context) less a trailing run of
U+FFFD, the same streamed and whole; nothing is left to flush at the end. Released text never
ends with U+FFFD, but where a stop string cuts it after an invalid byte.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

_CONTEXT = 6  # prompt tokens decoded with the output, so leading spaces come out right


class Decoder(Protocol):
    def decode(self, token_ids: Any, skip_special_tokens: bool = ...) -> str: ...


class _BackendDecoder:
    """A fast tokenizer's Rust ``decode`` called directly: what ``PreTrainedTokenizerFast``
    returns when it has no clean-up step to apply, without the Python around it (argument
    conversion and checks cost ~5x the decode itself, twice per generated token)."""

    def __init__(self, backend: Any) -> None:
        self._decode = backend.decode

    def decode(self, token_ids: Any, skip_special_tokens: bool = False) -> str:
        return str(self._decode(token_ids, skip_special_tokens=skip_special_tokens))


def fast_decoder(tokenizer: Any) -> Decoder:
    """``tokenizer`` itself, or its backend when the two decode alike: a fast tokenizer (a
    ``backend_tokenizer``) that cleans up no tokenization spaces."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return tokenizer  # type: ignore[no-any-return]
    return _BackendDecoder(backend)


def held_back(stop: Sequence[str]) -> int:
    """How many trailing characters of a request's text, unfinished, wait until they can no
    longer begin one of its ``stop`` strings: the longest one's length less one (0 without).
    Whoever sends part of a request's text (a prefill worker its first token) holds back as
    many, so that the worker going on with it (which starts from the same tokens) sends them."""
    return max(map(len, stop), default=1) - 1


@dataclass
class IncrementalDetokenizer:
    tokenizer: Decoder
    prompt_tail: list[int]
    stop: tuple[str, ...] = ()
    include_stop: bool = False
    skip_special: bool = True
    # stop strings count from this many output tokens on (vLLM's min_tokens: before it neither a
    # stop token nor a stop string ends the output; the sampler masks the tokens)
    min_tokens: int = 0
    ids: list[int] = field(default_factory=list)
    # decoded text not released yet: what a stop string may still claim (the released text is
    # not kept: appending to the whole output would copy it every token)
    text: str = ""
    _prefix: int = 0
    _read: int = 0
    _shown: int = 0  # characters past the text of ids[_prefix:_read] released already
    _stopped: bool = False  # a stop string matched: the text ends there
    _longest_stop: int = 0
    _outputs: int = 0  # output tokens added

    def __post_init__(self) -> None:
        self.ids = list(self.prompt_tail[-_CONTEXT:])
        self._prefix = 0
        self._read = len(self.ids)
        self._longest_stop = max(map(len, self.stop), default=0)

    def _dec(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special)

    def add(self, token_id: int) -> str | None:
        """Append a token; returns the matched stop string if the output must stop here."""
        self.ids.append(token_id)
        self._outputs += 1
        return self._advance()

    def _advance(self) -> str | None:
        ids = self.ids
        if self._read == len(ids) or self._stopped:
            return None
        before = self._dec(ids[self._prefix : self._read])
        after = self._dec(ids[self._prefix :])
        if len(after) <= len(before):
            return None
        new = after[len(before) :]
        # the characters before an unfinished one are final: what follows cannot change them;
        # the unfinished one waits for its last bytes (dropped if the output ends first)
        fresh = new.rstrip("\ufffd")[self._shown :]
        if not new.endswith("\ufffd"):
            self._prefix, self._read, self._shown = self._read, len(ids), 0
        else:
            self._shown += len(fresh)
        if not fresh:
            return None
        start = max(len(self.text) - self._longest_stop, 0)
        self.text += fresh
        if not self.stop or self._outputs < self.min_tokens:
            return None
        return self._check_stop(start)

    def _check_stop(self, search_from: int) -> str | None:
        for s in self.stop:
            idx = self.text.find(s, search_from)
            if idx != -1:
                self.text = self.text[: idx + len(s)] if self.include_stop else self.text[:idx]
                self._stopped = True
                return s
        return None

    def release(self, finished: bool) -> str:
        """New text safe to show now (everything, once finished)."""
        hold = 0 if finished else held_back(self.stop)
        end = max(len(self.text) - hold, 0)
        delta, self.text = self.text[:end], self.text[end:]
        return delta
