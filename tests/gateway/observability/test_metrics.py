"""/metrics: vLLM-style names and buckets, counts that move, goodput against the SLO, the
--metrics-prefix that lets vLLM's own dashboard read a Tandem gateway, and the shipped dashboard
and alert rules asking only for what the gateway exports."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from gateway.observability.metrics import (
    LATENCY_BUCKETS,
    N_BUCKETS,
    TOKEN_BUCKETS,
    TPOT_BUCKETS,
    TTFT_BUCKETS,
    GatewayMetrics,
    one_two_five,
)
from tests.gateway.fake_workers import ITERATION_TOKENS
from tests.gateway.stack import Stack, wait_for

pytestmark = pytest.mark.timeout(60)
PROMPT = "Hello world, this is a test of the gateway"
DEPLOY = Path(__file__).resolve().parents[3] / "deploy"
DASHBOARD = DEPLOY / "grafana" / "tandem-dashboard.json"
ALERTS = DEPLOY / "prometheus" / "alerts.yaml"

# Every series vLLM's published Grafana dashboard queries, as written in its PromQL:
# vllm-project/vllm examples/observability/prometheus_grafana/grafana.json at commit
# 4b5c627c23e6690b8987100d1cbf78e34ac14bf9 (the newest in the index; the older
# examples/online_serving copy also asked for V0's gpu/cpu_cache_usage_perc and
# num_requests_swapped, which vLLM has since removed). Every panel filters by model_name.
VLLM_DASHBOARD_SERIES = (
    "vllm:e2e_request_latency_seconds_bucket",
    "vllm:e2e_request_latency_seconds_sum",
    "vllm:e2e_request_latency_seconds_count",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:inter_token_latency_seconds_bucket",
    "vllm:inter_token_latency_seconds_sum",
    "vllm:inter_token_latency_seconds_count",
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:time_to_first_token_seconds_bucket",
    "vllm:time_to_first_token_seconds_sum",
    "vllm:time_to_first_token_seconds_count",
    "vllm:kv_cache_usage_perc",
    "vllm:request_prompt_tokens_bucket",
    "vllm:request_generation_tokens_bucket",
    "vllm:request_success_total",  # sum by(finished_reason)
    "vllm:request_queue_time_seconds_sum",
    "vllm:request_prefill_time_seconds_sum",
    "vllm:request_decode_time_seconds_sum",
    "vllm:request_max_num_generation_tokens_sum",
)


def scrape(stack: Stack) -> dict[tuple[str, frozenset], float]:
    text = httpx.get(f"{stack.base_url}/metrics").text
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: dict, name: str, **labels: str) -> float:
    labels = {"model_name": "embedded", **labels}
    return samples.get((name, frozenset(labels.items())), 0.0)


def buckets(samples: dict, name: str) -> list[float]:
    les = [float(dict(k[1])["le"]) for k in samples if k[0] == f"{name}_bucket"]
    return sorted(le for le in les if le != float("inf"))


def test_names_and_buckets_match_vllm(disagg: Stack) -> None:
    httpx.post(f"{disagg.base_url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 3})
    samples = scrape(disagg)
    assert buckets(samples, "tandem:time_to_first_token_seconds") == list(TTFT_BUCKETS)
    assert TTFT_BUCKETS[:3] == (0.001, 0.005, 0.01) and TTFT_BUCKETS[-1] == 2560.0
    for name in ("inter_token_latency", "request_time_per_output_token"):
        assert buckets(samples, f"tandem:{name}_seconds") == list(TPOT_BUCKETS)
    for name in (
        "e2e_request_latency",
        "request_queue_time",
        "request_prefill_time",
        "request_decode_time",
    ):
        assert buckets(samples, f"tandem:{name}_seconds") == list(LATENCY_BUCKETS)
    assert LATENCY_BUCKETS[0] == 0.3 and LATENCY_BUCKETS[-1] == 7680.0
    assert buckets(samples, "tandem:request_inference_time_seconds") == list(LATENCY_BUCKETS)
    for name in (
        "request_prompt_tokens",
        "request_generation_tokens",
        "request_params_max_tokens",
        "request_max_num_generation_tokens",
    ):
        assert buckets(samples, f"tandem:{name}") == list(TOKEN_BUCKETS)
    assert buckets(samples, "tandem:request_params_n") == list(N_BUCKETS)


def test_counts_move_and_ttft_is_within_e2e(disagg: Stack) -> None:
    before = scrape(disagg)
    for max_tokens in (3, 5):
        httpx.post(
            f"{disagg.base_url}/v1/completions", json={"prompt": PROMPT, "max_tokens": max_tokens}
        )
    httpx.post(f"{disagg.base_url}/v1/chat/completions",
               json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 50})  # fmt: skip
    after = scrape(disagg)

    def delta(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert delta("tandem:request_success_total", finished_reason="length") == 2
    assert delta("tandem:request_success_total", finished_reason="stop") == 1  # EOS
    assert delta("tandem:prompt_tokens_total") == 10 + 10 + 31
    assert delta("tandem:generation_tokens_total") == 3 + 5 + 20
    assert delta("tandem:time_to_first_token_seconds_count") == 3
    assert delta("tandem:e2e_request_latency_seconds_count") == 3
    assert (
        0
        < delta("tandem:time_to_first_token_seconds_sum")
        <= delta("tandem:e2e_request_latency_seconds_sum")
    )
    assert delta("tandem:inter_token_latency_seconds_count") == 2 + 4 + 19
    assert delta("tandem:request_prefill_time_seconds_sum") == pytest.approx(3 * 0.002)


def test_a_scored_prompt_counts_no_generated_token(disagg: Stack) -> None:
    """max_tokens 0 with echo: the token the workers generate beside the prompt's logprobs is
    not in usage, nor in the metrics' token counts."""
    before = scrape(disagg)
    body = {"prompt": PROMPT, "max_tokens": 0, "echo": True, "n": 2}
    r = httpx.post(f"{disagg.base_url}/v1/completions", json=body)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 0, r.text
    after = scrape(disagg)

    def delta(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert delta("tandem:request_success_total", finished_reason="length") == 2
    assert delta("tandem:generation_tokens_total") == 0
    assert delta("tandem:request_generation_tokens_sum") == 0
    assert delta("tandem:prompt_tokens_total") == 10


def test_worker_metrics_come_from_get_load(disagg: Stack) -> None:
    samples = scrape(disagg)
    decode = disagg.role("decode")[0]
    labels = {"role": "decode", "worker": "decode-0"}
    assert value(samples, "tandem:kv_transfer_bytes_total", **labels) == 1234
    assert value(samples, "tandem:kv_transfer_granted_total", **labels) == 5
    # /metrics is open: it names workers by role and index, never by address
    assert decode.address not in httpx.get(f"{disagg.base_url}/metrics").text
    listed = httpx.get(f"{disagg.base_url}/workers").json()["workers"]  # behind the API key
    assert {"name": "decode-0", "address": decode.address}.items() <= next(
        w for w in listed if w["role"] == "decode"
    ).items()
    assert value(samples, "tandem:worker_healthy", **labels) == 1
    assert value(samples, "tandem:kv_cache_usage_perc", **labels) == 0.0
    for name in ("num_requests_running", "num_requests_waiting"):
        assert (
            f"tandem:{name}",
            frozenset({"model_name": "embedded", **labels}.items()),
        ) in samples


def test_errors_are_counted_by_status(colocated: Stack) -> None:
    before = value(scrape(colocated), "tandem:request_errors_total", status="400")
    httpx.post(f"{colocated.base_url}/v1/completions", json={"prompt": ""})
    assert value(scrape(colocated), "tandem:request_errors_total", status="400") == before + 1


@pytest.fixture(scope="module")
def slo_stack(tokenizer_dir: str) -> Iterator[Stack]:
    stack = Stack(tokenizer_dir, ["colocated"], slo_ttft_ms=300.0, slo_tpot_ms=50.0).start()
    try:
        yield stack
    finally:
        stack.stop()


def test_goodput_counts_only_requests_within_the_slo(slo_stack: Stack) -> None:
    worker = slo_stack.workers[0]

    def run(first_delay: float, token_delay: float) -> float:
        worker.behavior.first_delay_s, worker.behavior.token_delay_s = first_delay, token_delay
        before = value(scrape(slo_stack), "tandem:request_goodput_total")
        r = httpx.post(
            f"{slo_stack.base_url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 4}
        )
        assert r.status_code == 200
        return value(scrape(slo_stack), "tandem:request_goodput_total") - before

    assert run(0.0, 0.0) == 1  # fast
    assert run(0.0, 0.12) == 0  # TPOT 120 ms > 50 ms
    assert run(0.6, 0.0) == 0  # TTFT 600 ms > 300 ms


def test_genai_otel_metrics(colocated: Stack) -> None:
    httpx.post(f"{colocated.base_url}/v1/chat/completions",
               json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})  # fmt: skip
    data = colocated.metric_reader.get_metrics_data()
    points = {
        m.name: m.data.data_points
        for rm in data.resource_metrics for sm in rm.scope_metrics for m in sm.metrics
    }  # fmt: skip
    (ttft,) = [p for p in points["gen_ai.server.time_to_first_token"]
               if p.attributes["gen_ai.operation.name"] == "chat"]  # fmt: skip
    assert ttft.count >= 1 and ttft.attributes["gen_ai.request.model"] == "embedded"
    assert "gen_ai.server.time_per_output_token" in points


