"""gRPC failures of workers, turned into the HTTP errors clients see."""

from __future__ import annotations

import grpc

from gateway.core.errors import APIError
from protos.errors import PARAM_METADATA_KEY

_RETRYABLE = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.ABORTED,
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.INTERNAL,
}
# Codes that may say the worker itself is gone or broken (work.rpc_failure marks it or checks it).
_WORKER_DOWN = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL}


class LostWorkerError(grpc.aio.AioRpcError):
    """UNAVAILABLE from the gateway itself: its health polls saw the worker gone (dead,
    frozen, its engine stuck in a step). The details are the gateway's own words (the worker's
    name and why it was given up), so the client gets them, unlike a transport's."""

    def __init__(self, details: str) -> None:
        super().__init__(
            grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), details
        )


class UpstreamError(Exception):
    """A worker call failed; ``api_error`` is what the client gets. Clients see a worker by its
    name (``decode-1``), as /health and /metrics show it; ``detail`` is the operator's line for
    the gateway log: the worker's address and the raw gRPC status and details."""

    def __init__(
        self, api_error: APIError, retryable: bool, worker_down: bool = False, address: str = "",
        status: str = "", detail: str = "",
    ) -> None:  # fmt: skip
        super().__init__(api_error.message)
        self.api_error = api_error
        self.retryable = retryable
        self.worker_down = worker_down
        self.address = address
        self.status = status  # the gRPC status code's name, when a call failed with one
        self.detail = detail or (f"{api_error.message} [{address}]" if address else "")


def status_code(err: grpc.RpcError) -> grpc.StatusCode:
    """The call's gRPC status code (UNKNOWN for an error that carries none)."""
    code = err.code() if hasattr(err, "code") else None
    return code if isinstance(code, grpc.StatusCode) else grpc.StatusCode.UNKNOWN


def _details(err: grpc.RpcError) -> str:
    details = err.details() if hasattr(err, "details") else None
    return str(details or "").strip()


def _param(err: grpc.RpcError) -> str | None:
    """The request field a worker's INVALID_ARGUMENT names (trailing metadata), if any."""
    try:
        metadata = err.trailing_metadata() if hasattr(err, "trailing_metadata") else None
    except Exception:  # a call's metadata is unreadable: the message still says it
        return None
    for key, value in metadata or ():
        if key == PARAM_METADATA_KEY and isinstance(value, str) and value:
            return value
    return None


def summary(err: grpc.RpcError) -> str:
    """``CODE: details`` on one line, for a log (an ``AioRpcError``'s own text spans lines)."""
    details = " ".join(_details(err).split())
    return f"{status_code(err).name}: {details}" if details else status_code(err).name


def from_rpc_error(err: grpc.RpcError, name: str, address: str, call: str) -> UpstreamError:
    """``name``: the worker's as clients see it; ``address``: for the log and for routing. The
    details of a transport failure (UNAVAILABLE, a cancelled call) stay in the log: they name
    addresses and sockets; those a worker wrote for the request (a refusal, an exception in its
    handler) reach the client."""
    code = status_code(err)
    details = _details(err)
    where = f"{call} on worker {name}"
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        api = APIError(
            400, details or f"{where} rejected the request", param=_param(err),
            code="invalid_argument",
        )  # fmt: skip
    elif code == grpc.StatusCode.NOT_FOUND and call == "Decode":
        # a Decode call names only the reservation this gateway made: the worker let go of it
        # (its lease ran out while the gateway did not renew it, or the worker restarted)
        api = APIError(
            503, f"{where}: the decode worker no longer holds this request's KV reservation "
            f"({details or 'not found'}); send the request again", code="reservation_lost",
        )  # fmt: skip
    elif code == grpc.StatusCode.NOT_FOUND:
        api = APIError(404, details or f"{where}: not found", code="not_found")
    elif code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        api = APIError(503, f"no capacity: {where}: {details}", code="no_capacity")
    elif code == grpc.StatusCode.UNAVAILABLE and isinstance(err, LostWorkerError):
        api = APIError(503, f"{where}: {details}", code="worker_unavailable")
    elif code == grpc.StatusCode.UNAVAILABLE:
        api = APIError(
            503, f"{where} is unavailable (the worker is down or restarting)",
            code="worker_unavailable",
        )  # fmt: skip
    elif code == grpc.StatusCode.DEADLINE_EXCEEDED:
        api = APIError(504, f"{where} did not answer in time", code="deadline_exceeded")
    elif code == grpc.StatusCode.CANCELLED:
        api = APIError(503, f"{where} was cancelled by the worker", code="cancelled")
    else:
        api = APIError(502, f"{where} failed ({code.name}): {details}", code="worker_error")
    retryable = code in _RETRYABLE or api.code == "reservation_lost"  # on another decode worker
    return UpstreamError(
        api, retryable=retryable, worker_down=code in _WORKER_DOWN, address=address,
        status=code.name, detail=f"{call} on worker {name} ({address}): {summary(err)}",
    )  # fmt: skip


def worker_failed(name: str, address: str, message: str) -> UpstreamError:
    """A worker ended the request with an error chunk."""
    api = APIError(502, f"worker {name} failed the request: {message}", code="worker_error")
    return UpstreamError(api, retryable=True, address=address)


def stream_ended(name: str, address: str, call: str) -> UpstreamError:
    api = APIError(
        502, f"{call} on worker {name} ended before the request finished", code="worker_error"
    )
    return UpstreamError(api, retryable=True, address=address)
