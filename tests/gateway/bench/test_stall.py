"""The stall and cancel benchmarks' arithmetic (they run against a live gateway)."""

from __future__ import annotations

import pytest

from gateway.bench.cancel import _idle
from gateway.bench.stall import StreamTimes, summarize


def test_gaps_count_from_the_second_token_and_the_largest_is_reported() -> None:
    a = StreamTimes([0.0, 5.0, 5.1, 5.3])  # the first gap is the time to a second frame: ITL
    b = StreamTimes([1.0, 1.2, 1.25])
    phase = summarize("p", [a, b])
    assert (phase.streams, phase.tokens) == (2, 7)
    assert phase.max_gap_s == pytest.approx(0.2) and phase.median_gap_s == pytest.approx(0.1)


def test_a_phase_without_gaps_is_an_error() -> None:
    with pytest.raises(SystemExit, match="no inter-token gaps"):
        summarize("p", [StreamTimes([1.0, 2.0])])


def test_a_worker_is_idle_only_with_its_whole_pool_free_and_nothing_held() -> None:
    load = {
        "free_blocks": 8,
        "total_blocks": 8,
        "num_running": 0,
        "num_waiting": 0,
        "num_reserved": 0,
    }
    assert _idle(load)
    for key, value in (
        ("free_blocks", 7),
        ("num_running", 1),
        ("num_waiting", 1),
        ("num_reserved", 1),
    ):
        assert not _idle({**load, key: value})
    assert not _idle(None)  # not polled yet
