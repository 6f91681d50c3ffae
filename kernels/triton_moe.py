"""The fused Mixture-of-Experts MLP in Triton: tokens grouped by expert, two grouped GEMMs.

Same signature and rounding as :func:`kernels.moe.ref_fused_moe`. A grouping, then three Triton
launches; no host sync anywhere (so a CUDA graph can hold them: every size is known from
the shapes alone):

1. **Group** (:func:`align_to_blocks`: one launch of ``_align_kernel``, torch's sort for more
   than ``ALIGN_MAX_PAIRS``): the ``T * top_k`` (token, slot) pairs are
   sorted by expert and each expert's run is padded to a multiple of ``BLOCK_M``, so every block
   of ``BLOCK_M`` rows belongs to one expert. ``block_expert`` names it (-1: a block past the last
   expert's run, which exits at once). Experts that receive no token own no block.
2. **Gate/up + activation**: each program multiplies one block of rows of x (gathered through
   the sorted pair ids) by ``BLOCK_N`` columns of its expert's gate and up weights, adds its
   expert's gate and up biases (``HAS_BIAS``), applies ``silu(gate) * up`` or gpt-oss's clamped
   SwiGLU (``CLAMPED``) in registers and writes the ``[T * top_k, I]`` intermediate.
3. **Down + weight**: the same grouping over the intermediate and the expert's down projection;
   the product plus the expert's down bias (``HAS_BIAS``), times the pair's router weight, goes
   to ``[T * top_k, H]``.
4. **Combine**: each token's ``top_k`` rows added in ascending expert order (the launcher sorts
   each token's experts first), rounding after each add as transformers' ``index_add_`` does.

**FP8 experts** (``FP8``, constexpr; :class:`kernels.moe.Fp8Scales`): e4m3 weight tiles are
loaded (1 byte an element: half the bytes of bf16, the whole cost of decode), converted to the
activation dtype (exact: every e4m3 value is a bf16 and an fp16 value) for ``tl.dot``, and the
tile's product times its columns' scales is added to the accumulator: weight-only, as the dense
FP8 GEMM of ``kernels.triton_quant``. A K tile never straddles two scale blocks (``BLOCK_K``
divides ``block_k``), so one scale per output column and tile; per-channel scales are one block
as wide as K. Against the reference (weights dequantized, rounded to the activation dtype, then
multiplied) the kernel skips that rounding of the weights: products differ by at most half an
ulp of a weight each.

**Int4 experts** (``INT4``, constexpr; :class:`kernels.moe.Int4Scales`: AWQ's and GPTQ's w4a16
converted at load to eight K columns a word, one row of words per output row, float32 scales
and uint8 zero points per row and group): each K tile's words are loaded once, ``[BLOCK_N,
BLOCK_K / 8]`` contiguous along K, their nibbles split in registers,
``(q - z) * s`` computed in fp32 with the tile's one scale and zero a row (a K tile never
straddles two groups: ``BLOCK_K`` divides the group) and rounded to the activation dtype, the
eight planes joined into ``[BLOCK_N, BLOCK_K]`` and transposed for ``tl.dot``
(:func:`kernels.triton_moe_pairs.int4_tile`, which the pair kernels share): the very weights
the reference (and a model whose experts were dequantized at load) multiplies. A quarter of
bf16's bytes, plus 5 bytes a row and group (0.3 bit a weight in groups of 128). In the Hopper
code of the (16, 64, 128, 4) launch the words arrive in 16-byte copies to shared memory,
pipelined as the float tiles are, and the joined tile is already in the layout of ``mma``'s
second operand (no conversion through shared memory). Each word was loaded once per column it
holds before (gathered, transposed): 8308 us against bf16's 425 at 256 tokens on an H200.
Act-order int4 experts (``Int4Scales.w13_perm``) read rows of
:func:`kernels.triton_moe_pairs.permuted_rows` (a row a pair in its expert's column order)
with ``TOP_K`` 1: gathering the A tile through the permutation inside the K loop instead took
1.66x AWQ's time at 256 tokens on an H200.

``HAS_BIAS`` and ``CLAMPED`` are constexpr (the clamp's constants too), so a model without biases
runs exactly the kernels it ran before they existed.

Napkin math: at batch 1 the layer reads ``top_k`` experts' weights once (3 * H * I elements
each) and does 2 FLOP per element: bandwidth-bound, like a GEMV, with 1/``BLOCK_M`` of the rows
of each block real. At large batch each expert sees ``T * top_k / E`` rows on average: a grouped
GEMM bound by FLOPs (``6 * T * top_k * H * I``), wasting at most ``BLOCK_M - 1`` padded rows
per expert.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import triton_moe_pairs
from kernels.moe import (
    ClampedSwiGLU,
    Fp8Scales,
    Int4Scales,
    check_fp8_scales,
    check_int4_scales,
    check_moe_shapes,
    int4_scales_of,
    scales_of,
    sort_by_expert,
)
from kernels.triton_common import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_devices,
    check_tensor,
    dot_precision,
    dot_upcast,
    mma,
    next_pow2,
)
from kernels.triton_moe_pairs import (
    act_order_inputs,
    act_order_intermediate,
    fused_moe_pairs,
    gated_activation,
    int4_tile,
    quant_args,
    within_scale_block,
)

# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps); BLOCK_M chosen per call from the rows per expert
DEFAULT_TILES = (64, 64, 4)  # (BLOCK_N, BLOCK_K, num_warps)
# int4 experts: K tiles of one group of 128 (half the steps of 64, and 16-byte loads of four
# words a thread); not yet timed on a GPU (kernels.bench.moe sweeps the tiles)
INT4_TILES = (64, 128, 4)
# the least K tile whose int4 weights are joined from their nibble planes (int4_tile); narrower
# ones (groups of 16 or 32 bound the tile) are gathered a column at a time
# (int4_tile_gathered): on an H200 a bf16 launch with K tiles of 16 (groups of 48) gave wrong
# sums through the joined tile (tests/kernels/test_triton_moe.py, 2026-12-01) while tiles of 64
# and 128 were right (kernels.bench.moe checks every launch); 32 was not run there
INT4_JOINED_MIN_K = tl.constexpr(64)
COMBINE_BLOCK = 1024


def pick_block_m(pairs: int, experts: int) -> int:
    """Rows per block: 16 (tl.dot's least) while experts see few rows each (decode), more as the
    average run grows, so fewer padded rows are multiplied than real ones."""
    avg = pairs / max(experts, 1)
    return 16 if avg <= 16 else 32 if avg <= 64 else 64


# the alignment kernel's pairs a step (its [CHUNK, CHUNK] same-expert comparison in registers),
# its blocks a step (a [BLOCKS, E] comparison: 32 registers a thread at 256 experts), and the most
# pairs it takes: one program walks them all, twice; more go through torch's sort
ALIGN_CHUNK = 64
ALIGN_BLOCKS = 16
ALIGN_MAX_PAIRS = 8192


@triton.jit(do_not_specialize=["num_pairs", "size"])
def _align_kernel(
    ids_ptr, pairs_ptr, block_expert_ptr, num_pairs, size, NUM_EXPERTS: tl.constexpr,
    E_PAD: tl.constexpr, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr, BLOCKS: tl.constexpr,
):  # fmt: skip
    """:func:`ref_align_to_blocks` in one program: the experts' counts (histograms of the ids,
    masked lanes left out), their runs padded to BLOCK_M and laid end to end (a cumulative
    sum), each block's expert (the runs ending at or before its first row), the sentinel
    everywhere, then each pair stored at its run's next free row: its rank among the chunk's
    earlier pairs of its expert (a [CHUNK, CHUNK] comparison) plus the rows earlier chunks
    took, kept in registers (``tl.gather`` of the expert's counter)."""
    offs_c = tl.arange(0, CHUNK)
    counts = tl.zeros([E_PAD], tl.int32)
    for p0 in range(0, num_pairs, CHUNK):
        mask = p0 + offs_c < num_pairs
        e = tl.load(ids_ptr + p0 + offs_c, mask=mask, other=0).to(tl.int32)
        counts += tl.histogram(e, E_PAD, mask=mask)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M  # bins past the experts count 0
    end = tl.cumsum(padded, 0)  # [E_PAD]: past the experts, the total
    for b0 in range(0, size // BLOCK_M, BLOCKS):
        blocks = b0 + tl.arange(0, BLOCKS)
        expert = tl.sum((end[None, :] <= (blocks * BLOCK_M)[:, None]).to(tl.int32), 1)
        expert = tl.where(expert < NUM_EXPERTS, expert, -1)
        tl.store(block_expert_ptr + blocks, expert, mask=blocks < size // BLOCK_M)
    for r0 in range(0, size, CHUNK):
        tl.store(pairs_ptr + r0 + offs_c, num_pairs, mask=r0 + offs_c < size)
    tl.debug_barrier()  # every sentinel written before any pair overwrites its row
    nxt = end - padded  # each expert's next free row
    earlier = offs_c[None, :] < offs_c[:, None]  # [CHUNK, CHUNK]: j before i
    for p0 in range(0, num_pairs, CHUNK):
        mask = p0 + offs_c < num_pairs
        e = tl.load(ids_ptr + p0 + offs_c, mask=mask, other=0).to(tl.int32)
        same = (e[None, :] == e[:, None]) & earlier & mask[None, :]
        rank = tl.sum(same.to(tl.int32), 1)
        row = tl.gather(nxt, e, 0) + rank
        tl.store(pairs_ptr + row, p0 + offs_c, mask=mask)
        nxt += tl.histogram(e, E_PAD, mask=mask)


def align_to_blocks(
    topk_ids: torch.Tensor,  # [T, top_k], each row ascending
    num_experts: int,
    block_m: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # ([P_pad] int32 pair ids, [P_pad / BLOCK_M] int32 experts)
    """:func:`ref_align_to_blocks` through one launch of the alignment kernel for up to
    :data:`ALIGN_MAX_PAIRS` pairs (a decode step: torch's sort and the dozen small kernels
    around it took ~40 us a layer at DeepSeek-V2-Lite's batch 64 on an H200), torch's beyond."""
    pairs = topk_ids.numel()
    if pairs > ALIGN_MAX_PAIRS or pairs == 0:
        return ref_align_to_blocks(topk_ids, num_experts, block_m)
    size = triton.cdiv(pairs + min(num_experts, pairs) * (block_m - 1), block_m) * block_m
    dev = topk_ids.device
    sorted_pairs = torch.empty((size,), dtype=torch.int32, device=dev)
    block_expert = torch.empty((size // block_m,), dtype=torch.int32, device=dev)
    _align_kernel[(1,)](
        topk_ids.reshape(-1), sorted_pairs, block_expert, pairs, size,
        NUM_EXPERTS=num_experts, E_PAD=next_pow2(num_experts), BLOCK_M=block_m,
        CHUNK=ALIGN_CHUNK, BLOCKS=ALIGN_BLOCKS, num_warps=4,
    )  # fmt: skip
    return sorted_pairs, block_expert


def ref_align_to_blocks(
    topk_ids: torch.Tensor,  # [T, top_k], each row ascending
    num_experts: int,
    block_m: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # ([P_pad] int32 pair ids, [P_pad / BLOCK_M] int32 experts)
    """The pairs ``t * top_k + j`` sorted by expert, each expert's run padded with the sentinel
    ``T * top_k`` to a multiple of ``block_m``; and each block's expert (-1 past the end).
    The padded length is the most any routing can need: P + min(E, P) * (block_m - 1)."""
    flat = topk_ids.reshape(-1).long()  # [P]
    pairs, dev = flat.numel(), flat.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # no bincount: it syncs on CUDA
    padded = (counts + block_m - 1) // block_m * block_m  # [E]
    padded_end = padded.cumsum(0)  # [E]
    order = torch.argsort(flat, stable=True)  # [P] pair ids, grouped by expert
    expert_of = flat[order]
    rank = torch.arange(pairs, device=dev) - (counts.cumsum(0) - counts)[expert_of]
    dest = (padded_end - padded)[expert_of] + rank
    size = triton.cdiv(pairs + min(num_experts, pairs) * (block_m - 1), block_m) * block_m
    sorted_pairs = torch.full((size,), pairs, dtype=torch.int32, device=dev)
    sorted_pairs[dest] = order.to(torch.int32)
    starts = torch.arange(0, size, block_m, device=dev)
    block_expert = torch.searchsorted(padded_end, starts, right=True)  # E past the last run
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return sorted_pairs, block_expert


@triton.jit(do_not_specialize=["num_pairs"])  # one compilation for every batch size
def _gate_up_kernel(
    x_ptr, w_ptr, b_ptr, s_ptr, z_ptr, out_ptr, pairs_ptr, block_expert_ptr, num_pairs, N, K,
    s_xt, s_we, s_wn, s_be, s_se, s_sn, s_sk, SCALE_BN, SCALE_BK, SCALE_UP, s_ot,
    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr, HAS_BIAS: tl.constexpr,
    CLAMPED: tl.constexpr, ALPHA: tl.constexpr, LIMIT: tl.constexpr, FP8: tl.constexpr,
    INT4: tl.constexpr = False, EVEN_K: tl.constexpr = False,
):  # fmt: skip
    pid_m = tl.program_id(0)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if expert < 0:
        return
    pair = tl.load(pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    m_mask = pair < num_pairs
    token = pair // TOP_K
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    # w13[expert] is [2N, K]: gate rows n, up rows N + n; tiles loaded as [BLOCK_K, BLOCK_N]
    rows_gate = w_ptr + expert * s_we + offs_n.to(tl.int64) * s_wn
    rows_up = rows_gate + N * s_wn
    w_gate = rows_gate[None, :]
    w_up = rows_up[None, :]
    # FP8: each column's scale row (the gate's blocks, then the up's from SCALE_UP on)
    s_gate = s_ptr + expert * s_se + (offs_n // SCALE_BN).to(tl.int64) * s_sn
    s_up = s_gate + SCALE_UP * s_sn
    z_gate = z_ptr + expert * s_se + (offs_n // SCALE_BN).to(tl.int64) * s_sn  # INT4's zeros
    z_up = z_gate + SCALE_UP * s_sn
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + offs_k
        k_mask = ks < K
        a = tl.load(x_ptr + token[:, None] * s_xt + ks[None, :],
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0)  # fmt: skip
        w_mask = k_mask[:, None] & n_mask[None, :]
        if INT4:  # dequantized in the tile (inside one group) to x's dtype, as the reference
            kb = k0 // SCALE_BK * s_sk
            xt = a.dtype
            if BLOCK_K >= INT4_JOINED_MIN_K:
                wg = tl.trans(int4_tile(rows_gate, s_gate + kb, z_gate + kb, k0, K, n_mask, xt,
                                        BLOCK_K, EVEN_K))  # fmt: skip
                wu = tl.trans(int4_tile(rows_up, s_up + kb, z_up + kb, k0, K, n_mask, xt,
                                        BLOCK_K, EVEN_K))  # fmt: skip
            else:
                wg = int4_tile_gathered(w_gate, s_gate + kb, z_gate + kb, ks, w_mask, n_mask, xt)
                wu = int4_tile_gathered(w_up, s_up + kb, z_up + kb, ks, w_mask, n_mask, xt)
            acc_gate += mma(a, wg, UPCAST, PRECISION)
            acc_up += mma(a, wu, UPCAST, PRECISION)
        elif FP8:  # e4m3 -> the activation dtype is exact; the scales on the tile's product
            wg = tl.load(w_gate + ks[:, None], mask=w_mask, other=0.0)
            wu = tl.load(w_up + ks[:, None], mask=w_mask, other=0.0)
            kb = k0 // SCALE_BK * s_sk
            sg = tl.load(s_gate + kb, mask=n_mask, other=0.0)
            su = tl.load(s_up + kb, mask=n_mask, other=0.0)
            acc_gate += mma(a, wg.to(a.dtype), UPCAST, PRECISION) * sg[None, :]
            acc_up += mma(a, wu.to(a.dtype), UPCAST, PRECISION) * su[None, :]
        else:
            wg = tl.load(w_gate + ks[:, None], mask=w_mask, other=0.0)
            wu = tl.load(w_up + ks[:, None], mask=w_mask, other=0.0)
            acc_gate += mma(a, wg, UPCAST, PRECISION)
            acc_up += mma(a, wu, UPCAST, PRECISION)
    dt = out_ptr.dtype.element_ty
    # as the reference: the projection rounded, the bias added and rounded again, then silu
    # rounded and the product rounded, or the clamped SwiGLU in fp32 rounded once
    gate = acc_gate.to(dt).to(tl.float32)
    up = acc_up.to(dt).to(tl.float32)
    if HAS_BIAS:  # b13[expert] is [2N]: gate half, then up half
        b_gate = b_ptr + expert * s_be + offs_n
        bg = tl.load(b_gate, mask=n_mask, other=0.0).to(tl.float32)
        bu = tl.load(b_gate + N, mask=n_mask, other=0.0).to(tl.float32)
        gate = (gate + bg).to(dt).to(tl.float32)
        up = (up + bu).to(dt).to(tl.float32)
    out = gated_activation(gate, up, dt, CLAMPED, ALPHA, LIMIT)
    out_ptrs = out_ptr + pair[:, None] * s_ot + offs_n[None, :]
    tl.store(out_ptrs, out.to(dt), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit(do_not_specialize=["num_pairs"])
def _down_kernel(
    a_ptr, w_ptr, b_ptr, s_ptr, z_ptr, out_ptr, pairs_ptr, block_expert_ptr, weights_ptr,
    num_pairs, N, K, s_at, s_we, s_wn, s_be, s_se, s_sn, s_sk, SCALE_BN, SCALE_BK, s_ot,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr,
    PRECISION: tl.constexpr, HAS_BIAS: tl.constexpr, FP8: tl.constexpr,
    INT4: tl.constexpr = False, EVEN_K: tl.constexpr = False,
):  # fmt: skip
    pid_m = tl.program_id(0)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if expert < 0:
        return
    pair = tl.load(pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    m_mask = pair < num_pairs
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    rows = w_ptr + expert * s_we + offs_n.to(tl.int64) * s_wn
    w_rows = rows[None, :]
    s_rows = s_ptr + expert * s_se + (offs_n // SCALE_BN).to(tl.int64) * s_sn
    z_rows = z_ptr + expert * s_se + (offs_n // SCALE_BN).to(tl.int64) * s_sn  # INT4's zeros
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + offs_k
        k_mask = ks < K
        a = tl.load(a_ptr + pair[:, None] * s_at + ks[None, :],
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0)  # fmt: skip
        w_mask = k_mask[:, None] & n_mask[None, :]
        if INT4:
            kb = k0 // SCALE_BK * s_sk
            if BLOCK_K >= INT4_JOINED_MIN_K:
                w = tl.trans(int4_tile(rows, s_rows + kb, z_rows + kb, k0, K, n_mask, a.dtype,
                                       BLOCK_K, EVEN_K))  # fmt: skip
            else:
                w = int4_tile_gathered(w_rows, s_rows + kb, z_rows + kb, ks, w_mask, n_mask,
                                       a.dtype)  # fmt: skip
            acc += mma(a, w, UPCAST, PRECISION)
        elif FP8:
            w = tl.load(w_rows + ks[:, None], mask=w_mask, other=0.0)
            sc = tl.load(s_rows + k0 // SCALE_BK * s_sk, mask=n_mask, other=0.0)
            acc += mma(a, w.to(a.dtype), UPCAST, PRECISION) * sc[None, :]
        else:
            w = tl.load(w_rows + ks[:, None], mask=w_mask, other=0.0)
            acc += mma(a, w, UPCAST, PRECISION)
    dt = out_ptr.dtype.element_ty
    weight = tl.load(weights_ptr + pair, mask=m_mask, other=0.0).to(tl.float32)
    out_mask = m_mask[:, None] & n_mask[None, :]
    down = acc.to(dt).to(tl.float32)  # the projection rounded
    if HAS_BIAS:  # then the bias added and rounded again
        # loaded for every row (the 2-D mask broadcasts it; L1 serves the repeats), so straight
        # into the accumulator's layout: a [BLOCK_N] load broadcast afterwards took 56 registers
        # instead of 48 on an H200 (9 resident programs per SM at 4 warps, not 10), and a second
        # wave for gpt-oss-20b at T=16 (the down kernel 14% slower)
        bias = tl.load(b_ptr + expert * s_be + offs_n[None, :], mask=out_mask, other=0.0)
        down = (down + bias.to(tl.float32)).to(dt).to(tl.float32)
    out = down * weight[:, None]
    out_ptrs = out_ptr + pair[:, None] * s_ot + offs_n[None, :]
    tl.store(out_ptrs, out.to(dt), mask=out_mask)


@triton.jit
def int4_tile_gathered(w_cols, s_cols, z_cols, ks, w_mask, n_mask, dt: tl.constexpr):
    """A ``[BLOCK_K, BLOCK_N]`` tile of packed int4 rows read transposed, each word loaded for
    each of its eight columns (the narrow K tiles' loader: see ``INT4_JOINED_MIN_K``),
    ``(q - z) * s`` in fp32 rounded to ``dt``: the same weights as :func:`int4_tile`."""
    words = tl.load(w_cols + (ks // 8)[:, None], mask=w_mask, other=0)
    q = ((words >> ((ks % 8) * 4)[:, None]) & 0xF).to(tl.float32)
    s = tl.load(s_cols, mask=n_mask, other=0.0).to(tl.float32)
    z = tl.load(z_cols, mask=n_mask, other=0).to(tl.float32)
    return ((q - z[None, :]) * s[None, :]).to(dt)


@triton.jit
def _combine_kernel(c_ptr, out_ptr, H, s_ct, s_ot, TOP_K: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < H
    dt = out_ptr.dtype.element_ty
    row = c_ptr + t * TOP_K * s_ct + offs
    acc = tl.load(row, mask=mask, other=0.0).to(tl.float32)
    for j in tl.static_range(1, TOP_K):
        nxt = tl.load(row + j * s_ct, mask=mask, other=0.0).to(tl.float32)
        acc = (acc + nxt).to(dt).to(tl.float32)  # as index_add_ in the activation dtype
    tl.store(out_ptr + t * s_ot + offs, acc.to(dt), mask=mask)


def _check(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
    topk_ids: torch.Tensor, b13: torch.Tensor | None, b2: torch.Tensor | None,
    fp8: Fp8Scales | None, int4: Int4Scales | None = None,
) -> tuple[int, int, int, int]:  # fmt: skip
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    wdt = (x.dtype,) if fp8 is None else (torch.float8_e4m3fn,)
    wdt = (torch.int32,) if int4 is not None else wdt
    check_tensor("w13", w13, ndim=3, dtypes=wdt)
    check_tensor("w2", w2, ndim=3, dtypes=wdt)
    check_tensor("topk_weights", topk_weights, ndim=2, dtypes=FLOAT_DTYPES, inner_contiguous=False)
    check_tensor("topk_ids", topk_ids, ndim=2, dtypes=INDEX_DTYPES, inner_contiguous=False)
    biases = {name: b for name, b in (("b13", b13), ("b2", b2)) if b is not None}
    for name, b in biases.items():
        check_tensor(name, b, ndim=2, dtypes=(x.dtype,))
    check_devices(x=x, w13=w13, w2=w2, topk_weights=topk_weights, topk_ids=topk_ids, **biases)
    if w13.stride(1) != w13.shape[2] or w2.stride(1) != w2.shape[2]:
        raise ValueError("w13 and w2 must be contiguous within each expert")
    packed = 8 if w13.dtype == torch.int32 else 1
    shapes = check_moe_shapes(x, w13, w2, topk_weights, topk_ids, b13=b13, b2=b2, packed=packed)
    check_int4_scales(w13, w2, int4, x)
    if int4 is None:
        check_fp8_scales(w13, w2, fp8, x)
    elif fp8 is not None:
        raise ValueError("int4 experts take no fp8 scales")
    return shapes


def fused_moe(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2I, H]: gate rows, then up rows
    w2: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # [T, top_k] float
    topk_ids: torch.Tensor,  # [T, top_k] int32/int64, in [0, E)
    *,
    b13: torch.Tensor | None = None,  # [E, 2I]: gate half, then up half; x's dtype
    b2: torch.Tensor | None = None,  # [E, H]; x's dtype
    clamp: ClampedSwiGLU | None = None,  # None: silu(gate) * up
    fp8: Fp8Scales | None = None,  # the scales of e4m3 w13 and w2
    int4: Int4Scales | None = None,  # the groups of packed int4 w13 [E, 2I, H/8], w2 [E, H, I/8]
    config: tuple[int, int, int, int] | None = None,  # (BLOCK_M, BLOCK_N, BLOCK_K, warps)
) -> torch.Tensor:  # [T, H]
    """Triton version of :func:`kernels.moe.ref_fused_moe`. Expert ids out of range are not
    checked (that would sync with the GPU): the router produces them. Biases are applied with
    each of the two projections, so either may be given alone."""
    fp8 = scales_of(w13, fp8)
    int4 = int4_scales_of(w13, int4)
    t, h, e, inter = _check(x, w13, w2, topk_weights, topk_ids, b13, b2, fp8, int4)
    top_k = topk_ids.shape[1]
    out = torch.empty((t, h), dtype=x.dtype, device=x.device)
    if t == 0 or h == 0:
        return out
    if top_k == 0 or inter == 0:
        return out.zero_()
    pairs = t * top_k
    if config is None and triton_moe_pairs.takes_pairs(pairs, e):  # decode: a GEMV a pair
        return fused_moe_pairs(
            x, w13, w2, topk_weights, topk_ids, b13=b13, b2=b2, clamp=clamp, fp8=fp8, int4=int4
        )
    tiles = DEFAULT_TILES if int4 is None else INT4_TILES
    bm, bn, bk, warps = config or (pick_block_m(pairs, e), *tiles)
    weights, ids = sort_by_expert(topk_weights, topk_ids)
    sorted_pairs, block_expert = align_to_blocks(ids, e, bm)
    blocks = block_expert.numel()
    dots = {"UPCAST": dot_upcast(x.dtype), "PRECISION": dot_precision(x.dtype)}
    inter_act = torch.empty((pairs, inter), dtype=x.dtype, device=x.device)  # [P, I]
    bn1, bk1 = _fit(bn, inter), _fit(bk, h)
    # an absent bias or scale is never read (HAS_BIAS, FP8, INT4 False): the weights stand in
    quant = fp8 is not None or int4 is not None
    s13, z13 = quant_args(w13, fp8, int4, h, True)
    bk1 = _within(bk1, s13[5], h) if quant else bk1
    scale_up = -(-inter // s13[4])  # the up half's first scale row
    rows, rows_top_k = act_order_inputs(x, int4, ids, top_k)  # ids: each row ascending
    _gate_up_kernel[(blocks, triton.cdiv(inter, bn1))](
        rows, w13, w13 if b13 is None else b13, s13[0], z13, inter_act, sorted_pairs,
        block_expert, pairs, inter, h, rows.stride(0), w13.stride(0), w13.stride(1),
        0 if b13 is None else b13.stride(0), *s13[1:], scale_up, inter_act.stride(0),
        TOP_K=rows_top_k, BLOCK_M=bm, BLOCK_N=bn1, BLOCK_K=bk1, num_warps=warps,
        HAS_BIAS=b13 is not None, CLAMPED=clamp is not None,
        ALPHA=float(clamp.alpha) if clamp else 0.0, LIMIT=float(clamp.limit) if clamp else 0.0,
        FP8=fp8 is not None, INT4=int4 is not None, **dots, **_even_k(int4, h, bk1),
    )  # fmt: skip
    contrib = torch.empty((pairs, h), dtype=x.dtype, device=x.device)  # [P, H], token-major
    bn2, bk2 = _fit(bn, h), _fit(bk, inter)
    s2, z2 = quant_args(w2, fp8, int4, inter, False)
    bk2 = _within(bk2, s2[5], inter) if quant else bk2
    inter_act = act_order_intermediate(inter_act, int4, ids)
    _down_kernel[(blocks, triton.cdiv(h, bn2))](
        inter_act, w2, w2 if b2 is None else b2, s2[0], z2, contrib, sorted_pairs, block_expert,
        weights.reshape(-1), pairs, h, inter, inter_act.stride(0), w2.stride(0), w2.stride(1),
        0 if b2 is None else b2.stride(0), *s2[1:], contrib.stride(0),
        BLOCK_M=bm, BLOCK_N=bn2, BLOCK_K=bk2, num_warps=warps, HAS_BIAS=b2 is not None,
        FP8=fp8 is not None, INT4=int4 is not None, **dots, **_even_k(int4, inter, bk2),
    )  # fmt: skip
    block = min(COMBINE_BLOCK, next_pow2(h))
    _combine_kernel[(t, triton.cdiv(h, block))](
        contrib, out, h, contrib.stride(0), out.stride(0), TOP_K=top_k, BLOCK=block
    )
    return out


def _even_k(int4: Int4Scales | None, k: int, block_k: int) -> dict[str, bool]:
    """An int4 launch's ``EVEN_K``: every K tile whole (its words unmasked along K; always so
    unless one group spans a K no multiple of the tile). Float and FP8 launches compile as
    before."""
    return {} if int4 is None else {"EVEN_K": k % block_k == 0}


def _within(block_k: int, scale_k: int, k: int) -> int:
    """A K tile inside one FP8 scale block or int4 group (``within_scale_block``); ``scale_k``
    is a multiple of 16 (or covers K), so never below tl.dot's least K of 16."""
    block_k = within_scale_block(block_k, scale_k, k)
    assert block_k >= 16, f"scale block_k {scale_k} is no multiple of 16"
    return block_k


def _fit(block: int, size: int) -> int:
    """A tile no wider than the next power of two of ``size``, and at least 16 (tl.dot's least)."""
    return max(16, min(block, next_pow2(size)))
