"""Element-wise layers of the Llama family in Triton: fused add + RMSNorm, SiLU-and-mul, RoPE.

Same signatures and semantics as :mod:`kernels.layers`. All three are memory-bound: each reads
its inputs and writes its outputs once, with fp32 arithmetic in registers, rounded to the
activation dtype where the references (and transformers' Llama code) round:
``.to(dtype).to(tl.float32)``, an identity in float32. They launch with ``enable_fp_fusion=False``:
otherwise the compiler turns a rounded product followed by a sum into one bf16 FMA (seen in the
sm_90 PTX: ``fma.rn.bf16``), which skips the product's rounding and drifts from torch by an ulp.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_common import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_devices,
    check_tensor,
    next_pow2,
    pdl,
    pdl_enter,
)

MAX_NORM_WIDTH = 65536


@triton.jit
def _rms_norm_kernel(
    x_ptr, r_ptr, w_ptr, out_ptr, rout_ptr, s_x, s_r, s_o, s_ro, width, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    pdl_enter(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < width
    x = tl.load(x_ptr + row * s_x + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        x += tl.load(r_ptr + row * s_r + offs, mask=mask, other=0.0).to(tl.float32)
        x_io = x.to(rout_ptr.dtype.element_ty)  # the reference rounds the sum to x's dtype
        tl.store(rout_ptr + row * s_ro + offs, x_io, mask=mask)
        x = x_io.to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(x * x, 0) / width + eps)
    # as LlamaRMSNorm: round the normalized value to x's dtype, then weight * it, rounded once
    normed = (x * rstd).to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * s_o + offs, (w * normed).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_and_mul_kernel(
    x_ptr, out_ptr, s_x, s_o, inter, BLOCK: tl.constexpr, USE_PDL: tl.constexpr
):
    pdl_enter(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    gate = tl.load(x_ptr + row * s_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * s_x + inter + offs, mask=mask, other=0.0).to(tl.float32)
    # as act_fn(gate) * up in x's dtype: silu rounded to it, then the product rounded
    act = tl.div_rn(gate, 1.0 + tl.exp(-gate)).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * s_o + offs, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def rotate_half_pair(x1, x2, cos, sin, DTYPE: tl.constexpr):
    """NeoX rotation of the halves (x1, x2), fp32 in and out, rounded like transformers'
    ``q * cos + rotate_half(q) * sin`` in ``DTYPE``: cos and sin rounded to it, then each product
    and each sum (an identity when DTYPE is float32). Returns (o1, o2), still to be stored."""
    c = cos.to(DTYPE).to(tl.float32)
    s = sin.to(DTYPE).to(tl.float32)
    o1 = (x1 * c).to(DTYPE).to(tl.float32) - (x2 * s).to(DTYPE).to(tl.float32)
    o2 = (x2 * c).to(DTYPE).to(tl.float32) + (x1 * s).to(DTYPE).to(tl.float32)
    return o1, o2


@triton.jit
def _rotate_heads(x_ptr, s_h, num_heads, cos, sin, HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):  # fmt: skip
    offs_h = tl.arange(0, BLOCK_H)
    offs = tl.arange(0, BLOCK_HALF)
    mask = (offs_h < num_heads)[:, None] & (offs < HALF)[None, :]
    p1 = x_ptr + offs_h[:, None] * s_h + offs[None, :]
    x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(p1 + HALF, mask=mask, other=0.0).to(tl.float32)
    o1, o2 = rotate_half_pair(x1, x2, cos[None, :], sin[None, :], x_ptr.dtype.element_ty)
    tl.store(p1, o1.to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(p1 + HALF, o2.to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kernel(
    pos_ptr, q_ptr, k_ptr, cs_ptr, s_qt, s_qh, s_kt, s_kh, s_cs, num_q_heads, num_k_heads,
    HALF: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    offs = tl.arange(0, BLOCK_HALF)
    mask = offs < HALF
    cos = tl.load(cs_ptr + pos * s_cs + offs, mask=mask, other=0.0).to(tl.float32)
    sin = tl.load(cs_ptr + pos * s_cs + HALF + offs, mask=mask, other=0.0).to(tl.float32)
    _rotate_heads(q_ptr + t * s_qt, s_qh, num_q_heads, cos, sin, HALF, BLOCK_HQ, BLOCK_HALF)
    _rotate_heads(k_ptr + t * s_kt, s_kh, num_k_heads, cos, sin, HALF, BLOCK_HK, BLOCK_HALF)


def _row_warps(block: int) -> int:
    return max(1, min(16, block // 512))


def rms_norm(
    x: torch.Tensor,  # [T, H]
    weight: torch.Tensor,  # [H]
    eps: float,
    residual: torch.Tensor | None = None,  # [T, H]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of :func:`kernels.layers.ref_rms_norm`: (norm(x + residual), x + residual)."""
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    check_tensor("weight", weight, ndim=1, dtypes=FLOAT_DTYPES)
    rows, width = x.shape
    if weight.shape[0] != width:
        raise ValueError(f"weight has {weight.shape[0]} entries for width {width}")
    if width > MAX_NORM_WIDTH:
        raise ValueError(f"rms_norm width {width} > {MAX_NORM_WIDTH} is not supported")
    if residual is not None:
        check_tensor("residual", residual, ndim=2, dtypes=FLOAT_DTYPES)
        if residual.shape != x.shape:
            raise ValueError(f"residual {tuple(residual.shape)} != x {tuple(x.shape)}")
        check_devices(x=x, weight=weight, residual=residual)
    else:
        check_devices(x=x, weight=weight)
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    res_out = torch.empty_like(out) if residual is not None else x
    if rows == 0:
        return out, res_out
    block = next_pow2(width)
    _rms_norm_kernel[(rows,)](
        x, residual if residual is not None else x, weight, out, res_out,
        x.stride(0), residual.stride(0) if residual is not None else 0,
        out.stride(0), res_out.stride(0), width, float(eps),
        HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=_row_warps(block),
        enable_fp_fusion=False, **pdl(x.device, rows),
    )  # fmt: skip
    return out, res_out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:  # [..., 2I] -> [..., I]
    """Triton version of :func:`kernels.layers.ref_silu_and_mul`."""
    check_tensor("x", x, dtypes=FLOAT_DTYPES)
    if x.dim() < 1 or x.shape[-1] % 2 != 0:
        raise ValueError(f"x's last dim must be even, shape {tuple(x.shape)}")
    check_devices(x=x)
    inter = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * inter)
    out = torch.empty((x2.shape[0], inter), dtype=x.dtype, device=x.device)
    if out.numel() > 0:
        block = min(4096, next_pow2(inter))
        grid = (x2.shape[0], triton.cdiv(inter, block))
        _silu_and_mul_kernel[grid](
            x2,
            out,
            x2.stride(0),
            out.stride(0),
            inter,
            BLOCK=block,
            num_warps=_row_warps(block),
            enable_fp_fusion=False,
            **pdl(x.device, x2.shape[0]),
        )
    return out.view(*x.shape[:-1], inter)


