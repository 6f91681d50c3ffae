"""Shared servicer plumbing: error mapping and streaming an engine request as TokenChunks."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
from opentelemetry.trace import Span

from protos import common_pb2
from protos.pooling_params import PoolingParams
from protos.sampling_params import InvalidRequestError, SamplingParams
from services.common.convert import images_from_pb, output_to_chunk, sampling_from_pb
from services.common.runtime import WorkerRuntime
from services.common.tracing import end_span
from services.engine.driver import EngineDriver, Stream


async def parse_sampling(
    msg: common_pb2.SamplingParams, context: grpc.aio.ServicerContext
) -> SamplingParams:
    try:
        return sampling_from_pb(msg)
    except InvalidRequestError as exc:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        raise  # unreachable: abort raises


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
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
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
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
    except ValueError as exc:  # a request id that is in use
        await context.abort(grpc.StatusCode.ALREADY_EXISTS, str(exc))
    raise AssertionError("unreachable")


async def stream_chunks(
    runtime: WorkerRuntime, driver: EngineDriver, stream: Stream, started: float | None = None,
    span: Span | None = None,
) -> AsyncIterator[common_pb2.TokenChunk]:  # fmt: skip
    """Yield the request's outputs; a cancelled or broken call aborts it in the engine.

    ``span`` (the RPC's server span) is ended here, with the output token count and finish reason.
    """
    started = started or time.monotonic()
    first: float | None = None
    finished = False
    num_tokens = 0
    reason: str | None = None
    queue_s = 0.0
    runtime.inflight += 1
    try:
        while not finished:
            out = await stream.queue.get()
            while not out.finished and not stream.queue.empty():  # fell behind: one message
                out = out.merged(stream.queue.get_nowait())
            now = time.monotonic()
            first = first or now
            finished = out.finished
            num_tokens += len(out.token_ids)
            reason = out.finish_reason
            queue_s = max(queue_s, out.queue_s)
            timing = None
            if finished:
                timing = common_pb2.Timing(queue_s=queue_s, prefill_s=max(first - started - queue_s, 0.0),
                                           decode_s=now - first)  # fmt: skip
            yield output_to_chunk(out, timing=timing)
    finally:
        runtime.inflight -= 1
        if not finished:
            driver.abort(stream.request_id)
        if span is not None:
            span.set_attribute("gen_ai.usage.output_tokens", num_tokens)
            if reason:
                span.set_attribute("gen_ai.response.finish_reasons", [reason])
            end_span(span, None if finished else "the call ended before the request finished")
