"""``tandem decode``: admission (Reserve), KV received into the reserved blocks, then
continuous-batching generation streamed back."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc

from protos import common_pb2, decode_pb2, decode_pb2_grpc, kv_control_pb2
from protos.blocks import blocks_for
from protos.ports import check_port_free
from protos.roles import Role
from protos.sampling_params import InvalidRequestError, SamplingParams
from services.common.convert import (
    images_from_pb,
    sampling_from_pb,
    seconds_from_pb,
    transfer_fields,
)
from services.common.multiplex import multiplex
from services.common.runtime import WorkerRpcs, WorkerRuntime, run_worker
from services.common.streaming import abort_invalid, stream_chunks
from services.common.tracing import start_server_span
from services.decode.admission import AdmissionQueue

if TYPE_CHECKING:
    from services.engine.driver import EngineDriver

log = logging.getLogger(__name__)
MAX_TTL_S = 3600.0  # the gateway asks for its request's remaining time (--request-timeout)
# a reservation nobody renews a lease for (a caller that names no owner) lives at most this long
UNOWNED_MAX_TTL_S = 60.0
DEFAULT_TTL_S = 10.0  # a ReserveRequest's ttl_s 0 (unset)
# what 0 means, for a refusal of a ttl_s or wait_s that is not a finite number >= 0
TTL_UNSET = (f"{DEFAULT_TTL_S:g} s; more than {MAX_TTL_S:g} s ({UNOWNED_MAX_TTL_S:g} s with no "
             "owner) is cut to that")  # fmt: skip
WAIT_UNSET = "no wait, RESOURCE_EXHAUSTED at once when the blocks are not free now"


def reservation_ttl(ttl_s: float, owner: str) -> float:
    """Seconds an unclaimed reservation lives: as asked (DEFAULT_TTL_S if not said), capped; an
    owned one is also freed soon after its owner stops polling (services.common.leases)."""
    return min(ttl_s if ttl_s > 0 else DEFAULT_TTL_S, MAX_TTL_S if owner else UNOWNED_MAX_TTL_S)


class Draining(Exception):
    """The worker stops admitting: a waiting Reserve ends UNAVAILABLE."""


@dataclass
class Reservation:
    """KV blocks held for one request until its KV has landed and a Decode call claims it.

    Its one deadline lives here, as the ``timer`` on the event loop (``timer.when()``): the
    receiver expects the KV with no clock of its own, and a Decode call that claims the
    reservation only brings the deadline forward to its own patience for the KV.
    When the timer fires, the reservation is freed wherever it stands: the receiver stops
    expecting the KV (a sender still sending is refused, and its prefill worker frees its
    blocks), the engine frees the blocks, and a Decode call waiting for the KV fails."""

    request_id: str
    num_prompt_tokens: int
    handle: Any  # kvtransfer.TransferHandle
    timer: asyncio.TimerHandle
    owner: str = ""  # the gateway whose lease keeps it (services.common.leases)
    claimed: bool = False


async def _wait_for_kv(handle: Any) -> Any:
    """The transfer's result; no thread is held while waiting. The reservation's timer ends the
    wait: at its deadline the transfer is cancelled, which resolves it with an error."""
    loop = asyncio.get_running_loop()
    arrived: asyncio.Future[Any] = loop.create_future()

    def settle(result: Any) -> None:
        if not arrived.done():
            arrived.set_result(result)

    def on_done(result: Any) -> None:  # on a receiver thread (or here, if already done)
        with contextlib.suppress(RuntimeError):  # the loop closed at shutdown
            loop.call_soon_threadsafe(settle, result)

    handle.add_done_callback(on_done)
    return await arrived


class DecodeServicer(WorkerRpcs, decode_pb2_grpc.DecodeServiceServicer):
    def __init__(self, runtime: WorkerRuntime) -> None:
        self.rt = runtime
        self.receiver: Any = None  # kvtransfer.KvReceiver once the model is loaded
        self.reservations: dict[str, Reservation] = {}
        # Reserve calls under way (their blocks not yet recorded): an Abort for one of them
        # cancels it, whichever of the Abort and its caller's own cancellation arrives first
        self._reserving: dict[str, asyncio.Task[Any]] = {}
        self._aborted: set[asyncio.Task[Any]] = set()
        self._lease_timer: asyncio.TimerHandle | None = None
        self.admission = AdmissionQueue(
            self._release_admitted, by_priority=runtime.config.engine.scheduler.policy == "priority"
        )

    # ---- KV receiver lifecycle ---------------------------------------------------------------
    def start_receiver(self) -> None:
        from kvtransfer import KvReceiver, ReceiverOptions

        assert self.rt.engine is not None
        c = self.rt.config
        opts = ReceiverOptions(host=c.kv_host or c.host, port=c.kv_port, io_timeout_s=c.kv_timeout_s,
                               advertise_host=c.kv_host,
                               auth_token=self.rt.internal_token)  # fmt: skip
        runner = self.rt.engine.runner  # with TP, whole blocks scattered over the ranks' heads
        self.receiver = KvReceiver(runner.kv_caches, opts, shards=runner.kv_shards())
        assert self.rt.driver is not None
        self.rt.driver.after_work.append(
            lambda e: self.admission.on_blocks_freed(e.kv.num_free_blocks)
        )

    def stop_admission(self) -> None:
        """Draining: Reserve calls still waiting for blocks fail (UNAVAILABLE, retryable)."""
        self.admission.fail_all(Draining(f"{self.rt.worker_id} is draining"))

    def _release_admitted(self, rid: str) -> None:
        if self.rt.driver is not None:
            self.rt.driver.cancel_reservation(rid)

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
        if not rid or n < 1:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                "request_id and num_prompt_tokens >= 1 are required")  # fmt: skip
        try:  # before anything is taken (an infinite wait_s waited for blocks as long as the
            # call lasted; a NaN one timed out at once, a NaN or negative ttl_s read as unset)
            ttl_s = seconds_from_pb(request.ttl_s, "ttl_s", TTL_UNSET)
            wait_s = seconds_from_pb(request.wait_s, "wait_s", WAIT_UNSET)
        except InvalidRequestError as exc:
            await abort_invalid(context, exc)
        assert self.rt.engine is not None  # ready_driver returned: the engine is loaded
        limit = self.rt.engine.max_model_len
        if n >= limit:  # before any list of n ids is made: 2**31 of them took 17 GB and hung
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"num_prompt_tokens {n} is "
                                f"at or over this worker's max_model_len {limit}")  # fmt: skip
        if rid in self.reservations or rid in self._reserving:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"{rid!r} is already reserved")
        params = SamplingParams(max_tokens=max(request.max_tokens, 1))
        started = time.monotonic()
        task = asyncio.current_task()
        assert task is not None
        self._reserving[rid] = task
        try:
            blocks = await self._reserve_or_wait(driver, rid, n, params, wait_s, request.priority)
        except asyncio.CancelledError:
            if task not in self._aborted or task.uncancel():
                raise  # its caller went away (or the server stops)
            await context.abort(grpc.StatusCode.CANCELLED,
                                f"{rid!r} was aborted while it waited for KV blocks")  # fmt: skip
        except InvalidRequestError as exc:
            await abort_invalid(context, exc)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, str(exc))
        except Draining as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        finally:
            del self._reserving[rid]
            self._aborted.discard(task)
        if blocks is None:
            waited = time.monotonic() - started
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"no free KV blocks for a {n}-token prompt on {self.rt.worker_id} "
                                f"(waited {waited:.1f} s, {len(self.admission)} waiting)")  # fmt: skip
        assert self.rt.engine is not None and blocks is not None
        ttl = reservation_ttl(ttl_s, request.owner)
        nblk = blocks_for(n, self.rt.engine.config.cache.block_size)
        # no clock there: ours is the one. A grant (asked for by a gateway whose prefill worker
        # ships whole KV) lets a sender on this GPU copy without asking for the blocks
        handle = self.receiver.expect(rid, blocks[:nblk], grant=request.grant)
        loop = asyncio.get_running_loop()
        timer = loop.call_later(ttl, self._expire, rid)
        self.rt.leases.renew(request.owner)
        self.reservations[rid] = Reservation(rid, n, handle, timer, request.owner)
        self._watch_leases(loop)
        handle.add_done_callback(lambda result: self._on_transfer_end(loop, rid, handle, result))
        grant = json.dumps(handle.grant.to_json()) if handle.grant is not None else ""
        return kv_control_pb2.ReserveResponse(
            reservation_id=rid, num_blocks=nblk, kv_endpoint=self.receiver.endpoint,
            decode_worker_id=self.rt.worker_id, kv_grant=grant,
        )  # fmt: skip

    async def _reserve_or_wait(
        self, driver: EngineDriver, rid: str, n: int, params: SamplingParams, wait_s: float,
        priority: int,
    ) -> list[int] | None:  # fmt: skip
        """Blocks now if they fit and nobody waits for them, else (``wait_s`` > 0) once the
        admission queue admits the request; None if they did not come in time."""

        async def attempt() -> list[int] | None:
            got = await driver.reserve(rid, n, params)  # a caller gone meanwhile keeps nothing
            if got.blocks is None:
                self.admission.note_free_blocks(got.free_blocks)
            return got.blocks

        if not len(self.admission):
            blocks = await attempt()
            if blocks is not None or wait_s == 0:
                return blocks
        elif wait_s == 0:
            return None  # others wait for the blocks first
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(wait_s):
                return await self.admission.wait(rid, priority, attempt)
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
        if res is not None:
            state = "claimed, its KV still missing" if res.claimed else "unclaimed"
            log.warning("reservation %s expired (%s); its blocks are freed", rid, state)
            self._cancel(rid, f"reservation {rid!r} expired before its KV arrived")

    def _bring_deadline_forward(self, res: Reservation, within_s: float) -> None:
        loop = asyncio.get_running_loop()
        if loop.time() + within_s < res.timer.when():
            res.timer.cancel()
            res.timer = loop.call_later(within_s, self._expire, res.request_id)

    def _cancel(
        self, rid: str, reason: str = "reservation cancelled",
        freed: asyncio.Future[None] | None = None,
    ) -> bool:  # fmt: skip
        """Drop reservation ``rid`` (False: there is none). ``freed`` is resolved once its
        blocks have been handed back to the engine (its cancel queued on the engine thread)."""
        res = self.reservations.pop(rid, None)
        if res is None:
            return False
        res.timer.cancel()
        # the blocks are freed once nothing writes them: at once, or (a sender on this GPU
        # still copying into them, or a grant to take back) from the receiver's thread, never
        # blocking this loop
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # not on the event loop (shutdown): wait here instead
            self.receiver.cancel(rid, reason)
            self._free_reservation(rid, freed)
            return True
        thread = threading.get_ident()

        def free() -> None:
            if threading.get_ident() == thread:
                self._free_reservation(rid, freed)
            else:
                with contextlib.suppress(RuntimeError):  # the loop closed at shutdown
                    loop.call_soon_threadsafe(self._free_reservation, rid, freed)

        self.receiver.cancel(rid, reason, on_free=free)
        return True

    def _free_reservation(self, rid: str, freed: asyncio.Future[None] | None = None) -> None:
        if self.rt.driver is not None:
            self.rt.driver.cancel_reservation(rid)
        if freed is not None and not freed.done():
            freed.set_result(None)

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
        kv_timeout_s = self.rt.config.kv_timeout_s
        try:  # bad input fails now, not after the KV wait (and never inside an engine step)
            kv_wait_s = seconds_from_pb(
                request.kv_wait_s, "kv_wait_s", f"this worker's --kv-timeout, {kv_timeout_s:g} s"
            )
            params = sampling_from_pb(request.sampling)
            self._check(request, res, params)
        except InvalidRequestError as exc:
            self._cancel(rid)
            await abort_invalid(context, exc)
        if request.local_prefill:
            async for chunk in self._prefill_here(request, context, driver, params):
                yield chunk
            return
        # the caller waits for the KV this long at most: the reservation's deadline comes forward
        self._bring_deadline_forward(res, kv_wait_s or kv_timeout_s)
        try:
            result = await _wait_for_kv(res.handle)
        except asyncio.CancelledError:
            self._cancel(rid)
            raise
        if not result.ok or self.reservations.get(rid) is not res:  # failed, or expired just now
            self._cancel(rid)
            why = result.error if not result.ok else f"reservation {rid!r} expired"
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"KV for {rid!r} is missing: {why}")
        del self.reservations[rid]
        res.timer.cancel()  # the KV landed: the reservation becomes a request in the engine
        try:
            stream = await driver.activate(rid, list(request.prompt_token_ids),
                                           list(request.output_token_ids), params,
                                           images_from_pb(request.images))  # fmt: skip
        except asyncio.CancelledError:  # not activated (else the driver aborts it): free
            driver.cancel_reservation(rid)
            raise
        except (InvalidRequestError, KeyError) as exc:
            driver.cancel_reservation(rid)
            bad = exc if isinstance(exc, InvalidRequestError) else InvalidRequestError(str(exc))
            await abort_invalid(context, bad)
        span = start_server_span(context, "decode", {"tandem.request_id": request.request_id})
        async for chunk in stream_chunks(self.rt, driver, stream, span=span, context=context,
                                         prefills=False):  # fmt: skip
            yield chunk

    async def _prefill_here(
        self, request: decode_pb2.DecodeRequest, context: grpc.aio.ServicerContext,
        driver: Any, params: SamplingParams,
    ) -> AsyncIterator[common_pb2.TokenChunk]:  # fmt: skip
        """Conditional disaggregation: no KV is coming; the prompt is prefilled by this engine
        (chunked, mixed into its decode batches, its prefix cache used) and every token streams
        from here. The reservation was the admission: its blocks go back to the pool now and the
        request allocates its own. With ``output_token_ids`` the request moved here from a decode
        worker that died mid-stream: those are prefilled too and the stream goes on after them."""
        rid = request.reservation_id
        # the request takes the reservation's id: submit it only once the engine has dropped
        # the reservation. A granted one is freed from the receiver's thread (the grant taken
        # back first), so a submit at once found the id still in use (INTERNAL, on one GPU with
        # whole KV transfers, whose reservations are granted)
        freed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if self._cancel(rid, freed=freed):
            try:
                await asyncio.wait_for(freed, self.rt.config.kv_timeout_s)
            except TimeoutError:
                await context.abort(
                    grpc.StatusCode.UNAVAILABLE,
                    f"reservation {rid!r}: its blocks were not freed within "
                    f"{self.rt.config.kv_timeout_s} s (a KV copy into them still running)",
                )
        try:
            stream = await driver.submit(rid, list(request.prompt_token_ids), params,
                                         priority=request.priority,
                                         images=images_from_pb(request.images),
                                         outputs=list(request.output_token_ids))  # fmt: skip
        except InvalidRequestError as exc:
            await abort_invalid(context, exc)
        attrs = {"tandem.request_id": request.request_id, "tandem.local_prefill": True}
        span = start_server_span(context, "decode", attrs)
        async for chunk in stream_chunks(self.rt, driver, stream, span=span, context=context):
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
        if request.local_prefill:  # outputs: a request moved here mid-stream (checked on add)
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
        reserving = self._reserving.get(request.request_id)
        if reserving is not None:  # still waiting for (or taking) its blocks: it keeps none
            self._aborted.add(reserving)
            reserving.cancel()
            return common_pb2.AbortResponse(found=True)
        return await super().Abort(request, context)

    def cancel_all(self) -> None:
        for rid in list(self.reservations):
            with contextlib.suppress(Exception):
                self._cancel(rid)


def build(runtime: WorkerRuntime) -> list[str]:
    c = runtime.config  # the KV receiver listens once the model is loaded: a busy port is said now
    check_port_free(
        c.kv_host or c.host, c.kv_port, "--kv-port", "--kv-host" if c.kv_host else "--host"
    )
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
    return run_worker(args, build, Role.DECODE)
