"""Measurements of the in-process engine: throughput, step latency, parity, a profiled step."""
