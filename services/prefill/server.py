"""``tandem prefill``: chunked prefill, the first token, then the KV shipped to a decode worker."""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import grpc

from protos import common_pb2, kv_control_pb2, prefill_pb2, prefill_pb2_grpc
from protos.blocks import blocks_for
from protos.roles import Role
from services.common.convert import output_to_chunk, transfer_fields
from services.common.runtime import WorkerRpcs, WorkerRuntime, run_worker
from services.common.streaming import parse_sampling, submit
from services.common.tracing import child_span, end_span, start_server_span


class PrefillServicer(WorkerRpcs, prefill_pb2_grpc.PrefillServiceServicer):
    def __init__(self, runtime: WorkerRuntime) -> None:
        self.rt = runtime
        self.sender: Any = None  # a kvtransfer.KvSender once the model is loaded

    def start_sender(self) -> None:
        from kvtransfer import KvSender, SenderOptions

        assert self.rt.engine is not None
        caches = self.rt.engine.runner.kv_caches
        opts = SenderOptions(
            timeout_s=self.rt.config.kv_timeout_s,
            checksum=self.rt.config.kv_checksum,
            auth_token=self.rt.internal_token,
        )
        self.sender = KvSender(caches, sender_id=self.rt.worker_id, options=opts)

    def stop_sender(self) -> None:
        if self.sender is not None:
            self.sender.close()

    def transfer_load(self) -> dict[str, object]:
        if self.sender is None:
            return {}
        return transfer_fields(self.sender.stats())

    async def Prefill(
        self, request: prefill_pb2.PrefillRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[prefill_pb2.PrefillEvent]:
        driver = await self.rt.ready_driver(context)
        params = await parse_sampling(request.sampling, context)
        prompt = list(request.prompt_token_ids)
        rid = request.request_id
        target = (
            request.target if request.HasField("target") and request.target.kv_endpoint else None
        )
        first_params = replace(params, max_tokens=1, min_tokens=min(params.min_tokens, 1))
        started = time.monotonic()
        stream = await submit(driver, context, rid, prompt, first_params, request.priority,
                              prefill_only=target is not None)  # fmt: skip
        self.rt.inflight += 1
        span = start_server_span(context, "prefill", {"tandem.request_id": rid,
                                                      "gen_ai.usage.input_tokens": len(prompt)})  # fmt: skip
        error: str | None = None
        try:
            out = await stream.queue.get()
            prefill_s = time.monotonic() - started
            engine = self.rt.engine
            assert engine is not None
            done = (out.finish_reason != "length" or params.max_tokens == 1
                    or len(prompt) + 1 >= engine.max_model_len)  # fmt: skip
            timing = common_pb2.Timing(
                queue_s=out.queue_s, prefill_s=max(prefill_s - out.queue_s, 0.0)
            )
            yield prefill_pb2.PrefillEvent(first=output_to_chunk(out, finished=done, timing=timing))
            if done or target is None:
                return
            transfer = child_span(span, "kv transfer", {"tandem.kv.endpoint": target.kv_endpoint})
            try:
                event = await self._transfer(rid, len(prompt), target, context)
            except BaseException as exc:
                end_span(transfer, repr(exc))
                raise
            transfer.set_attribute("tandem.kv.bytes", event.done.bytes)
            end_span(transfer)
            yield event
        except BaseException as exc:
            error = repr(exc)
            raise
        finally:
            end_span(span, error)
            self.rt.inflight -= 1
            driver.release(rid)  # its KV has left (or never will): blocks into the prefix cache

    async def _transfer(
        self, rid: str, num_prompt: int, target: kv_control_pb2.KvTarget,
        context: grpc.aio.ServicerContext,
    ) -> prefill_pb2.PrefillEvent:  # fmt: skip
        from kvtransfer import TransferError

        assert self.rt.driver is not None and self.rt.engine is not None and self.sender is not None
        blocks = await self.rt.driver.block_ids(rid)
        n = blocks_for(num_prompt, self.rt.engine.config.cache.block_size)
        try:  # waits for its turn on the pair to the receiver; its timeout starts then
            future = self.sender.submit(target.kv_endpoint, target.reservation_id, blocks[:n],
                                        self.rt.config.kv_timeout_s)  # fmt: skip
            waiter = asyncio.wrap_future(future)
            try:
                stats = await asyncio.shield(waiter)
            except asyncio.CancelledError:
                # a transfer still queued never starts; a running one still reads these
                # blocks, so they are freed only once it is done
                future.cancel()
                await asyncio.wait([waiter])
                raise
        except TransferError as exc:
            # ABORTED, not UNAVAILABLE: the decode side failed, this prefill worker is fine
            await context.abort(
                grpc.StatusCode.ABORTED, f"KV transfer to {target.kv_endpoint} failed: {exc}"
            )
            raise
        done = kv_control_pb2.TransferDone(bytes=stats.bytes, seconds=stats.seconds, num_blocks=n)
        return prefill_pb2.PrefillEvent(done=done)


def build(runtime: WorkerRuntime) -> list[str]:
    servicer = PrefillServicer(runtime)
    prefill_pb2_grpc.add_PrefillServiceServicer_to_server(servicer, runtime.server)
    runtime.on_ready.append(servicer.start_sender)
    runtime.on_stop.append(servicer.stop_sender)
    runtime.extra_load = servicer.transfer_load
    return [prefill_pb2.DESCRIPTOR.services_by_name["PrefillService"].full_name]


def main(args: argparse.Namespace) -> int:
    return run_worker(args, build, Role.PREFILL)
