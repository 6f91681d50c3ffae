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
"""

from __future__ import annotations

import argparse
import contextlib
import functools
from collections.abc import Callable, Iterator

import torch
import triton
import triton.language as tl

GROUP = 128
# ((BLOCK_N, BLOCK_K, warps, SPLIT), PREFETCH) of the GEMV: K split automatically (0, about
# two programs per SM) or into more slices, so that more programs keep weight tiles in flight
# (an H100 run of 2026-11-25 found every launch at 25-47% of the copy bandwidth, with no split,
# 1, far slower), and with or without loading the next chunk ahead (``W4_GEMV_PREFETCH``)
LAUNCHES = [((bn, 128, w, split), prefetch) for bn in (64, 128, 256) for w in (2, 4)
            for split in (0, 8, 16) for prefetch in (False, True)]  # fmt: skip


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


def time_shape(name: str, n: int, k: int, copy: float, device: str = "cuda") -> dict:
    from kernels.bench import gemv_graph
    from kernels.quant import ref_w4a16_linear
    from kernels.triton_quant import w4a16_linear

    REPS, graph_us = gemv_graph.REPS, gemv_graph.graph_us
    dev = torch.device(device)
    weights = [
        (
            torch.randint(-(2**31), 2**31, (k // 8, n), dtype=torch.int32, device=dev),
            (torch.rand(k // GROUP, n, device=dev) / 8 + 0.01).to(torch.bfloat16),
            torch.randint(0, 16, (k // GROUP, n), device=dev).to(torch.bfloat16),
        )
        for _ in range(REPS)
    ]
    x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
    ref = ref_w4a16_linear(x, *weights[0], GROUP).float()
    scale = ref.abs().max().item() + 1e-6
    for fn in (w4a16_linear, trick_gemv):
        err = (fn(x, *weights[0], GROUP).float() - ref).abs().max().item() / scale
        if err > 2e-2:
            raise SystemExit(f"{name}: {fn.__name__} differs from the reference ({err:.3g})")

    def run(fn: Callable[..., torch.Tensor]) -> Callable[[], None]:
        def launches() -> None:
            for qw, s, z in weights:
                fn(x, qw, s, z, GROUP)

        return launches

    nbytes = k * n // 2 + 2 * (k // GROUP) * n * 2  # int4 weights, bf16 scales and zeros
    floor_us = nbytes / copy / 1e3
    convert, trick = graph_us(run(w4a16_linear)), graph_us(run(trick_gemv))
    # the served kernel at other launches
    launches: dict[str, float] = {}
    for config, prefetch in LAUNCHES:
        fn = functools.partial(w4a16_linear, config=config)
        with _prefetch(prefetch):
            err = (fn(x, *weights[0], GROUP).float() - ref).abs().max().item() / scale
            if err <= 2e-2:
                launches[f"{config}{' prefetch' if prefetch else ''}"] = graph_us(run(fn))
    best = min(launches, key=lambda c: launches[c]) if launches else "default"
    best_us = launches.get(best, trick)
    print(f"{name:8s} floor {floor_us:6.1f} us  converting {convert:6.1f} us "
          f"({100 * floor_us / convert:5.1f}% of copy)  mantissa trick {trick:6.1f} us "
          f"({100 * floor_us / trick:5.1f}%)  best launch {best} {best_us:6.1f} us "
          f"({100 * floor_us / best_us:5.1f}%)", flush=True)  # fmt: skip
    return {"shape": name, "n": n, "k": k, "group": GROUP, "bytes": nbytes,
            "floor_us": floor_us, "convert_us": convert, "trick_us": trick, "best": best,
            "best_us": best_us, "launches_us": launches}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    from kernels.bench.gemv_graph import sweep

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json-out", default=None)
    return sweep(time_shape, p.parse_args(argv).json_out)


if __name__ == "__main__":
    raise SystemExit(main())
