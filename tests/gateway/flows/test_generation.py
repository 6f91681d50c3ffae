"""Many requests at once: nothing lost, nothing leaked, an abort storm does not stall the gateway."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from tests.gateway.stack import Stack

pytestmark = pytest.mark.timeout(120)
PROMPT = "Hello world, this is a test of the gateway"


def no_leaks(stack: Stack) -> bool:
    clients = stack.state.registry.clients
    decode_reserved = [w.records.reservations for w in stack.role("decode")]
    return (
        not stack.state.active
        and all(c.inflight == 0 for c in clients)
        and not any(decode_reserved)
    )


async def wait_until(cond, timeout: float = 10.0) -> bool:  # type: ignore[no-untyped-def]
    end = time.monotonic() + timeout
    while time.monotonic() < end and not cond():
        await asyncio.sleep(0.05)
    return bool(cond())


async def test_concurrent_requests_all_complete(disagg: Stack) -> None:
    async with httpx.AsyncClient(base_url=disagg.base_url, timeout=60) as c:

        async def one(i: int) -> dict:
            body = {"prompt": PROMPT, "max_tokens": 1 + i % 7, "n": 1 + i % 2}
            r = await c.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            return r.json()

        results = await asyncio.gather(*(one(i) for i in range(60)))
    for i, out in enumerate(results):
        assert out["usage"]["completion_tokens"] == (1 + i % 7) * (1 + i % 2)
    assert await wait_until(lambda: no_leaks(disagg))


async def test_abort_storm_then_a_new_request_finishes_quickly(disagg: Stack) -> None:
    decode = disagg.role("decode")[0]
    decode.behavior.token_delay_s = 0.02
    limits = httpx.Limits(max_connections=250)
    async with httpx.AsyncClient(base_url=disagg.base_url, timeout=60, limits=limits) as c:

        async def leave_after_first_token() -> None:
            body = {"prompt": PROMPT, "max_tokens": 500, "stream": True}
            async with c.stream("POST", "/v1/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        return

        await asyncio.gather(*(leave_after_first_token() for _ in range(200)))
        start = time.monotonic()
        r = await c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 5})
        assert r.status_code == 200 and time.monotonic() - start < 5.0
    assert await wait_until(lambda: len(set(decode.records.aborts)) == 200)
    assert await wait_until(lambda: no_leaks(disagg))
