"""OpenTelemetry GenAI server metrics (time to first token, time per output token).

Recorded on the given MeterProvider, else the global one (a no-op unless the process sets one up),
or one exporting over OTLP when an endpoint is configured.
"""

from __future__ import annotations

import logging
import os

from opentelemetry import metrics
from opentelemetry.metrics import MeterProvider

from gateway.observability.stats import RequestStats

log = logging.getLogger(__name__)


def build_meter_provider(otlp_endpoint: str | None) -> MeterProvider | None:
    endpoint = (
        otlp_endpoint
        or os.environ.get("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT")
        or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    )
    if not endpoint:
        return None
    try:
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
        from opentelemetry.sdk.metrics import MeterProvider as SdkMeterProvider
        from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
    except ImportError:
        log.warning("OTLP endpoint set but opentelemetry-exporter-otlp is not installed")
        return None
    reader = PeriodicExportingMetricReader(OTLPMetricExporter(endpoint=endpoint))
    return SdkMeterProvider(metric_readers=[reader])


class GenAiMetrics:
    def __init__(self, model: str, provider: MeterProvider | None = None) -> None:
        meter = (provider or metrics.get_meter_provider()).get_meter("tandem.gateway")
        self._model = model
        self._ttft = meter.create_histogram(
            "gen_ai.server.time_to_first_token", unit="s", description="Time to first token"
        )
        self._tpot = meter.create_histogram(
            "gen_ai.server.time_per_output_token",
            unit="s",
            description="Time per output token after the first",
        )

    def record(self, operation: str, stats: RequestStats) -> None:
        attributes = {"gen_ai.operation.name": operation, "gen_ai.request.model": self._model}
        if stats.ttft is not None:
            self._ttft.record(stats.ttft, attributes)
        if stats.tpot is not None:
            self._tpot.record(stats.tpot, attributes)
