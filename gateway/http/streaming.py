"""SSE event streams for completions and chat completions.

Frames: ``data: {chunk}`` per piece of text; with include_usage a last chunk with
``choices: []`` and usage; with continuous_usage_stats (vLLM's) the usage so far in every chunk; an error mid-stream is one ``data: {"error": ...}`` frame. Just
before ``data: [DONE]`` comes the SSE comment ``: x-tandem-timing queue=..;prefill=..;...``
(clients ignore comments; it mirrors the non-streaming ``x-tandem-timing`` header).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import Any

from gateway.core.errors import APIError
from gateway.core.events import Chunk
from gateway.flows.chat_output import ChoiceOutput, OutputPlan
from gateway.flows.generation import Choice, Generation
from gateway.http import formats
from gateway.http.transport import DONE, sse
from gateway.observability.metrics import GatewayMetrics
from gateway.observability.stats import combined
from gateway.workers.rpc_errors import UpstreamError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StreamInfo:
    response_id: str
    object: str  # text_completion | chat.completion.chunk
    created: int
    model: str
    include_usage: bool
    logprobs: bool
    echo: bool = False
    plan: OutputPlan | None = None  # chat: tool calls or reasoning to read out of the text
    # vLLM's prompt_logprobs (the alternatives asked for; None: not asked): a frame of their
    # own, first
    prompt_logprobs: int | None = None
    logprobs_top: int = 0  # completions' logprobs: the alternatives of an echoed prompt token
    continuous_usage: bool = False  # vLLM's continuous_usage_stats: usage in every chunk
    token_id_logprobs: bool = False  # vLLM's return_tokens_as_token_ids
    echoed: str = ""  # chat: the text the reply's content starts with (vLLM's echo)
    # completions' echo with logprobs: a prompt token's raw bytes (its logprob entry's text)
    token_bytes: Callable[[int], bytes] | None = None
    score_only: bool = False  # completions' max_tokens 0 with echo: the prompt, nothing generated

    @property
    def echo_waits(self) -> bool:
        """Completions' echo waits for the choice's first chunk where it carries what that
        chunk brings: the prompt's logprobs, or (scoring only) the finish."""
        return self.echo and (self.logprobs or self.score_only)


Body = dict[str, Any]  # one chunk, before it is framed


def _frame(info: StreamInfo, choices: list[dict[str, Any]]) -> Body:
    return formats.envelope(info.response_id, info.object, info.created, info.model, choices)


def _usage(gen: Generation) -> dict[str, Any]:
    return formats.usage(gen.prompt_tokens, gen.completion_tokens, gen.cached_tokens)


def _emit(info: StreamInfo, gen: Generation, body: Body, opening: bool = False) -> bytes:
    if info.continuous_usage:  # an opening (chat's role) counts no token, as vLLM's
        completion = 0 if opening else gen.completion_tokens
        body["usage"] = formats.usage(gen.prompt_tokens, completion, gen.cached_tokens)
    return sse(body)


def _timing_comment(gen: Generation) -> bytes:
    return (
        b": x-tandem-timing " + combined([c.stats for c in gen.choices]).header().encode() + b"\n\n"
    )


def _completion_piece(
    info: StreamInfo, offsets: dict[int, formats.TextOffsets], choice: Choice, chunk: Chunk
) -> list[Body]:
    """``offsets``: per choice, its tokens' offsets so far, one count over the whole stream (as
    a whole response counts), from where its text starts (after the echoed prompt)."""
    logprobs = None
    if info.logprobs:
        logprobs = formats.completion_logprobs(
            chunk.logprobs, offsets[choice.index], by_id=info.token_id_logprobs
        )
    piece = formats.completion_choice(
        choice.index, chunk.text, logprobs, chunk.finish_reason, chunk.stop_reason
    )
    return [_frame(info, [piece])]


def _chat_piece(
    info: StreamInfo, offsets: dict[int, formats.TextOffsets], choice: Choice, chunk: Chunk
) -> list[Body]:
    logprobs = (
        formats.chat_logprobs(chunk.logprobs, info.token_id_logprobs) if info.logprobs else None
    )
    delta = {"content": chunk.text} if chunk.text else {}
    piece = formats.chat_delta(
        choice.index, delta, logprobs, chunk.finish_reason, chunk.stop_reason
    )
    return [_frame(info, [piece])]


def _parsed_chat_piece(
    info: StreamInfo, outputs: dict[int, ChoiceOutput], choice: Choice, chunk: Chunk
) -> list[Body]:
    """Chat with tool calls or reasoning: the text becomes OpenAI's typed deltas (content,
    reasoning_content, tool_calls); the chunk's logprobs ride on the first, its finish on the last."""
    out = outputs[choice.index]
    deltas = out.feed(chunk.text)
    finish = None
    if chunk.finish_reason is not None:
        deltas += out.finish()
        finish = out.finish_reason(chunk.finish_reason)
    logprobs = (
        formats.chat_logprobs(chunk.logprobs, info.token_id_logprobs) if info.logprobs else None
    )
    if not deltas and (finish is not None or logprobs is not None):
        deltas = [{}]
    last = len(deltas) - 1
    return [
        _frame(info, [formats.chat_delta(choice.index, delta, logprobs if i == 0 else None,
                                         finish if i == last else None,
                                         chunk.stop_reason if i == last else None)])
        for i, delta in enumerate(deltas)
    ]  # fmt: skip


