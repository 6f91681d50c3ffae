"""Many requests over one stream, worker side: batching, per-request errors, aborts, deadlines."""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from protos import common_pb2, worker_pb2
from protos.sampling_params import InvalidRequestError
from services.common.multiplex import multiplex
from services.common.streaming import abort_invalid
from services.engine.outputs import RequestOutput

pytestmark = pytest.mark.timeout(30)


def _gen(
    rid: str, n: int = 3, timeout_s: float = 0.0, **meta: str
) -> worker_pb2.GenerateStreamItem:
    return worker_pb2.GenerateStreamItem(
        generate=worker_pb2.GenerateRequest(request_id=rid, prompt_token_ids=[n]),
        metadata=meta, timeout_s=timeout_s,
    )  # fmt: skip


def _abort(rid: str) -> worker_pb2.GenerateStreamItem:
    return worker_pb2.GenerateStreamItem(abort=common_pb2.AbortRequest(request_id=rid))


class Handler:
    """Yields prompt_token_ids[0] tokens, one per tick; 'bad' aborts, 'slow' never ends."""

    def __init__(self) -> None:
        self.closed: list[str] = []
        self.metadata: dict[str, dict[str, str]] = {}
        self.tick = asyncio.Event()

    async def __call__(self, request: Any, context: Any) -> AsyncIterator[common_pb2.TokenChunk]:
        rid = request.request_id
        self.metadata[rid] = dict(context.invocation_metadata())
        try:
            if rid == "bad":
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "bad prompt")
            if rid == "bad-field":  # as services.common.streaming.abort_invalid ends a call
                await abort_invalid(
                    context, InvalidRequestError("priority 3 needs ...", "priority")
                )
            if rid == "bad-grammar":  # the gateway names the field the client used
                await abort_invalid(context, InvalidRequestError("bad", "structured_outputs"))
            n = request.prompt_token_ids[0]
            for i in range(n if rid != "slow" else 10**9):
                await asyncio.sleep(0.001)
                done = i == n - 1 and rid != "slow"
                reason = common_pb2.FINISH_REASON_LENGTH if done else None
                yield common_pb2.TokenChunk(token_ids=[i], finish_reason=reason)
        finally:
            self.closed.append(rid)


async def _serve(items: list[Any], handler: Handler, then: list[Any] | None = None, gap: float = 0.05) -> list[common_pb2.ChunkBatch]:  # fmt: skip
    async def source() -> AsyncIterator[Any]:
        for item in items:
            yield item
        await asyncio.sleep(gap)
        for item in then or []:
            yield item

    return [b async for b in multiplex(source(), "generate", handler)]


def _by_request(batches: list[common_pb2.ChunkBatch]) -> dict[str, list[common_pb2.TokenChunk]]:
    out: dict[str, list[common_pb2.TokenChunk]] = {}
    for batch in batches:
        for c in batch.chunks:
            out.setdefault(c.request_id, []).append(c)
    return out


