"""The latency benchmark's roofline counts what a decode step reads, quantized layers included."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from kernels.bench.roofline import KNOWN_CEILINGS, Ceilings
from services.engine.bench.in_process import (
    _step_weight_bytes,
    _weight_bytes,
    floor_seconds,
    unread_expert_bytes,
)


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
    model.register_buffer("cos_sin_local", torch.zeros(100, 64))  # nor Gemma's local table
    assert _weight_bytes(model) == 256 + 256 + 32


def test_a_decode_step_reads_a_tied_embedding_table_whole() -> None:
    """Untied, a step reads only its tokens' rows of the embedding table; tied (SmolLM2,
    Gemma), the LM head is that table and reads all of it."""
    model = torch.nn.Module()
    model.model = torch.nn.Module()
    model.model.embed_tokens = torch.nn.Embedding(100, 8)  # 3200 bytes
    model.lm_head = torch.nn.Linear(8, 100, bias=False)  # 3200 bytes
    arch = SimpleNamespace(vocab_size=100, hidden_size=8)
    assert _step_weight_bytes(model, arch) == 3200
    model.lm_head.weight = model.model.embed_tokens.weight
    assert _step_weight_bytes(model, arch) == 3200


def test_a_decode_step_of_few_tokens_reads_only_the_experts_they_pick() -> None:
    """gpt-oss-20b's shape (top-4 of 32): one token reads 4 experts a layer, 28 stay unread;
    256 tokens pick every expert (the unread share rounds to nothing)."""
    from services.engine.loader import _no_param_init
    from services.engine.model_config import ArchConfig
    from services.engine.models.llama import LlamaForCausalLM
    from services.model_files import resolve_model

    arch = ArchConfig.from_file(resolve_model("gpt-oss-20b").path)
    with torch.device("meta"), _no_param_init():
        model = LlamaForCausalLM(arch, 64).to(torch.bfloat16)
    assert arch.moe is not None
    experts = model.model.layers[0].mlp.experts  # type: ignore[union-attr]
    layer = sum(p.numel() * 2 for p in experts.parameters())
    assert unread_expert_bytes(model, arch, 1) == pytest.approx(24 * layer * 28 / 32, rel=1e-6)
    assert unread_expert_bytes(model, arch, 256) < 1e-6 * layer
    dense = SimpleNamespace(moe=None)
    assert unread_expert_bytes(model, dense, 1) == 0


def _engine_8b() -> Any:
    """What floor_seconds reads of an engine serving the Llama-3.1-8B shape on a GPU."""
    arch = SimpleNamespace(
        vocab_size=128256, hidden_size=4096, num_layers=32, num_heads=32, head_dim=128, moe=None,
        kv_bytes_per_token=lambda size: 2 * 32 * 8 * 128 * size,
    )  # fmt: skip
    weights = [torch.empty(8_030_261_248, device="meta", dtype=torch.bfloat16)]  # the 8B model's
    model = SimpleNamespace(
        parameters=lambda: iter(weights), named_buffers=lambda: iter([]), modules=lambda: iter([])
    )
    runner = SimpleNamespace(
        device=torch.device("cuda"), arch=arch, model=model, kv_dtype=torch.bfloat16
    )
    return SimpleNamespace(runner=runner)


def test_w1_floor_follows_the_gpu() -> None:
    """W1's floor on an H100 is the 7.31 s its runs reported (targets.md's napkin math); on an
    H200 the decode part, bytes, shrinks by its copy bandwidth and the prefill part stays."""
    engine = _engine_8b()
    h100 = Ceilings("H100", *KNOWN_CEILINGS["NVIDIA H100 80GB HBM3"], measured_now=False)
    h200 = Ceilings("H200", *KNOWN_CEILINGS["NVIDIA H200"], measured_now=False)
    on_h100 = floor_seconds(engine, 256, 1024, 128, h100)
    assert on_h100 == pytest.approx(7.3142, abs=1e-3)
    bytes_only = Ceilings("x", 1.0, float("inf"), measured_now=False)
    flops_only = Ceilings("x", float("inf"), 1.0, measured_now=False)
    decode_bytes = floor_seconds(engine, 256, 1024, 128, bytes_only)
    prefill_flops = floor_seconds(engine, 256, 1024, 128, flops_only)
    assert decode_bytes is not None and prefill_flops is not None
    assert floor_seconds(engine, 256, 1024, 128, h200) == pytest.approx(
        prefill_flops / 788e12 + decode_bytes / 4.3e12
    )
    assert prefill_flops / 780e12 > 4.5  # the prefill is most of it (targets.md: ~4.8 s)


def test_fp8_layers_multiply_at_twice_the_rate_and_are_read_a_byte_a_weight() -> None:
    """W1's floor with FP8 weights and an FP8 KV cache: the quantized layers' weights are
    buffers (they were left out of the count: a floor of 1.55 s on an H200 for a run of 5.3 s),
    multiplied at twice the bf16 rate and read a byte each; the KV a byte an element."""
    from services.engine.quantization.fp8 import Fp8Linear

    engine = _engine_8b()
    embed = 128256 * 4096
    linears = 8_030_261_248 - 2 * embed  # the 8B model's linear layers but lm_head
    with torch.device("meta"):
        layer = Fp8Linear(linears // 4096, 4096, [4096], False, torch.bfloat16, None)
    float_weights = [torch.empty(2 * embed, device="meta", dtype=torch.bfloat16)]
    engine.runner.model = SimpleNamespace(
        parameters=lambda: iter(float_weights),
        named_buffers=lambda: iter(layer.named_buffers()),
        modules=lambda: iter([layer]),
    )
    engine.runner.kv_dtype = torch.float8_e4m3fn
    bytes_only = Ceilings("x", 1.0, float("inf"), measured_now=False)
    flops_only = Ceilings("x", float("inf"), 1.0, measured_now=False)
    bf16 = _engine_8b()
    # prefill: lm_head at the bf16 rate, the rest at twice it; attention the same
    attention = 4 * 32 * 32 * 128 * 256 * 1024 * 1024 / 2
    want = 2 * (embed + linears / 2) * 256 * 1024 + attention
    assert floor_seconds(engine, 256, 1024, 128, flops_only) == pytest.approx(want)
    assert floor_seconds(bf16, 256, 1024, 128, flops_only) == pytest.approx(
        2 * (embed + linears) * 256 * 1024 + attention
    )
    # decode: lm_head's bf16 bytes, a byte a linear weight, a float32 scale a row, FP8 KV
    kv_tok = 2 * 32 * 8 * 128
    want = sum(2 * embed + linears + 4 * 4096 + 256 * kv_tok * (1024 + s) for s in range(127))
    assert floor_seconds(engine, 256, 1024, 128, bytes_only) == pytest.approx(want)


def test_no_floor_off_a_gpu() -> None:
    engine = _engine_8b()
    engine.runner.device = torch.device("cpu")
    assert floor_seconds(engine, 1, 8, 8) is None


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
