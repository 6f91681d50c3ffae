"""The decode servicer's reservations, without processes: a granted reservation's blocks come
back from the KV receiver's thread, after the call that cancelled it returned; a bad Reserve or
Decode is refused and leaves nothing held."""

from __future__ import annotations

import asyncio
import math
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
        self.trailing: dict[str, str] = {}

    async def abort(
        self, code: Any, details: str, trailing_metadata: tuple[tuple[str, str], ...] = ()
    ) -> None:
        self.code, self.details = code, details
        self.trailing = dict(trailing_metadata)
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


BAD_SECONDS = [math.nan, math.inf, -math.inf, -1.0]


class Handle:
    """A KV transfer that never lands, or (``fail``) fails as soon as someone waits for it."""

    grant = None

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail

    def add_done_callback(self, callback: Any) -> None:
        if self.fail:
            callback(SimpleNamespace(ok=False, error="the sender went away"))


class Receiver:
    """Expects KV without a socket; a cancel frees the blocks at once (no grant to take back)."""

    endpoint = "127.0.0.1:9"

    def __init__(self) -> None:
        self.expected: list[str] = []
        self.cancelled: list[str] = []

    def expect(self, rid: str, blocks: list[int], grant: bool = False) -> Handle:
        self.expected.append(rid)
        return Handle()

    def cancel(self, rid: str, reason: str, on_free: Any = None) -> bool:
        self.cancelled.append(rid)
        if on_free is not None:
            on_free()
        return True


class BlocksDriver(RecordingDriver):
    """Has the blocks for any prompt at once."""

    async def reserve(self, rid: str, n: int, params: Any) -> Any:
        self.calls.append(("reserve", rid))
        return SimpleNamespace(blocks=[7, 8, 9], free_blocks=100)


def ready_servicer(driver: Any) -> DecodeServicer:
    config = SimpleNamespace(
        engine=SimpleNamespace(scheduler=SimpleNamespace(policy="fcfs")), kv_timeout_s=7.0
    )
    engine = SimpleNamespace(
        max_model_len=2048, vocab_size=100, config=SimpleNamespace(cache=SimpleNamespace(block_size=16)),
        validate=lambda prompt, params: None,
    )  # fmt: skip
    runtime: Any = ReadyRuntime(
        config=config, driver=driver, engine=engine, worker_id="decode-0",
        leases=SimpleNamespace(renew=lambda owner: None),
    )  # fmt: skip
    s = DecodeServicer(runtime)
    s.receiver = Receiver()
    return s


def assert_refused(context: AbortingContext, field: str) -> None:
    import grpc

    from protos.errors import PARAM_METADATA_KEY

    assert context.code == grpc.StatusCode.INVALID_ARGUMENT
    assert context.details.startswith(f"{field} must be a finite number of seconds >= 0 (0 or ")
    assert context.trailing == {PARAM_METADATA_KEY: field}  # the gateway's 400 names it


@pytest.mark.parametrize("field", ["ttl_s", "wait_s"])
@pytest.mark.parametrize("value", BAD_SECONDS)
async def test_a_reserve_whose_ttl_or_wait_is_not_a_finite_number_at_least_0_is_refused(
    field: str, value: float
) -> None:
    # a NaN or negative ttl_s read as unset (10 s) and an infinite one as the cap; an infinite
    # wait_s queued for blocks as long as the call lasted, a NaN one gave up at once: refused
    # before the engine is asked, so no blocks are taken and nothing is reserved or queued
    from protos import kv_control_pb2

    s = ready_servicer(NoReserveDriver())
    request = kv_control_pb2.ReserveRequest(
        request_id="r1", num_prompt_tokens=4, ttl_s=5.0, wait_s=1.0
    )
    setattr(request, field, value)
    context = AbortingContext()
    with pytest.raises(Aborted):
        await s.Reserve(request, context)  # type: ignore[arg-type]
    assert_refused(context, field)
    assert not s.reservations and not s._reserving and not len(s.admission)
    assert s.receiver.expected == []


