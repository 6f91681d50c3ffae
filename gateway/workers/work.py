"""What every request flow needs: the unit of work, its deadline, and failure bookkeeping."""

from __future__ import annotations

import time
from dataclasses import dataclass

import grpc
from opentelemetry.trace import Tracer

from gateway.core.config import GatewayConfig
from gateway.core.errors import APIError
from gateway.workers.client import WorkerClient
from gateway.workers.multiplex import RequestRpcError
from gateway.workers.registry import WorkerRegistry
from gateway.workers.rpc_errors import UpstreamError, from_rpc_error
from protos.multimodal import ImageItem
from protos.sampling_params import SamplingParams


@dataclass(frozen=True)
class WorkItem:
    """One sequence to generate (one choice of one prompt)."""

    request_id: str
    prompt_ids: tuple[int, ...]
    sampling: SamplingParams
    priority: int = 0
    deadline: float = float("inf")  # time.monotonic() by which it must be done
    images: tuple[ImageItem, ...] = ()  # a vision-language prompt's, placeholders expanded


@dataclass(frozen=True)
class FlowContext:
    registry: WorkerRegistry
    tracer: Tracer
    config: GatewayConfig

    def time_left(self, item: WorkItem) -> float:
        left = item.deadline - time.monotonic()
        if left <= 0:
            api = APIError(504, "the request ran past --request-timeout", code="deadline_exceeded")
            raise UpstreamError(api, retryable=False)
        return left

    def abort_later(self, worker: WorkerClient, request_id: str) -> None:
        self.registry.abort_later(worker, request_id, self.config.rpc_timeout_s)


def rpc_failure(worker: WorkerClient, err: grpc.RpcError, call: str) -> UpstreamError:
    """Converts a failed call. A worker that cannot be reached (UNAVAILABLE) is marked unhealthy
    at once. INTERNAL or UNKNOWN may be one request's (an exception in the worker's handler) or
    the worker's: it stays in rotation and is health-polled now. A failure the worker reported
    for the one request over a live stream (:class:`RequestRpcError`) is that request's."""
    failure = from_rpc_error(err, worker.name, worker.address, call)
    if not failure.worker_down or isinstance(err, RequestRpcError):
        return failure
    reason = f"{call} failed: {failure.api_error.message}"
    if failure.status == grpc.StatusCode.UNAVAILABLE.name:
        # once unhealthy, its reason stays the poll's (or the first failure's): each request
        # failing on a lost worker quotes that reason, and quoting back into it would nest
        # every earlier request's message in the next (quadratic in the requests in flight)
        if worker.healthy:
            worker.mark_unhealthy(reason)
    else:
        worker.check_now(reason)
    return failure
