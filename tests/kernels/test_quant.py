"""The quantized-weight references: the on-disk bit layouts, dequantization and W8A8."""

from __future__ import annotations

import pytest
import torch

from kernels import ops
from kernels.quant import (
    AWQ_ORDER,
    expand_block_scales,
    pack_cols,
    pack_rows,
    quantize_fp8_rows,
    ref_dequant_awq,
    ref_dequant_fp8,
    ref_dequant_gptq,
    ref_fp8_linear,
    ref_fp8_w8a8_linear,
    ref_w4a16_linear,
    scaled_mm_w8a8_linear,
    unpack_cols,
    unpack_rows,
)


def test_nibble_orders_of_the_formats() -> None:
    """Values 0..7 in eight columns (or rows): AWQ puts column [0,2,4,6,1,3,5,7][i] in nibble i,
    GPTQ (and our layout) keeps them in order."""
    q = torch.arange(8).reshape(1, 8)
    assert pack_cols(q, AWQ_ORDER).item() == 0x75316420
    assert pack_cols(q).item() == 0x76543210
    assert pack_rows(q.T).item() == 0x76543210


def test_packing_round_trips_with_the_sign_bit_set(gen: torch.Generator) -> None:
    q = torch.randint(0, 16, (16, 24), generator=gen)
    q[:, 7] = 15  # the top nibble: the int32 is negative
    for order in (None, AWQ_ORDER):
        assert torch.equal(unpack_cols(pack_cols(q, order), order), q)
    assert torch.equal(unpack_rows(pack_rows(q)), q)


def test_awq_and_gptq_dequantization(gen: torch.Generator) -> None:
    k, n, g = 64, 16, 32
    q = torch.randint(0, 16, (k, n), generator=gen)
    z = torch.randint(1, 16, (k // g, n), generator=gen)
    s = torch.rand(k // g, n, generator=gen).half()
    g_idx = torch.randperm(k, generator=gen) % (k // g)  # act-order: groups scattered
    want = (q - z[g_idx]).float() * s[g_idx].float()
    got = ref_dequant_gptq(pack_rows(q), pack_cols(z - 1), s, g_idx.int())
    assert torch.equal(got, want)
    rows = torch.arange(k) // g
    want = (q - z[rows]).float() * s[rows].float()
    assert torch.equal(ref_dequant_awq(pack_cols(q, AWQ_ORDER), pack_cols(z, AWQ_ORDER), s), want)


def test_fp8_block_scales_expand_to_rows(gen: torch.Generator) -> None:
    w = torch.randn(5, 40, generator=gen).to(torch.float8_e4m3fn)
    blocks = torch.rand(3, 3, generator=gen)  # block 2x16: rows 0-1, 2-3, 4; cols 0-15, ...
    rows = expand_block_scales(blocks, 5, 2)
    want = w.float() * blocks[torch.arange(5) // 2][:, torch.arange(40) // 16]
    assert torch.equal(ref_dequant_fp8(w, rows, 16), want)


def test_fp8_row_quantization_keeps_three_mantissa_bits(gen: torch.Generator) -> None:
    w = torch.randn(32, 100, generator=gen)
    q, s = quantize_fp8_rows(w)
    assert s.shape == (32, 1) and torch.equal(q.float().abs().amax(1), torch.full((32,), 448.0))
    err = (q.float() * s - w).abs()
    assert (err <= w.abs() / 16 + s * 2**-9).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_w8a8_scaled_mm_matches_its_reference(
    dtype: torch.dtype, gen: torch.Generator, device: torch.device
) -> None:
    """torch._scaled_mm (its CPU kernel under the interpreter, FP8 tensor cores on a GPU) against
    the reference; and W8A8 stays within the activation rounding (3 mantissa bits) of
    weight-only. The engine calls it on CUDA only; torch's CPU kernel took row-wise scales from
    2.13 (2.11's asserts per-tensor scales), so an older CPU torch skips."""
    x = torch.randn(17, 64, generator=gen).to(dtype).to(device)
    w, s = (t.to(device) for t in quantize_fp8_rows(torch.randn(48, 64, generator=gen)))
    if device.type == "cpu":
        try:
            scaled_mm_w8a8_linear(x[:1], w, s)
        except RuntimeError as exc:
            if "per-tensor" not in str(exc):
                raise
            pytest.skip(
                f"this torch's CPU _scaled_mm takes per-tensor scales only ({torch.__version__})"
            )
    ref = ref_fp8_w8a8_linear(x, w, s)
    # the CPU kernel sums the fp8 products exactly in fp32; the FP8 tensor cores do not (an H100
    # parted from the reference by 5e-4 of the output's scale at K = 64)
    tol = 1e-4 if dtype == torch.float32 and device.type == "cpu" else 2e-2
    torch.testing.assert_close(scaled_mm_w8a8_linear(x, w, s).float(), ref.float(), rtol=tol, atol=tol)  # fmt: skip
    weight_only = ref_fp8_linear(x, w, s, 64).float()
    assert ((ref.float() - weight_only).norm() / weight_only.norm()).item() < 0.05


def test_ops_run_the_references_on_the_cpu_and_add_the_bias(gen: torch.Generator) -> None:
    x = torch.randn(3, 64, generator=gen)
    bias = torch.randn(16, generator=gen)
    qw = pack_rows(torch.randint(0, 16, (64, 16), generator=gen))
    s, z = torch.rand(2, 16, generator=gen), torch.full((2, 16), 8.0)
    out = ops.w4a16_linear(x, qw, s, z, 32, bias)
    assert torch.equal(out, ref_w4a16_linear(x, qw, s, z, 32) + bias)
    w, ws = quantize_fp8_rows(torch.randn(16, 64, generator=gen))
    assert torch.equal(ops.fp8_linear(x, w, ws, 64, bias), ref_fp8_linear(x, w, ws, 64) + bias)
