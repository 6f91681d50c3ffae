"""The batch-1 int4 GEMV with and without integer-to-float conversions, side by side in one run.

    python -m kernels.bench.w4_unpack [--json-out w4_unpack.json]

``kernels.triton_quant``'s GEMV shifts, masks and converts each nibble with ``.to``. Hopper runs
that conversion at an eighth of the fp32 rate, so this keeps the alternative (the 2^23 mantissa
trick: nibbles masked in place and made float with full-rate instructions, x scaled by 16^-i),
which was served for a while and measured slower on an H100 (47 against 58 us for the 8B
gate_up projection, 2026-11-25). Both are timed in the same process on the same weights: each of
Llama-3.1-8B's projections over ``REPS`` distinct AWQ-shaped weights (group 128) back to back in
one CUDA graph, as a decode step runs them, against the bytes of the int4 weights, scales and
zeros at the copy bandwidth. Both use the default tile and split of ``w4a16_linear``, and the
served kernel is also timed at other tiles, splits and with its next chunk loaded ahead
(``LAUNCHES``); every output is checked against the reference first.

Two more forms are timed beside them (2026-11-30), each a candidate for the served GEMV:

- ``shifted``: each nibble shifted to bits 16..19 and OR-ed into the mantissa of 128.0
  (0x43000000), so the float is ``128 + q`` with one shift and one LOP3 and no subtraction: the
  ``128`` is taken out with ``z`` (``sum x (128 + q) - (128 + z) sum x``); the eight nibble
  planes of a chunk are multiplied into one ``[BK/8, BN]`` accumulator summed over K once, at
  the end; a chunk may span several scale groups (up to 16 KB of packed words), the next one
  loads ahead, and a launch may leave K unsplit (one kernel, no partial sums).

Measured once and dropped (one H200, 2026-11-30, the 8B projections): the same planes as
``q - z`` on the tensor cores, eight ``tl.dot`` of K = BK/8 a chunk with x's rows padded to 16,
took 1.3-1.5x the served kernel's time (qkv 16.2 against 11.3 us, gate_up 51.1 against 35.2);
the ``shifted`` kernel with the served kernel's chunks (one group, 4 KB) measured within 1-13%
of it on each projection, so the instructions per nibble are not what bounds the GEMV there.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
import triton
import triton.language as tl

from kernels.triton_common import pdl, pdl_enter

GROUP = 128
SHIFTED_CONFIG = (64, 128, 2, 16)  # (BLOCK_N, BLOCK_K, warps, SPLIT): the served GEMV's
# ((BLOCK_N, BLOCK_K, warps, SPLIT), PREFETCH) of the GEMV: K split automatically (0, about
# two programs per SM) or into more slices, so that more programs keep weight tiles in flight
# (an H100 run of 2026-11-25 found every launch at 25-47% of the copy bandwidth, with no split,
# 1, far slower), and with or without loading the next chunk ahead (``W4_GEMV_PREFETCH``)
# (loading ahead gained nothing on the H100: only the plain loop is swept since 2026-11-30)
LAUNCHES = [((bn, 128, w, split), False) for bn in (64, 128, 256) for w in (2, 4)
            for split in (0, 8, 16)]  # fmt: skip
# one chunk: 4-16 KB of packed words; split 1 (one kernel, no partial sums) or automatic
SHIFTED_LAUNCHES = [(bn, bk, w, split) for bn, bk in ((16, 1024), (32, 512), (32, 1024),
                    (64, 256), (64, 512), (128, 128)) for w in (4, 8) for split in (1, 0)]  # fmt: skip


@triton.jit
def _float_bits(bits):
    """2^23 + the low bits of ``bits``, minus 2^23: the low bits as an exact float32."""
    return bits.to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def _w4_gemv_trick_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, out_ptr, M, N, K, K_PER, s_xm, s_qk, s_sg, s_om,
    GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
):  # fmt: skip
    """The int4 GEMV without integer-to-float conversions (served from f7555b3 until it measured
    slower): each int32 holds rows 8p .. 8p + 7 of a column; the low half's four nibbles and,
    after one shift, the high half's are masked in place, so nibble i of a half is q 16^i, made
    float by the 2^23 mantissa trick (one LOP3 and one add, no per-element shift) and multiplied
    by x 16^-i (exact: powers of two)."""
    pid = tl.program_id(0)
    pid_n = pid // M
    m = (pid % M).to(tl.int64)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
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
    if SPLIT == 1:
        tl.store(out_ptr + m * s_om + offs_n, acc.to(out_ptr.dtype.element_ty), mask=n_mask)
    else:
        tl.store(out_ptr + (pid_k * M + m) * N + offs_n, acc, mask=n_mask)


def trick_gemv(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
    group_size: int,
) -> torch.Tensor:  # fmt: skip
    """``w4a16_linear`` for 1 or 2 rows of x through the mantissa-trick kernel, at the default
    launch."""
    from kernels.triton_quant import W4_GEMV_CONFIG, _finish, _split, _target, _with_split

    m, k = x.shape
    n = qweight.shape[1]
    bn, bk, warps, asked = _with_split(W4_GEMV_CONFIG, 3)
    bk = min(bk, group_size)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    split, per = _split(asked, triton.cdiv(n, bn) * m, k // bk, x.device)
    target = _target(out, split)
    _w4_gemv_trick_kernel[(triton.cdiv(n, bn) * m, split)](
        x, qweight, scales, zeros, target, m, n, k, per * bk, x.stride(0), qweight.stride(0),
        scales.stride(0), out.stride(0), GROUP=group_size, BLOCK_N=bn, BLOCK_K=bk, SPLIT=split,
        num_warps=warps,
    )  # fmt: skip
    return _finish(target, out, split)


@triton.jit
def _plane(packed, J: tl.constexpr):
    """Nibble ``J`` (rows 8p + J) of each int32 as the exact float32 ``128 + q``: shifted to
    bits 16..19 and OR-ed into the mantissa of 128.0, whose unit is bit 16 (one LOP3)."""
    if J < 4:
        t = packed << (16 - 4 * J)
    elif J > 4:
        t = packed >> (4 * J - 16)  # arithmetic: the sign fills bits the mask drops
    else:
        t = packed
    return ((t & 0x000F0000) | 0x43000000).to(tl.float32, bitcast=True)


@triton.jit
def _w4_gemv_shifted_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, out_ptr, M, N, K, K_PER, s_xm, s_qk, s_sg, s_om,
    GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    """The GEMV on ``128 + q`` planes. A chunk of K may span several scale groups (row p of
    the packed tile is in group (k0 + 8p) / GROUP): per chunk sum_j plane_j x_j, less
    (128 + z) sum_j x_j, times s, into a [BK/8, BN] accumulator summed over K once at the end.
    The next chunk's words load before this chunk's arithmetic, the first before the wait."""
    pid = tl.program_id(0)
    pid_n = pid // M
    m = (pid % M).to(tl.int64)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    rows = tl.arange(0, BLOCK_K // 8)
    k_lo = pid_k * K_PER
    k_hi = tl.minimum(k_lo + K_PER, K)
    qw_tile = qw_ptr + rows[:, None].to(tl.int64) * s_qk + offs_n[None, :]
    sz_tile = ((rows * 8) // GROUP)[:, None] * s_sg + offs_n[None, :]
    following = tl.load(qw_tile + (k_lo // 8) * s_qk, mask=n_mask[None, :], other=0)
    pdl_enter(USE_PDL)
    acc = tl.zeros([BLOCK_K // 8, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        packed = following
        ahead = tl.minimum(k0 + BLOCK_K, k_hi - BLOCK_K)  # the last chunk again, from L2
        following = tl.load(qw_tile + (ahead // 8) * s_qk, mask=n_mask[None, :], other=0)
        g0 = (k0 // GROUP) * s_sg
        s = tl.load(s_ptr + g0 + sz_tile, mask=n_mask[None, :], other=0.0).to(tl.float32)
        zb = tl.load(z_ptr + g0 + sz_tile, mask=n_mask[None, :], other=0.0).to(tl.float32) + 128.0
        x_row = x_ptr + m * s_xm + k0 + rows * 8
        part = tl.zeros([BLOCK_K // 8, BLOCK_N], dtype=tl.float32)
        x_sum = tl.zeros([BLOCK_K // 8], dtype=tl.float32)
        for j in tl.static_range(8):
            xj = tl.load(x_row + j).to(tl.float32)
            part += _plane(packed, j) * xj[:, None]
            x_sum += xj
        acc += s * (part - zb * x_sum[:, None])
    res = tl.sum(acc, axis=0)
    if SPLIT == 1:
        tl.store(out_ptr + m * s_om + offs_n, res.to(out_ptr.dtype.element_ty), mask=n_mask)
    else:
        tl.store(out_ptr + (pid_k * M + m) * N + offs_n, res, mask=n_mask)


def _launch_gemv(
    kernel: Any, x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
    zeros: torch.Tensor, group_size: int, config: tuple[int, ...],
) -> torch.Tensor:  # fmt: skip
    from kernels.triton_quant import _chunk, _finish, _split, _target, _with_split

    m, k = x.shape
    n = qweight.shape[1]
    bn, bk, warps, asked = _with_split(config, 3)
    bk = _chunk(bk, k) if bk > group_size else bk  # whole groups, or a part of one
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    split, per = _split(asked, triton.cdiv(n, bn) * m, k // bk, x.device)
    target = _target(out, split)
    kernel[(triton.cdiv(n, bn) * m, split)](
        x, qweight, scales, zeros, target, m, n, k, per * bk, x.stride(0), qweight.stride(0),
        scales.stride(0), out.stride(0), GROUP=group_size, BLOCK_N=bn, BLOCK_K=bk, SPLIT=split,
        num_warps=warps, **pdl(x.device, m),
    )  # fmt: skip
    return _finish(target, out, split)


def shifted_gemv(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
    group_size: int, config: tuple[int, ...] = SHIFTED_CONFIG,
) -> torch.Tensor:  # fmt: skip
    """``w4a16_linear`` for 1 or 2 rows of x through the ``128 + q`` plane kernel; ``config``:
    (BLOCK_N, BLOCK_K, warps[, SPLIT])."""
    return _launch_gemv(_w4_gemv_shifted_kernel, x, qweight, scales, zeros, group_size, config)


@contextlib.contextmanager
def _prefetch(on: bool) -> Iterator[None]:
    """``kernels.triton_quant.W4_GEMV_PREFETCH`` set to ``on`` while launches are captured."""
    from kernels import triton_quant

    was = triton_quant.W4_GEMV_PREFETCH
    triton_quant.W4_GEMV_PREFETCH = on
    try:
        yield
    finally:
        triton_quant.W4_GEMV_PREFETCH = was


def candidates() -> dict[str, list[tuple[str, Callable[..., torch.Tensor]]]]:
    """Each form of the batch-1 GEMV at the launches timed: family -> [(launch, fn)]."""
    from kernels.triton_quant import w4a16_linear

    served = [(str(c) + (" prefetch" if p else ""), _with_prefetch(
        functools.partial(w4a16_linear, config=c), p)) for c, p in LAUNCHES]  # fmt: skip
    return {
        "convert": [("default", w4a16_linear)],
        "trick": [("default", trick_gemv)],
        "served": served,
        "shifted": [(str(c), functools.partial(shifted_gemv, config=c)) for c in SHIFTED_LAUNCHES],
    }


def _with_prefetch(fn: Callable[..., torch.Tensor], on: bool) -> Callable[..., torch.Tensor]:
    def call(*args: Any) -> torch.Tensor:
        with _prefetch(on):
            return fn(*args)

    return call


def time_shape(name: str, n: int, k: int, copy: float, device: str = "cuda") -> dict:
    from kernels.bench import gemv_graph
    from kernels.quant import ref_w4a16_linear

    graph_us = gemv_graph.graph_us
    dev = torch.device(device)
    weights = [
        (
            torch.randint(-(2**31), 2**31, (k // 8, n), dtype=torch.int32, device=dev),
            (torch.rand(k // GROUP, n, device=dev) / 8 + 0.01).to(torch.bfloat16),
            torch.randint(0, 16, (k // GROUP, n), device=dev).to(torch.bfloat16),
        )
        for _ in range(gemv_graph.REPS)
    ]
    x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
    ref = ref_w4a16_linear(x, *weights[0], GROUP).float()
    scale = ref.abs().max().item() + 1e-6

    def run(fn: Callable[..., torch.Tensor]) -> Callable[[], None]:
        def launches() -> None:
            for qw, s, z in weights:
                fn(x, qw, s, z, GROUP)

        return launches

    nbytes = k * n // 2 + 2 * (k // GROUP) * n * 2  # int4 weights, bf16 scales and zeros
    floor_us = nbytes / copy / 1e3
    timed: dict[str, dict[str, float]] = {}
    best: dict[str, tuple[str, float]] = {}
    for family, launches in candidates().items():
        for label, fn in launches:
            err = (fn(x, *weights[0], GROUP).float() - ref).abs().max().item() / scale
            if err > 2e-2:
                raise SystemExit(f"{name}: {family} {label} differs from the reference ({err:.3g})")
            timed.setdefault(family, {})[label] = us = graph_us(run(fn))
            if family not in best or us < best[family][1]:
                best[family] = (label, us)
    line = "  ".join(f"{f} {u:6.1f} us ({100 * floor_us / u:4.1f}%)" for f, (_, u) in best.items())
    print(f"{name:8s} floor {floor_us:6.1f} us  best of each: {line}", flush=True)
    for family, (label, _) in best.items():
        print(f"    {family:8s} best launch {label}", flush=True)
    return {"shape": name, "n": n, "k": k, "group": GROUP, "bytes": nbytes,
            "floor_us": floor_us, "best": {f: {"launch": b, "us": u} for f, (b, u) in best.items()},
            "launches_us": timed}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    from kernels.bench.gemv_graph import sweep

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json-out", default=None)
    return sweep(time_shape, p.parse_args(argv).json_out)


if __name__ == "__main__":
    raise SystemExit(main())
