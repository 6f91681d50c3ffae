"""``tandem decode``: admission (Reserve), KV received into the reserved blocks, then
continuous-batching generation streamed back."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc

from protos import common_pb2, decode_pb2, decode_pb2_grpc, kv_control_pb2
from services.common.convert import sampling_from_pb, transfer_fields
from services.common.multiplex import multiplex
from services.common.runtime import WorkerRpcs, WorkerRuntime, run_worker
from services.common.streaming import stream_chunks
from services.common.tracing import start_server_span
from services.decode.admission import AdmissionQueue
from services.scheduling.block_pool import blocks_for
from services.scheduling.sampling_params import InvalidRequestError, SamplingParams

if TYPE_CHECKING:
    from services.engine.driver import EngineDriver
    from services.engine.llm_engine import LLMEngine

log = logging.getLogger(__name__)
MAX_TTL_S = 3600.0  # the gateway asks for its request's remaining time (--request-timeout)
# a reservation nobody renews a lease for (a caller that names no owner) lives at most this long
UNOWNED_MAX_TTL_S = 60.0


def reservation_ttl(ttl_s: float, owner: str) -> float:
    """Seconds an unclaimed reservation lives: as asked (10 s if not said), capped; an owned
    one is also freed soon after its owner stops polling (services.common.leases)."""
    return min(ttl_s if ttl_s > 0 else 10.0, MAX_TTL_S if owner else UNOWNED_MAX_TTL_S)


class Draining(Exception):
    """The worker stops admitting: a waiting Reserve ends UNAVAILABLE."""


@dataclass
class Reservation:
    request_id: str
    num_prompt_tokens: int
    handle: Any  # kvtransfer.TransferHandle
    expiry: asyncio.TimerHandle
    owner: str = ""  # the gateway whose lease keeps it (services.common.leases)
    claimed: bool = False


async def _wait_for_kv(handle: Any, timeout_s: float) -> Any:
    """The transfer's result, or None after ``timeout_s``; no thread is held while waiting."""
    loop = asyncio.get_running_loop()
    arrived: asyncio.Future[Any] = loop.create_future()

    def settle(result: Any) -> None:
        if not arrived.done():
            arrived.set_result(result)

    def on_done(result: Any) -> None:  # on a receiver thread (or here, if already done)
        with contextlib.suppress(RuntimeError):  # the loop closed at shutdown
            loop.call_soon_threadsafe(settle, result)

    handle.add_done_callback(on_done)
    try:
        return await asyncio.wait_for(arrived, timeout_s)
    except TimeoutError:
        return None


