"""Measurements of a worker's serving path on the CPU (a fake engine behind the real servicer)."""
