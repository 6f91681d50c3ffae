"""Where a finished request is recorded: Prometheus, OpenTelemetry GenAI metrics, the SLO."""

from __future__ import annotations

from dataclasses import dataclass

from gateway.observability.metrics import GatewayMetrics
from gateway.observability.otel_metrics import GenAiMetrics
from gateway.observability.stats import RequestStats


@dataclass(frozen=True)
class Slo:
    ttft_s: float
    tpot_s: float


@dataclass(frozen=True)
class Telemetry:
    metrics: GatewayMetrics
    genai: GenAiMetrics
    slo: Slo

    def finished(self, operation: str, stats: RequestStats, finish_reason: str) -> None:
        in_slo = stats.meets_slo(self.slo.ttft_s, self.slo.tpot_s)
        self.metrics.observe_finished(stats, finish_reason, in_slo)
        self.genai.record(operation, stats)
