"""Paged attention in Triton: the KV cache write here, decode and prefill beside it.

Same signatures and semantics as :mod:`kernels.attention` (the pure-torch references). The cache
layout is ``[num_blocks, block_size, Hkv, D]`` per K and V; token ``t`` of a sequence lives in
block ``block_table[t // block_size]`` at offset ``t % block_size``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.attention import FP8_KV_DTYPES, check_k_out, inverse_scale
from kernels.layers import check_rotary_width
from kernels.triton_common import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_devices,
    check_kv_cache,
    check_tensor,
    next_pow2,
    pdl,
    pdl_enter,
    to_kv,
)
from kernels.triton_decode import choose_num_splits, paged_decode_attention
from kernels.triton_layers import rotate_half_pair
from kernels.triton_prefill import prefill_attention
from kernels.triton_varlen import varlen_attention

__all__ = [
    "choose_num_splits",
    "paged_decode_attention",
    "prefill_attention",
    "rotary_write_kv",
    "varlen_attention",
    "write_kv",
]


# the most elements of one program's query tile in rotary_write_kv: wider, its heads are split
Q_TILE_ELEMS = 16384


@triton.jit(do_not_specialize=["slot_ptr"])  # a per-step staging slice
def _write_kv_kernel(
    k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, k_inv, v_inv,
    s_kt, s_kh, s_vt, s_vh, s_kcn, s_kcb, s_kch, s_vcn, s_vcb, s_vch,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, FP8: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    pdl_enter(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    head_ok = (offs_h < NUM_HEADS) & ((offs_h * 0 + slot) >= 0)  # slot < 0: skip the token
    mask = head_ok[:, None] & (offs_d < HEAD_DIM)[None, :]
    k = tl.load(k_ptr + t * s_kt + offs_h[:, None] * s_kh + offs_d[None, :], mask=mask)
    v = tl.load(v_ptr + t * s_vt + offs_h[:, None] * s_vh + offs_d[None, :], mask=mask)
    kc = kc_ptr + blk * s_kcn + off * s_kcb + offs_h[:, None] * s_kch + offs_d[None, :]
    vc = vc_ptr + blk * s_vcn + off * s_vcb + offs_h[:, None] * s_vch + offs_d[None, :]
    tl.store(kc, to_kv(k, k_inv, FP8).to(kc_ptr.dtype.element_ty), mask=mask)
    tl.store(vc, to_kv(v, v_inv, FP8).to(vc_ptr.dtype.element_ty), mask=mask)


def write_kv(
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [N, bs, Hkv, D]
    v_cache: torch.Tensor,  # [N, bs, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int64, -1 = do not write
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Triton version of :func:`kernels.attention.ref_write_kv` (slots are not bounds-checked)."""
    check_tensor("k", k, ndim=3, dtypes=FLOAT_DTYPES)
    check_tensor("v", v, ndim=3, dtypes=FLOAT_DTYPES)
    _, bs, hkv, d = check_kv_cache(k_cache, v_cache)
    check_tensor("slot_mapping", slot_mapping, ndim=1, dtypes=INDEX_DTYPES, inner_contiguous=False)
    if k.shape != v.shape:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} differ in shape")
    if tuple(k.shape[1:]) != (hkv, d):
        raise ValueError(
            f"k/v heads x dim {tuple(k.shape[1:])} do not match the cache's {(hkv, d)}"
        )
    if slot_mapping.shape[0] != k.shape[0]:
        raise ValueError(
            f"slot_mapping has {slot_mapping.shape[0]} entries for {k.shape[0]} tokens"
        )
    check_devices(k=k, v=v, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping)
    if k.shape[0] == 0:
        return
    block_h, block_d = next_pow2(hkv), next_pow2(d)
    _write_kv_kernel[(k.shape[0],)](
        k, v, k_cache, v_cache, slot_mapping, inverse_scale(k_scale), inverse_scale(v_scale),
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        *k_cache.stride()[:3], *v_cache.stride()[:3],
        NUM_HEADS=hkv, HEAD_DIM=d, BLOCK_H=block_h, BLOCK_D=block_d, BLOCK_SIZE=bs,
        FP8=k_cache.dtype in FP8_KV_DTYPES,
        num_warps=4 if block_h * block_d >= 2048 else 1, **pdl(k.device, k.shape[0]),
    )  # fmt: skip


