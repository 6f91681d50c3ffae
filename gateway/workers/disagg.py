"""A request split over a prefill and a decode worker.

1. Reserve KV blocks on a decode worker (admission; the reservation has a TTL). When no decode
   worker has room, the request waits in the admission queue of the least loaded one until
   blocks free up or its deadline passes (``queue=`` in its timing); it is never refused for a
   burst.
2. Prefill on a prefill worker with the reservation as KV target; its first event is the first
   token, streamed on at once (TTFT), its second the end of the KV transfer.
3. Decode on the decode worker streams the rest, over the worker's multiplexed stream
   (``DecodeService.DecodeStream``, see ``gateway.workers.multiplex``). If the first token already finished the
   request, Decode is never called and the reservation is released.
Conditional disaggregation (``gateway.workers.prefill_choice``): when the prompt is short or
every prefill worker is busy, 2 and 3 are one Decode with ``local_prefill`` (the decode worker
prefills the prompt itself, no KV transfer).
Any early exit (error, client gone, deadline) cancels the open calls and sends Abort to every
worker that holds state for the request. A request whose worker died after some of its tokens
reached the client goes on with another decode worker (:func:`resumed`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, Awaitable, Sequence
from typing import Any, TypeVar

import grpc
from opentelemetry.trace import Span

from gateway.core.errors import APIError
from gateway.core.events import Chunk, Timing
from gateway.observability.tracing import child_span, end_span, grpc_metadata
from gateway.workers.client import WorkerClient
from gateway.workers.convert import (
    WorkerReportedError,
    chunk_from_pb,
    images_to_pb,
    sampling_to_pb,
)
from gateway.workers.prefill_choice import local_prefill_reason
from gateway.workers.router import least_queued, rank_decode
from gateway.workers.rpc_errors import UpstreamError, stream_ended, worker_failed
from gateway.workers.work import FlowContext, WorkItem, rpc_failure
from protos import decode_pb2, kv_control_pb2, prefill_pb2
from protos.blocks import blocks_for

T = TypeVar("T")


MAX_RESERVE_TRIES = 3
WAIT_MARGIN_S = 0.2  # a waiting Reserve is answered this long before the request's deadline


def _kv_bound_failure(work: asyncio.Future[Any]) -> bool:
    """The prefill worker ended the call with ABORTED: its KV could not reach the decode side."""
    if work.cancelled():
        return False
    exc = work.exception()
    return isinstance(exc, UpstreamError) and exc.status == "ABORTED"


class _Run:
    def __init__(
        self, ctx: FlowContext, item: WorkItem, parent: Span, prefill: WorkerClient | None
    ) -> None:
        self.ctx, self.item, self.parent = ctx, item, parent
        self._prefill = prefill  # None: a resumed request, prefilled by its decode worker
        self.decode: WorkerClient | None = None
        self.decode_counted = False  # this request is in self.decode's inflight count
        self.reservation: kv_control_pb2.ReserveResponse | None = None
        self.prefill_call: Any = None  # open until TransferDone (or the stream ends)
        self.decode_call: Any = None
        self.prefill_span: Span | None = None
        self.decode_span: Span | None = None
        self.transfer = Timing()
        self.done: kv_control_pb2.TransferDone | None = None
        self.open_spans: list[Span] = []

    @property
    def prefill(self) -> WorkerClient:
        assert self._prefill is not None, "a resumed request has no prefill worker"
        return self._prefill

    def _span(self, name: str, worker: WorkerClient) -> Span:
        span = child_span(self.ctx.tracer, name, self.parent, **{"tandem.worker": worker.address})
        self.open_spans.append(span)
        return span

    def _end(self, span: Span, error: str | None = None) -> None:
        if span in self.open_spans:
            self.open_spans.remove(span)
            end_span(span, error)

    async def reserve(self, decodes: Sequence[WorkerClient]) -> None:
        """KV blocks on the decode worker with the most room now; when none has room, the
        request waits in the admission queue of the least loaded one (up to its deadline)."""
        item, last = self.item, None
        needed = blocks_for(len(item.prompt_ids) + 1, decodes[0].block_size)
        full: list[WorkerClient] = []  # answered "no room now": nothing reserved there
        for decode in rank_decode(decodes, needed)[:MAX_RESERVE_TRIES]:
            try:
                await self._reserve_on(decode, wait=False)
                return
            except UpstreamError as e:
                if not e.retryable:
                    raise
                last = e
                if e.api_error.code == "no_capacity":
                    full.append(decode)
        assert last is not None
        if not full:
            raise last
        decode = least_queued(full)
        started = time.monotonic()
        await self._reserve_on(decode, wait=True)
        self.transfer.queue_s = time.monotonic() - started

    async def _reserve_on(self, decode: WorkerClient, wait: bool) -> None:
        item = self.item
        span = self._span("Reserve", decode)
        left = self.ctx.time_left(item)
        request = kv_control_pb2.ReserveRequest(
            request_id=item.request_id,
            num_prompt_tokens=len(item.prompt_ids),
            max_tokens=item.sampling.max_tokens,
            # unclaimed, it lives as long as the request may (a slow prefill of a long
            # prompt must not find it gone), and at least reserve_ttl_s
            ttl_s=max(self.ctx.config.reserve_ttl_s, left),
            # the worker answers before our deadline, so a full pool reads as such
            wait_s=max(left - WAIT_MARGIN_S, 0.0) if wait else 0.0,
            priority=item.priority,
            owner=self.ctx.registry.owner,  # freed soon after this gateway dies
            # a prefill worker that ships the whole KV copies it into blocks granted now without
            # asking for them (one GPU; a decode worker that cannot grant ignores this)
            grant=bool(self._prefill and self._prefill.load and self._prefill.load.kv_whole),
        )
        timeout = left if wait else min(self.ctx.config.rpc_timeout_s, left)
        # counted on the worker from the choice on: a burst ranks before any reply comes back
        decode.inflight += 1
        try:
            reply = await decode.unless_lost(  # a frozen worker: not up to the deadline
                decode.stub.Reserve(request, timeout=timeout, metadata=grpc_metadata(span))
            )
        except grpc.RpcError as e:
            decode.inflight -= 1
            failure = rpc_failure(decode, e, "Reserve")
            self._end(span, failure.api_error.message)
            if failure.api_error.code != "no_capacity":  # that answer says nothing was reserved
                self.ctx.abort_later(decode, item.request_id)  # in case it did reserve
            if wait and failure.api_error.code == "no_capacity" and self._nearly_due():
                raise UpstreamError(APIError(
                    504, f"the request waited {left:.1f} s (its --request-timeout) for KV blocks "
                    f"on a decode worker: {failure.api_error.message}", code="deadline_exceeded",
                ), retryable=False) from e  # fmt: skip
            raise failure from e
        except asyncio.CancelledError:
            decode.inflight -= 1
            self.ctx.abort_later(decode, item.request_id)
            self._end(span, "cancelled")
            raise
        span.set_attribute("tandem.kv.num_blocks", reply.num_blocks)
        self._end(span)
        self.decode, self.reservation = decode, reply
        self.decode_counted = True  # until the request ends on that worker

    def _nearly_due(self) -> bool:
        return self.item.deadline - time.monotonic() <= 2 * WAIT_MARGIN_S

    async def _read_prefill(self) -> prefill_pb2.PrefillEvent | None:
        try:  # a prefill worker seen gone (a frozen one answers nothing) fails it now
            event = await self.prefill.unless_lost(self.prefill_call.read())
        except grpc.RpcError as e:
            raise rpc_failure(self.prefill, e, "Prefill") from e
        return None if event is grpc.aio.EOF else event

    async def unless_decode_lost(self, step: Awaitable[T]) -> T:
        """``step`` (the prefill, the KV transfer), failed at once when the decode worker that
        holds the reservation is seen gone: the KV has nowhere to go, so the client hears it
        within a health poll, not at the prefill worker's KV timeout."""
        assert self.decode is not None
        decode = self.decode
        work = asyncio.ensure_future(step)
        lost = asyncio.ensure_future(decode.until_lost())
        try:
            await asyncio.wait((work, lost), return_when=asyncio.FIRST_COMPLETED)
            kv_bound = work.done() and _kv_bound_failure(work)
            if kv_bound:
                # the prefill worker may hear of the death first (its KV transfer refused)
                # while the gateway's health poll has yet to see it: give the poll its turn,
                # so the client hears that the decode worker is gone
                await asyncio.wait((lost,), timeout=2 * self.ctx.config.health_interval_s)
        finally:
            lost.cancel()
            if not work.done():
                work.cancel()
        decode_gone = lost.done() and not lost.cancelled()
        if work.done() and not work.cancelled() and not (decode_gone and kv_bound):
            return work.result()  # its value, or its own error
        raise UpstreamError(
            APIError(
                503,
                f"decode worker {decode.name} went away while this request's KV was on its "
                "way to it",
                code="worker_unavailable",
            ),
            retryable=True,  # with another decode worker: retried, or resumed after tokens
            worker_down=True,
            address=decode.address,
            detail=f"decode worker {decode.name} ({decode.address}) went away while a "
            f"request's KV was on its way to it: {decode.last_error}",
        )

    async def first_token(self) -> Chunk:
        assert self.reservation is not None
        item, res = self.item, self.reservation
        span = self.prefill_span = self._span("Prefill", self.prefill)
        target = kv_control_pb2.KvTarget(
            kv_endpoint=res.kv_endpoint,
            reservation_id=res.reservation_id,
            decode_worker_id=res.decode_worker_id,
            kv_grant=res.kv_grant,
        )
        request = prefill_pb2.PrefillRequest(
            request_id=item.request_id,
            prompt_token_ids=item.prompt_ids,
            sampling=sampling_to_pb(item.sampling),
            priority=item.priority,
            target=target,
            images=images_to_pb(item.images),
        )
        self.prefill_call = self.prefill.stub.Prefill(
            request, timeout=self.ctx.time_left(item), metadata=grpc_metadata(span)
        )
        self.prefill.inflight += 1
        while True:  # "first" then "done" by contract; a "done" that overtakes is kept
            event = await self._read_prefill()
            if event is None:
                raise stream_ended(self.prefill.name, self.prefill.address, "Prefill")
            kind = event.WhichOneof("event")
            if kind == "done":
                self.done = event.done
                continue
            if kind != "first":
                raise stream_ended(self.prefill.name, self.prefill.address, "Prefill")
            try:
                first = chunk_from_pb(event.first)
            except WorkerReportedError as e:
                raise worker_failed(self.prefill.name, self.prefill.address, str(e)) from e
            # queued for decode KV, then in the prefill worker's queue
            first.timing.queue_s += self.transfer.queue_s
            first.timing.mode = self.transfer.mode
            self.transfer.queue_s = first.timing.queue_s
            return first

    async def transfer_done(self) -> None:
        span = self._span("KV transfer", self.prefill)
        if self.done is None:
            event = await self._read_prefill()
            if event is None or event.WhichOneof("event") != "done":
                raise stream_ended(self.prefill.name, self.prefill.address, "Prefill (KV transfer)")
            self.done = event.done
        span.set_attribute("tandem.kv.bytes", self.done.bytes)
        span.set_attribute("tandem.kv.num_blocks", self.done.num_blocks)
        self.transfer.transfer_s = self.done.seconds
        self._end(span)
        self._close_prefill()

    def _close_prefill(self) -> None:
        if self.prefill_call is not None:
            self.prefill_call = None
            self.prefill.inflight -= 1
        if self.prefill_span is not None:
            self._end(self.prefill_span)
            self.prefill_span = None

    def start_local(self, reason: str, outputs: Sequence[int] = ()) -> None:
        """Conditional disaggregation: the decode worker prefills the prompt itself (and
        ``outputs``, the tokens already sent of a request resumed there)."""
        assert self.decode is not None and self.reservation is not None
        item, decode = self.item, self.decode
        self.transfer.mode, self.transfer.local_reason = "local", reason
        self.decode_span = self._span("Decode (local prefill)", decode)
        request = decode_pb2.DecodeRequest(
            request_id=item.request_id,
            reservation_id=self.reservation.reservation_id,
            prompt_token_ids=item.prompt_ids,
            output_token_ids=outputs,
            sampling=sampling_to_pb(item.sampling),
            priority=item.priority,
            local_prefill=True,
            images=images_to_pb(item.images),  # prefilled there: the bytes too
        )
        self.decode_call = decode.stream().start(
            request, grpc_metadata(self.decode_span), self.ctx.time_left(item)
        )

    def start_decode(self, first: Chunk) -> None:
        assert self.decode is not None and self.reservation is not None
        item, decode = self.item, self.decode
        self.decode_span = self._span("Decode", decode)
        request = decode_pb2.DecodeRequest(
            request_id=item.request_id,
            reservation_id=self.reservation.reservation_id,
            prompt_token_ids=item.prompt_ids,
            output_token_ids=first.token_ids,
            sampling=sampling_to_pb(item.sampling),
            priority=item.priority,
            kv_wait_s=self.ctx.config.kv_wait_s,
            # the bytes too, though the KV crossed: preempted under KV pressure, the decode
            # worker recomputes the images' tokens instead of failing the request (it
            # preprocesses an image only then)
            images=images_to_pb(item.images),
        )
        self.decode_call = decode.stream().start(
            request, grpc_metadata(self.decode_span), self.ctx.time_left(item)
        )

    async def next_decode_chunk(self) -> Chunk:
        assert self.decode is not None
        try:
            msg = await self.decode_call.read()
        except grpc.RpcError as e:
            raise rpc_failure(self.decode, e, "Decode") from e
        if msg is grpc.aio.EOF:
            raise stream_ended(self.decode.name, self.decode.address, "Decode")
        try:
            chunk = chunk_from_pb(msg)
        except WorkerReportedError as e:
            raise worker_failed(self.decode.name, self.decode.address, str(e)) from e
        chunk.timing.merge(self.transfer)
        if chunk.finish_reason is not None:
            self._close_decode()
        return chunk

    def _close_decode(self, error: str | None = None) -> None:
        self.decode_call = None
        self._uncount_decode()
        if self.decode_span is not None:
            self._end(self.decode_span, error)
            self.decode_span = None

    def _uncount_decode(self) -> None:
        if self.decode_counted and self.decode is not None:
            self.decode_counted = False
            self.decode.inflight -= 1

    def finish_early(self) -> None:
        """The first token finished the request: let prefill end, then free the reservation."""
        call, decode = self.prefill_call, self.decode
        self._close_prefill()
        self._uncount_decode()
        self.ctx.registry.spawn(self._release_after(call, decode))

    async def _release_after(self, call: Any, decode: WorkerClient | None) -> None:
        if call is not None:
            with contextlib.suppress(grpc.RpcError, asyncio.TimeoutError):
                async with asyncio.timeout(self.ctx.config.kv_wait_s):
                    while await call.read() is not grpc.aio.EOF:
                        pass
        if decode is not None:
            await decode.abort(self.item.request_id, self.ctx.config.rpc_timeout_s)

    def abort_all(self, error: str) -> None:
        """Synchronous on purpose: it runs while the request's task is being cancelled."""
        rid = self.item.request_id
        for span in list(self.open_spans):
            self._end(span, error)
        if self.prefill_call is not None:
            self.prefill_call.cancel()
            self.ctx.abort_later(self.prefill, rid)
            self._close_prefill()
        if self.decode_call is not None:
            self.decode_call.cancel()
            self._close_decode(error)
        if self.decode is not None:
            self.ctx.abort_later(self.decode, rid)
        self._uncount_decode()


