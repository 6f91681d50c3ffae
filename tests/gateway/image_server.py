"""A local HTTP server for image URL tests (uvicorn on a free port, in its own thread): PNGs,
and every way an image URL can go wrong."""

from __future__ import annotations

import asyncio
import io
import threading
from collections import Counter
from collections.abc import AsyncIterator, Callable, Mapping

import uvicorn
from PIL import Image
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response, StreamingResponse
from starlette.routing import Route

from tests.gateway.threaded_server import ThreadedServer

LIMIT = 64 * 1024  # /big.png is one byte more


def _png(width: int, height: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (width, height), (10, 20, 30)).save(buf, format="PNG")
    return buf.getvalue()


CAT, DOG = _png(3, 2), _png(5, 4)


class ImageServer(ThreadedServer):
    """Serves PNGs and every way an image URL can go wrong; ``hung`` and ``left`` tell the test
    when a hanging request arrived and when its client closed the connection."""

    def __init__(self, files: Mapping[str, bytes] | None = None) -> None:
        self.hung, self.left = threading.Event(), threading.Event()
        self.arrived: Counter[str] = Counter()
        self.pairs: dict[str, asyncio.Event] = {}
        routes = [
            Route("/cat.png", lambda r: Response(CAT, media_type="image/png")),
            Route("/dog", lambda r: Response(DOG, media_type="application/octet-stream")),
            Route("/page", lambda r: Response("<html></html>", media_type="text/html")),
            Route("/big.png", lambda r: Response(b"\0" * (LIMIT + 1), media_type="image/png")),
            Route("/endless.png", self.endless),
            Route("/hang.png", self.hang),
            Route("/pair/{key}", self.pair),
            Route("/late-404", self.late_404),
            Route("/hop", lambda r: RedirectResponse("/cat.png")),
            Route("/away", lambda r: RedirectResponse(f"http://localhost:{self.port}/cat.png")),
            Route("/loop", lambda r: RedirectResponse("/loop")),
            *(Route(path, self._file(data)) for path, data in (files or {}).items()),
        ]
        super().__init__(uvicorn.Config(Starlette(routes=routes), host="127.0.0.1", port=0,
                                        log_level="warning"))  # fmt: skip

    @staticmethod
    def _file(data: bytes) -> Callable[[Request], Response]:
        return lambda request: Response(data, media_type="image/png")

    async def endless(self, request: Request) -> StreamingResponse:
        async def chunks() -> AsyncIterator[bytes]:
            while True:  # never ends: only a reader that stops at its limit gets past this
                yield b"\0" * 4096
                await asyncio.sleep(0)

        return StreamingResponse(chunks(), media_type="image/png")

    async def hang(self, request: Request) -> Response:
        self.hung.set()
        while (await request.receive())["type"] != "http.disconnect":
            pass
        self.left.set()
        return Response(b"")

    async def late_404(self, request: Request) -> Response:
        """A 404 once a /hang.png request is in (so the failure comes while it is fetched)."""
        await asyncio.to_thread(self.hung.wait, 5)
        return Response(b"", status_code=404)

    async def pair(self, request: Request) -> Response:
        """Answers once two requests of the same key are in: only concurrent fetches pass."""
        key = request.path_params["key"]
        both = self.pairs.setdefault(key, asyncio.Event())
        self.arrived[key] += 1
        if self.arrived[key] == 2:
            both.set()
        await both.wait()
        return Response(DOG if request.query_params.get("dog") else CAT, media_type="image/png")

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"
