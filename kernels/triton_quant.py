"""Quantized-weight linear layers in Triton: int4 (w4a16) and fp8 weights, dequantized in-kernel.

A decode step at batch 1-16 reads each weight once and does a few FLOP per byte: the time is the
bytes of the quantized weight (0.5 B per element for int4 plus 1/16 B of scales and zeros at
group 128; 1 B for fp8 plus 4 B per scale row chunk). The weights never exist dequantized in
memory: each program loads a packed tile, unpacks it in registers and multiplies (long int4
batches excepted, below).

- **GEMV** (M <= ``GEMV_ROWS`` for fp8, ``W4_GEMV_ROWS`` for int4: the conversion and
  unpacking are redone per row, so from 2 rows (fp8) or 3 (int4) the GEMM is faster, at a tile
  for few rows up to ``SMALL_GEMM_ROWS``): one program per ``BLOCK_N``
  output columns, row of x and slice of K, fp32 partial products reduced once at the end. The
  rows of x are the grid's fastest index, so the M programs of one weight tile run side by side
  and read it from HBM about once (with M the slowest, a batch of 4 read every weight 4 times).
  The int4 GEMV streams long chunks of K (16 KB of packed words, several scale groups) through
  few columns, the next chunk loaded ahead: the bytes in flight per SM, not the arithmetic,
  bounded its earlier form (see ``kernels.bench.w4_unpack``). Each shift of a word puts two
  nibbles where one LOP3 each makes them the floats ``2048 + q`` and ``128 + q`` (no
  conversion, no subtraction); the offsets leave with the zero point,
  ``s (sum x (c + q) - sum (c + z) x)``.
- **Split-K**: a decode projection has few output tiles (64 for a 4096-wide layer at
  ``BLOCK_N`` 64) for 132 SMs, so the fp8 GEMV also splits K (``SPLIT`` programs per tile, each
  a run of whole chunks) until there are about two programs per SM; the fp32 partials go to a
  ``[SPLIT, M, N]`` buffer that one more kernel sums in a fixed order (deterministic, no
  atomics). The int4 GEMV's narrow tiles leave enough programs unsplit (one kernel).
  The GEMMs split automatically only a long K (at least ``GEMM_SLICE_K`` per slice).
- **Dequantize, then cuBLAS** (M > ``W4_DEQUANT_ROWS``: prefill chunks, large decode batches):
  the GEMM would unpack each weight tile once per ``BLOCK_M`` rows, so its CUDA-core work grows
  with M; a dequantized copy of the weight (in column slices of bounded size) costs a fixed
  ~4.5 bytes of traffic per element and the matmul then runs at cuBLAS's rate.
- **GEMM** (from 3 rows; for int4 up to ``W4_DEQUANT_ROWS``): ``tl.dot`` tiles. The integer
  part of the weight (``q - z`` for int4, the e4m3 value for fp8) is exact in the activation
  dtype, so the dot runs on it and the scale, constant over a chunk of K, multiplies the fp32
  partial product afterwards. The int4 GEMM's chunks of a multiple of ``W4_PLANES_K`` rows
  (the small batches' tile) skip the reshape of the unpacked ``[BK/8, 8, BN]`` words into
  ``[BK, BN]``: nibble plane ``j`` (rows ``8p + j``) meets x's columns ``8p + j`` in a dot of
  its own, eight dots a chunk.

- **Per-token activation quantization** (W8A8 on FP8 tensor cores): one program per row reads
  it twice (the amax, then the e4m3 values; the second read comes from L2) and writes the fp8
  row and its scale, where torch needs five passes over the activation (abs, amax, product,
  clamp, cast).

- **Unpacking int4** for the GEMM and the dequantization without an integer-to-float
  conversion (16 a clock per SM on Hopper, an eighth of the fp32 rate): a nibble is OR-ed into
  the mantissa of 2^23 and 2^23 subtracted (:func:`_nibbles`), exact; the GEMV's ``128 + q``
  (:func:`_plane_pair`) is the same idea with the offsets folded into the zero point.

A chunk of K never straddles a scale group partly: ``BLOCK_K`` divides the int4 group size (or
is a multiple of it, in the int4 GEMV) and the fp8 ``block_k`` (or the whole row, for
per-channel scales).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kernels import triton_layers
from kernels.quant import INV_FP8_MAX
from kernels.triton_common import (
    FLOAT_DTYPES,
    check_devices,
    check_tensor,
    cuda_index,
    dot_precision,
    dot_upcast,
    fp8_row_scale,
    fp8_rows,
    interpreting,
    mma,
    pdl,
    pdl_enter,
    pdl_release,
    pdl_wait,
    quantize_row,
    round_to_bf16,
    rounds_bf16_in_kernel,
    to_e4m3,
)
from kernels.triton_gemv import release_late, store_sums, tile_rows

# fp8: batches of at most this many rows take the GEMV. It reads each weight tile once per row
# of x (from L2 after the first) and converts it again: the 8B FP8 decode step on an H100 took
# 8.25 ms at 4 rows and 14.05 at 8 against 6.81 at 16 (the GEMM). At 2 rows too the GEMM at
# FP8_SMALL_GEMM_CONFIG is faster: the four 8B projections in a graph on an H200 (python -m
# kernels.bench.gemv_graph --fp8 --rows 2, 2026-11-30) 98 us against the GEMV's 107
GEMV_ROWS = 1
# fp8 GEMMs of up to 16 rows: 16 rows of x a tile (the least tl.dot takes), 32 output columns,
# 256-long chunks of K, 4 warps, K sliced for two programs an SM. The four 8B projections in a
# graph on an H200 at 4 / 8 / 16 rows (gemv_graph --fp8 --rows): 98 / 98 / 98 us against 130
# / 130 / 129 at GEMM_CONFIG, every projection faster
FP8_SMALL_GEMM_CONFIG = (16, 32, 256, 4)
SMALL_GEMM_ROWS = 16  # GEMMs of at most this many rows take the *_SMALL_GEMM_CONFIG tiles
# int4: 1 or 2 rows take the GEMV (both rows in one program, each nibble plane made once), from
# 3 rows the GEMM (one H100, the GEMV of 2026-11-25 against it, the four Llama-3.1-8B
# projections together: 358 against 284 us at 4 rows; one H200, 2026-11-30: the GEMV with 8
# rows a program in 3D tensors took 3-4x the GEMM's time)
W4_GEMV_ROWS = 2
# int4 GEMMs of up to 16 rows: 128 output columns, chunks of one 128-long scale group on the
# nibble planes (W4_PLANES_K), 8 warps, K in 8 slices. The four Llama-3.1-8B projections in a
# graph on one H200 (python -m kernels.bench.w4_unpack --rows 4 8 16, 2026-11-30): 109 / 113
# us at 4 / 8 rows against 193 for the best tile of each projection unpacked into [BK, BN]
# (215 at the tile served before, (16, 64, 128, 4))
W4_SMALL_GEMM_CONFIG = (16, 128, 128, 8, 8)
# a chunk of K that is a multiple of this many rows is multiplied plane by plane: x's columns
# 8p + j against nibble j of each packed word, one dot of K = BLOCK_K / 8 (at least 16) a plane
W4_PLANES_K = 128
# above this many rows the planes' GEMM loads x's chunk whole and splits it into its eight
# planes in registers; up to it each plane's columns 8p + j are loaded on their own. The 8B AWQ
# decode step on one H200 (2026-11-30), x by planes / whole: batch 4 4.59 / 4.77 ms, 8 4.86 /
# 4.92, 12 5.69 / 5.21, 16 5.77 / 5.32
W4_PLANES_X_WHOLE_ROWS = 8
# int4 above this many rows: the weight is dequantized to x's dtype (in slices of at most
# W4_DEQUANT_SLICE_BYTES) and multiplied by cuBLAS. The GEMM unpacks each weight tile once per
# BLOCK_M rows of x on CUDA cores, so its unpacking grows with M while a dequantized copy costs
# ~4.5 bytes of traffic per element once. One H100, the four Llama-3.1-8B projections together
# (kernels.bench.quant --w4-rows, 2026-11-25): at 64 rows the GEMM 375 us, dequantize-then-matmul
# 392; at 128 rows 589 against 408; at 2048 rows 8205 against 1435 (vLLM's AWQ takes the same
# dequantize-then-GEMM route for long batches)
W4_DEQUANT_ROWS = 64
W4_DEQUANT_SLICE_BYTES = 256 << 20
W4_DEQUANT_CONFIG = (64, 128, 4)  # BLOCK_K, BLOCK_N, warps
# (BLOCK_N, BLOCK_K, num_warps[, SPLIT]) for the GEMVs; (BLOCK_M, BLOCK_N, BLOCK_K, num_warps[,
# SPLIT]) for GEMMs; SPLIT 0 or left out: enough slices of K for two programs per SM
# int4: 16 rows of the packed weight's columns a program, chunks of 1024 rows of K (16 KB of
# words, several scale groups), 8 warps, K unsplit (one kernel, no partial sums): on one H200
# (kernels.bench.w4_unpack, 2026-11-30) the four 8B projections took 62 us a layer at the best
# launch of each against 78 for the GEMV before (one group a chunk, 16 slices of K)
W4_GEMV_CONFIG = (16, 1024, 8, 1)
# int4, one row of x and rows of at least W4_GEMV_LONG_K (and twice the outputs: the down
# projections): 16 warps over 2048-long chunks, each program's loop half as long.
# Llama-3.1-8B's down projection has 256 programs of 16 columns for 132 SMs, under one wave; in
# a graph on one H200 (kernels.bench.w4_unpack, 2026-11-30) 13.8 against 15.6 us at
# W4_GEMV_CONFIG, the AWQ step at batch 1 2.574 -> 2.515 ms; at batch 2 (both rows in one
# program) the step was slower with it (3.42 -> 3.58 ms), so two rows keep W4_GEMV_CONFIG
W4_GEMV_LONG_K_CONFIG = (16, 2048, 16, 1)
W4_GEMV_LONG_K = 8192
# int4, at least W4_GEMV_WIDE_N times as many outputs as inputs (gate_up projections), one
# or two rows of x: 32 columns a program over 512-long chunks. Llama-3.1-8B's gate_up in a
# graph on one H200 (kernels.bench.w4_unpack, 2026-11-30, session 13): 24.5 against 26.7 us
# at W4_GEMV_CONFIG (the words alone, kernels.bench.w4_ceiling, reach 80% of copy with 64
# columns against 68% with 16; the whole GEMV is slower at 64); the AWQ step at batch 1
# 2.52 -> 2.44 ms, at batch 2 3.42 -> 3.30
W4_GEMV_WIDE_N_CONFIG = (32, 512, 8, 1)
W4_GEMV_WIDE_N = 4
FP8_GEMV_CONFIG = (8, 512, 4)
# FP8 per-channel GEMV launches with the chunks' loads software-pipelined through shared memory
# (BLOCK_N, BLOCK_K, warps, SPLIT, STAGES). Llama-3.1-8B's projections in a graph on one H200
# (kernels.bench.gemv_stages, 2026-11-30), against the launches before, each chunk loaded as
# used: more than twice as many outputs as inputs (gate_up) 29.9 against 33.4 us at (8, 512,
# 4); square (o) 5.9 against 6.8 at (8, 1024, 8); long rows (down) 16.0 against 16.8 at (2,
# 2048, 4). qkv's (16, 512, 8) stays: 8.3 us, none better by more than 0.1
FP8_GEMV_WIDE_N_CONFIG = (16, 256, 4, 1, 3)
FP8_GEMV_STAGED_CONFIG = (16, 512, 4, 1, 4)
# the bits of 2048.0 and 128.0: a nibble OR-ed in at bits 12..15 or 16..19 adds itself
PLANE_MAGIC_LO, PLANE_MAGIC_HI = 0x45000000, 0x43000000
GEMM_CONFIG = (32, 64, 64, 4)
PROGRAMS_PER_SM = 2
MAX_SPLIT = 16
GEMM_SLICE_K = 4096


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 1  # the interpreter: split only when a config asks
    return _cached_sm_count(cuda_index(device))


@functools.cache
def _cached_sm_count(index: int) -> int:
    return int(torch.cuda.get_device_properties(index).multi_processor_count)


def _split(
    asked: int, tiles: int, chunks: int, device: torch.device, most: int = MAX_SPLIT
) -> tuple[int, int]:
    """(SPLIT, chunks per slice): ``asked`` if given (> 0), else enough slices of K for
    ``PROGRAMS_PER_SM`` programs per SM, at most ``most``; never more slices than chunks."""
    split = asked
    if split <= 0:
        want = PROGRAMS_PER_SM * _sm_count(device)
        split = 1
        while tiles * split < want and split * 2 <= most:
            split *= 2
    split = max(1, min(split, chunks))
    per = -(-chunks // split)
    return -(-chunks // per), per


@triton.jit
def _sum_splits_kernel(
    part_ptr, out_ptr, MN, SPLIT: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr
):
    """out[i] = sum over s of part[s, i], in order s = 0, 1, ...; cast to out's dtype."""
    pdl_enter(USE_PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < MN
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in range(SPLIT):
        acc += tl.load(part_ptr + s * MN + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def _gemm_most(k: int) -> int:
    """The GEMMs' automatic split keeps at least ``GEMM_SLICE_K`` of K per slice: on an H100 a
    split 4096-long K doubled batch-16 times, while a 14336-long one was 2.4x faster split."""
    return max(1, k // GEMM_SLICE_K)


def _target(out: torch.Tensor, split: int) -> torch.Tensor:
    """Where the kernel writes: ``out`` itself, or an fp32 [SPLIT, M, N] buffer of partials."""
    if split == 1:
        return out
    return torch.empty((split, *out.shape), dtype=torch.float32, device=out.device)


def _finish(target: torch.Tensor, out: torch.Tensor, split: int) -> torch.Tensor:
    if split > 1:
        mn = out.numel()
        _sum_splits_kernel[(triton.cdiv(mn, 1024),)](
            target, out, mn, SPLIT=split, BLOCK=1024, **pdl(out.device, out.shape[0])
        )
    return out


def _chunk(block_k: int, fits: int) -> int:
    """The largest power of two <= ``block_k`` that divides ``fits`` (at least 16)."""
    while block_k > 16 and fits % block_k:
        block_k //= 2
    return block_k


@triton.jit
def _nibbles(packed, shifts):
    """The nibbles of int32 ``packed`` at bit offsets ``shifts``, as exact float32 0.0 .. 15.0,
    without an integer-to-float conversion: that runs 16 a clock per SM on Hopper, an eighth of
    the fp32 rate, and at eight per 4 bytes of weight it alone caps an int4 GEMV near 2 TB/s on
    an H100. Instead the nibble becomes the low mantissa bits of 2^23 (0x4B000000; the AND and
    the OR make one LOP3) and 2^23 is subtracted, exactly: full-rate instructions only."""
    bits = ((packed >> shifts) & 0xF) | 0x4B000000
    return bits.to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def _packed_tile(qw_ptr, k0, offs_n, n_mask, s_qk, BLOCK_K: tl.constexpr):
    """The ``[BLOCK_K / 8, BN]`` int32 words holding rows k0 .. k0 + BLOCK_K of the int4
    weight (row 8p + j in nibble j of word p)."""
    rows = k0 // 8 + tl.arange(0, BLOCK_K // 8)
    return tl.load(
        qw_ptr + rows[:, None].to(tl.int64) * s_qk + offs_n[None, :], mask=n_mask[None, :], other=0
    )


@triton.jit
def _unpack(qw_ptr, k0, offs_n, n_mask, s_qk, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """Rows k0 .. k0 + BLOCK_K of the int4 weight, ``[BLOCK_K, BLOCK_N]`` float32 in 0..15:
    each int32 is loaded once and split into its eight rows in registers."""
    packed = _packed_tile(qw_ptr, k0, offs_n, n_mask, s_qk, BLOCK_K)  # [BK/8, BN]
    shifts = (tl.arange(0, 8) * 4)[None, :, None]
    q = _nibbles(packed[:, None, :], shifts)  # [BK/8, 8, BN]: row 8p + i at [p, i]
    return tl.reshape(q, (BLOCK_K, BLOCK_N))


@triton.jit
def _plane(packed, J: tl.constexpr):
    """Nibble ``J`` (rows 8p + J) of each int32 as the exact float32 ``128 + q``: shifted to
    bits 16..19 and OR-ed into the mantissa of 128.0, whose unit is bit 16. Both constants
    are immediates, so ptxas makes it an AND and an OR; the GEMM of a few rows, which uses it,
    was slower with the float's bits in a register (one LOP3) and with planes in pairs (one
    H200, 2026-11-30: the 8B AWQ step at batch 8 4.85 -> 5.19 ms with one LOP3; the four 8B
    projections at 16 rows 124 -> 131 us in pairs): its time is not in these instructions."""
    if J < 4:
        t = packed << (16 - 4 * J)
    elif J > 4:
        t = packed >> (4 * J - 16)  # arithmetic: the sign fills bits the mask drops
    else:
        t = packed
    return ((t & 0x000F0000) | 0x43000000).to(tl.float32, bitcast=True)


@triton.jit
def _plane_pair(packed, PAIR: tl.constexpr, magic_lo, magic_hi):
    """Nibbles ``2 PAIR`` and ``2 PAIR + 1`` of each int32 (rows 8p + 2 PAIR, 8p + 2 PAIR + 1)
    as the exact float32 ``2048 + q`` and ``128 + q``: one shift (by 12 - 8 PAIR) puts them at
    bits 12..15 and 16..19, and one LOP3 each ORs them into the mantissa of 2048.0 or 128.0,
    whose units are bits 12 and 16 (the offsets, at most 2^11 times x, cost ~11 of fp32's 24
    bits of the products' sum before they are taken off: ~1e-5 relative). ``magic_*`` (their
    bits, ``PLANE_MAGIC_LO`` and ``PLANE_MAGIC_HI``) come in as kernel arguments, in
    registers: with both the mask and the float's bits immediates, the ptxas of triton 3.6
    (the GPU image's) made each plane an AND and an OR; with one in a register, one LOP3
    (``python -m kernels.bench.sass int4-gemv``)."""
    if PAIR < 2:
        t = packed << (12 - 8 * PAIR)
    else:
        t = packed >> (8 * PAIR - 12)  # arithmetic: the sign fills bits the masks drop
    lo = ((t & 0x0000F000) | magic_lo).to(tl.float32, bitcast=True)
    hi = ((t & 0x000F0000) | magic_hi).to(tl.float32, bitcast=True)
    return lo, hi


@triton.jit
def _w4_gemv_program(
    x_ptr, qw_ptr, M, N, K, K_PER, s_xm, s_qk, s_sg, GROUPS, GROUP: tl.constexpr,
    ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """An int4 GEMV program's share: its rows of x ``m0`` and ``m1`` (a second row past the
    batch reads the last and stores nothing), slice of K ``[k_lo, k_hi)`` (``pid_k``), output
    columns and their mask, the offsets of its ``[BK/8, BN]`` packed-word and scale tiles and
    of its rows of x at ``8p``. The rows of x are the grid's fastest index: a weight tile's
    row groups run side by side, and the tile is read from HBM about once."""
    pid = tl.program_id(0)
    m0 = ((pid % GROUPS) * ROWS).to(tl.int64)
    m1 = tl.minimum(m0 + 1, M - 1)
    pid_k = tl.program_id(1)
    offs_n = (pid // GROUPS) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.arange(0, BLOCK_K // 8)
    k_lo = pid_k * K_PER
    qw_tile, sz_tile = _w4_tiles(qw_ptr, offs_n, s_qk, s_sg, GROUP, BLOCK_K)
    x0_row = x_ptr + m0 * s_xm + rows * 8
    x1_row = x_ptr + m1 * s_xm + rows * 8
    k_hi = tl.minimum(k_lo + K_PER, K)
    return m0, m1, pid_k, offs_n, offs_n < N, k_lo, k_hi, qw_tile, sz_tile, x0_row, x1_row


@triton.jit
def _w4_tiles(qw_ptr, offs_n, s_qk, s_sg, GROUP: tl.constexpr, BLOCK_K: tl.constexpr):
    """The offsets of a GEMV program's ``[BK/8, BN]`` packed-word tile (a pointer) and of its
    scale and zero tile, for columns ``offs_n``: row p of the tile in group (8p) / GROUP."""
    rows = tl.arange(0, BLOCK_K // 8)
    qw_tile = qw_ptr + rows[:, None].to(tl.int64) * s_qk + offs_n[None, :]
    return qw_tile, ((rows * 8) // GROUP)[:, None] * s_sg + offs_n[None, :]


@triton.jit
def _w4_next_words(qw_tile, n_mask, k0, k_hi, s_qk, BLOCK_K: tl.constexpr):
    """The packed words of the chunk after ``k0``, loaded ahead (past the slice, the last chunk
    again, from L2)."""
    ahead = tl.minimum(k0 + BLOCK_K, k_hi - BLOCK_K)
    return tl.load(qw_tile + (ahead // 8) * s_qk, mask=n_mask[None, :], other=0)


@triton.jit
def _w4_gemv_chunk(
    qw_tile, s_ptr, z_ptr, sz_tile, n_mask, k0, k_hi, s_qk, s_sg, GROUP: tl.constexpr,
    BLOCK_K: tl.constexpr,
):  # fmt: skip
    """An int4 GEMV program's loads for the chunk at ``k0``: the next chunk's packed words
    (:func:`_w4_next_words`) and this chunk's scales and zeros as float32, each row of the tile
    its own group's."""
    following = _w4_next_words(qw_tile, n_mask, k0, k_hi, s_qk, BLOCK_K)
    g0 = (k0 // GROUP) * s_sg
    s = tl.load(s_ptr + g0 + sz_tile, mask=n_mask[None, :], other=0.0).to(tl.float32)
    z = tl.load(z_ptr + g0 + sz_tile, mask=n_mask[None, :], other=0.0).to(tl.float32)
    return following, s, z


@triton.jit
def _w4_gemv_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, out_ptr, M, N, K, K_PER, s_xm, s_qk, s_sg, s_om, GROUPS,
    MAGIC_LO, MAGIC_HI, GROUP: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, SPLIT: tl.constexpr, ACT: tl.constexpr, LATE: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    """The GEMV on nibble planes for ``ROWS`` (1 or 2) rows of x at once: each plane is made
    once and multiplied into each row's sums (2D tensors only: a [ROWS, BK/8, BN] form
    measured 2-3x slower). Planes come in pairs (:func:`_plane_pair`): four shifts and eight
    LOP3 a word, where one plane a shift (:func:`_plane`) took seven shifts and sixteen
    LOP3: 267 instructions a thread a chunk of eight words against 359 in the SASS of the 8B
    launch, the four 8B projections 63.9 -> 56.6 us at one row, 104.8 -> 87.4 at two (one
    H200, 2026-11-30). A chunk of K may span several scale groups
    (row p of the packed tile is in group (k0 + 8p) / GROUP): per chunk sum_j plane_j x_j,
    less (2048 + z) times the x of the low planes and (128 + z) times the high ones', times s,
    into a [BK/8, BN] accumulator per row, summed over K once at the end. The next chunk's
    words load before this chunk's arithmetic, the first before the wait. ``ACT`` (one slice of
    K; a gate_up weight, gate columns then as many up columns): a program's BLOCK_N columns are
    the gate and up columns of BLOCK_N / 2 outputs, interleaved, and it stores their
    ``silu(gate) * up`` (as ``kernels.triton_gemv``'s); ``LATE``: the next kernel may launch only
    after the loop (``kernels.triton_common.pdl_wait``)."""
    m0, m1, pid_k, offs_n, n_mask, k_lo, k_hi, qw_tile, sz_tile, x0_row, x1_row = _w4_gemv_program(
        x_ptr, qw_ptr, M, N, K, K_PER, s_xm, s_qk, s_sg, GROUPS, GROUP, ROWS, BLOCK_N, BLOCK_K
    )
    offs_out = offs_n
    if ACT:  # the program's columns: BLOCK_N / 2 gate columns, then the same outputs' up columns
        offs_out, offs_n, n_mask = _gate_up_cols(tl.program_id(0) // GROUPS, N, BLOCK_N)
        qw_tile, sz_tile = _w4_tiles(qw_ptr, offs_n, s_qk, s_sg, GROUP, BLOCK_K)
    following = tl.load(qw_tile + (k_lo // 8) * s_qk, mask=n_mask[None, :], other=0)
    pdl_wait(USE_PDL, not LATE)
    acc0 = tl.zeros([BLOCK_K // 8, BLOCK_N], dtype=tl.float32)
    acc1 = tl.zeros([BLOCK_K // 8, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        packed = following
        following, s, z = _w4_gemv_chunk(
            qw_tile, s_ptr, z_ptr, sz_tile, n_mask, k0, k_hi, s_qk, s_sg, GROUP, BLOCK_K
        )
        part0 = tl.zeros([BLOCK_K // 8, BLOCK_N], dtype=tl.float32)
        part1 = tl.zeros([BLOCK_K // 8, BLOCK_N], dtype=tl.float32)
        lo0 = tl.zeros([BLOCK_K // 8], dtype=tl.float32)  # x of the low (2048 + q) planes
        hi0 = tl.zeros([BLOCK_K // 8], dtype=tl.float32)  # x of the high (128 + q) planes
        lo1 = tl.zeros([BLOCK_K // 8], dtype=tl.float32)
        hi1 = tl.zeros([BLOCK_K // 8], dtype=tl.float32)
        for i in tl.static_range(4):
            plane_lo, plane_hi = _plane_pair(packed, i, MAGIC_LO, MAGIC_HI)
            xl = tl.load(x0_row + k0 + 2 * i).to(tl.float32)
            xh = tl.load(x0_row + k0 + 2 * i + 1).to(tl.float32)
            part0 += plane_lo * xl[:, None]  # two FFMAs: one sum of both products takes three
            part0 += plane_hi * xh[:, None]
            lo0 += xl
            hi0 += xh
            if ROWS > 1:
                xl = tl.load(x1_row + k0 + 2 * i).to(tl.float32)
                xh = tl.load(x1_row + k0 + 2 * i + 1).to(tl.float32)
                part1 += plane_lo * xl[:, None]
                part1 += plane_hi * xh[:, None]
                lo1 += xl
                hi1 += xh
        acc0 += s * (part0 - (2048.0 * lo0 + 128.0 * hi0)[:, None] - z * (lo0 + hi0)[:, None])
        if ROWS > 1:
            acc1 += s * (part1 - (2048.0 * lo1 + 128.0 * hi1)[:, None] - z * (lo1 + hi1)[:, None])
    pdl_release(USE_PDL, not LATE)
    if ACT:
        live = (tl.zeros([1], dtype=tl.int64) + m0) < M
        _store_gate_up(out_ptr + m0 * s_om, tl.sum(acc0, axis=0), live, offs_out, N, BLOCK_N)
        if ROWS > 1:
            live = (tl.zeros([1], dtype=tl.int64) + m0 + 1) < M
            _store_gate_up(out_ptr + m1 * s_om, tl.sum(acc1, axis=0), live, offs_out, N, BLOCK_N)
    else:
        _store_row(out_ptr, tl.sum(acc0, axis=0), m0, offs_n, n_mask, pid_k, M, N, s_om, SPLIT)
        if ROWS > 1:
            mask = n_mask & (m0 + 1 + tl.zeros([BLOCK_N], dtype=tl.int64) < M)
            _store_row(out_ptr, tl.sum(acc1, axis=0), m1, offs_n, mask, pid_k, M, N, s_om, SPLIT)


@triton.jit
def _gate_up_cols(pid_n, N, BLOCK_N: tl.constexpr):
    """An int4 GEMV program's outputs, columns and their mask with SiLU-and-mul (a gate_up
    weight: N / 2 gate columns, then the up columns): BLOCK_N / 2 outputs, their gate columns
    then their up columns, each run contiguous. Not interleaved one by one as the bf16 GEMV's
    rows (``kernels.triton_gemv.tile_rows``): the columns are the packed words' contiguous
    dim, and single columns left every load a scalar one (the 8B AWQ step 2.42 -> 4.68 ms)."""
    offs_out = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
    i = tl.arange(0, BLOCK_N)
    half = pid_n * (BLOCK_N // 2) + i % (BLOCK_N // 2)
    return offs_out, half + (i // (BLOCK_N // 2)) * (N // 2), half < N // 2


@triton.jit
def _store_gate_up(out_row, sums, live, offs_out, N, BLOCK_N: tl.constexpr):
    """``silu(gate) * up`` of a row's float32 sums in :func:`_gate_up_cols`' order, each sum
    rounded to out's dtype first (as ``kernels.triton_gemv.store_sums``)."""
    ty = out_row.dtype.element_ty
    pairs = tl.permute(tl.reshape(sums.to(ty), [2, BLOCK_N // 2]), [1, 0])
    gate, up = tl.split(pairs)
    y = triton_layers.act_and_mul(gate.to(tl.float32), up.to(tl.float32), ty, False)
    tl.store(out_row + offs_out, y, mask=(offs_out < N // 2) & live)


@triton.jit
def _store_row(out_ptr, res, m, offs_n, mask, pid_k, M, N, s_om, SPLIT: tl.constexpr):
    """A GEMV row: into ``out`` (one slice of K) or as fp32 partials into [SPLIT, M, N]."""
    if SPLIT == 1:
        tl.store(out_ptr + m * s_om + offs_n, res.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(out_ptr + (pid_k * M + m) * N + offs_n, res, mask=mask)


@triton.jit
def _w4_dequant_kernel(
    qw_ptr, s_ptr, z_ptr, out_ptr, N, N0, s_qk, s_sg, s_ok,
    GROUP: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, ROUND: tl.constexpr,
):  # fmt: skip
    """Columns N0 .. N of the int4 weight as ``(q - z) s`` in out's dtype, ``out[k, n - N0]``:
    the product in fp32, rounded once (as ``ref_dequant_int4(...).to(dtype)``). BLOCK_K divides
    GROUP: one scale and zero per column of a tile. ``ROUND``: see ``round_to_bf16``."""
    k0 = tl.program_id(0) * BLOCK_K
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # within the slice
    offs_n = N0 + cols
    n_mask = offs_n < N
    q = _unpack(qw_ptr, k0, offs_n, n_mask, s_qk, BLOCK_K, BLOCK_N)
    g = k0 // GROUP
    s = tl.load(s_ptr + g * s_sg + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + g * s_sg + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    w = round_to_bf16((q - z[None, :]) * s[None, :], ROUND)
    rows = (k0 + tl.arange(0, BLOCK_K)).to(tl.int64)
    tl.store(out_ptr + rows[:, None] * s_ok + cols[None, :], w.to(out_ptr.dtype.element_ty),
             mask=n_mask[None, :])  # fmt: skip


def w4_dequantize(
    qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
    dtype: torch.dtype, first: int = 0, last: int | None = None,
) -> torch.Tensor:  # fmt: skip
    """Columns ``first:last`` of the int4 weight as a ``[K, last - first]`` tensor of ``dtype``
    (arguments as :func:`w4a16_linear` checks them)."""
    k, n = qweight.shape[0] * 8, qweight.shape[1]
    last = n if last is None else last
    out = torch.empty((k, last - first), dtype=dtype, device=qweight.device)
    bk, bn, warps = W4_DEQUANT_CONFIG
    bk = min(bk, group_size)
    _w4_dequant_kernel[(k // bk, triton.cdiv(last - first, bn))](
        qweight, scales, zeros, out, last, first, qweight.stride(0), scales.stride(0),
        out.stride(0), GROUP=group_size, BLOCK_K=bk, BLOCK_N=bn,
        ROUND=rounds_bf16_in_kernel(dtype), num_warps=warps,
    )  # fmt: skip
    return out


def _dequant_matmul(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
    group_size: int, out: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    """``out = x @ W`` through dequantized slices of W's columns and torch's matmul."""
    k, n = x.shape[1], out.shape[1]
    bn = W4_DEQUANT_CONFIG[1]
    cols = max(bn, W4_DEQUANT_SLICE_BYTES // (k * x.element_size()) // bn * bn)
    if cols >= n:
        return torch.mm(x, w4_dequantize(qweight, scales, zeros, group_size, x.dtype), out=out)
    for first in range(0, n, cols):
        last = min(first + cols, n)
        w = w4_dequantize(qweight, scales, zeros, group_size, x.dtype, first, last)
        out[:, first:last] = torch.mm(x, w)
    return out


@triton.jit
def _plane_dot(part, a, packed, J: tl.constexpr, zb, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """``part + a @ (q - z)`` for nibble plane ``J`` of ``packed`` (``zb``: 128 + z)."""
    return part + mma(a, (_plane(packed, J) - zb).to(a.dtype), UPCAST, PRECISION)


@triton.jit(do_not_specialize=["M"])  # one compilation for every batch size
def _w4_gemm_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, out_ptr, M, N, K, K_PER, s_xm, s_qk, s_sg, s_om,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr, SPLIT: tl.constexpr, PLANES: tl.constexpr,
    X_WHOLE: tl.constexpr,
):  # fmt: skip
    # launched plainly (no programmatic launch): with it AWQ's batch-8 step took 8.24 ms
    # against 7.84 on an H100
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    pid_k = tl.program_id(2)
    m_mask, n_mask = offs_m < M, offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    k_lo = pid_k * K_PER
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * s_xm
    for k0 in range(k_lo, tl.minimum(k_lo + K_PER, K), BLOCK_K):
        g = k0 // GROUP
        s = tl.load(s_ptr + g * s_sg + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + g * s_sg + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        if PLANES:
            # plane j of the words (rows 8p + j) as 128 + q, less 128 + z: q - z, exact; times
            # x's columns 8p + j, eight dots of K = BLOCK_K / 8 (no [BK/8, 8, BN] -> [BK, BN]
            # reshape of the unpacked tile through shared memory)
            packed = _packed_tile(qw_ptr, k0, offs_n, n_mask, s_qk, BLOCK_K)
            part = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            zb = (z + 128.0)[None, :]
            if X_WHOLE:
                # x's [BM, BK] chunk as [BM, BK/8, 2, 2, 2] (k = 8p + 4a + 2b + c), split on
                # c, then b, then a: plane j = 4a + 2b + c
                xa = tl.load(x_rows + (k0 + offs_k)[None, :], mask=m_mask[:, None], other=0.0)
                c0, c1 = tl.split(tl.reshape(xa, [BLOCK_M, BLOCK_K // 8, 2, 2, 2]))
                c0b0, c0b1 = tl.split(c0)
                c1b0, c1b1 = tl.split(c1)
                x0, x4 = tl.split(c0b0)
                x2, x6 = tl.split(c0b1)
                x1, x5 = tl.split(c1b0)
                x3, x7 = tl.split(c1b1)
                part = _plane_dot(part, x0, packed, 0, zb, UPCAST, PRECISION)
                part = _plane_dot(part, x1, packed, 1, zb, UPCAST, PRECISION)
                part = _plane_dot(part, x2, packed, 2, zb, UPCAST, PRECISION)
                part = _plane_dot(part, x3, packed, 3, zb, UPCAST, PRECISION)
                part = _plane_dot(part, x4, packed, 4, zb, UPCAST, PRECISION)
                part = _plane_dot(part, x5, packed, 5, zb, UPCAST, PRECISION)
                part = _plane_dot(part, x6, packed, 6, zb, UPCAST, PRECISION)
                part = _plane_dot(part, x7, packed, 7, zb, UPCAST, PRECISION)
            else:
                p = tl.arange(0, BLOCK_K // 8)
                for j in tl.static_range(8):
                    a = tl.load(x_rows + (k0 + j + 8 * p)[None, :], mask=m_mask[:, None],
                                other=0.0)  # fmt: skip
                    part = _plane_dot(part, a, packed, j, zb, UPCAST, PRECISION)
            acc += part * s[None, :]
        else:
            a = tl.load(x_rows + (k0 + offs_k)[None, :], mask=m_mask[:, None], other=0.0)
            q = _unpack(qw_ptr, k0, offs_n, n_mask, s_qk, BLOCK_K, BLOCK_N)
            w = (q - z[None, :]).to(a.dtype)  # exact: integers in [-15, 15]
            acc += mma(a, w, UPCAST, PRECISION) * s[None, :]
    _store_tile(out_ptr, acc, offs_m, offs_n, m_mask, n_mask, pid_k, M, N, s_om, SPLIT)


@triton.jit
def _store_tile(
    out_ptr, acc, offs_m, offs_n, m_mask, n_mask, pid_k, M, N, s_om, SPLIT: tl.constexpr
):
    """A GEMM tile: into ``out`` (one slice of K) or as fp32 partials into [SPLIT, M, N]."""
    mask = m_mask[:, None] & n_mask[None, :]
    if SPLIT == 1:
        out_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * s_om + offs_n[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        rows = (pid_k * M + offs_m).to(tl.int64)
        tl.store(out_ptr + rows[:, None] * N + offs_n[None, :], acc, mask=mask)


@triton.jit
def _fp8_gemv_kernel(
    x_ptr, w_ptr, s_ptr, out_ptr, M, N, K, K_PER, s_xm, s_wn, s_sn, s_om, BLOCK_SCALE,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, SPLIT: tl.constexpr,
    ROW_SCALE: tl.constexpr, STAGES: tl.constexpr, ACT: tl.constexpr, LATE: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    """``STAGES`` > 1: the chunks' loads software-pipelined, ``STAGES - 1`` chunks ahead through
    shared memory (cp.async); 1: each chunk loaded when it is used. ``ACT`` (one slice of K): a
    gate_up weight's ``silu(gate) * up`` stored, as ``kernels.triton_gemv``'s."""
    pid = tl.program_id(0)  # the rows of x fastest: a weight tile's M programs run together
    pid_n = pid // M
    m = (pid % M).to(tl.int64)
    pid_k = tl.program_id(1)
    offs_out, offs_n, n_mask = tile_rows(pid_n, N, BLOCK_N, ACT)
    offs_k = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * s_wn
    s_rows = s_ptr + offs_n.to(tl.int64) * s_sn
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    k_lo = pid_k * K_PER
    # no weight prefetch before the wait here (as the bf16 GEMV's unpipelined launch has):
    # holding a second chunk slowed these launches by 10-25% in a graph on an H100
    pdl_wait(USE_PDL, not LATE)
    for k0 in tl.range(k_lo, tl.minimum(k_lo + K_PER, K), BLOCK_K, num_stages=STAGES):
        ks = k0 + offs_k
        if EVEN_K:
            xv = tl.load(x_ptr + m * s_xm + ks)
            w = tl.load(w_rows + ks[None, :], mask=n_mask[:, None], other=0.0)
        else:
            k_mask = ks < K
            xv = tl.load(x_ptr + m * s_xm + ks, mask=k_mask, other=0.0)
            w = tl.load(w_rows + ks[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        if ROW_SCALE:  # one scale per row: applied once, after the sum
            acc += w.to(tl.float32) * xv.to(tl.float32)[None, :]
        else:
            s = tl.load(s_rows + k0 // BLOCK_SCALE, mask=n_mask, other=0.0)  # [BN] fp32
            acc += w.to(tl.float32) * s[:, None] * xv.to(tl.float32)[None, :]
    pdl_release(USE_PDL, not LATE)
    out = tl.sum(acc, axis=1)
    if ROW_SCALE:
        out = out * tl.load(s_rows, mask=n_mask, other=0.0)
    if ACT:
        live = (tl.zeros([1], dtype=tl.int64) + m) < M
        store_sums(out_ptr + m * s_om, out, live, offs_out, N, BLOCK_N, True)
    else:
        _store_row(out_ptr, out, m, offs_n, n_mask, pid_k, M, N, s_om, SPLIT)


@triton.jit(do_not_specialize=["M"])
def _fp8_gemm_kernel(
    x_ptr, w_ptr, s_ptr, out_ptr, M, N, K, K_PER, s_xm, s_wn, s_sn, s_om, BLOCK_SCALE,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr, SPLIT: tl.constexpr,
):  # fmt: skip
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    pid_k = tl.program_id(2)
    m_mask, n_mask = offs_m < M, offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    k_lo = pid_k * K_PER
    for k0 in range(k_lo, tl.minimum(k_lo + K_PER, K), BLOCK_K):
        ks = k0 + offs_k
        k_mask = ks < K
        a = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * s_xm + ks[None, :],
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0)  # fmt: skip
        w = tl.load(
            w_ptr + offs_n[None, :].to(tl.int64) * s_wn + ks[:, None],
            mask=n_mask[None, :] & k_mask[:, None],
            other=0.0,
        )  # [BK, BN]
        s = tl.load(s_ptr + offs_n.to(tl.int64) * s_sn + k0 // BLOCK_SCALE, mask=n_mask, other=0.0)
        acc += mma(a, w.to(a.dtype), UPCAST, PRECISION) * s[None, :]  # e4m3 -> bf16 is exact
    _store_tile(out_ptr, acc, offs_m, offs_n, m_mask, n_mask, pid_k, M, N, s_om, SPLIT)


def _check_x(x: torch.Tensor, k: int) -> tuple[int, int]:
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    if x.shape[1] != k:
        raise ValueError(f"x has {x.shape[1]} features but the weight expects {k}")
    return x.shape[0], k


def w4a16_linear(
    x: torch.Tensor,  # [M, K]
    qweight: torch.Tensor,  # [K/8, N] int32, packed along K
    scales: torch.Tensor,  # [K/G, N]
    zeros: torch.Tensor,  # [K/G, N]
    group_size: int,
    *,
    config: tuple[int, ...] | None = None,
    silu_and_mul: bool = False,
) -> torch.Tensor:  # [M, N], or [M, N / 2] with silu_and_mul
    """Triton version of :func:`kernels.quant.ref_w4a16_linear`: the GEMV up to
    ``W4_GEMV_ROWS`` rows, the GEMM up to ``W4_DEQUANT_ROWS``, above that the weight dequantized
    to x's dtype and torch's matmul. ``config`` picks the Triton launch (and keeps larger M on
    the GEMM): (BLOCK_N, BLOCK_K, warps[, SPLIT]) for the GEMV, else (BLOCK_M, BLOCK_N, BLOCK_K,
    warps[, SPLIT]). ``silu_and_mul``: a gate_up weight's product through SiLU-and-mul, in the
    GEMV's epilogue (one slice of K) where the GEMV runs, bit for bit the two kernels' result;
    else the two kernels."""
    check_tensor("qweight", qweight, ndim=2, dtypes=(torch.int32,))
    check_tensor("scales", scales, ndim=2, dtypes=FLOAT_DTYPES)
    check_tensor("zeros", zeros, ndim=2, dtypes=FLOAT_DTYPES)
    n = qweight.shape[1]
    m, k = _check_x(x, qweight.shape[0] * 8)
    if group_size < 16 or group_size & (group_size - 1) or k % group_size:
        raise ValueError(f"group_size {group_size} must be a power of two >= 16 dividing K={k}")
    if scales.shape != (k // group_size, n) or zeros.shape != scales.shape:
        raise ValueError(
            f"scales {tuple(scales.shape)} and zeros {tuple(zeros.shape)} must be "
            f"{(k // group_size, n)}"
        )
    if scales.stride() != zeros.stride():
        raise ValueError("scales and zeros must have the same strides")
    if silu_and_mul and n % 2:
        raise ValueError(f"a gate_up weight has as many up columns as gate columns, got {n}")
    check_devices(x=x, qweight=qweight, scales=scales, zeros=zeros)
    if silu_and_mul and m > W4_GEMV_ROWS:  # the GEMM's product, then the SiLU-and-mul kernel
        product = w4a16_linear(x, qweight, scales, zeros, group_size, config=config)
        return triton_layers.silu_and_mul(product)
    out = torch.empty((m, n // 2 if silu_and_mul else n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    if m > W4_DEQUANT_ROWS and config is None:
        return _dequant_matmul(x, qweight, scales, zeros, group_size, out)
    strides = (x.stride(0), qweight.stride(0), scales.stride(0), out.stride(0))
    if m <= W4_GEMV_ROWS:
        bn, bk, warps, asked = _with_split(config or w4_gemv_config(n, k, m), 3)
        if silu_and_mul and bn % 2:
            raise ValueError(f"silu_and_mul takes an even BLOCK_N, got {config}")
        bk = _chunk(bk, k) if bk > group_size else bk  # whole groups, or a part of one
        rows = min(m, 2)
        groups = triton.cdiv(m, rows)
        split, per = _split(
            1 if silu_and_mul else asked, triton.cdiv(n, bn) * groups, k // bk, x.device
        )
        target = _target(out, split)
        _w4_gemv_kernel[(triton.cdiv(n, bn) * groups, split)](
            x, qweight, scales, zeros, target, m, n, k, per * bk, *strides, groups,
            PLANE_MAGIC_LO, PLANE_MAGIC_HI, GROUP=group_size, ROWS=rows, BLOCK_N=bn, BLOCK_K=bk,
            SPLIT=split, ACT=silu_and_mul, LATE=release_late(silu_and_mul), num_warps=warps,
            **pdl(x.device, m),
        )  # fmt: skip
        return _finish(target, out, split)
    default = W4_SMALL_GEMM_CONFIG if m <= SMALL_GEMM_ROWS else GEMM_CONFIG
    bm, bn, bk, warps, asked = _with_split(config or default, 4)
    bk = min(bk, group_size)
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    split, per = _split(asked, tiles, k // bk, x.device, _gemm_most(k))
    target = _target(out, split)
    planes = bk % W4_PLANES_K == 0
    _w4_gemm_kernel[(triton.cdiv(m, bm), triton.cdiv(n, bn), split)](
        x, qweight, scales, zeros, target, m, n, k, per * bk, *strides,
        GROUP=group_size, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, UPCAST=dot_upcast(x.dtype),
        PRECISION=dot_precision(x.dtype), SPLIT=split, PLANES=planes,
        X_WHOLE=planes and m > W4_PLANES_X_WHOLE_ROWS, num_warps=warps,
    )  # fmt: skip
    return _finish(target, out, split)


def w4_gemv_config(n: int, k: int, rows: int = 1) -> tuple[int, ...]:
    """The int4 GEMV's launch for ``rows`` rows of x and an [n, k] weight:
    ``W4_GEMV_LONG_K_CONFIG`` for one row and long rows of the weight (k >= ``W4_GEMV_LONG_K``
    and k >= 2n), ``W4_GEMV_WIDE_N_CONFIG`` for n >= ``W4_GEMV_WIDE_N`` k, else
    ``W4_GEMV_CONFIG``."""
    if rows == 1 and k >= max(W4_GEMV_LONG_K, 2 * n):
        return W4_GEMV_LONG_K_CONFIG
    if n >= W4_GEMV_WIDE_N * k:
        return W4_GEMV_WIDE_N_CONFIG
    return W4_GEMV_CONFIG


def _with_split(config: tuple[int, ...], size: int) -> tuple[int, ...]:
    """A launch config of ``size`` entries with its SPLIT appended (0: chosen by :func:`_split`)
    unless it already ends with one."""
    if len(config) == size:
        return (*config, 0)
    if len(config) != size + 1:
        raise ValueError(f"a launch config has {size} entries and an optional SPLIT, got {config}")
    return config


def fp8_gemv_config(n: int, k: int, block_k: int) -> tuple[int, ...]:
    """The GEMV launch for an [n, k] fp8 weight. Per-channel scales (``--quantization fp8``):
    outputs more than the inputs but at most twice them (qkv's) 16 rows of 512 on 8 warps, the
    best of ``kernels.bench.gemv_graph --fp8`` in a graph on an H100 (11.3 against 11.6 us) and
    an H200 (8.4 against 9.4 us, 2026-11-30); more outputs than that (gate_up's)
    ``FP8_GEMV_WIDE_N_CONFIG``; the rest (square, narrow or long rows: o's and down's)
    ``FP8_GEMV_STAGED_CONFIG``, both software-pipelined. Block scales keep chunks within a
    scale block (FP8_GEMV_CONFIG)."""
    if block_k < k:
        return FP8_GEMV_CONFIG
    if n <= k or k >= 8192:
        return FP8_GEMV_STAGED_CONFIG
    if n <= 2 * k:
        return (16, 512, 8)
    return FP8_GEMV_WIDE_N_CONFIG


def fp8_gemm_config(m: int) -> tuple[int, int, int, int]:
    """The FP8 GEMM's tile for ``m`` rows of x (BLOCK_M, BLOCK_N, BLOCK_K, warps)."""
    return FP8_SMALL_GEMM_CONFIG if m <= SMALL_GEMM_ROWS else GEMM_CONFIG


def fp8_linear(
    x: torch.Tensor,  # [M, K]
    weight: torch.Tensor,  # [N, K] float8_e4m3fn
    scale: torch.Tensor,  # [N, ceil(K / block_k)] float32
    block_k: int,
    *,
    config: tuple[int, ...] | None = None,
    silu_and_mul: bool = False,
) -> torch.Tensor:  # [M, N], or [M, N / 2] with silu_and_mul
    """Triton version of :func:`kernels.quant.ref_fp8_linear` (weight-only); ``config`` as
    :func:`w4a16_linear`'s, with a fifth entry for the GEMV: STAGES. ``silu_and_mul``: a
    gate_up weight's product through SiLU-and-mul, in the GEMV's epilogue (one slice of K)
    where the GEMV runs, bit for bit the two kernels' result."""
    check_tensor("weight", weight, ndim=2, dtypes=(torch.float8_e4m3fn,))
    check_tensor("scale", scale, ndim=2, dtypes=(torch.float32,), inner_contiguous=False)
    n, k = weight.shape
    m, _ = _check_x(x, k)
    if block_k < 1 or scale.shape != (n, -(-k // block_k)):
        raise ValueError(
            f"scale {tuple(scale.shape)} must be [N, ceil(K / block_k)] = {(n, -(-k // block_k))}"
        )
    if block_k < k and block_k % 16:
        raise ValueError(f"block_k {block_k} must be a multiple of 16 (or cover the whole row)")
    if silu_and_mul and n % 2:
        raise ValueError(f"a gate_up weight has as many up rows as gate rows, got {n} rows")
    check_devices(x=x, weight=weight, scale=scale)
    if silu_and_mul and m > GEMV_ROWS:  # the GEMM's product, then the SiLU-and-mul kernel
        return triton_layers.silu_and_mul(fp8_linear(x, weight, scale, block_k, config=config))
    out = torch.empty((m, n // 2 if silu_and_mul else n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()
    strides = (x.stride(0), weight.stride(0), scale.stride(0), out.stride(0))
    if m <= GEMV_ROWS:
        launch = config or fp8_gemv_config(n, k, block_k)
        stages = launch[4] if len(launch) == 5 else 1
        bn, bk, warps, asked = _with_split(launch[:4], 3)
        if silu_and_mul and bn % 2:
            raise ValueError(f"silu_and_mul takes an even BLOCK_N, got {config}")
        bk = min(bk, triton.next_power_of_2(k))
        bk = _chunk(bk, block_k) if block_k < k else bk
        split, per = _split(
            1 if silu_and_mul else asked, triton.cdiv(n, bn) * m, triton.cdiv(k, bk), x.device
        )
        target = _target(out, split)
        _fp8_gemv_kernel[(triton.cdiv(n, bn) * m, split)](
            x, weight, scale, target, m, n, k, per * bk, *strides, block_k,
            BLOCK_N=bn, BLOCK_K=bk, EVEN_K=k % bk == 0, SPLIT=split, ROW_SCALE=block_k >= k,
            STAGES=stages, ACT=silu_and_mul, LATE=release_late(silu_and_mul and stages > 1),
            num_warps=warps, **pdl(x.device, m),
        )  # fmt: skip
        return _finish(target, out, split)
    bm, bn, bk, warps, asked = _with_split(config or fp8_gemm_config(m), 4)
    bk = max(16, min(bk, triton.next_power_of_2(k)))
    bk = _chunk(bk, block_k) if block_k < k else bk
    split, per = _split(
        asked, triton.cdiv(m, bm) * triton.cdiv(n, bn), triton.cdiv(k, bk), x.device
    )
    target = _target(out, split)
    _fp8_gemm_kernel[(triton.cdiv(m, bm), triton.cdiv(n, bn), split)](
        x, weight, scale, target, m, n, k, per * bk, *strides, block_k,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, UPCAST=dot_upcast(x.dtype),
        PRECISION=dot_precision(x.dtype), SPLIT=split, num_warps=warps,
    )  # fmt: skip
    return _finish(target, out, split)


QUANT_BLOCK = 1024  # elements of a row per iteration of the per-token quantization


@triton.jit
def _per_token_quant_fp8_kernel(
    x_ptr, q_ptr, s_ptr, K, s_xm, s_qm, INV_MAX: tl.constexpr, BLOCK: tl.constexpr,
    ONE_PASS: tl.constexpr, USE_PDL: tl.constexpr, SOFT_FP8: tl.constexpr,
):  # fmt: skip
    pdl_enter(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    x_row, q_row = x_ptr + row * s_xm, q_ptr + row * s_qm
    if ONE_PASS:  # the whole row in registers: read once
        mask = offs < K
        x = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
        quantize_row(x, q_row, s_ptr, row, offs, mask, INV_MAX, SOFT_FP8)
    else:
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for k0 in range(0, K, BLOCK):
            ks = k0 + offs
            xv = tl.load(x_row + ks, mask=ks < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(xv))
        inv = fp8_row_scale(tl.max(amax, axis=0), s_ptr, row, INV_MAX)
        for k0 in range(0, K, BLOCK):
            ks = k0 + offs
            k_mask = ks < K
            xv = tl.load(x_row + ks, mask=k_mask, other=0.0).to(tl.float32)
            tl.store(q_row + ks, to_e4m3(xv * inv, SOFT_FP8), mask=k_mask)


def per_token_quant_fp8(
    x: torch.Tensor,  # [M, K]
    *,
    block: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # (fp8 [M, K], fp32 [M, 1])
    """Triton version of :func:`kernels.quant.ref_per_token_quant_fp8`, bit for bit: a row of
    up to 16,384 elements in one read (``block`` forces the chunked two-pass loop)."""
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    check_devices(x=x)
    m, k = x.shape
    q, scale = fp8_rows(m, k, x.device)
    if m == 0 or k == 0:
        return q, scale
    whole = triton.next_power_of_2(k)
    one_pass = block is None and whole <= 16384
    bl = whole if one_pass else min(block or QUANT_BLOCK, whole)
    _per_token_quant_fp8_kernel[(m,)](
        x, q, scale, k, x.stride(0), q.stride(0), INV_MAX=INV_FP8_MAX, BLOCK=bl, ONE_PASS=one_pass,
        num_warps=8 if bl >= 4096 else 4, SOFT_FP8=interpreting(), **pdl(x.device, m),
    )  # fmt: skip
    return q, scale
