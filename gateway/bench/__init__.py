"""Clients of a running gateway: `tandem bench serve` (the serving benchmark against any
OpenAI-compatible endpoint), `python -m gateway.bench.stall` (stalls of its streams) and
`python -m gateway.bench.cancel` (pools free after a client hangs up)."""
