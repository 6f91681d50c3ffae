"""The internal token on the workers' gRPC API: required on every RPC but health checks.

Without it, anyone who reaches a worker's port can reserve every KV block or run prefills, so
the gateway's --api-key would protect nothing that matters. Workers and gateway read the same
secret (``--internal-token`` or ``TANDEM_INTERNAL_TOKEN``; ``tandem up`` makes one per run), the
gateway sends it as metadata on every call (:func:`client_interceptors`), and a worker refuses a
call without it as UNAUTHENTICATED (:class:`TokenCheck`). Health checks stay open so probes of
compose and Kubernetes, which send no metadata, keep working; they reveal nothing but a status.
With no token configured, nothing is checked (the loopback-only default of a single host).
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

TOKEN_ENV = "TANDEM_INTERNAL_TOKEN"
METADATA_KEY = "x-tandem-internal-token"
OPEN_METHODS = frozenset({"/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/Watch"})


def token_from(flag: str | None) -> str:
    """The flag's value, else the environment's, else "" (no token)."""
    return flag or os.environ.get(TOKEN_ENV, "")


def _refuse(kind: str) -> grpc.RpcMethodHandler:
    async def deny(request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(
            grpc.StatusCode.UNAUTHENTICATED,
            f"missing or wrong internal token (metadata {METADATA_KEY!r})",
        )

    make = {
        "unary_unary": grpc.unary_unary_rpc_method_handler,
        "unary_stream": grpc.unary_stream_rpc_method_handler,
        "stream_unary": grpc.stream_unary_rpc_method_handler,
        "stream_stream": grpc.stream_stream_rpc_method_handler,
    }[kind]
    return make(deny)  # type: ignore[operator]


class TokenCheck(grpc.aio.ServerInterceptor):
    """Refuses every call but health checks that does not carry the token."""

    def __init__(self, token: str) -> None:
        self._expected = token.encode()

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or details.method in OPEN_METHODS:  # type: ignore[attr-defined]
            return handler
        given = dict(details.invocation_metadata or ()).get(METADATA_KEY, "")  # type: ignore[attr-defined]
        if isinstance(given, str) and hmac.compare_digest(given.encode(), self._expected):
            return handler
        kind = next(k for k in ("unary_unary", "unary_stream", "stream_unary", "stream_stream")
                    if getattr(handler, k, None) is not None)  # fmt: skip
        return _refuse(kind)


def server_interceptors(token: str) -> list[grpc.aio.ServerInterceptor]:
    return [TokenCheck(token)] if token else []


class _AddToken:
    """Adds the token to each call's metadata (one class for all four call kinds)."""

    def __init__(self, token: str) -> None:
        self._pair = (METADATA_KEY, token)

    def _details(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        metadata = grpc.aio.Metadata(*(details.metadata or ()), self._pair)
        return grpc.aio.ClientCallDetails(
            details.method, details.timeout, metadata, details.credentials,
            details.wait_for_ready,
        )  # fmt: skip

    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(self._details(details), request)

    async def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(self._details(details), request)

    async def intercept_stream_unary(self, continuation: Any, details: Any, requests: Any) -> Any:
        return await continuation(self._details(details), requests)

    async def intercept_stream_stream(self, continuation: Any, details: Any, requests: Any) -> Any:
        return await continuation(self._details(details), requests)


class _UU(_AddToken, grpc.aio.UnaryUnaryClientInterceptor):
    pass


class _US(_AddToken, grpc.aio.UnaryStreamClientInterceptor):
    pass


class _SU(_AddToken, grpc.aio.StreamUnaryClientInterceptor):
    pass


class _SS(_AddToken, grpc.aio.StreamStreamClientInterceptor):
    pass


def client_interceptors(token: str) -> list[grpc.aio.ClientInterceptor]:
    """For ``grpc.aio.insecure_channel(..., interceptors=...)``: the token on every call."""
    if not token:
        return []
    return [_UU(token), _US(token), _SU(token), _SS(token)]
