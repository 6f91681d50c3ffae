"""Variable-length causal prefill attention over a paged KV cache, in Triton (sliding window too).

Flash-attention style: one program owns a tile of ``BLOCK_M`` query rows of one sequence, walks
the keys ``BLOCK_N`` at a time through the block table and keeps an online softmax (base 2, the
scale folded into one multiply per score). Keys before the tile's first query position are
visible to every row and need no causal mask; only the diagonal stretch is masked, and keys past
the tile's last query are never read.

GQA packing: a tile's rows are (token, head) pairs, the ``HEADS`` query heads of one KV head
side by side for ``TOKENS = BLOCK_M // HEADS`` tokens. Every K/V tile read from the cache feeds
``BLOCK_M`` rows even when a chunk has fewer tokens than that (a 1-token row reads its context
once per KV head, not once per query head), and a tile spans ``HEADS`` times fewer positions,
so with ``BLOCK_N`` near ``TOKENS`` less of the causal diagonal is computed and thrown away.
``HEADS = 1`` is one query head per program.

The grid is sized without a device sync: sequence ``b`` owns the tiles starting at
``query_start_loc[b] // TOKENS + b`` (these ranges never overlap), so ``T // TOKENS + B`` tiles
cover every sequence; each program finds its sequence by a binary search over those tile starts.
Nothing about the batch is a compile-time constant (a new batch size must not compile a new
kernel in the middle of serving). The grid is one-dimensional with the head sets varying
fastest (unpacked, the heads that read the same K/V run side by side and share it through L2),
and the tiles run last to first, so the longest causal tiles start first and the short ones fill
the tail.

Sliding window (``window`` > 0, transformers' definition: the query at position ``p`` sees keys
``p - window < j <= p``): each tile starts its key loops at the lowest key any of its rows sees,
its first row's ``p - window + 1`` rounded down to a multiple of ``BLOCK_N`` (tiles stay on
block boundaries), so the keys below are never read. The key tiles that cut into some row's
window (up to the last row's ``p - window``) are masked in a loop of their own, the diagonal
ones too; between them every row sees every key, unmasked as without a window. A row may see
no key of a whole tile (the online softmax guards it). ``HAS_WINDOW`` is constexpr, the size a
runtime argument: without a window the kernel compiles as before (the same PTX, one unused
argument more), and every window size shares one variant. A window that never binds (as wide
as every context) still costs ~7% on 8 x 1024 prompts, ~2% on long ones (H200, 2026-11-29):
pass 0 when no context can outgrow it.

Attention sinks (gpt-oss, ``HAS_SINKS`` constexpr): each row's online softmax starts as if it
had already seen its head's sink logit (value vector zero): running max the sink in log2 units,
running sum 1, instead of -inf and 0. A packed tile's rows belong to ``HEADS`` heads, so each row
loads its own head's sink. No row's max is then ever -inf, and a row that sees no key (a padding
row past its window) ends with sum >= 1 and output 0.

Image spans (Gemma 3, ``HAS_SPANS`` constexpr; ``span_last``): an image's tokens attend to each
other both ways, so each row loads the last key it sees (its image's last token, or itself) and
the diagonal loops run to the tile's furthest such key; the causal compare takes that bound,
the window keeps its own (``p - window``). Spans never cross a chunk (the scheduler's rule).

The chunk's own keys are read through the block table like the prefix, unless the caller hands
them over contiguously (``k_new``/``v_new``: the rotated keys, which the fused rotary kernel also
writes out, and the qkv activation's values). With ``no_prefix`` (whole prompts, no cached
prefix) the paged loops are not compiled in at all and the tiles load through TMA tensor
descriptors on Hopper: 91% of SDPA's rate on 8 x 1024 prompts against ~74% through the block
table, whose compiled-in loops alone cost most of that (register pressure). An FP8 cache's
rounding must be what attention sees, so it always reads the cache.

Tiles by the step's shape (:func:`step_tiles`): the launcher takes the first of ``LARGE_TILES``
(256 rows: 64 tokens of a 4-head group) whose whole tiles, ``ceil(T / TOKENS)`` per head set,
give at least ~2 programs per SM, else the first of ``TILE_CHOICES`` (64 rows) that fits shared
memory. Large tiles read each K/V tile for 4x the rows; on a short chunk they leave SMs idle
(a 512-token chunk fills 64 programs of 256 rows on 132 SMs). Only host-side shapes decide (no
device sync), and only between these few fixed configurations: nothing about the batch becomes
a compile-time constant. ``tiles=`` overrides the choice.

Kernel variants (:class:`Tiles`' knobs, constexpr; all off by default, the sweep times them):
``narrow`` keeps int64 math to each key's block base and hoists the int32 in-block offsets out
of the loop; ``block_reads`` reads one block-table entry per KV block instead of one per key;
``k_transposed`` loads K as a [D, BLOCK_N] tile. The first two apply when BLOCK_SIZE divides
BLOCK_N (a tile then starts on a block boundary), else the per-key path runs. (Warp
specialization of the unmasked loop, ``tl.range(..., warp_specialize=True)``, was tried on an
H100 with Triton 3.6: no faster at 8 and 16 warps, and it does not compile at 4.)

Napkin math: 4 * D FLOP per visible (query, key) pair per head. A K/V tile of ``BLOCK_N`` keys
(2 * BLOCK_N * D elements from L2) feeds 4 * BLOCK_M * BLOCK_N * D FLOP, so bf16 reads one L2
byte per BLOCK_M FLOP: at 64 rows an H100's tensor cores (~990 TFLOP/s dense bf16) would want
~15 TB/s of L2 reads, at 128 rows ~7.7, at 256 ~3.9, hence the large tiles.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels.attention import (
    check_sinks,
    check_softcap,
    check_span_last,
    check_window,
)
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
    seq_of_tile,
    sm_count,
    soft_cap_log2,
)

LOG2E = 1.4426950408889634


@triton.jit
def _row_blocks(table, n0, ctx, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                MASKED: tl.constexpr, BLOCK_READS: tl.constexpr):  # fmt: skip
    """The cache block of each of the tile's ``BLOCK_N`` keys (int64, 0 past ``ctx``)."""
    pos = n0 + tl.arange(0, BLOCK_N)
    if BLOCK_READS:  # one table entry per KV block, repeated for its BLOCK_SIZE keys
        entry = n0 // BLOCK_SIZE + tl.arange(0, BLOCK_N // BLOCK_SIZE)
        if MASKED:
            blk = tl.load(table + entry, mask=entry * BLOCK_SIZE < ctx, other=0).to(tl.int64)
        else:
            blk = tl.load(table + entry).to(tl.int64)
        return tl.reshape(
            tl.broadcast_to(blk[:, None], (BLOCK_N // BLOCK_SIZE, BLOCK_SIZE)), (BLOCK_N,)
        )
    else:
        if MASKED:
            return tl.load(table + pos // BLOCK_SIZE, mask=pos < ctx, other=0).to(tl.int64)
        else:  # every key of the tile is in range
            return tl.load(table + pos // BLOCK_SIZE).to(tl.int64)


@triton.jit
def _kv_tile(base, blk, n0, ctx, s_n, s_b, inner, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr,
             BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, LOAD_MASK: tl.constexpr,
             NARROW: tl.constexpr, TRANSPOSED: tl.constexpr):  # fmt: skip
    """One KV head's ``BLOCK_N`` keys (or values) from the cache: [BLOCK_N, BLOCK_D], or
    [BLOCK_D, BLOCK_N] when ``TRANSPOSED``. ``NARROW``: only the block base is int64 math per
    iteration; ``inner`` holds the loop-invariant int32 in-block offsets (in the tile's layout)."""
    pos = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    if NARROW:
        rows = base + blk * s_n
    else:
        rows = base + blk * s_n + (pos % BLOCK_SIZE) * s_b
    if TRANSPOSED:
        if NARROW:
            ptrs = rows[None, :] + inner
        else:
            ptrs = rows[None, :] + offs_d[:, None]
        mask = (offs_d < HEAD_DIM)[:, None] & (pos < ctx)[None, :]
    else:
        if NARROW:
            ptrs = rows[:, None] + inner
        else:
            ptrs = rows[:, None] + offs_d[None, :]
        mask = (pos < ctx)[:, None] & (offs_d < HEAD_DIM)[None, :]
    if LOAD_MASK:
        return tl.load(ptrs, mask=mask, other=0.0)
    else:
        return tl.load(ptrs)


@triton.jit
def _softmax_update(s, m_i, l_i, scale_log2e, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr):
    """One tile's online-softmax step on raw scores ``s``: (new row max, the factor that
    rescales what was summed so far, the tile's probabilities, the new row sums). ``SOFTCAP``
    > 0: the scaled scores soft-capped first (masked ones stay -inf)."""
    if SOFTCAP > 0:
        s = soft_cap_log2(s * scale_log2e, SOFTCAP)
        scale_log2e = 1.0
    # the scale is positive, so the row max scales with it; the exponent is then one FMA per
    # score. Without a window never -inf: every row sees the first key the tile walks (see the
    # loops' bounds), so no guard against -inf - -inf is needed
    m_new = tl.maximum(m_i, tl.max(s, 1) * scale_log2e)
    m_exp = m_new
    if WINDOW:  # a row may have seen no key yet (its window starts in a later tile): exponents
        # against 0 there, so alpha and p are 0 (its sums stay 0), not exp2(NaN)
        m_exp = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.math.exp2(m_i - m_exp)
    p = tl.math.exp2(s * scale_log2e - m_exp[:, None])
    return m_new, alpha, p, l_i * alpha + tl.sum(p, 1)


@triton.jit
def _attend_contig(
    q, m_i, l_i, acc, kn_base, vn_base, j0, tok, q_len, s_knt, s_vnt, scale_log2e,
    kd, vd, tma_row, tma_col, after,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
    LOAD_MASK: tl.constexpr, K_TRANSPOSED: tl.constexpr, DOT_UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr, TMA: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
):  # fmt: skip
    """One tile of the chunk's own keys, read from the contiguous new K/V (``k_new``): rows
    ``j0 .. j0 + BLOCK_N`` of the sequence's chunk, no block table. ``WINDOW``: row r sees only
    the chunk's keys past ``after[r]`` (``tok - window``; the causal mask, if any, too)."""
    if TMA:  # tensor descriptors: rows past the tensor read as zeros, the scores mask the rest
        j = j0 + tl.arange(0, BLOCK_N)
        k = kd.load([tma_row + j0, tma_col])
        v = vd.load([tma_row + j0, tma_col])
        s = mma(q, tl.trans(k), DOT_UPCAST, DOT_PRECISION)
        if MASKED:
            visible = (j[None, :] <= tok[:, None]) & (j < q_len)[None, :]
            if WINDOW:
                visible = visible & (j[None, :] > after[:, None])
            s = tl.where(visible, s, float("-inf"))
            # rows past the sequence are the next one's values: zero them, so an inf there
            # cannot become 0 * inf = NaN in this one's output
            v = tl.where((j < q_len)[:, None], v, 0.0)
        elif WINDOW:
            s = tl.where(j[None, :] > after[:, None], s, float("-inf"))
        m_new, alpha, p, l_i = _softmax_update(s, m_i, l_i, scale_log2e, WINDOW, SOFTCAP)
        acc = acc * alpha[:, None] + mma(p.to(v.dtype), v, DOT_UPCAST, DOT_PRECISION)
        return m_new, l_i, acc
    j = j0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    rows = j.to(tl.int64)
    in_range = j < q_len
    if K_TRANSPOSED:
        k_ptrs = kn_base + rows[None, :] * s_knt + offs_d[:, None]
        k_mask = (offs_d < HEAD_DIM)[:, None] & in_range[None, :]
    else:
        k_ptrs = kn_base + rows[:, None] * s_knt + offs_d[None, :]
        k_mask = in_range[:, None] & (offs_d < HEAD_DIM)[None, :]
    v_ptrs = vn_base + rows[:, None] * s_vnt + offs_d[None, :]
    v_mask = in_range[:, None] & (offs_d < HEAD_DIM)[None, :]
    if LOAD_MASK:
        k = tl.load(k_ptrs, mask=k_mask, other=0.0)
    else:
        k = tl.load(k_ptrs)
    if K_TRANSPOSED:
        s = mma(q, k, DOT_UPCAST, DOT_PRECISION)
    else:
        s = mma(q, tl.trans(k), DOT_UPCAST, DOT_PRECISION)
    if MASKED:
        visible = (j[None, :] <= tok[:, None]) & in_range[None, :]
        if WINDOW:
            visible = visible & (j[None, :] > after[:, None])
        s = tl.where(visible, s, float("-inf"))
    elif WINDOW:
        s = tl.where(j[None, :] > after[:, None], s, float("-inf"))
    m_new, alpha, p, l_i = _softmax_update(s, m_i, l_i, scale_log2e, WINDOW, SOFTCAP)
    if LOAD_MASK:
        v = tl.load(v_ptrs, mask=v_mask, other=0.0)
    else:
        v = tl.load(v_ptrs)
    acc = acc * alpha[:, None] + mma(p.to(v.dtype), v, DOT_UPCAST, DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _attend_tile(
    q, m_i, l_i, acc, table, k_base, v_base, k_inner, v_inner, n0, q_pos, ctx,
    s_kn, s_kb, s_vn, s_vb, scale_log2e, after,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, MASKED: tl.constexpr, LOAD_MASK: tl.constexpr,
    NARROW: tl.constexpr, BLOCK_READS: tl.constexpr, K_TRANSPOSED: tl.constexpr,
    DOT_UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr,
):  # fmt: skip
    """One tile of ``BLOCK_N`` keys from ``n0`` through the block table. ``MASKED``: the causal
    mask and keys past ``ctx``; ``WINDOW``: row r sees only keys past ``after[r]``
    (``q_pos - window``), masked or not."""
    pos = n0 + tl.arange(0, BLOCK_N)
    blk = _row_blocks(table, n0, ctx, BLOCK_SIZE, BLOCK_N, MASKED, BLOCK_READS)
    k = _kv_tile(
        k_base, blk, n0, ctx, s_kn, s_kb, k_inner, BLOCK_D, HEAD_DIM, BLOCK_SIZE, BLOCK_N,
        LOAD_MASK, NARROW, K_TRANSPOSED,
    ).to(q.dtype)  # fmt: skip  # FP8 caches: exact. Read as fp16 with the scale in q (what
    # the decode kernel does) it was slower here: 361 against 330 us a layer of an 8 x 1024
    # FP8 prefill step on an H200 (2026-11-28)
    if K_TRANSPOSED:
        s = mma(q, k, DOT_UPCAST, DOT_PRECISION)  # raw scores: scaled inside the exp2
    else:
        s = mma(q, tl.trans(k), DOT_UPCAST, DOT_PRECISION)
    if MASKED:
        visible = (pos[None, :] <= q_pos[:, None]) & (pos < ctx)[None, :]
        if WINDOW:
            visible = visible & (pos[None, :] > after[:, None])
        s = tl.where(visible, s, float("-inf"))
    elif WINDOW:
        s = tl.where(pos[None, :] > after[:, None], s, float("-inf"))
    m_new, alpha, p, l_i = _softmax_update(s, m_i, l_i, scale_log2e, WINDOW, SOFTCAP)
    v = _kv_tile(
        v_base, blk, n0, ctx, s_vn, s_vb, v_inner, BLOCK_D, HEAD_DIM, BLOCK_SIZE, BLOCK_N,
        LOAD_MASK, NARROW, False,
    ).to(q.dtype)  # fmt: skip
    acc = acc * alpha[:, None] + mma(p.to(v.dtype), v, DOT_UPCAST, DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _window_cut(last_after, lo, hi, BLOCK_N: tl.constexpr):
    """Where the key tiles that cut into some row's window end, within ``[lo, hi]``: the first
    multiple of ``BLOCK_N`` past ``last_after`` (the highest key any row's window leaves out,
    the last row's). Every row sees the keys of the tiles from there on (up to the diagonal):
    they need no window mask."""
    return tl.minimum(tl.maximum((last_after + BLOCK_N) // BLOCK_N * BLOCK_N, lo), hi)


# the batch's counts and index arrays vary per step: not specialized (the alignment of a slice of
# the step's staging buffer would otherwise compile a new kernel for some batch sizes); nor is the
# window (one variant for every size: 1 and multiples of 16 would otherwise be their own)
@triton.jit(
    do_not_specialize=[
        "bt_ptr",
        "qsl_ptr",
        "lens_ptr",
        "span_ptr",
        "num_seqs",
        "num_tiles",
        "s_btb",
        "window",
    ]
)
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, qsl_ptr, lens_ptr, out_ptr, kn_ptr, vn_ptr, sink_ptr, span_ptr,
    scale_log2e,
    num_seqs, num_tiles, window, s_qt, s_qh, s_kn, s_kb, s_kh, s_vn, s_vb, s_vh, s_btb, s_ot, s_oh,
    s_knt, s_knh, s_vnt, s_vnh, kd, vd,
    HEAD_SETS: tl.constexpr, HEADS: tl.constexpr, GROUP: tl.constexpr, TOKENS: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D_PADDED: tl.constexpr,
    NARROW: tl.constexpr, BLOCK_READS: tl.constexpr, K_TRANSPOSED: tl.constexpr,
    CONTIG: tl.constexpr, DOT_UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
    TMA: tl.constexpr, NO_PREFIX: tl.constexpr, HAS_WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
    HAS_SINKS: tl.constexpr, HAS_SPANS: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    h0 = (pid % HEAD_SETS) * HEADS  # the tile's first query head
    tile = num_tiles - 1 - pid // HEAD_SETS
    kvh = h0 // GROUP
    b, q_start, q_len, m0 = seq_of_tile(qsl_ptr, num_seqs, tile, TOKENS)
    if m0 >= q_len:
        return
    ctx = tl.load(lens_ptr + b).to(tl.int32)
    prefix = ctx - q_len

    r = tl.arange(0, BLOCK_M)
    tok = m0 + r // HEADS  # row r: token m0 + r // HEADS, head h0 + r % HEADS
    head = h0 + r % HEADS
    offs_d = tl.arange(0, BLOCK_D)
    # rows past TOKENS * HEADS pad a group size that does not divide BLOCK_M
    m_mask = (tok < q_len) & (r < TOKENS * HEADS)
    io_mask = m_mask[:, None] & (offs_d < HEAD_DIM)[None, :]
    rows = (q_start + tok).to(tl.int64)
    q_ptrs = q_ptr + rows[:, None] * s_qt + head[:, None] * s_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=io_mask, other=0.0)
    q_pos = prefix + tok
    # the last key each row sees (lim, tok_lim in the chunk's numbering) and the end of the
    # chunk's keys any row sees (reach): the diagonal, or with Gemma 3's image spans the last
    # token of a row's image (its tokens see each other; every span ends within its chunk)
    lim = q_pos
    reach = m0 + TOKENS
    if HAS_SPANS:
        lim = tl.maximum(tl.load(span_ptr + q_start + tok, mask=m_mask, other=0), q_pos)
        reach = tl.maximum(reach, tl.max(tl.where(m_mask, lim, 0)) + 1 - prefix)
    tok_lim = lim - prefix
    table = bt_ptr + b.to(tl.int64) * s_btb

    k_base = k_ptr + kvh * s_kh
    v_base = v_ptr + kvh * s_vh
    k_inner = 0
    v_inner = 0
    if NARROW:  # a tile starts on a block boundary: its keys' in-block offsets never change
        in_blk = tl.arange(0, BLOCK_N) % BLOCK_SIZE
        if K_TRANSPOSED:
            k_inner = (in_blk * s_kb)[None, :] + offs_d[:, None]
        else:
            k_inner = (in_blk * s_kb)[:, None] + offs_d[None, :]
        v_inner = (in_blk * s_vb)[:, None] + offs_d[None, :]

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    if HAS_SINKS:  # gpt-oss: the row's head's sink logit (value 0) as if already seen, in log2
        # units as the running max is (never soft-capped); its term e^0 = 1 in the sum. Every
        # head of the tile is a real one (padding rows repeat the group's), so no load mask
        m_i = tl.load(sink_ptr + head).to(tl.float32) * 1.4426950408889634  # [BLOCK_M]
        l_i = tl.full([BLOCK_M], 1.0, tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # a sliding window: row r sees only the keys past position after[r]. Key tiles wholly below
    # the first row's window (the lowest any row sees) are skipped: the loops start there,
    # rounded down to a multiple of BLOCK_N (tiles stay on block boundaries). Only the tiles that
    # cut some row's window (up to _window_cut) and the diagonal ones are masked, and a row may
    # see no key of such a tile (_softmax_update guards that)
    after = 0
    if HAS_WINDOW:
        after = q_pos - window
    if CONTIG:
        # the cached prefix through the block table (every row sees all of it; the last tile
        # stops at the prefix's end), then the chunk's own keys from the contiguous new K/V.
        # Whichever comes first holds key 0, which every row sees
        pre_full = prefix // BLOCK_N * BLOCK_N
        pre_start = 0
        if HAS_WINDOW and not NO_PREFIX:
            pre_start = tl.maximum(prefix + m0 - window + 1, 0) // BLOCK_N * BLOCK_N
            pre_cut = _window_cut(prefix + m0 + TOKENS - 1 - window, pre_start, pre_full, BLOCK_N)
            for n0 in range(pre_start, pre_cut, BLOCK_N):
                m_i, l_i, acc = _attend_tile(
                    q, m_i, l_i, acc, table, k_base, v_base, k_inner, v_inner, n0, q_pos,
                    prefix, s_kn, s_kb, s_vn, s_vb, scale_log2e, after, HEAD_DIM, BLOCK_D,
                    BLOCK_SIZE, BLOCK_N, False, D_PADDED, NARROW, BLOCK_READS, K_TRANSPOSED,
                    DOT_UPCAST, DOT_PRECISION, True, SOFTCAP,
                )  # fmt: skip
            pre_start = pre_cut
        if NO_PREFIX:  # the caller says no sequence has one: the paged loops are not compiled
            pre_full = 0
            prefix = 0
            pre_start = 0
        for n0 in range(pre_start, pre_full, BLOCK_N):
            m_i, l_i, acc = _attend_tile(
                q, m_i, l_i, acc, table, k_base, v_base, k_inner, v_inner, n0, q_pos, prefix,
                s_kn, s_kb, s_vn, s_vb, scale_log2e, after, HEAD_DIM, BLOCK_D, BLOCK_SIZE,
                BLOCK_N, False, D_PADDED, NARROW, BLOCK_READS, K_TRANSPOSED, DOT_UPCAST,
                DOT_PRECISION, False, SOFTCAP,
            )  # fmt: skip
        # with a window, only if the first row's window reaches into the prefix
        if not NO_PREFIX and pre_full < prefix and (not HAS_WINDOW or m0 + 1 < window):
            m_i, l_i, acc = _attend_tile(
                q, m_i, l_i, acc, table, k_base, v_base, k_inner, v_inner, pre_full, q_pos,
                prefix, s_kn, s_kb, s_vn, s_vb, scale_log2e, after, HEAD_DIM, BLOCK_D,
                BLOCK_SIZE, BLOCK_N, True, True, NARROW, BLOCK_READS, K_TRANSPOSED, DOT_UPCAST,
                DOT_PRECISION, HAS_WINDOW, SOFTCAP,
            )  # fmt: skip
        kn_base = kn_ptr + q_start.to(tl.int64) * s_knt + kvh * s_knh
        vn_base = vn_ptr + q_start.to(tl.int64) * s_vnt + kvh * s_vnh
        chunk_full = m0 // BLOCK_N * BLOCK_N  # chunk keys every row of the tile sees
        tma_col = kvh * HEAD_DIM
        chunk_start = 0
        chunk_after = 0
        if HAS_WINDOW:  # in the chunk's own numbering: its key j sits at position prefix + j
            chunk_start = tl.maximum(m0 - window + 1, 0) // BLOCK_N * BLOCK_N
            chunk_after = tok - window
            chunk_cut = _window_cut(m0 + TOKENS - 1 - window, chunk_start, chunk_full, BLOCK_N)
            for j0 in range(chunk_start, chunk_cut, BLOCK_N):
                m_i, l_i, acc = _attend_contig(
                    q, m_i, l_i, acc, kn_base, vn_base, j0, tok_lim, q_len, s_knt, s_vnt,
                    scale_log2e, kd, vd, q_start, tma_col, chunk_after, HEAD_DIM, BLOCK_D,
                    BLOCK_N, False, D_PADDED, K_TRANSPOSED, DOT_UPCAST, DOT_PRECISION, TMA, True, SOFTCAP,
                )  # fmt: skip
            chunk_start = chunk_cut
        for j0 in range(chunk_start, chunk_full, BLOCK_N):
            m_i, l_i, acc = _attend_contig(
                q, m_i, l_i, acc, kn_base, vn_base, j0, tok_lim, q_len, s_knt, s_vnt, scale_log2e,
                kd, vd, q_start, tma_col, chunk_after, HEAD_DIM, BLOCK_D, BLOCK_N, False,
                D_PADDED, K_TRANSPOSED, DOT_UPCAST, DOT_PRECISION, TMA, False, SOFTCAP,
            )  # fmt: skip
        for j0 in range(chunk_full, tl.minimum(reach, q_len), BLOCK_N):
            m_i, l_i, acc = _attend_contig(
                q, m_i, l_i, acc, kn_base, vn_base, j0, tok_lim, q_len, s_knt, s_vnt, scale_log2e,
                kd, vd, q_start, tma_col, chunk_after, HEAD_DIM, BLOCK_D, BLOCK_N, True, True,
                K_TRANSPOSED, DOT_UPCAST, DOT_PRECISION, TMA, HAS_WINDOW, SOFTCAP,
            )  # fmt: skip
    else:
        # keys every row sees (causal; with a window, from the cut on); the first masked tile
        # starts at or before the tile's first position, so each row (padding rows included:
        # their positions lie past it) sees its first key
        full_end = (prefix + m0) // BLOCK_N * BLOCK_N
        hi = tl.minimum(prefix + reach, ctx)
        start = 0
        if HAS_WINDOW:
            start = tl.maximum(prefix + m0 - window + 1, 0) // BLOCK_N * BLOCK_N
            cut = _window_cut(prefix + m0 + TOKENS - 1 - window, start, full_end, BLOCK_N)
            for n0 in range(start, cut, BLOCK_N):
                m_i, l_i, acc = _attend_tile(
                    q, m_i, l_i, acc, table, k_base, v_base, k_inner, v_inner, n0, q_pos, ctx,
                    s_kn, s_kb, s_vn, s_vb, scale_log2e, after, HEAD_DIM, BLOCK_D, BLOCK_SIZE,
                    BLOCK_N, False, D_PADDED, NARROW, BLOCK_READS, K_TRANSPOSED, DOT_UPCAST,
                    DOT_PRECISION, True, SOFTCAP,
                )  # fmt: skip
            start = cut
        for n0 in range(start, full_end, BLOCK_N):
            m_i, l_i, acc = _attend_tile(
                q, m_i, l_i, acc, table, k_base, v_base, k_inner, v_inner, n0, q_pos, ctx,
                s_kn, s_kb, s_vn, s_vb, scale_log2e, after, HEAD_DIM, BLOCK_D, BLOCK_SIZE,
                BLOCK_N, False, D_PADDED, NARROW, BLOCK_READS, K_TRANSPOSED, DOT_UPCAST,
                DOT_PRECISION, False, SOFTCAP,
            )  # fmt: skip
        for n0 in range(full_end, hi, BLOCK_N):
            m_i, l_i, acc = _attend_tile(
                q, m_i, l_i, acc, table, k_base, v_base, k_inner, v_inner, n0, lim, ctx,
                s_kn, s_kb, s_vn, s_vb, scale_log2e, after, HEAD_DIM, BLOCK_D, BLOCK_SIZE,
                BLOCK_N, True, True, NARROW, BLOCK_READS, K_TRANSPOSED, DOT_UPCAST,
                DOT_PRECISION, HAS_WINDOW, SOFTCAP,
            )  # fmt: skip
    if HAS_WINDOW:  # a padding row's window may lie wholly past the context: no key, sum 0
        # (its output is not stored; 0, not 0 / 0)
        l_i = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_i[:, None]
    o_ptrs = out_ptr + rows[:, None] * s_ot + head[:, None] * s_oh + offs_d[None, :]
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=io_mask)


class Tiles(NamedTuple):
    """A launch configuration: the tile shape, then the kernel variants (constexpr knobs).

    Plain 5-tuples ``(block_m, block_n, num_warps, num_stages, pack)`` are accepted wherever a
    ``Tiles`` is, with every knob off. The knobs change how K/V tiles are addressed and loaded,
    never the arithmetic: every variant computes the same result.
    """

    block_m: int  # rows: (token, head) pairs when ``pack`` stacks a GQA group
    block_n: int  # keys per K/V tile
    num_warps: int
    num_stages: int
    pack: bool  # a GQA group's heads share one tile
    # int64 math only for each key's block base; the in-block offsets (key row, head, dim) are
    # int32 and loop-invariant, computed once per program (needs BLOCK_SIZE | block_n)
    narrow: bool = False
    # one block-table entry per KV block, broadcast to its keys, instead of one per key
    # (needs BLOCK_SIZE | block_n)
    block_reads: bool = False
    k_transposed: bool = False  # K loaded as a [D, block_n] tile (no tl.trans before QK^T)

    def code(self) -> str:
        """The Python literal, knobs only when on: what to paste into the defaults."""
        knobs = "".join(f", {k}=True" for k in self._fields[5:] if getattr(self, k))
        return f"Tiles{tuple(self[:5])}"[:-1] + knobs + ")"


TilesLike = Tiles | tuple[int, int, int, int, bool]  # a plain 5-tuple: every knob off


# fastest first (swept on an H100 with ``python -m kernels.bench.tune prefill``); the first whose
# tiles fit the device's shared memory is used when the grid is too small for ``LARGE_TILES``.
# The first: the least total time over "4 x 512 prompts" and "512 chunk after 4096 prefix" in the
# 2026-11-25 sweep (0.164 ms against 0.189 for the same tiles without the knobs: 4 x 512 at
# 175 TFLOP/s instead of ~165; the chunk within noise), docs/benchmarks.md
TILE_CHOICES: tuple[Tiles, ...] = (
    Tiles(64, 64, 4, 3, True, narrow=True, block_reads=True, k_transposed=True),
    Tiles(64, 64, 4, 3, True),
    Tiles(64, 32, 4, 2, True),
    Tiles(32, 32, 4, 2, True),
    Tiles(16, 16, 4, 1, True),
)
# (tiles, the least grid programs per SM to take them): large tiles feed each K/V tile to more
# rows (less L2 traffic per FLOP) but cut the grid; below ~2 programs per SM the tail and idle
# SMs cost more than the reads save (a 512-token chunk after a long prefix fills 64 programs of 256
# rows for 132 SMs, ~10% slower than 264 programs of 64). The first that fits and fills is used.
LARGE_TILES: tuple[tuple[Tiles, float], ...] = ((Tiles(256, 64, 16, 2, True), 2.0),)


# whole prompts read contiguously (k_new, no_prefix): the best of the engine's kernel on an H200
# (kernels.bench.prefill_probe engine, 2026-11-29: 372 TFLOP/s on 8 x 1024 prompts with TMA, 92%
# of SDPA in the same run; 323 with plain loads, against 306 through the block table)
WHOLE_PROMPT_TILES = Tiles(128, 64, 4, 2, True)
# the same for heads wider than 128, whose tile is 256 wide: four warps would hold a 128 x 256
# float32 accumulator, 256 registers a thread (they spilled), so 8 warps. Measured on an H200
# (kernels.bench.wide_heads, 8 x 1024 prompts, docs/benchmarks.md session 23): Gemma 3's 256 (8
# over 4 heads) 96 TFLOP/s with (64, 64, 4, 2), 214 with these (session 21's sweep, before the
# TMA loads and the shared tile search, had ranked them the other way: 227 against 118), and
# gemma-3-1b's offline 128 x 2048 -> 8 1.88 -> 1.27-1.56 s; DeepSeek's expanded 192 (values
# padded, as varlen_attention ran before kernels.triton_varlen) 47 -> 146 TFLOP/s
WIDE_WHOLE_PROMPT_TILES = Tiles(128, 64, 8, 2, True)


def _whole_prompt_tiles(d: int) -> Tiles:
    return WHOLE_PROMPT_TILES if next_pow2(d) <= 128 else WIDE_WHOLE_PROMPT_TILES


def tiles_fit(tiles: TilesLike, d: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the pipelined K/V stages plus the Q tile fit in ~85% of shared memory."""
    return fits_in(Tiles(*tiles), d, dtype, max_shared_memory(device))


def fits_in(tiles: Tiles, d: int, dtype: torch.dtype, smem_bytes: int) -> bool:
    elem = torch.finfo(dtype).bits // 8
    block_d = max(16, next_pow2(d))
    return (
        tiles.num_stages * 2 * tiles.block_n + tiles.block_m
    ) * block_d * elem <= 0.85 * smem_bytes


def default_tiles(d: int, dtype: torch.dtype, device: torch.device) -> Tiles:
    """The first (fastest) of ``TILE_CHOICES`` that fits the device (a small grid's tiles)."""
    return _first_fitting(functools.partial(tiles_fit, d=d, dtype=dtype, device=device))


def _first_fitting(fits: Callable[[Tiles], bool]) -> Tiles:
    return next((t for t in TILE_CHOICES if fits(t)), TILE_CHOICES[-1])


def heads_per_tile(block_m: int, group: int, pack: bool) -> int:
    """Query heads stacked in one tile: the whole GQA group when packing and it fits, else one."""
    return group if pack and group <= block_m else 1


def filled_programs(tiles: Tiles, tokens: int, q_heads: int, group: int) -> int:
    """Programs that ``tokens`` new tokens fill: whole tiles per head set. The grid adds up to
    one partial tile per sequence, not counted: many short rows give a big grid of near-empty
    tiles, and a large tile would only multiply their wasted rows."""
    heads = heads_per_tile(tiles.block_m, group, tiles.pack)
    return triton.cdiv(tokens, tiles.block_m // heads) * (q_heads // heads)


def choose_tiles(
    tokens: int, q_heads: int, group: int, sms: int, fits: Callable[[Tiles], bool]
) -> Tiles:
    """The step's tiles from its shape (host-side, no device sync): the first of ``LARGE_TILES``
    that fits and whose :func:`filled_programs` still give every SM its share, else the first of
    ``TILE_CHOICES`` that fits. Only which of these few configurations runs depends on the batch,
    never a compile-time constant, so a new batch compiles nothing once each has run."""
    for tiles, per_sm in LARGE_TILES:
        if fits(tiles) and filled_programs(tiles, tokens, q_heads, group) >= per_sm * sms:
            return tiles
    return _first_fitting(fits)


def step_tiles(
    tokens: int,
    q_heads: int,
    group: int,
    d: int,
    dtype: torch.dtype,
    device: torch.device,
) -> Tiles:
    """:func:`choose_tiles` for ``device`` (its SM count; a nominal one under the interpreter)."""
    smem = max_shared_memory(device)
    fits = functools.partial(fits_in, d=d, dtype=dtype, smem_bytes=smem)
    return choose_tiles(tokens, q_heads, group, sm_count(device), fits)


# TMA pays from this many new tokens: each call builds two tensor descriptors on the host (~40 us
# more per call: 128 against 92 us on an H200), which a short chunk's kernel (4 x 512 prompts:
# 0.04 ms) cannot hide; 8 x 1024 prompts run 374 TFLOP/s with it, ~323 with plain loads
TMA_MIN_TOKENS = 4096


def _tma_layout(x: torch.Tensor, d: int) -> bool:
    """Whether ``x`` ([T, Hkv, D]) reads as the 2-D [T, Hkv * D] tensor a descriptor needs: heads
    side by side, a power-of-two D, base and row stride 16-byte aligned (else plain loads)."""
    elem = x.element_size()
    return (
        d == max(16, next_pow2(d))
        and x.stride(2) == 1
        and x.stride(1) == d
        and x.data_ptr() % 16 == 0
        and x.stride(0) * elem % 16 == 0
    )


def _tma_ok(device: torch.device, tokens: int) -> bool:
    """Whether K/V tiles load through TMA tensor descriptors: compute capability 9+ and a chunk
    large enough (``TMA_MIN_TOKENS``)."""
    if device.type != "cuda" or tokens < TMA_MIN_TOKENS:
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


def _check_new_kv(
    k_new: torch.Tensor | None, v_new: torch.Tensor | None, q: torch.Tensor, k_cache: torch.Tensor
) -> bool:
    """Whether the chunk's keys come from ``k_new``/``v_new``; refuses what the kernel cannot
    read as the cache's values."""
    if k_new is None and v_new is None:
        return False
    if k_new is None or v_new is None:
        raise ValueError("k_new and v_new go together")
    want = (q.shape[0], k_cache.shape[2], k_cache.shape[3])
    for name, x in (("k_new", k_new), ("v_new", v_new)):
        check_tensor(name, x, ndim=3, dtypes=FLOAT_DTYPES)
        if tuple(x.shape) != want:
            raise ValueError(f"{name} {tuple(x.shape)} must be [T, Hkv, D] = {want}")
        if x.dtype != q.dtype or x.device != q.device:
            raise ValueError(f"{name} must be {q.dtype} on {q.device}, like q")
    if k_cache.dtype != q.dtype:
        raise ValueError(f"k_new needs a cache of q's dtype ({q.dtype}), not {k_cache.dtype}: "
                         "attention must see the cache's rounding")  # fmt: skip
    return True


def prefill_attention(
    q: torch.Tensor,  # [T, Hq, D], the new tokens of every sequence, concatenated
    k_cache: torch.Tensor,  # [N, bs, Hkv, D], already holding the new tokens' K/V
    v_cache: torch.Tensor,  # [N, bs, Hkv, D]
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    query_start_loc: torch.Tensor,  # [B + 1] int32, prefix sums of query lengths
    context_lens: torch.Tensor,  # [B] int32, cached prefix + new tokens
    scale: float,
    *,
    out: torch.Tensor | None = None,  # [T, Hq, D] to write into (e.g. a slice of a larger one)
    tiles: TilesLike | None = None,
    k_new: torch.Tensor | None = None,  # [T, Hkv, D], the new tokens' rotated keys, row for row
    v_new: torch.Tensor | None = None,  # [T, Hkv, D] (may be strided views, e.g. of qkv)
    no_prefix: bool = False,  # the caller knows no sequence has a cached prefix (k_new only:
    # the paged loops are then not compiled in, and the whole-prompt tiles run). Not checked
    # here (that would need a device sync): set it from host-side facts, as the engine's
    # AttentionMetadata.prefill_no_prefix does; the reference checks it
    tma: bool | None = None,  # read k_new/v_new through TMA descriptors (default: _tma_ok;
    # plain loads wherever their layout does not suit a descriptor, see _tma_layout)
    window: int = 0,  # sliding window: each query sees its last ``window`` positions (0: all)
    softcap: float = 0.0,  # scores soft-capped (Gemma 2): ref_prefill_attention's
    sinks: torch.Tensor | None = None,  # [Hq], contiguous: a learned logit per head (gpt-oss)
    span_last: torch.Tensor | None = None,  # [T] int32: ref_prefill_attention's (Gemma 3's
    # images); None: the kernel compiled without it
) -> torch.Tensor:  # [T, Hq, D]
    """Triton version of :func:`kernels.attention.ref_prefill_attention`.

    ``k_new``/``v_new``: the chunk's own keys and values are read from these contiguous rows
    instead of through the block table (the prefix still is): 30-40% faster on whole prompts
    (docs/benchmarks.md, W3). Only for a cache of q's dtype: an FP8 cache's rounding must be
    what attention sees.

    ``window`` > 0: sliding-window attention as transformers defines it (Mistral's
    ``sliding_window``, Gemma's local layers): the query at position ``p`` sees keys
    ``p - window < j <= p``, exactly ``window`` of them (itself included) once ``p >= window - 1``.
    A runtime argument (one compiled variant serves every window size; 0 runs the kernel
    compiled without one): key tiles below a tile's windows are never read, only the tiles that
    cut a window (and the diagonal) are masked. A window that never binds still costs a few
    percent (module docstring): pass 0 when no context can be longer than it.

    ``sinks`` (gpt-oss's attention sinks, the reference's; None: none, the kernel compiled
    without them) seed each row's running max and sum (module docstring).

    ``tiles`` (a :class:`Tiles`, or a plain (BLOCK_M, BLOCK_N, num_warps, num_stages, pack)) overrides
    :func:`step_tiles`' choice (for tuning); BLOCK_M counts rows, which are (token, head) pairs when
    ``pack`` stacks a GQA group.
    """
    check_tensor("q", q, ndim=3, dtypes=FLOAT_DTYPES)
    _, bs, hkv, d = check_kv_cache(k_cache, v_cache)
    check_tensor("block_tables", block_tables, ndim=2, dtypes=INDEX_DTYPES)
    check_tensor("query_start_loc", query_start_loc, ndim=1, dtypes=INDEX_DTYPES)
    check_tensor("context_lens", context_lens, ndim=1, dtypes=INDEX_DTYPES, inner_contiguous=False)
    t, hq, qd = q.shape
    group = check_heads(hq, hkv, qd, d)
    batch = context_lens.shape[0]
    check_q_for_cache(q, k_cache)
    if block_tables.shape[0] != batch:
        raise ValueError(f"block_tables has {block_tables.shape[0]} rows for {batch} sequences")
    if query_start_loc.shape[0] != batch + 1:
        raise ValueError(
            f"query_start_loc needs {batch + 1} entries for {batch} sequences, got {query_start_loc.shape[0]}"
        )
    device = check_devices(
        q=q, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables,
        query_start_loc=query_start_loc, context_lens=context_lens,
    )  # fmt: skip
    if not scale > 0:  # the kernel takes the row max before scaling
        raise ValueError(f"scale must be positive, got {scale}")
    check_window(window)
    check_softcap(softcap)
    check_sinks(sinks, hq, device)
    if sinks is not None:  # the kernel reads sinks[h] at sink_ptr + h
        check_tensor("sinks", sinks, ndim=1)
    check_span_last(span_last, t, device)
    out = check_out(out, (t, hq, d), q.dtype, device)
    contig = _check_new_kv(k_new, v_new, q, k_cache)
    if t == 0 or batch == 0:
        return out
    if tiles:
        cfg = Tiles(*tiles)
    elif contig and no_prefix and tiles_fit(whole := _whole_prompt_tiles(d), d, q.dtype, device):
        cfg = whole
    else:
        cfg = step_tiles(t, hq, group, d, q.dtype, device)
    heads = heads_per_tile(cfg.block_m, group, cfg.pack)
    tokens = cfg.block_m // heads
    num_tiles = triton.cdiv(t, tokens) + batch
    whole_blocks = cfg.block_n % bs == 0  # a K/V tile starts on a block boundary
    kn, vn = (k_new, v_new) if k_new is not None and v_new is not None else (q, q)
    use_tma = (
        contig
        and (tma if tma is not None else _tma_ok(device, t))
        and all(_tma_layout(x, d) for x in (kn, vn))
    )
    kd = vd = 0
    if use_tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        kd, vd = (
            TensorDescriptor(x, (t, x.shape[1] * d), (x.stride(0), 1), (cfg.block_n, d))
            for x in (kn, vn)
        )
    _prefill_kernel[(num_tiles * (hq // heads),)](
        q, k_cache, v_cache, block_tables, query_start_loc, context_lens, out, kn, vn,
        q if sinks is None else sinks,  # q: a stand-in pointer the kernel never reads
        q if span_last is None else span_last.to(torch.int32).contiguous(),
        float(scale) * LOG2E, batch, num_tiles, min(window, 2**31 - 1),  # an int32 (no context
        # is longer), so a huge window is one more no-op window, not a new int64 variant
        q.stride(0), q.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3],
        block_tables.stride(0), out.stride(0), out.stride(1), kn.stride(0), kn.stride(1),
        vn.stride(0), vn.stride(1), kd, vd,
        HEAD_SETS=hq // heads, HEADS=heads, GROUP=group, TOKENS=tokens, HEAD_DIM=d,
        BLOCK_D=max(16, next_pow2(d)), BLOCK_SIZE=bs, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        D_PADDED=next_pow2(d) != d or d < 16, NARROW=cfg.narrow and whole_blocks,
        BLOCK_READS=cfg.block_reads and whole_blocks, K_TRANSPOSED=cfg.k_transposed,
        CONTIG=contig, TMA=use_tma, NO_PREFIX=contig and no_prefix, HAS_WINDOW=window > 0,
        SOFTCAP=float(softcap), HAS_SINKS=sinks is not None, HAS_SPANS=span_last is not None,
        DOT_UPCAST=dot_upcast(q.dtype), DOT_PRECISION=dot_precision(q.dtype),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return out
