"""What `tandem bench disagg` runs and when: parsing, prompts per rate, GPU split, time budget."""

from __future__ import annotations

import math
import time

import pytest

from deploy.bench.plan import (
    Budget,
    check_local_prefill_tokens,
    estimate_run_s,
    fits,
    parse_rates,
    parse_topologies,
    parse_workloads,
    prompts_for_rate,
    rate_label,
    topology,
)


def test_workloads_rates_and_topology_names_parse() -> None:
    workloads = parse_workloads("1024:128, 4096:256")
    assert [(w.key, w.label) for w in workloads] == [
        ("1024:128", "1024in-128out"),
        ("4096:256", "4096in-256out"),
    ]
    rates = parse_rates(["8,2,4,4", "4096:256=1,inf"], workloads)
    assert rates == {"1024:128": [2.0, 4.0, 8.0], "4096:256": [1.0, math.inf]}
    assert parse_rates(None, workloads)["4096:256"] == [2.0, 4.0, 8.0]
    with pytest.raises(ValueError, match="not in --workloads"):
        parse_rates(["16:4=1"], workloads)
    with pytest.raises(ValueError):
        parse_workloads("1024x128")
    with pytest.raises(ValueError):
        parse_rates(["0"], workloads)
    assert parse_topologies("colocated,disagg,colocated") == ["colocated", "disagg"]
    assert parse_topologies("none") == []
    with pytest.raises(ValueError, match="unknown topology"):
        parse_topologies("pipelined")
    assert [rate_label(r) for r in (2.0, 0.5, math.inf, "inf")] == ["2", "0.5", "inf", "inf"]


def test_prompts_per_rate_follow_the_duration_within_bounds() -> None:
    assert prompts_for_rate(4.0, 200, 16, 30.0) == 120
    assert prompts_for_rate(0.1, 200, 16, 30.0) == 16
    assert prompts_for_rate(50.0, 200, 16, 30.0) == 200
    assert prompts_for_rate(math.inf, 64, 16, 30.0) == 64
    assert prompts_for_rate(4.0, 8, 16, 0) == 8


def test_topologies_split_the_gpus() -> None:
    two = ["0", "1"]
    assert topology("disagg", two, 2, None).up_flags == ["--prefill", "1", "--decode", "1"]
    assert topology("colocated", two, 2, None).up_flags == ["--colocated", "2"]
    four = ["0", "1", "2", "3"]
    assert topology("disagg", four, 2, None).up_flags == ["--prefill", "2", "--decode", "2"]
    assert topology("disagg", four, 2, 1).up_flags == ["--prefill", "1", "--decode", "3"]
    assert topology("disagg", four, 2, 9).up_flags == ["--prefill", "3", "--decode", "1"]
    assert topology("colocated", four, 2, None).up_flags == ["--colocated", "4"]
    # no GPU: --workers processes; a disaggregated pair needs two even on one GPU
    assert topology("colocated", [], 3, None).up_flags == ["--colocated", "3"]
    assert topology("disagg", [], 1, None).up_flags == ["--prefill", "1", "--decode", "1"]
    assert topology("disagg", ["0"], 2, None).up_flags == ["--prefill", "1", "--decode", "1"]
    # conditional disaggregation: the disagg shape, plus the gateway's threshold
    assert topology("disagg-local", two, 2, None, 512).up_flags == [
        "--prefill", "1", "--decode", "1", "--max-local-prefill-tokens", "512"
    ]  # fmt: skip
    assert topology("disagg-local", two, 2, None).up_flags[-1] == "1024"
    # the whole KV after the first token instead of streamed while the prompt is computed
    assert topology("disagg-whole", two, 2, None).up_flags == [
        "--prefill", "1", "--decode", "1", "--kv-streaming", "off"
    ]  # fmt: skip
    assert topology("disagg-streamed", two, 2, None).up_flags == [
        "--prefill", "1", "--decode", "1", "--kv-streaming", "on"
    ]  # fmt: skip
    check_local_prefill_tokens(None, ["disagg"])
    check_local_prefill_tokens(512, ["disagg", "disagg-local"])
    with pytest.raises(ValueError, match="needs the disagg-local topology"):
        check_local_prefill_tokens(512, ["disagg", "colocated"])  # never silently unused
    with pytest.raises(ValueError, match="at least 1"):
        check_local_prefill_tokens(0, ["disagg-local"])
    check_local_prefill_tokens(None, ["disagg-local"], 2)
    with pytest.raises(ValueError, match="--local-prefill-queue needs the disagg-local"):
        check_local_prefill_tokens(None, ["disagg"], 2)
    with pytest.raises(ValueError, match="--local-prefill-queue must be at least 1"):
        check_local_prefill_tokens(None, ["disagg-local"], 0)


def test_budget_shares_what_is_left() -> None:
    assert Budget(None).share(3) is None and fits(1e9, None)
    budget = Budget(time.monotonic() + 100)
    share = budget.share(2, reserve_s=20)
    assert share is not None and 39 < share - time.monotonic() <= 40
    assert fits(10, share) and not fits(60, share)
    assert estimate_run_s(4.0, 40, 5.0) == 17.0
    assert estimate_run_s(math.inf, 40, 5.0) == 7.0
