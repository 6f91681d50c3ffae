"""The OpenAI error model: one exception type that knows its HTTP status and JSON body."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from starlette.responses import JSONResponse

_TYPES = {
    401: "authentication_error",
    499: "client_closed_request",
    503: "service_unavailable_error",
    504: "timeout_error",
}


def error_type(status: int) -> str:
    """OpenAI's ``type`` for a status: a few have their own, any other 4xx is the client's
    (``invalid_request_error``), anything else the server's (``server_error``)."""
    if status in _TYPES:
        return _TYPES[status]
    return "invalid_request_error" if 400 <= status < 500 else "server_error"


class APIError(Exception):
    """An error the client sees as ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or error_type(status)
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers or None)


def invalid(message: str, param: str | None = None, code: str | None = None) -> APIError:
    """A 400: the request is wrong and the message says how to fix it."""
    return APIError(400, message, param=param, code=code)


def unavailable(message: str, code: str = "no_healthy_worker") -> APIError:
    return APIError(503, message, code=code)