async def test_requests_share_batches_and_each_finishes() -> None:
    h = Handler()
    batches = await _serve([_gen("a", 5, traceparent="00-x"), _gen("b", 3)], h)
    got = _by_request(batches)
    assert [t for c in got["a"] for t in c.token_ids] == [0, 1, 2, 3, 4]
    assert [t for c in got["b"] for t in c.token_ids] == [0, 1, 2]
    assert got["a"][-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert any(len({c.request_id for c in b.chunks}) == 2 for b in batches), "never batched"
    assert h.metadata["a"] == {"traceparent": "00-x"}
    assert sorted(h.closed) == ["a", "b"]


async def test_a_refused_request_ends_with_its_status_and_the_others_go_on() -> None:
    h = Handler()
    got = _by_request(await _serve([_gen("bad"), _gen("ok", 2)], h))
    (err,) = got["bad"]
    assert err.finish_reason == common_pb2.FINISH_REASON_ERROR and err.error == "bad prompt"
    assert err.status_code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert got["ok"][-1].finish_reason == common_pb2.FINISH_REASON_LENGTH


async def test_a_refusal_naming_a_field_carries_it() -> None:
    items = [_gen("bad-field"), _gen("bad"), _gen("bad-grammar")]
    got = _by_request(await _serve(items, Handler()))
    (err,) = got["bad-field"]
    assert err.status_code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert (err.error, err.error_param) == ("priority 3 needs ...", "priority")
    assert got["bad"][0].error_param == ""  # a refusal that names no field
    assert got["bad-grammar"][0].error_param == "structured_outputs"


async def test_abort_stops_the_handler_and_a_deadline_ends_with_deadline_exceeded() -> None:
    h = Handler()
    batches = await _serve(
        [_gen("slow"), _gen("late", 10**6, timeout_s=0.05)], h, then=[_abort("slow")], gap=0.1
    )
    got = _by_request(batches)
    assert "slow" in h.closed and "late" in h.closed
    assert got["late"][-1].status_code == grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
    assert all(c.finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED for c in got["slow"])


@pytest.mark.parametrize("timeout_s", [math.nan, math.inf, -math.inf, -1.0])
async def test_a_timeout_not_a_finite_number_at_least_0_is_refused_before_the_handler(
    timeout_s: float,
) -> None:
    # a negative or NaN timeout_s ran the request with no deadline, as 0 does; an infinite one
    # too: refused now, naming the field, and the handler (which would take KV blocks) never
    # starts; the stream and its other requests go on
    h = Handler()
    started: list[str] = []

    def handler(request: Any, context: Any) -> AsyncIterator[common_pb2.TokenChunk]:
        started.append(request.request_id)
        return h(request, context)

    items = [_gen("bad", timeout_s=timeout_s), _gen("ok", 2, timeout_s=5.0), _gen("zero", 2)]
    got = _by_request([b async for b in multiplex(_items(items), "generate", handler)])
    (err,) = got["bad"]
    assert err.finish_reason == common_pb2.FINISH_REASON_ERROR
    assert err.status_code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert err.error_param == "timeout_s"
    assert err.error.startswith("timeout_s must be a finite number of seconds >= 0")
    assert "0 or unset: no deadline" in err.error
    assert started == ["ok", "zero"] and sorted(h.closed) == ["ok", "zero"]
    for rid in ("ok", "zero"):
        assert [t for c in got[rid] for t in c.token_ids] == [0, 1]
        assert got[rid][-1].finish_reason == LENGTH and not got[rid][-1].error


async def test_a_request_id_already_running_is_refused() -> None:
    h = Handler()
    got = _by_request(await _serve([_gen("a", 50), _gen("a", 2)], h))
    refused = [c for c in got["a"] if c.status_code]
    assert len(refused) == 1 and "is running" in refused[0].error


async def test_closing_the_stream_aborts_what_still_runs() -> None:
    h = Handler()

    async def source() -> AsyncIterator[Any]:
        yield _gen("slow")
        await asyncio.sleep(3600)

    stream = multiplex(source(), "generate", h)
    first = await stream.__anext__()
    assert first.chunks[0].request_id == "slow"
    await stream.aclose()  # the caller went away
    assert h.closed == ["slow"]


async def test_a_handler_that_ends_without_finishing_reports_it() -> None:
    async def silent(request: Any, context: Any) -> AsyncIterator[common_pb2.TokenChunk]:
        yield common_pb2.TokenChunk(token_ids=[1])  # then stops, no finish reason

    got = _by_request([b async for b in multiplex(_items([_gen("s")]), "generate", silent)])
    last = got["s"][-1]
    assert last.finish_reason == common_pb2.FINISH_REASON_ERROR and last.status_code == 0
    assert "ended before it finished" in last.error


async def test_an_abort_before_the_request_ran_leaves_nothing_behind() -> None:
    h = Handler()
    batches = [b async for b in multiplex(_items([_gen("a", 5), _abort("a")]), "generate", h)]
    assert not any(c.finish_reason for b in batches for c in b.chunks)  # ended, nothing sent


async def test_a_backlog_leaves_in_bounded_batches(monkeypatch: pytest.MonkeyPatch) -> None:
    import services.common.multiplex as mx

    monkeypatch.setattr(mx, "MAX_BATCH", 4)

    async def burst(request: Any, context: Any) -> AsyncIterator[common_pb2.TokenChunk]:
        for i in range(9):
            yield common_pb2.TokenChunk(token_ids=[i], finish_reason=LENGTH if i == 8 else None)

    batches = [b async for b in multiplex(_items([_gen("b")]), "generate", burst)]
    assert max(len(b.chunks) for b in batches) <= 4
    assert [t for b in batches for c in b.chunks for t in c.token_ids] == list(range(9))


async def test_outputs_handed_over_directly_share_batches_and_merge_until_sent(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import services.common.multiplex as mx

    monkeypatch.setattr(mx, "MAX_BATCH", 2)

    async def direct(request: Any, context: Any) -> AsyncIterator[common_pb2.TokenChunk]:
        n = request.prompt_token_ids[0]
        for i in range(n):  # all before the stream sends: one chunk per request per batch
            context.put_output(RequestOutput(request.request_id, [i], f"t{i}", i == n - 1,
                                             "length" if i == n - 1 else None))  # fmt: skip
        await asyncio.sleep(0.05)  # past its deadline, finished already: no error follows
        return
        yield

    items = [_gen("a", 3, timeout_s=0.01), _gen("b", 2), _gen("c", 1)]
    batches = [b async for b in multiplex(_items(items), "generate", direct)]
    assert max(len(b.chunks) for b in batches) <= 2
    got = _by_request(batches)
    assert [(list(c.token_ids), c.text) for c in got["a"]] == [([0, 1, 2], "t0t1t2")]
    assert [list(c.token_ids) for c in got["b"] + got["c"]] == [[0, 1], [0]]
    assert all(cs[-1].finish_reason == LENGTH and not cs[-1].error for cs in got.values())


LENGTH = common_pb2.FINISH_REASON_LENGTH


async def _items(items: list[Any]) -> AsyncIterator[Any]:
    for item in items:
        yield item
