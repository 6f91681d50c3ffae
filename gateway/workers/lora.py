"""Runtime LoRA updates (vLLM's ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``):
one update sent to every healthy generating worker, so that any of them can serve the adapter
(prefill and decode workers alike: both run a request under its adapter).

A load is all or nothing: if any worker fails it (a bad adapter, a worker gone, no answer in
time), it is unloaded again from every worker that loaded it (and from those whose outcome is
unknown: a timed-out load may still land, and the worker runs the unload after it), and the
client gets the failing workers and their causes. Otherwise a prefill worker could serve an
adapter no decode worker has: listed in /v1/models, yet every request under it a 503.

A worker started without ``--allow-runtime-lora-updating`` refuses (FAILED_PRECONDITION, a
400 here). The gateway's view of each worker's adapters is updated from the answers at once,
not at the next load poll, so a request right after a load finds its adapter; a load that
fails never enters that view.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, replace

import grpc

from gateway.core.errors import APIError, unavailable
from gateway.workers.client import WorkerClient
from gateway.workers.convert import load_lora_to_pb, unload_lora_to_pb
from gateway.workers.registry import WorkerRegistry
from gateway.workers.rpc_errors import from_rpc_error

log = logging.getLogger(__name__)

# failures after which the worker surely did not apply the update (it answered a refusal)
_REFUSED = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.ALREADY_EXISTS,
}


@dataclass(frozen=True)
class _Outcome:
    """One worker's answer to an update: the adapters it serves after it, or why it failed."""

    client: WorkerClient
    names: tuple[str, ...] = ()
    paths: tuple[str, ...] = ()  # names[i]'s directory on the worker
    error: APIError | None = None
    status: grpc.StatusCode | None = None  # the failure's gRPC code

    @property
    def maybe_applied(self) -> bool:
        """Applied, or failed without an answer that says it was not (timeout, crash)."""
        return self.error is None or self.status not in _REFUSED

    def where(self) -> str:
        return f"{self.client.role} worker {self.client.address}"


def _targets(registry: WorkerRegistry) -> list[WorkerClient]:
    workers = [c for c in registry.clients if c.healthy and c.task == "generate"]
    if not workers:
        raise unavailable("no healthy worker to update")
    return workers


async def _call(client: WorkerClient, call: str, request: object, timeout_s: float) -> _Outcome:
    try:
        reply = await getattr(client.stub, call)(request, timeout=timeout_s)
    except grpc.RpcError as err:
        code = err.code()  # type: ignore[attr-defined]
        if code == grpc.StatusCode.FAILED_PRECONDITION:
            api = APIError(400, err.details() or "runtime LoRA updates are off",  # type: ignore[attr-defined]
                           code="lora_updates_off")  # fmt: skip
        else:
            api = from_rpc_error(err, client.name, client.address, call).api_error
        return _Outcome(client, error=api, status=code)
    return _Outcome(client, names=tuple(reply.lora_names), paths=tuple(reply.lora_paths))


def _note(outcome: _Outcome) -> None:
    """The gateway's view of the worker's adapters, from its answer."""
    client = outcome.client
    if client.load is not None:
        client.load = replace(client.load, lora_names=outcome.names, lora_paths=outcome.paths)


async def load_adapter(
    registry: WorkerRegistry, name: str, path: str, timeout_s: float
) -> list[str]:
    """Load on every target worker, or on none (APIError naming the failing workers)."""
    request = load_lora_to_pb(name, path)
    outcomes = await asyncio.gather(*(_call(c, "LoadLoRA", request, timeout_s)
                                      for c in _targets(registry)))  # fmt: skip
    failed = [o for o in outcomes if o.error is not None]
    if not failed:
        for o in outcomes:
            _note(o)
        return list(outcomes[-1].names)
    undo = [o for o in outcomes if o.maybe_applied]
    left = await asyncio.gather(*(_roll_back(o, name, timeout_s) for o in undo))
    raise _load_failed(name, failed, [o for o in undo if o.error is None],
                       [o for o in left if o is not None])  # fmt: skip


async def _roll_back(loaded: _Outcome, name: str, timeout_s: float) -> _Outcome | None:
    """Unload from a worker that loaded (or may have loaded) the adapter; the unload's failure
    where the worker surely still holds it, else None."""
    undone = await _call(loaded.client, "UnloadLoRA", unload_lora_to_pb(name), timeout_s)
    if undone.error is None:
        _note(undone)
        return None
    if loaded.error is not None or undone.status == grpc.StatusCode.NOT_FOUND:
        log.warning("LoRA adapter %r: unloading it from %s after a failed load: %s", name,
                    loaded.where(), undone.error.message)  # fmt: skip
        return None
    return undone


