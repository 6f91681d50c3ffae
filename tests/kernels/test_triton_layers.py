"""RMSNorm, SiLU-and-mul, GELU-and-mul and rotary embedding (Triton) against the references."""

from __future__ import annotations

import pytest
import torch

from kernels.layers import (
    ref_gelu_tanh_and_mul,
    ref_gemma_rms_norm,
    ref_rms_norm,
    ref_rotary_embedding,
    ref_silu_and_mul,
)
from kernels.quant import ref_per_token_quant_fp8
from kernels.triton_layers import (
    gelu_tanh_and_mul,
    gemma_rms_norm,
    rms_norm,
    rms_norm_fp8,
    rotary_embedding,
    silu_and_mul,
    silu_and_mul_fp8,
)
from kernels.triton_quant import per_token_quant_fp8
from tests.kernels.paged import assert_matches, assert_same_rounding, rand
from tests.kernels.rounding import assert_rotated, kernel_rounding, rotate, torch_rounding

DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("width", [48, 100])
def test_rms_norm(dtype: torch.dtype, with_residual: bool, width: int, gen: torch.Generator, device: torch.device, poison_empty: None) -> None:  # fmt: skip
    x = rand((5, width), dtype, gen, device)
    weight = rand((width,), dtype, gen, device)
    residual = rand((5, width), dtype, gen, device) if with_residual else None
    out, res = rms_norm(x, weight, 1e-5, residual)
    ref_out, ref_res = ref_rms_norm(x, weight, 1e-5, residual)
    assert_matches(out, ref_out)
    assert_same_rounding(res, ref_res)  # the residual stream is rounded like the reference


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("width", [16, 96, 256])
def test_gemma_rms_norm(dtype: torch.dtype, with_residual: bool, width: int, gen: torch.Generator, device: torch.device, poison_empty: None) -> None:  # fmt: skip
    """Gemma's order: 1 + weight and one rounding after the fp32 product (not Llama's)."""
    x = rand((5, width), dtype, gen, device) * 3
    weight = rand((width,), dtype, gen, device) * 0.3
    residual = rand((5, width), dtype, gen, device) if with_residual else None
    out, res = gemma_rms_norm(x, weight, 1e-6, residual)
    ref_out, ref_res = ref_gemma_rms_norm(x, weight, 1e-6, residual)
    assert_matches(out, ref_out)
    assert_same_rounding(res, ref_res)


def test_rms_norm_of_a_single_token_row_view(gen: torch.Generator, device: torch.device, poison_empty: None) -> None:  # fmt: skip
    x = rand((3, 64), torch.float32, gen, device)[1:2]
    weight = rand((64,), torch.float32, gen, device)
    assert_matches(rms_norm(x, weight, 1e-6)[0], ref_rms_norm(x, weight, 1e-6)[0])


def test_rms_norm_errors(gen: torch.Generator, device: torch.device) -> None:
    x = rand((2, 8), torch.float32, gen, device)
    with pytest.raises(ValueError, match="weight has 4 entries for width 8"):
        rms_norm(x, rand((4,), torch.float32, gen, device), 1e-6)
    with pytest.raises(ValueError, match="residual"):
        rms_norm(x, rand((8,), torch.float32, gen, device), 1e-6, rand((2, 4), torch.float32, gen, device))  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 2 * 24), (4, 3, 2 * 40)])
def test_silu_and_mul(dtype: torch.dtype, shape: tuple[int, ...], gen: torch.Generator, device: torch.device, poison_empty: None) -> None:  # fmt: skip
    x = rand(shape, dtype, gen, device) * 3
    assert_matches(silu_and_mul(x), ref_silu_and_mul(x))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 2 * 24), (4, 3, 2 * 40)])
def test_gelu_tanh_and_mul(dtype: torch.dtype, shape: tuple[int, ...], gen: torch.Generator, device: torch.device, poison_empty: None) -> None:  # fmt: skip
    x = rand(shape, dtype, gen, device) * 3
    # the tails (-10: GELU ~0 from below; 10: the identity) and zero beside the random values
    x.view(-1, shape[-1])[0, :3] = torch.tensor([-10.0, 0.0, 10.0])
    got, want = gelu_tanh_and_mul(x), ref_gelu_tanh_and_mul(x)
    assert got.shape == want.shape and got.dtype == dtype
    # float32: the activation's value differs from torch's in its last bits at most (computed
    # as g / (1 + exp(-2u))); 16 bits: the dtype's tolerance, as for every kernel (the
    # interpreter's bfloat16 rounding is not the GPU's)
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6)
    assert_matches(got, want)


