"""The latency benchmark's roofline counts what a decode step reads, quantized layers included."""

from __future__ import annotations

import torch

from services.engine.bench.in_process import _weight_bytes


class _Packed(torch.nn.Module):
    """Like a quantized linear layer: its weight and scales are buffers, not parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("qweight", torch.zeros(4, 16, dtype=torch.int32))  # 256 bytes
        self.register_buffer("scales", torch.zeros(1, 16, dtype=torch.bfloat16))  # 32 bytes


def test_buffers_of_packed_layers_count_and_the_rotary_table_does_not() -> None:
    model = torch.nn.Module()
    model.norm = torch.nn.Linear(8, 8, bias=False)  # 64 fp32 parameters: 256 bytes
    model.proj = _Packed()
    model.register_buffer("cos_sin", torch.zeros(100, 64))  # not weights
    assert _weight_bytes(model) == 256 + 256 + 32