def _prompt_logprobs_frame(info: StreamInfo, choice: Choice, chunk: Chunk) -> Body:
    """vLLM's prompt_logprobs, when the first chunk brings them: in the choice (completions) or
    beside the choices (chat)."""
    assert info.prompt_logprobs is not None
    scores = formats.prompt_logprobs(chunk.prompt_logprobs, info.prompt_logprobs)
    if info.object == "chat.completion.chunk":
        body = formats.envelope(info.response_id, info.object, info.created, info.model,
                                [formats.chat_delta(choice.index, {}, None, None)])  # fmt: skip
        body["prompt_logprobs"] = scores
        return body
    piece = {**formats.completion_choice(choice.index, "", None, None), "prompt_logprobs": scores}
    return _frame(info, [piece])


def _roles(info: StreamInfo, gen: Generation) -> list[Body]:
    """Chat: each choice's assistant role, sent when the first token of the request has come
    (as vLLM sends it): a client that times the first chunk with choices (``vllm bench serve``'s
    chat client) reads it as the first token, so sent up front it made TTFT read as ~0."""
    delta = {"role": "assistant", "content": info.echoed}
    return [_frame(info, [formats.chat_delta(c.index, delta, None, None)]) for c in gen.choices]


def _openings(info: StreamInfo, gen: Generation) -> list[Body]:
    """Completions with echo: the prompt first (unless it waits for the first chunk:
    :func:`_echo_frame`)."""
    if info.echo and not info.echo_waits:
        return [_frame(info, [formats.completion_choice(c.index, c.prompt_text, None, None)])
                for c in gen.choices]  # fmt: skip
    return []


def _echo_frame(info: StreamInfo, offsets: formats.TextOffsets, choice: Choice) -> Body:
    """A completion's echoed prompt, sent with its choice's first chunk (as vLLM's first chunk
    carries it): with logprobs, the prompt tokens' (the first null; the offsets then go on from
    the prompt's text, as a whole response counts them); scoring only (max_tokens 0), the
    finish too, the generated token dropped as a whole response drops it. vLLM's
    ``prompt_logprobs``, when asked for, ride along (no frame of their own)."""
    logprobs = None
    if info.logprobs:
        assert info.token_bytes is not None
        prompt = choice.item.prompt_ids
        logprobs = formats.completion_logprobs(
            (), offsets, [info.token_bytes(t) for t in prompt],
            formats.top_of(choice.prompt_logprobs, info.logprobs_top),
            info.token_id_logprobs, prompt,
        )  # fmt: skip
    finish: tuple[str | None, formats.StopReason] = (None, None)
    if info.score_only:
        choice.drop_generated()
        finish = (choice.finish_reason, choice.stop_reason)
    piece = formats.completion_choice(choice.index, choice.prompt_text, logprobs, *finish)
    if info.prompt_logprobs is not None:
        piece["prompt_logprobs"] = formats.prompt_logprobs(
            choice.prompt_logprobs, info.prompt_logprobs
        )
    return _frame(info, [piece])


async def stream_events(
    info: StreamInfo,
    gen: Generation,
    metrics: GatewayMetrics,
) -> AsyncGenerator[bytes, None]:
    piece: Any = _chat_piece if info.object == "chat.completion.chunk" else _completion_piece
    # each choice's token offsets, one count over the whole stream from the start of its text
    # (the echoed prompt's tokens count first: only with logprobs are offsets sent)
    state: Any = {c.index: formats.TextOffsets(0) for c in gen.choices}
    if info.plan is not None and not info.plan.plain:
        piece, state = _parsed_chat_piece, {c.index: ChoiceOutput(info.plan) for c in gen.choices}
    waiting = {c.index for c in gen.choices} if info.echo_waits else set()
    roles = _roles(info, gen) if info.object == "chat.completion.chunk" else []
    try:
        for body in _openings(info, gen):
            yield _emit(info, gen, body)
        async for choice, chunk in gen.events():
            if roles:
                yield b"".join(_emit(info, gen, body, opening=True) for body in roles)
                roles = []
            if choice.index in waiting:
                if info.score_only and chunk.finish_reason is None:
                    continue  # the finish carries the echo; nothing generated is shown
                waiting.discard(choice.index)
                yield _emit(info, gen, _echo_frame(info, state[choice.index], choice))
                if info.score_only:
                    continue
            elif info.prompt_logprobs is not None and chunk.prompt_logprobs:
                yield _emit(info, gen, _prompt_logprobs_frame(info, choice, chunk))
            if chunk.text or chunk.finish_reason is not None or (info.logprobs and chunk.logprobs):
                bodies = piece(info, state, choice, chunk)
                if bodies:
                    yield b"".join(_emit(info, gen, body) for body in bodies)
        if info.include_usage:
            yield sse({**_frame(info, []), "usage": _usage(gen)})
        yield _timing_comment(gen)
    except (UpstreamError, APIError) as e:
        error = e.api_error if isinstance(e, UpstreamError) else e
        metrics.observe_error(error.status)
        yield sse(error.body())
    except Exception:
        log.exception("stream %s failed", info.response_id)
        metrics.observe_error(500)
        yield sse(APIError(500, "internal error while streaming; see the gateway log").body())
    finally:
        gen.close()
    yield DONE
