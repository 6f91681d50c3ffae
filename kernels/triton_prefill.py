"""Variable-length causal prefill attention over a paged KV cache, in Triton.

Flash-attention style: one program owns a tile of ``BLOCK_M`` query rows of one sequence, walks
the keys ``BLOCK_N`` at a time through the block table and keeps an online softmax (base 2, the
scale folded into one multiply per score). Keys before the tile's first query position are
visible to every row and need no mask; only the diagonal stretch is masked, and keys past the
tile's last query are never read.

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

The chunk's own keys are read through the block table like the prefix: the cache is the only
place that holds the rotated keys (the qkv activation holds them before RoPE), each row of one
KV head is ``D`` contiguous elements in either layout, and an FP8 cache's rounding must be what
attention sees.

Napkin math: 4 * D FLOP per visible (query, key) pair per head. A K/V tile of ``BLOCK_N`` keys
(2 * BLOCK_N * D elements from L2) feeds 4 * BLOCK_M * BLOCK_N * D FLOP: at 64 rows an H100's
tensor cores (~990 TFLOP/s dense bf16) would want ~15 TB/s of L2 reads, at 128 rows about
half, hence the large tiles.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

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
)

LOG2E = 1.4426950408889634


@triton.jit
def _load_rows(row_ptrs, offs_d, mask, USE_MASK: tl.constexpr):
    if USE_MASK:
        return tl.load(row_ptrs[:, None] + offs_d[None, :], mask=mask, other=0.0)
    else:
        return tl.load(row_ptrs[:, None] + offs_d[None, :])


@triton.jit
def _attend_tile(
    q, m_i, l_i, acc, table, k_ptr, v_ptr, n0, q_pos, ctx, kvh,
    s_kn, s_kb, s_kh, s_vn, s_vb, s_vh, scale_log2e,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, MASKED: tl.constexpr, LOAD_MASK: tl.constexpr,
    DOT_UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    offs_d = tl.arange(0, BLOCK_D)
    pos = n0 + tl.arange(0, BLOCK_N)
    kv_mask = (pos < ctx)[:, None] & (offs_d < HEAD_DIM)[None, :]
    if MASKED:
        blk = tl.load(table + pos // BLOCK_SIZE, mask=pos < ctx, other=0).to(tl.int64)
    else:  # every key of the tile is in range
        blk = tl.load(table + pos // BLOCK_SIZE).to(tl.int64)
    off = pos % BLOCK_SIZE
    k_rows = k_ptr + blk * s_kn + off * s_kb + kvh * s_kh
    k = _load_rows(k_rows, offs_d, kv_mask, LOAD_MASK).to(q.dtype)  # FP8 caches: exact
    s = mma(q, tl.trans(k), DOT_UPCAST, DOT_PRECISION)  # raw scores: scaled inside the exp2
    if MASKED:
        visible = (pos[None, :] <= q_pos[:, None]) & (pos < ctx)[None, :]
        s = tl.where(visible, s, float("-inf"))
    # the scale is positive, so the row max scales with it; the exponent is then one FMA per
    # score. Never -inf: every row sees the first key the tile walks (see the loops' bounds), so
    # no guard against -inf - -inf is needed
    m_new = tl.maximum(m_i, tl.max(s, 1) * scale_log2e)
    alpha = tl.math.exp2(m_i - m_new)
    p = tl.math.exp2(s * scale_log2e - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v_rows = v_ptr + blk * s_vn + off * s_vb + kvh * s_vh
    v = _load_rows(v_rows, offs_d, kv_mask, LOAD_MASK).to(q.dtype)
    acc = acc * alpha[:, None] + mma(p.to(v.dtype), v, DOT_UPCAST, DOT_PRECISION)
    return m_new, l_i, acc


# the batch's counts and index arrays vary per step: not specialized (the alignment of a slice of
# the step's staging buffer would otherwise compile a new kernel for some batch sizes)
@triton.jit(do_not_specialize=["bt_ptr", "qsl_ptr", "lens_ptr", "num_seqs", "num_tiles", "s_btb"])
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, qsl_ptr, lens_ptr, out_ptr, scale_log2e, num_seqs, num_tiles,
    s_qt, s_qh, s_kn, s_kb, s_kh, s_vn, s_vb, s_vh, s_btb, s_ot, s_oh,
    HEAD_SETS: tl.constexpr, HEADS: tl.constexpr, GROUP: tl.constexpr, TOKENS: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    D_PADDED: tl.constexpr, DOT_UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    h0 = (pid % HEAD_SETS) * HEADS  # the tile's first query head
    tile = num_tiles - 1 - pid // HEAD_SETS
    kvh = h0 // GROUP
    # the last sequence whose first tile is <= this one (tile starts strictly increase)
    lo = tl.zeros([], dtype=tl.int32)
    hi = num_seqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        first = tl.load(qsl_ptr + mid).to(tl.int32) // TOKENS + mid
        lo = tl.where(first <= tile, mid, lo)
        hi = tl.where(first <= tile, hi, mid - 1)
    b = lo
    q_start = tl.load(qsl_ptr + b).to(tl.int32)
    q_len = tl.load(qsl_ptr + b + 1).to(tl.int32) - q_start
    m0 = (tile - (q_start // TOKENS + b)) * TOKENS  # the tile's first token in its sequence
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
    table = bt_ptr + b.to(tl.int64) * s_btb

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # keys every row sees; the first masked tile starts at or before the tile's first position,
    # so each row (padding rows included: their positions lie past it) sees its first key
    full_end = (prefix + m0) // BLOCK_N * BLOCK_N
    hi = tl.minimum(prefix + m0 + TOKENS, ctx)
    for n0 in range(0, full_end, BLOCK_N):
        m_i, l_i, acc = _attend_tile(
            q, m_i, l_i, acc, table, k_ptr, v_ptr, n0, q_pos, ctx, kvh,
            s_kn, s_kb, s_kh, s_vn, s_vb, s_vh, scale_log2e,
            HEAD_DIM, BLOCK_D, BLOCK_SIZE, BLOCK_N, False, D_PADDED, DOT_UPCAST, DOT_PRECISION,
        )  # fmt: skip
    for n0 in range(full_end, hi, BLOCK_N):
        m_i, l_i, acc = _attend_tile(
            q, m_i, l_i, acc, table, k_ptr, v_ptr, n0, q_pos, ctx, kvh,
            s_kn, s_kb, s_kh, s_vn, s_vb, s_vh, scale_log2e,
            HEAD_DIM, BLOCK_D, BLOCK_SIZE, BLOCK_N, True, True, DOT_UPCAST, DOT_PRECISION,
        )  # fmt: skip
    out = acc / l_i[:, None]
    o_ptrs = out_ptr + rows[:, None] * s_ot + head[:, None] * s_oh + offs_d[None, :]
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=io_mask)


Tiles = tuple[int, int, int, int, bool]  # (BLOCK_M rows, BLOCK_N, num_warps, num_stages, pack)

# fastest first (swept on an H100 with ``python -m kernels.bench.tune prefill``); the first whose
# tiles fit the device's shared memory is used. ``pack``: a GQA group's heads share one tile.
TILE_CHOICES: tuple[Tiles, ...] = (
    (64, 64, 4, 3, True),
    (64, 32, 4, 2, True),
    (32, 32, 4, 2, True),
    (16, 16, 4, 1, True),
)


def tiles_fit(tiles: Tiles, d: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the pipelined K/V stages plus the Q tile fit in ~85% of shared memory."""
    m, n, _, stages, _ = tiles
    elem = torch.finfo(dtype).bits // 8
    block_d = max(16, next_pow2(d))
    return (stages * 2 * n + m) * block_d * elem <= 0.85 * max_shared_memory(device)


