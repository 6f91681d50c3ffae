"""Per-step counters of the engine: a cumulative histogram of the tokens each step computed,
what the gateway exports as vLLM's ``iteration_tokens_total``.

vLLM derives those buckets from the CUDA-graph capture sizes in some versions and uses this fixed
list in others; a fixed list keeps every worker's series comparable. The engine thread observes;
any thread may take a snapshot (one list copy, so the buckets and count always agree).
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


@dataclass(frozen=True)
class HistogramSnapshot:
    bounds: tuple[float, ...]
    counts: tuple[int, ...]  # cumulative: observations <= bounds[i]
    sum: float
    count: int  # every observation (the +Inf bucket)


class TokenHistogram:
    def __init__(self, bounds: Sequence[float] = ITERATION_TOKEN_BUCKETS) -> None:
        if list(bounds) != sorted(set(bounds)):
            raise ValueError(f"histogram bounds must be strictly ascending, got {bounds}")
        self.bounds = tuple(float(b) for b in bounds)
        self._counts = [0] * (len(self.bounds) + 1)  # per bucket; the last is above every bound
        self._sum = 0.0

    def observe(self, value: float) -> None:
        self._counts[bisect.bisect_left(self.bounds, value)] += 1
        self._sum += value

    def snapshot(self) -> HistogramSnapshot:
        counts = list(self._counts)  # one copy: a step may be counting on the engine thread
        cumulative = tuple(itertools.accumulate(counts))
        return HistogramSnapshot(self.bounds, cumulative[:-1], float(self._sum), cumulative[-1])
