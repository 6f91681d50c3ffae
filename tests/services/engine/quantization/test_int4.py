"""The int4 layer's fused SiLU-and-mul: one kernel where its GEMV runs, the two elsewhere."""

from __future__ import annotations

import pytest
import torch

from kernels import ops
from kernels.quant import pack_rows
from services.engine.quantization.int4 import Int4Linear


def _gate_up(k: int, inter: int, device: torch.device, gen: torch.Generator) -> Int4Linear:
    layer = Int4Linear(k, 2 * inter, [inter, inter], False, torch.bfloat16, "awq", 32)
    layer = layer.to(device)
    q = torch.randint(0, 16, (k, 2 * inter), generator=gen, device=gen.device)
    layer.qweight.copy_(pack_rows(q.cpu()).to(device))
    layer.scales.copy_((torch.rand(k // 32, 2 * inter, generator=gen, device=gen.device) + 0.5) / 8)
    layer.zeros.copy_(torch.randint(0, 16, (k // 32, 2 * inter), generator=gen, device=gen.device))
    return layer


def test_off_the_gpu_the_activation_runs_after_the_layer() -> None:
    gen = torch.Generator().manual_seed(0)
    layer = _gate_up(64, 24, torch.device("cpu"), gen)
    x = torch.randn(1, 64, generator=gen).to(torch.bfloat16)
    assert layer.fused_act(ops.silu_and_mul, x) is None
    out = ops.linear_act(layer, ops.silu_and_mul, x)
    assert torch.equal(out, ops.silu_and_mul(layer(x)))
    assert layer.fused_act(ops.gelu_tanh_and_mul, x) is None  # only SiLU is fused


@pytest.mark.gpu
@pytest.mark.parametrize("act_order", [False, True])
def test_an_int4_gate_up_takes_silu_into_its_gemv_at_batch_one(act_order: bool) -> None:
    """On a GPU the batch-1 GEMV of an int4 gate_up does SiLU-and-mul in its epilogue: the
    bits of the GEMV then the SiLU-and-mul kernel (x permuted first for an act-order layer);
    from two rows the two kernels run."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    layer = _gate_up(256, 96, dev, gen)
    if act_order:
        layer.perm = torch.randperm(256, generator=gen, device=dev)
    x = torch.randn(1, 256, generator=gen, device=dev).to(torch.bfloat16)
    fused = layer.fused_act(ops.silu_and_mul, x)
    assert fused is not None and fused.shape == (1, 96)
    assert torch.equal(fused, ops.silu_and_mul(layer(x)))
    two = torch.randn(2, 256, generator=gen, device=dev).to(torch.bfloat16)
    assert layer.fused_act(ops.silu_and_mul, two) is None
