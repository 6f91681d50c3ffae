"""Many requests over one gRPC stream (``GenerateStream``, ``DecodeStream``).

grpc.aio spends tens of microseconds of Python per streamed message; with one server stream per
request, a batch of 256 decodes costs 256 messages a step, and in a worker that shares its GIL
with the engine thread that time comes straight out of the GPU's. On a multiplexed stream every
request runs the very handler its own call would run (``Generate`` / ``Decode``), and what all of
them produced since the last send leaves as one ``ChunkBatch``: one message per engine step.

A handler may also hand its engine outputs straight to the stream (``RequestContext.put_output``,
what ``services.common.streaming.stream_chunks`` does here): each is written into the batch being
built, or appended to the request's chunk in it, as it arrives, so a token costs neither a task
wake-up nor a queue hand-off nor a chunk copied into the batch.

A request that its own call would end with a status (``context.abort``) ends here with an error
chunk carrying that status code; an ``abort`` item, the request's timeout or the end of the
stream stops the handler, whose cleanup aborts the request in the engine as a cancelled call's
would.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections import deque
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

import grpc

from protos import common_pb2
from protos.errors import PARAM_METADATA_KEY
from protos.sampling_params import InvalidRequestError
from services.common.convert import add_output, merge_output, seconds_from_pb
from services.engine.outputs import RequestOutput

log = logging.getLogger(__name__)
MAX_BATCH = 1024  # chunks per ChunkBatch

Handler = Callable[[Any, Any], AsyncIterator[common_pb2.TokenChunk]]


class RequestAborted(Exception):
    def __init__(self, code: grpc.StatusCode, details: str, param: str = "") -> None:
        super().__init__(details)
        self.code, self.details, self.param = code, details, param


class RequestContext:
    """The part of ``grpc.aio.ServicerContext`` the handlers use, for one request of a stream,
    and the way to hand it outputs without yielding a chunk each."""

    def __init__(self, metadata: Mapping[str, str], outbox: _Outbox, request_id: str) -> None:
        self._metadata = tuple(metadata.items())
        self._outbox, self.request_id = outbox, request_id
        self.finished = False  # a finishing output went out through put_output

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata

    async def abort(
        self, code: grpc.StatusCode, details: str = "",
        trailing_metadata: tuple[tuple[str, str], ...] = (),
    ) -> None:  # fmt: skip
        """End the request with ``code`` (an error chunk); of the trailing metadata only the
        field an INVALID_ARGUMENT names travels (the chunk's ``error_param``)."""
        raise RequestAborted(code, details, dict(trailing_metadata).get(PARAM_METADATA_KEY, ""))

    def put_output(self, out: RequestOutput, timing: common_pb2.Timing | None = None) -> None:
        """Send ``out`` (on the loop; it does not raise). An error the request is at fault
        for (``error_param``; it carries no tokens) ends it as a refused call of its own ends:
        INVALID_ARGUMENT, naming the field."""
        if out.error_param is None:
            self._outbox.put_output(self.request_id, out, timing)
        else:
            code = grpc.StatusCode.INVALID_ARGUMENT
            self._outbox.put(_error(self.request_id, code, out.error or "", out.error_param))
        self.finished = self.finished or out.finished


def _error(
    request_id: str, code: grpc.StatusCode | None, message: str, param: str = ""
) -> common_pb2.TokenChunk:
    """An error chunk; ``code`` None means a failure after the start (status 0); ``param``: the
    request field an INVALID_ARGUMENT is about."""
    return common_pb2.TokenChunk(
        request_id=request_id, finish_reason=common_pb2.FINISH_REASON_ERROR, error=message,
        status_code=code.value[0] if code is not None else 0, error_param=param,
    )  # fmt: skip


class _Outbox:
    """Batches waiting to be sent (the last one still filling), and the requests still running."""

    def __init__(self) -> None:
        self.batches: deque[common_pb2.ChunkBatch] = deque()
        self.open: dict[str, common_pb2.TokenChunk] = {}  # each request's chunk in the last batch
        self.wake = asyncio.Event()
        self.running: dict[str, asyncio.Task[None]] = {}

    def _filling(self) -> Any:
        """The last batch's chunks; a new batch once it holds MAX_BATCH (a backlog leaves in
        several messages, each well under the gateway's message size limit)."""
        if not self.batches or len(self.batches[-1].chunks) >= MAX_BATCH:
            self.batches.append(common_pb2.ChunkBatch())
            self.open = {}
        return self.batches[-1].chunks

    def put(self, chunk: common_pb2.TokenChunk) -> None:
        self._filling().append(chunk)
        self.open.pop(chunk.request_id, None)  # a later output must not go in before it
        self.wake.set()

    def put_output(
        self, rid: str, out: RequestOutput, timing: common_pb2.Timing | None = None
    ) -> None:
        chunk = self.open.get(rid)
        if chunk is None:
            self.open[rid] = add_output(self._filling(), rid, out, timing)
        else:  # not sent since its last output: one chunk, as a stream that fell behind sends
            merge_output(chunk, out, timing)
        self.wake.set()

    def finished(self, rid: str, task: asyncio.Task[None]) -> None:
        if self.running.get(rid) is task:
            del self.running[rid]
        self.wake.set()

    def take(self) -> common_pb2.ChunkBatch:
        """The next batch to send; nothing writes into it afterwards."""
        batch = self.batches.popleft()
        if self.batches:
            self.wake.set()
        else:
            self.open = {}
        return batch


async def _run_one(
    outbox: _Outbox, context: RequestContext, chunks: AsyncIterator[common_pb2.TokenChunk],
    timeout_s: float,
) -> None:  # fmt: skip
    rid = context.request_id
    finished = False
    try:
        async with asyncio.timeout(timeout_s if timeout_s > 0 else None):
            async for chunk in chunks:
                chunk.request_id = rid  # the key the caller routes by, whatever the handler set
                finished = chunk.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED
                outbox.put(chunk)
        if not (finished or context.finished):  # what an own call's early end tells its caller
            outbox.put(_error(rid, None, f"request {rid} ended before it finished"))
    except RequestAborted as exc:
        outbox.put(_error(rid, exc.code, exc.details, exc.param))
    except TimeoutError:
        if context.finished:  # its last chunk is out already
            return
        outbox.put(_error(rid, grpc.StatusCode.DEADLINE_EXCEEDED, f"request {rid} timed out"))
    except asyncio.CancelledError:
        pass  # aborted by the caller or the stream ended: nobody waits for a chunk
    except Exception as exc:  # a bug in a handler must not end the other requests
        log.exception("request %s failed on a multiplexed stream", rid)
        outbox.put(_error(rid, grpc.StatusCode.INTERNAL, f"internal error: {exc!r}"))
    finally:
        with contextlib.suppress(Exception):
            await chunks.aclose()  # type: ignore[attr-defined]


async def _read_items(
    items: AsyncIterator[Any], outbox: _Outbox, kind: str, handler: Handler
) -> None:
    async for item in items:
        which = item.WhichOneof("item")
        if which == "abort":
            task = outbox.running.get(item.abort.request_id)
            if task is not None:
                task.cancel()
            continue
        if which != kind:
            continue
        request = getattr(item, kind)
        rid = request.request_id
        if not rid or rid in outbox.running:
            why = "request_id must not be empty" if not rid else f"request {rid} is running"
            outbox.put(_error(rid, grpc.StatusCode.INVALID_ARGUMENT, why))
            continue
        try:  # before the handler runs, so it takes nothing (a negative or NaN deadline was
            # no deadline, as 0 is)
            timeout_s = seconds_from_pb(item.timeout_s, "timeout_s", "no deadline")
        except InvalidRequestError as exc:
            outbox.put(_error(rid, grpc.StatusCode.INVALID_ARGUMENT, str(exc), exc.param or ""))
            continue
        context = RequestContext(item.metadata, outbox, rid)
        chunks = handler(request, context)
        task = asyncio.ensure_future(_run_one(outbox, context, chunks, timeout_s))
        outbox.running[rid] = task
        task.add_done_callback(functools.partial(outbox.finished, rid))  # also if never run


async def multiplex(
    items: AsyncIterator[Any], kind: str, handler: Handler
) -> AsyncIterator[common_pb2.ChunkBatch]:
    """Serve a stream of ``{kind, abort}`` items with ``handler(request, context)``; yields a
    ChunkBatch whenever chunks are waiting. Ends (aborting what still runs) when the caller
    closes its side and every request is done, or when the call is cancelled."""
    outbox = _Outbox()
    reader = asyncio.ensure_future(_read_items(items, outbox, kind, handler))
    reader.add_done_callback(lambda _: outbox.wake.set())
    try:
        while True:
            await outbox.wake.wait()
            outbox.wake.clear()
            if outbox.batches:
                yield outbox.take()
            if reader.done() and not outbox.running and not outbox.batches:
                reader.result()  # a broken request stream ends the call with its error
                return
    finally:
        reader.cancel()
        tasks = list(outbox.running.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(reader, *tasks, return_exceptions=True)
