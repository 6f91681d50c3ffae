"""The fused Mixture-of-Experts MLP for a few tokens: one GEMV a (token, expert) pair, no grouping.

Same signature and rounding as :func:`kernels.moe.ref_fused_moe` (and
:func:`kernels.triton_moe.fused_moe`, which calls this for few pairs). At decode batch sizes
the grouped kernels' set-up dominates the layer: sorting and padding the ``T * top_k`` pairs by
expert (:func:`kernels.triton_moe.align_to_blocks`) was about fifteen small torch kernels a
layer (one Triton launch now), and ``tl.dot`` wants blocks of 16 rows where each expert holds one or two. On an H200,
Qwen3-30B-A3B's batch-1 decode step spent ~2.3 of its 6.4 ms in that set-up and read the
experts at ~25% of the copy bandwidth. Here, three launches and nothing else:

1. **Gate/up + activation**: a program per pair and ``BLOCK_N`` columns reads its expert's
   gate and up rows (``[BLOCK_N, BLOCK_K]`` tiles, contiguous along K) against the token's row
   of x, accumulates in fp32, adds the biases and applies the activation as the grouped kernel
   does, and writes the pair's row of the ``[T * top_k, I]`` intermediate.
2. **Down + weight**: the same over the intermediate and the expert's down rows, the product
   (plus its bias) times the pair's router weight, to ``[T * top_k, H]``.
3. **Combine**: each token's ``top_k`` rows added in ascending expert order (each program ranks
   the token's expert ids itself: no sort), rounding after each add as the reference does.

FP8 experts (``FP8``) take their scales on each tile's partial sums; int4 ones (``INT4``,
:class:`kernels.moe.Int4Scales`) are dequantized in the tile (:func:`int4_planes`, one group a
tile, each packed word loaded once) to the activation dtype, as the reference's weights, and
multiplied in fp32 plane by plane against x's matching columns (no reshape), their K loops
software-pipelined (``INT4_STAGES``). Act-order int4 experts (``Int4Scales.w13_perm`` /
``w2_perm``: each expert's columns sorted by group at load) read their inputs through
:func:`permuted_rows` first, a row a pair in its expert's column order, so the GEMVs read
them as any int4 expert's (one small launch; gathered in the K loops instead, the
intermediate's too, a Qwen3-30B-A3B layer took 1.6x AWQ's time on an H200).

An expert two tokens route to is read twice (once a pair), which the grouped kernels avoid:
:func:`takes_pairs` says where this path serves (``kernels.bench.moe --tune-pairs`` times both). No host
sync; every size comes from the shapes, so a CUDA graph holds the three launches.

Napkin math (Qwen3-30B-A3B, batch 1, bf16): 8 experts x 3 x 2048 x 768 x 2 B = 75.5 MB a layer;
at 4.2 TB/s that is ~18 us, the floor of the two GEMVs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.moe import ClampedSwiGLU, Fp8Scales, Int4Scales
from kernels.triton_common import next_pow2

# T * top_k pairs up to this, and no more than the experts, take the pair kernels; otherwise
# the grouped ones (kernels.triton_moe). On an H200 (kernels.bench.moe --tune-pairs, bf16 layer
# in a graph): Qwen3-30B-A3B (128 experts, top-8) 25 / 43 / 76 / 124 / 220 us at 1 / 2 / 4 / 8 /
# 16 tokens against the grouped kernels' 100 / 111 / 143 / 203 / 278; Mixtral (8 experts, top-2)
# 197 / 278 / 468 against 287 / 361 / 523 at 1 / 2 / 4 tokens, but 863 against 663 at 8 (16
# pairs on 8 experts: each read twice)
MAX_PAIRS = 128
# (BLOCK_N, BLOCK_K, num_warps) of the gate/up GEMV, and of the down GEMV for up to
# SMALL_DOWN_PAIRS pairs and beyond: the sweep's best at nearly every shape
GATE_UP_TILES = (4, 512, 2)
SMALL_DOWN_TILES = (8, 256, 2)
DOWN_TILES = (32, 256, 4)
SMALL_DOWN_PAIRS = 8
# int4 experts' tiles (BLOCK_K one group of 128, the most a tile may span: 1 KB of packed words
# for 16 rows, four words a thread) and the stages of their K loops' software pipeline (the
# words and scales copied ahead into shared memory): a program's K tiles depend on each other,
# and at batch 1 each SM holds ~6 KB of one K step's words, so without loads ahead the layer
# would wait 16 memory latencies along H = 2048. Not yet timed on a GPU (``kernels.bench.moe
# --tune-pairs`` sweeps both)
INT4_GATE_UP_TILES = (16, 128, 2)
INT4_DOWN_TILES = (16, 128, 2)
INT4_STAGES = 4
COMBINE_BLOCK = 1024
PERMUTE_BLOCK = 1024


def takes_pairs(pairs: int, experts: int) -> bool:
    """Whether ``pairs`` (token, expert) pairs over ``experts`` experts take the pair kernels."""
    return pairs <= min(MAX_PAIRS, experts)


@triton.jit
def _pair_gate_up_kernel(
    x_ptr, w_ptr, b_ptr, s_ptr, z_ptr, out_ptr, ids_ptr, N, K, s_xt, s_we, s_wn, s_be, s_se,
    s_sn, s_sk, SCALE_BN, SCALE_BK, SCALE_UP, s_ot, TOP_K: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr, CLAMPED: tl.constexpr, ALPHA: tl.constexpr,
    LIMIT: tl.constexpr, FP8: tl.constexpr, INT4: tl.constexpr = False,
    EVEN_K: tl.constexpr = False, STAGES: tl.constexpr = None,
):  # fmt: skip
    pair = tl.program_id(0).to(tl.int64)
    token = pair // TOP_K
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    # w13[expert] is [2N, K]: gate rows n, up rows N + n; tiles [BLOCK_N, BLOCK_K], K contiguous
    rows_gate = w_ptr + expert * s_we + offs_n.to(tl.int64) * s_wn
    rows_up = rows_gate + N * s_wn
    w_gate = rows_gate[:, None]
    w_up = rows_up[:, None]
    s_gate = s_ptr + expert * s_se + (offs_n // SCALE_BN).to(tl.int64) * s_sn
    s_up = s_gate + SCALE_UP * s_sn
    # INT4: the zero points laid out as the scales
    z_gate = z_ptr + expert * s_se + (offs_n // SCALE_BN).to(tl.int64) * s_sn
    z_up = z_gate + SCALE_UP * s_sn
    if INT4:  # [BLOCK_N, BLOCK_K / 8] sums (a column per word of the tile), summed after K
        acc_gate = tl.zeros([BLOCK_N, BLOCK_K // 8], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_N, BLOCK_K // 8], dtype=tl.float32)
    else:
        acc_gate = tl.zeros([BLOCK_N], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_N], dtype=tl.float32)
    dt = out_ptr.dtype.element_ty
    for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        if INT4:  # the tile lies in one group along K (the launcher's BLOCK_K)
            kb = k0 // SCALE_BK * s_sk
            xs = int4_x_planes(x_ptr + token * s_xt, k0, K, BLOCK_K, EVEN_K)
            gate = int4_planes(rows_gate, s_gate + kb, z_gate + kb, k0, K, n_mask, dt, BLOCK_K,
                               EVEN_K)  # fmt: skip
            acc_gate = int4_planes_dot(acc_gate, gate, xs)
            up = int4_planes(rows_up, s_up + kb, z_up + kb, k0, K, n_mask, dt, BLOCK_K, EVEN_K)
            acc_up = int4_planes_dot(acc_up, up, xs)
        else:
            ks = k0 + offs_k
            k_mask = ks < K
            a = tl.load(x_ptr + token * s_xt + ks, mask=k_mask, other=0.0).to(tl.float32)
            w_mask = n_mask[:, None] & k_mask[None, :]
            wg = tl.load(w_gate + ks[None, :], mask=w_mask, other=0.0).to(tl.float32)
            wu = tl.load(w_up + ks[None, :], mask=w_mask, other=0.0).to(tl.float32)
            part_gate = tl.sum(wg * a[None, :], axis=1)
            part_up = tl.sum(wu * a[None, :], axis=1)
            if FP8:  # the tile lies in one scale block along K (the launcher's BLOCK_K)
                kb = k0 // SCALE_BK * s_sk
                part_gate *= tl.load(s_gate + kb, mask=n_mask, other=0.0)
                part_up *= tl.load(s_up + kb, mask=n_mask, other=0.0)
            acc_gate += part_gate
            acc_up += part_up
    if INT4:
        acc_gate = tl.sum(acc_gate, axis=1)
        acc_up = tl.sum(acc_up, axis=1)
    # the grouped kernel's epilogue: the projection rounded, the bias added and rounded again,
    # then silu rounded and the product rounded, or the clamped SwiGLU in fp32 rounded once
    gate = acc_gate.to(dt).to(tl.float32)
    up = acc_up.to(dt).to(tl.float32)
    if HAS_BIAS:
        b_gate = b_ptr + expert * s_be + offs_n
        bg = tl.load(b_gate, mask=n_mask, other=0.0).to(tl.float32)
        bu = tl.load(b_gate + N, mask=n_mask, other=0.0).to(tl.float32)
        gate = (gate + bg).to(dt).to(tl.float32)
        up = (up + bu).to(dt).to(tl.float32)
    out = gated_activation(gate, up, dt, CLAMPED, ALPHA, LIMIT)
    tl.store(out_ptr + pair * s_ot + offs_n, out.to(dt), mask=n_mask)


@triton.jit
def int4_planes(w_rows, s_rows, z_rows, k0, K, n_mask, dt: tl.constexpr, BLOCK_K: tl.constexpr,
                EVEN_K: tl.constexpr):  # fmt: skip
    """K columns ``k0 .. k0 + BLOCK_K`` of ``BLOCK_N`` packed int4 rows
    (``kernels.moe.Int4Scales``: eight K columns a word, column ``8p + j`` in nibble ``j`` of
    word ``p``; ``w_rows``: the rows' first words) dequantized with the rows' group (the tile
    inside one group: one scale and zero a row), as eight ``[BLOCK_N, BLOCK_K / 8]`` planes in
    ``dt``: plane ``j`` holds columns ``k0 + 8p + j``. ``(q - z) * s`` in fp32 rounded to
    ``dt``, the reference's weights bit for bit. ``EVEN_K``: K a multiple of BLOCK_K (every
    tile whole; otherwise the words past K are masked).

    Each word is loaded once, the tile contiguous along K (16-byte loads of four words), and
    split into its nibbles in registers. It was loaded once for each of its eight columns,
    gathered (repeated addresses, the grouped kernel's tile transposed across rows): on an
    H200 (``kernels.bench.moe``, Qwen3-30B-A3B's layer in groups of 128, 2026-12-01) 44 / 1170
    / 8308 us at 1 / 16 / 256 tokens against bf16's 25 / 218 / 425. A nibble becomes a float
    without an integer conversion (16 a clock per SM on Hopper, an eighth of fp32's rate): OR-ed
    into the mantissa of 2^23 it is the float ``2^23 + q`` exactly, and ``2^23 + z`` (exact too)
    subtracted leaves ``q - z`` exactly, so the one rounding is the product's, as before."""
    cols = k0 // 8 + tl.arange(0, BLOCK_K // 8)
    mask = n_mask[:, None]
    if not EVEN_K:
        mask = mask & (cols < K // 8)[None, :]
    words = tl.load(w_rows[:, None] + cols[None, :], mask=mask, other=0)
    s = tl.load(s_rows, mask=n_mask, other=0.0)[:, None]
    zb = (tl.load(z_rows, mask=n_mask, other=0).to(tl.float32) + 8388608.0)[:, None]
    return (
        _int4_plane(words, 0, zb, s, dt), _int4_plane(words, 1, zb, s, dt),
        _int4_plane(words, 2, zb, s, dt), _int4_plane(words, 3, zb, s, dt),
        _int4_plane(words, 4, zb, s, dt), _int4_plane(words, 5, zb, s, dt),
        _int4_plane(words, 6, zb, s, dt), _int4_plane(words, 7, zb, s, dt),
    )  # fmt: skip


@triton.jit
def _int4_plane(words, J: tl.constexpr, zb, s, dt: tl.constexpr):
    """Nibble ``J`` of int32 ``words`` as ``(q - z) * s`` rounded to ``dt`` (``zb``: 2^23 + z)."""
    bits = ((words >> (4 * J)) & 0xF) | 0x4B000000  # arithmetic shift: the mask drops the sign
    return ((bits.to(tl.float32, bitcast=True) - zb) * s).to(dt)


@triton.jit
def int4_tile(w_rows, s_rows, z_rows, k0, K, n_mask, dt: tl.constexpr, BLOCK_K: tl.constexpr,
              EVEN_K: tl.constexpr):  # fmt: skip
    """:func:`int4_planes` as one ``[BLOCK_N, BLOCK_K]`` tile in ``dt``, columns in order (for
    ``tl.dot``): the planes joined into ``[BLOCK_N, BLOCK_K / 8, 2, 2, 2]`` (the last three
    indices ``a, b, c`` of nibble ``4a + 2b + c``; each thread holds a word's eight values, so
    the reshape moves nothing)."""
    p = int4_planes(w_rows, s_rows, z_rows, k0, K, n_mask, dt, BLOCK_K, EVEN_K)
    low = tl.join(tl.join(p[0], p[4]), tl.join(p[2], p[6]))  # [BN, BK/8, a, b]: 4a + 2b
    high = tl.join(tl.join(p[1], p[5]), tl.join(p[3], p[7]))  # 4a + 2b + 1
    return tl.reshape(tl.join(low, high), [low.shape[0], BLOCK_K])


@triton.jit
def int4_x_planes(x_row, k0, K, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    """A row of x's columns ``k0 + 8p + j`` as eight ``[BLOCK_K / 8]`` float32 planes, to meet
    :func:`int4_planes`' plane ``j`` (strided loads of a short row: L1 serves them)."""
    x = x_row + k0 + 8 * tl.arange(0, BLOCK_K // 8)
    mask, other = None, None
    if not EVEN_K:
        mask, other = k0 + 8 * tl.arange(0, BLOCK_K // 8) < K, 0.0
    return (
        tl.load(x, mask=mask, other=other).to(tl.float32),
        tl.load(x + 1, mask=mask, other=other).to(tl.float32),
        tl.load(x + 2, mask=mask, other=other).to(tl.float32),
        tl.load(x + 3, mask=mask, other=other).to(tl.float32),
        tl.load(x + 4, mask=mask, other=other).to(tl.float32),
        tl.load(x + 5, mask=mask, other=other).to(tl.float32),
        tl.load(x + 6, mask=mask, other=other).to(tl.float32),
        tl.load(x + 7, mask=mask, other=other).to(tl.float32),
    )


@triton.jit
def int4_planes_dot(acc, planes, xs):
    """``acc`` (``[BLOCK_N, BLOCK_K / 8]`` float32) plus each plane times its columns of x: a
    GEMV's products without putting the planes' columns in order (no reshape)."""
    for j in tl.static_range(8):
        acc += planes[j].to(tl.float32) * xs[j][None, :]
    return acc


@triton.jit
def gated_activation(gate, up, dt: tl.constexpr, CLAMPED: tl.constexpr, ALPHA: tl.constexpr,
                     LIMIT: tl.constexpr):  # fmt: skip
    """The experts' activation of the rounded (and biased) gate and up projections, fp32 out
    (the caller rounds it to ``dt``): ``silu(gate)`` rounded to ``dt`` times up, or gpt-oss's
    clamped SwiGLU in fp32 (gate clamped from above only). The grouped and the pair kernels'."""
    if CLAMPED:
        gate = tl.minimum(gate, LIMIT)
        up = tl.minimum(tl.maximum(up, -LIMIT), LIMIT)
        out = (up + 1.0) * tl.div_rn(gate, 1.0 + tl.exp(-(gate * ALPHA)))
    else:
        act = tl.div_rn(gate, 1.0 + tl.exp(-gate)).to(dt).to(tl.float32)
        out = act * up
    return out


@triton.jit
def _pair_down_kernel(
    a_ptr, w_ptr, b_ptr, s_ptr, z_ptr, out_ptr, ids_ptr, weights_ptr, N, K, s_at, s_we, s_wn,
    s_be, s_se, s_sn, s_sk, SCALE_BN, SCALE_BK, s_ot, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr, FP8: tl.constexpr, INT4: tl.constexpr = False,
    EVEN_K: tl.constexpr = False, STAGES: tl.constexpr = None,
):  # fmt: skip
    pair = tl.program_id(0).to(tl.int64)
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    rows = w_ptr + expert * s_we + offs_n.to(tl.int64) * s_wn
    w_rows = rows[:, None]
    s_rows = s_ptr + expert * s_se + (offs_n // SCALE_BN).to(tl.int64) * s_sn
    z_rows = z_ptr + expert * s_se + (offs_n // SCALE_BN).to(tl.int64) * s_sn
    if INT4:  # as the gate/up kernel's: a column per word of the tile, summed after K
        acc = tl.zeros([BLOCK_N, BLOCK_K // 8], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    dt = out_ptr.dtype.element_ty
    for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        if INT4:
            kb = k0 // SCALE_BK * s_sk
            xs = int4_x_planes(a_ptr + pair * s_at, k0, K, BLOCK_K, EVEN_K)
            w = int4_planes(rows, s_rows + kb, z_rows + kb, k0, K, n_mask, dt, BLOCK_K, EVEN_K)
            acc = int4_planes_dot(acc, w, xs)
        else:
            ks = k0 + offs_k
            k_mask = ks < K
            a = tl.load(a_ptr + pair * s_at + ks, mask=k_mask, other=0.0).to(tl.float32)
            w_mask = n_mask[:, None] & k_mask[None, :]
            w = tl.load(w_rows + ks[None, :], mask=w_mask, other=0.0)
            part = tl.sum(w.to(tl.float32) * a[None, :], axis=1)
            if FP8:
                part *= tl.load(s_rows + k0 // SCALE_BK * s_sk, mask=n_mask, other=0.0)
            acc += part
    if INT4:
        acc = tl.sum(acc, axis=1)
    down = acc.to(dt).to(tl.float32)  # the projection rounded
    if HAS_BIAS:  # then the bias added and rounded again
        bias = tl.load(b_ptr + expert * s_be + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        down = (down + bias).to(dt).to(tl.float32)
    weight = tl.load(weights_ptr + pair).to(tl.float32)
    tl.store(out_ptr + pair * s_ot + offs_n, (down * weight).to(dt), mask=n_mask)


@triton.jit
def _ordered_combine_kernel(
    c_ptr, ids_ptr, out_ptr, H, s_ct, s_ot, TOP_K: tl.constexpr, TOP_K_P2: tl.constexpr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < H
    # each slot's place in ascending expert order (ties, which top-k never makes, by slot)
    js = tl.arange(0, TOP_K_P2)
    ids = tl.load(ids_ptr + t * TOP_K + js, mask=js < TOP_K, other=2147483647).to(tl.int64)
    before = (ids[None, :] < ids[:, None]) | (
        (ids[None, :] == ids[:, None]) & (js[None, :] < js[:, None])
    )
    rank = tl.sum(before.to(tl.int32), axis=1)  # [TOP_K_P2]
    dt = out_ptr.dtype.element_ty
    row = c_ptr + t * TOP_K * s_ct + offs
    first = tl.sum(tl.where(rank == 0, js, 0))
    acc = tl.load(row + first * s_ct, mask=mask, other=0.0).to(tl.float32)
    for r in tl.static_range(1, TOP_K):
        j = tl.sum(tl.where(rank == r, js, 0))
        nxt = tl.load(row + j * s_ct, mask=mask, other=0.0).to(tl.float32)
        acc = (acc + nxt).to(dt).to(tl.float32)  # as index_add_ in the activation dtype
    tl.store(out_ptr + t * s_ot + offs, acc.to(dt), mask=mask)


@triton.jit
def _permuted_rows_kernel(
    src_ptr, perm_ptr, ids_ptr, out_ptr, K, s_src, s_pe, s_out, TOP_K: tl.constexpr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    pair = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < K
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    feature = tl.load(perm_ptr + expert * s_pe + cols, mask=mask, other=0).to(tl.int64)
    value = tl.load(src_ptr + (pair // TOP_K) * s_src + feature, mask=mask)
    tl.store(out_ptr + pair * s_out + cols, value, mask=mask)


def permuted_rows(
    src: torch.Tensor,  # [R, K]
    perm: torch.Tensor,  # [E, K] int32/int64
    ids: torch.Tensor,  # [P]: each row's expert, contiguous
    top_k: int,  # row p reads src[p // top_k]
) -> torch.Tensor:  # [P, K]
    """:func:`kernels.moe.ref_permuted_rows`: each pair's input row in its act-order expert's
    column order (x's for the gate/up GEMMs, with ``top_k`` the token's pairs; the
    intermediate's, a row a pair, for the down ones). A program a row and ``PERMUTE_BLOCK``
    columns; bytes: two reads (the permutation, the row) and a write of ``P * K``."""
    p, k = ids.numel(), src.shape[1]
    out = torch.empty((p, k), dtype=src.dtype, device=src.device)
    if p == 0 or k == 0:
        return out
    block = min(PERMUTE_BLOCK, next_pow2(k))
    _permuted_rows_kernel[(p, triton.cdiv(k, block))](
        src, perm, ids, out, k, src.stride(0), perm.stride(0), out.stride(0), TOP_K=top_k,
        BLOCK=block,
    )  # fmt: skip
    return out


def act_order_inputs(
    x: torch.Tensor, int4: Int4Scales | None, ids: torch.Tensor, top_k: int
) -> tuple[torch.Tensor, int]:
    """The gate/up launch's rows of x and its ``TOP_K``: x itself, or for act-order int4
    experts (``w13_perm``) a row a pair in its expert's column order (:func:`permuted_rows`;
    ``ids``: the pairs' experts, ``[T, top_k]`` contiguous, pair ``t * top_k + j``)."""
    if int4 is None or int4.w13_perm is None:
        return x, top_k
    return permuted_rows(x, int4.w13_perm, ids.view(-1), top_k), 1


def act_order_intermediate(
    inter: torch.Tensor, int4: Int4Scales | None, ids: torch.Tensor
) -> torch.Tensor:
    """The down launch's input: the ``[P, I]`` intermediate, in each pair's expert's column
    order for act-order int4 experts whose ``w2_perm`` is kept (``Experts.finish_loading``
    folds it into gate_up's rows, so a served model has none)."""
    if int4 is None or int4.w2_perm is None:
        return inter
    return permuted_rows(inter, int4.w2_perm, ids.view(-1), 1)


def scale_args(
    w: torch.Tensor, scale: torch.Tensor | None, blocks: tuple[int, int] | None
) -> tuple[torch.Tensor, int, int, int, int, int]:
    """(pointer, expert / row / column strides, block_n, block_k) of an FP8 weight's scales
    (an int4 weight's: blocks of one row and a group); placeholders (the weight, block 1) for a
    float weight (the grouped kernels' too)."""
    if scale is None or blocks is None:
        return w, 0, 0, 0, 1, 1
    return scale, scale.stride(0), scale.stride(1), scale.stride(2), blocks[0], blocks[1]


def quant_args(
    w: torch.Tensor, fp8: Fp8Scales | None, int4: Int4Scales | None, k: int, up: bool
) -> tuple[tuple[torch.Tensor, int, int, int, int, int], torch.Tensor]:
    """:func:`scale_args` of ``w`` (w13 with ``up``, else w2; ``k`` its input features) under
    FP8 scales or int4 groups, and the int4 zero points' pointer (the scales' strides; the
    weight as a placeholder otherwise)."""
    if int4 is not None:
        scale, zeros = (int4.w13_scale, int4.w13_zeros) if up else (int4.w2_scale, int4.w2_zeros)
        return scale_args(w, scale, (1, int4.group(k))), zeros
    if fp8 is not None:
        scale = fp8.w13_scale if up else fp8.w2_scale
        return scale_args(w, scale, fp8.blocks(k)), w
    return scale_args(w, None, None), w


def within_scale_block(block_k: int, scale_k: int, k: int) -> int:
    """A K tile inside one FP8 scale block ``scale_k`` wide: halved until it divides the block,
    unless one block covers all of K."""
    while scale_k < k and scale_k % block_k:
        block_k //= 2
    return block_k


def _k_tile(block_k: int, k: int, scale_k: int | None) -> int:
    """A K tile no wider than K's next power of two and, for FP8 weights (``scale_k``: their
    scale blocks' width), inside one scale block."""
    block_k = min(block_k, next_pow2(k))
    return block_k if scale_k is None else within_scale_block(block_k, scale_k, k)


def _int4_args(
    int4: Int4Scales | None, k: int, block_k: int, stages: int | None
) -> dict[str, bool | int]:
    """An int4 launch's constexprs: whether its K tiles are all whole, and its K loop pipelined
    (``stages``, else ``INT4_STAGES``; the loop holds no ``tl.dot``, which Triton pipelines
    unasked). None for float and FP8 weights: their kernels compile as before."""
    if int4 is None:
        return {}
    return {"EVEN_K": k % block_k == 0, "STAGES": stages or INT4_STAGES}


def fused_moe_pairs(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2I, H]: gate rows, then up rows
    w2: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # [T, top_k] float
    topk_ids: torch.Tensor,  # [T, top_k] int32/int64, in [0, E)
    *,
    b13: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
    clamp: ClampedSwiGLU | None = None,
    fp8: Fp8Scales | None = None,
    int4: Int4Scales | None = None,
    tiles: tuple[tuple[int, int, int], tuple[int, int, int]] | None = None,
    stages: int | None = None,
) -> torch.Tensor:  # [T, H]
    """:func:`kernels.moe.ref_fused_moe` a pair at a time; its arguments checked by the caller
    (:func:`kernels.triton_moe.fused_moe`). ``tiles``: (gate/up, down) ``(BLOCK_N, BLOCK_K,
    num_warps)``, and ``stages`` the int4 K loops' software pipeline (``INT4_STAGES`` when
    None), for tests and tuning."""
    t, h = x.shape
    inter = w13.shape[1] // 2
    top_k = topk_ids.shape[1]
    pairs = t * top_k
    out = torch.empty((t, h), dtype=x.dtype, device=x.device)
    ids = topk_ids.contiguous()
    weights = topk_weights.contiguous()
    if int4 is not None:
        served = INT4_GATE_UP_TILES, INT4_DOWN_TILES
    else:
        served = GATE_UP_TILES, SMALL_DOWN_TILES if pairs <= SMALL_DOWN_PAIRS else DOWN_TILES
    (bn1, bk1, warps1), (bn2, bk2, warps2) = tiles or served
    inter_act = torch.empty((pairs, inter), dtype=x.dtype, device=x.device)  # [P, I]
    quant = fp8 is not None or int4 is not None
    s13, z13 = quant_args(w13, fp8, int4, h, True)
    bn1 = min(bn1, next_pow2(inter))
    bk1 = _k_tile(bk1, h, s13[5] if quant else None)
    rows, rows_top_k = act_order_inputs(x, int4, ids, top_k)
    _pair_gate_up_kernel[(pairs, triton.cdiv(inter, bn1))](
        rows, w13, w13 if b13 is None else b13, s13[0], z13, inter_act, ids, inter, h,
        rows.stride(0), w13.stride(0), w13.stride(1), 0 if b13 is None else b13.stride(0),
        *s13[1:], -(-inter // s13[4]), inter_act.stride(0), TOP_K=rows_top_k, BLOCK_N=bn1,
        BLOCK_K=bk1,
        HAS_BIAS=b13 is not None, CLAMPED=clamp is not None,
        ALPHA=float(clamp.alpha) if clamp else 0.0, LIMIT=float(clamp.limit) if clamp else 0.0,
        FP8=fp8 is not None, INT4=int4 is not None, num_warps=warps1,
        **_int4_args(int4, h, bk1, stages),
    )  # fmt: skip
    contrib = torch.empty((pairs, h), dtype=x.dtype, device=x.device)  # [P, H], token-major
    s2, z2 = quant_args(w2, fp8, int4, inter, False)
    bn2 = min(bn2, next_pow2(h))
    bk2 = _k_tile(bk2, inter, s2[5] if quant else None)
    inter_act = act_order_intermediate(inter_act, int4, ids)
    _pair_down_kernel[(pairs, triton.cdiv(h, bn2))](
        inter_act, w2, w2 if b2 is None else b2, s2[0], z2, contrib, ids, weights, h, inter,
        inter_act.stride(0), w2.stride(0), w2.stride(1), 0 if b2 is None else b2.stride(0),
        *s2[1:], contrib.stride(0), BLOCK_N=bn2, BLOCK_K=bk2, HAS_BIAS=b2 is not None,
        FP8=fp8 is not None, INT4=int4 is not None, num_warps=warps2,
        **_int4_args(int4, inter, bk2, stages),
    )  # fmt: skip
    block = min(COMBINE_BLOCK, next_pow2(h))
    _ordered_combine_kernel[(t, triton.cdiv(h, block))](
        contrib, ids, out, h, contrib.stride(0), out.stride(0), TOP_K=top_k,
        TOP_K_P2=max(2, next_pow2(top_k)), BLOCK=block,
    )  # fmt: skip
    return out