def _load_failed(
    name: str, failed: list[_Outcome], loaded: list[_Outcome], left: list[_Outcome]
) -> APIError:
    """A bad adapter (a 4xx on any worker) before a worker's trouble (503, 504, 502)."""
    bad = [o for o in failed if o.error is not None and 400 <= o.error.status < 500]
    first = (bad or failed)[0].error
    assert first is not None
    causes = "; ".join(f"{o.where()}: {o.error.message}" for o in failed if o.error)
    message = f"LoRA adapter {name!r} was not loaded: {causes}"
    undone = len(loaded) - len(left)
    if undone:
        message += (f". It was unloaded again from the {undone} worker(s) that had loaded it "
                    "(a load is all or nothing)")  # fmt: skip
    if left:
        where = ", ".join(f"{o.where()} ({o.error.message})" for o in left if o.error)
        message += (f". It could not be unloaded from {where}: unload it with POST "
                    "/v1/unload_lora_adapter")  # fmt: skip
    return APIError(first.status, message, param=first.param, code=first.code)


async def unload_adapter(registry: WorkerRegistry, name: str, timeout_s: float) -> list[str]:
    """Unload from every target worker, or from none. While this gateway has requests under the
    adapter (queued, in prefill or decoding) it refuses at once, as a worker does with requests
    of its own: a prefill worker with none queued would drop it while a decode worker refused,
    and the requests on their way to it would then fail. A worker that refuses (requests of
    another gateway) or fails: the adapter is loaded again where it was unloaded, from the
    directory that worker reported."""
    if registry.adapter_in_use(name):
        raise APIError(400, f"LoRA adapter {name!r} has requests in flight: unload it later",
                       param="lora_name")  # fmt: skip
    targets = _targets(registry)
    paths = {c: _path(c, name) for c in targets}
    outcomes = await asyncio.gather(*(_call(c, "UnloadLoRA", unload_lora_to_pb(name), timeout_s)
                                      for c in targets))  # fmt: skip
    for o in outcomes:
        if o.error is None:
            _note(o)
    failed = [o for o in outcomes if o.error is not None and o.status != grpc.StatusCode.NOT_FOUND]
    if not failed:
        missing = [o for o in outcomes if o.error is not None]
        if len(missing) == len(outcomes):  # nowhere loaded: vLLM's 404
            assert missing[0].error is not None
            raise missing[0].error
        return list(next(o for o in outcomes if o.error is None).names)
    unloaded = [o for o in outcomes if o.error is None]
    again = await asyncio.gather(*(_reload(o.client, name, paths[o.client], timeout_s)
                                   for o in unloaded))  # fmt: skip
    first = failed[0].error
    assert first is not None
    causes = "; ".join(f"{o.where()}: {o.error.message}" for o in failed if o.error)
    message = f"LoRA adapter {name!r} was not unloaded: {causes}"
    reloaded = [o for o in again if o.error is None]
    if reloaded:
        message += (f". It was loaded again on the {len(reloaded)} worker(s) that had "
                    "unloaded it (an unload is all or nothing)")  # fmt: skip
    left = [o for o in again if o.error is not None]
    if left:
        where = ", ".join(f"{o.where()} ({o.error.message})" for o in left if o.error)
        message += (f". It could not be loaded again on {where}: those workers no longer "
                    "serve it (unload it there too, or load it again, with POST "
                    "/v1/unload_lora_adapter or /v1/load_lora_adapter)")  # fmt: skip
    raise APIError(first.status, message, param=first.param, code=first.code)


async def _reload(client: WorkerClient, name: str, path: str, timeout_s: float) -> _Outcome:
    """Load ``name`` again on a worker that unloaded it while another refused, from the
    directory the worker reported for it (an error outcome where it reported none)."""
    if not path:
        log.warning("LoRA adapter %r: %s %s reported no directory for it: not loaded again",
                    name, client.role, client.address)  # fmt: skip
        return _Outcome(client, error=APIError(503, "it reported no directory for the adapter"))
    outcome = await _call(client, "LoadLoRA", load_lora_to_pb(name, path), timeout_s)
    if outcome.error is None:
        _note(outcome)
    else:
        log.warning("LoRA adapter %r: loading it again on %s after a refused unload: %s",
                    name, outcome.where(), outcome.error.message)  # fmt: skip
    return outcome


def _path(client: WorkerClient, name: str) -> str:
    """The directory of adapter ``name`` on ``client``, as it last reported ("" unknown)."""
    load = client.load
    if load is None:
        return ""
    paths = dict(zip(load.lora_names, load.lora_paths, strict=False))
    return paths.get(name, "")