def rotary_embedding(
    positions: torch.Tensor,  # [T] int64
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hkv, D]
    cos_sin_cache: torch.Tensor,  # [max_pos, D] float32: cos in [:, :D/2], sin in [:, D/2:]
) -> None:
    """Triton version of :func:`kernels.layers.ref_rotary_embedding` (in place, NeoX halves).

    q and k may be strided views (e.g. slices of a fused qkv tensor); positions are not
    bounds-checked against the cache.
    """
    check_tensor("positions", positions, ndim=1, dtypes=INDEX_DTYPES, inner_contiguous=False)
    check_tensor("q", q, ndim=3, dtypes=FLOAT_DTYPES)
    check_tensor("k", k, ndim=3, dtypes=FLOAT_DTYPES)
    check_tensor("cos_sin_cache", cos_sin_cache, ndim=2, dtypes=FLOAT_DTYPES)
    t, hq, d = q.shape
    if k.shape[0] != t or k.shape[2] != d:
        raise ValueError(f"k {tuple(k.shape)} does not match q {tuple(q.shape)}")
    if positions.shape[0] != t:
        raise ValueError(f"positions has {positions.shape[0]} entries for {t} tokens")
    if d % 2 != 0:
        raise ValueError(f"head_dim must be even for NeoX rotary, got {d}")
    if cos_sin_cache.shape[1] != d:
        raise ValueError(f"cos_sin_cache width {cos_sin_cache.shape[1]} != head_dim {d}")
    check_devices(positions=positions, q=q, k=k, cos_sin_cache=cos_sin_cache)
    if t == 0:
        return
    half = d // 2
    _rope_kernel[(t,)](
        positions, q, k, cos_sin_cache, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        cos_sin_cache.stride(0), hq, k.shape[1],
        HALF=half, BLOCK_HQ=next_pow2(hq), BLOCK_HK=next_pow2(k.shape[1]),
        BLOCK_HALF=next_pow2(half), num_warps=4 if next_pow2(hq) * next_pow2(half) >= 2048 else 1,
        enable_fp_fusion=False,
    )  # fmt: skip
