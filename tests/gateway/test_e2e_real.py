"""The gateway in front of REAL workers (``tandem gateway|prefill|decode`` processes, the
embedded model on the CPU): the official openai client gets the offline engine's greedy text,
200 clients that hang up early leave nothing behind, and a prefill worker killed under load
costs only the requests that already had tokens (they end with an error frame, then [DONE])."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import openai
import pytest

from tests.services.clients import SYSTEM, Conn, assert_idle, chat_ids, wait_pool_free
from tests.services.procs import Fleet, Proc, fleet
from tests.services.reference import greedy_reference

__all__ = ["fleet"]
pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct"

QUESTIONS = [
    (None, "What is the capital of France?"),
    (None, "Write a haiku about autumn."),
    (None, "Name three colours of the rainbow."),
    (None, "Explain what a CPU does. " * 12),  # a prompt of several blocks
    (SYSTEM, "Where is my parcel?"),  # a shared system prompt: prefix-cache hits
    (SYSTEM, "How long does shipping to Spain take?"),
    (SYSTEM, "Can I send a parcel to Norway?"),
    (None, "Translate 'good morning' into German."),
]


def messages(system: str | None, user: str) -> list[dict[str, str]]:
    return ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": user}
    ]


@pytest.fixture(scope="module")
def stack(fleet: Fleet) -> Any:
    """The shared prefill + decode workers and the shared gateway in front of them (the same one
    as both_topologies'; it outlives the module)."""
    prefill, decode = fleet.shared("prefill", "decode")
    gateway = fleet.shared_gateway(prefill=[prefill], decode=[decode])
    wait_healthy(gateway, 2)
    yield prefill, decode, gateway


def both_topologies(fleet: Fleet) -> Iterator[dict[str, Proc]]:
    """A gateway in front of the shared prefill + decode workers and one in front of the shared
    colocated worker, for a module's fixture: the fleet's shared gateways, kept for the next
    module. After it the workers' pools must be free while the gateways still run (a request
    that its first token ends has its reservation released in the background once the prefill
    is done: a gateway killed first would leave that to the reservation's lease)."""
    prefill, decode, worker = fleet.shared("prefill", "decode", "worker")
    disagg = fleet.shared_gateway(prefill=[prefill], decode=[decode])
    colocated = fleet.shared_gateway(worker=[worker])
    wait_healthy(disagg, 2)
    wait_healthy(colocated, 1)
    yield {"disagg": disagg, "colocated": colocated}
    asyncio.run(pools_free(prefill, decode, worker, timeout_s=10.0))


def workers(gateway: Proc) -> list[dict[str, Any]]:
    body: list[dict[str, Any]] = httpx.get(f"{gateway.url}/workers", timeout=5).json()["workers"]
    return body


def wait_healthy(gateway: Proc, count: int, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while sum(w["healthy"] for w in workers(gateway)) < count:
        assert time.monotonic() < deadline, workers(gateway)
        time.sleep(0.1)


async def pools_free(*procs: Proc, timeout_s: float = 2.0) -> None:
    conns = [Conn(p.address, p.role) for p in procs]
    try:
        assert_idle(await wait_pool_free(conns, timeout_s))
    finally:
        for c in conns:
            await c.close()


async def test_openai_chat_equals_the_offline_engine(stack: Any) -> None:
    prefill, decode, gateway = stack
    expected = greedy_reference([chat_ids(u, s) for s, u in QUESTIONS], 24)
    client = openai.AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key="none", max_retries=0)
    # sent together (the workers batch them), in two waves: the 2nd and 3rd questions with the
    # shared system prompt (5 and 6) after the 1st is done, so they find it cached
    waves = [[i for i in range(len(QUESTIONS)) if i not in (5, 6)], [5, 6]]
    done: dict[int, Any] = {}
    async with client:
        for wave in waves:
            got = await asyncio.gather(
                *(
                    client.chat.completions.create(
                        model=MODEL,
                        messages=messages(*QUESTIONS[i]),  # type: ignore[arg-type]
                        temperature=0,
                        max_tokens=24,
                    )
                    for i in wave
                )
            )
            done.update(zip(wave, got, strict=True))
    replies = [done[i] for i in range(len(QUESTIONS))]
    for (s, u), exp, reply in zip(QUESTIONS, expected, replies, strict=True):
        assert reply.usage is not None and reply.usage.prompt_tokens == len(chat_ids(u, s))
        assert reply.choices[0].message.content == exp.text
        assert reply.choices[0].finish_reason == exp.finish_reason
    async with Conn(prefill.address, "prefill") as p:
        assert (await p.load()).prefix_cache_hits >= 2 * 3 * 16
    await pools_free(prefill, decode)


def test_the_timing_header_puts_prefill_within_ttft(stack: Any) -> None:
    """Disaggregated: the prefill part is the prefill worker's; the decode worker's time to its
    first token (a decode step) was reported as prefill too and won the merge (prefill=0.30 beside
    ttft=0.20 for 8 tokens)."""
    _, _, gateway = stack
    body = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 8,
            "temperature": 0, "ignore_eos": True}  # fmt: skip
    for _ in range(3):
        r = httpx.post(f"{gateway.url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        parts = dict(kv.split("=") for kv in r.headers["x-tandem-timing"].split(";"))
        assert parts["mode"] == "disagg"
        assert 0 < float(parts["prefill"]) <= float(parts["ttft"]), parts
        assert float(parts["decode"]) > 0, parts


@dataclass
class SSE:
    frames: list[dict[str, Any]] = field(default_factory=list)
    done: bool = False

    @property
    def text(self) -> str:
        return "".join(
            c["delta"].get("content") or "" for f in self.frames for c in f.get("choices", [])
        )

    @property
    def error(self) -> dict[str, Any] | None:
        return next((f["error"] for f in self.frames if "error" in f), None)

    @property
    def finish_reason(self) -> str | None:
        reasons = [c.get("finish_reason") for f in self.frames for c in f.get("choices", [])]
        return next((r for r in reasons if r), None)


async def stream_chat(
    client: httpx.AsyncClient, body: dict[str, Any], stop_after: int | None = None
) -> SSE:
    """A streaming chat; ``stop_after`` frames, the client hangs up."""
    out = SSE()
    body = {"model": MODEL, "stream": True, "temperature": 0, **body}
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                out.done = True
                break
            out.frames.append(json.loads(line[6:]))
            if stop_after is not None and len(out.frames) >= stop_after:
                break
    return out


async def test_200_clients_hanging_up_early_leave_nothing_behind(stack: Any) -> None:
    prefill, decode, gateway = stack
    limits = httpx.Limits(max_connections=50)
    gate = asyncio.Semaphore(50)

    async def hang_up(i: int, client: httpx.AsyncClient) -> None:
        body = {"messages": messages(None, f"Client {i}: tell me a long story."),
                "max_tokens": 200, "ignore_eos": True}  # fmt: skip
        async with gate:
            if i % 2:  # after the role frame and the first token
                await stream_chat(client, body, stop_after=2)
            else:  # before any answer: the task is cancelled mid-request
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stream_chat(client, body), timeout=0.05 + i % 7 * 0.02)

    async with httpx.AsyncClient(base_url=gateway.url, limits=limits, timeout=60) as client:
        await asyncio.gather(*(hang_up(i, client) for i in range(200)))
        t0 = time.monotonic()
        ids = chat_ids("What is the capital of France?")
        reply = await stream_chat(client, {"messages": messages(None, "What is the capital of France?"),
                                           "max_tokens": 12})  # fmt: skip
        assert time.monotonic() - t0 < 5.0
        assert reply.done and reply.text == greedy_reference([ids], 12)[0].text
    await pools_free(prefill, decode)


