"""DeepSeek's latent decode attention (multi-head latent attention in the absorbed form) in
Triton: every query head attends over one cache row a token, ``[rope | latent]`` (64 + 512
dims for DeepSeek-V2/V3), whose latent part is also the value. The torch reference is
:func:`kernels.attention.ref_mla_decode_attention`.

The general decode kernel (:mod:`kernels.triton_decode`) served it as one 576-dim KV head read
as keys and again as values: its tiles padded to 1024 columns, the values' 64 rope columns
multiplied and dropped, 16 keys a step (a [BLOCK_N, 1024] tile in two stages fills shared
memory), and the 1024-wide partial sums of its splits merged by a second kernel holding
64 x 1024 floats a program (DeepSeek-V2-Lite, batch 64 x 1024 keys on an H200: 75 us a layer
for 75 MB of cache, ~1 TB/s, and 16 us of merging). Here a key tile is loaded once as its
latent ``[BLOCK_N, L]`` and rope ``[BLOCK_N, R]`` columns at their own widths: the scores are
``q_latent . k_latent + q_rope . k_rope`` (two MMAs into one accumulator), and the same latent
tile, already in shared memory, is the value tile of ``p @ k_latent``; the output is the
``[H, L]`` latent the model's W_UV then maps to each head's value.

One program handles one sequence, ``BLOCK_G`` of its query heads and one split of its context
(flash-decoding): the heads of a program share every key byte it loads (DeepSeek-V2-Lite's 16
heads in one program; V3's 128 in ``128 / BLOCK_G``, each reading the keys again). The splits'
partial (max, sum, accumulator) rows are merged by ``triton_decode``'s merge kernel, in chunks
of the latent's columns.

Napkin math (DeepSeek-V2-Lite, 16 heads, bf16): a token's row is 1,152 bytes for 16 heads'
2 x 16 x 576 FLOP of scores and 2 x 16 x 512 of values, ~30 FLOP a byte: bound by memory;
batch 64 x 1024 keys is 75.5 MB a layer, ~18 us at the H200's ~4.2 TB/s.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels.triton_common import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_devices,
    check_out,
    check_tensor,
    dot_precision,
    dot_upcast,
    mma,
    next_pow2,
    pdl,
    pdl_enter,
    sm_count,
)
from kernels.triton_decode import (
    LOG2E,
    MAX_SPLITS,
    _merge_splits_kernel,
    _mma_acc,
    merge_chunk,
    online_softmax,
)

# heads a program (rows of its query tile): its accumulator is BLOCK_G x L floats
DEFAULT_BLOCK_G = 16
# keys a step: a [BLOCK_N, 512] bf16 latent tile is 32 KiB, two stages 64 KiB of shared memory
DEFAULT_BLOCK_N = 32
MIN_KEYS_PER_SPLIT = 32  # one key tile


def num_splits_for(programs: int, max_context: int, device: torch.device) -> int:
    """Splits of each sequence's context for ``programs`` (sequence, head block) programs: none
    once they fill the SMs, else the power of two nearest below two programs a SM, at least one
    key tile a split. A split's partial sums are float32 and L wide a head (2 KiB, against a
    token's 1,152-byte row), written and read again by the merge, so splits are dearer here than
    in ``triton_decode``, whose ~4 programs a SM this rule replaces. DeepSeek-V2-Lite on an
    H200 (``python -m kernels.bench.mla_decode --splits 16 32 4 2``, graph us, bf16 cache):
    batch 256 x 1024 keys 114 with 1 split against 183 with 3 (``triton_decode``'s choice);
    64 x 1024 54 with 4 (9: 59); 1 x 1024 6.7 with 32 (16: 8.5); 16 heads x 64 x 4096 130 with
    4 (8: 132); V3's 128 heads (8 programs a sequence) x 64: 184 with 1."""
    sms = sm_count(device)
    if programs >= sms:
        return 1
    by_work = max(1, max_context // MIN_KEYS_PER_SPLIT)
    return max(1, min(1 << int(math.log2(2 * sms / programs)), by_work, MAX_SPLITS))


@triton.jit(do_not_specialize=["bt_ptr", "lens_ptr", "num_splits", "s_btb"])
def _mla_decode_kernel(
    q_ptr, c_ptr, bt_ptr, lens_ptr, out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr,
    scale_log2e, num_splits, s_qb, s_qh, s_cn, s_cb, s_btb, s_ob, s_oh,
    NUM_Q_HEADS: tl.constexpr, BLOCK_G: tl.constexpr, ROPE: tl.constexpr, BLOCK_R: tl.constexpr,
    LATENT: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, DOT_UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    pdl_enter(USE_PDL)
    b = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_G + tl.arange(0, BLOCK_G)
    split = tl.program_id(2)
    ctx = tl.load(lens_ptr + b).to(tl.int32)
    per_split = tl.cdiv(tl.cdiv(ctx, num_splits), BLOCK_N) * BLOCK_N
    start = split * per_split
    end = tl.minimum(start + per_split, ctx)

    g_mask = heads < NUM_Q_HEADS
    offs_r = tl.arange(0, BLOCK_R)
    offs_l = tl.arange(0, BLOCK_L)
    offs_n = tl.arange(0, BLOCK_N)
    r_mask = offs_r < ROPE
    l_mask = offs_l < LATENT
    q_rows = q_ptr + b.to(tl.int64) * s_qb + heads[:, None] * s_qh
    q_rope = tl.load(q_rows + offs_r[None, :], mask=g_mask[:, None] & r_mask[None, :], other=0.0)
    q_lat = tl.load(
        q_rows + ROPE + offs_l[None, :], mask=g_mask[:, None] & l_mask[None, :], other=0.0
    )
    table = bt_ptr + b.to(tl.int64) * s_btb
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_L], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + offs_n
        n_mask = pos < end
        blk = tl.load(table + pos // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        rows = c_ptr + blk * s_cn + (pos % BLOCK_SIZE) * s_cb  # [BLOCK_N] cache rows
        # an FP8 cache is read in q's dtype (exact: every e4m3 value is a bf16/fp16 value)
        k_lat = tl.load(
            rows[:, None] + ROPE + offs_l[None, :], mask=n_mask[:, None] & l_mask[None, :],
            other=0.0,
        ).to(q_lat.dtype)  # fmt: skip
        k_rope = tl.load(
            rows[:, None] + offs_r[None, :], mask=n_mask[:, None] & r_mask[None, :], other=0.0
        ).to(q_lat.dtype)
        s = mma(q_lat, tl.trans(k_lat), DOT_UPCAST, DOT_PRECISION)
        s = _mma_acc(q_rope, tl.trans(k_rope), s, DOT_UPCAST, DOT_PRECISION) * scale_log2e
        s = tl.where(n_mask[None, :], s, float("-inf"))  # [BLOCK_G, BLOCK_N]
        m_new, alpha, p, l_i = online_softmax(s, m_i, l_i)
        # the latent tile is the value tile: no second load
        acc = _mma_acc(p.to(k_lat.dtype), k_lat, acc * alpha[:, None], DOT_UPCAST, DOT_PRECISION)
        m_i = m_new

    if not SPLIT:
        o_ptrs = out_ptr + b.to(tl.int64) * s_ob + heads[:, None] * s_oh + offs_l[None, :]
        out = (acc / l_i[:, None]).to(out_ptr.dtype.element_ty)
        tl.store(o_ptrs, out, mask=g_mask[:, None] & l_mask[None, :])
    else:
        row = (b.to(tl.int64) * NUM_Q_HEADS + heads) * num_splits + split  # [BLOCK_G]
        tl.store(part_m_ptr + row, m_i, mask=g_mask)
        tl.store(part_l_ptr + row, l_i, mask=g_mask)
        a_ptrs = part_acc_ptr + row[:, None] * LATENT + offs_l[None, :]
        tl.store(a_ptrs, acc, mask=g_mask[:, None] & l_mask[None, :])


def mla_decode_attention(
    q: torch.Tensor,  # [B, H, R + L]: each head's rotated rope query, then its absorbed one
    cache: torch.Tensor,  # [N, bs, 1, R + L]: a token's rope key, then its latent
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    context_lens: torch.Tensor,  # [B] int32, >= 1
    scale: float,
    rope_dim: int,
    *,
    out: torch.Tensor | None = None,  # [B, H, L] to write into
    num_splits: int | None = None,
    block_g: int = DEFAULT_BLOCK_G,
    block_n: int = DEFAULT_BLOCK_N,
    num_warps: int = 4,
    num_stages: int = 2,
) -> torch.Tensor:  # [B, H, L]
    """Triton version of :func:`kernels.attention.ref_mla_decode_attention`. ``num_splits``
    defaults to a choice from the batch, the programs of heads and the block table's width (the
    context bound known without a device sync); the other keywords are the tiles, for tests and
    tuning."""
    check_tensor("q", q, ndim=3, dtypes=FLOAT_DTYPES)
    check_tensor("cache", cache, ndim=4)
    check_tensor("block_tables", block_tables, ndim=2, dtypes=INDEX_DTYPES)
    check_tensor("context_lens", context_lens, ndim=1, dtypes=INDEX_DTYPES, inner_contiguous=False)
    batch, hq, width = q.shape
    _, bs, kv_heads, row = cache.shape
    if kv_heads != 1 or row != width:
        raise ValueError(f"cache {tuple(cache.shape)} must be [N, bs, 1, {width}] for q "
                         f"{tuple(q.shape)}")  # fmt: skip
    if cache.dtype not in (q.dtype, torch.float8_e4m3fn):
        raise ValueError(f"cache must be {q.dtype} (q's) or float8_e4m3fn, got {cache.dtype}")
    if not 0 < rope_dim < width:
        raise ValueError(f"rope_dim must be in (0, {width}), got {rope_dim}")
    if block_tables.shape[0] != batch or context_lens.shape[0] != batch:
        raise ValueError(f"block_tables {tuple(block_tables.shape)} and context_lens "
                         f"{tuple(context_lens.shape)} must have {batch} rows")  # fmt: skip
    device = check_devices(q=q, cache=cache, block_tables=block_tables, context_lens=context_lens)
    latent = width - rope_dim
    out = check_out(out, (batch, hq, latent), q.dtype, device)
    if batch == 0:
        return out
    for name, v in (("block_g", block_g), ("block_n", block_n)):
        if v < 16 or v != next_pow2(v):
            raise ValueError(f"{name} must be a power of two >= 16, got {v}")
    head_blocks = -(-hq // block_g)
    if num_splits is None:
        num_splits = num_splits_for(batch * head_blocks, block_tables.shape[1] * bs, device)
    if not (1 <= num_splits <= MAX_SPLITS):
        raise ValueError(f"num_splits must be in [1, {MAX_SPLITS}], got {num_splits}")
    rows = batch * hq * num_splits if num_splits > 1 else 1
    pad = -(-rows // 4) * 4  # each part 16-byte aligned, as paged_decode_attention's
    work = torch.empty(pad * (latent + 2), dtype=torch.float32, device=device)
    part_acc, part_m, part_l = (
        work[: rows * latent],
        work[pad * latent : pad * latent + rows],
        work[pad * (latent + 1) : pad * (latent + 1) + rows],
    )
    block_l = max(16, next_pow2(latent))
    _mla_decode_kernel[(batch, head_blocks, num_splits)](
        q, cache, block_tables, context_lens, out, part_m, part_l, part_acc,
        float(scale) * LOG2E, num_splits, q.stride(0), q.stride(1), cache.stride(0),
        cache.stride(1), block_tables.stride(0), out.stride(0), out.stride(1),
        NUM_Q_HEADS=hq, BLOCK_G=block_g, ROPE=rope_dim, BLOCK_R=max(16, next_pow2(rope_dim)),
        LATENT=latent, BLOCK_L=block_l, BLOCK_SIZE=bs, BLOCK_N=block_n,
        SPLIT=num_splits > 1, DOT_UPCAST=dot_upcast(q.dtype),
        DOT_PRECISION=dot_precision(q.dtype), num_warps=num_warps, num_stages=num_stages,
        **pdl(device, batch),
    )  # fmt: skip
    if num_splits > 1:
        chunk = merge_chunk(block_l)
        _merge_splits_kernel[(batch, hq, triton.cdiv(latent, chunk))](
            part_m, part_l, part_acc, out, out.stride(0), out.stride(1), num_splits,
            NUM_Q_HEADS=hq, HEAD_DIM=latent, BLOCK_D=chunk, BLOCK_S=MAX_SPLITS, num_warps=4,
            **pdl(device, batch),
        )  # fmt: skip
    return out
