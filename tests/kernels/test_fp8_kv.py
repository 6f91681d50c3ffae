"""FP8 (e4m3) KV caches: the rounding, the writes and both attention kernels against the references."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

import kernels.triton_attention as ta
from kernels.attention import (
    E4M3_MAX,
    ref_paged_decode_attention,
    ref_prefill_attention,
    ref_rotary_write_kv,
    ref_write_kv,
    to_cache_dtype,
)
from kernels.triton_common import interpreting, round_to_e4m3, to_e4m3
from kernels.triton_decode import paged_decode_attention
from kernels.triton_prefill import prefill_attention
from tests.kernels.paged import assert_matches, paged_kv, rand

FP8 = torch.float8_e4m3fn


@triton.jit
def _round_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask)
    tl.store(out_ptr + offs, round_to_e4m3(x).to(out_ptr.dtype.element_ty), mask=mask)


def every_e4m3_value_and_the_midpoints() -> torch.Tensor:
    """Each finite e4m3 value, the midpoints between neighbours (the ties), values just beside
    them, subnormals, zeros of both signs and values far past the saturation point."""
    finite = torch.arange(256, dtype=torch.uint8).view(FP8).float()
    finite = finite[torch.isfinite(finite)].unique()  # -448 .. 448, with 0
    mids = (finite[1:] + finite[:-1]) / 2
    beside = torch.cat([mids * (1 + 2**-20), mids * (1 - 2**-20)])
    extra = torch.tensor([-0.0, 0.0, 2**-10, -(2**-10), 2**-12, 449.0, 464.0, 500.0, -1e6, 1e30])
    return torch.cat([finite, mids, beside, extra])


@triton.jit
def _cast_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr, SOFT: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(out_ptr + offs, to_e4m3(tl.load(x_ptr + offs, mask=mask), SOFT), mask=mask)


def test_the_kernel_rounding_equals_torch_bit_for_bit(device: torch.device) -> None:
    x = every_e4m3_value_and_the_midpoints().to(device)
    out = torch.empty(x.shape, dtype=FP8, device=device)
    _round_kernel[(triton.cdiv(x.numel(), 1024),)](x, out, x.numel(), BLOCK=1024)
    ref = x.clamp(-E4M3_MAX, E4M3_MAX).to(FP8)
    assert torch.equal(out.view(torch.uint8), ref.view(torch.uint8))
    # to_e4m3: the hardware conversion when compiled (the float rounding under the interpreter)
    cast = torch.empty_like(out)
    grid = (triton.cdiv(x.numel(), 1024),)
    _cast_kernel[grid](x, cast, x.numel(), BLOCK=1024, SOFT=interpreting())
    assert torch.equal(cast.view(torch.uint8), ref.view(torch.uint8))
    assert torch.equal(to_cache_dtype(x, FP8).view(torch.uint8), ref.view(torch.uint8))
    assert out.float().abs().max().item() == E4M3_MAX  # saturated, never NaN


def fp8_caches(gen: torch.Generator, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    k = rand((6, 8, 2, 32), torch.float32, gen, device).to(FP8)
    return k, rand((6, 8, 2, 32), torch.float32, gen, device).to(FP8)


@pytest.mark.parametrize("src", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("k_scale", "v_scale"), [(1.0, 1.0), (0.25, 3.0)])
def test_write_kv_into_an_fp8_cache(src: torch.dtype, k_scale: float, v_scale: float, gen: torch.Generator, device: torch.device) -> None:  # fmt: skip
    k_cache, v_cache = fp8_caches(gen, device)
    k, v = rand((6, 2, 32), src, gen, device) * 40, rand((6, 2, 32), src, gen, device)
    slots = torch.tensor([0, -1, 7, 8, 47, 20], dtype=torch.int64, device=device)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    ref_write_kv(k, v, ref_k, ref_v, slots, k_scale, v_scale)
    ta.write_kv(k, v, k_cache, v_cache, slots, k_scale, v_scale)
    assert torch.equal(k_cache.view(torch.uint8), ref_k.view(torch.uint8))
    assert torch.equal(v_cache.view(torch.uint8), ref_v.view(torch.uint8))
    # what was written reads back as the scaled value, within e4m3's precision (3 mantissa bits)
    got = ref_k.view(-1, 2, 32)[slots[slots >= 0]].float() * k_scale
    want = k[slots >= 0].float().clamp(-E4M3_MAX * k_scale, E4M3_MAX * k_scale)
    torch.testing.assert_close(got, want, rtol=2**-4, atol=2**-9 * k_scale)


@pytest.mark.parametrize("rot", [32, 24])  # 24: partial rotary, 8 dims of each head pass
def test_rotary_write_kv_into_an_fp8_cache(rot: int, gen: torch.Generator, device: torch.device) -> None:  # fmt: skip
    k_cache, v_cache = fp8_caches(gen, device)
    t, hq, hkv, d = 5, 4, 2, 32
    q = rand((t, hq, d), torch.float32, gen, device)
    k, v = (
        rand((t, hkv, d), torch.float32, gen, device),
        rand((t, hkv, d), torch.float32, gen, device),
    )
    positions = torch.tensor([0, 3, 9, 100, 511], device=device)
    inv = 1.0 / (10000 ** (torch.arange(0, rot, 2, dtype=torch.float32) / rot))
    angles = torch.arange(512, dtype=torch.float32)[:, None] * inv[None, :]
    cos_sin = torch.cat([angles.cos(), angles.sin()], dim=-1).to(device)
    slots = torch.tensor([1, 9, -1, 40, 47], dtype=torch.int64, device=device)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    ref_q = ref_rotary_write_kv(positions, q, k, v, cos_sin, ref_k, ref_v, slots, 0.5, 2.0)
    out_q = ta.rotary_write_kv(positions, q, k, v, cos_sin, k_cache, v_cache, slots, 0.5, 2.0)
    torch.testing.assert_close(out_q, ref_q, rtol=1e-5, atol=1e-5)
    # the rotation may differ from torch's in the last float32 bit, which can move a value that
    # sits on an e4m3 midpoint to the neighbouring code: at most one step, on a rare element
    diff = (k_cache.float() - ref_k.float()).abs()
    assert (diff <= ref_k.float().abs() * 2**-3 + 2**-9).all() and (diff > 0).float().mean() < 0.01
    assert torch.equal(v_cache.view(torch.uint8), ref_v.view(torch.uint8))


MIXED_LENS = [1, 16, 17, 45, 100]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_attention_reads_an_fp8_cache(dtype: torch.dtype, num_splits: int, gen: torch.Generator, device: torch.device) -> None:  # fmt: skip
    k_cache, v_cache, tables = paged_kv(MIXED_LENS, 16, 2, 32, torch.float32, gen, device)
    k_cache, v_cache = k_cache.to(FP8), v_cache.to(FP8)  # the spare blocks stay NaN
    q = rand((len(MIXED_LENS), 8, 32), dtype, gen, device)
    lens = torch.tensor(MIXED_LENS, dtype=torch.int32, device=device)
    out = paged_decode_attention(q, k_cache, v_cache, tables, lens, 32**-0.5, num_splits=num_splits)
    ref = ref_paged_decode_attention(q, k_cache, v_cache, tables, lens, 32**-0.5)
    assert out.dtype == dtype
    assert_matches(out, ref)


# bf16 queries past fp16's range; fp16 ones of ordinary size (for those f16_read only adds a
# rounding of q * scale: it is off by default, since their keys are converted to fp16 anyway)
Q_CASES = [(torch.bfloat16, 1.0), (torch.bfloat16, 1e5), (torch.float16, 1.0)]


@pytest.mark.parametrize(("dtype", "magnitude"), Q_CASES)
@pytest.mark.parametrize("num_splits", [1, 3])
def test_an_fp8_cache_read_as_fp16_or_bf16_matches_the_reference(dtype: torch.dtype, num_splits: int, magnitude: float, gen: torch.Generator, device: torch.device) -> None:  # fmt: skip
    # the fp16 read (the default for bf16 queries) folds the softmax scale into q before
    # rounding it to fp16: bf16 queries past fp16's 65504 stay finite and match
    k_cache, v_cache, tables = paged_kv(MIXED_LENS, 16, 2, 32, torch.float32, gen, device)
    k_cache, v_cache = k_cache.to(FP8), v_cache.to(FP8)
    q = rand((len(MIXED_LENS), 8, 32), torch.float32, gen, device)
    q = (q * magnitude / q.abs().amax()).to(dtype)
    lens = torch.tensor(MIXED_LENS, dtype=torch.int32, device=device)
    ref = ref_paged_decode_attention(q, k_cache, v_cache, tables, lens, 32**-0.5)
    assert torch.isfinite(ref).all()
    outs = [
        paged_decode_attention(
            q, k_cache, v_cache, tables, lens, 32**-0.5, num_splits=num_splits, f16_read=f16
        )
        for f16 in (False, True)
    ]
    for out in outs:
        assert out.dtype == dtype
        assert_matches(out, ref)


@pytest.mark.parametrize("max_registers", [0, 128])
def test_a_register_cap_changes_nothing_but_speed(max_registers: int, gen: torch.Generator, device: torch.device) -> None:  # fmt: skip
    # an FP8 cache's kernel runs with its registers capped on a GPU by default (more programs a
    # multiprocessor); capped or not, it computes the same attention
    k_cache, v_cache, tables = paged_kv(MIXED_LENS, 16, 2, 32, torch.float32, gen, device)
    k_cache, v_cache = k_cache.to(FP8), v_cache.to(FP8)
    q = rand((len(MIXED_LENS), 8, 32), torch.bfloat16, gen, device)
    lens = torch.tensor(MIXED_LENS, dtype=torch.int32, device=device)
    ref = ref_paged_decode_attention(q, k_cache, v_cache, tables, lens, 32**-0.5)
    for splits in (1, 3):
        out = paged_decode_attention(
            q, k_cache, v_cache, tables, lens, 32**-0.5, num_splits=splits,
            max_registers=max_registers,
        )  # fmt: skip
        assert_matches(out, ref)
    with pytest.raises(ValueError, match="max_registers must be 0"):
        paged_decode_attention(q, k_cache, v_cache, tables, lens, 1.0, max_registers=-1)


def test_the_fp16_read_is_for_fp8_caches_only(gen: torch.Generator, device: torch.device) -> None:
    k_cache, v_cache, tables = paged_kv([3], 16, 2, 32, torch.bfloat16, gen, device)
    q = rand((1, 4, 32), torch.bfloat16, gen, device)
    lens = torch.tensor([3], dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="f16_read reads an FP8 cache"):
        paged_decode_attention(q, k_cache, v_cache, tables, lens, 1.0, f16_read=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_attention_reads_an_fp8_cache(dtype: torch.dtype, gen: torch.Generator, device: torch.device) -> None:  # fmt: skip
    q_lens, ctx = [5, 16, 1, 33], [5, 40, 17, 33]  # plain prompts and chunks after prefixes
    k_cache, v_cache, tables = paged_kv(ctx, 16, 2, 32, torch.float32, gen, device)
    k_cache, v_cache = k_cache.to(FP8), v_cache.to(FP8)
    q = rand((sum(q_lens), 4, 32), dtype, gen, device)
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    lens = torch.tensor(ctx, dtype=torch.int32, device=device)
    out = prefill_attention(q, k_cache, v_cache, tables, starts.to(device), lens, 32**-0.5)
    ref = ref_prefill_attention(q, k_cache, v_cache, tables, starts.to(device), lens, 32**-0.5)
    assert_matches(out, ref)


def test_a_16_bit_cache_still_needs_q_in_its_dtype(
    gen: torch.Generator, device: torch.device
) -> None:
    k_cache, v_cache, tables = paged_kv([3], 16, 2, 32, torch.bfloat16, gen, device)
    q = rand((1, 4, 32), torch.float32, gen, device)
    lens = torch.tensor([3], dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="KV cache dtype"):
        paged_decode_attention(q, k_cache, v_cache, tables, lens, 1.0)
