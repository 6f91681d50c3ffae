"""The near-tie check that judges bf16 greedy parity (services.engine.bench.parity_check)."""

from __future__ import annotations

import pytest

from services.engine.bench.parity_check import Continuation, logprobs_close, summarize


def _c(ids: list[int], tops: list[dict[int, float]]) -> Continuation:
    return Continuation(ids, tops)


def test_equal_continuations_have_no_divergence() -> None:
    top = [{1: -0.1, 2: -3.0}, {3: -0.2, 4: -2.0}]
    d = logprobs_close(_c([1, 3], top), _c([1, 3], top))
    assert d.position is None and d.close


def test_near_tie_is_close_with_gaps() -> None:
    ours = _c([1, 4], [{1: -0.1}, {4: -0.69, 3: -0.70}])
    ref = _c([1, 3, 9], [{1: -0.1}, {3: -0.68, 4: -0.71}, {9: -0.1}])
    d = logprobs_close(ours, ref)
    assert d.position == 1 and d.close
    assert d.ref_gap == pytest.approx(0.03) and d.ours_gap == pytest.approx(0.01)


def test_a_token_outside_the_other_sides_top_is_not_close() -> None:
    ours = _c([5], [{5: -0.01, 6: -5.0}])
    ref = _c([6], [{6: -0.01, 7: -4.0}])
    d = logprobs_close(ours, ref)
    assert d.position == 0 and not d.close
    assert not d.ours_in_ref_top and d.ref_in_ours_top
    assert d.ref_gap is None and d.ours_gap == pytest.approx(4.99)


def test_one_side_ending_early_is_not_a_divergence() -> None:
    d = logprobs_close(
        _c([1, 2], [{1: 0.0}, {2: 0.0}]), _c([1, 2, 3], [{1: 0.0}, {2: 0.0}, {3: 0.0}])
    )
    assert d.position is None


def test_missing_log_probabilities_where_tokens_differ_is_an_error() -> None:
    with pytest.raises(ValueError, match="position 1"):
        logprobs_close(_c([1, 2], [{1: 0.0}]), _c([1, 3], [{1: 0.0}, {3: 0.0}]))


def test_summary_counts_and_widest_gap() -> None:
    pairs = [
        logprobs_close(_c([1], [{1: 0.0}]), _c([1], [{1: 0.0}])),
        logprobs_close(_c([2], [{2: -0.5, 3: -0.9}]), _c([3], [{3: -0.6, 2: -0.8}])),
        logprobs_close(_c([2], [{2: -0.1}]), _c([3], [{3: -0.1}])),
    ]
    s = summarize(pairs)
    assert (s["equal_to_end"], s["close"], s["of"]) == (1, 2, 3)
    assert s["max_gap"] == pytest.approx(0.4)
