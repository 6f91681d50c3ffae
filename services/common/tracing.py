"""Worker-side OpenTelemetry spans that continue the gateway's trace (W3C traceparent in gRPC
metadata). Export is opt-in: OTLP when OTEL_EXPORTER_OTLP_ENDPOINT is set, else spans are no-ops."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from typing import Any

import grpc
from opentelemetry import propagate, trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

log = logging.getLogger(__name__)
TRACER_NAME = "tandem.worker"


def setup_tracing(service_name: str) -> None:
    """Install an OTLP-exporting TracerProvider when the standard OTEL_* variables ask for one."""
    if not os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        return
    try:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError:
        log.warning("OTEL_EXPORTER_OTLP_ENDPOINT is set but the OTLP exporter is not installed "
                    "(pip install 'tandem-serve[otlp]'); no traces are exported")  # fmt: skip
        return
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)


def flush_tracing(timeout_s: float = 2.0, provider: trace.TracerProvider | None = None) -> None:
    """Export the spans still batched (before a process leaves without its atexit handlers);
    ``provider``: the global one unless given."""
    flush = getattr(provider or trace.get_tracer_provider(), "force_flush", None)
    if flush is None:
        return

    def run() -> None:
        with contextlib.suppress(Exception):
            flush(int(timeout_s * 1000))

    # the SDK's batch processor exports synchronously whatever the timeout says: waited for
    # on a thread of its own, at most timeout_s
    done = threading.Thread(target=run, name="trace-flush", daemon=True)
    done.start()
    done.join(timeout_s)


def start_server_span(
    context: grpc.aio.ServicerContext, name: str, attributes: dict[str, Any] | None = None,
    provider: trace.TracerProvider | None = None,
) -> Span:  # fmt: skip
    """A span for one RPC, child of the caller's traceparent. End it with :func:`end_span`."""
    metadata = {k: v for k, v in (context.invocation_metadata() or ()) if isinstance(v, str)}
    parent = propagate.extract(metadata)
    tracer = trace.get_tracer(TRACER_NAME, tracer_provider=provider)
    return tracer.start_span(name, context=parent, kind=SpanKind.SERVER, attributes=attributes)


def child_span(
    parent: Span, name: str, attributes: dict[str, Any] | None = None,
    provider: trace.TracerProvider | None = None,
) -> Span:  # fmt: skip
    ctx = trace.set_span_in_context(parent)
    tracer = trace.get_tracer(TRACER_NAME, tracer_provider=provider)
    return tracer.start_span(name, context=ctx, attributes=attributes)


def end_span(span: Span, error: str | None = None) -> None:
    if error:
        span.set_status(Status(StatusCode.ERROR, error))
    span.end()
