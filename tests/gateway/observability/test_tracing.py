"""One trace per request: the client's traceparent, GenAI attributes, child spans per worker call,
and the traceparent carried into the workers' gRPC metadata."""

from __future__ import annotations

import httpx
import pytest
from opentelemetry.trace import SpanKind, StatusCode

from gateway.observability.tracing import build_tracer_provider
from tests.gateway.stack import Stack

pytestmark = pytest.mark.timeout(60)
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"


def spans_by_name(stack: Stack) -> dict:
    return {s.name: s for s in stack.exporter.get_finished_spans()}


def test_request_span_with_children_and_traceparent_to_workers(disagg: Stack) -> None:
    r = httpx.post(
        f"{disagg.base_url}/v1/completions",
        json={"prompt": "Hello world, this is", "max_tokens": 3, "temperature": 0.5, "seed": 3},
        headers={"traceparent": TRACEPARENT},
    )
    spans = spans_by_name(disagg)
    root = spans["text_completion embedded"]
    assert format(root.context.trace_id, "032x") == TRACE_ID
    assert format(root.parent.span_id, "016x") == PARENT_ID
    assert root.kind == SpanKind.SERVER
    attrs = root.attributes
    assert attrs["gen_ai.operation.name"] == "text_completion"
    assert (attrs["gen_ai.request.max_tokens"], attrs["gen_ai.request.temperature"]) == (3, 0.5)
    assert attrs["gen_ai.request.seed"] == 3 and attrs["gen_ai.request.top_p"] == 1.0
    assert attrs["gen_ai.response.id"] == r.json()["id"]
    assert attrs["gen_ai.response.finish_reasons"] == ("length",)
    assert (attrs["gen_ai.usage.input_tokens"], attrs["gen_ai.usage.output_tokens"]) == (5, 3)
    for name in ("Reserve", "Prefill", "KV transfer", "Decode"):
        assert spans[name].parent.span_id == root.context.span_id, name
        assert spans[name].kind == SpanKind.CLIENT
    assert spans["KV transfer"].attributes["tandem.kv.bytes"] == 4096

    # each worker call carried a traceparent naming its own child span
    seen = [m["traceparent"] for w in disagg.workers for m in w.records.metadata]
    expected = {
        f"00-{TRACE_ID}-{format(spans[name].context.span_id, '016x')}-01"
        for name in ("Reserve", "Prefill", "Decode")
    }
    assert expected <= set(seen)


def test_a_new_trace_without_traceparent(colocated: Stack) -> None:
    httpx.post(f"{colocated.base_url}/v1/chat/completions",
               json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})  # fmt: skip
    spans = spans_by_name(colocated)
    root, child = spans["chat embedded"], spans["Generate"]
    assert root.parent is None and child.parent.span_id == root.context.span_id
    traceparent = colocated.workers[0].records.metadata[0]["traceparent"]
    assert traceparent.split("-")[1] == format(root.context.trace_id, "032x")


def test_failed_requests_mark_their_spans(colocated: Stack) -> None:
    colocated.workers[0].behavior.fail_after_tokens = 1
    httpx.post(
        f"{colocated.base_url}/v1/completions", json={"prompt": "Hello world", "max_tokens": 5}
    )
    spans = spans_by_name(colocated)
    assert spans["text_completion embedded"].status.status_code == StatusCode.ERROR
    assert spans["Generate"].status.status_code == StatusCode.ERROR


def test_no_exporter_without_an_endpoint(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        monkeypatch.delenv(var, raising=False)
    provider = build_tracer_provider(None)
    assert provider._active_span_processor._span_processors == ()


def test_otlp_endpoint_without_the_exporter_package_warns(caplog: pytest.LogCaptureFixture) -> None:
    pytest.importorskip("opentelemetry.sdk")
    try:
        import opentelemetry.exporter.otlp.proto.grpc  # noqa: F401
    except ImportError:
        provider = build_tracer_provider("http://127.0.0.1:4317")
        assert provider._active_span_processor._span_processors == ()
        assert "opentelemetry-exporter-otlp is not installed" in caplog.text
    else:
        provider = build_tracer_provider("http://127.0.0.1:4317")
        assert len(provider._active_span_processor._span_processors) == 1
        provider.shutdown()
