"""``tandem worker``: a colocated worker serving whole requests (chunked prefill mixed into decode)."""

from __future__ import annotations

import argparse
from collections.abc import AsyncIterator

import grpc

from protos import common_pb2, worker_pb2, worker_pb2_grpc
from protos.roles import Role
from services.common.multiplex import multiplex
from services.common.runtime import WorkerRpcs, WorkerRuntime, run_worker
from services.common.streaming import parse_sampling, stream_chunks, submit
from services.common.tracing import start_server_span


class WorkerServicer(WorkerRpcs, worker_pb2_grpc.WorkerServiceServicer):
    def __init__(self, runtime: WorkerRuntime) -> None:
        self.rt = runtime

    async def Generate(
        self, request: worker_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[common_pb2.TokenChunk]:
        driver = await self.rt.ready_driver(context)
        params = await parse_sampling(request.sampling, context)
        stream = await submit(driver, context, request.request_id, list(request.prompt_token_ids),
                              params, request.priority)  # fmt: skip
        span = start_server_span(context, "generate", {"tandem.request_id": request.request_id})
        async for chunk in stream_chunks(self.rt, driver, stream, span=span):
            yield chunk

    async def GenerateStream(
        self, request_iterator: AsyncIterator[worker_pb2.GenerateStreamItem],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[common_pb2.ChunkBatch]:  # fmt: skip
        async for batch in multiplex(request_iterator, "generate", self.Generate):
            yield batch


def build(runtime: WorkerRuntime) -> list[str]:
    worker_pb2_grpc.add_WorkerServiceServicer_to_server(WorkerServicer(runtime), runtime.server)
    return [worker_pb2.DESCRIPTOR.services_by_name["WorkerService"].full_name]


def main(args: argparse.Namespace) -> int:
    return run_worker(args, build, Role.COLOCATED)
