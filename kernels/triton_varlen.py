"""Causal attention of packed whole prompts over their own tokens (no cache), in Triton: keys as
wide as any head, values of their own width. The torch reference is
:func:`kernels.attention.ref_varlen_attention` (flash-attention's varlen call).

Built for DeepSeek's expanded MLA prefill: query and key heads of 192 dims (128 nope + 64 rope),
values of 128. The paged prefill kernel has one head width, a power of two: it ran these heads
as 256-wide tiles (values zero-padded to 192 by a copy first), so QK^T and P @ V each multiplied
256 columns where 192 and 128 are needed, into a [BLOCK_M, 256] float32 accumulator. Here the
key width is split into a power-of-two main part and a power-of-two remainder (192 = 128 + 64,
576 = 512 + 64; a power of two has none; other widths round the remainder up to a power of two,
its extra columns masked at load, never padded in memory), and a score tile is the sum of two
``tl.dot`` s, one per part. The values have their own block width (``next_pow2(Dv)``, masked),
so DeepSeek's accumulator is [BLOCK_M, 128].

One program owns ``BLOCK_M`` query rows of one sequence and one query head, walks its
sequence's keys ``BLOCK_N`` at a time and keeps an online softmax in base 2 (the scale times
log2(e) folded into one multiply per score, float32 throughout). Key tiles wholly before the
tile's first query are visible to every row and run unmasked; only the tiles on the diagonal
apply the causal mask (and the sequence's end), and keys past the tile's last query are never
read. q, k, v and ``out`` are read and written through their token and head strides (DeepSeek
passes slices of larger tensors, its keys an expanded rotary part), so nothing is copied.

The grid is sized without a device sync, as the paged prefill kernel's: sequence ``b`` owns
the tiles from ``query_start_loc[b] // BLOCK_M + b`` (these ranges never overlap), so
``T // BLOCK_M + B`` tiles cover every sequence; each program finds its sequence by a binary
search over those starts, and a tile past its sequence's end (or of an empty one) returns at
once. The grid is one-dimensional, heads fastest (a GQA group's heads, which read the same
K/V, run side by side and share it through L2), tiles last to first (each sequence's longest
causal tiles start first, the shortest fill the tail). Nothing about the batch is a
compile-time constant.

Napkin math for DeepSeek's heads: 2 * (192 + 128) FLOP per visible (query, key) pair per head
against the padded path's 2 * (256 + 256), 0.625x the tensor-core work, and the accumulator
half as wide (8 warps hold 128 x 128 float32 in 64 registers a thread).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels.attention import check_varlen
from kernels.triton_common import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    MAX_HEAD_DIM,
    check_devices,
    check_out,
    check_tensor,
    dot_precision,
    dot_upcast,
    max_shared_memory,
    mma,
    next_pow2,
    round_to_bf16,
    rounds_bf16_in_kernel,
    seq_of_tile,
)

LOG2E = 1.4426950408889634


class VarlenTiles(NamedTuple):
    """A launch configuration of :func:`varlen_attention` (a plain 4-tuple works as well)."""

    block_m: int  # query rows (tokens of one head) a program
    block_n: int  # keys a K/V tile
    num_warps: int
    num_stages: int


VarlenTilesLike = VarlenTiles | tuple[int, int, int, int]

# the defaults by width (key blocks, value block); to be swept on an H200 with
# ``python -m kernels.bench.wide_heads``. Up to 128 wide: the paged kernel's whole-prompt tiles
VARLEN_TILES = VarlenTiles(128, 64, 4, 2)
# keys and values up to 256 wide: DeepSeek's expanded 192 / 128 and Gemma 3's 256. Eight warps,
# as the padded path needed for its 256-wide tiles (triton_prefill.WIDE_WHOLE_PROMPT_TILES).
# H200, 8 x 1024 prompts (kernels.bench.wide_heads, docs/benchmarks.md session 23): 192 / 128
# 0.186 ms (3 stages 0.157, no change end to end: DeepSeek-V2-Lite's offline W1 6.5 s either
# way), Gemma 3's 256 (8 over 4 heads) 0.141 ms against 0.203 with (64, 64, 4, 2)
WIDE_VARLEN_TILES = VarlenTiles(128, 64, 8, 2)
# wider still (576 / 512, DeepSeek's latent widths): one stage, so K and V tiles fit the margin
# fits_in keeps (two compile at 208 KiB and spill less: a candidate for the sweep)
LATENT_VARLEN_TILES = VarlenTiles(64, 32, 8, 1)
# smaller tiles, in order, for when the default does not fit the device's shared memory
FALLBACK_TILES: tuple[VarlenTiles, ...] = (
    VarlenTiles(64, 64, 4, 2),
    VarlenTiles(64, 32, 4, 2),
    VarlenTiles(32, 32, 4, 1),
    VarlenTiles(16, 16, 4, 1),
)


def split_width(d: int) -> tuple[int, int]:
    """The key width as (main block, remainder block): the largest power of two in ``d`` and
    what is left rounded up to a power of two (0: none). Each at least 16 (a ``tl.dot``'s
    least K); the columns past ``d`` are masked at load."""
    if d <= 16:
        return 16, 0
    main = 1 << (d.bit_length() - 1)
    rest = d - main
    return main, (max(16, next_pow2(rest)) if rest else 0)


def default_tiles(d: int, dv: int) -> VarlenTiles:
    """The tiles for keys ``d`` and values ``dv`` wide, by their block widths alone."""
    kw = sum(split_width(d))
    vw = max(16, next_pow2(dv))
    if kw <= 128 and vw <= 128:
        return VARLEN_TILES
    if kw <= 256 and vw <= 256:
        return WIDE_VARLEN_TILES
    return LATENT_VARLEN_TILES


def fits_in(tiles: VarlenTiles, d: int, dv: int, dtype: torch.dtype, smem_bytes: int) -> bool:
    """Whether the Q tile and the pipelined K/V stages fit in ~85% of ``smem_bytes``."""
    kw = sum(split_width(d))
    vw = max(16, next_pow2(dv))
    elem = torch.finfo(dtype).bits // 8
    need = (tiles.block_m * kw + tiles.num_stages * tiles.block_n * (kw + vw)) * elem
    return need <= 0.85 * smem_bytes


def tiles_for(d: int, dv: int, dtype: torch.dtype, smem_bytes: int) -> VarlenTiles:
    """:func:`default_tiles`, or the first of ``FALLBACK_TILES`` that fits ``smem_bytes`` when
    it does not (float32 inputs, smaller GPUs)."""
    tiles = default_tiles(d, dv)
    if fits_in(tiles, d, dv, dtype, smem_bytes):
        return tiles
    fits = (t for t in FALLBACK_TILES if fits_in(t, d, dv, dtype, smem_bytes))
    return next(fits, FALLBACK_TILES[-1])


def choose_tiles(d: int, dv: int, dtype: torch.dtype, device: torch.device) -> VarlenTiles:
    """:func:`tiles_for` the device's shared memory (the interpreter's: a small GPU's)."""
    return tiles_for(d, dv, dtype, max_shared_memory(device))


