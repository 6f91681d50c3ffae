"""A request's stream: what piled up while the consumer was behind goes out as one chunk; on a
multiplexed stream each output goes into the batch being built as it arrives."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import grpc
import pytest

from protos import common_pb2, worker_pb2
from protos.errors import PARAM_METADATA_KEY
from protos.logprobs import PositionLogprobs, TokenLogprob
from services.common.multiplex import multiplex
from services.common.streaming import stream_chunks
from services.engine.driver import Stream
from services.engine.outputs import RequestOutput


def _out(tok: int, text: str, finished: bool = False) -> RequestOutput:
    lp = [PositionLogprobs(TokenLogprob(tok, -0.5, text))]
    reason = "length" if finished else None
    return RequestOutput("r", [tok], text, finished, reason, None, 7, 2, lp)


class _Driver:
    def __init__(self) -> None:
        self.aborted: list[str] = []

    def abort(self, rid: str) -> None:
        self.aborted.append(rid)


async def _collect(stream: Stream, feed: Any) -> tuple[list[common_pb2.TokenChunk], _Driver]:
    runtime, driver = SimpleNamespace(inflight=0), _Driver()
    feeder = asyncio.ensure_future(feed())
    chunks = [c async for c in stream_chunks(runtime, driver, stream)]  # type: ignore[arg-type]
    await feeder
    assert runtime.inflight == 0
    return chunks, driver


async def test_outputs_that_piled_up_leave_as_one_chunk() -> None:
    stream = Stream("r", asyncio.get_running_loop())

    async def feed() -> None:
        for i, done in ((1, False), (2, False), (3, True)):
            stream.queue.put_nowait(_out(i, f"t{i}", done))

    chunks, driver = await _collect(stream, feed)
    assert len(chunks) == 1
    (c,) = chunks
    assert list(c.token_ids) == [1, 2, 3] and c.text == "t1t2t3"
    assert [p.chosen.token_id for p in c.logprobs] == [1, 2, 3]
    assert c.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert c.num_prompt_tokens == 7 and c.num_cached_tokens == 2
    assert driver.aborted == []


async def test_a_consumer_that_keeps_up_gets_one_chunk_per_output() -> None:
    stream = Stream("r", asyncio.get_running_loop())

    async def feed() -> None:
        for i, done in ((1, False), (2, False), (3, True)):
            stream.queue.put_nowait(_out(i, f"t{i}", done))
            await asyncio.sleep(0.01)

    chunks, _ = await _collect(stream, feed)
    assert [list(c.token_ids) for c in chunks] == [[1], [2], [3]]


def test_merged_keeps_the_later_finish_and_the_earlier_counts() -> None:
    a = RequestOutput("r", [5], "a", False, None, None, 3, 1)
    b = RequestOutput("r", [6], "b", True, "stop", "</s>", 0, 0, error=None)
    m = a.merged(b)
    assert (m.token_ids, m.text, m.finished, m.finish_reason, m.stop_reason) == (
        [5, 6], "ab", True, "stop", "</s>",
    )  # fmt: skip
    assert (m.num_prompt_tokens, m.num_cached_tokens) == (3, 1)


def _mux_handler(stream: Stream, runtime: Any, driver: _Driver) -> Any:
    async def handler(request: Any, context: Any) -> AsyncIterator[common_pb2.TokenChunk]:
        async for chunk in stream_chunks(runtime, driver, stream, context=context):
            yield chunk

    return handler


async def test_on_a_multiplexed_stream_outputs_go_into_the_batch_as_they_arrive() -> None:
    stream = Stream("r", asyncio.get_running_loop())
    stream.queue.put_nowait(_out(1, "t1"))  # delivered before the handler attached
    runtime, driver = SimpleNamespace(inflight=0), _Driver()
    item = worker_pb2.GenerateStreamItem(generate=worker_pb2.GenerateRequest(request_id="r"))
    mux = multiplex(_items([item]), "generate", _mux_handler(stream, runtime, driver))
    first = await mux.__anext__()
    assert [list(c.token_ids) for c in first.chunks] == [[1]]
    stream.take(_out(2, "t2"))  # a step's outputs before the next send: merged into one chunk
    stream.take(_out(3, "t3", finished=True))
    rest = [b async for b in mux]
    (chunk,) = [c for b in rest for c in b.chunks]
    assert list(chunk.token_ids) == [2, 3] and chunk.text == "t2t3" and chunk.request_id == "r"
    assert [p.chosen.token_id for p in chunk.logprobs] == [2, 3]
    assert chunk.finish_reason == common_pb2.FINISH_REASON_LENGTH and chunk.HasField("timing")
    assert runtime.inflight == 0 and driver.aborted == [] and stream.sink is None


async def test_an_aborted_multiplexed_request_is_aborted_in_the_engine_and_detached() -> None:
    stream = Stream("r", asyncio.get_running_loop())
    runtime, driver = SimpleNamespace(inflight=0), _Driver()
    gen = worker_pb2.GenerateStreamItem(generate=worker_pb2.GenerateRequest(request_id="r"))
    abort = worker_pb2.GenerateStreamItem(abort=common_pb2.AbortRequest(request_id="r"))
    sent = asyncio.Event()

    async def items() -> AsyncIterator[Any]:
        yield gen
        await sent.wait()
        yield abort

    mux = multiplex(items(), "generate", _mux_handler(stream, runtime, driver))
    stream.queue.put_nowait(_out(1, "t1"))
    assert [list(c.token_ids) for c in (await mux.__anext__()).chunks] == [[1]]
    sent.set()
    assert [b async for b in mux] == []
    assert driver.aborted == ["r"] and runtime.inflight == 0 and stream.sink is None
    stream.take(_out(2, "t2"))  # a late output: nobody reads it, nothing breaks
    assert stream.queue.qsize() == 1


async def _items(items: list[Any]) -> AsyncIterator[Any]:
    for item in items:
        yield item


def test_a_request_prefilled_elsewhere_reports_no_prefill_time() -> None:
    """A decode worker's request whose KV came from a prefill worker: its first token here is a
    decode step's, so all its time is decode time (it was reported as prefill time, which the
    gateway's timing kept over the prefill worker's: prefill=0.30 beside ttft=0.20)."""
    import time

    from services.common.streaming import _Tally

    started = time.monotonic() - 0.5
    here = _Tally(started, prefills=True)
    assert here.add(_out(1, "a")) is None
    timing = here.add(_out(2, "b", finished=True))
    assert timing is not None and timing.prefill_s >= 0.5 and timing.decode_s < 0.5
    elsewhere = _Tally(started, prefills=False)
    assert elsewhere.add(_out(1, "a")) is None
    timing = elsewhere.add(_out(2, "b", finished=True))
    assert timing is not None and timing.prefill_s == 0.0 and timing.decode_s >= 0.5


_REFUSED = RequestOutput("r", [], "", True, "error", error="none left", error_param="bad_words")


async def test_an_error_the_request_is_at_fault_for_ends_its_call_as_refused() -> None:
    """``error_param``: the call ends with INVALID_ARGUMENT naming the field (what the gateway
    makes a 400 of), after a chunk of the tokens that came before it."""

    class Context:
        aborted: tuple[Any, ...] = ()

        async def abort(self, code: Any, details: str, trailing_metadata: Any = ()) -> None:
            self.aborted = (code, details, tuple(trailing_metadata))
            raise RuntimeError("aborted")

    stream, context = Stream("r", asyncio.get_running_loop()), Context()
    stream.queue.put_nowait(_out(1, "t1"))
    stream.queue.put_nowait(_REFUSED)  # behind the tokens: merged with them
    runtime, driver = SimpleNamespace(inflight=0), _Driver()
    chunks = []
    with pytest.raises(RuntimeError, match="aborted"):
        async for chunk in stream_chunks(runtime, driver, stream, context=context):  # type: ignore[arg-type]
            chunks.append(chunk)
    (c,) = chunks
    assert list(c.token_ids) == [1] and c.finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED
    assert not c.error
    code = grpc.StatusCode.INVALID_ARGUMENT
    assert context.aborted == (code, "none left", ((PARAM_METADATA_KEY, "bad_words"),))
    assert driver.aborted == [] and runtime.inflight == 0  # it had finished in the engine


async def test_on_a_multiplexed_stream_such_an_error_is_an_invalid_argument_chunk() -> None:
    stream = Stream("r", asyncio.get_running_loop())
    stream.queue.put_nowait(_out(1, "t1"))
    stream.queue.put_nowait(_REFUSED)
    runtime, driver = SimpleNamespace(inflight=0), _Driver()
    item = worker_pb2.GenerateStreamItem(generate=worker_pb2.GenerateRequest(request_id="r"))
    mux = multiplex(_items([item]), "generate", _mux_handler(stream, runtime, driver))
    tokens, error = [c for b in [b async for b in mux] for c in b.chunks]
    assert list(tokens.token_ids) == [1] and not tokens.finish_reason
    assert error.finish_reason == common_pb2.FINISH_REASON_ERROR and error.error == "none left"
    assert error.status_code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert error.error_param == "bad_words" and not error.token_ids
    assert driver.aborted == [] and runtime.inflight == 0
