"""``tandem prefill``: chunked prefill, the first token, then the KV shipped to a decode worker."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import TYPE_CHECKING

import grpc
from opentelemetry.trace import Span

from protos import common_pb2, kv_control_pb2, prefill_pb2, prefill_pb2_grpc
from protos.blocks import blocks_for
from protos.roles import Role
from protos.sampling_params import InvalidRequestError
from services.common.convert import output_to_chunk, transfer_fields
from services.common.runtime import WorkerRpcs, WorkerRuntime, run_worker
from services.common.streaming import abort_invalid, parse_sampling, submit
from services.common.tracing import child_span, end_span, start_server_span
from services.engine.detokenizer import held_back
from services.engine.driver import EngineDriver

if TYPE_CHECKING:
    from services.prefill.handoff import Handoff, Handoffs


class PrefillServicer(WorkerRpcs, prefill_pb2_grpc.PrefillServiceServicer):
    def __init__(self, runtime: WorkerRuntime) -> None:
        self.rt = runtime
        self.handoffs: Handoffs | None = None  # once the model is loaded
        self.streaming = False  # once the model is loaded: WorkerConfig.streaming_on

    def start_sender(self) -> None:
        from kvtransfer import KvSender, SenderOptions
        from services.prefill.handoff import Handoffs

        assert self.rt.engine is not None and self.rt.driver is not None
        config = self.rt.config
        caches = self.rt.engine.runner.kv_caches
        opts = SenderOptions(
            timeout_s=config.kv_timeout_s,
            checksum=config.kv_checksum,
            auth_token=self.rt.internal_token,
        )
        # tensor parallelism: whole blocks gathered from every rank's heads (services.engine.tp_kv)
        shards = self.rt.engine.runner.kv_shards()
        sender = KvSender(caches, sender_id=self.rt.worker_id, options=opts, shards=shards)
        self.handoffs = Handoffs(sender, caches[0].device, config.kv_timeout_s)
        self.streaming = config.streaming_on(caches[0].device.type)
        if self.streaming:  # each prompt's KV leaves as its last chunk's forward writes it
            self.rt.driver.on_final_chunks(self.handoffs.on_final_chunks).result()

    def stop_sender(self) -> None:
        if self.handoffs is not None:
            self.handoffs.sender.close()

    def transfer_load(self) -> dict[str, object]:
        # kv_whole: without streaming each KV goes whole after the first token, where blocks
        # granted with the reservation save a round trip (the gateway asks for them)
        whole: dict[str, object] = {"kv_whole": not self.streaming}
        if self.handoffs is None:
            return whole
        return {**transfer_fields(self.handoffs.sender.stats()), **whole}

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
        handoff = await self._open(rid, target, context) if target is not None else None
        # the first token only; a stop string in it counts only if min_tokens allows one there
        # (else the decode worker, counting from it, matches across the tokens after it)
        first_params = replace(
            params, max_tokens=1, min_tokens=min(params.min_tokens, 1),
            stop=params.stop if params.min_tokens <= 1 else (),
        )  # fmt: skip
        started = time.monotonic()
        try:
            stream = await submit(driver, context, rid, prompt, first_params, request.priority,
                                  prefill_only=target is not None, images=request.images)  # fmt: skip
        except BaseException:
            if handoff is not None:  # a request added meanwhile was aborted by the driver
                self._finish(handoff, None)
            raise
        self.rt.inflight += 1
        span = start_server_span(context, "prefill", {"tandem.request_id": rid,
                                                      "gen_ai.usage.input_tokens": len(prompt)})  # fmt: skip
        error: str | None = None
        try:
            out = await stream.queue.get()
            if out.error_param is not None:  # the request's fault (its masks left no token)
                await abort_invalid(context, InvalidRequestError(out.error or "", out.error_param))
            first_at = time.monotonic()
            prefill_s = first_at - started
            engine = self.rt.engine
            assert engine is not None
            done = (out.finish_reason != "length" or params.max_tokens == 1
                    or len(prompt) + 1 >= engine.max_model_len)  # fmt: skip
            if not done:  # the engine released all of it (max_tokens 1 there), less a
                # character the first token only begins (never released: the decode worker
                # spells it once complete); what may begin a stop string is the decode worker's
                # too, held back there as well (LLMEngine.activate), which finds the stop string
                # across the tokens
                keep = max(len(out.text) - held_back(params.stop), 0)
                out = replace(out, text=out.text[:keep])
            timing = common_pb2.Timing(
                queue_s=out.queue_s, prefill_s=max(prefill_s - out.queue_s, 0.0)
            )
            yield prefill_pb2.PrefillEvent(first=output_to_chunk(out, finished=done, timing=timing))
            if handoff is not None and done:
                await self._unneeded(handoff)
            elif handoff is not None:
                yield await self._traced_transfer(span, handoff, len(prompt), first_at, context)
        except BaseException as exc:
            error = repr(exc)
            raise
        finally:
            end_span(span, error)
            self.rt.inflight -= 1
            if handoff is not None:  # its KV has left (or never will): into the prefix cache
                self._finish(handoff, driver)
            else:
                driver.release(rid)

    async def _open(
        self, rid: str, target: kv_control_pb2.KvTarget, context: grpc.aio.ServicerContext
    ) -> Handoff:
        if self.handoffs is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"{self.rt.worker_id} is starting")
        assert self.handoffs is not None
        grant = None
        if target.kv_grant:
            from kvtransfer.grants import Grant

            try:
                grant = Grant.from_json(json.loads(target.kv_grant))
            except ValueError as exc:  # json's errors are ValueErrors too
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    f"target.kv_grant is not a KV grant: {exc}")  # fmt: skip
        handoff = self.handoffs.open(rid, target.kv_endpoint, target.reservation_id, grant)
        if handoff is None:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"request id {rid!r} is in use")
        assert handoff is not None
        return handoff

    def _finish(self, handoff: Handoff, driver: EngineDriver | None) -> None:
        """The call is over: its blocks go back once no transfer reads them."""
        assert self.handoffs is not None
        rid = handoff.request_id
        self.handoffs.finish(handoff, (lambda: driver.release(rid)) if driver else lambda: None)

    async def _traced_transfer(
        self, span: Span, handoff: Handoff, num_prompt: int, first_at: float,
        context: grpc.aio.ServicerContext,
    ) -> prefill_pb2.PrefillEvent:  # fmt: skip
        transfer = child_span(span, "kv transfer", {"tandem.kv.endpoint": handoff.endpoint,
                                                    "tandem.kv.streamed": handoff.streamed})  # fmt: skip
        try:
            event = await self._transfer(handoff, num_prompt, first_at, context)
        except BaseException as exc:
            end_span(transfer, repr(exc))
            raise
        transfer.set_attribute("tandem.kv.bytes", event.done.bytes)
        end_span(transfer)
        return event

    @staticmethod
    async def _unneeded(handoff: Handoff) -> None:
        """The first token ended the request: its streamed transfer is cancelled if it still
        waits for its turn, or else allowed to end before the call does (the gateway releases
        the reservation it writes into once the call has ended: not a failed transfer)."""
        future = handoff.future
        if future is not None and not future.cancel():
            with contextlib.suppress(Exception):
                await asyncio.wrap_future(future)

    async def _transfer(
        self, handoff: Handoff, num_prompt: int, first_at: float,
        context: grpc.aio.ServicerContext,
    ) -> prefill_pb2.PrefillEvent:  # fmt: skip
        """Await the KV transfer: streamed, it was submitted before the last chunk's forward;
        otherwise the whole KV is submitted now. A cancelled call cancels a transfer still
        waiting for its turn; one running ends before the blocks are released (``_finish``)."""
        from kvtransfer import TransferError

        assert self.rt.driver is not None and self.rt.engine is not None
        assert self.handoffs is not None
        n = blocks_for(num_prompt, self.rt.engine.config.cache.block_size)
        future = handoff.future
        try:
            if future is None:  # off, or the hook could not submit it: the whole KV, now
                blocks = await self.rt.driver.block_ids(handoff.request_id)
                future = self.handoffs.submit_whole(handoff, blocks[:n])
            if future is None:  # an Abort closed it meanwhile
                await context.abort(grpc.StatusCode.CANCELLED, "the request was aborted")
            assert future is not None
            # waits for its turn on the pair to the receiver; its timeout starts then
            stats = await asyncio.wrap_future(future)
        except TransferError as exc:
            # ABORTED, not UNAVAILABLE: the decode side failed, this prefill worker is fine
            await context.abort(
                grpc.StatusCode.ABORTED, f"KV transfer to {handoff.endpoint} failed: {exc}"
            )
            raise
        # what the hand-off added after the first token (a streamed one overlapped the prefill)
        seconds = min(stats.seconds, time.monotonic() - first_at)
        done = kv_control_pb2.TransferDone(bytes=stats.bytes, seconds=seconds, num_blocks=n)
        return prefill_pb2.PrefillEvent(done=done)

    async def Abort(
        self, request: common_pb2.AbortRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.AbortResponse:
        """As every role's, but the blocks of a request whose KV is on its way are released
        only once that transfer has ended (one still waiting for its turn is cancelled)."""
        driver, rid = self.rt.driver, request.request_id
        handoffs = self.handoffs
        if (
            driver is not None
            and handoffs is not None
            and handoffs.close(rid, lambda: driver.abort(rid))
        ):
            return common_pb2.AbortResponse(found=True)
        return await super().Abort(request, context)


def build(runtime: WorkerRuntime) -> list[str]:
    servicer = PrefillServicer(runtime)
    prefill_pb2_grpc.add_PrefillServiceServicer_to_server(servicer, runtime.server)
    runtime.on_ready.append(servicer.start_sender)
    runtime.on_stop.append(servicer.stop_sender)
    runtime.extra_load = servicer.transfer_load
    runtime.ready_extra = lambda: {"kv_streaming": servicer.streaming}
    return [prefill_pb2.DESCRIPTOR.services_by_name["PrefillService"].full_name]


def main(args: argparse.Namespace) -> int:
    return run_worker(args, build, Role.PREFILL)
