"""The decode servicer's cancel of a reservation, without processes: a granted reservation's
blocks come back from the KV receiver's thread, after the call that cancelled it returned."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace
from typing import Any

import pytest

from services.decode.server import DecodeServicer, Reservation


class DeferredReceiver:
    """A receiver whose cancels free their blocks later, from another thread (a grant taken
    back after the copy into it ended)."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.threads: list[threading.Thread] = []

    def cancel(self, rid: str, reason: str, on_free: Any = None) -> bool:
        def later() -> None:
            self.release.wait(5)
            on_free()

        thread = threading.Thread(target=later)
        thread.start()
        self.threads.append(thread)
        return True


class RecordingDriver:
    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    def cancel_reservation(self, rid: str) -> None:
        self.calls.append(("cancel_reservation", rid))


def servicer(driver: RecordingDriver, receiver: DeferredReceiver) -> DecodeServicer:
    config = SimpleNamespace(engine=SimpleNamespace(scheduler=SimpleNamespace(policy="fcfs")))
    runtime: Any = SimpleNamespace(config=config, driver=driver)
    s = DecodeServicer(runtime)
    s.receiver = receiver
    return s


async def test_freed_resolves_once_the_engine_dropped_a_reservation_freed_later() -> None:
    driver, receiver = RecordingDriver(), DeferredReceiver()
    s = servicer(driver, receiver)
    loop = asyncio.get_running_loop()
    s.reservations["r1"] = Reservation("r1", 8, None, loop.call_later(60, lambda: None))
    freed: asyncio.Future[None] = loop.create_future()
    assert s._cancel("r1", freed=freed)
    assert "r1" not in s.reservations
    await asyncio.sleep(0.05)
    # the receiver has not given the blocks back: the engine still holds the reservation, so
    # a request under the same id would be refused as "already in use"
    assert not freed.done() and driver.calls == []
    receiver.release.set()
    await asyncio.wait_for(freed, 5)
    assert driver.calls == [("cancel_reservation", "r1")]
    for thread in receiver.threads:
        thread.join()
    assert not s._cancel("r1", freed=loop.create_future())  # gone: nothing to wait for


class Aborted(Exception):
    pass


class AbortingContext:
    def __init__(self) -> None:
        self.code: Any = None
        self.details = ""

    async def abort(self, code: Any, details: str) -> None:
        self.code, self.details = code, details
        raise Aborted(details)


class ReadyRuntime(SimpleNamespace):
    async def ready_driver(self, context: Any) -> Any:
        return self.driver


class NoReserveDriver:
    """A driver that must not be asked: the servicer refuses the request before it."""

    async def reserve(self, rid: str, n: int, params: Any) -> Any:
        raise AssertionError(f"reserve({rid!r}, {n}) reached the engine")


async def test_a_reservation_at_or_over_max_model_len_is_refused_before_the_engine() -> None:
    # num_prompt_tokens 2**31 - 1 once reached the engine, which made a list of that many ids
    # (17 GB) and left the worker unanswering; the gateway never asks for such a prompt, but a
    # bad call must cost an INVALID_ARGUMENT, not the worker
    import grpc

    from protos import kv_control_pb2

    config = SimpleNamespace(engine=SimpleNamespace(scheduler=SimpleNamespace(policy="fcfs")))
    runtime: Any = ReadyRuntime(
        config=config, driver=NoReserveDriver(), engine=SimpleNamespace(max_model_len=2048)
    )
    s = DecodeServicer(runtime)
    for n in (2048, 2**31 - 1):
        context = AbortingContext()
        request = kv_control_pb2.ReserveRequest(request_id=f"r{n}", num_prompt_tokens=n, ttl_s=5)
        with pytest.raises(Aborted):
            await s.Reserve(request, context)  # type: ignore[arg-type]
        assert context.code == grpc.StatusCode.INVALID_ARGUMENT, n
        assert "max_model_len 2048" in context.details
        assert not s.reservations and not s._reserving
