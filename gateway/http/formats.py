"""OpenAI response bodies and stream chunks for completions and chat completions."""

from __future__ import annotations

import codecs
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from gateway.core.errors import invalid
from protos.logprobs import PositionLogprobs, TokenLogprob

MAX_REQUEST_ID = 256  # characters of an X-Request-Id header taken as the response's id


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """OpenAI's usage; ``cached_tokens`` is there at 0 too (as OpenAI and vLLM's prompt tokens
    details report it): a benchmark client reads its absence as a server without cache reports."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def response_id(prefix: str, request_id: str | None, headers: Mapping[str, str]) -> str:
    """The id a response shows, as vLLM makes it: ``prefix-`` and the client's X-Request-Id
    header, else the body's ``request_id``, else a random one. Only the client sees it: the
    work sent to workers keeps ids of its own, unique even when two clients' ids are not."""
    given = headers.get("x-request-id")
    if given is not None and not 0 < len(given) <= MAX_REQUEST_ID:
        raise invalid(f"the X-Request-Id header must be 1 to {MAX_REQUEST_ID} characters")
    return f"{prefix}-{given or request_id or uuid.uuid4().hex}"


def envelope(rid: str, obj: str, created: int, model: str, choices: list[Any]) -> dict[str, Any]:
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": choices}


# ---- completions (legacy logprobs: parallel lists) ----


def token_id_name(token_id: int) -> str:
    """A token as vLLM's ``return_tokens_as_token_ids`` names it in logprobs."""
    return f"token_id:{token_id}"


def _legacy_name(t: TokenLogprob, by_id: bool) -> str:
    return token_id_name(t.token_id) if by_id else _legacy_token(t.token, t.token_bytes)


def _legacy_token(text: str, raw: bytes) -> str:
    """A token as legacy logprobs show it: its text, or, where it holds only part of a
    character (its text has U+FFFD and its bytes are known), ``bytes:\\xNN...`` as OpenAI does."""
    if "\ufffd" in text and raw:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
    return text


_CONTINUATION = bytes(range(0x80, 0xC0))  # a UTF-8 byte that continues a character


class TextOffsets:
    """Where each token starts, in characters of the text the tokens spell: the characters that
    all earlier tokens' bytes complete. The pieces of one split character all point at where that
    character starts, and no offset passes the text's end.

    Bytes that continue a character begun before ``start`` (a streamed chunk that opens with the
    rest of a character the previous chunk's text held back) belong to a character at ``start``."""

    def __init__(self, start: int) -> None:
        self.start = start
        self.chars = 0  # characters the bytes so far complete (after any leading tail)
        self.tail = False  # the bytes opened with the tail of a character begun before start
        self.begun = False  # a byte that starts a character has come
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="ignore")

    def next(self, raw: bytes) -> int:
        """The offset of a token with bytes ``raw``, which then count as seen."""
        in_tail = not self.begun and raw[:1] != raw[:1].lstrip(_CONTINUATION)
        at = self.start + (1 if self.tail and not in_tail else 0) + self.chars
        if not self.begun:
            rest = raw.lstrip(_CONTINUATION)
            self.tail = self.tail or len(rest) < len(raw)
            self.begun = bool(rest)
            raw = rest
        self.chars += len(self.decoder.decode(raw))
        return at


def completion_logprobs(
    entries: Sequence[PositionLogprobs],
    offset: int | TextOffsets,
    prompt_tokens: Sequence[str | bytes] = (),
    prompt_scores: Sequence[PositionLogprobs] = (),
    by_id: bool = False,
    prompt_ids: Sequence[int] = (),
) -> dict[str, Any]:
    """``{tokens, token_logprobs, top_logprobs, text_offset}``; echoed prompt tokens (their text,
    or their raw bytes) come first, with their logprobs from ``prompt_scores`` (positions 1..;
    the first token has none: null). ``offset`` is where the first token starts in the choice's
    text, or the offsets of the tokens before it (a :class:`TextOffsets` a stream carries over
    its chunks, advanced by these: counted from the tokens' bytes, not from the text a chunk
    released, which lags the tokens while a worker holds text back for a stop string);
    ``text_offset`` counts characters of that text (see TextOffsets). ``by_id``: every token
    named :func:`token_id_name` (offsets unchanged), the echoed ones by ``prompt_ids``."""
    tokens: list[str] = []
    token_logprobs: list[float | None] = [None] * len(prompt_tokens)
    top: list[dict[str, float] | None] = [None] * len(prompt_tokens)
    for j, score in enumerate(prompt_scores[: max(len(prompt_tokens) - 1, 0)], start=1):
        token_logprobs[j] = score.chosen.logprob
        top[j] = _legacy_top(score, by_id)
    offsets: list[int] = []
    where = offset if isinstance(offset, TextOffsets) else TextOffsets(offset)
    for i, p in enumerate(prompt_tokens):
        raw = p if isinstance(p, bytes) else p.encode("utf-8")
        text = p.decode("utf-8", errors="replace") if isinstance(p, bytes) else p
        offsets.append(where.next(raw))
        tokens.append(token_id_name(prompt_ids[i]) if by_id else _legacy_token(text, raw))
    for entry in entries:
        chosen = entry.chosen
        offsets.append(where.next(chosen.token_bytes or chosen.token.encode("utf-8")))
        tokens.append(_legacy_name(chosen, by_id))
        token_logprobs.append(chosen.logprob)
        top.append(_legacy_top(entry, by_id))
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top,
        "text_offset": offsets,
    }