async def _aborted_unless_finished(
    run: _Run, chunks: AsyncGenerator[Chunk, None]
) -> AsyncGenerator[Chunk, None]:
    """``chunks``, and on any exit before the last of them (an error, the client gone, a
    deadline) every call of ``run`` cancelled and everything it holds aborted."""
    finished, error = False, "cancelled"
    try:
        async with contextlib.aclosing(chunks):
            async for chunk in chunks:
                finished = chunk.finish_reason is not None
                yield chunk
    except UpstreamError as e:
        error = e.api_error.message
        raise
    finally:
        if not finished:
            run.abort_all(error)


async def _decode_rest(run: _Run) -> AsyncGenerator[Chunk, None]:
    """The decode worker's chunks up to the last."""
    finished = False
    while not finished:
        chunk = await run.next_decode_chunk()
        finished = chunk.finish_reason is not None
        yield chunk


def disaggregated(
    ctx: FlowContext,
    prefills: Sequence[WorkerClient],
    decodes: Sequence[WorkerClient],
    item: WorkItem,
    parent: Span,
) -> AsyncGenerator[Chunk, None]:
    """``prefills``: the candidate prefill workers, best first; the request goes to the first
    unless it is prefilled locally (``gateway.workers.prefill_choice``), which reads them all."""
    run = _Run(ctx, item, parent, prefills[0])
    return _aborted_unless_finished(run, _disaggregated(run, prefills, decodes))


