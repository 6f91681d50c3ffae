"""``tandem worker``: a colocated worker serving whole requests (chunked prefill mixed into
decode), or, started with ``--task embed``, embeddings (prefill only, one pooled vector each)."""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import AsyncIterator

import grpc

from protos import common_pb2, worker_pb2, worker_pb2_grpc
from protos.roles import Role
from services.common.convert import embedding_to_pb, pooling_from_pb
from services.common.multiplex import multiplex
from services.common.runtime import WorkerRpcs, WorkerRuntime, run_worker
from services.common.streaming import parse_sampling, stream_chunks, submit, submit_embedding
from services.common.tracing import end_span, start_server_span
from services.engine.driver import EngineDriver, Stream
from services.engine.outputs import RequestOutput

MAX_EMBED_INPUTS = 2048  # the gateway sends at most its own limit (gateway.flows.embeddings)


class WorkerServicer(WorkerRpcs, worker_pb2_grpc.WorkerServiceServicer):
    def __init__(self, runtime: WorkerRuntime) -> None:
        self.rt = runtime

    async def Generate(
        self, request: worker_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[common_pb2.TokenChunk]:
        driver = await self.rt.ready_driver(context)
        params = await parse_sampling(request.sampling, context)
        stream = await submit(driver, context, request.request_id, list(request.prompt_token_ids),
                              params, request.priority, images=request.images)  # fmt: skip
        span = start_server_span(context, "generate", {"tandem.request_id": request.request_id})
        async for chunk in stream_chunks(self.rt, driver, stream, span=span, context=context):
            yield chunk

    async def GenerateStream(
        self, request_iterator: AsyncIterator[worker_pb2.GenerateStreamItem],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[common_pb2.ChunkBatch]:  # fmt: skip
        async for batch in multiplex(request_iterator, "generate", self.Generate):
            yield batch

    async def Embed(
        self, request: worker_pb2.EmbedRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.EmbedResponse:
        """Every input joins the engine at once (they batch like any prefills); a call that
        ends early (cancelled, past its deadline) aborts the inputs still running."""
        driver = await self.rt.ready_driver(context)
        if not request.request_id or not 0 < len(request.inputs) <= MAX_EMBED_INPUTS:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"an Embed call needs a request_id and 1 to {MAX_EMBED_INPUTS} inputs",
            )
        pooling = pooling_from_pb(request, self.rt.config.engine.pooler)
        span = start_server_span(context, "embed", {"tandem.request_id": request.request_id})
        streams: list[Stream] = []
        outputs: list[RequestOutput] = []
        self.rt.inflight += 1
        try:
            for i, item in enumerate(request.inputs):
                streams.append(await submit_embedding(
                    driver, context, f"{request.request_id}-{i}", list(item.token_ids), pooling,
                    request.priority,
                ))  # fmt: skip
            outputs = list(await asyncio.gather(*(_final(s) for s in streams)))
        finally:
            self.rt.inflight -= 1
            _abort_unfinished(driver, streams, outputs)
            failed = next((o.error or "aborted" for o in outputs if o.embedding is None), None)
            end_span(span, failed if len(outputs) == len(streams) else "ended early")
        if failed is not None:
            await context.abort(grpc.StatusCode.INTERNAL, f"embedding failed: {failed}")
        return worker_pb2.EmbedResponse(embeddings=[embedding_to_pb(o) for o in outputs])


async def _final(stream: Stream) -> RequestOutput:
    """An embedding's one output (an abort or an engine failure: one without a vector)."""
    out = await stream.queue.get()
    while not out.finished:
        out = await stream.queue.get()
    return out


def _abort_unfinished(
    driver: EngineDriver, streams: list[Stream], outputs: list[RequestOutput]
) -> None:
    if len(outputs) < len(streams):  # all or nothing: gather ended without results
        for s in streams:
            driver.abort(s.request_id)


def build(runtime: WorkerRuntime) -> list[str]:
    worker_pb2_grpc.add_WorkerServiceServicer_to_server(WorkerServicer(runtime), runtime.server)
    return [worker_pb2.DESCRIPTOR.services_by_name["WorkerService"].full_name]


def main(args: argparse.Namespace) -> int:
    return run_worker(args, build, Role.COLOCATED)
