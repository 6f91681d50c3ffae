"""The set of workers, polled in the background, and fire-and-forget tasks (aborts).

Workers come from the configuration (fixed) and from DNS names (``gateway.workers.discovery``), which are
resolved again every ``discover_interval_s``: new addresses become workers at once, vanished ones
stop receiving requests at once and are closed once their requests are done (or after a grace).
``clients`` is replaced, never mutated, so a reader's list stays consistent.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Coroutine, Iterable, Iterator
from typing import Any

from gateway.core.config import WORKER_STALL_TIMEOUT_S, DiscoverySpec, WorkerSpec
from gateway.workers.client import WorkerClient
from gateway.workers.discovery import Resolver, resolve_dns
from protos.roles import Role

log = logging.getLogger(__name__)

# a runtime LoRA load into a worker started again (as /v1/load_lora_adapter's)
ADAPTER_LOAD_TIMEOUT_S = 60.0


class WorkerRegistry:
    def __init__(
        self,
        specs: Iterable[WorkerSpec],
        interval_s: float = 1.0,
        timeout_s: float = 1.0,
        internal_token: str = "",
        owner: str = "",
        discover: Iterable[DiscoverySpec] = (),
        discover_interval_s: float = 5.0,
        resolver: Resolver = resolve_dns,
        retire_grace_s: float = 600.0,
        stall_timeout_s: float = WORKER_STALL_TIMEOUT_S,
    ) -> None:
        self.owner = owner  # this gateway's instance id (leases on the workers)
        self._token = internal_token
        self._names: dict[str, int] = {}  # next index per role: "decode-1", never reused
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.stall_timeout_s = stall_timeout_s  # polls unanswered this long: a worker is lost
        self.clients = [self._client(spec) for spec in specs]
        self.discover = tuple(discover)
        self.discover_interval_s = discover_interval_s
        self._resolver = resolver
        self._retire_grace_s = retire_grace_s  # longest a retired worker's requests may go on
        self._discovered: dict[WorkerSpec, WorkerClient] = {}
        self._resolved: dict[DiscoverySpec, list[str]] = {}  # each name's last good answer
        self._retired: set[WorkerClient] = set()  # left, closing once their requests end
        self._poller: asyncio.Task[None] | None = None
        self._discoverer: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[Any]] = set()
        self._adapter_requests: dict[str, int] = {}  # this gateway's requests under each adapter

    def _client(self, spec: WorkerSpec) -> WorkerClient:
        client = WorkerClient(spec, self._token, self.owner, self.timeout_s, self.stall_timeout_s)
        # "decode-1": a name for open endpoints (/metrics, /health), which show no addresses
        role = client.role
        index = self._names.get(role, 0)
        self._names[role] = index + 1
        client.name = f"{role}-{index}"
        return client

    async def start(self) -> None:
        """Resolves the discovered workers and polls once (so /health is right from the start),
        then polls every ``interval_s`` and resolves every ``discover_interval_s``."""
        if self.discover:
            await self.refresh()
            self._discoverer = asyncio.create_task(
                self._discover_forever(), name="tandem-worker-discovery"
            )
        await self.poll_all()
        self._poller = asyncio.create_task(self._poll_forever(), name="tandem-worker-poller")

    async def refresh(self) -> None:
        """Resolve every discovery name; add the workers that appeared, retire those that left.
        A name whose lookup fails keeps the workers it had."""
        wanted: dict[WorkerSpec, None] = {}
        for spec in self.discover:
            try:
                addresses = self._resolved[spec] = list(await self._resolver(spec.host, spec.port))
            except OSError as e:
                log.warning("worker discovery: %s did not resolve (%s); keeping its workers",
                            spec.host, e)  # fmt: skip
                addresses = self._resolved.get(spec, [])
            wanted.update((WorkerSpec(spec.role, a), None) for a in addresses)
        gone = [w for w in self._discovered if w not in wanted]
        new = [w for w in wanted if w not in self._discovered]
        if not gone and not new:
            return
        for w in new:
            self._discovered[w] = self._client(w)
            log.info("worker discovery: %s %s joined", w.role, w.address)
        retired = [self._discovered.pop(w) for w in gone]
        self.clients = [c for c in self.clients if c not in retired] + [
            self._discovered[w] for w in new
        ]
        for client in retired:
            log.info("worker discovery: %s %s left", client.role, client.address)
            self._retired.add(client)
            self.spawn(self._close_when_idle(client))
        if new:
            await asyncio.gather(*(self._discovered[w].poll(self.timeout_s) for w in new))

    async def _close_when_idle(self, client: WorkerClient) -> None:
        """A retired worker gets no new requests; its open ones may finish (up to the grace)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._retire_grace_s
        while client.inflight > 0 and loop.time() < deadline:
            await asyncio.sleep(0.5)
        self._retired.discard(client)
        await client.close()

    async def _discover_forever(self) -> None:
        while True:
            await asyncio.sleep(self.discover_interval_s)
            try:
                await self.refresh()
            except Exception:  # discovery must survive anything DNS does
                log.exception("worker discovery failed")

    async def poll_all(self) -> None:
        await asyncio.gather(*(c.poll(self.timeout_s) for c in self.clients))
        for client in self.clients:
            owed = self._still_served(client, client.take_owed_adapters())
            if owed:
                self.spawn(client.restore_adapters(owed, ADAPTER_LOAD_TIMEOUT_S))

    def _still_served(self, client: WorkerClient, owed: dict[str, str]) -> dict[str, str]:
        """Of the adapters owed to a worker started again, those the other generating workers
        still serve (or all, when it is the only one): one unloaded from them while it was
        down stays unloaded."""
        others = [c for c in self.clients
                  if c is not client and c.healthy and c.task == "generate"]  # fmt: skip
        if not others or client.task != "generate":
            return owed if client.task == "generate" else {}
        return {n: p for n, p in owed.items() if any(c.serves(n) for c in others)}

    async def _poll_forever(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.poll_all()
            except Exception:  # the poller must survive anything a worker does
                log.exception("worker poll failed")

    def healthy(self, role: str) -> list[WorkerClient]:
        return [c for c in self.clients if c.role == role and c.healthy]

    def any_healthy(self) -> bool:
        """Whether some worker can serve: a colocated one, or a decode one (it prefills prompts
        itself while no prefill worker is healthy)."""
        return bool(self.healthy(Role.COLOCATED)) or bool(self.healthy("decode"))

    def tasks(self) -> set[str]:
        """What the healthy workers serve (generate, embed); a decode worker generates."""
        tasks = {c.task for c in self.healthy(Role.COLOCATED)}
        if self.healthy("decode"):
            tasks.add("generate")
        return tasks

    def scheduling_policies(self) -> set[str]:
        """The scheduling policies the healthy workers report (fcfs, priority)."""
        return {c.scheduling_policy for c in self.clients if c.healthy} - {""}

    def lora_names(self) -> set[str]:
        """The LoRA adapters some healthy worker serves (each request goes to one that does)."""
        return {name for c in self.clients if c.healthy for name in c.lora_names}

    @contextlib.contextmanager
    def using_adapter(self, name: str) -> Iterator[None]:
        """Counts a request under LoRA adapter ``name`` ("" the base model: not counted) for as
        long as it runs, from before its first worker call to its end (an unload waits for it:
        ``gateway.workers.lora.unload_adapter``)."""
        if not name:
            yield
            return
        self._adapter_requests[name] = self._adapter_requests.get(name, 0) + 1
        try:
            yield
        finally:
            left = self._adapter_requests[name] - 1
            if left:
                self._adapter_requests[name] = left
            else:
                del self._adapter_requests[name]

    def adapter_in_use(self, name: str) -> bool:
        """Whether this gateway has a request under LoRA adapter ``name`` running."""
        return name in self._adapter_requests

    def lora_paths(self) -> dict[str, str]:
        """Each adapter's directory, as a healthy worker serving it reported it (workers that
        report none leave it out)."""
        return {name: path for c in self.clients if c.healthy and c.load
                for name, path in zip(c.load.lora_names, c.load.lora_paths, strict=False)}  # fmt: skip

    def limits(self) -> tuple[int | None, int | None]:
        """(max_model_len, vocab_size): the smallest any known worker reported."""
        healthy = [c.load for c in self.clients if c.healthy and c.load]
        loads = healthy or [c.load for c in self.clients if c.load]
        lens = [x.max_model_len for x in loads if x.max_model_len > 0]
        vocabs = [x.vocab_size for x in loads if x.vocab_size > 0]
        return (min(lens) if lens else None, min(vocabs) if vocabs else None)

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Runs ``coro`` detached from the caller: it survives the caller's cancellation."""
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def abort_later(self, client: WorkerClient, request_id: str, timeout_s: float) -> None:
        self.spawn(client.abort(request_id, timeout_s))

    async def settle(self, timeout_s: float = 5.0) -> None:
        """Waits for background tasks (aborts) to finish."""
        if self._background:
            await asyncio.wait(list(self._background), timeout=timeout_s)

    async def close(self) -> None:
        for task in (self._poller, self._discoverer):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        await self.settle()
        clients = [*self.clients, *self._retired]
        await asyncio.gather(*(c.close() for c in clients), return_exceptions=True)
