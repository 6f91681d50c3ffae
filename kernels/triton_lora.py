"""Batched LoRA in Triton: a segmented shrink (``x @ A^T``) then a segmented expand
(``y += xa @ B^T``), the SGMV shape of Punica and vLLM's LoRA kernels.

A segment is a run of entries of ``seg_rows``, the rows of ``x`` and ``y`` it covers (one
adapter's rows, wherever they lie in the batch). Both grids are (segment, row block[, column
block]); a program whose row block lies past its segment's end returns at once, so the grid's
rows are ``max_seg_len``'s. The grid and every buffer depend only on the shapes and on
``max_seg_len``, never on the index tensors' values: a CUDA graph captured over fixed-size index
buffers (segments of zero length for the slots a step leaves empty) replays any step's values
that fit them. The shrink keeps its [P, R] result (one row per entry of ``seg_rows``) in fp32
for the expand; R (all of a fused layer's shard ranks, stacked) is padded to one power-of-two
tile of at least 16 (tl.dot's least), which the zero-padded weights make harmless. The rank is
small (<= 3 x 64 here), so the shrink is a thin GEMM bound by reading x and A, the expand by
reading B and writing y.

``expand_lora`` serves a projection whose base GEMM already did the shrink (its weight extended
by every slot's A, ``LoRALinear``): its grid is (row block, column block) over the batch in
order, each row's slot read from ``row_slots``; a program adds one dot per slot its rows use
and writes a new output, the base columns copied where a row has no adapter.
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
    dot_precision,
    dot_upcast,
    mma,
    sm_count,
)

BLOCK_M = 16


@triton.jit
def _shrink_kernel(
    x_ptr, a_ptr, xa_ptr, rows_ptr, starts_ptr, lens_ptr, slots_ptr, K, R,
    s_xm, s_as, s_ar, s_xam, K_PER,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr, SPLIT: tl.constexpr,
):  # fmt: skip
    g = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    length = tl.load(lens_ptr + g)
    if pid_m * BLOCK_M >= length:
        return
    start = tl.load(starts_ptr + g)
    slot = tl.load(slots_ptr + g).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < length
    entries = (start + offs_m).to(tl.int64)  # this block's entries of seg_rows (and xa's rows)
    rows = tl.load(rows_ptr + entries, mask=m_mask, other=0).to(tl.int64)
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < R
    acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
    k_lo = pid_k * K_PER
    for k0 in range(k_lo, tl.minimum(k_lo + K_PER, K), BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        xv = tl.load(x_ptr + rows[:, None] * s_xm + ks[None, :],
                     mask=m_mask[:, None] & k_mask[None, :], other=0.0)  # fmt: skip
        at = tl.load(a_ptr + slot * s_as + offs_r[None, :] * s_ar + ks[:, None],
                     mask=r_mask[None, :] & k_mask[:, None], other=0.0)  # [BLOCK_K, BLOCK_R]  # fmt: skip
        acc += mma(xv, at, UPCAST, PRECISION)
    xa_ptrs = xa_ptr + entries[:, None] * s_xam + offs_r[None, :]
    if SPLIT == 1:
        tl.store(xa_ptrs, acc, mask=m_mask[:, None] & r_mask[None, :])
    else:  # the slices of K add up in xa (zeroed by the launcher)
        tl.atomic_add(xa_ptrs, acc, mask=m_mask[:, None] & r_mask[None, :])


@triton.jit
def _expand_kernel(
    xa_ptr, b_ptr, y_ptr, rows_ptr, starts_ptr, lens_ptr, slots_ptr, N, R,
    s_xam, s_bs, s_bn, s_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
):  # fmt: skip
    g = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_n = tl.program_id(2)
    length = tl.load(lens_ptr + g)
    if pid_m * BLOCK_M >= length:
        return
    start = tl.load(starts_ptr + g)
    slot = tl.load(slots_ptr + g).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < length
    entries = (start + offs_m).to(tl.int64)  # this block's entries of seg_rows (and xa's rows)
    rows = tl.load(rows_ptr + entries, mask=m_mask, other=0).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < R
    xa = tl.load(xa_ptr + entries[:, None] * s_xam + offs_r[None, :],
                 mask=m_mask[:, None] & r_mask[None, :], other=0.0)  # [BLOCK_M, BLOCK_R] fp32  # fmt: skip
    bt = tl.load(b_ptr + slot * s_bs + offs_n[None, :] * s_bn + offs_r[:, None],
                 mask=n_mask[None, :] & r_mask[:, None], other=0.0)  # [BLOCK_R, BLOCK_N]  # fmt: skip
    delta = tl.dot(xa, bt.to(tl.float32), input_precision="ieee")  # [BLOCK_M, BLOCK_N]
    out = y_ptr + rows[:, None] * s_ym + offs_n[None, :]
    mask = m_mask[:, None] & n_mask[None, :]
    y = tl.load(out, mask=mask, other=0.0)
    tl.store(out, (y.to(tl.float32) + delta).to(y_ptr.dtype.element_ty), mask=mask)


def add_lora(
    y: torch.Tensor,  # [T, N], updated in place
    x: torch.Tensor,  # [T, K]
    lora_a: torch.Tensor,  # [S, R, K]
    lora_b: torch.Tensor,  # [S, N, R]
    seg_rows: torch.Tensor,  # [P]
    seg_starts: torch.Tensor,  # [G]
    seg_lens: torch.Tensor,  # [G]
    seg_slots: torch.Tensor,  # [G]
    max_seg_len: int,
) -> torch.Tensor:  # y
    """Triton version of :func:`kernels.lora.ref_add_lora`."""
    check_tensor("y", y, ndim=2, dtypes=FLOAT_DTYPES)
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    check_tensor("lora_a", lora_a, ndim=3, dtypes=FLOAT_DTYPES)
    check_tensor("lora_b", lora_b, ndim=3, dtypes=FLOAT_DTYPES)
    index = {"seg_rows": seg_rows, "seg_starts": seg_starts, "seg_lens": seg_lens,
             "seg_slots": seg_slots}  # fmt: skip
    for name, t in index.items():
        check_tensor(name, t, ndim=1, dtypes=INDEX_DTYPES)
    t_rows, k = x.shape
    s, r, ka = lora_a.shape
    n = y.shape[1]
    if y.shape[0] != t_rows:
        raise ValueError(f"y has {y.shape[0]} rows but x has {t_rows}")
    if ka != k:
        raise ValueError(f"x has {k} features but lora_a {tuple(lora_a.shape)} expects {ka}")
    if tuple(lora_b.shape) != (s, n, r):
        raise ValueError(f"lora_b must be {(s, n, r)} (slots, N, R), got {tuple(lora_b.shape)}")
    if not seg_starts.shape == seg_lens.shape == seg_slots.shape:
        raise ValueError("seg_starts, seg_lens and seg_slots must have one entry per segment")
    if lora_a.dtype != x.dtype:
        raise ValueError(f"lora_a is {lora_a.dtype} but x is {x.dtype}: load adapters in x's dtype")
    if lora_a.stride(2) != 1 or lora_b.stride(2) != 1:
        raise ValueError("lora_a and lora_b must be contiguous in their last dim")
    if max_seg_len > seg_rows.shape[0]:
        raise ValueError(f"max_seg_len {max_seg_len} exceeds seg_rows' {seg_rows.shape[0]} entries")
    check_devices(y=y, x=x, lora_a=lora_a, lora_b=lora_b, **index)
    groups, entries = seg_starts.shape[0], seg_rows.shape[0]
    if groups == 0 or max_seg_len == 0 or n == 0 or r == 0:
        return y
    block_r = max(16, triton.next_power_of_2(r))
    block_k = max(16, min(64, triton.next_power_of_2(k)))
    m_blocks = triton.cdiv(max_seg_len, BLOCK_M)
    # split K so that a few segments of few rows still fill the GPU: with one program per
    # (segment, row block), a decode step's shrink of an 8B qkv (4 adapters) ran on 4 SMs,
    # each reading its adapter's 0.4 MB of A alone (~17 us at one SM's ~25 GB/s, against a
    # 0.3 us floor for the whole GPU)
    split = _split_k(groups * m_blocks, k, block_k, x.device)
    k_per = triton.cdiv(triton.cdiv(k, split), block_k) * block_k
    split = triton.cdiv(k, k_per)
    alloc = torch.zeros if split > 1 else torch.empty
    xa = alloc((entries, r), dtype=torch.float32, device=x.device)  # [P, R]
    _shrink_kernel[(groups, m_blocks, split)](
        x, lora_a, xa, seg_rows, seg_starts, seg_lens, seg_slots, k, r,
        x.stride(0), lora_a.stride(0), lora_a.stride(1), xa.stride(0), k_per,
        BLOCK_M=BLOCK_M, BLOCK_R=block_r, BLOCK_K=block_k,
        UPCAST=dot_upcast(x.dtype), PRECISION=dot_precision(x.dtype), SPLIT=split,
    )  # fmt: skip
    block_n = max(16, min(64, triton.next_power_of_2(n)))
    _expand_kernel[(groups, m_blocks, triton.cdiv(n, block_n))](
        xa, lora_b, y, seg_rows, seg_starts, seg_lens, seg_slots, n, r,
        xa.stride(0), lora_b.stride(0), lora_b.stride(1), y.stride(0),
        BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_R=block_r,
    )  # fmt: skip
    return y


TARGET_PROGRAMS = 256  # about two waves of an H100's 132 SMs


def _split_k(programs: int, k: int, block_k: int, device: torch.device) -> int:
    """Slices of K per (segment, row block): enough programs to fill the GPU, each at least two
    BLOCK_K steps long. One on the CPU (the interpreter gains nothing from it)."""
    if device.type != "cuda" or programs >= TARGET_PROGRAMS:
        return 1
    return max(1, min(triton.cdiv(TARGET_PROGRAMS, programs), triton.cdiv(k, 2 * block_k)))


@triton.jit
def _expand_ext_kernel(
    y_ptr, b_ptr, out_ptr, slots_ptr, T, N, R, S,
    s_ym, s_bs, s_bn, s_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < T
    rows = offs_m.to(tl.int64)
    slots = tl.load(slots_ptr + rows, mask=m_mask, other=-1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < R
    mask = m_mask[:, None] & n_mask[None, :]
    y = tl.load(y_ptr + rows[:, None] * s_ym + offs_n[None, :], mask=mask, other=0.0)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    # one dot per slot this block's rows use, each row's x A^T masked to its own slot's: a
    # decode batch's rows interleave adapters, so a block holds several
    for s in range(0, S):
        hit = slots == s
        if tl.max(hit.to(tl.int32), axis=0) > 0:
            cols = N + s * R + offs_r
            xa = tl.load(y_ptr + rows[:, None] * s_ym + cols[None, :],
                         mask=hit[:, None] & r_mask[None, :], other=0.0)  # [BLOCK_M, BLOCK_R]  # fmt: skip
            bt = tl.load(b_ptr + s * s_bs + offs_n[None, :] * s_bn + offs_r[:, None],
                         mask=n_mask[None, :] & r_mask[:, None], other=0.0)  # [BLOCK_R, BLOCK_N]  # fmt: skip
            acc += mma(xa, bt, UPCAST, PRECISION)
    adapted = (slots >= 0) & (slots < S)
    dtype = out_ptr.dtype.element_ty
    out = tl.where(adapted[:, None], (y.to(tl.float32) + acc).to(dtype), y)  # a copy elsewhere
    tl.store(out_ptr + rows[:, None] * s_om + offs_n[None, :], out, mask=mask)


def expand_lora(
    y_ext: torch.Tensor,  # [T, N + S * R]
    lora_b: torch.Tensor,  # [S, N, R]
    row_slots: torch.Tensor,  # [T]
) -> torch.Tensor:  # [T, N]
    """Triton version of :func:`kernels.lora.ref_expand_lora`: one launch writes every row of
    the output (a base-model or padding row is a copy), so a projection under LoRA is the base
    GEMM and this, two graph nodes."""
    check_tensor("y_ext", y_ext, ndim=2, dtypes=FLOAT_DTYPES)
    check_tensor("lora_b", lora_b, ndim=3, dtypes=FLOAT_DTYPES)
    check_tensor("row_slots", row_slots, ndim=1, dtypes=INDEX_DTYPES)
    t_rows, width = y_ext.shape
    s, n, r = lora_b.shape
    if width != n + s * r:
        raise ValueError(f"y_ext has {width} columns; lora_b {tuple(lora_b.shape)} needs "
                         f"N + S * R = {n + s * r}")  # fmt: skip
    if row_slots.shape[0] != t_rows:
        raise ValueError(f"row_slots has {row_slots.shape[0]} entries but y_ext {t_rows} rows")
    if lora_b.dtype != y_ext.dtype:
        raise ValueError(f"lora_b is {lora_b.dtype} but y_ext is {y_ext.dtype}")
    check_devices(y_ext=y_ext, lora_b=lora_b, row_slots=row_slots)
    out = torch.empty((t_rows, n), dtype=y_ext.dtype, device=y_ext.device)
    if t_rows == 0 or n == 0:
        return out
    block_r = max(16, triton.next_power_of_2(r))
    # rows per block: at decode sizes the whole batch in one or two blocks, so each slot's B
    # is read once per column block; fewer where the stacked rank makes the tiles large
    block_m = max(16, min(64 if block_r <= 64 else 32, triton.next_power_of_2(t_rows)))
    m_blocks = triton.cdiv(t_rows, block_m)
    block_n = 64 if m_blocks * triton.cdiv(n, 64) >= sm_count(y_ext.device) else 32
    _expand_ext_kernel[(m_blocks, triton.cdiv(n, block_n))](
        y_ext, lora_b, out, row_slots, t_rows, n, r, s,
        y_ext.stride(0), lora_b.stride(0), lora_b.stride(1), out.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_R=block_r,
        UPCAST=dot_upcast(y_ext.dtype), PRECISION=dot_precision(y_ext.dtype),
    )  # fmt: skip
    return out
