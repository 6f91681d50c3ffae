"""Paged decode attention in Triton, with split-K (flash-decoding) for long contexts.

One program handles one (sequence, KV head, split): the ``Hq // Hkv`` query heads that share the
KV head are packed into the rows of one tile, so every K/V byte is read once per sequence (a group
too wide for one tile, DeepSeek's 128 heads over its one 576-dim latent head, is split over
programs of ``MAX_TILE_ELEMS / BLOCK_D`` heads, each reading the keys again). Keys
are walked ``BLOCK_N`` at a time (several KV blocks per step), each row fetched through the block
table. With ``num_splits > 1`` each split covers an equal share of its own sequence's context and
writes a partial (max, sum, unnormalized acc); a second kernel merges the partials.

Attention sinks (gpt-oss): a head's sink is one more logit whose value is zero, so it adds to the
softmax's sum and max only. Split 0 starts its running max at the sink and its sum at 1 (the
sink's own term) instead of -inf and 0; the other splits start empty, so the merge counts the
sink exactly once. ``HAS_SINKS`` is constexpr: without sinks the kernel compiles as before.

Napkin math (H100, 32 q / 8 kv heads, D=128, bf16): a sequence reads 4 KiB of K/V per token and
does ~16 FLOP per byte after padding the group to 16 rows, far below the ~260 FLOP/byte ridge, so
the kernel is bound by memory and the target is the device copy bandwidth.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels.attention import check_sinks, check_softcap, check_window
from kernels.triton_common import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_devices,
    check_heads,
    check_kv_cache,
    check_out,
    check_q_for_cache,
    check_tensor,
    dot_precision,
    dot_upcast,
    max_shared_memory,
    mma,
    next_pow2,
    pdl,
    pdl_enter,
    sm_count,
    soft_cap_log2,
)

MAX_SPLITS = 64
# the widest query tile (rows x BLOCK_D): a group wider is split over programs (each reads the
# group's keys again); every model's group fits but DeepSeek's 128 heads over one latent head
MAX_TILE_ELEMS = 16384
NO_WINDOW = 2**31 - 1  # the kernel's window when there is none: longer than any context
MIN_KEYS_PER_SPLIT = 64  # one tile of keys: batch-1 8B decode at context 1024, 2048-token table,
# 0.07 ms a step faster than with 256 (H100; 128: 0.04, 32: no gain)
LOG2E = 1.4426950408889634
# registers a thread for the FP8 cache's kernel: uncapped it takes 197 (the e4m3 tiles converted
# to fp16 in registers), so two programs fit on a multiprocessor and it issues too few
# instructions to keep the loads coming (ncu, H200: 12.5% occupancy, 46% of DRAM bandwidth);
# capped at 128, 0.224 -> 0.190 ms at 224 sequences x 1100 keys (H200; 168: 0.188, but no gain
# at 64 x 4096: 0.232 -> 0.230 against 0.191 with 128). A 16-bit cache's kernel takes 93.
FP8_MAX_REGISTERS = 128
# Every FP8 call is capped, also the programs of one key tile that gain nothing from it (batch 1
# x 1024 keys in 8 splits: 6.6 against 6.3 us; x 8192 in 64: 13.6 against 12.8; x 32768 in 64
# splits of 4 tiles: 33.3 against 36.4 us, `python -m kernels.bench.tune cap graph`, H200): a cap
# chosen by the context would compile another kernel variant, and a captured decode graph and an
# eager step of the same batch see different contexts (the graph's table is max_model_len wide),
# so one would be built while serving a request. Not on ROCm (Triton's HIP options have no
# maxnreg).


@triton.jit
def online_softmax(s, m_i, l_i):
    """One key tile's online-softmax step on scores ``s`` in log2 units (masked ones -inf):
    (the new row max, the factor rescaling what was summed so far, the tile's probabilities,
    the new row sums). A row that has seen only masked keys (an empty split) keeps max -inf
    and sum 0: its exponents are taken against 0, not -inf - -inf."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.math.exp2(m_i - m_safe)
    p = tl.math.exp2(s - m_safe[:, None])
    return m_new, alpha, p, l_i * alpha + tl.sum(p, 1)


