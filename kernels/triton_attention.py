"""Paged attention in Triton: the KV cache write here, decode and prefill beside it.

Same signatures and semantics as :mod:`kernels.attention` (the pure-torch references). The cache
layout is ``[num_blocks, block_size, Hkv, D]`` per K and V; token ``t`` of a sequence lives in
block ``block_table[t // block_size]`` at offset ``t % block_size``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_common import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_devices,
    check_kv_cache,
    check_tensor,
    next_pow2,
)
from kernels.triton_decode import paged_decode_attention
from kernels.triton_prefill import prefill_attention

__all__ = ["paged_decode_attention", "prefill_attention", "write_kv"]


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr,
    s_kt, s_kh, s_vt, s_vh, s_kcn, s_kcb, s_kch, s_vcn, s_vcb, s_vch,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
):  # fmt: skip
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
    tl.store(kc, k.to(kc_ptr.dtype.element_ty), mask=mask)
    tl.store(vc, v.to(vc_ptr.dtype.element_ty), mask=mask)


def write_kv(
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [N, bs, Hkv, D]
    v_cache: torch.Tensor,  # [N, bs, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int64, -1 = do not write
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
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        *k_cache.stride()[:3], *v_cache.stride()[:3],
        NUM_HEADS=hkv, HEAD_DIM=d, BLOCK_H=block_h, BLOCK_D=block_d, BLOCK_SIZE=bs,
        num_warps=4 if block_h * block_d >= 2048 else 1,
    )  # fmt: skip
