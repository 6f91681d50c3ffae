"""Image URLs fetched by the gateway, against a real local HTTP server (uvicorn on a free port):
only from allowed hosts, within the size and time limits, redirects checked, a request's images
fetched at once, and a cancelled fetch closes its connection."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest

from gateway.core.config import GatewayConfig
from gateway.core.errors import APIError
from gateway.flows.image_fetch import FetchPolicy, ImageFetcher, ImageURL
from tests.gateway.image_server import CAT, DOG, LIMIT, ImageServer


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
    assert e.value.status == 400 and time.monotonic() - start < 5  # the server never answers
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