@triton.jit
def _rotate_into(
    src_ptr, s_src_h, dst_ptr, s_dst_h, num_heads, cos, sin, gate, dst_inv,
    HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, FP8: tl.constexpr,
    PASS: tl.constexpr, BLOCK_PASS: tl.constexpr,
):  # fmt: skip
    offs_h = tl.arange(0, BLOCK_H)
    offs = tl.arange(0, BLOCK_HALF)
    head_ok = (offs_h < num_heads) & ((offs_h * 0 + gate) >= 0)  # gate < 0: write nothing
    mask = head_ok[:, None] & (offs < HALF)[None, :]
    src = src_ptr + offs_h[:, None] * s_src_h + offs[None, :]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    dst = dst_ptr + offs_h[:, None] * s_dst_h + offs[None, :]
    # round like the reference: rotate in the source dtype (as transformers does), store in it,
    # then cast to the cache's (an FP8 cache: scaled and rounded to e4m3 first)
    o1, o2 = rotate_half_pair(x1, x2, cos[None, :], sin[None, :], src_ptr.dtype.element_ty)
    o1 = to_kv(o1.to(src_ptr.dtype.element_ty), dst_inv, FP8)
    o2 = to_kv(o2.to(src_ptr.dtype.element_ty), dst_inv, FP8)
    tl.store(dst, o1.to(dst_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + HALF, o2.to(dst_ptr.dtype.element_ty), mask=mask)
    if PASS > 0:  # partial rotary: the dims after the rotated 2 * HALF go over as they are
        offs_p = tl.arange(0, BLOCK_PASS)
        pmask = head_ok[:, None] & (offs_p < PASS)[None, :]
        rest = offs_h[:, None] * s_src_h + 2 * HALF + offs_p[None, :]
        x = tl.load(src_ptr + rest, mask=pmask, other=0.0)
        dst_p = dst_ptr + offs_h[:, None] * s_dst_h + 2 * HALF + offs_p[None, :]
        tl.store(dst_p, to_kv(x, dst_inv, FP8).to(dst_ptr.dtype.element_ty), mask=pmask)


@triton.jit(do_not_specialize=["pos_ptr", "slot_ptr"])  # per-step staging slices
def _rotary_write_kv_kernel(
    pos_ptr, q_ptr, k_ptr, v_ptr, cs_ptr, qo_ptr, kc_ptr, vc_ptr, slot_ptr, ko_ptr, k_inv, v_inv,
    s_qt, s_qh, s_kt, s_kh, s_vt, s_vh, s_cs, s_ot, s_oh, s_kot, s_koh,
    s_kcn, s_kcb, s_kch, s_vcn, s_vcb, s_vch, num_q_heads, num_kv_heads,
    HALF: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
    BLOCK_HALF: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, FP8: tl.constexpr,
    K_OUT: tl.constexpr, USE_PDL: tl.constexpr, PASS: tl.constexpr, BLOCK_PASS: tl.constexpr,
    WRITE_V: tl.constexpr, Q_SPLIT: tl.constexpr,
):  # fmt: skip
    pdl_enter(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    offs = tl.arange(0, BLOCK_HALF)
    cmask = offs < HALF
    cos = tl.load(cs_ptr + pos * s_cs + offs, mask=cmask, other=0.0).to(tl.float32)
    sin = tl.load(cs_ptr + pos * s_cs + HALF + offs, mask=cmask, other=0.0).to(tl.float32)
    h0 = tl.program_id(1) * BLOCK_HQ  # this program's query heads: [h0, h0 + BLOCK_HQ)
    _rotate_into(
        q_ptr + t * s_qt + h0 * s_qh, s_qh, qo_ptr + t * s_ot + h0 * s_oh, s_oh,
        num_q_heads - h0, cos, sin, t, 1.0, HALF, BLOCK_HQ, BLOCK_HALF, False, PASS, BLOCK_PASS,
    )  # fmt: skip
    if Q_SPLIT:  # the token's heads over several programs: the first writes its keys (and values)
        if tl.program_id(1) == 0:
            _rotary_write_k_v(
                t, k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, ko_ptr, k_inv, v_inv, s_kt, s_kh,
                s_vt, s_vh, s_kot, s_koh, s_kcn, s_kcb, s_kch, s_vcn, s_vcb, s_vch, num_kv_heads,
                cos, sin, HALF, HEAD_DIM, BLOCK_HK, BLOCK_HALF, BLOCK_D, BLOCK_SIZE, FP8, K_OUT,
                PASS, BLOCK_PASS, WRITE_V,
            )  # fmt: skip
    else:
        _rotary_write_k_v(
            t, k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, ko_ptr, k_inv, v_inv, s_kt, s_kh, s_vt,
            s_vh, s_kot, s_koh, s_kcn, s_kcb, s_kch, s_vcn, s_vcb, s_vch, num_kv_heads, cos, sin,
            HALF, HEAD_DIM, BLOCK_HK, BLOCK_HALF, BLOCK_D, BLOCK_SIZE, FP8, K_OUT, PASS,
            BLOCK_PASS, WRITE_V,
        )  # fmt: skip


@triton.jit
def _rotary_write_k_v(
    t, k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, ko_ptr, k_inv, v_inv, s_kt, s_kh, s_vt, s_vh,
    s_kot, s_koh, s_kcn, s_kcb, s_kch, s_vcn, s_vcb, s_vch, num_kv_heads, cos, sin,
    HALF: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_HK: tl.constexpr,
    BLOCK_HALF: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, FP8: tl.constexpr,
    K_OUT: tl.constexpr, PASS: tl.constexpr, BLOCK_PASS: tl.constexpr, WRITE_V: tl.constexpr,
):  # fmt: skip
    slot = tl.load(slot_ptr + t).to(tl.int64)
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    _rotate_into(
        k_ptr + t * s_kt, s_kh, kc_ptr + blk * s_kcn + off * s_kcb, s_kch, num_kv_heads, cos, sin,
        slot, k_inv, HALF, BLOCK_HK, BLOCK_HALF, FP8, PASS, BLOCK_PASS,
    )  # fmt: skip
    if K_OUT:  # the rotated keys in the model's dtype, row for row (prefill attention reads them)
        _rotate_into(
            k_ptr + t * s_kt, s_kh, ko_ptr + t * s_kot, s_koh, num_kv_heads, cos, sin, t, 1.0,
            HALF, BLOCK_HK, BLOCK_HALF, False, PASS, BLOCK_PASS,
        )  # fmt: skip
    if WRITE_V:  # (without: the values are the keys just written, DeepSeek's latent)
        offs_h = tl.arange(0, BLOCK_HK)
        offs_d = tl.arange(0, BLOCK_D)
        v_heads = (offs_h < num_kv_heads) & ((offs_h * 0 + slot) >= 0)
        vmask = v_heads[:, None] & (offs_d < HEAD_DIM)[None, :]
        v = tl.load(v_ptr + t * s_vt + offs_h[:, None] * s_vh + offs_d[None, :], mask=vmask)
        vc = vc_ptr + blk * s_vcn + off * s_vcb + offs_h[:, None] * s_vch + offs_d[None, :]
        tl.store(vc, to_kv(v, v_inv, FP8).to(vc_ptr.dtype.element_ty), mask=vmask)


def rotary_write_kv(
    positions: torch.Tensor,  # [T] int64
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor | None,  # [T, Hkv, D]; None: the keys are the values (written once)
    cos_sin_cache: torch.Tensor,  # [max_pos, R] float32, R <= D (R < D: partial rotary)
    k_cache: torch.Tensor,  # [N, bs, Hkv, D]
    v_cache: torch.Tensor,  # [N, bs, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int64, -1 = do not write
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    k_out: torch.Tensor | None = None,  # [T, Hkv, D] of k's dtype: the rotated keys, also here
) -> torch.Tensor:  # [T, Hq, D]
    """Triton version of :func:`kernels.attention.ref_rotary_write_kv`: one launch instead of
    rotary + three contiguous copies + the KV write (a decode step's per-layer launch count is
    what bounds batch-1 latency). Positions and slots are not bounds-checked."""
    check_tensor("positions", positions, ndim=1, dtypes=INDEX_DTYPES, inner_contiguous=False)
    write_v = v is not None
    v = v if v is not None else k  # no value write: the kernel never reads it
    for name, x in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, x, ndim=3, dtypes=FLOAT_DTYPES)
    check_tensor("cos_sin_cache", cos_sin_cache, ndim=2, dtypes=FLOAT_DTYPES)
    _, bs, hkv, d = check_kv_cache(k_cache, v_cache)
    check_tensor("slot_mapping", slot_mapping, ndim=1, dtypes=INDEX_DTYPES, inner_contiguous=False)
    t, hq, qd = q.shape
    if k.shape != v.shape or tuple(k.shape[1:]) != (hkv, d):
        raise ValueError(
            f"k {tuple(k.shape)} / v {tuple(v.shape)} do not match the cache's heads x dim {(hkv, d)}"
        )
    if k.shape[0] != t or qd != d:
        raise ValueError(f"q {tuple(q.shape)} does not match k {tuple(k.shape)}")
    if positions.shape[0] != t or slot_mapping.shape[0] != t:
        raise ValueError(
            f"positions ({positions.shape[0]}) and slot_mapping ({slot_mapping.shape[0]}) "
            f"need one entry per token ({t})"
        )
    half = check_rotary_width(cos_sin_cache, d) // 2
    check_devices(
        positions=positions, q=q, k=k, v=v, cos_sin_cache=cos_sin_cache, k_cache=k_cache,
        v_cache=v_cache, slot_mapping=slot_mapping,
    )  # fmt: skip
    check_k_out(k_out, k)
    out = torch.empty((t, hq, d), dtype=q.dtype, device=q.device)
    if t == 0:
        return out
    # a token's query heads in tiles of at most Q_TILE_ELEMS (DeepSeek's 128 heads of 576 dims:
    # 16 a program, 8 programs a token; every other model's heads in one)
    block_hq = next_pow2(hq)
    width = 2 * next_pow2(half) + (next_pow2(d - 2 * half) if d > 2 * half else 0)
    while block_hq > 1 and block_hq * width > Q_TILE_ELEMS:
        block_hq //= 2
    tile = block_hq * next_pow2(half)
    ko = k_out if k_out is not None else out
    _rotary_write_kv_kernel[(t, triton.cdiv(hq, block_hq))](
        positions, q, k, v, cos_sin_cache, out, k_cache, v_cache, slot_mapping, ko,
        inverse_scale(k_scale), inverse_scale(v_scale), q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        cos_sin_cache.stride(0), out.stride(0), out.stride(1), ko.stride(0), ko.stride(1),
        *k_cache.stride()[:3], *v_cache.stride()[:3], hq, hkv,
        HALF=half, HEAD_DIM=d, BLOCK_HQ=block_hq, BLOCK_HK=next_pow2(hkv),
        BLOCK_HALF=next_pow2(half), BLOCK_D=next_pow2(d), BLOCK_SIZE=bs,
        FP8=k_cache.dtype in FP8_KV_DTYPES, K_OUT=k_out is not None,
        PASS=d - 2 * half, BLOCK_PASS=next_pow2(max(d - 2 * half, 1)),  # partial rotary
        WRITE_V=write_v, Q_SPLIT=block_hq < next_pow2(hq), num_warps=4 if tile >= 2048 else 1,
        enable_fp_fusion=False, **pdl(q.device, t),
    )  # fmt: skip
    return out