def _legacy_top(entry: PositionLogprobs, by_id: bool) -> dict[str, float]:
    """A position's ``top_logprobs``: the ``logprobs`` most likely tokens and, as the OpenAI API
    and vLLM always include it, the chosen one (up to ``logprobs + 1`` entries; with
    ``logprobs=0`` the chosen one alone)."""
    top = {_legacy_name(t, by_id): t.logprob for t in entry.top}
    top.setdefault(_legacy_name(entry.chosen, by_id), entry.chosen.logprob)
    return top


# Each choice has vLLM's ``stop_reason`` beside ``finish_reason``: the stop string or stop token
# id that ended it, null for the end-of-sequence token, a length cut, or a chunk before the last.
StopReason = str | int | None


def completion_choice(
    index: int,
    text: str,
    logprobs: dict[str, Any] | None,
    finish_reason: str | None,
    stop_reason: StopReason = None,
) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason,
            "stop_reason": stop_reason}  # fmt: skip


def top_of(entries: Sequence[PositionLogprobs], n: int) -> list[PositionLogprobs]:
    """Each position with its ``n`` likeliest alternatives: the workers compute a prompt's as
    many as the larger of completions' ``logprobs`` (echoed) and ``prompt_logprobs`` asks."""
    return [replace(e, top=e.top[:n]) if len(e.top) > n else e for e in entries]


def prompt_logprobs(entries: Sequence[PositionLogprobs], n: int) -> list[dict[str, Any] | None]:
    """vLLM's ``prompt_logprobs``: per prompt position (the first has none: null) the prompt's
    token and its ``n`` top alternatives, by token id: ``{logprob, rank, decoded_token}``."""
    out: list[dict[str, Any] | None] = [None]
    for e in top_of(entries, n):
        position = {
            str(t.token_id): {
                "logprob": t.logprob,
                "rank": t.rank or j + 1,
                "decoded_token": t.token,
            }
            for j, t in enumerate(e.top)
        }
        position[str(e.chosen.token_id)] = {"logprob": e.chosen.logprob, "rank": e.chosen.rank,
                                            "decoded_token": e.chosen.token}  # fmt: skip
        out.append(position)
    return out


# ---- chat ----


def _chat_logprob(t: TokenLogprob, by_id: bool) -> dict[str, Any]:
    raw = t.token_bytes or t.token.encode("utf-8")  # the token's own bytes, even named by id
    token = token_id_name(t.token_id) if by_id else t.token
    return {"token": token, "logprob": t.logprob, "bytes": list(raw)}


def chat_logprobs(entries: Sequence[PositionLogprobs], by_id: bool = False) -> dict[str, Any]:
    """``by_id``: tokens named :func:`token_id_name` (vLLM's return_tokens_as_token_ids)."""
    return {
        "content": [
            {**_chat_logprob(e.chosen, by_id),
             "top_logprobs": [_chat_logprob(t, by_id) for t in e.top]}
            for e in entries
        ]
    }  # fmt: skip


def chat_choice(
    index: int,
    content: str,
    logprobs: dict[str, Any] | None,
    finish_reason: str | None,
    stop_reason: StopReason = None,
) -> dict[str, Any]:
    message = {"role": "assistant", "content": content}
    return chat_message_choice(index, message, logprobs, finish_reason, stop_reason)


def chat_message_choice(
    index: int,
    message: dict[str, Any],
    logprobs: dict[str, Any] | None,
    finish_reason: str | None,
    stop_reason: StopReason = None,
) -> dict[str, Any]:
    return {
        "index": index,
        "message": message,
        "logprobs": logprobs,
        "finish_reason": finish_reason,
        "stop_reason": stop_reason,
    }


def chat_delta(
    index: int,
    delta: dict[str, Any],
    logprobs: dict[str, Any] | None,
    finish_reason: str | None,
    stop_reason: StopReason = None,
) -> dict[str, Any]:
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason,
            "stop_reason": stop_reason}  # fmt: skip
