"""Prometheus metrics with vLLM V1's names, labels and buckets under a prefix (``tandem:``, or
``vllm:`` with ``--metrics-prefix vllm:`` so vLLM's dashboards and alert rules work unchanged).

Request-level series are measured by the gateway; engine-level ones (running, waiting, KV usage,
preemptions, prefix cache, KV transfer, tokens per engine step) come from the workers' GetLoad,
exported per worker.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from gateway.core.events import WorkerLoadInfo
from gateway.observability.stats import RequestStats
from protos.sampling_params import StructuredOutput

DEFAULT_PREFIX = "tandem:"  # --metrics-prefix (checked in gateway.core.config)


def one_two_five(limit: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to ``limit``: vLLM's buckets for token counts."""
    out: list[int] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > limit:
                return tuple(out)
            out.append(mantissa * scale)
        scale *= 10


TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
# vLLM sizes these to the model's context (1-2-5 up to max_model_len); the gateway learns the
# context only from its workers, after the histograms exist, so they reach a million tokens
TOKEN_BUCKETS = one_two_five(1_000_000)
N_BUCKETS = (1, 2, 5, 10, 20)
FINISH_REASONS = ("stop", "length", "abort")  # request_success's finished_reason (vLLM's)

_WORKER_GAUGES = {
    "num_requests_running": ("Requests running on the worker", lambda x: x.num_running),
    "num_requests_waiting": ("Requests waiting on the worker", lambda x: x.num_waiting),
    "kv_cache_usage_perc": ("KV-cache usage, 0..1", lambda x: x.kv_cache_usage),
}
_WORKER_COUNTERS = {
    "num_preemptions": ("Preemptions", lambda x: x.num_preemptions),
    "prefix_cache_queries": ("Prefix-cache queries (tokens)", lambda x: x.prefix_cache_queries),
    "prefix_cache_hits": ("Prefix-cache hits (tokens)", lambda x: x.prefix_cache_hits),
    "kv_transfer_bytes": ("KV bytes transferred", lambda x: x.kv_transfer_bytes),
    "kv_transfer_seconds": ("Seconds spent transferring KV", lambda x: x.kv_transfer_seconds),
    "kv_transfer_failures": ("Failed KV transfers", lambda x: x.kv_transfer_failures),
    "kv_transfer_granted": (
        "KV transfers received into blocks granted with their reservation (one GPU: copied "
        "without asking for the blocks)",
        lambda x: x.kv_transfer_granted,
    ),
    "prefix_cache_host_hits": (
        "Prefix-cache hits served from the host tier (tokens; prefix_cache_hits counts the "
        "device pool's)",
        lambda x: x.prefix_cache_host_hits,
    ),
    "kv_offload_stored_blocks": (
        "KV blocks the device pool evicted that were copied to the host tier",
        lambda x: x.kv_offload_stored_blocks,
    ),
    "kv_offload_restored_blocks": (
        "KV blocks copied back from the host tier instead of recomputed",
        lambda x: x.kv_offload_restored_blocks,
    ),
    "kv_offload_evicted_blocks": (
        "KV blocks dropped from the host tier to make room",
        lambda x: x.kv_offload_evicted_blocks,
    ),
    "spec_decode_num_drafts": (
        "Speculative decoding: verify steps of a request that carried draft tokens",
        lambda x: x.spec_decode_num_drafts,
    ),
    "spec_decode_num_draft_tokens": (
        "Speculative decoding: draft tokens proposed",
        lambda x: x.spec_decode_num_draft_tokens,
    ),
    "spec_decode_num_accepted_tokens": (
        "Speculative decoding: draft tokens accepted",
        lambda x: x.spec_decode_num_accepted_tokens,
    ),
}


class WorkerView(Protocol):
    """What the worker gauges read of a worker (the registry's clients)."""

    @property
    def role(self) -> str: ...

    @property
    def name(self) -> str: ...

    @property
    def healthy(self) -> bool: ...

    @property
    def load(self) -> WorkerLoadInfo | None: ...


