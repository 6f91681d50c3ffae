"""AdmissionQueue: Reserve calls wait in policy order for blocks and leave cleanly."""

from __future__ import annotations

import asyncio

import pytest

from services.decode.admission import AdmissionQueue, TryReserve

pytestmark = pytest.mark.timeout(30)


class Pool:
    """A fake engine pool: ``try_reserve(rid, n)`` takes n blocks if they are free."""

    def __init__(self, free: int) -> None:
        self.free = free
        self.held: dict[str, int] = {}
        self.released: list[str] = []

    def attempt(self, queue: AdmissionQueue, rid: str, n: int) -> TryReserve:
        async def go() -> list[int] | None:
            await asyncio.sleep(0)  # the engine thread answers later
            if n > self.free:
                queue.note_free_blocks(self.free)
                return None
            self.free -= n
            self.held[rid] = n
            return list(range(n))

        return go

    def give_back(self, queue: AdmissionQueue, rid: str) -> None:
        self.free += self.held.pop(rid)
        queue.on_blocks_freed(self.free)

    def release(self, rid: str) -> None:
        self.released.append(rid)
        self.free += self.held.pop(rid)


async def _settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


async def test_waiters_are_admitted_in_arrival_order_as_blocks_free() -> None:
    pool = Pool(free=0)
    q = AdmissionQueue(pool.release, by_priority=False)
    order: list[str] = []

    async def reserve(rid: str, n: int) -> None:
        await q.wait(rid, 0, pool.attempt(q, rid, n))
        order.append(rid)

    pool.held["running"] = 6
    tasks = [asyncio.create_task(reserve(rid, n)) for rid, n in (("a", 4), ("b", 1), ("c", 2))]
    await _settle()
    assert order == [] and len(q) == 3 and "b" in q
    pool.give_back(q, "running")  # 6 free: a (4) then b (1); c (2) does not fit in the last 1
    await _settle()
    assert order == ["a", "b"] and len(q) == 1
    pool.give_back(q, "a")
    await asyncio.gather(*tasks)
    assert order == ["a", "b", "c"] and len(q) == 0 and pool.released == []


async def test_the_head_holds_back_smaller_waiters_behind_it() -> None:
    pool = Pool(free=2)
    q = AdmissionQueue(pool.release, by_priority=False)
    big = asyncio.create_task(q.wait("big", 0, pool.attempt(q, "big", 5)))
    await _settle()
    small = asyncio.create_task(q.wait("small", 0, pool.attempt(q, "small", 1)))
    await _settle()
    assert not big.done() and not small.done()  # small fits, but big came first
    pool.held["other"] = 3
    pool.give_back(q, "other")
    assert await big == list(range(5))
    assert not small.done()  # the pool is empty again
    pool.give_back(q, "big")
    assert await small == [0]


async def test_priority_policy_admits_lower_priority_values_first() -> None:
    pool = Pool(free=0)
    q = AdmissionQueue(pool.release, by_priority=True)
    order: list[str] = []

    async def reserve(rid: str, prio: int) -> None:
        await q.wait(rid, prio, pool.attempt(q, rid, 1))
        order.append(rid)

    tasks = [asyncio.create_task(reserve(rid, p)) for rid, p in (("late", 5), ("urgent", -1))]
    await _settle()
    pool.held["x"] = 1
    pool.give_back(q, "x")
    await _settle()
    assert order == ["urgent"]
    pool.give_back(q, "urgent")
    await asyncio.gather(*tasks)
    assert order == ["urgent", "late"]


async def test_a_waiter_that_gives_up_leaves_the_queue_and_keeps_nothing() -> None:
    pool = Pool(free=0)
    q = AdmissionQueue(pool.release, by_priority=False)
    gone = asyncio.create_task(q.wait("gone", 0, pool.attempt(q, "gone", 2)))
    stays = asyncio.create_task(q.wait("stays", 0, pool.attempt(q, "stays", 2)))
    await _settle()
    gone.cancel()
    with pytest.raises(asyncio.CancelledError):
        await gone
    assert len(q) == 1 and "gone" not in q
    pool.held["x"] = 2
    pool.give_back(q, "x")
    assert await stays == [0, 1]
    assert pool.held == {"stays": 2}


async def test_a_timeout_while_waiting_is_a_plain_timeout() -> None:
    pool = Pool(free=0)
    q = AdmissionQueue(pool.release, by_priority=False)
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.05):
            await q.wait("slow", 0, pool.attempt(q, "slow", 1))
    assert len(q) == 0


async def test_blocks_reserved_for_a_waiter_that_left_meanwhile_are_given_back() -> None:
    pool = Pool(free=4)
    q = AdmissionQueue(pool.release, by_priority=False)
    gate = asyncio.Event()

    async def slow_attempt() -> list[int] | None:
        await gate.wait()  # the engine takes its time; the caller leaves meanwhile
        pool.free -= 2
        pool.held["racer"] = 2
        return [0, 1]

    racer = asyncio.create_task(q.wait("racer", 0, slow_attempt))
    await _settle()
    racer.cancel()
    with pytest.raises(asyncio.CancelledError):
        await racer
    gate.set()
    await _settle()
    assert pool.released == ["racer"] and pool.free == 4 and len(q) == 0


async def test_fail_all_ends_every_waiter_with_the_error() -> None:
    pool = Pool(free=0)
    q = AdmissionQueue(pool.release, by_priority=False)
    waiters = [
        asyncio.create_task(q.wait(f"w{i}", 0, pool.attempt(q, f"w{i}", 1))) for i in range(3)
    ]
    await _settle()
    q.fail_all(RuntimeError("draining"))
    for w in waiters:
        with pytest.raises(RuntimeError, match="draining"):
            await w
    assert len(q) == 0
