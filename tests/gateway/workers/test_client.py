"""A worker frozen, not dead (SIGSTOP): it answers nothing, its connections stay open.

Its health polls fail with DEADLINE_EXCEEDED: it is unhealthy at once, and once they have gone
unanswered for ``--worker-stall-timeout`` it is lost, as an unreachable worker is: the requests
in flight on it end with the error a dead worker gives (not at the gRPC keepalive, some 40 s
later), what they held elsewhere is aborted, and the aborts it missed are sent again once it
answers, when it also takes new requests.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from gateway.core.config import WorkerSpec
from gateway.workers.client import WorkerClient
from tests.gateway.fake_workers import FakeWorker
from tests.gateway.stack import Stack
from tests.gateway.workers.test_dispatch import PROMPT, sse_lines, wait_for

pytestmark = pytest.mark.timeout(60)
STALL_S = 2.0  # --worker-stall-timeout here
# generous: the point is "well before the keepalive's ~40 s", never a race with the bound
WITHIN_S = STALL_S + 10.0
ERROR_KEYS = {"message", "type", "param", "code"}


@pytest.fixture
def caplog_info(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.INFO, logger="gateway.workers")
    return caplog


def _logged(caplog: pytest.LogCaptureFixture, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if text in r.getMessage()]


def _stack(tokenizer_dir: str, roles: list[str], **config: object) -> Stack:
    """Polls every 0.2 s, each given 0.5 s; unary calls (Reserve, Abort) 1 s."""
    settings: dict[str, object] = {
        "health_timeout_s": 0.5, "worker_stall_timeout_s": STALL_S, "rpc_timeout_s": 1.0,
    }  # fmt: skip
    return Stack(tokenizer_dir, roles, **{**settings, **config}).start()


def _client(stack: Stack, worker: FakeWorker) -> WorkerClient:
    return next(c for c in stack.state.registry.clients if c.address == worker.address)


def _started_stream(stack: Stack, body: dict[str, object]) -> Iterator[str]:
    """The SSE data lines of a completion (opened in a thread: the caller reads them)."""
    with httpx.stream("POST", f"{stack.base_url}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        yield from sse_lines(r)


def _ends_with_error(frames: list[str]) -> dict[str, object]:
    assert frames[-1] == "[DONE]", frames
    error: dict[str, object] = json.loads(frames[-2])["error"]
    assert error["code"] == "worker_unavailable", error
    return error


def _reply_after_freezing(
    stack: Stack, worker: FakeWorker, started: Callable[[], bool], body: dict[str, object]
) -> tuple[httpx.Response, float]:
    """A non-streamed completion sent, ``worker`` frozen once ``started()``: the reply and the
    seconds it took after the freeze."""
    with ThreadPoolExecutor(1) as pool:
        reply = pool.submit(httpx.post, f"{stack.base_url}/v1/completions", json=body,
                            timeout=60)  # fmt: skip
        assert wait_for(started)
        stack.run(worker.freeze())
        t0 = time.monotonic()
        r = reply.result(60)
        return r, time.monotonic() - t0


def _usable_again(stack: Stack, worker: FakeWorker) -> None:
    """Thawed, the worker answers its polls, is healthy (not lost) and serves a request."""
    stack.run(worker.thaw())
    client = _client(stack, worker)
    assert wait_for(lambda: client.healthy, timeout=10)
    assert httpx.get(f"{stack.base_url}/health").status_code == 200
    r = httpx.post(f"{stack.base_url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 3})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "Hello world,", r.text


def test_a_frozen_decode_worker_ends_its_streams_and_takes_work_once_it_answers(
    tokenizer_dir: str, caplog_info: pytest.LogCaptureFixture
) -> None:
    stack = _stack(tokenizer_dir, ["prefill", "decode"])
    try:
        decode = stack.role("decode")[0]
        decode.behavior.token_delay_s = 0.02
        frames = _started_stream(stack, {"prompt": PROMPT, "max_tokens": 1000, "stream": True})
        got = [next(frames) for _ in range(3)]
        stack.run(decode.freeze())
        t0 = time.monotonic()
        got += list(frames)
        elapsed = time.monotonic() - t0
        error = _ends_with_error(got)
        assert "Decode" in str(error["message"]) and "--worker-stall-timeout" in str(
            error["message"]
        )
        assert elapsed < WITHIN_S, elapsed  # was ~66 s: the gRPC keepalive's
        client = _client(stack, decode)
        assert not client.healthy and "--worker-stall-timeout" in client.last_error
        # new requests are refused at once meanwhile
        r = httpx.post(f"{stack.base_url}/v1/completions", json={"prompt": PROMPT})
        assert r.status_code == 503 and httpx.get(f"{stack.base_url}/health").status_code == 503
        rid = decode.records.requests[0]
        assert wait_for(lambda: bool(_logged(caplog_info, f"abort of {rid}")))  # no answer
        assert rid not in decode.records.aborts
        (failed,) = _logged(caplog_info, f"abort of {rid}")
        assert "(DEADLINE_EXCEEDED: Deadline Exceeded); sent again once it answers" in failed
        _usable_again(stack, decode)
        assert wait_for(lambda: rid in decode.records.aborts)  # sent again once it answered
        assert _logged(caplog_info, "sending the 1 aborts it missed")
        assert not decode.records.reservations
    finally:
        stack.stop()


def test_a_decode_worker_whose_engine_step_hangs_ends_its_streams_and_serves_once_it_returns(
    tokenizer_dir: str,
) -> None:
    """The worker still answers its polls, but its health says NOT_SERVING and its load that
    its engine has been in one step past its --engine-stall-timeout: its streams end now (as a
    dead worker's), not at --request-timeout; once the step returns it serves again."""
    stack = _stack(tokenizer_dir, ["prefill", "decode"])
    try:
        decode = stack.role("decode")[0]
        decode.behavior.token_delay_s = 0.02
        frames = _started_stream(stack, {"prompt": PROMPT, "max_tokens": 1000, "stream": True})
        got = [next(frames) for _ in range(3)]
        decode.behavior.engine_stalled_s = 121.0
        decode.behavior.serving = False
        got += list(frames)
        error = _ends_with_error(got)
        assert "its engine has been in one step for 121 s" in str(error["message"]), error
        client = _client(stack, decode)
        assert not client.healthy and "--engine-stall-timeout" in client.last_error
        r = httpx.post(f"{stack.base_url}/v1/completions", json={"prompt": PROMPT})
        assert r.status_code == 503, r.text
        rid = decode.records.requests[0]
        assert wait_for(lambda: rid in decode.records.aborts)  # what it still runs is aborted
        decode.behavior.engine_stalled_s = 0.0
        decode.behavior.serving = True
        _usable_again(stack, decode)
        assert not decode.records.reservations
    finally:
        stack.stop()


def test_a_frozen_decode_worker_fails_a_non_streamed_request_with_a_503(
    tokenizer_dir: str,
) -> None:
    stack = _stack(tokenizer_dir, ["prefill", "decode"])
    try:
        decode = stack.role("decode")[0]
        decode.behavior.token_delay_s = 0.02
        body = {"prompt": PROMPT, "max_tokens": 1000}
        r, elapsed = _reply_after_freezing(
            stack, decode, lambda: bool(decode.records.decode_calls), body
        )
        assert r.status_code == 503, r.text
        error = r.json()["error"]
        assert set(error) == ERROR_KEYS and error["code"] == "worker_unavailable", error
        assert elapsed < WITHIN_S, elapsed
        _usable_again(stack, decode)
    finally:
        stack.stop()


def test_a_stream_on_a_frozen_decode_worker_resumes_on_another(tokenizer_dir: str) -> None:
    """With another decode worker, a stream whose decode worker froze goes on there, as one
    whose decode worker died does: the whole text, no error frame."""
    stack = _stack(tokenizer_dir, ["prefill", "decode", "decode"])
    try:
        frozen, other = stack.role("decode")
        other.behavior.num_waiting = 5  # the longer queue: the request goes to ``frozen``
        assert wait_for(lambda: _client(stack, other).queue_depth == 5)
        body = {"prompt": PROMPT, "max_tokens": 40, "stream": True}
        url = f"{stack.base_url}/v1/completions"
        whole = httpx.post(url, json={**body, "stream": False}).json()["choices"][0]["text"]
        frozen.behavior.token_delay_s = 0.02
        frames = _started_stream(stack, body)
        got = [next(frames) for _ in range(3)]
        assert frozen.records.decode_calls and not other.records.decode_calls
        stack.run(frozen.freeze())
        got += list(frames)
        assert got[-1] == "[DONE]"
        chunks = [json.loads(f) for f in got[:-1]]
        assert not [c for c in chunks if "error" in c], chunks[-1]
        assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == whole
        assert [rid for rid in other.records.local_prefills if rid.endswith("-retry1")]
        _usable_again(stack, frozen)
    finally:
        stack.stop()


def test_a_decode_worker_frozen_while_the_prompt_is_in_prefill_has_the_prefill_aborted(
    tokenizer_dir: str,
) -> None:
    """The reservation's worker freezes while the prompt is in prefill: the client hears it
    within the stall timeout (not at the prefill's KV timeout), and the prefill is aborted."""
    stack = _stack(tokenizer_dir, ["prefill", "decode"])
    try:
        prefill, decode = stack.role("prefill")[0], stack.role("decode")[0]
        prefill.behavior.first_delay_s = 60.0
        frames = _started_stream(stack, {"prompt": PROMPT, "max_tokens": 8, "stream": True})
        with ThreadPoolExecutor(1) as pool:
            rest = pool.submit(list, frames)
            assert wait_for(lambda: bool(prefill.records.requests))
            stack.run(decode.freeze())
            t0 = time.monotonic()
            got = rest.result(60)
            elapsed = time.monotonic() - t0
        error = _ends_with_error(got)
        assert "went away" in str(error["message"])
        assert elapsed < WITHIN_S, elapsed
        rid = prefill.records.requests[0]
        assert wait_for(lambda: rid in prefill.records.aborts)  # its KV has nowhere to go
        prefill.behavior.first_delay_s = 0.0
        _usable_again(stack, decode)
        assert wait_for(lambda: rid in decode.records.aborts)  # its reservation, once it answers
        assert wait_for(lambda: not decode.records.reservations)
    finally:
        stack.stop()


def test_a_frozen_prefill_worker_has_its_request_retried_on_the_decode_worker(
    tokenizer_dir: str,
) -> None:
    """The only prefill worker freezes before the first token: once it is lost, the request
    runs again on the decode worker, which prefills the prompt itself (was a 503); the first
    attempt's reservation is freed, and the prefill is aborted once the worker answers."""
    stack = _stack(tokenizer_dir, ["prefill", "decode"])
    try:
        prefill, decode = stack.role("prefill")[0], stack.role("decode")[0]
        prefill.behavior.first_delay_s = 0.5  # it freezes before the first token is out
        body = {"prompt": PROMPT, "max_tokens": 3}
        r, elapsed = _reply_after_freezing(
            stack, prefill, lambda: bool(prefill.records.requests), body
        )
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "Hello world,", r.text
        assert "local_reason=no_prefill" in r.headers["x-tandem-timing"]
        assert elapsed < WITHIN_S, elapsed
        rid = prefill.records.requests[0]
        assert decode.records.local_prefills == [f"{rid}-retry1"]
        assert wait_for(lambda: rid in decode.records.aborts and not decode.records.reservations)
        prefill.behavior.first_delay_s = 0.0
        _usable_again(stack, prefill)
        assert wait_for(lambda: rid in prefill.records.aborts)
    finally:
        stack.stop()


def test_a_frozen_colocated_worker_ends_its_streams(tokenizer_dir: str) -> None:
    stack = _stack(tokenizer_dir, ["colocated"])
    try:
        (worker,) = stack.workers
        worker.behavior.token_delay_s = 0.02
        frames = _started_stream(stack, {"prompt": PROMPT, "max_tokens": 1000, "stream": True})
        got = [next(frames) for _ in range(3)]
        stack.run(worker.freeze())
        t0 = time.monotonic()
        got += list(frames)
        assert time.monotonic() - t0 < WITHIN_S
        assert "Generate" in str(_ends_with_error(got)["message"])
        rid = worker.records.requests[0]
        _usable_again(stack, worker)
        assert wait_for(lambda: rid in worker.records.aborts)
    finally:
        stack.stop()


def test_late_polls_mark_a_worker_unhealthy_and_the_stall_timeout_lost(
    tokenizer_dir: str,
) -> None:
    """Polled by hand (the regular poll is a minute away), no clock in the verdicts: a frozen
    worker's first late poll is forgiven, the next makes it unhealthy but not lost, while a
    stream on it waits; polls unanswered for the stall timeout make it lost, which ends the
    stream; answering again makes it healthy."""
    stack = _stack(tokenizer_dir, ["colocated"], health_interval_s=60.0,
                   worker_stall_timeout_s=60.0, health_timeout_s=0.3)  # fmt: skip
    try:
        (worker,) = stack.workers
        client = _client(stack, worker)
        worker.behavior.token_delay_s = 0.02
        frames = _started_stream(stack, {"prompt": PROMPT, "max_tokens": 1000, "stream": True})
        with ThreadPoolExecutor(1) as pool:
            got = [next(frames) for _ in range(3)]
            rest = pool.submit(list, frames)
            stack.run(worker.freeze())
            stack.run(stack.state.registry.poll_all())
            assert client.healthy  # one late answer is forgiven
            stack.run(stack.state.registry.poll_all())
            assert not client.healthy and "DEADLINE_EXCEEDED" in client.last_error
            assert "stall" not in client.last_error and not rest.done()  # not yet lost
            assert client._silent_since is not None
            client._silent_since -= 60.0  # as if a minute had gone by unanswered
            stack.run(stack.state.registry.poll_all())
            assert "--worker-stall-timeout 60" in client.last_error
            got += rest.result(30)
        _ends_with_error(got)
        stack.run(worker.thaw())
        stack.run(stack.state.registry.poll_all())
        assert client.healthy and client._silent_since is None
        stack.run(client.unless_lost(_answer()))  # not lost any more: a call runs
    finally:
        stack.stop()


async def _answer() -> int:
    return 1


async def test_the_aborts_a_dead_worker_misses_are_logged_once_not_one_line_each(
    caplog_info: pytest.LogCaptureFixture,
) -> None:
    """kill -9 of a decode worker with 12 requests on it wrote 12 'abort of ... failed' lines;
    with hundreds in flight, hundreds. The first is logged, the rest are counted in the line
    that sends them again once it answers."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"  # nobody listens there
    client = WorkerClient(WorkerSpec("decode", address))
    try:
        found = await asyncio.gather(*(client.abort(f"r{i}", 1.0) for i in range(30)))
    finally:
        await client.close()
    assert not any(found) and len(client._owed_aborts) == 30
    failed = _logged(caplog_info, "failed (UNAVAILABLE")
    assert len(failed) == 1 and "sent again once it answers" in failed[0], failed


async def test_a_worker_with_another_internal_token_is_logged_naming_the_token(
    caplog_info: pytest.LogCaptureFixture,
) -> None:
    """A gateway whose internal token differs from the workers' never saw them healthy, and its
    log said nothing (only an unhealthy verdict on a worker that had served was logged): the
    first verdict is logged too, and an UNAUTHENTICATED one names the token."""
    import grpc
    from grpc_health.v1 import health, health_pb2_grpc

    from protos import decode_pb2_grpc
    from protos.auth import server_interceptors

    server = grpc.aio.server(interceptors=server_interceptors("the-workers-token"))
    decode_pb2_grpc.add_DecodeServiceServicer_to_server(
        decode_pb2_grpc.DecodeServiceServicer(), server
    )
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    client = WorkerClient(WorkerSpec("decode", f"127.0.0.1:{port}"), internal_token="another")
    try:
        for _ in range(3):
            await client.poll(5.0)
    finally:
        await client.close()
        await server.stop(None)
    assert not client.healthy and "UNAUTHENTICATED" in client.last_error
    (said,) = _logged(caplog_info, "is unhealthy")  # once, not once a poll
    assert "UNAUTHENTICATED" in said and "TANDEM_INTERNAL_TOKEN must be the same" in said
