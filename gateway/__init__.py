"""The OpenAI-compatible HTTP gateway: torch-free, it reaches workers only through ``protos/``.

A request's path through the modules:
  app            the Starlette app (routes, API key, error handlers, lifespan) from a GatewayConfig
  transport      bounded JSON bodies, SSE responses, client-disconnect detection
  protocol       request bodies -> validated dataclasses (fields: typed readers, errors: 4xx/5xx)
  tokenizer      tokenizers + Jinja chat templates (chat_template), ids identical to transformers
  prepare        vocabulary and context-length checks, max_tokens, n choices with seeds
  openai_api     /v1/completions and /v1/chat/completions; streaming: SSE frames; formats: bodies
  generation     runs a request's choices concurrently, records metrics and the request span
  dispatch       picks disaggregated (disagg) or colocated (colocated) flow, retries once
  router         prefix-affinity rendezvous hashing; decode admission by free KV blocks
  registry       the workers (workers: one gRPC client each) polled for health and load
  convert        the one place protobuf becomes plain data (events)
  upstream       gRPC status codes -> HTTP errors
  metrics        Prometheus (vLLM names and buckets); otel_metrics: GenAI metrics; telemetry: SLO
  tracing        OpenTelemetry spans and traceparent propagation into gRPC metadata
  admin_api      health, metrics, models, tokenize, detokenize, version, workers, openapi.json
  server         ``tandem gateway``: uvicorn on uvloop, draining shutdown, ready file
"""
