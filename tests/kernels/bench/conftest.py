"""What the in-graph benchmarks' tests share."""

from __future__ import annotations

import pytest


@pytest.fixture
def graph_calls(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """``kernels.bench.gemv_graph``'s graph timer stubbed (each call counted as 1 us, its
    launches run once, as the capture would) over 2 weights: the results of the calls timed."""
    from kernels.bench import gemv_graph

    calls: list[object] = []

    def one_us(fn):  # type: ignore[no-untyped-def]
        calls.append(fn())
        return 1.0

    monkeypatch.setattr(gemv_graph, "REPS", 2)
    monkeypatch.setattr(gemv_graph, "graph_us", one_us)
    return calls
