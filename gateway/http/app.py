"""The Starlette application, built from a frozen GatewayConfig."""

from __future__ import annotations

import contextlib
import hmac
import logging
from collections.abc import AsyncIterator

from opentelemetry.metrics import MeterProvider
from opentelemetry.sdk.trace import TracerProvider
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.core.config import CORS_EXPOSE_HEADERS, GatewayConfig
from gateway.core.errors import APIError
from gateway.flows.tokenizer import GatewayTokenizer
from gateway.flows.unsupported import not_found_message, unsupported_endpoint
from gateway.http import admin_api, embeddings_api, lora_api, openai_api, responses_api
from gateway.http.state import GatewayState, gateway_state

log = logging.getLogger(__name__)
OPEN_PATHS = frozenset({"/health", "/metrics", "/version", "/openapi.json"})


class ApiKeyMiddleware:
    """Requires ``Authorization: Bearer KEY`` everywhere but health, metrics, version, spec
    (with or without a trailing slash, which the router redirects) and ``OPTIONS`` requests
    (as vLLM: they run nothing, and a preflight carries no key)."""

    def __init__(self, app: ASGIApp, api_key: str | None) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode() if api_key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            self.expected is None
            or scope["type"] != "http"
            or scope["method"] == "OPTIONS"
            or (scope["path"].rstrip("/") or "/") in OPEN_PATHS
        ):
            await self.app(scope, receive, send)
            return
        given = dict(scope["headers"]).get(b"authorization", b"")
        if hmac.compare_digest(given, self.expected):
            await self.app(scope, receive, send)
            return
        error = APIError(401, "missing or wrong API key: send 'Authorization: Bearer KEY'",
                         code="invalid_api_key")  # fmt: skip
        await error.response()(scope, receive, send)


def _state(request: Request) -> GatewayState:
    return gateway_state(request)


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    _state(request).metrics.observe_error(exc.status)
    return exc.response()


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    # Starlette's own errors (405 with its Allow header, 404): OpenAI-shaped, headers kept. An
    # endpoint this server does not serve is a 404 that says so, also where a route with a path
    # parameter matched it (/v1/responses/input_tokens as /v1/responses/{response_id}): a 405
    # would say it is served under another method
    path = request.url.path
    if exc.status_code == 404 or unsupported_endpoint(path):
        message = not_found_message(request.method, path)
        headers = exc.headers if exc.status_code == 404 else None
        return APIError(404, message, code="not_found", headers=headers).response()
    error = APIError(exc.status_code, str(exc.detail), code="http_error", headers=exc.headers)
    return error.response()


async def _client_gone(request: Request, exc: Exception) -> Response:
    return Response(status_code=499)


async def _bug(request: Request, exc: Exception) -> Response:
    log.error("unhandled error on %s", request.url.path, exc_info=exc)
    _state(request).metrics.observe_error(500)
    return APIError(500, f"internal error ({type(exc).__name__}); see the gateway log").response()


async def _stored_response(request: Request) -> Response:
    if request.method == "DELETE":
        return await responses_api.delete_response(request)
    return await responses_api.get_response(request)


def build_app(
    config: GatewayConfig,
    *,
    tracer_provider: TracerProvider | None = None,
    tokenizer: GatewayTokenizer | None = None,
    meter_provider: MeterProvider | None = None,
) -> Starlette:
    state = GatewayState(config, tokenizer, tracer_provider, meter_provider)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await state.start()
        try:
            yield
        finally:
            await state.close()

    routes = [
        Route("/v1/completions", openai_api.completions, methods=["POST"]),
        Route("/v1/chat/completions", openai_api.chat_completions, methods=["POST"]),
        Route("/v1/embeddings", embeddings_api.embeddings, methods=["POST"]),
        Route("/v1/responses", responses_api.create_response, methods=["POST"]),
        # one route for both methods, so that a 405 there lists both in its Allow header
        Route("/v1/responses/{response_id}", _stored_response, methods=["GET", "DELETE"]),
        Route(
            "/v1/responses/{response_id}/cancel", responses_api.cancel_response, methods=["POST"]
        ),
        Route(
            "/v1/responses/{response_id}/input_items", responses_api.input_items, methods=["GET"]
        ),
        Route("/v1/models", admin_api.models, methods=["GET"]),
        Route("/v1/load_lora_adapter", lora_api.load_lora_adapter, methods=["POST"]),
        Route("/v1/unload_lora_adapter", lora_api.unload_lora_adapter, methods=["POST"]),
        Route("/v1/models/{model:path}", admin_api.model, methods=["GET"]),
        Route("/health", admin_api.health, methods=["GET"]),
        Route("/metrics", admin_api.metrics, methods=["GET"]),
        Route("/tokenize", admin_api.tokenize, methods=["POST"]),
        Route("/detokenize", admin_api.detokenize, methods=["POST"]),
        Route("/version", admin_api.version_info, methods=["GET"]),
        Route("/workers", admin_api.workers, methods=["GET"]),
        Route("/openapi.json", admin_api.openapi, methods=["GET"]),
    ]
    cors = Middleware(
        CORSMiddleware,
        allow_origins=config.allowed_origins,
        allow_methods=config.allowed_methods,
        allow_headers=config.allowed_headers,
        allow_credentials=config.allow_credentials,
        expose_headers=CORS_EXPOSE_HEADERS,
    )
    app = Starlette(
        routes=routes,
        # CORS outside the key check: a browser's preflight (OPTIONS with Origin and
        # Access-Control-Request-Method) never carries the key and is answered here; the request
        # that follows needs it, and its 401 carries the CORS headers the browser needs to read it
        middleware=[cors, Middleware(ApiKeyMiddleware, api_key=config.api_key)],
        exception_handlers={
            APIError: _api_error,
            HTTPException: _http_error,
            ClientDisconnect: _client_gone,
            Exception: _bug,
        },
        lifespan=lifespan,
    )
    app.state.gateway = state
    return app
