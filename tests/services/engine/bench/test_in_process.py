"""The latency benchmark's roofline counts what a decode step reads, quantized layers included."""

from __future__ import annotations

import pytest
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


def test_offline_with_images_runs_a_tiny_vl_model_with_dummy_weights(tmp_path) -> None:
    """W1 with one image per prompt (``--image-size``): every prompt's image tokens are counted
    and encoded; the report says how many tokens went through."""
    import json

    from services.cli import build_parser
    from services.engine.bench.in_process import main_offline
    from tests.services.vl_model import build

    build(tmp_path / "vl")
    out = tmp_path / "w1.json"
    argv = ["bench", "offline", "--model", str(tmp_path / "vl"), "--load-format", "dummy",
            "--image-size", "56", "--num-prompts", "3", "--input-len", "8", "--output-len", "2",
            "--json-out", str(out)]  # fmt: skip
    assert main_offline(build_parser().parse_args(argv)) == 0
    res = json.loads(out.read_text())
    assert res["image_size"] == 56
    # 8 text tokens + vision start and end + 4 image tokens (56x56: 2x2 merged patches), 2 out
    assert res["tandem"]["total_tok_s"] * res["tandem"]["seconds"] == pytest.approx(3 * (14 + 2))
