"""Metrics (Prometheus, OpenTelemetry), per-request stats and SLO accounting, tracing."""