def _check_tiles(tiles: VarlenTiles) -> None:
    for name in ("block_m", "block_n"):
        n = getattr(tiles, name)
        if n < 16 or n & (n - 1):
            raise ValueError(f"tiles.{name} must be a power of two >= 16, got {n}")
    if tiles.num_warps < 1 or tiles.num_stages < 1:
        raise ValueError(f"tiles need num_warps and num_stages >= 1, got {tiles}")


@triton.jit
def _load(ptrs, row_ok, col_ok, ROWS: tl.constexpr, COLS: tl.constexpr):
    """A tile, zero where a row (``ROWS``) or a column (``COLS``) is out of range; a plain load
    when neither mask applies."""
    if ROWS and COLS:
        return tl.load(ptrs, mask=row_ok[:, None] & col_ok[None, :], other=0.0)
    elif ROWS:
        return tl.load(ptrs, mask=row_ok[:, None], other=0.0)
    elif COLS:
        return tl.load(ptrs, mask=col_ok[None, :], other=0.0)
    else:
        return tl.load(ptrs)


@triton.jit
def _attend(
    q_main, q_rem, m_i, l_i, acc, k_head, v_head, k_main, k_rem, v_offs, start, n0, tok, seq_len,
    s_kt, s_vt, scale_log2e,
    HEAD_DIM: tl.constexpr, D_MAIN: tl.constexpr, D_REM: tl.constexpr, V_DIM: tl.constexpr,
    BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
    DOT_UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """One tile of ``BLOCK_N`` keys from ``n0``: the scores as the two parts' dots summed, the
    online-softmax step, P @ V into ``acc``. ``MASKED`` (the diagonal tiles): keys past each
    row's token are -inf, keys past the sequence load as zeros (their rows belong to the next
    sequence or lie past the tensor). The in-tile offsets (``k_main``, ``k_rem``, ``v_offs``)
    are int32 and loop-invariant; only the tile's base is int64 math."""
    j = n0 + tl.arange(0, BLOCK_N)
    key_ok = j < seq_len
    kb = k_head + (start + n0) * s_kt  # start: int64
    main_ok = tl.arange(0, D_MAIN) < HEAD_DIM
    k = _load(kb + k_main, key_ok, main_ok, MASKED, HEAD_DIM < D_MAIN)
    s = mma(q_main, tl.trans(k), DOT_UPCAST, DOT_PRECISION)  # raw scores: scaled in the exp2
    if D_REM > 0:
        rem_ok = D_MAIN + tl.arange(0, D_REM) < HEAD_DIM
        k2 = _load(kb + k_rem, key_ok, rem_ok, MASKED, HEAD_DIM < D_MAIN + D_REM)
        s += mma(q_rem, tl.trans(k2), DOT_UPCAST, DOT_PRECISION)
    if MASKED:  # a real row's token is below seq_len, so this also hides the keys past it
        s = tl.where(j[None, :] <= tok[:, None], s, float("-inf"))
    # never -inf: every row sees the first key its program walks (key 0, or the first
    # diagonal tile's, at or before the tile's first token), so no -inf - -inf guard is needed
    m_new = tl.maximum(m_i, tl.max(s, 1) * scale_log2e)
    alpha = tl.math.exp2(m_i - m_new)
    p = tl.math.exp2(s * scale_log2e - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v_ok = tl.arange(0, BLOCK_DV) < V_DIM
    v = _load(v_head + (start + n0) * s_vt + v_offs, key_ok, v_ok, MASKED, V_DIM < BLOCK_DV)
    acc = acc * alpha[:, None] + mma(p.to(v.dtype), v, DOT_UPCAST, DOT_PRECISION)
    return m_new, l_i, acc


# the batch's counts and its start offsets (often a slice of a per-step buffer) vary per step:
# not specialized, so a new batch never compiles a new kernel
@triton.jit(do_not_specialize=["qsl_ptr", "num_seqs", "num_tiles"])
def _varlen_kernel(
    q_ptr, k_ptr, v_ptr, qsl_ptr, out_ptr, scale_log2e, num_seqs, num_tiles,
    s_qt, s_qh, s_kt, s_kh, s_vt, s_vh, s_ot, s_oh,
    HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, D_MAIN: tl.constexpr,
    D_REM: tl.constexpr, V_DIM: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, DOT_UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
    ROUND_BF16: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    head = pid % HEADS
    tile = num_tiles - 1 - pid // HEADS
    _seq, seq_start, seq_len, m0 = seq_of_tile(qsl_ptr, num_seqs, tile, BLOCK_M)
    if m0 >= seq_len:
        return
    kvh = head // GROUP
    start = seq_start.to(tl.int64)

    tok = m0 + tl.arange(0, BLOCK_M)
    row_ok = tok < seq_len
    q_base = q_ptr + start * s_qt + head * s_qh
    rows = tok.to(tl.int64)[:, None]  # int64: a long prompt's T * heads * D passes 2**31
    q_rows = rows * s_qt
    cols = tl.arange(0, D_MAIN)
    q_main = _load(q_base + q_rows + cols[None, :], row_ok, cols < HEAD_DIM, True,
                   HEAD_DIM < D_MAIN)  # fmt: skip
    keys = tl.arange(0, BLOCK_N)[:, None]
    k_main = keys * s_kt + cols[None, :]
    q_rem = q_main  # a stand-in the kernel never reads without a remainder
    k_rem = k_main
    if D_REM > 0:
        rem = D_MAIN + tl.arange(0, D_REM)
        q_rem = _load(q_base + q_rows + rem[None, :], row_ok, rem < HEAD_DIM, True,
                      HEAD_DIM < D_MAIN + D_REM)  # fmt: skip
        k_rem = keys * s_kt + rem[None, :]
    dv = tl.arange(0, BLOCK_DV)
    v_offs = keys * s_vt + dv[None, :]
    k_head = k_ptr + kvh * s_kh
    v_head = v_ptr + kvh * s_vh

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    full_end = m0 // BLOCK_N * BLOCK_N  # keys every row of the tile sees
    for n0 in range(0, full_end, BLOCK_N):
        m_i, l_i, acc = _attend(
            q_main, q_rem, m_i, l_i, acc, k_head, v_head, k_main, k_rem, v_offs, start, n0, tok,
            seq_len, s_kt, s_vt, scale_log2e, HEAD_DIM, D_MAIN, D_REM, V_DIM, BLOCK_DV, BLOCK_N,
            False, DOT_UPCAST, DOT_PRECISION,
        )  # fmt: skip
    for n0 in range(full_end, tl.minimum(m0 + BLOCK_M, seq_len), BLOCK_N):
        m_i, l_i, acc = _attend(
            q_main, q_rem, m_i, l_i, acc, k_head, v_head, k_main, k_rem, v_offs, start, n0, tok,
            seq_len, s_kt, s_vt, scale_log2e, HEAD_DIM, D_MAIN, D_REM, V_DIM, BLOCK_DV, BLOCK_N,
            True, DOT_UPCAST, DOT_PRECISION,
        )  # fmt: skip
    out = round_to_bf16(acc / l_i[:, None], ROUND_BF16)
    o_ptrs = out_ptr + start * s_ot + head * s_oh + rows * s_ot + dv[None, :]
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (dv < V_DIM)[None, :])


def varlen_attention(
    q: torch.Tensor,  # [T, Hq, D], the sequences' tokens, concatenated
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, Dv]
    query_start_loc: torch.Tensor,  # [B + 1] int32, prefix sums of the sequences' lengths
    scale: float,
    *,
    out: torch.Tensor | None = None,  # [T, Hq, Dv] to write into
    tiles: VarlenTilesLike | None = None,
) -> torch.Tensor:  # [T, Hq, Dv]
    """Triton version of :func:`kernels.attention.ref_varlen_attention`: causal attention of
    packed sequences over their own tokens, no cache, values of their own width. q, k, v and
    ``out`` may be strided views (any token and head strides; a last dim that is not unit-strided
    is copied). ``tiles`` (a :class:`VarlenTiles` or a plain 4-tuple) overrides
    :func:`choose_tiles`. ``query_start_loc`` is not checked against T here (that would need a
    device sync)."""
    check_varlen(q, k, v, query_start_loc, scale)
    check_tensor("q", q, ndim=3, dtypes=FLOAT_DTYPES, inner_contiguous=False)
    check_tensor("query_start_loc", query_start_loc, ndim=1, dtypes=INDEX_DTYPES)
    device = check_devices(q=q, k=k, v=v, query_start_loc=query_start_loc)
    t, hq, d = q.shape
    hkv, dv = v.shape[1], v.shape[2]
    if max(d, dv) > MAX_HEAD_DIM:
        raise ValueError(f"head widths {d}/{dv}: more than {MAX_HEAD_DIM} is not supported")
    out = check_out(out, (t, hq, dv), q.dtype, device)
    batch = query_start_loc.shape[0] - 1
    if t == 0 or batch == 0:
        return out
    cfg = VarlenTiles(*tiles) if tiles else choose_tiles(d, dv, q.dtype, device)
    _check_tiles(cfg)
    q, k, v = (x if x.stride(2) == 1 else x.contiguous() for x in (q, k, v))
    d_main, d_rem = split_width(d)
    num_tiles = t // cfg.block_m + batch
    _varlen_kernel[(num_tiles * hq,)](
        q, k, v, query_start_loc, out, float(scale) * LOG2E, batch, num_tiles,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1),
        HEADS=hq, GROUP=hq // hkv, HEAD_DIM=d, D_MAIN=d_main, D_REM=d_rem, V_DIM=dv,
        BLOCK_DV=max(16, next_pow2(dv)), BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        DOT_UPCAST=dot_upcast(q.dtype), DOT_PRECISION=dot_precision(q.dtype),
        ROUND_BF16=rounds_bf16_in_kernel(q.dtype),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return out
