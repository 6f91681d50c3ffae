"""The KV transfer benchmark and the simulated prefill it overlaps with."""
