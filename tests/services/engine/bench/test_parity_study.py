"""The parity study's statistics: the Wilson interval and the per-variant agreement rate."""

from __future__ import annotations

import pytest

from services.engine.bench import parity_report, parity_study


def test_wilson_interval_matches_the_textbook_values() -> None:
    lo, hi = parity_study.wilson(6, 8)
    assert lo == pytest.approx(0.4093, abs=1e-4) and hi == pytest.approx(0.9285, abs=1e-4)
    assert parity_study.wilson(0, 10)[0] == 0.0 and parity_study.wilson(10, 10)[1] == 1.0
    assert parity_study.wilson(0, 0) == (0.0, 1.0)


def test_equal_rate_counts_whole_continuations_and_the_median_first_difference() -> None:
    want = [[1, 2, 3], [4, 5], [6, 7, 8], [9]]
    got = [[1, 2, 3], [4, 0], [0, 7, 8], [9]]
    rate = parity_study.equal_rate(got, want)
    assert (rate["equal"], rate["of"], rate["rate"]) == (2, 4, 0.5)
    assert rate["median_first_difference"] == 1  # first differences at 1 and 0: upper median
    assert rate["ci95"][0] < 0.5 < rate["ci95"][1]
    assert parity_study.equal_rate(want, want)["median_first_difference"] is None


def test_the_study_includes_the_parity_tests_prompts_and_no_duplicates() -> None:
    texts = parity_report.PROMPTS + parity_study.STUDY_PROMPTS
    assert len(texts) == len(set(texts)) == 56