def exported_names(text: str) -> set[str]:
    """Every series name a scrape offers: its samples, and what each family's type promises
    (a labelled family no request has touched yet has no samples)."""
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}
    names: set[str] = set()
    for family in text_string_to_metric_families(text):
        names |= {s.name for s in family.samples}
        names |= {family.name + suffix for suffix in suffixes.get(family.type, ("",))}
    return names


def test_one_two_five_matches_vllm() -> None:
    assert one_two_five(100) == (1, 2, 5, 10, 20, 50, 100)
    assert one_two_five(4096) == (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000)
    assert TOKEN_BUCKETS[-1] == 1_000_000 and N_BUCKETS == (1, 2, 5, 10, 20)


def test_every_family_takes_the_prefix() -> None:
    for prefix in ("tandem:", "vllm:", "my_team:llm_"):
        names = [f.name for f in GatewayMetrics("m", prefix=prefix).registry.collect()]
        assert "worker_healthy" in {n.removeprefix(prefix) for n in names}
        assert all(n.startswith(prefix) for n in names), names


def test_request_series_exist_at_zero_before_the_first_request() -> None:
    """A series born with its first count loses that count to rate() and to a scraper that
    diffs two scrapes (aiperf): each of a fixed label set is exported at 0 from the start."""
    text = GatewayMetrics("m").render().decode()
    samples = {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    m = frozenset({("model_name", "m")})
    for name in ("prompt_tokens_total", "generation_tokens_total", "request_goodput_total",
                 "time_to_first_token_seconds_count", "e2e_request_latency_seconds_count",
                 "inter_token_latency_seconds_count", "request_queue_time_seconds_count",
                 "request_prompt_tokens_count", "request_generation_tokens_count",
                 "request_params_n_count", "request_max_num_generation_tokens_count"):  # fmt: skip
        assert samples[(f"tandem:{name}", m)] == 0.0, name
    for reason in ("stop", "length", "abort"):
        key = ("tandem:request_success_total", m | {("finished_reason", reason)})
        assert samples[key] == 0.0, reason


@pytest.fixture(scope="module")
def vllm_stack(tokenizer_dir: str) -> Iterator[Stack]:
    stack = Stack(tokenizer_dir, ["prefill", "decode"], metrics_prefix="vllm:").start()
    try:
        yield stack
    finally:
        stack.stop()


def test_vllm_prefix_serves_every_series_of_vllms_dashboard(vllm_stack: Stack) -> None:
    vllm_stack.reset()  # every worker polled: their gauges have samples
    for max_tokens in (3, 5):  # two tokens at least: an inter-token gap
        r = httpx.post(f"{vllm_stack.base_url}/v1/completions",
                       json={"prompt": PROMPT, "max_tokens": max_tokens})  # fmt: skip
        assert r.status_code == 200
    text = httpx.get(f"{vllm_stack.base_url}/metrics").text
    samples = [s for f in text_string_to_metric_families(text) for s in f.samples]
    served = {s.name for s in samples if s.labels.get("model_name") == "embedded"}
    missing = [name for name in VLLM_DASHBOARD_SERIES if name not in served]
    assert not missing, f"vLLM's dashboard would find no data for {missing}"
    reasons = {
        s.labels["finished_reason"]: s.value
        for s in samples
        if s.name == "vllm:request_success_total"
    }
    assert reasons == {"length": 2.0, "stop": 0.0, "abort": 0.0}
    assert not any(s.name.startswith("tandem:") for s in samples)


def dashboard_and_alert_queries() -> list[str]:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    exprs = [t["expr"] for p in panels for t in p.get("targets", [])]
    rules = yaml.safe_load(ALERTS.read_text())
    exprs += [r["expr"] for g in rules["groups"] for r in g["rules"]]
    return exprs


def test_the_shipped_dashboard_and_alerts_ask_only_for_exported_series(disagg: Stack) -> None:
    httpx.post(f"{disagg.base_url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 3})
    exported = exported_names(httpx.get(f"{disagg.base_url}/metrics").text)
    queries = dashboard_and_alert_queries()
    asked = {name for q in queries for name in re.findall(r"tandem:[a-zA-Z0-9_:]+", q)}
    assert len(asked) >= 15, "the dashboard and the rules were not read"
    assert sorted(asked - exported) == []
    for must in ("tandem:time_to_first_token_seconds_bucket", "tandem:kv_transfer_failures_total",
                 "tandem:worker_healthy", "tandem:request_errors_total"):  # fmt: skip
        assert must in asked


def test_new_request_histograms_observe_each_choice_and_each_prompt(colocated: Stack) -> None:
    before = scrape(colocated)
    url = f"{colocated.base_url}/v1/completions"
    r = httpx.post(url, json={"prompt": PROMPT, "n": 2, "max_tokens": 5})
    assert r.status_code == 200 and len(r.json()["choices"]) == 2
    r = httpx.post(url, json={"prompt": [PROMPT, PROMPT], "max_tokens": 3})
    assert r.status_code == 200 and len(r.json()["choices"]) == 2
    after = scrape(colocated)

    def delta(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    # per choice, as vLLM observes each of n child requests: 5 + 5 + 3 + 3 tokens
    for name, total in (("request_generation_tokens", 16), ("request_params_max_tokens", 16)):
        assert delta(f"tandem:{name}_count") == 4, name
        assert delta(f"tandem:{name}_sum") == total, name
    assert delta("tandem:request_generation_tokens_bucket", le="2.0") == 0
    assert delta("tandem:request_generation_tokens_bucket", le="5.0") == 4
    # a prompt's tokens once per prompt, whatever its n, as usage counts them
    assert delta("tandem:prompt_tokens_total") == 3 * 10
    assert delta("tandem:request_prompt_tokens_count") == 3
    assert delta("tandem:request_prompt_tokens_sum") == 3 * 10
    # per prompt, once its n choices have all finished: n=2 once, then n=1 twice
    assert delta("tandem:request_params_n_count") == 3
    assert delta("tandem:request_params_n_sum") == 2 + 1 + 1
    assert delta("tandem:request_params_n_bucket", le="1.0") == 2
    assert delta("tandem:request_max_num_generation_tokens_count") == 3
    assert delta("tandem:request_max_num_generation_tokens_sum") == 5 + 3 + 3
    # prefill + decode as the worker timed them: 0.002 + 0.003 x the last token's index
    assert delta("tandem:request_inference_time_seconds_count") == 4
    assert delta("tandem:request_inference_time_seconds_sum") == pytest.approx(
        2 * (0.002 + 0.012) + 2 * (0.002 + 0.006)
    )


def test_iteration_tokens_come_from_each_workers_load(disagg: Stack) -> None:
    samples = scrape(disagg)
    for role, worker in (("prefill", "prefill-1"), ("decode", "decode-0")):
        labels = {"role": role, "worker": worker}
        buckets = [value(samples, "tandem:iteration_tokens_total_bucket", le=le, **labels)
                   for le in ("1.0", "8.0", "16.0", "+Inf")]  # fmt: skip
        assert buckets == [*ITERATION_TOKENS.counts, ITERATION_TOKENS.count]
        assert value(samples, "tandem:iteration_tokens_total_count", **labels) == 6
        assert value(samples, "tandem:iteration_tokens_total_sum", **labels) == 321


def test_finished_requests_are_counted_by_where_their_prompt_was_prefilled(
    disagg: Stack, colocated: Stack
) -> None:
    for stack, mode in ((disagg, "disagg"), (colocated, "colocated")):
        name = "tandem:request_prefill_mode_total"
        before = value(scrape(stack), name, mode=mode, reason="")
        body = {"prompt": "Hello world", "max_tokens": 2}
        assert httpx.post(f"{stack.base_url}/v1/completions", json=body).status_code == 200
        assert value(scrape(stack), name, mode=mode, reason="") == before + 1


def test_a_prompts_tokens_count_once_whatever_its_n(colocated: Stack) -> None:
    """n=4 on a 10-token prompt: prompt_tokens_total and request_prompt_tokens agree (10, one
    observation: the prompt's, as usage counts it); the four choices are four finished
    requests (e2e, success), as vLLM counts its child requests."""
    before = scrape(colocated)
    body = {"prompt": PROMPT, "n": 4, "max_tokens": 2}
    r = httpx.post(f"{colocated.base_url}/v1/completions", json=body)
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 10
    after = scrape(colocated)

    def delta(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert delta("tandem:prompt_tokens_total") == 10
    assert delta("tandem:request_prompt_tokens_sum") == 10
    assert delta("tandem:request_prompt_tokens_count") == 1
    assert delta("tandem:e2e_request_latency_seconds_count") == 4
    assert delta("tandem:request_success_total", finished_reason="length") == 4
    assert delta("tandem:generation_tokens_total") == 4 * 2


@pytest.mark.parametrize("stream", [True, False])
def test_abandoned_requests_are_counted_as_aborts(colocated: Stack, stream: bool) -> None:
    """A client that leaves mid-stream, or before a whole response came: the request counts
    as finished with "abort" (vLLM's), with its latency and the tokens generated before."""
    colocated.workers[0].behavior.token_delay_s = 0.05
    before = scrape(colocated)
    url = f"{colocated.base_url}/v1/completions"
    body = {"prompt": PROMPT, "max_tokens": 200, "stream": stream}
    if stream:
        with httpx.stream("POST", url, json=body) as r:
            lines = (line for line in r.iter_lines() if line.startswith("data: "))
            for _ in range(3):
                next(lines)
    else:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url, json=body, timeout=0.3)

    def delta(name: str, **labels: str) -> float:
        return value(scrape(colocated), name, **labels) - value(before, name, **labels)

    assert wait_for(lambda: delta("tandem:request_success_total", finished_reason="abort") == 1)
    assert delta("tandem:e2e_request_latency_seconds_count") == 1
    assert delta("tandem:e2e_request_latency_seconds_sum") > 0.1
    assert 3 <= delta("tandem:generation_tokens_total") < 200
    assert delta("tandem:request_generation_tokens_count") == 1
    assert delta("tandem:prompt_tokens_total") == 10
    assert delta("tandem:request_goodput_total") == 0
    assert not colocated.state.active
