"""RMSNorm, SiLU-and-mul and rotary embedding (Triton) against the references."""

from __future__ import annotations

import pytest
import torch

from kernels.layers import ref_rms_norm, ref_rotary_embedding, ref_silu_and_mul
from kernels.triton_layers import rms_norm, rotary_embedding, silu_and_mul
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


def test_silu_and_mul_needs_an_even_width(gen: torch.Generator, device: torch.device) -> None:
    with pytest.raises(ValueError, match="even"):
        silu_and_mul(rand((2, 7), torch.float32, gen, device))


@pytest.mark.parametrize("dtype", [*DTYPES, torch.float16])
@pytest.mark.parametrize(("hq", "hkv", "d"), [(4, 4, 32), (8, 2, 64), (3, 1, 24)])
def test_rotary_on_strided_qkv_views(dtype: torch.dtype, hq: int, hkv: int, d: int, gen: torch.Generator, device: torch.device) -> None:  # fmt: skip
    """Rounded where the reference rounds (cos/sin, each product, each sum): bit for bit against
    the reference rounding the way the kernels do (the interpreter truncates to bf16)."""
    t = 6
    qkv = rand((t, hq + 2 * hkv, d), dtype, gen, device) * 4
    q, k = qkv[:, :hq], qkv[:, hq : hq + hkv]
    cos_sin = rand((50, d), torch.float32, gen, device)
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
    with pytest.raises(ValueError, match="cos_sin_cache width 16 != head_dim 32"):
        rotary_embedding(torch.tensor([0, 1]), q, k, rand((10, 16), torch.float32, gen, device))
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