async def test_a_long_prompt_cancelled_in_prefill_frees_both_pools_within_2_s(stack: Any) -> None:
    """The prompt is prefilled in several short steps (128-token chunks on the CPU); the client
    hangs up once it is under way, and both workers let go between two steps."""
    prefill, decode, gateway = stack
    prompt = "Cancelled request: tell me everything about harbours and their lanterns. " * 60
    async with (
        Conn(prefill.address, "prefill") as p,
        Conn(decode.address, "decode") as d,
        httpx.AsyncClient(base_url=gateway.url, timeout=60) as client,
    ):
        body = {"messages": messages(None, prompt), "max_tokens": 8}
        task = asyncio.create_task(stream_chat(client, body))
        deadline = time.monotonic() + 60
        while (await p.load()).num_running == 0:  # in prefill, its reservation made
            assert time.monotonic() < deadline and not task.done(), "the prefill never started"
            await asyncio.sleep(0.01)
        task.cancel()
        t0 = time.monotonic()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        assert_idle(await wait_pool_free([p, d], timeout_s=2.0))
        assert time.monotonic() - t0 < 2.5  # the last load poll included


async def test_a_decode_worker_killed_while_its_kv_is_due_fails_its_clients_within_5_s(
    fleet: Fleet,
) -> None:
    """Three long prompts in prefill, their KV bound for one decode worker, which is killed: each
    client hears it within 5 s (a health poll, not the prefill's KV timeout), the prefill worker
    lets go of everything and keeps serving."""
    (prefill,) = fleet.shared("prefill")
    doomed = fleet.start("decode", name="doomed-decode")
    gateway = fleet.gateway(prefill=[prefill], decode=[doomed])
    try:
        wait_healthy(gateway, 2)
        questions = [f"Doomed {i}: " + "Explain how parcels are sorted. " * 60 for i in range(3)]
        async with (
            Conn(prefill.address, "prefill") as p,
            httpx.AsyncClient(base_url=gateway.url, timeout=60) as client,
        ):
            asked = [
                asyncio.create_task(stream_chat(client, {"messages": messages(None, q), "max_tokens": 8}))
                for q in questions
            ]  # fmt: skip
            deadline = time.monotonic() + 60
            while (await p.load()).num_running == 0:
                assert time.monotonic() < deadline, "the prefill never started"
                await asyncio.sleep(0.01)
            doomed.kill()
            t0 = time.monotonic()
            results = await asyncio.gather(*asked)
            assert time.monotonic() - t0 < 5.0
            for got in results:
                assert got.done and got.error is not None, got.frames
                assert got.error["code"] == "worker_unavailable", got.error
            assert_idle(await wait_pool_free([p], timeout_s=5.0))
        assert prefill.alive
    finally:
        gateway.kill()
        doomed.kill()


