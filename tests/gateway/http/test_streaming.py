"""SSE framing as benchmark clients time it: chat's role chunk goes out with the first token."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator
from typing import Any

import httpx
import pytest

from gateway.core.events import Chunk
from gateway.flows.generation import Choice
from gateway.http.streaming import StreamInfo, stream_events
from gateway.workers.work import WorkItem
from protos.sampling_params import SamplingParams
from tests.gateway.stack import Stack

pytestmark = pytest.mark.timeout(60)


class _Generation:
    """What ``stream_events`` reads of a Generation; counts the chunks handed out so far."""

    def __init__(self, choices: list[Choice], chunks: list[tuple[Choice, Chunk]]) -> None:
        self.choices, self._chunks, self.arrived = choices, chunks, 0

    @property
    def prompt_tokens(self) -> int:
        return sum(len(c.item.prompt_ids) for c in self.choices)

    @property
    def completion_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.choices)

    cached_tokens = 0

    async def events(self) -> AsyncGenerator[tuple[Choice, Chunk], None]:
        for choice, chunk in self._chunks:
            self.arrived += 1
            choice.add(chunk)
            yield choice, chunk

    def close(self) -> None:
        pass


def _frames(data: bytes) -> list[dict[str, Any]]:
    lines = data.decode().split("\n")
    return [json.loads(x[6:]) for x in lines if x.startswith("data: {")]


def test_chat_role_chunk_waits_for_the_first_token() -> None:
    """vLLM sends the role once the first output is there; a client that stamps TTFT on the
    first chunk with choices (``vllm bench serve``) read ~0 s when it went out up front."""
    choices = [
        Choice(i, WorkItem(f"r{i}", (1, 2, 3), SamplingParams(max_tokens=2))) for i in (0, 1)
    ]
    chunks = [
        (choices[1], Chunk((5,), "a")),
        (choices[0], Chunk((6,), "b")),
        (choices[0], Chunk((7,), "c", finish_reason="length")),
        (choices[1], Chunk((8,), "d", finish_reason="length")),
    ]
    gen = _Generation(choices, chunks)
    info = StreamInfo("chatcmpl-x", "chat.completion.chunk", 0, "m", include_usage=False,
                      logprobs=False, continuous_usage=True)  # fmt: skip

    async def read() -> list[tuple[int, bytes]]:
        return [(gen.arrived, piece) async for piece in stream_events(info, gen, None)]  # type: ignore[arg-type]

    pieces = asyncio.run(read())
    first_arrived, first = pieces[0]
    roles = _frames(first)
    assert first_arrived == 1, "the role chunk went out before any token had come"
    assert [f["choices"][0]["delta"] for f in roles] == [{"role": "assistant", "content": ""}] * 2
    assert [f["choices"][0]["index"] for f in roles] == [0, 1]
    assert all(f["usage"]["completion_tokens"] == 0 for f in roles)  # as vLLM's role chunk
    content = [f for _, p in pieces[1:] for f in _frames(p)]
    assert [f["choices"][0]["delta"].get("content") for f in content] == ["a", "b", "c", "d"]
    assert [f["usage"]["completion_tokens"] for f in content] == [1, 2, 3, 4]


def test_chat_error_before_the_first_token_sends_no_role(colocated: Stack) -> None:
    """A request that fails before its first token streams the error alone, as vLLM's."""
    colocated.workers[0].behavior.error_chunk = True
    body = {"model": "embedded", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    r = httpx.post(f"{colocated.base_url}/v1/chat/completions", json=body, timeout=30)
    frames = _frames(r.content)
    assert len(frames) == 1 and "error" in frames[0], frames
    assert r.text.rstrip().endswith("data: [DONE]")