@pytest.mark.parametrize(
    ("ttl_s", "owner", "lives"), [(0.0, "", 10.0), (2.5, "", 2.5), (1e9, "", 60.0), (1e9, "gw", 3600.0)]
)  # fmt: skip
async def test_a_reserve_with_a_finite_ttl_and_wait_holds_its_blocks_that_long(
    ttl_s: float, owner: str, lives: float
) -> None:
    from protos import kv_control_pb2

    driver = BlocksDriver()
    s = ready_servicer(driver)
    loop = asyncio.get_running_loop()
    for rid, wait_s in (("r1", 0.0), ("r2", 1.5)):
        request = kv_control_pb2.ReserveRequest(
            request_id=rid, num_prompt_tokens=4, ttl_s=ttl_s, wait_s=wait_s, owner=owner
        )
        reply = await s.Reserve(request, AbortingContext())  # type: ignore[arg-type]
        assert (reply.reservation_id, reply.num_blocks) == (rid, 1)
        assert s.reservations[rid].timer.when() - loop.time() == pytest.approx(lives, abs=0.5)
    s.cancel_all()
    assert not s.reservations and driver.calls[-2:] == [
        ("cancel_reservation", "r1"), ("cancel_reservation", "r2"),
    ]  # fmt: skip


def decode_request(kv_wait_s: float) -> Any:
    from protos import common_pb2, decode_pb2

    return decode_pb2.DecodeRequest(
        request_id="r1", reservation_id="r1", prompt_token_ids=[1, 2, 3, 4],
        output_token_ids=[5], sampling=common_pb2.SamplingParams(max_tokens=4),
        kv_wait_s=kv_wait_s,
    )  # fmt: skip


def reserved(s: DecodeServicer) -> Reservation:
    loop = asyncio.get_running_loop()
    res = Reservation("r1", 4, Handle(fail=True), loop.call_later(60, s._expire, "r1"))
    s.reservations["r1"] = res
    return res


@pytest.mark.parametrize("value", BAD_SECONDS)
async def test_a_decode_whose_kv_wait_is_not_a_finite_number_at_least_0_is_refused(
    value: float,
) -> None:
    # a NaN or infinite kv_wait_s left the reservation's deadline where it was; a negative one
    # expired it at once. Refused before the KV wait, like any bad input of a Decode call: the
    # reservation it claimed is freed, its blocks back in the engine
    driver = RecordingDriver()
    s = ready_servicer(driver)
    reserved(s)
    context = AbortingContext()
    with pytest.raises(Aborted):
        await s.Decode(decode_request(value), context).__anext__()  # type: ignore[arg-type]
    assert_refused(context, "kv_wait_s")
    assert "0 or unset: this worker's --kv-timeout, 7 s" in context.details
    assert not s.reservations and driver.calls == [("cancel_reservation", "r1")]


@pytest.mark.parametrize(("kv_wait_s", "waits"), [(2.0, 2.0), (0.0, 7.0)])
async def test_a_decode_with_a_finite_kv_wait_waits_that_long_for_the_kv(
    kv_wait_s: float, waits: float
) -> None:
    import grpc

    driver = RecordingDriver()
    s = ready_servicer(driver)
    res = reserved(s)
    loop = asyncio.get_running_loop()
    context = AbortingContext()
    with pytest.raises(Aborted):  # the KV never comes: its transfer fails
        await s.Decode(decode_request(kv_wait_s), context).__anext__()  # type: ignore[arg-type]
    assert context.code == grpc.StatusCode.UNAVAILABLE, context.details
    # the deadline came forward to the wait asked for (0: the worker's --kv-timeout)
    assert res.timer.when() - loop.time() == pytest.approx(waits, abs=0.5)
    assert not s.reservations and driver.calls == [("cancel_reservation", "r1")]


async def test_a_decode_stream_item_with_a_bad_timeout_is_refused_before_decode_claims() -> None:
    # refused by the stream before Decode runs: the reservation stays as it was, unclaimed,
    # under its own ttl (and the caller's Abort), and nothing else is taken
    from protos import decode_pb2

    driver = RecordingDriver()
    s = ready_servicer(driver)
    res = reserved(s)

    async def items() -> Any:
        yield decode_pb2.DecodeStreamItem(decode=decode_request(1.0), timeout_s=math.nan)

    batches = [b async for b in s.DecodeStream(items(), AbortingContext())]  # type: ignore[arg-type]
    (chunk,) = [c for b in batches for c in b.chunks]
    assert (chunk.request_id, chunk.error_param) == ("r1", "timeout_s")
    assert s.reservations == {"r1": res} and not res.claimed and driver.calls == []
    res.timer.cancel()
