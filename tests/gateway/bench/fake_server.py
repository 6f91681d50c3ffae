"""A tiny OpenAI-compatible streaming server with known delays, for `tandem bench serve` tests."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route


@dataclass
class Behaviour:
    ttft_s: float = 0.05  # before the first token
    itl_s: float = 0.01  # between tokens
    fail_every: int = 0  # every n-th request gets HTTP 500
    error_frame_every: int = 0  # every n-th request ends with an SSE error frame after one token
    bodies: list[dict[str, Any]] = field(default_factory=list)
    in_flight: int = 0
    peak_in_flight: int = 0


def _sse(obj: object) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()


def _chunk(chat: bool, text: str) -> dict[str, Any]:
    choice = {"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text}
    return {
        "id": "x",
        "object": "chat.completion.chunk" if chat else "text_completion",
        "choices": [choice],
    }


def build_app(b: Behaviour) -> Starlette:
    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})

    async def complete(request: Request) -> Response:
        body = await request.json()
        b.bodies.append(body)
        number = len(b.bodies)
        if b.fail_every and number % b.fail_every == 0:
            error = {"message": "no decode worker can take this request", "type": "server_error"}
            return JSONResponse({"error": error}, status_code=503)
        chat = request.url.path.endswith("/chat/completions")
        tokens = int(body.get("max_completion_tokens") or body.get("max_tokens") or 16)
        broken = bool(b.error_frame_every and number % b.error_frame_every == 0)
        prompt = body.get("prompt")
        prompt_len = len(prompt) if isinstance(prompt, list) else 7

        async def stream() -> AsyncIterator[bytes]:
            b.in_flight += 1
            b.peak_in_flight = max(b.peak_in_flight, b.in_flight)
            try:
                await asyncio.sleep(b.ttft_s)
                yield _sse(_chunk(chat, "tok"))
                if broken:
                    yield _sse({"error": {"message": "decode worker died", "type": "server_error"}})
                    yield b"data: [DONE]\n\n"
                    return
                for _ in range(tokens - 1):
                    await asyncio.sleep(b.itl_s)
                    yield _sse(_chunk(chat, " tok"))
                usage = {"prompt_tokens": prompt_len, "completion_tokens": tokens,
                         "total_tokens": prompt_len + tokens}  # fmt: skip
                yield _sse({"id": "x", "choices": [], "usage": usage})
                yield b"data: [DONE]\n\n"
            finally:
                b.in_flight -= 1

        return StreamingResponse(stream(), media_type="text/event-stream")

    routes = [Route("/v1/models", models), Route("/v1/completions", complete, methods=["POST"]),
              Route("/v1/chat/completions", complete, methods=["POST"])]  # fmt: skip
    return Starlette(routes=routes)


@contextmanager
def serve(b: Behaviour) -> Iterator[str]:
    """Run the app on 127.0.0.1 (a free port) in a thread; yields the base URL."""
    config = uvicorn.Config(
        build_app(b), host="127.0.0.1", port=0, log_level="warning", lifespan="off"
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "fake server did not start"
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
