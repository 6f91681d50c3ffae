"""The HTTP connection guard: header and body deadlines, header size, connection bound."""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import PlainTextResponse, StreamingResponse
from starlette.routing import Route

from gateway.http.http_protocol import HttpLimits, guarded_protocol
from tests.gateway.threaded_server import ThreadedServer

pytestmark = pytest.mark.timeout(60)

LIMITS = HttpLimits(
    header_timeout_s=0.5,
    body_timeout_s=0.5,
    max_header_bytes=4096,
    max_connections=3,
    send_timeout_s=0.5,
)


class Served(ThreadedServer):
    def __init__(self, limits: HttpLimits) -> None:
        self.disconnects = 0
        self.bodies: list[int] = []

        async def echo(request: Request) -> PlainTextResponse:
            try:
                body = await request.body()
            except ClientDisconnect:
                self.disconnects += 1
                raise
            self.bodies.append(len(body))
            return PlainTextResponse(f"{len(body)}")

        self.floods_ended = threading.Event()

        async def flood(request: Request) -> StreamingResponse:
            async def chunks() -> AsyncIterator[bytes]:
                try:
                    while True:
                        yield b"x" * 65536
                        await asyncio.sleep(0)
                finally:
                    self.floods_ended.set()

            return StreamingResponse(chunks())

        app = Starlette(routes=[Route("/echo", echo, methods=["GET", "POST"]),
                                Route("/flood", flood)])  # fmt: skip
        config = uvicorn.Config(
            app, host="127.0.0.1", port=0, log_level="warning", http=guarded_protocol(limits),
            timeout_keep_alive=30,
        )  # fmt: skip
        super().__init__(config)

    def connect(self) -> socket.socket:
        s = socket.create_connection(("127.0.0.1", self.port), timeout=10)
        return s


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    with Served(LIMITS) as s:
        yield s