async def test_a_prefill_worker_killed_under_load(fleet: Fleet) -> None:
    shared, decode = fleet.shared("prefill", "decode")
    extra = fleet.start("prefill", name="doomed-prefill")
    gateway = fleet.gateway(prefill=[shared, extra], decode=[decode])
    try:
        wait_healthy(gateway, 3)
        await _kill_under_load(gateway, shared, extra, decode)
    finally:
        gateway.kill()
        extra.kill()


async def _kill_under_load(gateway: Proc, shared: Proc, extra: Proc, decode: Proc) -> None:
    long_questions = [f"Request {i}: " + "Explain how parcels are sorted. " * 20 for i in range(8)]
    short_questions = [f"Question {i}: what is {i} plus {i}?" for i in range(4)]
    seen_token = asyncio.Event()

    async def ask(client: httpx.AsyncClient, question: str) -> SSE:
        out = SSE()
        body = {"model": MODEL, "stream": True, "temperature": 0, "max_tokens": 8,
                "messages": messages(None, question)}  # fmt: skip
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            async for line in response.aiter_lines():
                if line == "data: [DONE]":
                    out.done = True
                elif line.startswith("data: "):
                    out.frames.append(json.loads(line[6:]))
                    if out.text:
                        seen_token.set()
        return out

    async with httpx.AsyncClient(base_url=gateway.url, timeout=120) as client:
        loaded = [asyncio.create_task(ask(client, q)) for q in long_questions]
        await asyncio.wait_for(seen_token.wait(), timeout=90)
        extra.kill()
        watch = asyncio.create_task(_dead_worker_reported(gateway, extra, time.monotonic()))
        # sent before the gateway's health check can notice: some go to the dead worker
        late = [asyncio.create_task(ask(client, q)) for q in short_questions]
        results = await asyncio.wait_for(asyncio.gather(*loaded, *late), timeout=120)
        health_seen = await watch
    questions = long_questions + short_questions
    expected = greedy_reference([chat_ids(q) for q in questions], 8)
    errors = 0
    for i, (exp, got) in enumerate(zip(expected, results, strict=True)):
        assert got.done, f"request {i} did not end with [DONE]"
        if got.error is None:
            assert (got.text, got.finish_reason) == (exp.text, exp.finish_reason), i
        else:  # only requests that had streamed tokens may fail: the rest were retried
            errors += 1
            assert i < len(long_questions) and got.text, (i, got.error)
            assert got.error["message"]
    assert health_seen < 5.0
    assert errors < len(long_questions)
    await pools_free(shared, decode)


