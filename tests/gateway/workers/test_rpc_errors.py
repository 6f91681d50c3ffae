"""A worker's gRPC failure as the client sees it: the worker by name (as /health and /metrics
show it), never its address or the transport's details; those go to the gateway's log."""

from __future__ import annotations

import grpc
import pytest

from gateway.workers.multiplex import rpc_error
from gateway.workers.rpc_errors import (
    LostWorkerError,
    from_rpc_error,
    stream_ended,
    worker_failed,
)

ADDRESS = "10.1.2.3:40867"
TRANSPORT = (
    "failed to connect to all addresses; last error: UNAVAILABLE: ipv4:10.1.2.3:40867: "
    "Stream removed (recvmsg: Connection reset by peer)"
)


@pytest.mark.parametrize(
    ("code", "status", "kind"),
    [
        (grpc.StatusCode.UNAVAILABLE, 503, "worker_unavailable"),
        (grpc.StatusCode.CANCELLED, 503, "cancelled"),
        (grpc.StatusCode.DEADLINE_EXCEEDED, 504, "deadline_exceeded"),
    ],
)
def test_a_transport_failure_names_the_worker_not_its_address(
    code: grpc.StatusCode, status: int, kind: str
) -> None:
    failure = from_rpc_error(rpc_error(code, TRANSPORT), "decode-1", ADDRESS, "Decode")
    api = failure.api_error
    assert (api.status, api.code) == (status, kind)
    assert "Decode on worker decode-1" in api.message
    assert "10.1.2.3" not in api.message and "recvmsg" not in api.message, api.message
    # the operator's line keeps all of it, and routing still has the address
    assert ADDRESS in failure.detail and "recvmsg" in failure.detail and code.name in failure.detail
    assert failure.address == ADDRESS


def test_what_the_worker_wrote_for_the_request_reaches_the_client() -> None:
    refused = from_rpc_error(
        rpc_error(grpc.StatusCode.INVALID_ARGUMENT, "max_tokens must be at least 1"),
        "prefill-0", ADDRESS, "Prefill",
    )  # fmt: skip
    assert (refused.api_error.status, refused.api_error.message) == (
        400, "max_tokens must be at least 1")  # fmt: skip
    full = from_rpc_error(
        rpc_error(grpc.StatusCode.RESOURCE_EXHAUSTED, "no free KV blocks for 900 tokens"),
        "decode-0", ADDRESS, "Reserve",
    )  # fmt: skip
    assert full.api_error.status == 503 and "no free KV blocks" in full.api_error.message
    assert ADDRESS not in full.api_error.message


def test_a_stream_that_ends_or_fails_names_the_worker() -> None:
    for failure in (
        stream_ended("decode-1", ADDRESS, "Decode"),
        worker_failed("decode-1", ADDRESS, "engine step failed"),
    ):
        assert "decode-1" in failure.api_error.message
        assert ADDRESS not in failure.api_error.message
        assert failure.address == ADDRESS and ADDRESS in failure.detail
        assert failure.retryable


def test_a_worker_the_gateway_gave_up_says_why() -> None:
    """The gateway's own verdict (its polls saw the worker gone) names no address: the client
    learns why its request ended."""
    why = "worker decode-1 (decode) is gone: its engine has been in one step for 121 s"
    failure = from_rpc_error(LostWorkerError(why), "decode-1", ADDRESS, "Decode")
    assert failure.api_error.status == 503 and failure.api_error.code == "worker_unavailable"
    assert failure.api_error.message == f"Decode on worker decode-1: {why}"
    assert failure.worker_down and failure.retryable