async def _disaggregated(
    run: _Run, prefills: Sequence[WorkerClient], decodes: Sequence[WorkerClient]
) -> AsyncGenerator[Chunk, None]:
    ctx, item, parent = run.ctx, run.item, run.parent
    await run.reserve(decodes)
    healthy = [p for p in prefills if p.healthy]  # read now: the Reserve may have waited
    config = ctx.config
    reason = local_prefill_reason(
        len(item.prompt_ids), healthy, config.max_local_prefill_tokens,
        config.local_prefill_queue, run.decode, config.local_prefill_decode_load,
    )  # fmt: skip
    if reason is not None:
        parent.set_attribute("tandem.mode", "local")
        parent.set_attribute("tandem.local_reason", reason)
        run.start_local(reason)  # every token, the first included, comes from the decode worker
    else:
        run.transfer.mode = "disagg"
        first = await run.unless_decode_lost(run.first_token())
        if first.finish_reason is not None:
            run.finish_early()
            yield first
            return
        yield first
        await run.unless_decode_lost(run.transfer_done())
        run.start_decode(first)
    async for chunk in _decode_rest(run):
        yield chunk


def resumed(
    ctx: FlowContext,
    decodes: Sequence[WorkerClient],
    item: WorkItem,
    outputs: Sequence[int],
    parent: Span,
    reason: str = "resumed",
) -> AsyncGenerator[Chunk, None]:
    """A request whose worker died after some of its tokens reached the client, moved to a
    decode worker: its prompt and ``outputs`` (the tokens already sent) are prefilled there, as a
    local prefill, and its stream goes on from the next token (``mode=local``,
    ``local_reason=resumed`` in its timing). With no ``outputs``, a request no prefill worker
    can take (``reason`` no_prefill): the decode worker prefills its prompt."""
    run = _Run(ctx, item, parent, None)
    return _aborted_unless_finished(run, _resumed(run, decodes, outputs, reason))


async def _resumed(
    run: _Run, decodes: Sequence[WorkerClient], outputs: Sequence[int], reason: str
) -> AsyncGenerator[Chunk, None]:
    await run.reserve(decodes)
    run.parent.set_attribute("tandem.resumed_after_tokens", len(outputs))
    run.start_local(reason, outputs)
    async for chunk in _decode_rest(run):
        yield chunk
