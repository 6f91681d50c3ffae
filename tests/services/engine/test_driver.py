"""The engine thread hands a step's outputs to each event loop in one wake-up."""

from __future__ import annotations

import asyncio
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
