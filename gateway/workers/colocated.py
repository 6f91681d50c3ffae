"""A request on one colocated worker: its tokens come over the worker's multiplexed stream
(``WorkerService.GenerateStream``, see ``gateway.workers.multiplex``)."""

from __future__ import annotations

from collections.abc import AsyncGenerator

import grpc
from opentelemetry.trace import Span

from gateway.core.events import Chunk
from gateway.observability.tracing import child_span, end_span, grpc_metadata
from gateway.workers.client import WorkerClient
from gateway.workers.convert import (
    WorkerReportedError,
    chunk_from_pb,
    images_to_pb,
    sampling_to_pb,
)
from gateway.workers.rpc_errors import UpstreamError, stream_ended, worker_failed
from gateway.workers.work import FlowContext, WorkItem, rpc_failure
from protos import worker_pb2


async def generate(
    ctx: FlowContext, worker: WorkerClient, item: WorkItem, parent: Span
) -> AsyncGenerator[Chunk, None]:
    """Streams the request's chunks; on any early exit the call is cancelled and aborted."""
    timeout = ctx.time_left(item)
    span = child_span(ctx.tracer, "Generate", parent, **{"tandem.worker": worker.address})
    request = worker_pb2.GenerateRequest(
        request_id=item.request_id,
        prompt_token_ids=item.prompt_ids,
        sampling=sampling_to_pb(item.sampling),
        priority=item.priority,
        images=images_to_pb(item.images),
    )
    call = worker.stream().start(request, grpc_metadata(span), timeout)
    worker.inflight += 1
    finished, error = False, None
    try:
        async for msg in call:
            chunk = chunk_from_pb(msg)
            chunk.timing.mode = "colocated"
            finished = chunk.finish_reason is not None
            yield chunk
            if finished:
                return
        raise stream_ended(worker.name, worker.address, "Generate")
    except grpc.RpcError as e:
        failure = rpc_failure(worker, e, "Generate")
        error = failure.api_error.message
        raise failure from e
    except WorkerReportedError as e:
        error = str(e)
        raise worker_failed(worker.name, worker.address, str(e)) from e
    except UpstreamError as e:
        error = e.api_error.message
        raise
    finally:
        worker.inflight -= 1
        if not finished:
            call.cancel()
            ctx.abort_later(worker, item.request_id)
            error = error or "cancelled"
        end_span(span, error)
