"""Images given as http(s) URLs, fetched by the gateway before the prompt is built; the bytes then
take the data URL's path (the same decoding, checks, limits and content hash).

Off unless ``--allowed-media-domains`` names hosts: the gateway would otherwise fetch whatever a
client names, from wherever it sits (internal services, cloud metadata). A URL must be https
(http too with ``--media-allow-http``), carry no credentials and name an allowed host; each
redirect's target is checked the same way. One image may take ``--media-fetch-timeout`` seconds
in all (connecting, redirects, the body) and ``--media-max-bytes`` bytes; the download stops as
soon as it passes that. A request's images are fetched at once; the first failure (a 400 naming
the URL) cancels the others, and so does the request's own cancellation (a client that left)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

import httpx

from gateway.core.config import GatewayConfig
from gateway.core.errors import APIError, invalid

MAX_REDIRECTS = 5
# images are compressed already; asking for no content encoding keeps the byte limit about what
# crosses the network, not what a gzip stream expands to
HEADERS = {"accept": "image/*", "accept-encoding": "identity", "user-agent": "tandem-gateway"}
# answers that may hold an image without saying so: PIL decides (a non-image fails to decode)
UNLABELLED = ("", "application/octet-stream", "binary/octet-stream")


@dataclass(frozen=True)
class ImageURL:
    """An image_url part's http(s) URL, fetched later (parsing does not know the gateway's flags)."""

    url: str
    param: str  # where the request gave it, e.g. messages[0].content


@dataclass(frozen=True)
class FetchPolicy:
    domains: tuple[str, ...]  # normalized (gateway.core.config.media_domain); empty: off
    allow_http: bool
    timeout_s: float
    max_bytes: int

    @classmethod
    def of(cls, config: GatewayConfig) -> FetchPolicy:
        return cls(config.allowed_media_domains, config.media_allow_http,
                   config.media_fetch_timeout_s, config.media_max_bytes)  # fmt: skip

    def allows_host(self, host: str) -> bool:
        return any(
            d == "*" or d == host or (d.startswith("*.") and host.endswith(d[1:]))
            for d in self.domains
        )


def _host(url: httpx.URL) -> str:
    return url.raw_host.decode("ascii").lower().rstrip(".")


def _join(base: httpx.URL, location: str, param: str) -> str:
    try:
        return str(base.join(location))
    except httpx.InvalidURL as e:
        raise invalid(f"{param}: {base} redirected to {location!r}, not a valid URL ({e})",
                      param) from None  # fmt: skip


class ImageFetcher:
    """Fetches image URLs under a FetchPolicy; one connection pool for the gateway's life
    (opened at the first fetch, closed by ``aclose``)."""

    def __init__(self, policy: FetchPolicy) -> None:
        self.policy = policy
        self._client: httpx.AsyncClient | None = None

    def check(self, url: str, param: str, redirected_from: str | None = None) -> httpx.URL:
        """The URL if the policy lets it be fetched, else a 400 that says what to change."""
        policy = self.policy
        if not policy.domains:
            raise invalid(
                f"{param}: fetching images from http(s) URLs is off on this server (the gateway "
                "fetches only from hosts named by --allowed-media-domains); send the image inline "
                "as a data URL: data:image/png;base64,...", param, code="media_fetch_off"
            )  # fmt: skip
        what = f"{redirected_from} redirected to {url}, which" if redirected_from else url
        try:
            parsed = httpx.URL(url)
            host = _host(parsed)
        except (httpx.InvalidURL, UnicodeError) as e:
            raise invalid(f"{param}: {what} is not a valid URL ({e})", param) from None
        if parsed.userinfo:  # checked first: the messages below repeat the URL
            raise invalid(f"{param}: image URLs must not carry credentials (user:password@): "
                          "drop them, or send the image as a data URL", param)  # fmt: skip
        schemes = ("https", "http") if policy.allow_http else ("https",)
        if parsed.scheme not in schemes:
            also = "" if policy.allow_http else " (http needs the gateway's --media-allow-http)"
            raise invalid(f"{param}: {what} is not an https URL; image URLs must be https{also}, "
                          "or send the image as a data URL", param)  # fmt: skip
        if not host or not policy.allows_host(host):
            raise invalid(
                f"{param}: {what} is on host {host!r}, not one the gateway may fetch images from "
                "(--allowed-media-domains); send the image as a data URL", param,
                code="media_host_not_allowed",
            )  # fmt: skip
        return parsed

    async def fetch_all(self, images: Sequence[bytes | ImageURL]) -> tuple[bytes, ...]:
        """The images' bytes, each URL fetched (all at once); every URL is checked before any
        is fetched."""
        for image in images:
            if isinstance(image, ImageURL):
                self.check(image.url, image.param)
        tasks = {
            i: asyncio.ensure_future(self.fetch(image))
            for i, image in enumerate(images)
            if isinstance(image, ImageURL)
        }
        try:
            await asyncio.gather(*tasks.values())
        finally:  # a failure or a cancellation leaves nothing running
            for task in tasks.values():
                task.cancel()
            await asyncio.gather(*tasks.values(), return_exceptions=True)
        return tuple(
            image if isinstance(image, bytes) else tasks[i].result()
            for i, image in enumerate(images)
        )

    async def fetch(self, image: ImageURL) -> bytes:
        """One image's bytes, within the policy's time and size; a 400 naming the URL else."""
        limit = self.policy.timeout_s
        try:
            async with asyncio.timeout(limit):
                return await self._follow(image)
        except (TimeoutError, httpx.TimeoutException):
            raise invalid(
                f"{image.param}: fetching {image.url} took longer than the {limit:g} s allowed "
                "(--media-fetch-timeout); send the image as a data URL", image.param,
                code="media_fetch_timeout",
            ) from None  # fmt: skip
        except httpx.HTTPError as e:
            raise invalid(f"{image.param}: could not fetch {image.url}: "
                          f"{e or type(e).__name__}", image.param) from None  # fmt: skip

    async def _follow(self, image: ImageURL) -> bytes:
        client = self._open()
        url, previous = image.url, None
        for _ in range(MAX_REDIRECTS + 1):
            target = self.check(url, image.param, previous)
            async with client.stream("GET", target) as answer:
                if answer.is_redirect:
                    previous, url = url, _join(target, answer.headers["location"], image.param)
                    continue
                return await self._body(answer, url, image.param)
        raise invalid(f"{image.param}: {image.url} redirected more than {MAX_REDIRECTS} times",
                      image.param)  # fmt: skip

    async def _body(self, answer: httpx.Response, url: str, param: str) -> bytes:
        if not answer.is_success:
            raise invalid(f"{param}: fetching {url} answered HTTP {answer.status_code} "
                          f"{answer.reason_phrase}".rstrip(), param)  # fmt: skip
        mime = answer.headers.get("content-type", "").split(";")[0].strip().lower()
        if mime not in UNLABELLED and not mime.startswith("image/"):
            raise invalid(f"{param}: {url} answered {mime!r}, not an image (image/png, "
                          "image/jpeg, ...)", param)  # fmt: skip
        declared = answer.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.policy.max_bytes:
            raise self._too_large(url, param, declared)
        parts, size = [], 0
        async for part in answer.aiter_bytes():
            size += len(part)
            if size > self.policy.max_bytes:  # stop reading: the rest is never downloaded
                raise self._too_large(url, param, f"more than {self.policy.max_bytes}")
            parts.append(part)
        return b"".join(parts)

    def _too_large(self, url: str, param: str, size: str) -> APIError:
        return invalid(
            f"{param}: the image at {url} ({size} bytes) is larger than the "
            f"{self.policy.max_bytes} bytes allowed (--media-max-bytes)", param,
            code="media_too_large",
        )  # fmt: skip

    def _open(self) -> httpx.AsyncClient:
        if self._client is None:
            # redirects are followed here, each target checked; the environment's proxies and
            # .netrc are not read (a fetch goes where the URL says, with no credentials)
            self._client = httpx.AsyncClient(
                headers=HEADERS, follow_redirects=False, trust_env=False,
                timeout=self.policy.timeout_s,
            )  # fmt: skip
        return self._client

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None
