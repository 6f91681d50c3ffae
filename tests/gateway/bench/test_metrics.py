from __future__ import annotations

import math

import pytest

from gateway.bench.client import RequestResult, arrival_offsets
from gateway.bench.metrics import format_result, format_summary, summarize


def ok(
    ttft: float, latency: float, out: int, itl: list[float] | None = None, prompt: int = 10
) -> RequestResult:
    return RequestResult(True, prompt, out, ttft, itl or [], latency)


RESULTS = [
    ok(0.1, 1.1, 11, [0.1] * 10),  # TPOT 100 ms
    ok(0.2, 0.7, 11, [0.05] * 10),  # TPOT 50 ms
    ok(0.3, 0.3, 1),  # one token: no TPOT
    ok(0.4, 0.9, 6, [0.1] * 5),  # TPOT 100 ms
    RequestResult(False, 10, 0, 0.0, [], 0.5, "HTTP 503: busy"),
]


def test_percentiles_and_means_in_milliseconds() -> None:
    m = summarize(RESULTS, 2.0, math.inf, None, 1000.0, 1000.0)
    assert m["mean_ttft_ms"] == pytest.approx(250.0)
    assert m["median_ttft_ms"] == pytest.approx(250.0)
    assert m["p90_ttft_ms"] == pytest.approx(370.0)
    assert m["p99_ttft_ms"] == pytest.approx(397.0)
    assert m["mean_tpot_ms"] == pytest.approx((100 + 50 + 100) / 3)
    assert m["median_itl_ms"] == pytest.approx(100.0)
    assert m["mean_e2el_ms"] == pytest.approx(750.0)


def test_counts_throughput_and_failures() -> None:
    m = summarize(RESULTS, 2.0, 4.0, 8, 1000.0, 1000.0)
    assert (m["completed"], m["failed"], m["errors"]) == (4, 1, {"HTTP 503: busy": 1})
    assert (m["total_input_tokens"], m["total_output_tokens"]) == (40, 29)
    assert m["request_throughput"] == 2.0 and m["output_throughput"] == 14.5
    assert m["total_token_throughput"] == 34.5
    assert (m["request_rate"], m["max_concurrency"]) == (4.0, 8)


def test_goodput_needs_both_slos() -> None:
    m = summarize(RESULTS, 2.0, math.inf, None, slo_ttft_ms=250.0, slo_tpot_ms=60.0)
    assert (
        m["goodput"] == m["request_goodput"] == 0.5
    )  # the 50 ms TPOT one... and the 1-token one? no: TTFT 300
    m = summarize(RESULTS, 2.0, math.inf, None, slo_ttft_ms=350.0, slo_tpot_ms=60.0)
    assert m["goodput"] == 1.0  # TPOT 50 ms at TTFT 200, and the 1-token request at TTFT 300


def test_no_successful_request_gives_no_latency_numbers() -> None:
    m = summarize(RESULTS[-1:], 1.0, math.inf, None, 1000.0, 40.0)
    assert m["completed"] == 0 and m["mean_ttft_ms"] is None and m["p99_e2el_ms"] is None
    assert "n/a" in format_result(m)


def test_tables_show_every_metric() -> None:
    m = summarize(RESULTS, 2.0, math.inf, None, 1000.0, 1000.0)
    table = format_result(m)
    for label in ("Successful requests:", "Mean TTFT (ms):", "P99 TPOT (ms):", "Median ITL (ms):",
                  "P90 E2EL (ms):", "Request goodput (req/s):", "1 x HTTP 503: busy"):  # fmt: skip
        assert label in table
    assert "250.0/370.0/397.0" in format_summary([m])


def test_poisson_arrivals_have_the_requested_mean_rate() -> None:
    offsets = arrival_offsets(4000, rate=8.0, seed=0)
    assert offsets[0] == 0.0 and offsets == sorted(offsets)
    assert (len(offsets) - 1) / offsets[-1] == pytest.approx(8.0, rel=0.05)
    assert offsets == arrival_offsets(4000, rate=8.0, seed=0)
    assert arrival_offsets(3, math.inf, 0) == [0.0, 0.0, 0.0]
