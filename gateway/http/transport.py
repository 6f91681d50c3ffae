"""HTTP plumbing: bounded JSON bodies, SSE responses, and noticing a client that left."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from gateway.core.errors import APIError, invalid

T = TypeVar("T")
DONE = b"data: [DONE]\n\n"


class ClientGone(Exception):
    """The client disconnected before the response was ready."""


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _check_content_type(request: Request) -> None:
    encoding = request.headers.get("content-encoding", "identity").strip().lower()
    if encoding not in ("", "identity"):  # no server decompresses it (vLLM, uvicorn): say so
        raise APIError(  # 415 covers the Content-Encoding too (RFC 9110)
            415,
            f"Content-Encoding {encoding!r} is not supported: send the request body uncompressed",
            code="content_encoding",
        )
    ctype = request.headers.get("content-type")
    if ctype is None:
        return
    mime = ctype.split(";")[0].strip().lower()
    if mime != "application/json" and not mime.endswith("+json"):
        raise APIError(  # as vLLM answers: 415 Unsupported Media Type
            415, f"Content-Type must be application/json, got {ctype!r}", code="content_type"
        )


def _too_large(size: int | str, limit: int) -> APIError:
    return APIError(
        413,
        f"the request body ({size} bytes) is larger than the limit of {limit} bytes "
        "(the gateway's --max-body-bytes; send images as URLs where the gateway fetches them, "
        "or smaller)",
        code="body_too_large",
    )


# JSON can smuggle lone UTF-16 surrogates in as \\uD800-\\uDFFF escapes; nothing else can
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def _printable(key: str | int) -> str:
    return str(key).encode("utf-8", "backslashreplace").decode("utf-8")


def _where(path: tuple[str | int, ...]) -> str:
    out = ""
    for key in path:
        if isinstance(key, int):
            out += f"[{key}]"
        else:
            out += f".{_printable(key)}" if out else _printable(key)
    return out or "the request body"


def _check_unicode(value: Any) -> None:
    """A 400 naming the first string (or key) holding a lone surrogate: not encodable text."""
    stack: list[tuple[Any, tuple[str | int, ...]]] = [(value, ())]
    while stack:
        item, path = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError as e:
                where = _where(path)
                raise invalid(
                    f"{where} is not valid Unicode: it holds a lone UTF-16 surrogate "
                    f"({item[e.start]!a} at character {e.start})",
                    _printable(path[0]) if path else None,
                    code="bad_unicode",
                ) from e
        elif isinstance(item, dict):
            for key, v in reversed(item.items()):
                stack.append((v, (*path, key)))
                stack.append((key, (*path, key)))
        elif isinstance(item, list):
            stack.extend((v, (*path, i)) for i, v in reversed(list(enumerate(item))))


async def read_json(request: Request, limit: int) -> Any:
    """The parsed body; a 415 for a Content-Type that is not JSON or a compressed body; a 400
    for bad UTF-8, bad JSON or strings that are not valid Unicode (lone surrogates); a 413 for
    too many bytes."""
    _check_content_type(request)
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(declared, limit)
    parts, size = [], 0
    async for part in request.stream():
        size += len(part)
        if size > limit:
            raise _too_large(f"more than {limit}", limit)
        parts.append(part)
    raw = b"".join(parts)
    if not raw.strip():
        raise invalid("the request body is empty: send a JSON object", code="empty_body")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise invalid(
            f"the request body is not valid UTF-8 (byte {e.start})", code="bad_utf8"
        ) from e
    try:
        body = json.loads(text, parse_constant=_reject_constant)
    except json.JSONDecodeError as e:
        raise invalid(
            f"the request body is not valid JSON: {e.msg} (line {e.lineno}, column {e.colno})",
            code="bad_json",
        ) from e
    except RecursionError as e:
        raise invalid("the request body is nested too deeply", code="bad_json") from e
    except ValueError as e:
        raise invalid(f"the request body is not valid JSON: {e}", code="bad_json") from e
    if _SURROGATE_ESCAPE.search(text):
        _check_unicode(body)
    return body


async def _wait_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _cancel(*tasks: asyncio.Future[Any]) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Awaits ``work``; cancels it and raises ClientGone if the client disconnects first."""
    job = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_wait_disconnect(request.receive))
    try:
        await asyncio.wait({job, watch}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        await _cancel(job, watch)
        raise
    if not job.done():
        await _cancel(job, watch)
        raise ClientGone()
    await _cancel(watch)
    return job.result()


def sse(data: Mapping[str, Any]) -> bytes:
    return b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"


class SSEResponse(Response):
    """Streams ``events`` (already framed bytes). A disconnect cancels the stream, whose
    generator cleans up (aborting the request on the workers)."""

    media_type = "text/event-stream"

    def __init__(
        self,
        events: AsyncGenerator[bytes, None],
        headers: Mapping[str, str] | None = None,
        on_close: Callable[[], None] = lambda: None,
    ) -> None:
        self.events = events
        self.on_close = on_close
        self.status_code = 200
        self.background = None
        self.init_headers(
            {"cache-control": "no-cache", "x-accel-buffering": "no", **(headers or {})}
        )

    async def _stream(self, send: Send) -> None:
        async with contextlib.aclosing(self.events):
            async for data in self.events:
                await send({"type": "http.response.body", "body": data, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send(
            {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
        )
        stream = asyncio.ensure_future(self._stream(send))
        watch = asyncio.ensure_future(_wait_disconnect(receive))
        try:
            await asyncio.wait({stream, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            await _cancel(stream, watch)
            self.on_close()
        error = stream.exception() if stream.done() and not stream.cancelled() else None
        if error is not None and not isinstance(error, OSError):  # OSError: the client left
            raise error
