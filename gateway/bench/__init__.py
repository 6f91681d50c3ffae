"""Clients of a running gateway: `tandem bench serve` (the serving benchmark against any
OpenAI-compatible endpoint) and `python -m gateway.bench.stall` (stalls of its streams)."""
