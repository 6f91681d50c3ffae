"""An embeddings request on one worker started with ``--task embed``: one unary ``Embed`` call
carrying every input; cancelling it (the client left, the deadline passed) aborts the inputs
still running on the worker."""

from __future__ import annotations

import grpc
from opentelemetry.trace import Span

from gateway.core.errors import APIError
from gateway.core.events import Embedding, EmbedWork
from gateway.observability.tracing import child_span, end_span, grpc_metadata
from gateway.workers.client import WorkerClient
from gateway.workers.convert import embed_request_to_pb, embeddings_from_pb
from gateway.workers.rpc_errors import UpstreamError
from gateway.workers.work import FlowContext, rpc_failure


async def embed(
    ctx: FlowContext, worker: WorkerClient, work: EmbedWork, timeout_s: float, parent: Span
) -> list[Embedding]:
    """One vector per input, in order; UpstreamError when the call fails."""
    span = child_span(ctx.tracer, "Embed", parent, **{"tandem.worker": worker.address})
    worker.inflight += 1
    error: str | None = "cancelled"
    try:
        reply = await worker.stub.Embed(
            embed_request_to_pb(work), timeout=timeout_s, metadata=grpc_metadata(span)
        )
        error = None
    except grpc.RpcError as e:
        failure = rpc_failure(worker, e, "Embed")
        error = failure.api_error.message
        raise failure from e
    finally:
        worker.inflight -= 1
        end_span(span, error)
    out = embeddings_from_pb(reply)
    if len(out) != len(work.inputs):
        message = f"Embed on worker {worker.address} returned {len(out)} of {len(work.inputs)}"
        raise UpstreamError(APIError(502, message, code="worker_error"), retryable=True,
                            address=worker.address)  # fmt: skip
    return out
