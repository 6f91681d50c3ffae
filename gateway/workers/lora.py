"""Runtime LoRA updates (vLLM's ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``):
one update sent to every healthy generating worker, so that any of them can serve the adapter
(prefill and decode workers alike: both run a request under its adapter).

A worker started without ``--allow-runtime-lora-updating`` refuses (FAILED_PRECONDITION, a
400 here). The gateway's view of each worker's adapters is updated from the answers at once,
not at the next load poll, so a request right after a load finds its adapter.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

import grpc

from gateway.core.errors import APIError, unavailable
from gateway.workers.client import WorkerClient
from gateway.workers.convert import load_lora_to_pb, unload_lora_to_pb
from gateway.workers.registry import WorkerRegistry
from gateway.workers.rpc_errors import from_rpc_error


def _targets(registry: WorkerRegistry) -> list[WorkerClient]:
    workers = [c for c in registry.clients if c.healthy and c.task == "generate"]
    if not workers:
        raise unavailable("no healthy worker to update")
    return workers


async def _update(
    registry: WorkerRegistry, call: str, request: object, timeout_s: float
) -> list[str]:
    """``call`` on every target worker; the adapters the last one serves after it."""

    async def one(client: WorkerClient) -> list[str]:
        try:
            reply = await getattr(client.stub, call)(request, timeout=timeout_s)
        except grpc.RpcError as err:
            if err.code() == grpc.StatusCode.FAILED_PRECONDITION:  # type: ignore[attr-defined]
                raise APIError(400, err.details() or "runtime LoRA updates are off",  # type: ignore[attr-defined]
                               code="lora_updates_off") from None  # fmt: skip
            raise from_rpc_error(err, client.address, call).api_error from None
        names = list(reply.lora_names)
        if client.load is not None:
            client.load = replace(client.load, lora_names=tuple(names))
        return names

    results = await asyncio.gather(*(one(c) for c in _targets(registry)), return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return list(results[-1])  # type: ignore[arg-type]


async def load_adapter(
    registry: WorkerRegistry, name: str, path: str, timeout_s: float
) -> list[str]:
    return await _update(registry, "LoadLoRA", load_lora_to_pb(name, path), timeout_s)


async def unload_adapter(registry: WorkerRegistry, name: str, timeout_s: float) -> list[str]:
    return await _update(registry, "UnloadLoRA", unload_lora_to_pb(name), timeout_s)