def default_tiles(d: int, dtype: torch.dtype, device: torch.device) -> Tiles:
    """The first (fastest) of ``TILE_CHOICES`` that fits the device."""
    return next((t for t in TILE_CHOICES if tiles_fit(t, d, dtype, device)), TILE_CHOICES[-1])


def heads_per_tile(block_m: int, group: int, pack: bool) -> int:
    """Query heads stacked in one tile: the whole GQA group when packing and it fits, else one."""
    return group if pack and group <= block_m else 1


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
    tiles: Tiles | None = None,
) -> torch.Tensor:  # [T, Hq, D]
    """Triton version of :func:`kernels.attention.ref_prefill_attention`.

    ``tiles`` = (BLOCK_M, BLOCK_N, num_warps, num_stages, pack) overrides the defaults (for
    tuning); BLOCK_M counts rows, which are (token, head) pairs when ``pack`` stacks a GQA group.
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
    out = check_out(out, (t, hq, d), q.dtype, device)
    if t == 0 or batch == 0:
        return out
    block_m, block_n, num_warps, num_stages, pack = tiles or default_tiles(d, q.dtype, device)
    heads = heads_per_tile(block_m, group, pack)
    tokens = block_m // heads
    num_tiles = triton.cdiv(t, tokens) + batch
    _prefill_kernel[(num_tiles * (hq // heads),)](
        q, k_cache, v_cache, block_tables, query_start_loc, context_lens, out,
        float(scale) * LOG2E, batch, num_tiles,
        q.stride(0), q.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3],
        block_tables.stride(0), out.stride(0), out.stride(1),
        HEAD_SETS=hq // heads, HEADS=heads, GROUP=group, TOKENS=tokens, HEAD_DIM=d,
        BLOCK_D=max(16, next_pow2(d)), BLOCK_SIZE=bs, BLOCK_M=block_m, BLOCK_N=block_n,
        D_PADDED=next_pow2(d) != d or d < 16, DOT_UPCAST=dot_upcast(q.dtype),
        DOT_PRECISION=dot_precision(q.dtype), num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return out
