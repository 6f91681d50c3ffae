"""The OpenAI-compatible HTTP gateway: torch-free, it reaches workers only through ``protos/``.

Four layers, each importing only itself and the layers below it (``tests/test_layering.py``):

  http           the HTTP surface: the Starlette app and its routes, the endpoints, SSE frames,
                 response bodies, the server (uvicorn, draining shutdown) and the gateway state
  flows          from a request body to the choices to run and back to text: parsing, the
                 tokenizer and chat template, tools, reasoning and structured outputs, and the
                 concurrent generation of a request's choices
  workers        the worker connections: dispatch (disaggregated or colocated, one retry), the
                 two flows, the router, the registry of gRPC clients, protobuf conversion
  observability  Prometheus and OpenTelemetry metrics, per-request stats, tracing
  core           configuration, API errors and the plain data the layers pass around
"""