class WorkerCollector(Collector):
    """Reads the last GetLoad of every worker at scrape time. Workers are labelled by name
    (``decode-1``), never by address: /metrics is open to anyone who reaches the gateway."""

    def __init__(
        self,
        model_name: str,
        workers: Callable[[], Iterable[WorkerView]],
        prefix: str = DEFAULT_PREFIX,
    ) -> None:
        self._model = model_name
        self._workers = workers
        self._prefix = prefix

    def collect(self) -> Iterator[Metric]:
        labels, p = ["model_name", "role", "worker"], self._prefix
        workers = list(self._workers())
        healthy = GaugeMetricFamily(
            f"{p}worker_healthy", "1 if the worker is healthy", labels=labels
        )
        for w in workers:
            healthy.add_metric([self._model, w.role, w.name], 1.0 if w.healthy else 0.0)
        yield healthy
        loaded = [(w, w.load) for w in workers if w.load is not None]
        for name, (doc, read) in _WORKER_GAUGES.items():
            gauge = GaugeMetricFamily(f"{p}{name}", doc, labels=labels)
            for w, load in loaded:
                gauge.add_metric([self._model, w.role, w.name], float(read(load)))
            yield gauge
        for name, (doc, read) in _WORKER_COUNTERS.items():
            counter = CounterMetricFamily(f"{p}{name}", doc, labels=labels)
            for w, load in loaded:
                counter.add_metric([self._model, w.role, w.name], float(read(load)))
            yield counter
        per_pos = CounterMetricFamily(
            f"{p}spec_decode_num_accepted_tokens_per_pos",
            "Speculative decoding: draft tokens accepted at each draft position (0: the first)",
            labels=[*labels, "position"],
        )
        for w, load in loaded:
            for pos, n in enumerate(load.spec_decode_num_accepted_tokens_per_pos):
                per_pos.add_metric([self._model, w.role, w.name, str(pos)], float(n))
        yield per_pos
        histograms = {
            "iteration_tokens_total": ("Tokens computed per engine step", "iteration_tokens"),
            "grammar_compile_seconds": (
                "Seconds to compile a structured-output grammar (cache hits included)",
                "grammar_compile_seconds",
            ),
        }
        for name, (doc, attr) in histograms.items():
            family = HistogramMetricFamily(f"{p}{name}", doc, labels=labels)
            for w, load in loaded:
                h = getattr(load, attr)
                if h.bounds:  # a worker older than this field reports none
                    buckets = [(floatToGoString(b), float(c))
                               for b, c in zip(h.bounds, h.counts, strict=True)]  # fmt: skip
                    buckets.append(("+Inf", float(h.count)))
                    family.add_metric([self._model, w.role, w.name], buckets, h.sum)
            yield family