async def _dead_worker_reported(gateway: Proc, dead: Proc, since: float) -> float:
    async with httpx.AsyncClient(base_url=gateway.url, timeout=5) as client:
        while True:
            body = (await client.get("/workers")).json()["workers"]
            entry = next(w for w in body if w["address"] == dead.address)
            health = await client.get("/health")
            if not entry["healthy"] and entry["last_error"] and health.status_code == 200:
                return time.monotonic() - since
            assert time.monotonic() - since < 10.0, body
            await asyncio.sleep(0.1)


async def test_a_gateway_killed_mid_request_leaks_nothing(fleet: Fleet) -> None:
    """Two gateways share the workers; kill -9 of one while its requests hold decode reservations
    (their prompts still in prefill): the workers free everything it held within 10 s (the
    reservations when its lease lapses, the rest when its calls are cut), no worker restarts, and
    the other gateway's request, reserved on the same decode worker, is untouched and completes."""
    prefill, decode = fleet.shared("prefill", "decode")
    gateway = fleet.gateway(prefill=[prefill], decode=[decode])
    other = fleet.gateway(prefill=[prefill], decode=[decode])
    try:
        wait_healthy(gateway, 2)
        wait_healthy(other, 2)
        await _kill_one_of_two_gateways(prefill, decode, gateway, other)
        assert prefill.alive and decode.alive
        assert fleet.shared("prefill", "decode") == [prefill, decode]  # nothing was restarted
    finally:
        gateway.kill()
        other.kill()


async def _kill_one_of_two_gateways(
    prefill: Proc, decode: Proc, gateway: Proc, other: Proc
) -> None:
    questions = [f"Request {i}: " + "Explain how parcels are sorted. " * 100 for i in range(4)]
    async with Conn(prefill.address, "prefill") as p, Conn(decode.address, "decode") as d:
        async with (
            httpx.AsyncClient(base_url=gateway.url, timeout=60) as client,
            httpx.AsyncClient(base_url=other.url, timeout=120) as survivor_client,
        ):
            sent = [
                asyncio.create_task(client.post("/v1/chat/completions", json={
                    "model": MODEL, "max_tokens": 32, "messages": messages(None, q)}))
                for q in questions[:3]
            ]  # fmt: skip
            survivor = asyncio.create_task(survivor_client.post("/v1/chat/completions", json={
                "model": MODEL, "max_tokens": 8, "ignore_eos": True,
                "messages": messages(None, questions[3])}))  # fmt: skip
            deadline = time.monotonic() + 60
            while (await d.load()).num_reserved < 4:  # both gateways' requests hold blocks
                assert time.monotonic() < deadline, "not every request made its reservation"
                await asyncio.sleep(0.02)
            gateway.kill()
            t0 = time.monotonic()
            await asyncio.gather(*sent, return_exceptions=True)  # the connections break
            while (await d.load()).num_reserved > 1:  # at most the survivor's is left
                assert time.monotonic() - t0 < 10.0, "the dead gateway's reservations stayed"
                await asyncio.sleep(0.05)
            reply = await survivor
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] == 8
        assert_idle(await wait_pool_free([p, d], timeout_s=10.0))
