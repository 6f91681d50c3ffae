"""The engine's tokens-per-step histogram: Prometheus' cumulative buckets, vLLM's bounds."""

from __future__ import annotations

import pytest

from services.engine.step_stats import ITERATION_TOKEN_BUCKETS, TokenHistogram


def test_buckets_are_vllms_iteration_tokens_buckets() -> None:
    assert ITERATION_TOKEN_BUCKETS == (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192,
                                       16384)  # fmt: skip
    h = TokenHistogram().snapshot()
    assert h.bounds == tuple(float(b) for b in ITERATION_TOKEN_BUCKETS)
    assert h.counts == (0,) * len(ITERATION_TOKEN_BUCKETS) and (h.sum, h.count) == (0.0, 0)


def test_observations_land_in_cumulative_buckets_with_le_inclusive() -> None:
    h = TokenHistogram((1, 8, 16))
    for tokens in (1, 1, 2, 8, 9, 16, 300):
        h.observe(tokens)
    snap = h.snapshot()
    assert snap.counts == (2, 4, 6)  # <= 1: two; <= 8: also 2 and 8; <= 16: also 9 and 16
    assert snap.count == 7  # 300 is only in +Inf
    assert snap.sum == 1 + 1 + 2 + 8 + 9 + 16 + 300


def test_a_snapshot_is_a_copy() -> None:
    h = TokenHistogram((4,))
    h.observe(3)
    before = h.snapshot()
    h.observe(3)
    assert (before.counts, before.count) == ((1,), 1)
    assert (h.snapshot().counts, h.snapshot().count) == ((2,), 2)


@pytest.mark.parametrize("bounds", [(8, 1), (1, 1, 2)])
def test_bounds_must_rise(bounds: tuple[int, ...]) -> None:
    with pytest.raises(ValueError, match="strictly ascending"):
        TokenHistogram(bounds)
