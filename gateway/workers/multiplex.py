"""The gateway's side of a multiplexed stream: many requests over one call per worker.

A worker streams the tokens of one engine step for every request of the stream as one
``ChunkBatch`` (``WorkerService.GenerateStream``, ``DecodeService.DecodeStream``), instead of one
gRPC message per token per request; that per-message cost, paid on the worker's GIL, was the
gateway path's overhead. ``StreamMux.start`` hands out a :class:`MuxCall` that reads like the
per-request call it replaces (``read()``, ``async for``, ``cancel()``, ``grpc.RpcError`` with the
same status codes), so the request flows keep their error handling:

- a request the worker refuses (bad input, no reservation, not loaded) ends with an error chunk
  carrying the status its own call would have had; ``read`` raises it as a
  :class:`RequestRpcError` (an ``AioRpcError``): the worker answered, on a stream that lives on,
  so it says nothing of the worker's health whatever its code;
- the stream itself failing (the worker died) fails every request on it with that error, and
  the next request opens a new stream;
- ``cancel`` (client gone, error elsewhere) sends an ``abort`` item; the request's deadline is
  kept here (``DEADLINE_EXCEEDED``) and sent along so the worker stops too.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import grpc

from gateway.workers.rpc_errors import LostWorkerError, summary
from protos import common_pb2
from protos.errors import PARAM_METADATA_KEY

log = logging.getLogger(__name__)
_CODES = {code.value[0]: code for code in grpc.StatusCode}


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


class RequestRpcError(grpc.aio.AioRpcError):
    """One request's failure that its worker reported on the live stream (an error chunk):
    that request's, not the worker's (an INTERNAL from a bug in one request must not take the
    worker out of rotation for every other request)."""

    def __init__(self, code: grpc.StatusCode, details: str, param: str = "") -> None:
        # the field an INVALID_ARGUMENT names, where a call of its own would carry it
        trailing = grpc.aio.Metadata((PARAM_METADATA_KEY, param)) if param else grpc.aio.Metadata()
        super().__init__(code, grpc.aio.Metadata(), trailing, details)


_EXPIRED = object()  # what a call's deadline puts into its inbox


class MuxCall:
    """One request of a multiplexed stream, read like a server-streaming call.

    Its chunks wait in a deque with at most one reader's future (an ``asyncio.Queue`` costs twice
    that per token) and its deadline is one timer for the whole call, not one per ``read``.
    """

    def __init__(self, mux: StreamMux, request_id: str, timeout: float) -> None:
        self._mux, self.request_id = mux, request_id
        self._inbox: deque[Any] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._done = False
        self._timer = asyncio.get_running_loop().call_later(timeout, self.deliver, _EXPIRED)

    def deliver(self, item: Any) -> None:
        """A chunk, a stream's error or ``_EXPIRED``, in the order read() gets them."""
        self._inbox.append(item)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def read(self) -> Any:
        """The next chunk, ``grpc.aio.EOF`` after the last one; raises ``grpc.RpcError``."""
        if self._done:
            return grpc.aio.EOF
        while not self._inbox:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        item = self._inbox.popleft()
        if item is _EXPIRED:
            self.cancel()
            raise rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
        if isinstance(item, BaseException):
            self._finish()
            raise item
        if item.finish_reason == common_pb2.FINISH_REASON_ERROR and item.status_code:
            self._finish()
            code = _CODES.get(item.status_code, grpc.StatusCode.UNKNOWN)
            raise RequestRpcError(code, item.error, item.error_param)
        if item.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
            self._finish()
        return item

    def __aiter__(self) -> MuxCall:
        return self

    async def __anext__(self) -> common_pb2.TokenChunk:
        item = await self.read()
        if item is grpc.aio.EOF:
            raise StopAsyncIteration
        return item  # type: ignore[no-any-return]

    def cancel(self) -> bool:
        """Stop the request on the worker (an ``abort`` item); False if it had already ended."""
        if self._done:
            return False
        self._finish()
        self._mux.send_abort(self.request_id)
        return True

    def _finish(self) -> None:
        self._done = True
        self._timer.cancel()
        self._mux.forget(self)


