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
