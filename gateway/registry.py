"""The set of workers, polled in the background, and fire-and-forget tasks (aborts)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Coroutine, Iterable
from typing import Any

from gateway.config import WorkerSpec
from gateway.workers import WorkerClient

log = logging.getLogger(__name__)


class WorkerRegistry:
    def __init__(
        self,
        specs: Iterable[WorkerSpec],
        interval_s: float = 1.0,
        timeout_s: float = 1.0,
        internal_token: str = "",
        owner: str = "",
    ) -> None:
        self.owner = owner  # this gateway's instance id (leases on the workers)
        self.clients = [WorkerClient(spec, internal_token, owner) for spec in specs]
        seen: dict[str, int] = {}
        for client in self.clients:  # "decode-1": a name for open endpoints (/metrics), which
            role = "colocated" if client.role == "both" else client.role  # show no addresses
            client.name = f"{role}-{seen.setdefault(role, 0)}"
            seen[role] += 1
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self._poller: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[Any]] = set()

    async def start(self) -> None:
        """Polls once (so /health is right from the start), then every ``interval_s``."""
        await self.poll_all()
        self._poller = asyncio.create_task(self._poll_forever(), name="tandem-worker-poller")

    async def poll_all(self) -> None:
        await asyncio.gather(*(c.poll(self.timeout_s) for c in self.clients))

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
        return bool(self.healthy("both")) or bool(
            self.healthy("prefill") and self.healthy("decode")
        )

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
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
        await self.settle()
        await asyncio.gather(*(c.close() for c in self.clients), return_exceptions=True)
