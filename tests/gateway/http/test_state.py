"""The gateway's state on the way out: its telemetry exporters get a bounded time to finish."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Sequence

import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

import gateway.http.state as state_module
from gateway.core.config import GatewayConfig, WorkerSpec
from gateway.observability import tracing

pytestmark = pytest.mark.timeout(60)


class StuckExporter(SpanExporter):
    """An exporter whose collector never answers: export returns only when released (as the
    OTLP exporter's retries against an unreachable collector, ~10 s a batch)."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.entered.set()
        self.release.wait(30)
        return SpanExportResult.FAILURE

    def shutdown(self) -> None:
        self.release.wait(30)


def test_close_leaves_a_stuck_trace_exporter_behind(
    tokenizer_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    exporter = StuckExporter()
    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=1))
    monkeypatch.setattr(state_module, "build_tracer_provider", lambda endpoint: provider)
    monkeypatch.setattr(tracing, "SHUTDOWN_TIMEOUT_S", 0.3)
    config = GatewayConfig(
        tokenizer=tokenizer_dir, workers=(WorkerSpec("colocated", "127.0.0.1:1"),)
    )

    async def run() -> float:  # the state's gRPC channels belong to a running loop
        state = state_module.GatewayState(config)
        assert state.tracer_provider is provider
        with state.tracer.start_as_current_span("request"):
            pass
        assert exporter.entered.wait(10)  # the batch is being exported, and will not finish
        start = time.monotonic()
        await state.close()
        return time.monotonic() - start

    try:
        assert asyncio.run(run()) < 5.0  # not the exporter's 30 s
        assert not exporter.release.is_set()
    finally:
        exporter.release.set()


def test_shutdown_bounded_says_whether_it_finished() -> None:
    release = threading.Event()
    assert tracing.shutdown_bounded(lambda: None, "quick", timeout_s=5.0)
    try:
        assert not tracing.shutdown_bounded(lambda: release.wait(30), "stuck", timeout_s=0.1)
    finally:
        release.set()
    # an exporter that raises is logged, and counts as finished: nothing is left running
    assert tracing.shutdown_bounded(lambda: 1 / 0, "failing", timeout_s=5.0)
