"""An embeddings request on the workers started with ``--task embed``: its inputs in parts of
at most ``CALL_INPUTS``, each one unary ``Embed`` call on the embed worker its first input ranks
first (prefix affinity), retried once on another after a retryable failure. Any early exit (the
client left, the deadline passed, a part failed) cancels the calls still open, which aborts
their inputs on the workers."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace

import grpc
from opentelemetry.trace import Span

from gateway.core.errors import APIError, unavailable
from gateway.core.events import Embedding, EmbedWork
from gateway.observability.tracing import child_span, end_span, grpc_metadata
from gateway.workers.client import WorkerClient
from gateway.workers.convert import embed_request_to_pb, embeddings_from_pb
from gateway.workers.router import prefix_key, rank_by_affinity
from gateway.workers.rpc_errors import UpstreamError
from gateway.workers.work import FlowContext, rpc_failure
from protos.roles import Role

log = logging.getLogger(__name__)
# inputs per Embed call: 2048 vectors of a 4096-wide model would pass the 32 MiB message limit;
# parts also spread a large batch over several embed workers
CALL_INPUTS = 256
MAX_ATTEMPTS = 2


async def embed_batch(ctx: FlowContext, work: EmbedWork, parent: Span) -> list[Embedding]:
    """One vector per input, in order; UpstreamError when a part cannot be served."""
    n = len(work.inputs)
    parts = [
        replace(work, request_id=f"{work.request_id}-p{a // CALL_INPUTS}",
                inputs=work.inputs[a : a + CALL_INPUTS])
        for a in range(0, n, CALL_INPUTS)
    ] if n > CALL_INPUTS else [work]  # fmt: skip
    tasks = [asyncio.ensure_future(_with_retry(ctx, part, parent)) for part in parts]
    try:
        done = await asyncio.gather(*tasks)
    finally:
        for task in tasks:  # a part failed: the others are no use any more
            task.cancel()
    return [vector for part in done for vector in part]


async def _with_retry(ctx: FlowContext, work: EmbedWork, parent: Span) -> list[Embedding]:
    failed: set[str] = set()
    for attempt in range(MAX_ATTEMPTS):
        workers = [
            w for w in ctx.registry.healthy(Role.COLOCATED)
            if w.task == "embed" and w.address not in failed
        ]  # fmt: skip
        if not workers:
            raise UpstreamError(unavailable("no healthy worker started with --task embed is left"),
                                retryable=False)  # fmt: skip
        key = prefix_key(work.inputs[0], workers[0].block_size, ctx.config.prefix_blocks)
        worker = rank_by_affinity(workers, key)[0]
        left = work.deadline - time.monotonic()
        if left <= 0:
            api = APIError(504, "the request ran past --request-timeout", code="deadline_exceeded")
            raise UpstreamError(api, retryable=False)
        rid = work.request_id if attempt == 0 else f"{work.request_id}-retry{attempt}"
        try:
            return await embed(ctx, worker, replace(work, request_id=rid), left, parent)
        except UpstreamError as e:
            if attempt + 1 >= MAX_ATTEMPTS or not e.retryable:
                raise
            log.warning("retrying %s on another worker: %s", work.request_id, e)
            failed.add(worker.address)
    raise AssertionError("unreachable")


async def embed(
    ctx: FlowContext, worker: WorkerClient, work: EmbedWork, timeout_s: float, parent: Span
) -> list[Embedding]:
    """One Embed call: a vector per input, in order; UpstreamError when the call fails."""
    span = child_span(ctx.tracer, "Embed", parent, **{"tandem.worker": worker.address})
    worker.inflight += 1
    error: str | None = "cancelled"
    try:
        reply = await worker.unless_lost(
            worker.stub.Embed(
                embed_request_to_pb(work), timeout=timeout_s, metadata=grpc_metadata(span)
            )
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
        message = f"Embed on worker {worker.name} returned {len(out)} of {len(work.inputs)}"
        raise UpstreamError(APIError(502, message, code="worker_error"), retryable=True,
                            address=worker.address)  # fmt: skip
    return out
