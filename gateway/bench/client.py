"""The load generator of `tandem bench serve`: streaming requests at Poisson arrivals.

One request is timed from just before it is sent: TTFT at the first chunk that carries text, ITL
between later text chunks, E2E at the end of the stream; token counts come from the usage chunk
(``stream_options.include_usage``).
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np

from gateway.bench.dataset import BenchPrompt

READ_TIMEOUT_S = 300.0  # the longest silence tolerated inside one stream


@dataclass
class RequestResult:
    ok: bool = False
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0  # seconds
    itl: list[float] = field(default_factory=list)  # seconds between text chunks
    latency: float = 0.0  # end to end, seconds
    error: str = ""


def request_body(p: BenchPrompt, model: str, endpoint: str) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
        "temperature": 0.0,
    }
    if endpoint.endswith("/chat/completions"):
        body["messages"] = p.messages
        body["max_completion_tokens"] = p.output_len
    else:
        body["prompt"] = p.prompt
        body["max_tokens"] = p.output_len
    return body


def _chunk_text(chunk: dict[str, Any]) -> str:
    texts = []
    for choice in chunk.get("choices") or []:
        texts.append(choice.get("text") or (choice.get("delta") or {}).get("content") or "")
    return "".join(texts)


def _error_message(raw: bytes, status: int) -> str:
    try:
        message = json.loads(raw)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = raw[:200].decode("utf-8", errors="replace")
    return f"HTTP {status}: {message}"


async def _consume(response: httpx.Response, result: RequestResult, start: float) -> None:
    last = start
    chunks = 0
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            result.ok = chunks > 0 or result.output_tokens > 0
            result.error = "" if result.ok else "the stream carried no tokens"
            return
        chunk = json.loads(data)
        if "error" in chunk:
            result.error = f"stream error: {chunk['error'].get('message', chunk['error'])}"
            return
        if usage := chunk.get("usage"):
            result.output_tokens = int(usage.get("completion_tokens") or 0)
            result.prompt_len = int(usage.get("prompt_tokens") or result.prompt_len)
        if _chunk_text(chunk):
            now = time.perf_counter()
            if chunks == 0:
                result.ttft = now - start
            else:
                result.itl.append(now - last)
            last, chunks = now, chunks + 1
    result.error = "the stream ended without [DONE]"


async def send_one(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], prompt_len: int
) -> RequestResult:
    result = RequestResult(prompt_len=prompt_len)
    start = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                result.error = _error_message(await response.aread(), response.status_code)
            else:
                await _consume(response, result, start)
    except (httpx.HTTPError, ValueError, KeyError) as exc:
        result.ok, result.error = False, f"{type(exc).__name__}: {exc}"
    result.latency = time.perf_counter() - start
    if result.ok and result.output_tokens == 0:
        result.output_tokens = len(result.itl) + 1  # no usage chunk: count text chunks
    return result


def arrival_offsets(n: int, rate: float, seed: int) -> list[float]:
    """Send times (seconds from the start) of a Poisson process; all zero for an infinite rate."""
    if math.isinf(rate):
        return [0.0] * n
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, n)
    gaps[0] = 0.0
    return [float(t) for t in np.cumsum(gaps)]


async def run_load(
    client: httpx.AsyncClient,
    url: str,
    model: str,
    endpoint: str,
    prompts: list[BenchPrompt],
    rate: float,
    max_concurrency: int | None,
    seed: int,
    on_done: Callable[[], None] = lambda: None,
) -> tuple[list[RequestResult], float]:
    """Send every prompt at its arrival time; returns the results and the benchmark duration."""
    limit = asyncio.Semaphore(max_concurrency or len(prompts))

    async def one(p: BenchPrompt) -> RequestResult:
        async with limit:
            result = await send_one(client, url, request_body(p, model, endpoint), p.prompt_len)
        on_done()
        return result

    start = time.perf_counter()
    tasks = []
    for p, offset in zip(prompts, arrival_offsets(len(prompts), rate, seed), strict=True):
        delay = start + offset - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(p)))
    results = await asyncio.gather(*tasks)
    return list(results), time.perf_counter() - start
