"""Worker spans continue the caller's W3C trace carried in gRPC metadata; batched spans are
exported before a worker leaves without its atexit handlers."""

from __future__ import annotations

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from services.common.tracing import child_span, end_span, flush_tracing, start_server_span

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"


class FakeContext:
    def __init__(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self._metadata = metadata

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata


def _provider() -> tuple[TracerProvider, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider, exporter


def test_server_span_is_a_child_of_the_incoming_traceparent() -> None:
    provider, exporter = _provider()
    ctx = FakeContext((("traceparent", f"00-{TRACE_ID}-{PARENT_ID}-01"),))
    span = start_server_span(ctx, "prefill", {"tandem.request_id": "r1"}, provider=provider)  # type: ignore[arg-type]
    transfer = child_span(span, "kv transfer", provider=provider)
    end_span(transfer, "peer died")
    end_span(span)
    by_name = {s.name: s for s in exporter.get_finished_spans()}
    prefill, kv = by_name["prefill"], by_name["kv transfer"]
    assert f"{prefill.context.trace_id:032x}" == TRACE_ID
    assert prefill.parent is not None and f"{prefill.parent.span_id:016x}" == PARENT_ID
    assert prefill.kind is SpanKind.SERVER and prefill.attributes["tandem.request_id"] == "r1"
    assert kv.parent is not None and kv.parent.span_id == prefill.context.span_id
    assert (
        kv.status.status_code is StatusCode.ERROR and prefill.status.status_code is StatusCode.UNSET
    )


def test_without_traceparent_a_new_trace_starts() -> None:
    provider, exporter = _provider()
    end_span(start_server_span(FakeContext(()), "decode", provider=provider))  # type: ignore[arg-type]
    (span,) = exporter.get_finished_spans()
    assert span.parent is None and span.context.trace_id != 0


def test_flush_exports_the_spans_still_batched() -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=600_000))
    end_span(start_server_span(FakeContext(()), "decode", provider=provider))  # type: ignore[arg-type]
    assert exporter.get_finished_spans() == ()  # waits for the batch
    flush_tracing(provider=provider)
    assert [s.name for s in exporter.get_finished_spans()] == ["decode"]
    provider.shutdown()