def read_all(s: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (10 s socket timeout)."""
    chunks = []
    while chunk := s.recv(65536):
        chunks.append(chunk)
    return b"".join(chunks)


def read_response(s: socket.socket) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data:
        data += s.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(
        next(
            line for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")
        ).split(b":")[1]
    )
    while len(body) < length:
        body += s.recv(65536)
    return head.split(b"\r\n")[0] + b" " + body


def test_a_complete_request_is_served_and_keep_alive_outlives_the_header_deadline(
    served: Served,
) -> None:
    with served.connect() as s:
        s.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello")
        assert read_response(s) == b"HTTP/1.1 200 OK 5"
        time.sleep(2 * LIMITS.header_timeout_s)  # idle between requests: keep-alive's rule
        s.sendall(b"GET /echo HTTP/1.1\r\nHost: x\r\n\r\n")
        assert read_response(s) == b"HTTP/1.1 200 OK 0"


def test_headers_that_never_finish_get_408_and_the_connection_closes(served: Served) -> None:
    with served.connect() as s:
        s.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\n")
        reply = read_all(s)
    assert reply.startswith(b"HTTP/1.1 408") and b"connection: close" in reply


def test_a_trickle_of_header_bytes_is_cut_off_at_the_total_deadline(served: Served) -> None:
    line = b"X-Slow: " + b"a" * 200 + b"\r\n"
    started = time.monotonic()
    with served.connect() as s:
        s.sendall(b"GET /echo HTTP/1.1\r\n")
        try:
            for i in range(1000):  # a byte every 10 ms never finishes in time
                s.sendall(line[i % len(line) : i % len(line) + 1])
                time.sleep(0.01)
        except OSError:
            pass  # closed by the server while we were still sending
        reply = read_all(s)
    assert reply.startswith(b"HTTP/1.1 408")
    assert time.monotonic() - started < 9  # cut off long before the trickle would have ended


def test_a_connection_that_sends_nothing_is_closed(served: Served) -> None:
    with served.connect() as s:
        assert read_all(s).startswith(b"HTTP/1.1 408")


def test_oversized_headers_get_431(served: Served) -> None:
    with served.connect() as s:
        s.sendall(b"GET /echo HTTP/1.1\r\nHost: x\r\nX-Big: " + b"b" * 8192 + b"\r\n\r\n")
        assert read_all(s).startswith(b"HTTP/1.1 431")
    with served.connect() as s:  # one endless header line, never terminated
        s.sendall(b"GET /echo HTTP/1.1\r\nX-Big: " + b"b" * 8192)
        assert read_all(s).startswith(b"HTTP/1.1 431")


def test_a_body_that_stops_arriving_closes_the_connection_and_the_app_sees_a_disconnect(
    served: Served,
) -> None:
    before = served.disconnects
    with served.connect() as s:
        s.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n0123456789")
        assert read_all(s) == b""  # closed without a response: the app never had its body
    deadline = time.monotonic() + 5
    while served.disconnects == before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert served.disconnects == before + 1


def test_a_client_that_stops_reading_its_response_is_cut_off(served: Served) -> None:
    """A client that reads nothing of a streamed response while the server has bytes for it
    held the connection, and what the gateway buffered for it, for as long as it liked (a
    stream ran on for minutes). After send_timeout_s without a byte taken, as nginx's
    send_timeout, the connection is dropped and the application sees the disconnect."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(("127.0.0.1", served.port))
    try:
        s.sendall(b"GET /flood HTTP/1.1\r\nHost: x\r\n\r\n")  # and never read
        assert served.floods_ended.wait(10)
    finally:
        s.close()


def test_a_send_timeout_of_zero_waits_for_the_client() -> None:
    """--send-timeout 0: a client that reads nothing keeps its stream (until it leaves)."""
    with Served(HttpLimits(send_timeout_s=0)) as served:
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.connect(("127.0.0.1", served.port))
        s.sendall(b"GET /flood HTTP/1.1\r\nHost: x\r\n\r\n")  # and never read
        # twice LIMITS.send_timeout_s, after which the test above sees the stream cut
        assert not served.floods_ended.wait(1.0)
        s.close()
        assert served.floods_ended.wait(10)


def test_connections_beyond_the_bound_get_503() -> None:
    with Served(LIMITS) as served:
        held = [served.connect() for _ in range(LIMITS.max_connections)]
        for s in held:
            s.sendall(b"GET /echo HTTP/1.1\r\n")  # in flight, not finished
        try:
            with served.connect() as extra:
                assert read_all(extra).startswith(b"HTTP/1.1 503")
        finally:
            for s in held:
                s.close()
        with served.connect() as s:  # room again once they are gone
            s.sendall(b"GET /echo HTTP/1.1\r\nHost: x\r\n\r\n")
            assert read_response(s) == b"HTTP/1.1 200 OK 0"


def test_a_flood_of_refused_connections_is_logged_in_a_few_lines(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Every connection past the bound was one WARNING line: 4,200 idle sockets against the
    gateway's 4,096 wrote 104 lines in a millisecond. The first refusal is logged, the rest of
    the burst is summed up in one line."""
    limits = HttpLimits(max_connections=1, refusal_log_s=0.2)
    caplog.set_level(logging.WARNING, logger="gateway.http.http_protocol")
    with Served(limits) as served:
        held = served.connect()
        held.sendall(b"GET /echo HTTP/1.1\r\n")  # holds the only slot
        for _ in range(20):
            with served.connect() as extra:
                assert read_all(extra).startswith(b"HTTP/1.1 503")
        deadline = time.monotonic() + 5
        while "19 more" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.05)  # the summary is written by the server's loop after refusal_log_s
        held.close()
    lines = [r.getMessage() for r in caplog.records if r.name == "gateway.http.http_protocol"]
    assert len(lines) == 2, lines
    assert "1 open" in lines[0] and "refused 19 more connections" in lines[1]


def test_limits_must_be_positive() -> None:
    with pytest.raises(ValueError, match="header_timeout_s"):
        HttpLimits(header_timeout_s=0)
    with pytest.raises(ValueError, match="send_timeout_s"):
        HttpLimits(send_timeout_s=-1)
