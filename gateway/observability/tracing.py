"""OpenTelemetry: one span per request (GenAI conventions), children per worker call, and the
W3C traceparent carried into gRPC metadata.

Spans are started and ended explicitly (no ``use_span``): the request's work crosses tasks and
async generators, where attaching and detaching a context would not pair up.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

log = logging.getLogger(__name__)
_PROPAGATOR = TraceContextTextMapPropagator()
Metadata = tuple[tuple[str, str], ...]
# how long the gateway's exit waits for its telemetry to leave: an OTLP exporter whose
# collector cannot be reached retries for ~10 s a batch, and the SDK's shutdowns wait for it
SHUTDOWN_TIMEOUT_S = 2.0


def build_tracer_provider(otlp_endpoint: str | None = None) -> TracerProvider:
    """Exports over OTLP only when an endpoint is given here or in OTEL_EXPORTER_OTLP_*."""
    provider = TracerProvider(resource=Resource.create({"service.name": "tandem-gateway"}))
    endpoint = (
        otlp_endpoint
        or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    )
    if endpoint:
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        except ImportError:
            log.warning("OTLP endpoint set but opentelemetry-exporter-otlp is not installed")
            return provider
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    return provider


def shutdown_bounded(shutdown: Callable[[], object], what: str,
                     timeout_s: float | None = None) -> bool:  # fmt: skip
    """Run a telemetry provider's ``shutdown`` (its last export) for at most ``timeout_s``
    (:data:`SHUTDOWN_TIMEOUT_S` unless given): on a
    daemon thread, left behind when it takes longer (the process is leaving; what it had not
    exported is lost, as with an unreachable collector anyway). Whether it finished."""

    def run() -> None:
        try:
            shutdown()
        except Exception:  # the exporter's own errors: exiting regardless
            log.exception("%s shutdown failed", what)

    limit = SHUTDOWN_TIMEOUT_S if timeout_s is None else timeout_s
    start = time.monotonic()
    thread = threading.Thread(target=run, name=f"{what}-shutdown", daemon=True)
    thread.start()
    thread.join(limit)
    if thread.is_alive():
        log.warning("%s did not finish exporting within %.1f s (is the OTLP collector "
                    "reachable?); leaving without it", what, time.monotonic() - start)  # fmt: skip
        return False
    return True


def get_tracer(provider: TracerProvider) -> Tracer:
    return provider.get_tracer("tandem.gateway")


def start_request_span(
    tracer: Tracer, operation: str, model: str, headers: Mapping[str, str]
) -> Span:
    """The span ``"{operation} {model}"``, a child of the client's traceparent if it sent one."""
    parent = _PROPAGATOR.extract(carrier=dict(headers))
    span = tracer.start_span(f"{operation} {model}", context=parent, kind=SpanKind.SERVER)
    span.set_attribute("gen_ai.operation.name", operation)
    span.set_attribute("gen_ai.system", "tandem")
    span.set_attribute("gen_ai.request.model", model)
    return span


def child_span(tracer: Tracer, name: str, parent: Span, **attributes: Any) -> Span:
    span = tracer.start_span(name, context=trace.set_span_in_context(parent), kind=SpanKind.CLIENT)
    for key, value in attributes.items():
        if value is not None:
            span.set_attribute(key, value)
    return span


def grpc_metadata(span: Span) -> Metadata:
    """``traceparent`` (and ``tracestate``) naming ``span`` as the parent, for a gRPC call."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(span, Context()))
    return tuple(carrier.items())


def set_request_attributes(span: Span, attributes: Mapping[str, Any]) -> None:
    for key, value in attributes.items():
        if value is not None:
            span.set_attribute(f"gen_ai.request.{key}", value)


def end_request_span(
    span: Span,
    response_id: str,
    model: str,
    finish_reasons: Sequence[str],
    input_tokens: int,
    output_tokens: int,
    error: str | None = None,
) -> None:
    span.set_attribute("gen_ai.response.id", response_id)
    span.set_attribute("gen_ai.response.model", model)
    span.set_attribute("gen_ai.response.finish_reasons", list(finish_reasons))
    span.set_attribute("gen_ai.usage.input_tokens", input_tokens)
    span.set_attribute("gen_ai.usage.output_tokens", output_tokens)
    end_span(span, error)


def end_span(span: Span, error: str | None = None) -> None:
    if error:
        span.set_status(Status(StatusCode.ERROR, error))
    span.end()
