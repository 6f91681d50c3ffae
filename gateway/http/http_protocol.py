"""The gateway's HTTP/1.1 connection guard: uvicorn's httptools protocol with limits it lacks.

uvicorn times out only idle keep-alive connections. A client that opens a connection and then
sends its request line and headers a byte at a time (or never), or stops halfway through a body,
holds a socket and a parser forever; a few hundred of them exhaust file descriptors. This
protocol adds, per connection:

- a header deadline: the request line and every header must arrive within ``header_timeout_s`` of
  the request's first byte (of the connection, for its first request); else a 408 and close;
- a header size cap (``max_header_bytes``): more before the blank line is a 431 and close;
- a body deadline: the whole body within ``body_timeout_s`` of the headers; else the connection
  closes and the application sees ``http.disconnect`` (it frees what it held for the request);
- a send deadline: a client that takes no byte of its response for ``send_timeout_s``
  (``--send-timeout``; 0: none) while the server has bytes for it (the socket's buffers full)
  is dropped, as nginx's ``send_timeout``; the application sees ``http.disconnect`` and aborts
  the request, so a client that stops reading neither holds the connection nor has its output
  buffered forever;
- a bound on open connections (``max_connections``): one more is answered 503 and closed before
  its request is read. The first refusal is logged, the rest of a flood of them is summed up in
  one line per ``refusal_log_s``, not one line each.

Deadlines are totals, not per-read gaps: a client trickling one byte a second is cut off as
surely as a silent one.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HttpLimits:
    header_timeout_s: float = 10.0
    body_timeout_s: float = 60.0
    max_header_bytes: int = 64 * 1024
    max_connections: int = 4096
    refusal_log_s: float = 10.0
    send_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        names = ("header_timeout_s", "body_timeout_s", "max_header_bytes", "max_connections",
                 "refusal_log_s")  # fmt: skip
        for name in names:
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.send_timeout_s < 0:  # 0: no send deadline
            raise ValueError(f"send_timeout_s must be >= 0, got {self.send_timeout_s}")


class RefusalLog:
    """Refused connections in a few log lines: the first of a burst at once, the others counted
    and summed up in one line ``every_s`` after it (one server's loop calls it)."""

    def __init__(self, every_s: float) -> None:
        self.every_s = every_s
        self._quiet_until = 0.0
        self._held = 0  # refusals since the last line
        self._summary: asyncio.TimerHandle | None = None

    def refused(self, loop: asyncio.AbstractEventLoop, open_now: int) -> None:
        now = loop.time()
        if now >= self._quiet_until:
            log.warning("refusing connections: %d open, the bound (--max-connections)", open_now)
            self._quiet_until = now + self.every_s
            return
        self._held += 1
        if self._summary is None:
            self._summary = loop.call_at(self._quiet_until, self._sum_up)

    def _sum_up(self) -> None:
        self._summary = None
        log.warning("refused %d more connections in %g s: too many open", self._held, self.every_s)
        self._held = 0


def _reply(status: int, message: str) -> bytes:
    body = message.encode()
    return b"".join(
        [
            STATUS_LINE[status],
            b"content-type: text/plain; charset=utf-8\r\n",
            b"content-length: %d\r\n" % len(body),
            b"connection: close\r\n\r\n",
            body,
        ]
    )


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    """Subclassed per server by :func:`guarded_protocol` (uvicorn builds protocols itself)."""

    limits = HttpLimits()
    refusals = RefusalLog(limits.refusal_log_s)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._deadline: asyncio.TimerHandle | None = None
        self._reading_headers = True  # between requests: the next bytes start a request head
        self._header_bytes = 0
        self._reading_body = False
        self._unread: asyncio.TimerHandle | None = None  # writes paused: the client reads nothing

    # connection life
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections:
            self.refusals.refused(self.loop, len(self.connections) - 1)
            transport.write(_reply(503, "too many open connections; retry later"))
            transport.close()
            return
        self._arm(self.limits.header_timeout_s, self._header_timeout)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self._disarm_send()
        super().connection_lost(exc)

    # writes: the transport pauses us while its buffer is full, resumes us once it drained
    def pause_writing(self) -> None:
        super().pause_writing()
        if self._unread is None and self.limits.send_timeout_s > 0:
            self._unread = self.loop.call_later(self.limits.send_timeout_s, self._send_timeout)

    def resume_writing(self) -> None:
        super().resume_writing()
        self._disarm_send()

    def _disarm_send(self) -> None:
        if self._unread is not None:
            self._unread.cancel()
            self._unread = None

    def _send_timeout(self) -> None:
        self._unread = None
        if not self.transport.is_closing():
            log.info("closing a connection: the client read nothing of its response for %g s",
                     self.limits.send_timeout_s)  # fmt: skip
            self.transport.abort()  # what is buffered for it is dropped

    def data_received(self, data: bytes) -> None:
        if self._reading_headers:
            self._header_bytes += len(data)
        super().data_received(data)
        # still no blank line after this many bytes (httptools buffers a partial header itself)
        if self._reading_headers and self._header_bytes > self.limits.max_header_bytes:
            self._refuse(431, "request line and headers too large")

    # parser callbacks
    def on_message_begin(self) -> None:  # a request's first byte
        super().on_message_begin()
        self._reading_headers = True
        self._arm(self.limits.header_timeout_s, self._header_timeout)

    def on_headers_complete(self) -> None:
        self._disarm()
        self._reading_headers = False
        self._header_bytes = 0
        size = len(self.url) + sum(len(n) + len(v) + 4 for n, v in self.headers)
        if size > self.limits.max_header_bytes:
            self._refuse(431, "request line and headers too large")
            return
        super().on_headers_complete()
        if self.parser is not None and not self.transport.is_closing():
            self._reading_body = True
            self._arm(self.limits.body_timeout_s, self._body_timeout)

    def on_body(self, body: bytes) -> None:
        if self.cycle is not None:  # None: the head was refused, the connection is closing
            super().on_body(body)

    def on_message_complete(self) -> None:
        self._disarm()
        self._reading_body = False
        self._reading_headers = True  # the next request's deadline starts at its first byte
        if self.cycle is not None:
            super().on_message_complete()

    # deadlines
    def _arm(self, seconds: float, fn: Any) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(seconds, fn)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _header_timeout(self) -> None:
        self._deadline = None
        if not self._reading_headers:
            return
        if self.cycle is not None and not self.cycle.response_complete:
            self.transport.close()  # a pipelined request stalled behind a response being written
            return
        timeout = self.limits.header_timeout_s
        self._refuse(408, f"request headers not received within {timeout:g} s")

    def _body_timeout(self) -> None:
        self._deadline = None
        if self._reading_body and not self.transport.is_closing():
            log.info("closing a connection: request body not received in time")
            self.transport.close()  # the application sees http.disconnect and lets go

    def _refuse(self, status: int, message: str) -> None:
        self._disarm()
        if not self.transport.is_closing():
            self.transport.write(_reply(status, message))
            self.transport.close()


def guarded_protocol(limits: HttpLimits) -> type[GuardedHttpToolsProtocol]:
    """A protocol class for ``uvicorn.Config(http=...)`` bound to these limits."""
    attrs = {"limits": limits, "refusals": RefusalLog(limits.refusal_log_s)}
    return type("GuardedHttp", (GuardedHttpToolsProtocol,), attrs)