def test_gelu_is_not_silu(gen: torch.Generator, device: torch.device) -> None:
    x = rand((2, 16), torch.float32, gen, device)
    assert not torch.allclose(gelu_tanh_and_mul(x), silu_and_mul(x))


def test_silu_and_mul_needs_an_even_width(gen: torch.Generator, device: torch.device) -> None:
    with pytest.raises(ValueError, match="even"):
        silu_and_mul(rand((2, 7), torch.float32, gen, device))


def _same_fp8(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]) -> None:  # fmt: skip
    assert got[0].dtype == torch.float8_e4m3fn and got[1].dtype == torch.float32
    assert got[1].shape == want[1].shape and torch.equal(got[1], want[1])
    assert torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize(("rows", "width"), [(1, 48), (5, 100), (3, 1000)])
def test_rms_norm_fp8_is_the_norm_then_the_quantization(dtype: torch.dtype, with_residual: bool, rows: int, width: int, gen: torch.Generator, device: torch.device, poison_empty: None) -> None:  # fmt: skip
    x = rand((rows, width), dtype, gen, device) * 4
    x[0, 0] = 0.0
    weight = rand((width,), dtype, gen, device)
    residual = rand((rows, width), dtype, gen, device) if with_residual else None
    q, scales, res = rms_norm_fp8(x, weight, 1e-5, residual)
    y, ref_res = rms_norm(x, weight, 1e-5, residual)
    # bit for bit the two kernels one after the other under the interpreter (compiled: within a
    # step, test_gpu_fp8_forms_against_the_two_kernels), and the reference's quantization of them
    _same_fp8((q, scales), per_token_quant_fp8(y))
    _same_fp8((q, scales), ref_per_token_quant_fp8(y))
    assert torch.equal(res, ref_res)
    if residual is None:
        assert res is x  # as rms_norm: the residual stream is x itself
    # and within the e4m3 rounding of the torch reference's norm
    ref = ref_rms_norm(x, weight, 1e-5, residual)[0].float()
    assert torch.allclose(q.float() * scales, ref, rtol=0.07, atol=1e-6 + 0.07 * ref.abs().max())