class GatewayMetrics:
    def __init__(
        self,
        model_name: str,
        workers: Callable[[], Iterable[WorkerView]] = lambda: (),
        prefix: str = DEFAULT_PREFIX,
    ) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self.prefix = prefix
        m, reg = ["model_name"], self.registry

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(f"{prefix}{name}", doc, m, buckets=buckets, registry=reg)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(f"{prefix}{name}", doc, [*m, *extra], registry=reg)

        self.ttft = hist("time_to_first_token_seconds", "Time to first token", TTFT_BUCKETS)
        self.itl = hist("inter_token_latency_seconds", "Inter-token latency", TPOT_BUCKETS)
        self.tpot = hist(
            "request_time_per_output_token_seconds", "Time per output token", TPOT_BUCKETS
        )
        self.e2e = hist(
            "e2e_request_latency_seconds", "End-to-end request latency", LATENCY_BUCKETS
        )
        self.queue = hist("request_queue_time_seconds", "Time queued in workers", LATENCY_BUCKETS)
        self.prefill = hist("request_prefill_time_seconds", "Prefill time", LATENCY_BUCKETS)
        self.decode = hist("request_decode_time_seconds", "Decode time", LATENCY_BUCKETS)
        self.inference = hist(
            "request_inference_time_seconds", "Prefill plus decode time", LATENCY_BUCKETS
        )
        # A prompt's tokens are counted once per prompt, whatever its n (as usage counts them):
        # request_prompt_tokens observes each prompt once (with its first choice), so its sum
        # is prompt_tokens_total; the other request histograms and
        # request_success count each of the n choices, as vLLM counts its child requests.
        self.request_prompt = hist(
            "request_prompt_tokens",
            "Prompt tokens per prompt (once for all its n choices; its sum is prompt_tokens)",
            TOKEN_BUCKETS,
        )
        self.request_generation = hist(
            "request_generation_tokens", "Generated tokens per request", TOKEN_BUCKETS
        )
        self.params_max_tokens = hist(
            "request_params_max_tokens", "The max_tokens of each request", TOKEN_BUCKETS
        )
        self.params_n = hist("request_params_n", "The n of each request", N_BUCKETS)
        self.max_generation = hist(
            "request_max_num_generation_tokens",
            "Most tokens generated by one of a prompt's n choices",
            TOKEN_BUCKETS,
        )
        self.prompt_tokens = counter(
            "prompt_tokens", "Prompt tokens, each prompt's once whatever its n (as usage counts)"
        )
        self.generation_tokens = counter("generation_tokens", "Generated tokens")
        self.success = counter("request_success", "Finished requests", ("finished_reason",))
        self.goodput = counter("request_goodput", "Requests within the TTFT and TPOT SLO")
        self.modes = counter(
            "request_prefill_mode",
            "Finished requests by where their prompt was prefilled: disagg (a prefill worker), "
            "local (the decode worker: conditional disaggregation) or colocated; for local, the "
            "reason: short (the prompt) or queue (every prefill worker busy); resumed: a request "
            "that went on with another decode worker after its worker died mid-stream",
            ("mode", "reason"),
        )
        self.errors = counter("request_errors", "Requests that failed", ("status",))
        self.structured = counter(
            "structured_output_requests",
            "Requests whose output a grammar constrains, by kind: json, json_object, regex, "
            "choice, grammar, or tool_call (tool_choice required or a named function)",
            ("kind",),
        )
        # Every series of a fixed label set exists from the start at 0, as in vLLM: rate() and
        # a scraper diffing two scrapes (aiperf) would otherwise lose each series' first count.
        # Those whose labels depend on what happens (an error's status, a prefill mode, a
        # structured-output kind) appear with their first count.
        for metric in (self.ttft, self.itl, self.tpot, self.e2e, self.queue, self.prefill,
                       self.decode, self.inference, self.request_prompt, self.request_generation,
                       self.params_max_tokens, self.params_n, self.max_generation,
                       self.prompt_tokens, self.generation_tokens, self.goodput):  # fmt: skip
            metric.labels(model_name)
        for reason in FINISH_REASONS:
            self.success.labels(model_name, reason)
        reg.register(WorkerCollector(model_name, workers, prefix))

    def observe_gap(self, gap: float) -> None:
        self.itl.labels(self.model_name).observe(gap)

    def observe_finished(self, stats: RequestStats, finish_reason: str, in_slo: bool) -> None:
        """One finished choice (what vLLM counts as one request: n=2 is two); its prompt's
        tokens only where ``stats`` counts them (once per prompt)."""
        name = self.model_name
        if stats.ttft is not None:
            self.ttft.labels(name).observe(stats.ttft)
        if stats.tpot is not None:
            self.tpot.labels(name).observe(stats.tpot)
        self.e2e.labels(name).observe(stats.e2e)
        self.queue.labels(name).observe(stats.timing.queue_s)
        self.prefill.labels(name).observe(stats.timing.prefill_s)
        self.decode.labels(name).observe(stats.timing.decode_s)
        self.inference.labels(name).observe(stats.timing.prefill_s + stats.timing.decode_s)
        if stats.num_prompt_tokens:  # the prompt's first choice (0 for its others)
            self.request_prompt.labels(name).observe(stats.num_prompt_tokens)
            self.prompt_tokens.labels(name).inc(stats.num_prompt_tokens)
        self.request_generation.labels(name).observe(stats.num_output_tokens)
        if stats.max_tokens:
            self.params_max_tokens.labels(name).observe(stats.max_tokens)
        self.generation_tokens.labels(name).inc(stats.num_output_tokens)
        self.success.labels(name, finish_reason).inc()
        if stats.timing.mode:
            self.modes.labels(name, stats.timing.mode, stats.timing.local_reason).inc()
        if in_slo and finish_reason != "abort":
            self.goodput.labels(name).inc()

    def observe_embeddings(self, num_inputs: int, num_prompt_tokens: int, e2e_s: float) -> None:
        """An embeddings request served: its prompt tokens, one success per input (as vLLM
        counts a pooling request; finished_reason stop) and its latency."""
        name = self.model_name
        self.prompt_tokens.labels(name).inc(num_prompt_tokens)
        self.success.labels(name, "stop").inc(num_inputs)
        self.e2e.labels(name).observe(e2e_s)

    def observe_prompt_finished(self, n: int, max_generated: int) -> None:
        """Every choice of one prompt has finished: its n, and the most tokens one generated."""
        self.params_n.labels(self.model_name).observe(n)
        self.max_generation.labels(self.model_name).observe(max_generated)

    def observe_structured(self, so: StructuredOutput | None, tool_choice: str | None) -> None:
        """A request with a grammar, by kind; one whose grammar comes from its tools (tool_choice
        "required" or a named function, strict functions under "auto") counts as "tool_call"."""
        if so is not None:
            forced = tool_choice in ("required", "function") or so.source == "tools"
            self.structured.labels(self.model_name, "tool_call" if forced else so.kind).inc()

    def observe_error(self, status: int) -> None:
        self.errors.labels(self.model_name, str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
