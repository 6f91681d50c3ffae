"""The decode worker's admission queue: Reserve calls that wait for KV blocks.

A burst larger than the decode pool queues here instead of failing. Waiters are admitted in
policy order (arrival, or priority then arrival) as soon as the engine has the blocks; the order
is strict, so a long prompt at the head holds back shorter ones behind it instead of starving. A
caller that gives up (its deadline, a client gone) leaves the queue at once, and blocks reserved
for a waiter that left meanwhile are given back.

Why on the decode worker and not in the gateway: this worker is the one that sees blocks free (a
step finished a request, a reservation was cancelled) the moment it happens, and one queue per
worker stays fair when several gateways share it.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

TryReserve = Callable[[], Awaitable["list[int] | None"]]  # the blocks, or None if they don't fit


@dataclass(eq=False)
class _Waiter:
    key: tuple[int, int]  # (priority, arrival): lower first
    request_id: str
    try_reserve: TryReserve
    future: asyncio.Future[list[int]]


class AdmissionQueue:
    """Runs on one event loop; :meth:`on_blocks_freed` may be called from any thread."""

    def __init__(self, release: Callable[[str], None], by_priority: bool) -> None:
        self._release = release  # gives back blocks reserved for a waiter that left
        self._by_priority = by_priority
        self._waiters: list[_Waiter] = []  # kept sorted by key
        self._seq = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[None] | None = None
        self._again = False
        self._free_seen = -1  # free blocks when the head last did not fit

    def __len__(self) -> int:
        return len(self._waiters)

    def __contains__(self, request_id: str) -> bool:
        return any(w.request_id == request_id for w in self._waiters)

    async def wait(self, request_id: str, priority: int, try_reserve: TryReserve) -> list[int]:
        """The blocks once this request's turn comes and they fit. Cancel the awaiting task to
        leave the queue (nothing stays reserved)."""
        loop = self._loop = asyncio.get_running_loop()
        key = (priority if self._by_priority else 0, next(self._seq))
        waiter = _Waiter(key, request_id, try_reserve, loop.create_future())
        self._waiters.append(waiter)
        self._waiters.sort(key=lambda w: w.key)
        self.kick()
        try:
            return await waiter.future
        except asyncio.CancelledError:
            self._remove(waiter)
            if waiter.future.done() and not waiter.future.cancelled():
                self._release(request_id)  # admitted just as its caller gave up
            raise

    def fail_all(self, exc: Exception) -> None:
        """Every waiter fails with ``exc`` (the worker is draining or stopping)."""
        waiters, self._waiters = self._waiters, []
        for w in waiters:
            if not w.future.done():
                w.future.set_exception(exc)

    def on_blocks_freed(self, free_blocks: int) -> None:
        """From the engine thread after its work: kick if blocks freed since the head last
        failed to fit (a racy read of the waiters is fine: a new waiter kicks by itself)."""
        if self._waiters and self._loop is not None and free_blocks > self._free_seen:
            self._free_seen = free_blocks
            self._loop.call_soon_threadsafe(self.kick)

    def kick(self) -> None:
        self._again = True
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while self._again:
            self._again = False
            await self._admit()

    async def _admit(self) -> None:
        while self._waiters:
            head = self._waiters[0]
            if head.future.done():  # its caller left
                self._remove(head)
                continue
            blocks = await head.try_reserve()
            if blocks is None:
                return  # the next freed blocks kick again
            self._remove(head)
            if head.future.done():
                self._release(head.request_id)
            else:
                head.future.set_result(blocks)

    def note_free_blocks(self, free_blocks: int) -> None:
        """Called on the engine thread by a ``try_reserve`` that did not fit."""
        self._free_seen = free_blocks

    def _remove(self, waiter: _Waiter) -> None:
        if waiter in self._waiters:
            self._waiters.remove(waiter)
