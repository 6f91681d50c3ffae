"""Image URLs fetched by the gateway, against a real local HTTP server (uvicorn on a free port):
only from allowed hosts, within the size and time limits, redirects checked, a request's images
fetched at once, and a cancelled fetch closes its connection."""

from __future__ import annotations

import asyncio
import io
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator

import pytest
import uvicorn
from PIL import Image
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response, StreamingResponse
from starlette.routing import Route

from gateway.core.config import GatewayConfig
from gateway.core.errors import APIError
from gateway.flows.image_fetch import FetchPolicy, ImageFetcher, ImageURL

LIMIT = 64 * 1024


def _png(width: int, height: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (width, height), (10, 20, 30)).save(buf, format="PNG")
    return buf.getvalue()


CAT, DOG = _png(3, 2), _png(5, 4)


class ImageServer:
    """Serves PNGs and every way an image URL can go wrong; ``hung`` and ``left`` tell the test
    when a hanging request arrived and when its client closed the connection."""

    def __init__(self) -> None:
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
        ]
        config = uvicorn.Config(Starlette(routes=routes), host="127.0.0.1", port=0,
                                log_level="warning")  # fmt: skip
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=asyncio.run, args=(self.server.serve(),))
        self.port = 0

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

    def __enter__(self) -> ImageServer:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started and time.monotonic() < deadline:
            time.sleep(0.01)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture(scope="module")
def served() -> Iterator[ImageServer]:
    with ImageServer() as s:
        yield s


def _fetcher(**kw: object) -> ImageFetcher:
    policy = {"domains": ("127.0.0.1",), "allow_http": True, "timeout_s": 2.0,
              "max_bytes": LIMIT, **kw}  # fmt: skip
    return ImageFetcher(FetchPolicy(**policy))  # type: ignore[arg-type]


async def _fetch(served: ImageServer, path: str, **kw: object) -> bytes:
    fetcher = _fetcher(**kw)
    try:
        (data,) = await fetcher.fetch_all([ImageURL(served.url(path), "messages[0].content")])
        return data
    finally:
        await fetcher.aclose()


async def test_an_allowed_url_gives_the_image_bytes(served: ImageServer) -> None:
    assert await _fetch(served, "/cat.png") == CAT
    assert await _fetch(served, "/hop") == CAT  # a redirect within the allowed hosts
    assert await _fetch(served, "/dog") == DOG  # octet-stream: the image decoder decides


async def test_the_default_config_fetches_nothing() -> None:
    fetcher = ImageFetcher(FetchPolicy.of(GatewayConfig(tokenizer="/tok")))
    with pytest.raises(APIError, match=r"off on this server.*--allowed-media-domains") as e:
        await fetcher.fetch_all([b"inline", ImageURL("https://example.com/a.png", "p")])
    assert e.value.status == 400 and e.value.param == "p"


@pytest.mark.parametrize(
    ("url", "kw", "words"),
    [
        ("http://127.0.0.1:1/a.png", {"allow_http": False}, "must be https.*--media-allow-http"),
        ("https://u:pw@127.0.0.1/a.png", {}, "must not carry credentials"),
        ("https://example.com/a.png", {}, "host 'example.com', not one the gateway may fetch"),
        ("https://127.0.0.1.evil.com/a", {}, "host '127.0.0.1.evil.com'"),
    ],
)
async def test_urls_the_policy_refuses_are_a_400_before_any_fetch(
    url: str, kw: dict, words: str
) -> None:
    fetcher = _fetcher(**kw)
    with pytest.raises(APIError, match=words) as e:
        await fetcher.fetch_all([ImageURL(url, "p")])
    assert e.value.status == 400
    assert fetcher._client is None  # nothing was opened


def test_allowed_hosts_match_exactly_or_as_subdomains_of_a_wildcard() -> None:
    policy = FetchPolicy(("img.example.com", "*.cdn.net"), False, 1.0, 1)
    assert policy.allows_host("img.example.com") and policy.allows_host("a.b.cdn.net")
    assert not policy.allows_host("example.com") and not policy.allows_host("cdn.net")
    assert not policy.allows_host("evilcdn.net") and not policy.allows_host("img.example.com.x")
    assert FetchPolicy(("*",), False, 1.0, 1).allows_host("anything.at.all")


@pytest.mark.parametrize(
    ("path", "words"),
    [
        ("/missing.png", "answered HTTP 404 Not Found"),
        ("/page", "answered 'text/html', not an image"),
        ("/big.png", f"larger than the {LIMIT} bytes allowed"),  # declared by Content-Length
        ("/endless.png", f"more than {LIMIT} bytes"),  # streamed: the read stops at the limit
        ("/away", "redirected to http://localhost:.*host 'localhost', not one"),
        ("/loop", "redirected more than 5 times"),
    ],
)
async def test_answers_that_are_not_an_allowed_image_are_a_400(
    served: ImageServer, path: str, words: str
) -> None:
    with pytest.raises(APIError, match=words) as e:
        await _fetch(served, path)
    assert e.value.status == 400 and e.value.param == "messages[0].content"


async def test_a_slow_server_is_a_400_at_the_deadline_and_its_connection_closes(
    served: ImageServer,
) -> None:
    served.hung.clear(), served.left.clear()
    start = time.monotonic()
    with pytest.raises(APIError, match=r"took longer than the 0\.2 s allowed") as e:
        await _fetch(served, "/hang.png", timeout_s=0.2)
    assert e.value.status == 400 and time.monotonic() - start < 1.5
    assert await asyncio.to_thread(served.left.wait, 5)


async def test_a_cancelled_fetch_closes_its_connection(served: ImageServer) -> None:
    served.hung.clear(), served.left.clear()
    fetcher = _fetcher(timeout_s=30.0)
    task = asyncio.ensure_future(fetcher.fetch_all([ImageURL(served.url("/hang.png"), "p")]))
    assert await asyncio.to_thread(served.hung.wait, 5)
    task.cancel()  # what a client that leaves does to the request's fetch
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await asyncio.to_thread(served.left.wait, 5)
    await fetcher.aclose()


async def test_a_requests_images_are_fetched_at_once_and_kept_in_order(
    served: ImageServer,
) -> None:
    fetcher = _fetcher()
    # each /pair URL answers only once the other has arrived: fetched one by one, they time out
    urls = [ImageURL(served.url("/pair/a"), "p"), ImageURL(served.url("/pair/a?dog=1"), "p")]
    try:
        assert await fetcher.fetch_all([urls[1], b"inline", urls[0]]) == (DOG, b"inline", CAT)
    finally:
        await fetcher.aclose()


async def test_one_failure_cancels_the_requests_other_fetches(served: ImageServer) -> None:
    served.hung.clear(), served.left.clear()
    fetcher = _fetcher(timeout_s=30.0)  # the hanging fetch ends by cancellation, not its deadline
    urls = [ImageURL(served.url("/hang.png"), "p"), ImageURL(served.url("/late-404"), "p")]
    start = time.monotonic()
    with pytest.raises(APIError, match="HTTP 404"):
        await fetcher.fetch_all(urls)
    assert time.monotonic() - start < 5
    assert await asyncio.to_thread(served.left.wait, 5)  # the hanging one was let go
    await fetcher.aclose()
