"""Many requests over one stream, gateway side: each request reads like its own call."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from gateway.core.config import WorkerSpec
from gateway.workers.client import WorkerClient
from gateway.workers.multiplex import RequestRpcError, StreamMux, rpc_error
from gateway.workers.work import rpc_failure
from protos import common_pb2, worker_pb2

pytestmark = pytest.mark.timeout(30)
LENGTH, ERROR = common_pb2.FINISH_REASON_LENGTH, common_pb2.FINISH_REASON_ERROR


class _Call:
    """A bidi call as grpc.aio hands it out: iterable, cancellable."""

    def __init__(self, replies: AsyncIterator[Any]) -> None:
        self.replies, self.cancelled = replies, False

    def __aiter__(self) -> AsyncIterator[Any]:
        return self.replies

    def cancel(self) -> bool:
        self.cancelled = True
        return True


class FakeStream:
    """Stands in for a worker's GenerateStream: records the items, answers as a test says."""

    def __init__(self) -> None:
        self.opened = 0
        self.consumers: list[asyncio.Task[None]] = []
        self.items: list[Any] = []
        self.batches: asyncio.Queue[Any] = asyncio.Queue()

    def __call__(self, items: AsyncIterator[Any]) -> Any:
        self.opened += 1
        self.consumers.append(asyncio.ensure_future(self._consume(items)))
        return _Call(self._replies())

    async def _consume(self, items: AsyncIterator[Any]) -> None:
        async for item in items:
            self.items.append(item)

    async def _replies(self) -> AsyncIterator[common_pb2.ChunkBatch]:
        while (b := await self.batches.get()) is not None:
            if isinstance(b, BaseException):
                raise b
            yield b

    def send(self, *chunks: common_pb2.TokenChunk) -> None:
        self.batches.put_nowait(common_pb2.ChunkBatch(chunks=list(chunks)))


def _chunk(rid: str, *tokens: int, reason: int = 0, **kw: Any) -> common_pb2.TokenChunk:
    return common_pb2.TokenChunk(request_id=rid, token_ids=list(tokens), finish_reason=reason, **kw)


def _mux(fake: FakeStream) -> StreamMux:
    return StreamMux(fake, worker_pb2.GenerateStreamItem, "generate", "w:1")


def _req(rid: str) -> worker_pb2.GenerateRequest:
    return worker_pb2.GenerateRequest(request_id=rid, prompt_token_ids=[1])


async def test_chunks_reach_their_requests_then_eof() -> None:
    fake = FakeStream()
    mux = _mux(fake)
    a = mux.start(_req("a"), [("traceparent", "00-t")], 10.0)
    b = mux.start(_req("b"), [], 10.0)
    fake.send(_chunk("b", 7), _chunk("a", 1), _chunk("zzz", 9))  # zzz: nobody's
    fake.send(_chunk("a", 2, reason=LENGTH), _chunk("b", 8, reason=LENGTH))
    assert [list(c.token_ids) async for c in a] == [[1], [2]]
    assert [list(c.token_ids) async for c in b] == [[7], [8]]
    assert await a.read() is grpc.aio.EOF
    await asyncio.sleep(0)
    assert fake.opened == 1 and [i.generate.request_id for i in fake.items] == ["a", "b"]
    assert dict(fake.items[0].metadata) == {"traceparent": "00-t"} and fake.items[0].timeout_s > 9
    assert mux.open_requests == 0
    await mux.close()


async def test_a_refused_request_raises_its_status() -> None:
    fake = FakeStream()
    mux = _mux(fake)
    call = mux.start(_req("a"), [], 10.0)
    fake.send(_chunk("a", reason=ERROR, error="no reservation", status_code=5))
    with pytest.raises(grpc.RpcError) as info:
        await call.read()
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert info.value.details() == "no reservation"
    # an engine failure after the start is an ordinary error chunk, as on a per-request stream
    call = mux.start(_req("b"), [], 10.0)
    fake.send(_chunk("b", reason=ERROR, error="engine step failed"))
    assert (await call.read()).error == "engine step failed"
    await mux.close()