@triton.jit
def _mma_acc(a, b, acc, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """``acc + mma(a, b)`` as one ``tl.dot`` accumulating into ``acc`` (fp32): the MMA adds into
    its own accumulator registers, no second [M, N] tile for the product."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc, input_precision=PRECISION)


# per-step values and index arrays: not specialized, so no step compiles a new kernel
@triton.jit(do_not_specialize=["bt_ptr", "lens_ptr", "num_splits", "s_btb", "window"])
def _decode_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, lens_ptr, out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr,
    sink_ptr, scale_log2e, num_splits, window,
    s_qb, s_qh, s_kn, s_kb, s_kh, s_vn, s_vb, s_vh, s_btb, s_ob, s_oh,
    NUM_Q_HEADS: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, DOT_UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
    USE_PDL: tl.constexpr, F16_READ: tl.constexpr, HALF_D: tl.constexpr, SOFTCAP: tl.constexpr,
    HAS_SINKS: tl.constexpr, HEAD_BLOCKS: tl.constexpr,
):  # fmt: skip
    pdl_enter(USE_PDL)
    b = tl.program_id(0)
    kvh = tl.program_id(1) // HEAD_BLOCKS  # a group wider than one tile: HEAD_BLOCKS programs
    first = (tl.program_id(1) % HEAD_BLOCKS) * BLOCK_G  # this program's first head of the group
    split = tl.program_id(2)
    ctx = tl.load(lens_ptr + b).to(tl.int32)
    # a sliding window: the query (at ctx - 1) sees the last `window` keys; without one the
    # launcher passes a window longer than any context, so lo is 0. The splits share [lo, ctx)
    lo = tl.maximum(ctx - window, 0)
    per_split = tl.cdiv(tl.cdiv(ctx - lo, num_splits), BLOCK_N) * BLOCK_N
    start = lo + split * per_split
    end = tl.minimum(start + per_split, ctx)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    heads = kvh * GROUP + first + offs_g
    g_mask = first + offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    if HALF_D:  # the head dim in two halves, columns offs_h and HALF + offs_h (half_d)
        HALF: tl.constexpr = BLOCK_D // 2
        offs_h = tl.arange(0, HALF)
        lo_mask = offs_h < HEAD_DIM
        hi_mask = offs_h + HALF < HEAD_DIM  # never empty: HEAD_DIM > BLOCK_D / 2
        q_row = q_ptr + b.to(tl.int64) * s_qb + heads[:, None] * s_qh + offs_h[None, :]
        q_lo = tl.load(q_row, mask=g_mask[:, None] & lo_mask[None, :], other=0.0)
        q_hi = tl.load(q_row + HALF, mask=g_mask[:, None] & hi_mask[None, :], other=0.0)
        if F16_READ:  # as below
            q_lo = (q_lo.to(tl.float32) * scale_log2e).to(tl.float16)
            q_hi = (q_hi.to(tl.float32) * scale_log2e).to(tl.float16)
    else:
        q = tl.load(
            q_ptr + b.to(tl.int64) * s_qb + heads[:, None] * s_qh + offs_d[None, :],
            mask=g_mask[:, None] & d_mask[None, :],
            other=0.0,
        )  # [BLOCK_G, BLOCK_D]
        if F16_READ:  # an FP8 cache read as fp16 (one hardware conversion; bf16 takes more): q
            # carries the softmax scale, so it stays far inside fp16's range
            q = (q.to(tl.float32) * scale_log2e).to(tl.float16)
    table = bt_ptr + b.to(tl.int64) * s_btb
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    if HAS_SINKS:  # gpt-oss: each head's sink logit (value 0) as if already seen, in split 0
        # only (the merge must count it once): max = the sink in log2 units (never soft-capped),
        # sum = its term e^0 = 1. Padding rows (past the group) load 0: they are never stored
        sink = tl.load(sink_ptr + heads, mask=g_mask, other=0.0).to(tl.float32)
        m_i = tl.where(split == 0, sink * 1.4426950408889634, m_i)  # [BLOCK_G]
        l_i = tl.where(split == 0, 1.0, l_i)
    if HALF_D:
        acc_lo = tl.zeros([BLOCK_G, HALF], tl.float32)
        acc_hi = tl.zeros([BLOCK_G, HALF], tl.float32)
    else:
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + offs_n
        n_mask = pos < end
        blk = tl.load(table + pos // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        off = pos % BLOCK_SIZE
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k_rows = k_ptr + blk * s_kn + off * s_kb + kvh * s_kh
        if HALF_D:  # each half of K converted and multiplied as soon as it is loaded: one
            # [BLOCK_N, HALF] tile in registers at a time, not [BLOCK_N, BLOCK_D]
            lo_kv = n_mask[:, None] & lo_mask[None, :]
            hi_kv = n_mask[:, None] & hi_mask[None, :]
            k_half = k_rows[:, None] + offs_h[None, :]
            k_lo = tl.load(k_half, mask=lo_kv, other=0.0).to(q_lo.dtype)
            s = mma(q_lo, tl.trans(k_lo), DOT_UPCAST, DOT_PRECISION)
            k_hi = tl.load(k_half + HALF, mask=hi_kv, other=0.0).to(q_lo.dtype)
            s = _mma_acc(q_hi, tl.trans(k_hi), s, DOT_UPCAST, DOT_PRECISION)
        else:
            # an FP8 cache is read in q's dtype (exact: every e4m3 value is a bf16/fp16 value)
            k = tl.load(k_rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0).to(q.dtype)
            s = mma(q, tl.trans(k), DOT_UPCAST, DOT_PRECISION)
        if not F16_READ:
            s = s * scale_log2e
        if SOFTCAP > 0:  # Gemma 2: before the mask, as transformers caps them
            s = soft_cap_log2(s, SOFTCAP)
        s = tl.where(n_mask[None, :], s, float("-inf"))  # [BLOCK_G, BLOCK_N]
        m_new, alpha, p, l_i = online_softmax(s, m_i, l_i)
        v_rows = v_ptr + blk * s_vn + off * s_vb + kvh * s_vh
        if HALF_D:  # likewise V: p converted once, each half accumulated into its own acc
            p = p.to(q_lo.dtype)
            v_half = v_rows[:, None] + offs_h[None, :]
            v_lo = tl.load(v_half, mask=lo_kv, other=0.0).to(q_lo.dtype)
            acc_lo = _mma_acc(p, v_lo, acc_lo * alpha[:, None], DOT_UPCAST, DOT_PRECISION)
            v_hi = tl.load(v_half + HALF, mask=hi_kv, other=0.0).to(q_lo.dtype)
            acc_hi = _mma_acc(p, v_hi, acc_hi * alpha[:, None], DOT_UPCAST, DOT_PRECISION)
        else:
            v = tl.load(v_rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0).to(q.dtype)
            acc = acc * alpha[:, None] + mma(p.to(v.dtype), v, DOT_UPCAST, DOT_PRECISION)
        m_i = m_new

    if not SPLIT:
        if HALF_D:
            o_half = out_ptr + b.to(tl.int64) * s_ob + heads[:, None] * s_oh + offs_h[None, :]
            out_lo = (acc_lo / l_i[:, None]).to(out_ptr.dtype.element_ty)
            tl.store(o_half, out_lo, mask=g_mask[:, None] & lo_mask[None, :])
            out_hi = (acc_hi / l_i[:, None]).to(out_ptr.dtype.element_ty)
            tl.store(o_half + HALF, out_hi, mask=g_mask[:, None] & hi_mask[None, :])
        else:
            out = acc / l_i[:, None]
            o_ptrs = out_ptr + b.to(tl.int64) * s_ob + heads[:, None] * s_oh + offs_d[None, :]
            tl.store(
                o_ptrs, out.to(out_ptr.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :]
            )
    else:
        row = (b.to(tl.int64) * NUM_Q_HEADS + heads) * num_splits + split  # [BLOCK_G]
        tl.store(part_m_ptr + row, m_i, mask=g_mask)
        tl.store(part_l_ptr + row, l_i, mask=g_mask)
        if HALF_D:
            a_half = part_acc_ptr + row[:, None] * HEAD_DIM + offs_h[None, :]
            tl.store(a_half, acc_lo, mask=g_mask[:, None] & lo_mask[None, :])
            tl.store(a_half + HALF, acc_hi, mask=g_mask[:, None] & hi_mask[None, :])
        else:
            a_ptrs = part_acc_ptr + row[:, None] * HEAD_DIM + offs_d[None, :]
            tl.store(a_ptrs, acc, mask=g_mask[:, None] & d_mask[None, :])


@triton.jit(do_not_specialize=["num_splits"])
def _merge_splits_kernel(
    part_m_ptr, part_l_ptr, part_acc_ptr, out_ptr, s_ob, s_oh, num_splits,
    NUM_Q_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    pdl_enter(USE_PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)  # this program's columns
    s_mask = offs_s < num_splits
    d_mask = offs_d < HEAD_DIM
    row = (b.to(tl.int64) * NUM_Q_HEADS + h) * num_splits + offs_s
    m = tl.load(part_m_ptr + row, mask=s_mask, other=float("-inf"))
    l_s = tl.load(part_l_ptr + row, mask=s_mask, other=0.0)
    m_max = tl.max(m, 0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.math.exp2(m - m_max)  # empty splits carry m = -inf: weight 0
    acc = tl.load(
        part_acc_ptr + row[:, None] * HEAD_DIM + offs_d[None, :],
        mask=s_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    out = tl.sum(acc * w[:, None], 0) / tl.sum(l_s * w, 0)
    o_ptrs = out_ptr + b.to(tl.int64) * s_ob + h * s_oh + offs_d
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=d_mask)


def merge_chunk(block_d: int) -> int:
    """Columns of the head dim a merge program takes (``_merge_splits_kernel``'s ``BLOCK_D``,
    its grid's third axis ``block_d / chunk``): at most 128, so its [MAX_SPLITS, chunk] float32
    tile of partial sums stays in registers (DeepSeek's 1024-wide latent padding held 64 x 1024
    floats a program: 16 us a layer at batch 64 on an H200). The grid covers the head dim's
    columns only (``cdiv(d, chunk)``), not its padding."""
    return min(block_d, 128)


def default_block_n(block_d: int, elem: int, num_stages: int, device: torch.device) -> int:
    """Keys per step for a cache of ``elem``-byte elements: 64 (best on an H100 at D=128 bf16),
    128 for an FP8 cache (the same bytes per tile; on an H100 at batch 64 x 4096 keys 0.288
    against 0.396 ms with 64, at batch 256 x 512 0.133 against 0.159: ``python -m
    kernels.bench.tune decode fp8 graph b64``), fewer if K/V stages overflow ~85% of shared
    memory (fp32 or D=256 on GPUs with ~100 KB per block)."""
    budget = 0.85 * max_shared_memory(device)
    block_n = 128 if elem == 1 else 64
    while block_n > 16 and num_stages * 2 * block_n * block_d * elem > budget:
        block_n //= 2
    return block_n


def choose_num_splits(
    batch: int, kv_heads: int, max_context: int, device: torch.device, elem: int = 2
) -> int:
    """Split only when (sequence, KV head) programs number under 2 per SM; then aim for ~4 per SM
    with at least one key tile per split: ``MIN_KEYS_PER_SPLIT``, twice that for a cache of
    ``elem`` = 1 byte (FP8, whose tiles are 128 keys: a split is rounded up to whole tiles, so
    smaller ones would leave programs empty). On H100/H200, B=1 ctx 32k: 64 splits beat 32 by
    ~3%."""
    programs = batch * kv_heads
    sms = sm_count(device)
    if programs >= 2 * sms:
        return 1
    min_keys = MIN_KEYS_PER_SPLIT * (2 if elem == 1 else 1)
    by_work = max(1, max_context // min_keys)
    return max(1, min(math.ceil(4 * sms / programs), by_work, MAX_SPLITS))


def paged_decode_attention(
    q: torch.Tensor,  # [B, Hq, D]
    k_cache: torch.Tensor,  # [N, bs, Hkv, D]
    v_cache: torch.Tensor,  # [N, bs, Hkv, D]
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    context_lens: torch.Tensor,  # [B] int32, >= 1
    scale: float,
    *,
    num_splits: int | None = None,
    block_n: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
    f16_read: bool | None = None,
    max_registers: int | None = None,
    half_d: bool | None = None,
    window: int = 0,
    out: torch.Tensor | None = None,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,  # [Hq], contiguous: a learned logit per head (gpt-oss)
) -> torch.Tensor:  # [B, Hq, D]
    """Triton version of :func:`kernels.attention.ref_paged_decode_attention`.

    ``num_splits`` defaults to a choice from the batch size and the block table's width (the
    context bound known without a device sync); the keyword-only knobs exist for tests and tuning.
    ``f16_read`` (default: on for an FP8 cache and bf16 queries) converts the e4m3 keys and
    values to fp16, not to q's bf16, with the softmax scale folded into q: on an H200 0.224
    against 0.243 ms at 224 sequences x 1100 keys, 0.231 against 0.282 ms at 64 x 4096
    (``python -m kernels.bench.tune decode fp8 graph b64 w1``). ``max_registers`` caps the
    registers a thread (default: :data:`FP8_MAX_REGISTERS` for an FP8 cache on an NVIDIA GPU,
    else none; 0: none): with the cap (and the halves below) an FP8 cache is read at ~65-72% of the copy bandwidth on
    an H200, ~53-55% without, where a bf16 one reaches ~95%.

    ``half_d`` (default: on wherever the padded head dim ``BLOCK_D`` is 32 or more, so that
    each half is a dot of 16 columns or more) works on the head dimension in two halves: q, the
    K and V tiles and the accumulator as two ``[.., BLOCK_D // 2]`` halves, each K/V half
    converted and multiplied as soon as it is loaded, so fewer registers hold converted tiles
    at once. The same MMAs in the same order: the output is bit for bit the whole-width
    kernel's. On an H200 (``python -m kernels.bench.tune decode fp8 graph b64 w1 maxreg quick
    halfd``, and each case timed both ways): over an FP8 cache, capped at 128 registers,
    ptxas's spill stores 18 -> 2 bytes and 0.187 -> 0.172 ms at 64 sequences x 4096 keys (68 ->
    74% of the copy bandwidth) and at 224 x 1100, 1.03-1.11x at batch 1 to 8; over a bf16 cache
    1.01-1.02x at batch 64 to 256, 1.15x at 8 x 4096, 1.01-1.12x at batch 1.

    ``window`` (0: none) is a sliding window: each query sees only the last ``window`` keys of
    its context, itself included (transformers' ``sliding_window``); the splits share that
    range, and the kernel is the same for every window (a runtime argument). ``softcap`` > 0
    caps each score (Gemma 2's ``attn_logit_softcapping``; a compiled variant per value).
    ``sinks`` (gpt-oss's attention sinks, the reference's; None: none, the kernel compiled
    without them) seed split 0's running max and sum (module docstring).
    """
    check_tensor("q", q, ndim=3, dtypes=FLOAT_DTYPES)
    _, bs, hkv, d = check_kv_cache(k_cache, v_cache)
    check_tensor("block_tables", block_tables, ndim=2, dtypes=INDEX_DTYPES)
    check_tensor("context_lens", context_lens, ndim=1, dtypes=INDEX_DTYPES, inner_contiguous=False)
    batch, hq, qd = q.shape
    group = check_heads(hq, hkv, qd, d)
    check_q_for_cache(q, k_cache)
    if block_tables.shape[0] != batch:
        raise ValueError(f"block_tables has {block_tables.shape[0]} rows for {batch} sequences")
    if context_lens.shape[0] != batch:
        raise ValueError(f"context_lens has {context_lens.shape[0]} entries for {batch} sequences")
    device = check_devices(
        q=q, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables, context_lens=context_lens
    )
    out = check_out(out, (batch, hq, d), q.dtype, device)
    check_sinks(sinks, hq, device)
    if sinks is not None:  # the kernel reads sinks[h] at sink_ptr + h
        check_tensor("sinks", sinks, ndim=1)
    if batch == 0:
        return out
    fp8 = k_cache.element_size() == 1
    if f16_read is None:
        f16_read = fp8 and q.dtype == torch.bfloat16
    if f16_read and not fp8:
        raise ValueError("f16_read reads an FP8 cache; this one is " + str(k_cache.dtype))
    check_window(window)
    check_softcap(softcap)
    if num_splits is None:
        width = block_tables.shape[1] * bs  # the context bound known without a device sync
        num_splits = choose_num_splits(
            batch, hkv, min(width, window) if window else width, device, k_cache.element_size()
        )
    if not (1 <= num_splits <= 1024):
        raise ValueError(f"num_splits must be in [1, 1024], got {num_splits}")
    block_d = max(16, next_pow2(d))
    if block_n is None:
        block_n = default_block_n(block_d, k_cache.element_size(), num_stages, device)
    if block_n < 16 or block_n != next_pow2(block_n):
        raise ValueError(f"block_n must be a power of two >= 16, got {block_n}")
    if half_d is None:
        half_d = block_d >= 32
    if half_d and block_d < 32:  # each half a dot of 16 columns or more (tl.dot's least)
        raise ValueError(f"half_d needs a head_dim over 16 (BLOCK_D >= 32), got head_dim {d}")
    if max_registers is None:
        capped = fp8 and device.type == "cuda" and torch.version.hip is None
        max_registers = FP8_MAX_REGISTERS if capped else 0
    if max_registers < 0:
        raise ValueError(f"max_registers must be 0 (no cap) or more, got {max_registers}")
    # one workspace for the split partials: [rows, D] acc, then [rows] max and [rows] sum, each
    # part starting 16-byte aligned (Triton specializes pointers on it: a part at an odd offset
    # would build another variant of both kernels, on a request, for batches of odd rows)
    rows = batch * hq * num_splits if num_splits > 1 else 1
    pad = -(-rows // 4) * 4
    work = torch.empty(pad * (d + 2), dtype=torch.float32, device=device)
    part_acc, part_m, part_l = (
        work[: rows * d],
        work[pad * d : pad * d + rows],
        work[pad * (d + 1) : pad * (d + 1) + rows],
    )
    # a group's heads in tiles of at most MAX_TILE_ELEMS / BLOCK_D rows (DeepSeek's latent:
    # 128 heads of 576 dims, 16 a program; a 128-row tile needs 384 KiB of shared memory)
    block_g = min(max(16, next_pow2(group)), max(16, MAX_TILE_ELEMS // block_d))
    head_blocks = -(-group // block_g)
    _decode_kernel[(batch, hkv * head_blocks, num_splits)](
        q, k_cache, v_cache, block_tables, context_lens, out, part_m, part_l, part_acc,
        q if sinks is None else sinks,  # q: a stand-in pointer the kernel never reads
        float(scale) * LOG2E, num_splits, window or NO_WINDOW,
        q.stride(0), q.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3],
        block_tables.stride(0), out.stride(0), out.stride(1),
        NUM_Q_HEADS=hq, GROUP=group, BLOCK_G=block_g, HEAD_BLOCKS=head_blocks,
        HEAD_DIM=d, BLOCK_D=block_d, BLOCK_SIZE=bs, BLOCK_N=block_n,
        SPLIT=num_splits > 1, DOT_UPCAST=dot_upcast(q.dtype) and not f16_read,
        DOT_PRECISION=dot_precision(q.dtype), num_warps=num_warps, num_stages=num_stages,
        F16_READ=f16_read, HALF_D=half_d, SOFTCAP=float(softcap), HAS_SINKS=sinks is not None,
        **pdl(device, batch),
        **({"maxnreg": max_registers} if max_registers else {}),
    )  # fmt: skip
    if num_splits > 1:
        chunk = merge_chunk(block_d)
        _merge_splits_kernel[(batch, hq, triton.cdiv(d, chunk))](
            part_m, part_l, part_acc, out, out.stride(0), out.stride(1), num_splits,
            NUM_Q_HEADS=hq, HEAD_DIM=d, BLOCK_D=chunk,
            BLOCK_S=max(MAX_SPLITS, next_pow2(num_splits)),  # one variant for every default split
            num_warps=4, **pdl(device, batch),
        )  # fmt: skip
    return out