class DecodeServicer(WorkerRpcs, decode_pb2_grpc.DecodeServiceServicer):
    def __init__(self, runtime: WorkerRuntime) -> None:
        self.rt = runtime
        self.receiver: Any = None  # kvtransfer.KvReceiver once the model is loaded
        self.reservations: dict[str, Reservation] = {}
        self._lease_timer: asyncio.TimerHandle | None = None
        self.admission = AdmissionQueue(
            self._release_admitted, by_priority=runtime.args.scheduling_policy == "priority"
        )

    # ---- KV receiver lifecycle ---------------------------------------------------------------
    def start_receiver(self) -> None:
        from kvtransfer import KvReceiver, ReceiverOptions

        assert self.rt.engine is not None
        a = self.rt.args
        opts = ReceiverOptions(host=a.kv_host or a.host, port=a.kv_port, io_timeout_s=a.kv_timeout,
                               advertise_host=a.kv_host or "",
                               auth_token=self.rt.internal_token)  # fmt: skip
        self.receiver = KvReceiver(self.rt.engine.runner.kv_caches, opts)
        assert self.rt.driver is not None
        self.rt.driver.after_work.append(
            lambda e: self.admission.on_blocks_freed(e.kv.num_free_blocks)
        )

    def stop_admission(self) -> None:
        """Draining: Reserve calls still waiting for blocks fail (UNAVAILABLE, retryable)."""
        self.admission.fail_all(Draining(f"{self.rt.worker_id} is draining"))

    def _release_admitted(self, rid: str) -> None:
        if self.rt.driver is not None:
            self.rt.driver.call(lambda e: e.cancel_reservation(rid))

    def stop_receiver(self) -> None:
        if self.receiver is not None:
            self.receiver.close()

    def ready_extra(self) -> dict[str, Any]:
        return {"kv_port": self.receiver.port if self.receiver else 0,
                "kv_endpoint": self.receiver.endpoint if self.receiver else ""}  # fmt: skip

    def transfer_load(self) -> dict[str, object]:
        if self.receiver is None:
            return {}
        return transfer_fields(self.receiver.stats())

    # ---- reservations ------------------------------------------------------------------------
    async def Reserve(
        self, request: kv_control_pb2.ReserveRequest, context: grpc.aio.ServicerContext
    ) -> kv_control_pb2.ReserveResponse:
        driver = await self.rt.ready_driver(context)
        rid, n = request.request_id, request.num_prompt_tokens
        if not rid or n < 1 or request.wait_s < 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id, num_prompt_tokens "
                                ">= 1 and wait_s >= 0 are required")  # fmt: skip
        if rid in self.reservations or rid in self.admission:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"{rid!r} is already reserved")
        params = SamplingParams(max_tokens=max(request.max_tokens, 1))
        started = time.monotonic()
        try:
            blocks = await self._reserve_or_wait(driver, rid, n, params, request)
        except InvalidRequestError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except ValueError as exc:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, str(exc))
        except Draining as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        if blocks is None:
            waited = time.monotonic() - started
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"no free KV blocks for a {n}-token prompt on {self.rt.worker_id} "
                                f"(waited {waited:.1f} s, {len(self.admission)} waiting)")  # fmt: skip
        assert self.rt.engine is not None and blocks is not None
        ttl = reservation_ttl(request.ttl_s, request.owner)
        nblk = blocks_for(n, self.rt.engine.config.cache.block_size)
        handle = self.receiver.expect(rid, blocks[:nblk], deadline_s=ttl)
        loop = asyncio.get_running_loop()
        expiry = loop.call_later(ttl, self._expire, rid)
        self.rt.leases.renew(request.owner)
        self.reservations[rid] = Reservation(rid, n, handle, expiry, request.owner)
        self._watch_leases(loop)
        handle.add_done_callback(lambda result: self._on_transfer_end(loop, rid, handle, result))
        return kv_control_pb2.ReserveResponse(
            reservation_id=rid, num_blocks=nblk, kv_endpoint=self.receiver.endpoint,
            decode_worker_id=self.rt.worker_id,
        )  # fmt: skip

    async def _reserve_or_wait(
        self, driver: EngineDriver, rid: str, n: int, params: SamplingParams,
        request: kv_control_pb2.ReserveRequest,
    ) -> list[int] | None:  # fmt: skip
        """Blocks now if they fit and nobody waits for them, else (``wait_s`` > 0) once the
        admission queue admits the request; None if they did not come in time."""
        made: list[list[int] | None] = []

        def reserve(engine: LLMEngine) -> list[int] | None:
            blocks = engine.reserve_for(rid, n, params)
            made.append(blocks)
            if blocks is None:
                self.admission.note_free_blocks(engine.kv.num_free_blocks)
            return blocks

        async def attempt() -> list[int] | None:
            try:
                return await driver.acall(reserve)
            except asyncio.CancelledError:  # the caller is gone: keep no blocks for it
                driver.call(lambda e: made and made[-1] is not None and e.cancel_reservation(rid))
                raise

        if not len(self.admission):
            blocks = await attempt()
            if blocks is not None or request.wait_s == 0:
                return blocks
        elif request.wait_s == 0:
            return None  # others wait for the blocks first
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(request.wait_s):
                return await self.admission.wait(rid, request.priority, attempt)
        return None

    def _on_transfer_end(
        self, loop: asyncio.AbstractEventLoop, rid: str, handle: Any, result: Any
    ) -> None:
        """On a receiver thread: a transfer that failed frees its blocks now, not at expiry."""
        if not result.ok:
            with contextlib.suppress(RuntimeError):  # the loop closed at shutdown
                loop.call_soon_threadsafe(self._transfer_failed, rid, handle, result.error)

    def _transfer_failed(self, rid: str, handle: Any, error: str) -> None:
        res = self.reservations.get(rid)
        if res is not None and res.handle is handle and not res.claimed:  # Decode handles its own
            log.warning("KV transfer for %s failed (%s); its reservation is freed", rid, error)
            self._cancel(rid)

    def _watch_leases(self, loop: asyncio.AbstractEventLoop) -> None:
        """Every second while owned reservations exist: free those whose owner went silent."""
        if self._lease_timer is None and any(r.owner for r in self.reservations.values()):
            self._lease_timer = loop.call_later(1.0, self._check_leases, loop)

    def _check_leases(self, loop: asyncio.AbstractEventLoop) -> None:
        self._lease_timer = None
        leases = self.rt.leases
        for rid, res in list(self.reservations.items()):
            if not res.claimed and leases.lapsed(res.owner):
                log.warning("reservation %s: its owner %s went silent for %.0f s; freed",
                            rid, res.owner, leases.timeout_s)  # fmt: skip
                self._cancel(rid)
        leases.forget_lapsed()
        self._watch_leases(loop)

    def _expire(self, rid: str) -> None:
        res = self.reservations.get(rid)
        if res is not None and not res.claimed:
            log.warning("reservation %s expired unclaimed; its blocks are freed", rid)
            self._cancel(rid)

    def _cancel(self, rid: str) -> bool:
        res = self.reservations.pop(rid, None)
        if res is None:
            return False
        res.expiry.cancel()
        self.receiver.cancel(rid)  # no more writes into the blocks once this returns
        if self.rt.driver is not None:
            self.rt.driver.call(lambda e: e.cancel_reservation(rid))
        return True

    # ---- generation --------------------------------------------------------------------------
    async def Decode(
        self, request: decode_pb2.DecodeRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[common_pb2.TokenChunk]:
        driver = await self.rt.ready_driver(context)
        rid = request.reservation_id
        res = self.reservations.get(rid)
        if res is None or res.claimed:
            await context.abort(grpc.StatusCode.NOT_FOUND,
                                f"no reservation {rid!r} (expired, aborted or already claimed)")  # fmt: skip
        assert res is not None
        res.claimed = True
        res.expiry.cancel()
        try:  # bad input fails now, not after the KV wait (and never inside an engine step)
            params = sampling_from_pb(request.sampling)
            self._check(request, res, params)
        except InvalidRequestError as exc:
            self._cancel(rid)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if request.local_prefill:
            async for chunk in self._prefill_here(request, context, driver, params):
                yield chunk
            return
        wait = request.kv_wait_s or self.rt.args.kv_timeout
        try:
            result = await _wait_for_kv(res.handle, wait)
        except asyncio.CancelledError:
            self._cancel(rid)
            raise
        if result is None or not result.ok:
            self._cancel(rid)
            why = "it did not arrive in time" if result is None else result.error
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"KV for {rid!r} is missing: {why}")
        self.reservations.pop(rid, None)
        try:
            stream = await driver.activate(rid, list(request.prompt_token_ids),
                                           list(request.output_token_ids), params)  # fmt: skip
        except asyncio.CancelledError:  # not activated (else the driver aborts it): free
            driver.call(lambda e: e.cancel_reservation(rid))
            raise
        except (InvalidRequestError, KeyError) as exc:
            driver.call(lambda e: e.cancel_reservation(rid))
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        span = start_server_span(context, "decode", {"tandem.request_id": request.request_id})
        async for chunk in stream_chunks(self.rt, driver, stream, span=span):
            yield chunk

    async def _prefill_here(
        self, request: decode_pb2.DecodeRequest, context: grpc.aio.ServicerContext,
        driver: Any, params: SamplingParams,
    ) -> AsyncIterator[common_pb2.TokenChunk]:  # fmt: skip
        """Conditional disaggregation: no KV is coming; the prompt is prefilled by this engine
        (chunked, mixed into its decode batches, its prefix cache used) and every token streams
        from here. The reservation was the admission: its blocks go back to the pool now and the
        request allocates its own."""
        rid = request.reservation_id
        self._cancel(rid)
        try:
            stream = await driver.submit(rid, list(request.prompt_token_ids), params,
                                         priority=request.priority)  # fmt: skip
        except InvalidRequestError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        attrs = {"tandem.request_id": request.request_id, "tandem.local_prefill": True}
        span = start_server_span(context, "decode", attrs)
        async for chunk in stream_chunks(self.rt, driver, stream, span=span):
            yield chunk

    async def DecodeStream(
        self, request_iterator: AsyncIterator[decode_pb2.DecodeStreamItem],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[common_pb2.ChunkBatch]:  # fmt: skip
        async for batch in multiplex(request_iterator, "decode", self.Decode):
            yield batch

    def _check(
        self, request: decode_pb2.DecodeRequest, res: Reservation, params: SamplingParams
    ) -> None:
        engine = self.rt.engine
        assert engine is not None
        prompt, outputs = list(request.prompt_token_ids), list(request.output_token_ids)
        if len(prompt) != res.num_prompt_tokens:
            raise InvalidRequestError(
                f"the prompt has {len(prompt)} tokens but {res.num_prompt_tokens} were reserved",
                "prompt_token_ids",
            )
        engine.validate(prompt, params)  # plain checks against the vocabulary and context
        if request.local_prefill:
            if outputs:
                raise InvalidRequestError(
                    "output_token_ids must be empty with local_prefill (nothing was prefilled)",
                    "output_token_ids",
                )
            return
        if not outputs or not all(0 <= t < engine.vocab_size for t in outputs):
            raise InvalidRequestError(
                f"output_token_ids must hold the first token, ids in [0, {engine.vocab_size})",
                "output_token_ids",
            )

    async def Abort(
        self, request: common_pb2.AbortRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.AbortResponse:
        if self._cancel(request.request_id):  # a reservation, not yet a request in the engine
            return common_pb2.AbortResponse(found=True)
        return await super().Abort(request, context)

    def cancel_all(self) -> None:
        for rid in list(self.reservations):
            with contextlib.suppress(Exception):
                self._cancel(rid)


def build(runtime: WorkerRuntime) -> list[str]:
    servicer = DecodeServicer(runtime)
    decode_pb2_grpc.add_DecodeServiceServicer_to_server(servicer, runtime.server)
    runtime.on_ready.append(servicer.start_receiver)
    runtime.on_drain.append(servicer.stop_admission)
    runtime.on_stop.extend([servicer.cancel_all, servicer.stop_receiver])
    runtime.extra_load = servicer.transfer_load
    runtime.num_queued = servicer.admission.__len__
    runtime.ready_extra = servicer.ready_extra
    return [decode_pb2.DESCRIPTOR.services_by_name["DecodeService"].full_name]


def main(args: argparse.Namespace) -> int:
    return run_worker(args, build, "decode")
