"""Measurements of the Triton kernels: roofline, correctness pass, GEMV sweep, tile tuning."""
