"""The batch-1 int4 GEMV against its earlier forms, side by side in one run.

    python -m kernels.bench.w4_unpack [--rows 1 2 4 8] [--json-out w4_unpack.json]

Each of Llama-3.1-8B's projections over ``REPS`` distinct AWQ-shaped weights (group 128) back
to back in one CUDA graph, as a decode step runs them, against the bytes of the int4 weights,
scales and zeros at the copy bandwidth; every output is checked against the reference first.

- ``served``: ``kernels.triton_quant``'s GEMV (nibbles in pairs of planes, ``2048 + q`` and
  ``128 + q`` after one shift, chunks of several scale groups, K unsplit) at its default
  launch and at the others of ``LAUNCHES``; from 3 rows the GEMM.
- ``single`` (1-2 rows): the GEMV served before plane pairs (2026-11-30, session 12): each
  ``128 + q`` plane made on its own (a shift, then an AND and an OR: ptxas did not fuse two
  immediates into one LOP3).
- ``convert``: the GEMV it replaced (2026-11-30): one scale group a chunk (4 KB of words), each
  nibble shifted, masked and converted with ``.to`` (16 a clock per SM on Hopper, an eighth of
  the fp32 rate), K split in 16 slices summed by a second kernel.
- ``trick``: the form before that (2^23 mantissa trick with nibbles masked in place and x
  scaled by 16^-i), measured slower than ``convert`` on an H100 (47 against 58 us for the 8B
  gate_up projection, 2026-11-25).
- ``gemm`` (2 rows): the int4 GEMM at its default tile, which took batches of 2 rows until
  the GEMV made each nibble plane once for both (2026-11-30).
- ``unpacked`` and ``planes`` (from 2 rows): the int4 GEMM at other tiles. Chunks of 64 rows
  are unpacked into ``[BK/8, 8, BN]`` and reshaped to ``[BK, BN]`` (through shared memory, once
  for every 16 rows of x) for one ``tl.dot``; chunks of 128 rows skip the reshape: plane ``j``
  of the words (rows ``8p + j``) is made ``q - z`` (exact in bf16) and multiplied by x's
  columns ``8p + j``, eight ``tl.dot`` of K = BK/8 a chunk, x's rows padded to 16.

What one H200 said (2026-11-30): ``128 + q`` planes with the replaced kernel's 4 KB chunks and
split K measured within 1-13% of ``convert`` on each projection, so the instructions per nibble
were not what bounded it; with 8-16 KB chunks, 8 warps and K unsplit the same arithmetic took
0.62-0.85x its time. The planes on the tensor cores took 1.3-1.5x ``convert``'s time at one
row, but at 4 and 8 rows the four 8B projections took 109 and 113 us (128 columns, 8 warps, K
in 8 slices) against 193 for the best unpacked tile of each: the GEMM of up to 16 rows now
runs on the planes (``W4_SMALL_GEMM_CONFIG``).
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable
from typing import Any
from unittest import mock

import torch
import triton
import triton.language as tl

from kernels.triton_common import pdl, pdl_enter
from kernels.triton_quant import (
    _plane,
    _store_row,
    _w4_gemv_chunk,
    _w4_gemv_program,
    w4a16_linear,
)

GROUP = 128
Forms = dict[str, list[tuple[str, Callable[..., torch.Tensor]]]]  # family -> [(launch, fn)]
CONVERT_CONFIG = (64, 128, 2, 16)  # (BLOCK_N, BLOCK_K, warps, SPLIT): its served launch
# the served GEMV's other launches: 4-16 KB of packed words a chunk, 8 or 16 warps, K unsplit
LAUNCHES = [(bn, bk, w, 1) for bn, bk in ((8, 2048), (16, 1024), (16, 2048), (32, 512),
            (32, 1024)) for w in (4, 8, 16)]  # fmt: skip
# the int4 GEMM's launches (BLOCK_M, BLOCK_N, BLOCK_K up to a scale group, warps, SPLIT; 0:
# the default slices of K): chunks of 64 rows unpacked into [BK, BN], chunks of 128 rows on the
# nibble planes (kernels.triton_quant.W4_PLANES_K)
UNPACKED_LAUNCHES = [(16, bn, 64, w, 0) for bn in (32, 64, 128) for w in (4, 8)]
PLANES_LAUNCHES = [(16, bn, 128, w, split) for bn in (64, 128, 256) for w in (4, 8)
                   for split in (0, 8)]  # fmt: skip


@triton.jit
def _program(M, N, BLOCK_N: tl.constexpr):
    """A program's row of x (the rows fastest in the grid: a weight tile's M programs run
    together), slice of K, columns and their mask."""
    pid = tl.program_id(0)
    offs_n = (pid // M) * BLOCK_N + tl.arange(0, BLOCK_N)
    return (pid % M).to(tl.int64), tl.program_id(1), offs_n, offs_n < N


@triton.jit
def _float_bits(bits):
    """2^23 + the low bits of ``bits``, minus 2^23: the low bits as an exact float32."""
    return bits.to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def _w4_gemv_trick_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, out_ptr, M, N, K, K_PER, s_xm, s_qk, s_sg, s_om,
    GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    """The int4 GEMV without integer-to-float conversions (served from f7555b3 until it measured
    slower): each int32 holds rows 8p .. 8p + 7 of a column; the low half's four nibbles and,
    after one shift, the high half's are masked in place, so nibble i of a half is q 16^i, made
    float by the 2^23 mantissa trick (one LOP3 and one add, no per-element shift) and multiplied
    by x 16^-i (exact: powers of two)."""
    pdl_enter(USE_PDL)
    m, pid_k, offs_n, n_mask = _program(M, N, BLOCK_N)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    k_lo = pid_k * K_PER
    rows = tl.arange(0, BLOCK_K // 8)
    quarter = tl.arange(0, 4)
    masks = (0xF << (quarter * 4))[None, :, None]  # [1, 4, 1]
    down = ((127 - 4 * quarter) << 23).to(tl.float32, bitcast=True)[None, :]  # 16^-i, exactly
    x_offs = rows[:, None] * 8 + quarter[None, :]  # [BK/8, 4]: the low halves' rows
    for k0 in range(k_lo, tl.minimum(k_lo + K_PER, K), BLOCK_K):
        packed = tl.load(
            qw_ptr + (k0 // 8 + rows)[:, None].to(tl.int64) * s_qk + offs_n[None, :],
            mask=n_mask[None, :], other=0,
        )  # fmt: skip
        q_lo = _float_bits((packed[:, None, :] & masks) | 0x4B000000)  # q 16^i, row 8p + i
        q_hi = _float_bits(((packed >> 16)[:, None, :] & masks) | 0x4B000000)  # row 8p + 4 + i
        g = k0 // GROUP
        s = tl.load(s_ptr + g * s_sg + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + g * s_sg + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        x_lo = tl.load(x_ptr + m * s_xm + k0 + x_offs).to(tl.float32)  # [BK/8, 4]
        x_hi = tl.load(x_ptr + m * s_xm + k0 + 4 + x_offs).to(tl.float32)
        lo = tl.sum(q_lo * (x_lo * down)[:, :, None], axis=1)  # [BK/8, BN]
        hi = tl.sum(q_hi * (x_hi * down)[:, :, None], axis=1)
        qx = tl.sum(lo + hi, axis=0)  # [BN]
        acc += s * (qx - z * tl.sum(tl.sum(x_lo + x_hi, axis=1), axis=0))
    _store_row(out_ptr, acc, m, offs_n, n_mask, pid_k, M, N, s_om, SPLIT)


def trick_gemv(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
    group_size: int, config: tuple[int, ...] = CONVERT_CONFIG,
) -> torch.Tensor:  # fmt: skip
    """``w4a16_linear`` for 1 or 2 rows of x through the mantissa-trick kernel."""
    return _launch_gemv(_w4_gemv_trick_kernel, x, qweight, scales, zeros, group_size, config)


@triton.jit
def _w4_gemv_convert_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, out_ptr, M, N, K, K_PER, s_xm, s_qk, s_sg, s_om,
    GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    """The GEMV served until 2026-11-30: one scale group a chunk (4 KB of words at its launch),
    each nibble shifted, masked and converted with ``.to``, K split in 16 slices."""
    pdl_enter(USE_PDL)
    m, pid_k, offs_n, n_mask = _program(M, N, BLOCK_N)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    k_lo = pid_k * K_PER
    rows = tl.arange(0, BLOCK_K // 8)
    shifts = (tl.arange(0, 8) * 4)[None, :, None]
    x_offs = rows[:, None] * 8 + tl.arange(0, 8)[None, :]  # [BK/8, 8]
    qw_tile = qw_ptr + rows[:, None].to(tl.int64) * s_qk + offs_n[None, :]
    for k0 in range(k_lo, tl.minimum(k_lo + K_PER, K), BLOCK_K):
        packed = tl.load(qw_tile + (k0 // 8) * s_qk, mask=n_mask[None, :], other=0)
        q = ((packed[:, None, :] >> shifts) & 0xF).to(tl.float32)  # [BK/8, 8, BN]
        g = k0 // GROUP
        s = tl.load(s_ptr + g * s_sg + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + g * s_sg + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        xv = tl.load(x_ptr + m * s_xm + k0 + x_offs).to(tl.float32)  # [BK/8, 8]
        qx = tl.sum(tl.sum(q * xv[:, :, None], axis=1), axis=0)  # [BN]
        acc += s * (qx - z * tl.sum(tl.sum(xv, axis=1), axis=0))
    _store_row(out_ptr, acc, m, offs_n, n_mask, pid_k, M, N, s_om, SPLIT)


def _launch_gemv(
    kernel: Any, x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
    zeros: torch.Tensor, group_size: int, config: tuple[int, ...],
) -> torch.Tensor:  # fmt: skip
    from kernels.triton_quant import _finish, _split, _target, _with_split

    m, k = x.shape
    n = qweight.shape[1]
    bn, bk, warps, asked = _with_split(config, 3)
    bk = min(bk, group_size)  # one scale group a chunk at most
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    split, per = _split(asked, triton.cdiv(n, bn) * m, k // bk, x.device)
    target = _target(out, split)
    kernel[(triton.cdiv(n, bn) * m, split)](
        x, qweight, scales, zeros, target, m, n, k, per * bk, x.stride(0), qweight.stride(0),
        scales.stride(0), out.stride(0), GROUP=group_size, BLOCK_N=bn, BLOCK_K=bk, SPLIT=split,
        num_warps=warps, **pdl(x.device, m),
    )  # fmt: skip
    return _finish(target, out, split)


def convert_gemv(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
    group_size: int, config: tuple[int, ...] = CONVERT_CONFIG,
) -> torch.Tensor:  # fmt: skip
    """``w4a16_linear`` for 1 or 2 rows of x through the GEMV served until 2026-11-30;
    ``config``: (BLOCK_N, BLOCK_K <= group, warps[, SPLIT])."""
    return _launch_gemv(_w4_gemv_convert_kernel, x, qweight, scales, zeros, group_size, config)


@triton.jit
def _w4_gemv_single_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, out_ptr, M, N, K, K_PER, s_xm, s_qk, s_sg, s_om, GROUPS,
    GROUP: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    """The GEMV served until 2026-11-30 (session 12), on ``128 + q`` planes made one a shift
    (``kernels.triton_quant._plane``), for ``ROWS`` (1 or 2) rows of x at once: each plane is
    made once and multiplied into each row's sums (2D tensors only: a [ROWS, BK/8, BN] form
    measured 2-3x slower). A chunk of K may span several scale groups (row p of the packed
    tile is in group (k0 + 8p) / GROUP): per chunk sum_j plane_j x_j, less (128 + z) sum_j x_j,
    times s, into a [BK/8, BN] accumulator per row, summed over K once at the end. The next
    chunk's words load before this chunk's arithmetic, the first before the wait."""
    m0, m1, pid_k, offs_n, n_mask, k_lo, k_hi, qw_tile, sz_tile, x0_row, x1_row = _w4_gemv_program(
        x_ptr, qw_ptr, M, N, K, K_PER, s_xm, s_qk, s_sg, GROUPS, GROUP, ROWS, BLOCK_N, BLOCK_K
    )
    following = tl.load(qw_tile + (k_lo // 8) * s_qk, mask=n_mask[None, :], other=0)
    pdl_enter(USE_PDL)
    acc0 = tl.zeros([BLOCK_K // 8, BLOCK_N], dtype=tl.float32)
    acc1 = tl.zeros([BLOCK_K // 8, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        packed = following
        following, s, z = _w4_gemv_chunk(
            qw_tile, s_ptr, z_ptr, sz_tile, n_mask, k0, k_hi, s_qk, s_sg, GROUP, BLOCK_K
        )
        zb = z + 128.0
        part0 = tl.zeros([BLOCK_K // 8, BLOCK_N], dtype=tl.float32)
        part1 = tl.zeros([BLOCK_K // 8, BLOCK_N], dtype=tl.float32)
        sum0 = tl.zeros([BLOCK_K // 8], dtype=tl.float32)
        sum1 = tl.zeros([BLOCK_K // 8], dtype=tl.float32)
        for j in tl.static_range(8):
            plane = _plane(packed, j)
            xj = tl.load(x0_row + k0 + j).to(tl.float32)
            part0 += plane * xj[:, None]
            sum0 += xj
            if ROWS > 1:
                xj = tl.load(x1_row + k0 + j).to(tl.float32)
                part1 += plane * xj[:, None]
                sum1 += xj
        acc0 += s * (part0 - zb * sum0[:, None])
        if ROWS > 1:
            acc1 += s * (part1 - zb * sum1[:, None])
    _store_row(out_ptr, tl.sum(acc0, axis=0), m0, offs_n, n_mask, pid_k, M, N, s_om, SPLIT)
    if ROWS > 1:
        mask = n_mask & (m0 + 1 + tl.zeros([BLOCK_N], dtype=tl.int64) < M)
        _store_row(out_ptr, tl.sum(acc1, axis=0), m1, offs_n, mask, pid_k, M, N, s_om, SPLIT)


def single_w4a16_linear(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
    group_size: int, *, config: tuple[int, ...] | None = None,
) -> torch.Tensor:  # fmt: skip
    """``w4a16_linear`` as served before plane pairs (2026-11-30, session 12): 1-2 rows of x
    on the GEMV with each plane made alone; other batches (and any ``config``) go to the
    served function. A decode step runs on it with ``kernels.triton_quant.w4a16_linear``
    replaced by it (``scripts/device/w4_gemv.sh``, ``awq-single``)."""
    from kernels import triton_quant as tq

    m, k = x.shape
    if config is not None or not 0 < m <= tq.W4_GEMV_ROWS or group_size % tq.W4_PLANES_K:
        return w4a16_linear(x, qweight, scales, zeros, group_size, config=config)
    n = qweight.shape[1]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    bn, bk, warps, asked = tq._with_split(tq.W4_GEMV_CONFIG, 3)
    bk = tq._chunk(bk, k)
    split, per = tq._split(asked, triton.cdiv(n, bn), k // bk, x.device)
    target = tq._target(out, split)
    _w4_gemv_single_kernel[(triton.cdiv(n, bn), split)](
        x, qweight, scales, zeros, target, m, n, k, per * bk, x.stride(0), qweight.stride(0),
        scales.stride(0), out.stride(0), 1, GROUP=group_size, ROWS=m, BLOCK_N=bn, BLOCK_K=bk,
        SPLIT=split, num_warps=warps, **pdl(x.device, m),
    )  # fmt: skip
    return tq._finish(target, out, split)


def _gemm(*args: Any, config: tuple[int, ...] | None = None) -> torch.Tensor:
    """``w4a16_linear`` with every batch on the int4 GEMM (its default tile, or ``config``)."""
    from kernels import triton_quant

    with mock.patch.object(triton_quant, "W4_GEMV_ROWS", 0):
        return w4a16_linear(*args, config=config)


def candidates(rows: int = 1) -> Forms:
    """Each form of the GEMV for ``rows`` rows of x at the launches timed: family -> [(launch,
    fn)]; from 2 rows the int4 GEMM too (the GEMV takes up to ``W4_GEMV_ROWS``), its tiles
    unpacked into ``[BK, BN]`` and on the nibble planes as two families."""
    from kernels.triton_quant import W4_GEMV_ROWS

    gemm: Forms = {
        family: [(str(c), functools.partial(_gemm, config=c)) for c in launches]
        for family, launches in (("unpacked", UNPACKED_LAUNCHES), ("planes", PLANES_LAUNCHES))
    }
    single: Forms = {"single": [("default", single_w4a16_linear)]}
    if rows > W4_GEMV_ROWS:
        return {"served": [("default", w4a16_linear)], **gemm}
    served = [("default", w4a16_linear)]
    served += [(str(c), functools.partial(w4a16_linear, config=c)) for c in LAUNCHES]
    forms: Forms = {"served": served, **single, "convert": [("default", convert_gemv)],
             "trick": [("default", trick_gemv)]}  # fmt: skip
    if rows > 1:
        forms["gemm"] = [("default", _gemm)]
        forms.update(gemm)
    return forms


def awq_weights(
    n: int, k: int, device: torch.device
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """``gemv_graph.REPS`` distinct AWQ-shaped weights of an [n, k] projection: packed words
    ``[K/8, N]``, bf16 scales and zeros of groups of ``GROUP``."""
    from kernels.bench import gemv_graph

    return [
        (
            torch.randint(-(2**31), 2**31, (k // 8, n), dtype=torch.int32, device=device),
            (torch.rand(k // GROUP, n, device=device) / 8 + 0.01).to(torch.bfloat16),
            torch.randint(0, 16, (k // GROUP, n), device=device).to(torch.bfloat16),
        )
        for _ in range(gemv_graph.REPS)
    ]


def weight_bytes(n: int, k: int) -> int:
    """The bytes such a weight reads: int4 words, bf16 scales and zeros."""
    return k * n // 2 + 2 * (k // GROUP) * n * 2


def time_shape(name: str, n: int, k: int, copy: float, device: str = "cuda", rows: int = 1) -> dict:
    from kernels.bench import gemv_graph
    from kernels.quant import ref_w4a16_linear

    graph_us = gemv_graph.graph_us
    dev = torch.device(device)
    weights = awq_weights(n, k, dev)
    x = torch.randn(rows, k, device=dev, dtype=torch.bfloat16)
    ref = ref_w4a16_linear(x, *weights[0], GROUP).float()
    scale = ref.abs().max().item() + 1e-6

    def run(fn: Callable[..., torch.Tensor]) -> Callable[[], None]:
        def launches() -> None:
            for qw, s, z in weights:
                fn(x, qw, s, z, GROUP)

        return launches

    nbytes = weight_bytes(n, k)
    floor_us = nbytes / copy / 1e3
    timed: dict[str, dict[str, float]] = {}
    best: dict[str, tuple[str, float]] = {}
    for family, launches in candidates(rows).items():
        for label, fn in launches:
            err = (fn(x, *weights[0], GROUP).float() - ref).abs().max().item() / scale
            if err > 2e-2:
                raise SystemExit(f"{name}: {family} {label} differs from the reference ({err:.3g})")
            timed.setdefault(family, {})[label] = us = graph_us(run(fn))
            if family not in best or us < best[family][1]:
                best[family] = (label, us)
    line = "  ".join(f"{f} {u:6.1f} us ({100 * floor_us / u:4.1f}%)" for f, (_, u) in best.items())
    print(f"{name:8s} x{rows} floor {floor_us:6.1f} us  best of each: {line}", flush=True)
    for family, (label, _) in best.items():
        print(f"    {family:8s} best launch {label}", flush=True)
    return {"shape": name, "rows": rows, "n": n, "k": k, "group": GROUP, "bytes": nbytes,
            "floor_us": floor_us, "best": {f: {"launch": b, "us": u} for f, (b, u) in best.items()},
            "launches_us": timed}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    from kernels.bench.gemv_graph import sweep

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1], help="rows of x (batch sizes)")
    p.add_argument("--json-out", default=None, help="one file per row count: NAME-x<rows>.json")
    args = p.parse_args(argv)
    for rows in args.rows:
        out = None if args.json_out is None else args.json_out.replace(".json", f"-x{rows}.json")
        sweep(functools.partial(time_shape, rows=rows), out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
