"""OpenAI response bodies and stream chunks for completions and chat completions."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from gateway.events import PositionLogprobs, TokenLogprob


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    out: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if cached_tokens:
        out["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return out


def envelope(rid: str, obj: str, created: int, model: str, choices: list[Any]) -> dict[str, Any]:
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": choices}


# ---- completions (legacy logprobs: parallel lists) ----


def completion_logprobs(
    entries: Sequence[PositionLogprobs],
    offset: int,
    prompt_tokens: Sequence[str] = (),
) -> dict[str, Any]:
    """``{tokens, token_logprobs, top_logprobs, text_offset}``; echoed prompt tokens have null
    logprobs. ``offset`` is where the first token starts in the choice's text."""
    tokens: list[str] = list(prompt_tokens)
    token_logprobs: list[float | None] = [None] * len(prompt_tokens)
    top: list[dict[str, float] | None] = [None] * len(prompt_tokens)
    for entry in entries:
        tokens.append(entry.chosen.token)
        token_logprobs.append(entry.chosen.logprob)
        top.append({t.token: t.logprob for t in entry.top} if entry.top else {})
    offsets = []
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top,
        "text_offset": offsets,
    }


def completion_choice(
    index: int, text: str, logprobs: dict[str, Any] | None, finish_reason: str | None
) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


# ---- chat ----


def _chat_logprob(t: TokenLogprob) -> dict[str, Any]:
    raw = t.token_bytes or t.token.encode("utf-8")
    return {"token": t.token, "logprob": t.logprob, "bytes": list(raw)}


def chat_logprobs(entries: Sequence[PositionLogprobs]) -> dict[str, Any]:
    return {
        "content": [
            {**_chat_logprob(e.chosen), "top_logprobs": [_chat_logprob(t) for t in e.top]}
            for e in entries
        ]
    }


def chat_choice(
    index: int, content: str, logprobs: dict[str, Any] | None, finish_reason: str | None
) -> dict[str, Any]:
    return {
        "index": index,
        "message": {"role": "assistant", "content": content},
        "logprobs": logprobs,
        "finish_reason": finish_reason,
    }


def chat_delta(
    index: int, delta: dict[str, Any], logprobs: dict[str, Any] | None, finish_reason: str | None
) -> dict[str, Any]:
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
