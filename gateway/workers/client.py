"""One gRPC client per worker: its channel, stubs, health and last reported load."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable
from dataclasses import asdict, replace
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.core.config import WORKER_STALL_TIMEOUT_S, WorkerSpec
from gateway.core.events import WorkerLoadInfo
from gateway.workers.convert import load_from_pb, load_lora_to_pb
from gateway.workers.multiplex import StreamMux
from gateway.workers.rpc_errors import LostWorkerError, status_code, summary
from protos import (
    common_pb2,
    decode_pb2,
    decode_pb2_grpc,
    prefill_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)
from protos.auth import client_interceptors
from protos.roles import Role

log = logging.getLogger(__name__)
T = TypeVar("T")

# aborts a worker missed (it did not answer), sent again once it answers: at most this many
# held, each sent at most this many times in all
MAX_OWED_ABORTS = 4096
ABORT_TRIES = 3
# an abort that failed with one of these may not have reached the worker
_OWED_CODES = {grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE}

# Keepalive only while calls are open, and no more often than servers allow by default, so a
# quiet stream never trips "too_many_pings". Prompts travel as ids, logprobs as small chunks.
CHANNEL_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 0),
    ("grpc.max_receive_message_length", 32 * 1024 * 1024),
    ("grpc.max_send_message_length", 32 * 1024 * 1024),
]

_STUBS = {
    Role.COLOCATED: worker_pb2_grpc.WorkerServiceStub,
    "prefill": prefill_pb2_grpc.PrefillServiceStub,
    "decode": decode_pb2_grpc.DecodeServiceStub,
}
# the multiplexed stream of each role that streams many tokens: (stub method, item, field)
_MUX = {
    Role.COLOCATED: ("GenerateStream", worker_pb2.GenerateStreamItem, "generate"),
    "decode": ("DecodeStream", decode_pb2.DecodeStreamItem, "decode"),
}


class WorkerClient:
    def __init__(
        self, spec: WorkerSpec, internal_token: str = "", owner: str = "",
        poll_timeout_s: float = 1.0, stall_timeout_s: float = WORKER_STALL_TIMEOUT_S,
    ) -> None:  # fmt: skip
        self.spec = spec
        self.poll_timeout_s = poll_timeout_s  # of a health poll, the registry's or check_now's
        # polls unanswered this long: the worker is lost (frozen, hung), not just unhealthy
        self.stall_timeout_s = stall_timeout_s
        self.name = spec.address  # the registry names it by role and index
        self.owner = owner  # this gateway's instance id: each poll renews its leases there
        self.channel = grpc.aio.insecure_channel(
            spec.address, options=CHANNEL_OPTIONS, interceptors=client_interceptors(internal_token)
        )
        self.stub: Any = _STUBS[spec.role](self.channel)
        self._health = health_pb2_grpc.HealthStub(self.channel)
        self.healthy = False
        # set when the worker stops answering (dead, restarting): whatever it held for us is
        # gone, so requests waiting on it (a KV transfer into it) fail now, not at a timeout.
        # A fresh event once it is healthy again.
        self._lost = asyncio.Event()
        self._late_poll = False  # the last poll timed out (two in a row mark it unhealthy)
        self._silent_since: float | None = None  # when the polls now unanswered began
        # request id -> (timeout, tries so far): aborts that may not have reached it, sent again
        # once it answers (a frozen worker that comes back still holds what they were to free)
        self._owed_aborts: dict[str, tuple[float, int]] = {}
        self._resend: asyncio.Task[None] | None = None
        self._check: asyncio.Task[None] | None = None  # check_now's poll, while it runs
        self.load: WorkerLoadInfo | None = None
        # the adapters (name -> directory) the worker's last run served, when it answers as a
        # new run (started again on its address): loaded into it again (restore_adapters)
        self._owed_adapters: dict[str, str] = {}
        self.last_error = "not checked yet"
        self._judged = False  # a verdict on it was logged (one that never served gets one too)
        self.inflight = 0  # requests this gateway has open on the worker
        self.mux: StreamMux | None = None  # colocated and decode workers: tokens of many requests
        if spec.role in _MUX:
            method, item, kind = _MUX[spec.role]
            self.mux = StreamMux(getattr(self.stub, method), item, kind, spec.address)

    @property
    def role(self) -> str:
        return self.spec.role

    @property
    def address(self) -> str:
        return self.spec.address

    @property
    def task(self) -> str:
        """What the worker serves: generate or embed (a prefill or decode worker: generate)."""
        return (self.load.task if self.load else "") or "generate"

    @property
    def scheduling_policy(self) -> str:
        """fcfs or priority, as of its last load report ("": not reported)."""
        return self.load.scheduling_policy if self.load else ""

    @property
    def lora_names(self) -> frozenset[str]:
        """The LoRA adapters the worker serves (--enable-lora), as of its last load report."""
        return frozenset(self.load.lora_names) if self.load else frozenset()

    def serves(self, lora: str) -> bool:
        return not lora or lora in self.lora_names

    @property
    def reported_depth(self) -> int:
        """Requests running or waiting on the worker as of its last load report (every
        gateway's; a reservation not yet decoding is not one)."""
        return self.load.num_running + self.load.num_waiting if self.load else 0

    @property
    def queue_depth(self) -> int:
        return max(self.inflight, self.reported_depth)

    @property
    def free_blocks(self) -> int:
        return self.load.free_blocks if self.load else 0

    @property
    def block_size(self) -> int:
        return self.load.block_size if self.load and self.load.block_size > 0 else 16

    async def poll(self, timeout: float) -> None:
        """Health check and load; a failure marks the worker unhealthy until the next poll (one
        late answer of a healthy worker is forgiven: two in a row are not). Unreachable, or no
        answer for ``stall_timeout_s``: lost."""
        started = time.monotonic()
        try:
            check = await self._health.Check(health_pb2.HealthCheckRequest(), timeout=timeout)
            request = common_pb2.LoadRequest(owner=self.owner)
            load = load_from_pb(await self.stub.GetLoad(request, timeout=timeout))
        except grpc.RpcError as e:
            code = e.code() if hasattr(e, "code") else None
            if self._silent_since is None:
                self._silent_since = started
            silent = time.monotonic() - self._silent_since
            stalled = silent >= self.stall_timeout_s
            late = code == grpc.StatusCode.DEADLINE_EXCEEDED
            if late and self.healthy and not self._late_poll and not stalled:
                self._late_poll = True  # one late answer from a busy host is not yet a verdict
                return
            reason = f"health poll failed: {getattr(code, 'name', 'ERROR')}"
            if code == grpc.StatusCode.UNIMPLEMENTED:
                reason += f" (is it really a {self.role} worker?)"
            elif code == grpc.StatusCode.UNAUTHENTICATED:
                reason += " (the worker has another internal token: --internal-token or "
                reason += "TANDEM_INTERNAL_TOKEN must be the same on the gateway and the workers)"
            if stalled and code != grpc.StatusCode.UNAVAILABLE:
                reason = (f"no answer to health polls for {silent:.1f} s "
                          f"(--worker-stall-timeout {self.stall_timeout_s:g}); {reason}")  # fmt: skip
            # unreachable (refused, reset): gone. A slow answer (DEADLINE_EXCEEDED) is only
            # unhealthy, as a busy worker still holds what it holds, until the polls have gone
            # unanswered for stall_timeout_s: a frozen or hung worker's requests would otherwise
            # wait for the connection's keepalive to fail them, some 40 s after its last bytes
            self.mark_unhealthy(reason, lost=code == grpc.StatusCode.UNAVAILABLE or stalled)
            return
        self._late_poll = False
        self._silent_since = None
        self._note_restart(self.load, load)
        self.load = load
        if self._owed_aborts and (self._resend is None or self._resend.done()):
            self._resend = asyncio.get_running_loop().create_task(self._resend_aborts())
        if check.status != health_pb2.HealthCheckResponse.SERVING:
            why = "not serving (loading or draining)"
            if load.engine_stalled_s > 0:  # its requests would wait for a step that may not end
                why = (f"its engine has been in one step for {load.engine_stalled_s:.0f} s "
                       "(the worker's --engine-stall-timeout)")  # fmt: skip
            self.mark_unhealthy(why, lost=not load.draining)
        elif load.draining:
            self.mark_unhealthy("draining")
        else:
            if not self.healthy:
                log.info("worker %s (%s) is healthy", self.address, self.role)
            if self._lost.is_set():
                self._lost = asyncio.Event()
            self.healthy = True
            self.last_error = ""

    def _note_restart(self, before: WorkerLoadInfo | None, now: WorkerLoadInfo) -> None:
        """A worker that answers as another run than before (``instance``) has only the adapters
        it was started with: those its last run served are owed to it, from the directories it
        reported for them."""
        if before is None or not before.instance or before.instance == now.instance:
            return
        pairs = zip(before.lora_names, before.lora_paths, strict=False)
        self._owed_adapters.update((name, path) for name, path in pairs if path)

    def take_owed_adapters(self) -> dict[str, str]:
        """The adapters owed to the worker that it does not serve yet, once it is healthy
        (each handed out once); {} otherwise."""
        if not self.healthy or self.load is None or not self._owed_adapters:
            return {}
        owed = {n: p for n, p in self._owed_adapters.items() if n not in self.load.lora_names}
        self._owed_adapters.clear()
        return owed

    async def restore_adapters(self, owed: dict[str, str], timeout_s: float) -> None:
        """Load ``owed`` adapters into the worker, started again since its last run loaded
        them at run time. A failure is logged: the adapter then stays off this worker until it
        is unloaded and loaded again."""
        load = self.load
        if load is not None and not load.lora_runtime_updating:
            log.warning("worker %s (%s) started again without --allow-runtime-lora-updating: "
                        "the LoRA adapters its last run had loaded at run time (%s) are not "
                        "loaded again", self.address, self.role, ", ".join(sorted(owed)))  # fmt: skip
            return
        for name, path in owed.items():
            try:
                reply = await self.stub.LoadLoRA(load_lora_to_pb(name, path), timeout=timeout_s)
            except grpc.RpcError as e:
                log.warning("LoRA adapter %r: loading it again into worker %s (%s), started "
                            "again, failed: %s; unload it and load it again to serve it there",
                            name, self.address, self.role, summary(e))  # fmt: skip
                continue
            if self.load is not None:
                self.load = replace(self.load, lora_names=tuple(reply.lora_names),
                                    lora_paths=tuple(reply.lora_paths))  # fmt: skip
            log.info("LoRA adapter %r loaded again into worker %s (%s), started again", name,
                     self.address, self.role)  # fmt: skip

    def mark_unhealthy(self, reason: str, lost: bool = False) -> None:
        """``lost``: it does not answer at all (a draining worker still finishes its work)."""
        if self.healthy or not self._judged:  # a worker that never served is said once too
            log.warning("worker %s (%s) is unhealthy: %s", self.address, self.role, reason)
            self._judged = True
        self.healthy = False
        self.last_error = reason
        if lost and not self._lost.is_set():
            self._lost.set()
            if self.mux is not None:  # its requests end now, as when the stream breaks
                self.mux.fail(f"worker {self.name} ({self.role}) is gone: {reason}")

    def check_now(self, reason: str) -> None:
        """A failed call that may be the request's or the worker's (INTERNAL or UNKNOWN: an
        exception in the worker's handler for that one request, or a broken connection): a
        health poll now tells them apart. The worker stays in rotation until it answers; one
        poll at a time."""
        if self._check is not None and not self._check.done():
            return
        log.info("checking worker %s (%s) now: %s", self.address, self.role, reason)
        self._check = asyncio.get_running_loop().create_task(self.poll(self.poll_timeout_s))

    async def until_lost(self) -> None:
        """Returns once the worker is seen gone (now, if it already is)."""
        await self._lost.wait()

    async def unless_lost(self, step: Awaitable[T]) -> T:
        """``step`` (a call to this worker, or a read of one), failed with UNAVAILABLE as soon
        as the worker is seen gone: a frozen worker answers nothing, and the connection's
        keepalive would take some 40 s to fail the call. A gRPC call given is cancelled."""
        work = asyncio.ensure_future(step)
        gone = asyncio.ensure_future(self._lost.wait())
        finished = False
        try:
            await asyncio.wait((work, gone), return_when=asyncio.FIRST_COMPLETED)
            finished = work.done()
        finally:
            gone.cancel()
            if not work.done():
                work.cancel()
                cancel = getattr(step, "cancel", None)  # a call, not a coroutine reading one
                if callable(cancel):
                    cancel()
        if finished:
            return work.result()  # its value, or its own error
        raise LostWorkerError(f"worker {self.name} ({self.role}) is gone: {self.last_error}")

    async def abort(self, request_id: str, timeout: float, tries: int = 1) -> bool:
        """Tells the worker to drop ``request_id``; True when it held the request. One that
        may not have reached it (no answer) is sent again once the worker answers a poll
        (``tries``: this is the how-manieth time, up to ``ABORT_TRIES``)."""
        try:
            reply = await self.stub.Abort(
                common_pb2.AbortRequest(request_id=request_id), timeout=timeout
            )
        except grpc.RpcError as e:
            owed = status_code(e) in _OWED_CODES and tries < ABORT_TRIES
            # a dead worker misses the aborts of all it ran: the first is logged, the others
            # are counted in the line that sends them again (_resend_aborts)
            first = not self._owed_aborts
            if owed:
                self._owed_aborts[request_id] = (timeout, tries)
                while len(self._owed_aborts) > MAX_OWED_ABORTS:  # the oldest go
                    del self._owed_aborts[next(iter(self._owed_aborts))]
            log.log(logging.INFO if first or not owed else logging.DEBUG,
                    "abort of %s on %s failed (%s)%s", request_id, self.address, summary(e),
                    "; sent again once it answers" if owed else "")  # fmt: skip
            return False
        return bool(reply.found)

    async def _resend_aborts(self) -> None:
        """The aborts it missed, now that it answers."""
        owed, self._owed_aborts = self._owed_aborts, {}
        log.info("worker %s (%s) answers again: sending the %d aborts it missed",
                 self.address, self.role, len(owed))  # fmt: skip
        await asyncio.gather(
            *(self.abort(rid, timeout, tries + 1) for rid, (timeout, tries) in owed.items())
        )

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "role": self.role,
            "address": self.address,
            "healthy": self.healthy,
            "last_error": self.last_error or None,
            "inflight": self.inflight,
            "load": asdict(self.load) if self.load else None,
        }

    def stream(self) -> StreamMux:
        if self.mux is None:
            raise TypeError(f"a {self.role} worker has no multiplexed token stream")
        return self.mux

    async def close(self) -> None:
        for task in (self._check, self._resend):
            if task is not None:
                task.cancel()
        if self.mux is not None:
            await self.mux.close()
        await self.channel.close(grace=None)
