"""The norms and the SiLU-and-mul before FP8 W8A8 layers quantize their outputs for them
(``quantization.fp8.Fp8InputNorm``, ``Fp8SiluAndMul``): the same logits as the layers quantizing
their own inputs, only where the layer that takes the tensor would run W8A8.

The CPU has no FP8 GPU path, so these tests stand one in: ``ops.takes_w8a8`` says yes to what
it would take on one (bf16, more than ``FP8_GEMV_ROWS`` rows, per-channel scales), the layers
that quantize their own inputs take the W8A8 path as they would there, and ``torch._scaled_mm``
is a float32 product of the scaled operands (row-wise scales on the CPU vary by torch version).
The fused kernels themselves are checked against the two kernels they replace in
tests/kernels/test_triton_layers.py.
"""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import pytest
import torch
from torch import nn

from kernels import ops
from kernels.quant import scaled_mm_w8a8_linear
from services.config import ModelConfig
from services.engine.loader import load_model
from services.engine.models.llama import LlamaForCausalLM, RMSNorm
from services.engine.quantization import fp8
from tests.services.engine.quantization import checkpoints as ck
from tests.services.engine.quantization.test_loading import run

PROMPT = [(37 * i + 11) % 256 for i in range(24)]  # 24 rows: above FP8_GEMV_ROWS


def _stand_in_fp8_gpu(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """W8A8 on the CPU as on an FP8 GPU; returns the log of how each W8A8 layer got its input."""
    taken: list[str] = []

    def takes(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> bool:
        return (
            x.dim() == 2 and x.dtype == torch.bfloat16 and x.shape[0] > ops.FP8_GEMV_ROWS
            and scale.shape[1] == 1
        )  # fmt: skip

    real_linear, real_input = ops.fp8_linear, ops.fp8_input_linear

    def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block_k: int, bias: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        if not takes(x, weight, scale):
            return real_linear(x, weight, scale, block_k, bias)
        taken.append("quantized its own input")
        out = scaled_mm_w8a8_linear(x, weight, scale)
        return out if bias is None else out + bias

    def fp8_input_linear(*args: object, **kwargs: object) -> torch.Tensor:
        taken.append("took a quantized input")
        return real_input(*args, **kwargs)  # type: ignore[arg-type]

    def scaled_mm(a: torch.Tensor, b: torch.Tensor, *, scale_a: torch.Tensor, scale_b: torch.Tensor, out_dtype: torch.dtype, **_: object) -> torch.Tensor:  # fmt: skip
        # row-wise scales, which torch's CPU _scaled_mm takes only in some versions
        return ((a.float() * scale_a) @ (b.float() * scale_b)).to(out_dtype)

    monkeypatch.setattr(torch, "_scaled_mm", scaled_mm)
    monkeypatch.setattr(ops, "takes_w8a8", takes)
    monkeypatch.setattr(ops, "fp8_linear", fp8_linear)
    monkeypatch.setattr(ops, "fp8_input_linear", fp8_input_linear)
    return taken


def _load(tmp_path: Path) -> LlamaForCausalLM:
    path, _ = ck.fp8_checkpoint(tmp_path / "fp8", "channel")
    config = ModelConfig(model=str(path), dtype="bfloat16")
    return load_model(config, torch.device("cpu"), 64)[0]


def test_fused_inputs_give_the_logits_of_layers_quantizing_their_own(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    model = _load(tmp_path)
    layer = model.model.layers[0]
    assert isinstance(layer.input_layernorm, fp8.Fp8InputNorm)
    assert isinstance(layer.post_attention_layernorm, fp8.Fp8InputNorm)
    assert isinstance(layer.mlp.act_fn, fp8.Fp8SiluAndMul)
    assert type(model.model.norm) is RMSNorm  # lm_head stays in bf16
    # the checkpoint's names are unchanged, and no module reaches back up the tree
    assert "model.layers.0.input_layernorm.weight" in model.state_dict()
    assert len(list(model.modules())) == len(set(map(id, model.modules())))
    taken = _stand_in_fp8_gpu(monkeypatch)
    fused = run(model, PROMPT)
    # qkv, gate_up and down of both layers took their inputs quantized; o_proj quantizes its own
    assert taken.count("took a quantized input") == 6
    assert taken.count("quantized its own input") == 2
    taken.clear()
    monkeypatch.setattr(fp8, "_taker", lambda get, x: False)  # no fusion: each layer quantizes
    plain = run(model, PROMPT)
    assert taken == ["quantized its own input"] * 8
    assert torch.equal(fused, plain)
    assert torch.isfinite(fused).all()


def test_no_fusion_where_the_taking_layer_would_not_run_w8a8(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    model = _load(tmp_path)
    taken = _stand_in_fp8_gpu(monkeypatch)
    run(model, PROMPT[:12])  # 12 rows: the weight-only kernel's batches, which read bf16 x
    assert taken == []
    layer = model.model.layers[1]
    x = torch.randn(24, 128).to(torch.bfloat16)
    assert layer.input_layernorm(x)[0].dtype == torch.float8_e4m3fn

    class Wrapped(nn.Module):  # as LoRA wraps a layer: it reads the 16-bit input itself
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.inner(x)

    layer.self_attn.qkv_proj = Wrapped(layer.self_attn.qkv_proj)
    assert layer.input_layernorm(x)[0].dtype == torch.bfloat16  # looked up at every call
    out = run(model, PROMPT)
    assert torch.isfinite(out).all()


def test_an_fp8_input_without_scales_is_refused(tmp_path: Path) -> None:
    model = _load(tmp_path)
    q = torch.zeros(20, 128, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="without its per-token scales"):
        model.model.layers[0].self_attn.qkv_proj(q)


def test_the_swapped_modules_make_no_cycle(tmp_path: Path) -> None:
    """Dropping the model frees its MLPs at once (their weights are most of a model's memory),
    not when the cycle collector happens to run."""
    model = _load(tmp_path)
    mlp = weakref.ref(model.model.layers[0].mlp)
    gc.disable()
    try:
        del model
        assert mlp() is None
    finally:
        gc.enable()


@pytest.mark.gpu
def test_an_fp8_gate_up_takes_silu_into_its_gemv_at_batch_one() -> None:
    """On an FP8 GPU the batch-1 GEMV of an FP8 gate_up does SiLU-and-mul in its epilogue:
    the bits of the GEMV then the SiLU-and-mul kernel; a W8A8 batch keeps the two."""
    from services.engine.models.llama import Linear

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    dev = torch.device("cuda")
    if not ops.fp8_supported(dev):
        pytest.skip("needs an sm89+ GPU")
    gen = torch.Generator(device=dev).manual_seed(0)
    base = Linear(512, 2 * 384, bias=False).to(dev, torch.bfloat16)
    base.weight.data = torch.randn(768, 512, generator=gen, device=dev).to(torch.bfloat16)
    layer = fp8.Fp8Linear.from_linear(base)
    x = torch.randn(1, 512, generator=gen, device=dev).to(torch.bfloat16)
    fused = ops.linear_act(layer, ops.silu_and_mul, x)
    assert fused.shape == (1, 384)
    assert torch.equal(fused, ops.silu_and_mul(layer(x)))
    assert layer.fused_act(ops.silu_and_mul, x.expand(24, 512)) is None  # W8A8's rows