def test_rms_norm_fp8_of_zero_rows_and_a_zero_row(gen: torch.Generator, device: torch.device) -> None:  # fmt: skip
    w = rand((32,), torch.bfloat16, gen, device)
    q, s, _ = rms_norm_fp8(torch.zeros((0, 32), dtype=torch.bfloat16, device=device), w, 1e-6)
    assert q.shape == (0, 32) and s.shape == (0, 1)
    q, s, _ = rms_norm_fp8(torch.zeros((2, 32), dtype=torch.bfloat16, device=device), w, 1e-6)
    assert torch.equal(s, torch.full((2, 1), 1e-12, device=device)) and not q.float().any()
    with pytest.raises(ValueError, match="weight has 4 entries for width 32"):
        rms_norm_fp8(rand((2, 32), torch.bfloat16, gen, device), w[:4], 1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(("rows", "inter", "block"), [(1, 24, None), (4, 100, None), (3, 300, 64), (2, 256, 128)])  # fmt: skip
def test_silu_and_mul_fp8_is_the_product_then_the_quantization(dtype: torch.dtype, rows: int, inter: int, block: int | None, gen: torch.Generator, device: torch.device, poison_empty: None) -> None:  # fmt: skip
    x = rand((rows, 2 * inter), dtype, gen, device) * 3
    got = silu_and_mul_fp8(x, block=block)  # block: the two-pass loop over a wide row
    y = silu_and_mul(x)
    _same_fp8(got, per_token_quant_fp8(y))
    _same_fp8(got, ref_per_token_quant_fp8(y))
    # a strided view of a wider tensor (a step's rows of a larger buffer)
    wide = rand((rows, 2 * inter + 8), dtype, gen, device)[:, : 2 * inter]
    _same_fp8(silu_and_mul_fp8(wide, block=block), per_token_quant_fp8(silu_and_mul(wide)))


def test_silu_and_mul_fp8_takes_two_passes_over_long_steps(gen: torch.Generator, device: torch.device, monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    import kernels.triton_layers as layers

    monkeypatch.setattr(layers, "FP8_ONE_PASS_ROWS", 2)  # a "long" step of 3 rows
    monkeypatch.setattr(layers, "FP8_TWO_PASS_BLOCK", 64)  # rows of 100 outputs: two blocks
    x = rand((3, 200), torch.bfloat16, gen, device) * 3
    _same_fp8(silu_and_mul_fp8(x), per_token_quant_fp8(silu_and_mul(x)))


def test_silu_and_mul_fp8_edges(gen: torch.Generator, device: torch.device) -> None:
    q, s = silu_and_mul_fp8(torch.zeros((0, 8), dtype=torch.bfloat16, device=device))
    assert q.shape == (0, 4) and s.shape == (0, 1)
    with pytest.raises(ValueError, match="even"):
        silu_and_mul_fp8(rand((2, 7), torch.bfloat16, gen, device))


@pytest.mark.parametrize("dtype", [*DTYPES, torch.float16])
@pytest.mark.parametrize(("hq", "hkv", "d", "rot"), [(4, 4, 32, 32), (8, 2, 64, 64), (3, 1, 24, 24), (4, 2, 32, 24), (2, 1, 96, 72)])  # fmt: skip
def test_rotary_on_strided_qkv_views(dtype: torch.dtype, hq: int, hkv: int, d: int, rot: int, gen: torch.Generator, device: torch.device) -> None:  # fmt: skip
    """Rounded where the reference rounds (cos/sin, each product, each sum): bit for bit against
    the reference rounding the way the kernels do (the interpreter truncates to bf16). ``rot``
    < ``d``: partial rotary, the first ``rot`` dims of each head rotate, the others stay."""
    t = 6
    qkv = rand((t, hq + 2 * hkv, d), dtype, gen, device) * 4
    q, k = qkv[:, :hq], qkv[:, hq : hq + hkv]
    cos_sin = rand((50, rot), torch.float32, gen, device)
    positions = torch.tensor([0, 1, 2, 49, 17, 17], device=device)
    ref_q, ref_k = q.clone(), k.clone()
    untouched = qkv[:, hq + hkv :].clone()
    ref_rotary_embedding(positions, ref_q, ref_k, cos_sin)
    # the test's twin of the reference is the reference when rounding as torch does
    assert torch.equal(rotate(positions, q, cos_sin, torch_rounding), ref_q.float())
    assert torch.equal(rotate(positions, k, cos_sin, torch_rounding), ref_k.float())
    want_q = rotate(positions, q, cos_sin, kernel_rounding(device))
    want_k = rotate(positions, k, cos_sin, kernel_rounding(device))
    rotary_embedding(positions.int(), q, k, cos_sin)
    assert_rotated(q, want_q, dtype)
    assert_rotated(k, want_k, dtype)
    assert torch.equal(qkv[:, hq + hkv :], untouched)  # v was not written


def test_rotary_rounds_in_the_activation_dtype(gen: torch.Generator, device: torch.device) -> None:
    """bf16: o1 = rnd(rnd(x1 c) - rnd(x2 s)) with c, s rounded, not one rounding of fp32 math."""
    d = 64
    q = rand((64, 2, d), torch.bfloat16, gen, device) * 8
    k = rand((64, 1, d), torch.bfloat16, gen, device) * 8
    cos_sin = rand((64, d), torch.float32, gen, device)
    positions = torch.arange(64, device=device)
    ref_q, ref_k = q.clone(), k.clone()
    ref_rotary_embedding(positions, ref_q, ref_k, cos_sin)
    once = rotate(positions, q.float(), cos_sin, torch_rounding).bfloat16()  # fp32, rounded once
    assert not torch.equal(ref_q, once)
    want_q = rotate(positions, q, cos_sin, kernel_rounding(device))
    rotary_embedding(positions, q, k, cos_sin)
    assert_rotated(q, want_q, q.dtype)


def test_rotary_errors(gen: torch.Generator, device: torch.device) -> None:
    q = rand((2, 4, 32), torch.float32, gen, device)
    k = rand((2, 2, 32), torch.float32, gen, device)
    with pytest.raises(
        ValueError, match="cos_sin_cache width 48 must be even and at most head_dim 32"
    ):
        rotary_embedding(torch.tensor([0, 1]), q, k, rand((10, 48), torch.float32, gen, device))
    with pytest.raises(ValueError, match="cos_sin_cache width 15"):
        rotary_embedding(torch.tensor([0, 1]), q, k, rand((10, 15), torch.float32, gen, device))
    with pytest.raises(ValueError, match="positions has 3 entries"):
        rotary_embedding(torch.tensor([0, 1, 2]), q, k, rand((10, 32), torch.float32, gen, device))


@pytest.mark.gpu
def test_gpu_llama_shapes() -> None:
    gen, cuda = torch.Generator().manual_seed(0), torch.device("cuda")
    x, r = (
        rand((512, 4096), torch.bfloat16, gen, cuda),
        rand((512, 4096), torch.bfloat16, gen, cuda),
    )
    w = rand((4096,), torch.bfloat16, gen, cuda)
    assert_matches(rms_norm(x, w, 1e-5, r)[0], ref_rms_norm(x, w, 1e-5, r)[0])
    y = rand((512, 2 * 14336), torch.bfloat16, gen, cuda)
    assert_matches(silu_and_mul(y), ref_silu_and_mul(y))
    # the FP8 W8A8 inputs at the 8B shapes, compiled: the fused kernels against the two in turn
    _same_fp8(silu_and_mul_fp8(y), per_token_quant_fp8(silu_and_mul(y)))
    _within_a_step(rms_norm_fp8(x, w, 1e-5, r)[:2], per_token_quant_fp8(rms_norm(x, w, 1e-5, r)[0]))
    q, k = (
        rand((512, 32, 128), torch.bfloat16, gen, cuda),
        rand((512, 8, 128), torch.bfloat16, gen, cuda),
    )
    cs, pos = (
        rand((8192, 128), torch.float32, gen, cuda),
        torch.randint(0, 8192, (512,), device=cuda),
    )
    rq, rk = q.clone(), k.clone()
    ref_rotary_embedding(pos, rq, rk, cs)
    rotary_embedding(pos, q, k, cs)
    assert_rotated(q, rq, q.dtype)  # compiled kernels round to nearest even, as torch does
    assert_rotated(k, rk, k.dtype)


def _within_a_step(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]) -> None:  # fmt: skip
    """The fused norm compiled: its normalized values may sit a bf16 step from rms_norm's (the
    sum of squares in another order, module docstring of kernels.triton_layers), so a rare e4m3
    value a step away (at most 1/8 of its magnitude, or a subnormal step), a rare scale a bf16
    step of its row's largest value away."""
    q, s = got[0].float(), got[1]
    want_q, want_s = want[0].float(), want[1]
    assert torch.allclose(s, want_s, rtol=2**-7, atol=0)
    same_row = (s == want_s).squeeze(1)
    assert same_row.float().mean().item() >= 1 - 1e-3
    apart = (q != want_q) & same_row[:, None]
    assert apart.float().mean().item() <= 1e-5
    assert ((q - want_q).abs() <= want_q.abs() / 8 + 2**-9)[apart].all()
    # a row whose scale moved: its values dequantized agree within e4m3's rounding
    dq, want_dq = q * s, want_q * want_s
    close = (dq - want_dq).abs() <= want_dq.abs() / 8 + 2**-9 * want_s
    assert close[~same_row].all()


@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(4))
def test_gpu_fp8_forms_against_the_two_kernels(seed: int) -> None:
    """Compiled at the 8B shapes of a W1 prefill step (8192 rows). The SiLU's form is bit for
    bit; the norm's within a step on the rare values its summation order moves (0 to 9 of the
    33.5 M values of a call on an H200, where 512 rows of one seed had shown none)."""
    gen, cuda = torch.Generator().manual_seed(seed), torch.device("cuda")
    x, r = (rand((8192, 4096), torch.bfloat16, gen, cuda) * 3 for _ in range(2))
    w = rand((4096,), torch.bfloat16, gen, cuda)
    for residual in (None, r):
        q, scales, res = rms_norm_fp8(x, w, 1e-5, residual)
        y, want_res = rms_norm(x, w, 1e-5, residual)
        _within_a_step((q, scales), per_token_quant_fp8(y))
        assert torch.equal(res, want_res)
    gu = rand((2048, 2 * 14336), torch.bfloat16, gen, cuda) * 3
    _same_fp8(silu_and_mul_fp8(gu), per_token_quant_fp8(silu_and_mul(gu)))