class StreamMux:
    """One long-lived multiplexed stream to a worker, opened when a request first needs it.

    ``open_call(items)`` starts the bidi call (a stub method such as ``GenerateStream``);
    ``make_item(**fields)`` builds its request message; ``kind`` names the item's request field.
    """

    def __init__(
        self, open_call: Callable[[AsyncIterator[Any]], Any], make_item: Callable[..., Any],
        kind: str, address: str,
    ) -> None:  # fmt: skip
        self._open_call, self._make_item, self._kind = open_call, make_item, kind
        self.address = address
        self._calls: dict[str, MuxCall] = {}
        self._outbox: asyncio.Queue[Any] | None = None
        self._reader: asyncio.Task[None] | None = None
        self._call: Any = None  # the open stream's call

    def start(self, request: Any, metadata: Sequence[tuple[str, str]], timeout: float) -> MuxCall:
        rid = request.request_id
        old = self._calls.get(rid)
        if old is not None:  # the flows retry under a new id; an old attempt's late chunks
            old.cancel()  # would reach the new call, so the id is not reused while it runs
        call = MuxCall(self, rid, timeout)
        self._calls[rid] = call
        self._send(
            self._make_item(**{self._kind: request}, metadata=dict(metadata), timeout_s=timeout)
        )
        return call

    def send_abort(self, request_id: str) -> None:
        if self._outbox is not None:
            self._send(self._make_item(abort=common_pb2.AbortRequest(request_id=request_id)))

    def forget(self, call: MuxCall) -> None:
        if self._calls.get(call.request_id) is call:
            del self._calls[call.request_id]

    @property
    def open_requests(self) -> int:
        return len(self._calls)

    def _send(self, item: Any) -> None:
        if self._outbox is None:
            outbox: asyncio.Queue[Any] = asyncio.Queue()
            try:
                call = self._open_call(self._items(outbox))
            except Exception as exc:  # a closed channel and the like: fail who waits now
                self._fail_all(self._calls, rpc_error(grpc.StatusCode.UNAVAILABLE, repr(exc)))
                return
            self._outbox, self._call = outbox, call
            self._reader = asyncio.ensure_future(self._read(call, outbox))
        self._outbox.put_nowait(item)

    @staticmethod
    async def _items(outbox: asyncio.Queue[Any]) -> AsyncIterator[Any]:
        while (item := await outbox.get()) is not None:
            yield item

    async def _read(self, call: Any, outbox: asyncio.Queue[Any]) -> None:
        calls = self._calls
        error: BaseException = rpc_error(
            grpc.StatusCode.UNAVAILABLE, f"the stream to {self.address} ended"
        )
        try:
            async for batch in call:
                for chunk in batch.chunks:
                    target = calls.get(chunk.request_id)
                    if target is not None:
                        target.deliver(chunk)
        except grpc.RpcError as exc:
            error = exc
        except asyncio.CancelledError:
            error = rpc_error(grpc.StatusCode.CANCELLED, "the gateway closed the stream")
            raise
        except Exception as exc:  # a bug here must not leave the worker's requests waiting
            log.exception("multiplexed stream to %s failed", self.address)
            error = rpc_error(grpc.StatusCode.UNKNOWN, repr(exc))
        finally:
            outbox.put_nowait(None)  # ends grpc's request-reading task
            call.cancel()
            if self._outbox is outbox:  # the next request opens a new stream
                # (else fail() or close() let it go, and said so)
                log.info("multiplexed stream to %s ended: %s", self.address, summary(error))
                self._outbox, self._reader, self._call = None, None, None
                self._calls = {}
            self._fail_all(calls, error)

    def fail(self, details: str) -> None:
        """The worker is seen gone while its stream still looks open (a frozen process sends
        nothing, and the connection's keepalive takes some 40 s to notice): every request on the
        stream fails now with UNAVAILABLE, as when the stream breaks, and the stream is
        cancelled (a worker that comes back ends the requests of a stream that ended). The next
        request opens a new stream."""
        reader, outbox, calls, call = self._reader, self._outbox, self._calls, self._call
        if outbox is None:
            return
        self._reader, self._outbox, self._calls, self._call = None, None, {}, None
        log.warning("multiplexed stream to %s given up (%d requests on it): %s",
                    self.address, len(calls), details)  # fmt: skip
        self._fail_all(calls, LostWorkerError(details))
        outbox.put_nowait(None)
        call.cancel()
        if reader is not None:
            reader.cancel()  # what it still delivers comes after the error above: never read

    @staticmethod
    def _fail_all(calls: dict[str, MuxCall], error: BaseException) -> None:
        for target in list(calls.values()):
            target.deliver(error)

    async def close(self) -> None:
        reader, outbox, calls = self._reader, self._outbox, self._calls
        self._reader, self._outbox, self._calls, self._call = None, None, {}, None
        if reader is not None:
            reader.cancel()  # a reader that never ran has no finally: clean up here too
            with contextlib.suppress(asyncio.CancelledError, grpc.RpcError):
                await reader
        if outbox is not None:
            outbox.put_nowait(None)
        self._fail_all(calls, rpc_error(grpc.StatusCode.CANCELLED, "the gateway is closing"))
