"""The engine thread hands a step's outputs to each event loop in one wake-up."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

from services.engine.driver import EngineDriver, Stream
from services.engine.outputs import RequestOutput


class _Loop:
    """Records call_soon_threadsafe calls and runs them at once."""

    def __init__(self) -> None:
        self.calls = 0

    def call_soon_threadsafe(self, fn: Callable[..., Any], *args: Any) -> None:
        self.calls += 1
        fn(*args)


def test_one_wake_up_per_loop_per_step_and_finished_streams_leave() -> None:
    driver = EngineDriver(engine=None)  # type: ignore[arg-type]
    loops = [_Loop(), _Loop()]
    streams = {f"r{i}": Stream(f"r{i}", loops[i % 2], asyncio.Queue()) for i in range(5)}  # type: ignore[arg-type]
    driver._streams.update(streams)
    outs = [RequestOutput(f"r{i}", [i], "", i == 3) for i in range(5)]
    outs.append(RequestOutput("gone", [9], "", False))  # a stream that was aborted meanwhile
    driver._deliver(outs)
    assert [loop.calls for loop in loops] == [1, 1]
    assert [s.queue.qsize() for s in streams.values()] == [1, 1, 1, 1, 1]
    assert "r3" not in driver._streams and len(driver._streams) == 4


class _DyingEngine:
    """One request in flight; its step finds a tensor-parallel rank dead."""

    has_unfinished = True

    def __init__(self) -> None:
        self.aborted: list[str] = []

    def step(self) -> list[RequestOutput]:
        from services.engine.tp_ranks import RankFailedError

        raise RankFailedError("tensor-parallel rank 1 exited with status -9 during a step")

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


def test_a_dead_rank_fails_every_request_stops_the_engine_and_refuses_later_calls() -> None:
    engine = _DyingEngine()
    driver = EngineDriver(engine=engine)  # type: ignore[arg-type]
    loop = _Loop()
    stream = Stream("r0", loop, asyncio.Queue())  # type: ignore[arg-type]
    driver._streams["r0"] = stream
    fatal: list[str] = []
    driver.on_fatal.append(lambda exc: fatal.append(str(exc)))
    driver.start()
    driver._thread.join(10)
    assert not driver._thread.is_alive(), "the engine thread went on after a rank died"
    out = stream.queue.get_nowait()
    assert (out.finished, out.finish_reason) == (True, "error")
    assert out.error is not None and "rank 1 exited with status -9" in out.error
    assert engine.aborted == ["r0"]
    assert fatal == ["tensor-parallel rank 1 exited with status -9 during a step"]
    later = driver.call(lambda e: None)
    assert "the engine stopped" in str(later.exception(timeout=1))


def test_a_sink_gets_what_was_queued_first_then_every_output_and_a_broken_one_is_contained() -> (
    None
):
    loop = _Loop()
    stream = Stream("r", loop, asyncio.Queue())  # type: ignore[arg-type]
    broken = Stream("b", loop, asyncio.Queue())  # type: ignore[arg-type]
    driver = EngineDriver(engine=None)  # type: ignore[arg-type]
    driver._streams.update(r=stream, b=broken)
    driver._deliver([RequestOutput("r", [1], "", False)])
    got: list[int] = []
    stream.attach(lambda out: got.extend(out.token_ids))
    broken.attach(lambda out: 1 / 0)
    driver._deliver([RequestOutput("b", [7], "", False), RequestOutput("r", [2], "", False)])
    stream.put(RequestOutput("r", [3], "", True))  # an abort's or activate's output
    assert got == [1, 2, 3] and stream.queue.empty()
    stream.attach(None)
    driver._deliver([RequestOutput("r", [4], "", False)])
    assert got == [1, 2, 3] and stream.queue.qsize() == 1


class _HangingEngine:
    """One request whose step blocks until released (a hung kernel or collective)."""

    def __init__(self) -> None:
        self.has_unfinished = True
        self.entered = threading.Event()
        self.release = threading.Event()

    def step(self) -> list[RequestOutput]:
        self.entered.set()
        assert self.release.wait(30)
        self.has_unfinished = False
        return []


def _idle(driver: EngineDriver, within_s: float = 10.0) -> bool:
    """Whether the engine thread leaves its step or command within ``within_s`` (it resets
    ``busy_for`` just after a command's future is answered: no event marks that moment)."""
    deadline = time.monotonic() + within_s
    while driver.busy_for() > 0.0:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    return True


def test_busy_for_counts_the_step_in_progress_and_is_zero_between_steps() -> None:
    engine = _HangingEngine()
    driver = EngineDriver(engine=engine)  # type: ignore[arg-type]
    assert driver.busy_for() == 0.0 and driver.thread_ident is None
    driver.start()
    try:
        assert engine.entered.wait(10)
        first = driver.busy_for()
        assert first > 0.0 and driver.thread_ident is not None
        assert engine.release.wait(0) is False and driver.busy_for() >= first  # still in it
        engine.release.set()
        assert _idle(driver)  # the step returned: the thread waits for work
    finally:
        engine.release.set()
        driver.stop()


def test_busy_for_counts_a_command_in_progress() -> None:
    engine = _HangingEngine()
    engine.has_unfinished = False
    driver = EngineDriver(engine=engine)  # type: ignore[arg-type]
    driver.start()
    try:
        done = driver.call(lambda e: e.step())  # a command that hangs as the step does
        assert engine.entered.wait(10)
        assert driver.busy_for() > 0.0
        engine.release.set()
        done.result(10)
        assert _idle(driver)
    finally:
        engine.release.set()
        driver.stop()