async def test_a_refusal_naming_a_field_is_a_400_with_that_param() -> None:
    """A worker's INVALID_ARGUMENT about one request field (the chunk's error_param) is the
    client's 400 with ``param`` set, as the gateway's own checks give it."""
    from gateway.workers.rpc_errors import from_rpc_error

    fake = FakeStream()
    mux = _mux(fake)
    call = mux.start(_req("a"), [], 10.0)
    fake.send(_chunk("a", reason=ERROR, error="priority 3 needs ...", status_code=3,
                     error_param="priority"))  # fmt: skip
    with pytest.raises(RequestRpcError) as info:
        await call.read()
    api = from_rpc_error(info.value, "colocated-0", "w:1", "Generate").api_error
    assert (api.status, api.param, api.message) == (400, "priority", "priority 3 needs ...")
    call = mux.start(_req("b"), [], 10.0)  # no field named: no param
    fake.send(_chunk("b", reason=ERROR, error="bad", status_code=3))
    with pytest.raises(RequestRpcError) as info:
        await call.read()
    assert from_rpc_error(info.value, "colocated-0", "w:1", "Generate").api_error.param is None
    await mux.close()


async def test_one_requests_internal_error_leaves_its_worker_healthy() -> None:
    """A bug in one request (INTERNAL on its error chunk) fails that request, retryable; the
    worker, still streaming every other request, stays in rotation. The same code from the
    call itself has the worker health-checked now; UNAVAILABLE (it cannot be reached) marks it
    unhealthy until its next health poll."""
    fake = FakeStream()
    mux = _mux(fake)
    call = mux.start(_req("a"), [], 10.0)
    fake.send(_chunk("a", reason=ERROR, error="internal error: ValueError()", status_code=13))
    with pytest.raises(RequestRpcError) as info:
        await call.read()
    worker: Any = type(
        "W",
        (),
        {"name": "prefill-0", "address": "w:1", "reasons": [], "checks": [], "healthy": True},
    )()
    worker.mark_unhealthy = lambda reason, lost=False: worker.reasons.append(reason)
    worker.check_now = worker.checks.append
    failure = rpc_failure(worker, info.value, "Decode")
    assert failure.retryable and failure.api_error.status == 502
    assert worker.reasons == worker.checks == []
    failure = rpc_failure(worker, rpc_error(grpc.StatusCode.INTERNAL, "stream broke"), "Decode")
    assert failure.retryable and worker.reasons == [] and len(worker.checks) == 1
    failure = rpc_failure(worker, rpc_error(grpc.StatusCode.UNAVAILABLE, "reset"), "Decode")
    assert failure.retryable and len(worker.reasons) == 1
    await mux.close()


async def test_requests_failing_on_a_lost_worker_each_quote_its_reason_once() -> None:
    """Every request in flight on a lost worker fails with the poll's reason; a failure must not
    become the worker's reason, or the next request's message quotes it, and so on: the 1000th
    request's message held the 999 before it."""
    worker = WorkerClient(WorkerSpec("prefill", "127.0.0.1:1"))
    worker.healthy = True
    worker.mark_unhealthy("health poll failed: UNAVAILABLE", lost=True)
    messages, details = [], []
    for _ in range(3):
        with pytest.raises(grpc.RpcError) as info:
            await worker.unless_lost(asyncio.sleep(60))
        failure = rpc_failure(worker, info.value, "Prefill")
        messages.append(failure.api_error.message)
        details.append(failure.detail)
    assert worker.last_error == "health poll failed: UNAVAILABLE"
    assert len(set(messages)) == 1, messages  # the client's: no address, no reason quoted
    assert len(set(details)) == 1 and details[0].count("is gone") == 1, details[-1]
    await worker.close()


