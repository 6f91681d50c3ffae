"""Shared servicer plumbing: error mapping and streaming an engine request as TokenChunks."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any, NoReturn

import grpc
from opentelemetry.trace import Span

from protos import common_pb2
from protos.errors import PARAM_METADATA_KEY
from protos.pooling_params import PoolingParams
from protos.sampling_params import InvalidRequestError, SamplingParams
from services.common.convert import images_from_pb, output_to_chunk, sampling_from_pb
from services.common.multiplex import RequestContext
from services.common.runtime import WorkerRuntime
from services.common.tracing import end_span
from services.engine.driver import EngineDriver, Stream
from services.engine.outputs import RequestOutput


async def abort_invalid(context: Any, exc: InvalidRequestError) -> NoReturn:
    """End the call with INVALID_ARGUMENT and ``exc``'s message, the request field it names
    (``exc.param``) as the trailing metadata ``PARAM_METADATA_KEY``: the gateway's 400 names it
    (a multiplexed stream's error chunk carries it as ``error_param``). A refused structured
    output constraint names ``structured_outputs``: the gateway knows which of the request's
    fields asked for it and names that one."""
    param = exc.param or ""
    metadata = ((PARAM_METADATA_KEY, param),) if param else ()
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc), trailing_metadata=metadata)
    raise AssertionError("unreachable: abort raises")


async def parse_sampling(
    msg: common_pb2.SamplingParams, context: grpc.aio.ServicerContext
) -> SamplingParams:
    try:
        return sampling_from_pb(msg)
    except InvalidRequestError as exc:
        await abort_invalid(context, exc)


async def submit(
    driver: EngineDriver, context: grpc.aio.ServicerContext, request_id: str, prompt: list[int],
    params: SamplingParams, priority: int, prefill_only: bool = False, images: Any = (),
) -> Stream:  # fmt: skip
    """``images``: the request's ``repeated Image`` (protobuf), converted here."""
    if not request_id:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id must not be empty")
    try:
        items = images_from_pb(images)
        return await driver.submit(request_id, prompt, params, priority, prefill_only, items)
    except InvalidRequestError as exc:
        await abort_invalid(context, exc)
    except ValueError as exc:  # a request id that is in use
        await context.abort(grpc.StatusCode.ALREADY_EXISTS, str(exc))
    raise AssertionError("unreachable")


async def submit_embedding(
    driver: EngineDriver, context: grpc.aio.ServicerContext, request_id: str, prompt: list[int],
    pooling: PoolingParams, priority: int,
) -> Stream:  # fmt: skip
    try:
        return await driver.submit_embedding(request_id, prompt, pooling, priority)
    except InvalidRequestError as exc:
        await abort_invalid(context, exc)
    except ValueError as exc:  # a request id that is in use
        await context.abort(grpc.StatusCode.ALREADY_EXISTS, str(exc))
    raise AssertionError("unreachable")


class _Tally:
    """What a request has streamed so far: its usage, and the timing its last chunk carries."""

    def __init__(self, started: float, prefills: bool = True) -> None:
        self.started = started
        self.prefills = prefills  # False: the prompt was prefilled elsewhere (its KV came here)
        self.first: float | None = None
        self.finished = False
        self.num_tokens = 0
        self.reason: str | None = None
        self.queue_s = 0.0

    def add(self, out: RequestOutput) -> common_pb2.Timing | None:
        """Count ``out``; the request's timing if it finished it."""
        now = time.monotonic()
        first = self.first = self.first or now
        self.finished = out.finished
        self.num_tokens += len(out.token_ids)
        self.reason = out.finish_reason
        self.queue_s = max(self.queue_s, out.queue_s)
        if not out.finished:
            return None
        if not self.prefills:  # the first token here is a decode step's, as every later one
            decode_s = max(now - self.started - self.queue_s, 0.0)
            return common_pb2.Timing(queue_s=self.queue_s, decode_s=decode_s)
        return common_pb2.Timing(queue_s=self.queue_s, decode_s=now - first,
                                 prefill_s=max(first - self.started - self.queue_s, 0.0))  # fmt: skip


async def stream_chunks(
    runtime: WorkerRuntime, driver: EngineDriver, stream: Stream, started: float | None = None,
    span: Span | None = None, context: Any = None, prefills: bool = True,
) -> AsyncIterator[common_pb2.TokenChunk]:  # fmt: skip
    """Yield the request's outputs; a cancelled or broken call aborts it in the engine. An
    error the request is at fault for (``RequestOutput.error_param``) ends the call as a
    refused one (:func:`abort_invalid`), after the tokens before it.
    ``prefills`` False: a decode worker's request whose KV a prefill worker computed; its timing
    then has no prefill part (the time to its first token here is a decode step's).

    On a multiplexed stream (``context`` a ``RequestContext``) nothing is yielded: each output
    goes to the stream as the engine delivers it, and this waits for the last one.
    ``span`` (the RPC's server span) is ended here, with the output token count and finish reason.
    """
    tally = _Tally(started or time.monotonic(), prefills)
    runtime.inflight += 1
    try:
        if isinstance(context, RequestContext):
            await _send_directly(stream, tally, context)
        while not tally.finished:
            out = await stream.queue.get()
            while not out.finished and not stream.queue.empty():  # fell behind: one message
                out = out.merged(stream.queue.get_nowait())
            timing = tally.add(out)
            if out.error_param is not None and context is not None:  # the request's fault
                if out.token_ids:  # the tokens before it first
                    yield output_to_chunk(replace(out, finished=False, error=None))
                await abort_invalid(context, InvalidRequestError(out.error or "", out.error_param))
            yield output_to_chunk(out, timing=timing)
    finally:
        runtime.inflight -= 1
        stream.attach(None)
        if not tally.finished:
            driver.abort(stream.request_id)
        if span is not None:
            span.set_attribute("gen_ai.usage.output_tokens", tally.num_tokens)
            if tally.reason:
                span.set_attribute("gen_ai.response.finish_reasons", [tally.reason])
            end_span(span, None if tally.finished else "the call ended before the request finished")


async def _send_directly(stream: Stream, tally: _Tally, context: RequestContext) -> None:
    """Hand each output to the multiplexed stream on arrival; return once the last one went."""
    done = asyncio.get_running_loop().create_future()

    def send(out: RequestOutput) -> None:
        if tally.finished:  # an abort racing the last output: the request has ended
            return
        context.put_output(out, tally.add(out))
        if tally.finished and not done.done():
            done.set_result(None)

    stream.attach(send)
    await done
