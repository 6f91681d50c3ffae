"""`tandem bench serve` end to end against a fake streaming server with known delays."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from gateway.bench.serve import api_root, main, parse_rates
from services.cli import build_parser
from tests.gateway.bench.fake_server import Behaviour, serve
from tests.gateway.bench.test_dataset import make_tokenizer


def bench_args(base_url: str, *flags: str) -> argparse.Namespace:
    argv = ["bench", "serve", "--base-url", base_url, "--num-prompts", "8"]
    argv += ["--input-len", "16", "--output-len", "5", *flags]
    return build_parser().parse_args(argv)


def test_report_has_vllm_fields_latencies_and_failures(tmp_path: Path, capsys) -> None:
    behaviour = Behaviour(ttft_s=0.05, itl_s=0.01, fail_every=4)
    out, plot = tmp_path / "bench.json", tmp_path / "latency.png"
    with serve(behaviour) as url:
        args = bench_args(url, "--request-rate", "inf", "--request-rate", "50")
        args.json_out, args.plot = str(out), str(plot)
        assert main(args) == 0
    report = json.loads(out.read_text())
    assert report["config"]["model"] == "fake-model"
    assert report["config"]["request_rates"] == ["inf", 50.0]
    assert report["config"]["dataset"] == "random-ids"
    assert [r["request_rate"] for r in report["results"]] == ["inf", 50.0]
    for result in report["results"]:
        assert (result["completed"], result["failed"]) == (6, 2)
        assert list(result["errors"]) == ["HTTP 503: no decode worker can take this request"]
        assert result["total_output_tokens"] == 6 * 5
        assert result["total_input_tokens"] == 6 * 16
        # Only bounds that no machine load can break: the server sleeps 50 ms before the first
        # token and 10 ms between tokens (so each figure has a floor), and every latency lies
        # within the run's duration (so a unit or origin error cannot pass either).
        assert min(result["ttfts_ms"]) >= 50
        assert result["median_ttft_ms"] <= result["p90_ttft_ms"] <= result["p99_ttft_ms"]
        assert result["median_itl_ms"] >= 8 and result["mean_tpot_ms"] >= 8
        for ttft, e2el in zip(result["ttfts_ms"], result["e2els_ms"], strict=True):
            assert ttft <= e2el <= result["duration"] * 1000  # buffered tokens may arrive together
        # TPOT is (E2E - TTFT) / 4 per request here, so the means obey the same relation, and
        # the four gaps after the first token fit inside that same span.
        span = result["mean_e2el_ms"] - result["mean_ttft_ms"]
        assert result["mean_tpot_ms"] == pytest.approx(span / 4)
        assert 4 * result["mean_itl_ms"] <= span + 1e-6
        assert result["request_throughput"] == pytest.approx(6 / result["duration"])
        assert result["output_throughput"] == pytest.approx(30 / result["duration"])
        assert result["total_token_throughput"] == pytest.approx(126 / result["duration"])
        for key in ("goodput", "request_goodput", "std_ttft_ms", "p99_e2el_ms", "p90_tpot_ms"):
            assert key in result
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    printed = capsys.readouterr().out
    assert printed.count("Serving Benchmark Result") == 2 and "TTFT p50/p90/p99" in printed


def test_requests_ask_for_exact_fixed_length_work(tmp_path: Path) -> None:
    behaviour = Behaviour(ttft_s=0.0, itl_s=0.0)
    with serve(behaviour) as url:
        assert main(bench_args(url + "/v1/")) == 0  # a base URL ending in /v1 works too
    assert len(behaviour.bodies) == 8
    for body in behaviour.bodies:
        assert body["ignore_eos"] is True and body["stream"] is True
        assert body["stream_options"] == {"include_usage": True}
        assert body["max_tokens"] == 5 and body["model"] == "fake-model"
        assert isinstance(body["prompt"], list) and len(body["prompt"]) == 16


def test_goodput_counts_only_requests_within_the_slos(tmp_path: Path) -> None:
    out = tmp_path / "b.json"
    with serve(Behaviour(ttft_s=0.08, itl_s=0.0)) as url:
        tight = bench_args(url, "--slo-ttft-ms", "20", "--json-out", str(out))
        assert main(tight) == 0
        assert json.loads(out.read_text())["results"][0]["goodput"] == 0.0
        loose = bench_args(
            url, "--slo-ttft-ms", "5000", "--slo-tpot-ms", "5000", "--json-out", str(out)
        )
        assert main(loose) == 0
    result = json.loads(out.read_text())["results"][0]
    assert result["goodput"] == pytest.approx(result["request_throughput"])


def test_error_frames_mid_stream_are_failures(tmp_path: Path) -> None:
    out = tmp_path / "b.json"
    with serve(Behaviour(ttft_s=0.0, itl_s=0.0, error_frame_every=2)) as url:
        assert main(bench_args(url, "--json-out", str(out))) == 0
    result = json.loads(out.read_text())["results"][0]
    assert (result["completed"], result["failed"]) == (4, 4)
    assert result["errors"] == {"stream error: decode worker died": 4}


def test_max_concurrency_caps_requests_in_flight() -> None:
    behaviour = Behaviour(ttft_s=0.02, itl_s=0.005)
    with serve(behaviour) as url:
        assert main(bench_args(url, "--max-concurrency", "2")) == 0
    assert behaviour.peak_in_flight == 2


def test_chat_endpoint_with_a_tokenizer_sends_messages(tmp_path: Path) -> None:
    behaviour = Behaviour(ttft_s=0.0, itl_s=0.0)
    out = tmp_path / "b.json"
    with serve(behaviour) as url:
        args = bench_args(
            url, "--endpoint", "/v1/chat/completions", "--tokenizer", str(make_tokenizer(tmp_path))
        )
        args.json_out = str(out)
        assert main(args) == 0
    body = behaviour.bodies[0]
    assert body["max_completion_tokens"] == 5 and body["messages"][0]["role"] == "user"
    assert json.loads(out.read_text())["results"][0]["completed"] == 8


def test_all_requests_failing_is_an_error_exit() -> None:
    with serve(Behaviour(fail_every=1)) as url:
        assert main(bench_args(url)) == 1


def test_unreachable_server_is_reported_clearly(capsys) -> None:
    assert main(bench_args("http://127.0.0.1:9")) == 2
    assert "cannot use http://127.0.0.1:9" in capsys.readouterr().err


def test_request_rates_parse_lists_and_infinity() -> None:
    assert parse_rates(None) == [float("inf")]
    assert parse_rates(["1,2.5", "inf"]) == [1.0, 2.5, float("inf")]
    with pytest.raises(ValueError, match="positive"):
        parse_rates(["0"])


def test_api_root_accepts_urls_with_or_without_v1() -> None:
    assert api_root("http://h:8000/v1/") == api_root("http://h:8000") == "http://h:8000"
