"""The quantized-weight linear layers (Triton) against their references.

Tolerances: outputs are divided by sqrt(K) (sums of K products of unit-scale terms) and then
held to the dtype's element-wise tolerance (fp32 1e-4, bf16 2e-2, fp16 5e-3): the kernels
accumulate in fp32 exactly as the references do, in a different order, and round once.
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from kernels import triton_quant
from kernels.quant import (
    pack_rows,
    quantize_fp8_rows,
    ref_dequant_int4,
    ref_fp8_linear,
    ref_w4a16_linear,
)
from kernels.triton_quant import (
    FP8_GEMV_WIDE_N_CONFIG,
    GEMV_ROWS,
    W4_DEQUANT_ROWS,
    W4_GEMV_ROWS,
    W4_PLANES_K,
    W4_PLANES_X_WHOLE_ROWS,
    W4_SMALL_GEMM_CONFIG,
    _nibbles,
    _plane_pair,
    fp8_gemv_config,
    fp8_linear,
    w4_dequantize,
    w4a16_linear,
)
from tests.kernels.paged import assert_matches, rand

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def int4_weight(k: int, n: int, g: int, dtype: torch.dtype, gen: torch.Generator, device: torch.device) -> tuple[torch.Tensor, ...]:  # fmt: skip
    qweight = pack_rows(torch.randint(0, 16, (k, n), generator=gen))
    zeros = torch.randint(0, 16, (k // g, n), generator=gen).to(dtype)
    scales = (0.5 + torch.rand(k // g, n, generator=gen)).to(dtype) / 8
    return qweight.to(device), scales.to(device), zeros.to(device)


@triton.jit
def _nibbles_kernel(packed_ptr, out_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    packed = tl.load(packed_ptr + offs)
    shifts = (tl.arange(0, 8) * 4)[None, :]
    q = _nibbles(packed[:, None], shifts)  # [N, 8]
    tl.store(out_ptr + offs[:, None] * 8 + tl.arange(0, 8)[None, :], q)


def test_nibbles_are_the_integer_conversion_bit_for_bit(
    gen: torch.Generator, device: torch.device
) -> None:
    """Every value 0..15 at every one of the eight positions, words with the sign bit set
    (the arithmetic shift drags it into the top nibble, the mask must drop it), 0 and -1."""
    words = [sum(v << (4 * i) for i in range(8)) for v in range(16)]  # v in every nibble
    words += [sum(((v + i) % 16) << (4 * i) for i in range(8)) for v in range(16)]
    words += [0, -1, -(2**31), 2**31 - 1, 0x76543210, -0x76543211]
    as_int32 = [w - 2**32 if w >= 2**31 else w for w in words]
    random = torch.randint(-(2**31), 2**31, (128 - len(as_int32),), generator=gen)
    packed = torch.cat([torch.tensor(as_int32, dtype=torch.int32), random.to(torch.int32)])
    packed = packed.to(device)
    out = torch.empty((packed.numel(), 8), dtype=torch.float32, device=device)
    _nibbles_kernel[(1,)](packed, out, N=packed.numel())
    shifts = torch.arange(0, 32, 4, device=device, dtype=torch.int32)
    expected = ((packed[:, None] >> shifts) & 0xF).to(torch.float32)
    assert torch.equal(out, expected)
    assert torch.equal(out[:16, 0], torch.arange(16, dtype=torch.float32, device=device))


@triton.jit
def _plane_pairs_kernel(packed_ptr, out_ptr, magic_lo, magic_hi, N: tl.constexpr):
    offs = tl.arange(0, N)
    packed = tl.load(packed_ptr + offs)
    for pair in tl.static_range(4):
        lo, hi = _plane_pair(packed, pair, magic_lo, magic_hi)
        tl.store(out_ptr + offs * 8 + 2 * pair, lo - 2048.0)
        tl.store(out_ptr + offs * 8 + 2 * pair + 1, hi - 128.0)


def test_plane_pairs_are_the_nibbles_offset_exactly(
    gen: torch.Generator, device: torch.device
) -> None:
    """Each of the four shifts yields two planes, ``2048 + q`` and ``128 + q``, exactly: every
    nibble value in every position, the sign bit (the arithmetic shift fills the high bits
    with it; the masks must drop them), 0, -1 and random words."""
    words = [sum(v << (4 * i) for i in range(8)) for v in range(16)]
    words += [sum(((v + i) % 16) << (4 * i) for i in range(8)) for v in range(16)]
    words += [0, -1, -(2**31), 2**31 - 1, 0x76543210, -0x76543211, 0x0F0F0F0F, -0x0F0F0F10]
    as_int32 = [w - 2**32 if w >= 2**31 else w for w in words]
    random = torch.randint(-(2**31), 2**31, (128 - len(as_int32),), generator=gen)
    packed = torch.cat([torch.tensor(as_int32, dtype=torch.int32), random.to(torch.int32)])
    packed = packed.to(device)
    out = torch.empty((packed.numel(), 8), dtype=torch.float32, device=device)
    magic = (triton_quant.PLANE_MAGIC_LO, triton_quant.PLANE_MAGIC_HI)
    _plane_pairs_kernel[(1,)](packed, out, *magic, N=packed.numel())
    shifts = torch.arange(0, 32, 4, device=device, dtype=torch.int32)
    assert torch.equal(out, ((packed[:, None] >> shifts) & 0xF).to(torch.float32))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("m", "n", "k", "g"),
    [(1, 64, 128, 128), (1, 40, 256, 128), (2, 24, 512, 64), (3, 24, 512, 64), (8, 8, 128, 32),
     (9, 16, 128, 128), (17, 72, 256, 128), (33, 200, 384, 128), (1, 8, 32, 32)],
)  # fmt: skip
@pytest.mark.parametrize("config", [None, "small"])
def test_w4a16_matches_the_reference(
    dtype: torch.dtype, m: int, n: int, k: int, g: int, config: str | None,
    gen: torch.Generator, device: torch.device, poison_empty: None,
) -> None:  # fmt: skip
    """GEMV (M <= W4_GEMV_ROWS) and GEMM (M = 3 to 33) paths; N not a multiple of the tile."""
    qweight, scales, zeros = int4_weight(k, n, g, dtype, gen, device)
    x = rand((m, k), dtype, gen, device)
    cfg = None if config is None else ((16, 32, 2) if m <= W4_GEMV_ROWS else (16, 32, 32, 2))
    out = w4a16_linear(x, qweight, scales, zeros, g, config=cfg)
    ref = ref_w4a16_linear(x, qweight, scales, zeros, g)
    assert out.shape == (m, n) and out.dtype == dtype
    assert_matches(out / k**0.5, ref / k**0.5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("n", "k", "g", "cols"), [(40, 256, 128, None), (300, 128, 32, (8, 299)), (8, 64, 16, (0, 8))])  # fmt: skip
def test_dequantize_is_the_reference_bit_for_bit(
    dtype: torch.dtype, n: int, k: int, g: int, cols: tuple[int, int] | None,
    gen: torch.Generator, device: torch.device, poison_empty: None,
) -> None:  # fmt: skip
    """Whole weights and column slices (a slice not a multiple of the tile), rounded once."""
    qweight, scales, zeros = int4_weight(k, n, g, dtype, gen, device)
    first, last = cols or (0, n)
    got = w4_dequantize(qweight, scales, zeros, g, dtype, first, last)
    ref = ref_dequant_int4(qweight, scales, zeros, g).to(dtype)[:, first:last]
    assert got.shape == (k, last - first) and got.dtype == dtype
    assert torch.equal(got, ref)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("slice_bytes", [None, 1024])  # 1 KiB: 8-column slices at K=64
def test_long_batches_dequantize_then_multiply(
    dtype: torch.dtype, slice_bytes: int | None, gen: torch.Generator, device: torch.device,
    poison_empty: None, monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """Above W4_DEQUANT_ROWS rows: one dequantized weight, or column slices of it."""
    if slice_bytes is not None:
        monkeypatch.setattr(triton_quant, "W4_DEQUANT_SLICE_BYTES", slice_bytes)
        monkeypatch.setattr(triton_quant, "W4_DEQUANT_CONFIG", (16, 8, 2))
    m, n, k, g = W4_DEQUANT_ROWS + 3, 36, 64, 32
    qweight, scales, zeros = int4_weight(k, n, g, dtype, gen, device)
    x = rand((2 * m, k), dtype, gen, device)[::2]  # strided rows
    calls: list[tuple[int, int]] = []
    real = triton_quant.w4_dequantize

    def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
        out = real(*args, **kwargs)
        calls.append(tuple(out.shape))
        return out

    monkeypatch.setattr(triton_quant, "w4_dequantize", counted)
    out = w4a16_linear(x, qweight, scales, zeros, g)
    ref = ref_w4a16_linear(x, qweight, scales, zeros, g)
    assert out.shape == (m, n) and out.dtype == dtype
    assert_matches(out / k**0.5, ref / k**0.5)
    widths = [c for _, c in calls]
    assert sum(widths) == n and (widths == [n] if slice_bytes is None else len(widths) == 5)
    calls.clear()  # an explicit launch keeps the GEMM, which never dequantizes
    w4a16_linear(x, qweight, scales, zeros, g, config=(16, 32, 32, 2))
    assert not calls


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("m", "n", "k", "block_k"),
    [(1, 64, 256, 128), (1, 37, 200, 200), (5, 130, 300, 128), (8, 5, 96, 96), (1, 1, 16, 16),
     (9, 48, 256, 128), (17, 96, 256, 128), (33, 40, 200, 200), (20, 33, 136, 64),
     (2, 9, 8200, 8200)],  # per channel, a long row: the default launch's 2048-long chunks
)  # fmt: skip
@pytest.mark.parametrize("config", [None, "small"])
def test_fp8_matches_the_reference(
    dtype: torch.dtype, m: int, n: int, k: int, block_k: int, config: str | None,
    gen: torch.Generator, device: torch.device, poison_empty: None,
) -> None:  # fmt: skip
    """Block scales (K not a multiple of the block: a partial last block) and per-channel
    scales (block_k = K, K not a power of two); GEMV and GEMM paths."""
    weight, _ = quantize_fp8_rows(torch.randn(n, k, generator=gen))
    scale = torch.rand(n, -(-k // block_k), generator=gen) + 0.5
    x = rand((m, k), dtype, gen, device)
    cfg = None if config is None else ((4, 64, 2) if m <= GEMV_ROWS else (16, 32, 32, 2))
    out = fp8_linear(x, weight.to(device), scale.to(device), block_k, config=cfg)
    ref = ref_fp8_linear(x, weight.to(device), scale.to(device), block_k)
    assert out.shape == (m, n) and out.dtype == dtype
    scale_out = 448 * k**0.5  # |e4m3| up to 448
    assert_matches(out / scale_out, ref / scale_out)


@pytest.mark.parametrize(
    ("m", "n", "k", "g", "config"),
    [
        (1, 40, 512, 64, (16, 256, 4, 1)),  # four groups a chunk, two chunks, one slice of K
        (2, 24, 1024, 32, (8, 512, 4, 3)),  # sixteen groups a chunk, two slices of one chunk
        (1, 8, 384, 128, (16, 1024, 8, 1)),  # K = 3 groups: chunks of one group
        (1, 40, 576, 64, None),  # the default launch on SmolLM2's K (9 groups of 64)
        (2, 40, 576, 64, None),  # two rows in one program
        (1, 24, 8192, 128, None),  # long rows: 16 warps, 2048-long chunks (w4_gemv_config)
        (2, 24, 8192, 128, (16, 2048, 16)),
        (1, 264, 64, 32, None),  # four times as many outputs: 32 columns a program, a partial tile
        (2, 264, 64, 32, None),  # the same for two rows in one program
    ],
)
def test_w4a16_gemv_chunks_of_several_groups_match_the_reference(
    m: int, n: int, k: int, g: int, config: tuple[int, ...] | None, gen: torch.Generator,
    device: torch.device, poison_empty: None,
) -> None:  # fmt: skip
    """The GEMV's chunks span whole scale groups (each row of the packed tile takes its own
    group's scale and zero), a partial last column tile; the next chunk loaded ahead, the last
    one again."""
    qweight, scales, zeros = int4_weight(k, n, g, torch.bfloat16, gen, device)
    x = rand((m, k), torch.bfloat16, gen, device)
    out = w4a16_linear(x, qweight, scales, zeros, g, config=config)
    assert_matches(out / k**0.5, ref_w4a16_linear(x, qweight, scales, zeros, g) / k**0.5)


@pytest.mark.parametrize(
    ("m", "n", "k", "g", "config"),
    [
        (1, 264, 64, 32, None),  # the wide launch (32 columns: 16 outputs), a partial tile
        (2, 80, 512, 64, (16, 256, 4, 1)),  # two rows in one program, two chunks
        (1, 40, 384, 128, (8, 1024, 8)),  # chunks of one group; the last tile half empty
        (3, 48, 128, 32, None),  # the GEMM's rows: its product, then the SiLU-and-mul kernel
    ],
)
def test_w4a16_silu_and_mul_is_the_two_kernels_bit_for_bit(
    m: int, n: int, k: int, g: int, config: tuple[int, ...] | None, gen: torch.Generator,
    device: torch.device, poison_empty: None,
) -> None:  # fmt: skip
    """A gate_up weight's GEMV with SiLU-and-mul in its epilogue (gate and up columns of the
    same outputs in one program) gives what the GEMV and then the SiLU-and-mul kernel give."""
    from kernels.triton_layers import silu_and_mul

    qweight, scales, zeros = int4_weight(k, n, g, torch.bfloat16, gen, device)
    x = rand((m, k), torch.bfloat16, gen, device)
    fused = w4a16_linear(x, qweight, scales, zeros, g, config=config, silu_and_mul=True)
    assert fused.shape == (m, n // 2)
    two = silu_and_mul(w4a16_linear(x, qweight, scales, zeros, g, config=config))
    assert torch.equal(fused, two)
    with pytest.raises(ValueError, match="as many up columns"):
        w4a16_linear(x, qweight[:, :-1], scales[:, :-1], zeros[:, :-1], g, silu_and_mul=True)


def test_the_gemv_launch_follows_the_weights_shape() -> None:
    """One row of x and long rows of the weight with at most half as many outputs (down
    projections) take 16 warps, and four times as many outputs as inputs (gate_up) 32 columns
    a program (at one or two rows); two rows of x, other shapes and rows shorter than
    W4_GEMV_LONG_K the default launch."""
    long_k = triton_quant.W4_GEMV_LONG_K
    assert triton_quant.w4_gemv_config(4096, 14336) == triton_quant.W4_GEMV_LONG_K_CONFIG
    assert triton_quant.w4_gemv_config(long_k // 2, long_k) == triton_quant.W4_GEMV_LONG_K_CONFIG
    assert triton_quant.w4_gemv_config(4096, 14336, rows=2) == triton_quant.W4_GEMV_CONFIG
    # four times as many outputs as inputs (gate_up) take 32 columns a program, at 1 or 2 rows
    assert triton_quant.w4_gemv_config(28672, 4096) == triton_quant.W4_GEMV_WIDE_N_CONFIG
    assert triton_quant.w4_gemv_config(28672, 4096, rows=2) == triton_quant.W4_GEMV_WIDE_N_CONFIG
    for n, k in [(4096, 4096), (6144, 4096), (576, 1536), (8192, 8192), (16383, 4096)]:
        assert triton_quant.w4_gemv_config(n, k) == triton_quant.W4_GEMV_CONFIG


@pytest.mark.parametrize(
    ("m", "n", "k", "g", "config"),
    [
        (3, 64, 512, 128, (16, 64, 128, 4, 3)),  # K in three slices, partial sums
        (5, 40, 256, 128, (16, 32, 128, 4, 1)),  # a partial tile of N
        (17, 24, 256, 256, (16, 16, 256, 4, 1)),  # two tiles of rows; chunks of a 256 group
        (16, 200, 1024, 128, None),  # the small batches' default tile, K in 8 slices
    ],
)
def test_w4a16_gemm_on_the_nibble_planes_matches_the_reference(
    m: int, n: int, k: int, g: int, config: tuple[int, ...] | None, gen: torch.Generator,
    device: torch.device, poison_empty: None,
) -> None:  # fmt: skip
    """The GEMM's chunks of a multiple of 128 rows: x's columns 8p + j against nibble plane j,
    loaded plane by plane (3 and 5 rows) or whole and split in registers (16 and 17 rows)."""
    assert W4_SMALL_GEMM_CONFIG[2] % W4_PLANES_K == 0  # the default above is on the planes
    assert 5 <= W4_PLANES_X_WHOLE_ROWS < 16
    qweight, scales, zeros = int4_weight(k, n, g, torch.bfloat16, gen, device)
    x = rand((m, k), torch.bfloat16, gen, device)
    out = w4a16_linear(x, qweight, scales, zeros, g, config=config)
    assert out.shape == (m, n)
    assert_matches(out / k**0.5, ref_w4a16_linear(x, qweight, scales, zeros, g) / k**0.5)


@pytest.mark.parametrize(
    ("m", "n", "k", "g"), [(1, 40, 256, 64), (3, 24, 512, 64), (17, 72, 256, 32), (1, 8, 32, 32)]
)
def test_w4a16_split_k_matches_the_reference(
    m: int, n: int, k: int, g: int, gen: torch.Generator, device: torch.device, poison_empty: None
) -> None:
    """K in three slices (odd on purpose; fewer chunks than slices in the last shape), the fp32
    partials summed by the second kernel; GEMV and GEMM. The dtype plays no part in the split."""
    qweight, scales, zeros = int4_weight(k, n, g, torch.bfloat16, gen, device)
    x = rand((m, k), torch.bfloat16, gen, device)
    cfg = (16, 32, 2, 3) if m <= W4_GEMV_ROWS else (16, 32, 32, 2, 3)
    out = w4a16_linear(x, qweight, scales, zeros, g, config=cfg)
    assert_matches(out / k**0.5, ref_w4a16_linear(x, qweight, scales, zeros, g) / k**0.5)


def _fp8_case(
    m: int, n: int, k: int, block_k: int, gen: torch.Generator, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [m, k], an e4m3 weight [n, k] with a scale per row and block of ``block_k``, and the
    reference product."""
    weight, _ = quantize_fp8_rows(torch.randn(n, k, generator=gen))
    scale = torch.rand(n, -(-k // block_k), generator=gen) + 0.5
    x = rand((m, k), torch.bfloat16, gen, device)
    weight, scale = weight.to(device), scale.to(device)
    return x, weight, scale, ref_fp8_linear(x, weight, scale, block_k)


@pytest.mark.parametrize(
    ("m", "n", "k", "block_k"), [(1, 37, 200, 200), (5, 130, 300, 128), (17, 96, 256, 128)]
)
def test_fp8_split_k_matches_the_reference(
    m: int, n: int, k: int, block_k: int, gen: torch.Generator, device: torch.device,
    poison_empty: None,
) -> None:  # fmt: skip
    """Block and per-channel scales with K in three slices (a partial last chunk masked)."""
    x, weight, scale, ref = _fp8_case(m, n, k, block_k, gen, device)
    cfg = (4, 32, 2, 3) if m <= GEMV_ROWS else (16, 32, 32, 2, 3)
    out = fp8_linear(x, weight, scale, block_k, config=cfg)
    assert_matches(out / (k**0.5 * 448), ref / (k**0.5 * 448))


@pytest.mark.parametrize(("n", "k", "block_k"), [(37, 200, 200), (130, 1000, 1000), (40, 300, 128)])
def test_fp8_pipelined_gemv_matches_the_reference(
    n: int, k: int, block_k: int, gen: torch.Generator, device: torch.device, poison_empty: None
) -> None:
    """The GEMV (its rows of x) with its chunks' loads pipelined (STAGES > 1, as wide weights
    take it): a partial last chunk, fewer chunks than stages, block scales, K in two slices."""
    x, weight, scale, ref = _fp8_case(GEMV_ROWS, n, k, block_k, gen, device)
    for cfg in [(4, 64, 2, 1, 3), (8, 32, 2, 2, 4)]:
        out = fp8_linear(x, weight, scale, block_k, config=cfg)
        assert_matches(out / (k**0.5 * 448), ref / (k**0.5 * 448))


@pytest.mark.parametrize(
    ("m", "n", "k", "block_k", "config"),
    [
        (1, 40, 200, 200, (16, 64, 2, 1, 3)),  # per channel, pipelined, a partial block
        (1, 6, 96, 32, None),  # block scales, FP8_GEMV_CONFIG
        (3, 8, 64, 64, None),  # the GEMM's rows: its product, then the SiLU-and-mul kernel
    ],
)
def test_fp8_silu_and_mul_is_the_two_kernels_bit_for_bit(
    m: int, n: int, k: int, block_k: int, config: tuple[int, ...] | None,
    gen: torch.Generator, device: torch.device, poison_empty: None,
) -> None:  # fmt: skip
    from kernels.triton_layers import silu_and_mul

    weight, _ = quantize_fp8_rows(torch.randn(n, k, generator=gen))
    weight = weight.to(device)
    scale = (torch.rand(n, -(-k // block_k), generator=gen) + 0.5).to(device)
    x = rand((m, k), torch.bfloat16, gen, device)
    fused = fp8_linear(x, weight, scale, block_k, config=config, silu_and_mul=True)
    assert fused.shape == (m, n // 2)
    assert torch.equal(fused, silu_and_mul(fp8_linear(x, weight, scale, block_k, config=config)))
    with pytest.raises(ValueError, match="as many up rows"):
        fp8_linear(x, weight[:-1], scale[:-1], block_k, silu_and_mul=True)


def test_fp8_gemv_launches_by_shape() -> None:
    assert fp8_gemv_config(28672, 4096, 4096) == FP8_GEMV_WIDE_N_CONFIG
    assert FP8_GEMV_WIDE_N_CONFIG[4] > 1
    assert fp8_gemv_config(4096, 4096, 4096) == fp8_gemv_config(4096, 14336, 14336)
    assert fp8_gemv_config(4096, 14336, 14336)[4] > 1  # square and long rows: pipelined too
    assert len(fp8_gemv_config(6144, 4096, 4096)) == 3  # qkv's: loaded as used


def test_strided_rows_of_x(gen: torch.Generator, device: torch.device) -> None:
    big = rand((6, 512), torch.float32, gen, device)
    x = big[::2, :256]
    qweight, scales, zeros = int4_weight(256, 32, 128, torch.float32, gen, device)
    ref = ref_w4a16_linear(x, qweight, scales, zeros, 128)
    assert_matches(w4a16_linear(x, qweight, scales, zeros, 128) / 16, ref / 16)
    weight, s = quantize_fp8_rows(torch.randn(24, 256, generator=gen))
    w, s = weight.to(device), s.to(device)
    assert_matches(fp8_linear(x, w, s, 256) / 16 / 448, ref_fp8_linear(x, w, s, 256) / 16 / 448)


def test_errors(gen: torch.Generator, device: torch.device) -> None:
    qweight, scales, zeros = int4_weight(128, 16, 64, torch.float32, gen, device)
    x = rand((1, 128), torch.float32, gen, device)
    with pytest.raises(ValueError, match="expects 128"):
        w4a16_linear(rand((1, 120), torch.float32, gen, device), qweight, scales, zeros, 64)
    with pytest.raises(ValueError, match="must be"):
        w4a16_linear(x, qweight, scales, zeros, 128)  # scales are for groups of 64
    with pytest.raises(ValueError, match="power of two >= 16"):
        w4a16_linear(x, qweight, scales, zeros, 48)
    weight, s = quantize_fp8_rows(torch.randn(16, 128, generator=gen))
    with pytest.raises(ValueError, match="ceil"):
        fp8_linear(x, weight.to(device), s.to(device), 64)  # one scale column, blocks of 64
    with pytest.raises(ValueError, match="dtype"):
        fp8_linear(x, weight.float().to(device), s.to(device), 128)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("m", "k", "block"),
    [(1, 16, None), (3, 200, None), (5, 4096, None), (2, 300, 128), (4, 1000, 256), (1, 17000, None)],
)  # fmt: skip
def test_per_token_quant_fp8_is_the_reference_bit_for_bit(
    dtype: torch.dtype, m: int, k: int, block: int | None,
    gen: torch.Generator, device: torch.device, poison_empty: None,
) -> None:  # fmt: skip
    """One read per row (K up to 16,384) and the chunked two-pass loop (a partial last chunk;
    K = 17,000 takes it by itself); rows of very different magnitudes, an all-zero row (the
    1e-12 floor) and values on e4m3 rounding ties after scaling."""
    from kernels.quant import ref_per_token_quant_fp8
    from kernels.triton_quant import per_token_quant_fp8

    x = torch.randn(m, k, generator=gen) * torch.logspace(-3, 3, m).unsqueeze(1)
    if m > 2:
        x[1] = 0.0
        x[2] = torch.randn(k, generator=gen).clamp(-4.0, 4.0)  # amax 448 below: scale 1
        x[2, : min(k, 8)] = torch.tensor([448.0, 1.0625, -1.0625, 3.25, 0.5, -0.0, 13.0, 1e-3])[
            : min(k, 8)
        ]
    x = x.to(dtype).to(device)
    q, s = per_token_quant_fp8(x, block=block)
    rq, rs = ref_per_token_quant_fp8(x)
    assert q.shape == (m, k) and q.dtype == torch.float8_e4m3fn and s.shape == (m, 1)
    assert torch.equal(s, rs)
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8))


def test_per_token_quant_fp8_strided_and_empty(gen: torch.Generator, device: torch.device) -> None:
    from kernels.quant import ref_per_token_quant_fp8
    from kernels.triton_quant import per_token_quant_fp8

    base = torch.randn(4, 96, generator=gen).to(device)
    x = base[:, :64]  # row stride 96
    q, s = per_token_quant_fp8(x)
    rq, rs = ref_per_token_quant_fp8(x)
    assert torch.equal(s, rs) and torch.equal(q.view(torch.uint8), rq.view(torch.uint8))
    q0, s0 = per_token_quant_fp8(base[:0])
    assert q0.shape == (0, 96) and s0.shape == (0, 1)
    with pytest.raises(ValueError, match="dims"):
        per_token_quant_fp8(base[0])