async def test_a_broken_stream_fails_every_request_and_the_next_one_reopens() -> None:
    fake = FakeStream()
    mux = _mux(fake)
    a, b = mux.start(_req("a"), [], 10.0), mux.start(_req("b"), [], 10.0)
    fake.batches.put_nowait(rpc_error(grpc.StatusCode.UNAVAILABLE, "connection reset"))
    for call in (a, b):
        with pytest.raises(grpc.RpcError) as info:
            await call.read()
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    c = mux.start(_req("c"), [], 10.0)
    fake.send(_chunk("c", 1, reason=LENGTH))
    assert [list(x.token_ids) async for x in c] == [[1]]
    assert fake.opened == 2
    await mux.close()


async def test_cancel_sends_an_abort_and_a_deadline_raises_deadline_exceeded() -> None:
    fake = FakeStream()
    mux = _mux(fake)
    a = mux.start(_req("a"), [], 10.0)
    assert a.cancel() and not a.cancel()
    slow = mux.start(_req("slow"), [], 0.05)
    with pytest.raises(grpc.RpcError) as info:
        await slow.read()
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    await asyncio.sleep(0.01)
    aborts = [i.abort.request_id for i in fake.items if i.WhichOneof("item") == "abort"]
    assert aborts == ["a", "slow"] and mux.open_requests == 0
    await mux.close()


async def test_a_stream_that_cannot_open_fails_the_request_at_once() -> None:
    def broken(items: AsyncIterator[Any]) -> Any:
        raise RuntimeError("channel closed")

    mux = StreamMux(broken, worker_pb2.GenerateStreamItem, "generate", "w:1")
    call = mux.start(_req("a"), [], 10.0)
    with pytest.raises(grpc.RpcError) as info:
        await call.read()
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_close_fails_waiting_requests_and_a_broken_stream_leaves_no_reader() -> None:
    fake = FakeStream()
    mux = _mux(fake)
    a = mux.start(_req("a"), [], 10.0)
    fake.batches.put_nowait(rpc_error(grpc.StatusCode.UNAVAILABLE, "reset"))
    with pytest.raises(grpc.RpcError):
        await a.read()
    await asyncio.sleep(0.01)
    assert all(t.done() for t in fake.consumers), "the dead stream's request reader still waits"
    b = mux.start(_req("b"), [], 10.0)
    await mux.close()
    with pytest.raises(grpc.RpcError) as info:
        await b.read()
    assert info.value.code() == grpc.StatusCode.CANCELLED


async def test_fail_ends_every_request_of_a_silent_stream_and_the_next_one_reopens() -> None:
    """The worker is seen gone while its stream sends nothing (frozen, the connection open):
    ``fail`` ends each request on it with UNAVAILABLE at once, cancels the stream, and the next
    request opens a new one; a request cancelled afterwards sends no abort anywhere."""
    fake = FakeStream()
    mux = _mux(fake)
    a, b = mux.start(_req("a"), [], 10.0), mux.start(_req("b"), [], 10.0)
    await asyncio.sleep(0)  # the reader runs, waiting for a batch that never comes
    mux.fail("worker w:1 is gone: no answer")
    for call in (a, b):
        with pytest.raises(grpc.RpcError) as info:
            await call.read()
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert info.value.details() == "worker w:1 is gone: no answer"
        assert await call.read() is grpc.aio.EOF and not call.cancel()
    await asyncio.sleep(0.01)
    assert all(t.done() for t in fake.consumers), "the given-up stream's item reader still waits"
    assert mux.open_requests == 0
    c = mux.start(_req("c"), [], 10.0)
    fake.send(_chunk("c", 1, reason=LENGTH))
    assert [list(x.token_ids) async for x in c] == [[1]]
    assert fake.opened == 2
    assert not [i for i in fake.items if i.WhichOneof("item") == "abort"]
    mux.fail("nothing open: nothing to do")  # the stream is idle, still open: given up too
    mux.fail("twice")  # and then there is none
    assert fake.opened == 2
    await mux.close()
