"""What software pipelining gives the short-batch GEMVs: their chunk loads issued
``STAGES - 1`` chunks ahead through shared memory (``tl.range(..., num_stages=STAGES)``:
cp.async on Hopper) against one chunk ahead in registers or each chunk loaded as used.

    python -m kernels.bench.gemv_stages [--kinds int4 fp8 bf16] [--rows 1 2 4 8]
        [--json-out gemv_stages.json]

A GEMV loop of a plain ``range`` is left alone by Triton's pipeliner: at most the one chunk a
program prefetches by hand is in flight, and the small projections of a batch-1 step (qkv, o,
down: 256-768 programs for 132 SMs) then have too few bytes in flight to reach the copy
bandwidth (``kernels.bench.w4_ceiling``: the int4 GEMV's words alone take 46 of its 55 us a
layer on an H200, against a 27 us floor). The bf16 GEMV (``kernels.triton_gemv``) and the FP8
one (``kernels.triton_quant``) take a ``STAGES`` in their launch; each of their launches here
goes through the served function. The int4 GEMV's pipelined form is this module's
``_w4_gemv_staged_kernel`` (one row of x: the served kernel's planes and sums, its loads in the
loop for the pipeliner; "x whole": each chunk of x loaded whole and split into its eight
columns in registers, where the served kernel loads each column with a stride). A pipelined
kernel waits for the kernel before it (programmatic
launch) before its loop, since the pipeliner's prologue loads x too. Each of Llama-3.1-8B's
projections over distinct weights in one CUDA graph, as ``kernels.bench.gemv_graph`` times
them, against the served launch; a launch gives the served bits only at the served chunk
length (a row's sums are split by it).
"""

from __future__ import annotations

import argparse
import functools
import itertools
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from kernels.triton_common import pdl, pdl_enter
from kernels.triton_quant import _plane_pair, _store_row, _w4_gemv_program

STAGES = (2, 3, 4)
# the launches timed beside the served one: bf16 (BLOCK_N, BLOCK_K, warps, STAGES), FP8
# (BLOCK_N, BLOCK_K, warps, SPLIT, STAGES), int4 (BLOCK_N, BLOCK_K, warps) at each of STAGES
BF16_LAUNCHES = [(8, 1024, 8, 1), (4, 512, 8, 1), (16, 1024, 8, 1), (8, 256, 4, 1)] + [
    (bn, bk, 4, s) for bn in (8, 16) for bk in (256, 512) for s in STAGES
]
FP8_LAUNCHES = [(8, 1024, 8, 1, 1), (16, 512, 8, 1, 1), (8, 512, 4, 1, 1), (2, 2048, 4, 1, 1)] + [
    (bn, bk, 4, 1, s) for bn in (8, 16) for bk in (256, 512) for s in STAGES
]
INT4_LAUNCHES = [(16, 1024, 8), (16, 512, 8), (32, 512, 8), (16, 512, 4), (32, 256, 4)]
Gemv = Callable[..., torch.Tensor]


@triton.jit
def _x_columns(xw, BLOCK_K: tl.constexpr):
    """A chunk of x loaded whole ([BLOCK_K], float32) as its eight columns ``8p + j``, each
    [BLOCK_K / 8]: three splits of pairs in registers, no strided loads."""
    even, odd = tl.split(tl.reshape(xw, [BLOCK_K // 8, 4, 2]))  # columns 0 2 4 6 / 1 3 5 7
    e04, e26 = tl.split(tl.reshape(even, [BLOCK_K // 8, 2, 2]))
    o15, o37 = tl.split(tl.reshape(odd, [BLOCK_K // 8, 2, 2]))
    x0, x4 = tl.split(e04)
    x2, x6 = tl.split(e26)
    x1, x5 = tl.split(o15)
    x3, x7 = tl.split(o37)
    return x0, x1, x2, x3, x4, x5, x6, x7


@triton.jit
def _pair(part, lo, hi, packed, i: tl.constexpr, xl, xh, MAGIC_LO, MAGIC_HI):
    """Nibble planes ``2i`` and ``2i + 1`` into a row's sums, as the served GEMV adds them."""
    plane_lo, plane_hi = _plane_pair(packed, i, MAGIC_LO, MAGIC_HI)
    part += plane_lo * xl[:, None]
    part += plane_hi * xh[:, None]
    return part, lo + xl, hi + xh


@triton.jit
def _w4_gemv_staged_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, out_ptr, N, K, s_qk, s_sg, MAGIC_LO, MAGIC_HI,
    GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr,
    X_WHOLE: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    """One row of x, AWQ words: the served ``_w4_gemv_kernel``'s planes and sums. ``X_WHOLE``:
    each chunk of x loaded whole (16-byte loads the pipeliner can carry) and split into its
    columns in registers, where the served kernel loads each column ``8p + j`` with a stride
    of 8 elements (two bytes a lane, which cp.async cannot carry: loaded as used)."""
    m0, _m1, pid_k, offs_n, n_mask, k_lo, k_hi, qw_tile, sz_tile, x0_row, _x1 = _w4_gemv_program(
        x_ptr, qw_ptr, 1, N, K, K, 0, s_qk, s_sg, 1, GROUP, 1, BLOCK_N, BLOCK_K
    )
    pdl_enter(USE_PDL)
    acc0 = tl.zeros([BLOCK_K // 8, BLOCK_N], dtype=tl.float32)
    for k0 in tl.range(k_lo, k_hi, BLOCK_K, num_stages=STAGES):
        packed = tl.load(qw_tile + (k0 // 8) * s_qk, mask=n_mask[None, :], other=0)
        g0 = (k0 // GROUP) * s_sg
        s = tl.load(s_ptr + g0 + sz_tile, mask=n_mask[None, :], other=0.0).to(tl.float32)
        z = tl.load(z_ptr + g0 + sz_tile, mask=n_mask[None, :], other=0.0).to(tl.float32)
        part0 = tl.zeros([BLOCK_K // 8, BLOCK_N], dtype=tl.float32)
        lo0 = tl.zeros([BLOCK_K // 8], dtype=tl.float32)
        hi0 = tl.zeros([BLOCK_K // 8], dtype=tl.float32)
        if X_WHOLE:
            xw = tl.load(x_ptr + k0 + tl.arange(0, BLOCK_K)).to(tl.float32)
            c0, c1, c2, c3, c4, c5, c6, c7 = _x_columns(xw, BLOCK_K)
            part0, lo0, hi0 = _pair(part0, lo0, hi0, packed, 0, c0, c1, MAGIC_LO, MAGIC_HI)
            part0, lo0, hi0 = _pair(part0, lo0, hi0, packed, 1, c2, c3, MAGIC_LO, MAGIC_HI)
            part0, lo0, hi0 = _pair(part0, lo0, hi0, packed, 2, c4, c5, MAGIC_LO, MAGIC_HI)
            part0, lo0, hi0 = _pair(part0, lo0, hi0, packed, 3, c6, c7, MAGIC_LO, MAGIC_HI)
        else:
            for i in tl.static_range(4):
                xl = tl.load(x0_row + k0 + 2 * i).to(tl.float32)
                xh = tl.load(x0_row + k0 + 2 * i + 1).to(tl.float32)
                part0, lo0, hi0 = _pair(part0, lo0, hi0, packed, i, xl, xh, MAGIC_LO, MAGIC_HI)
        acc0 += s * (part0 - (2048.0 * lo0 + 128.0 * hi0)[:, None] - z * (lo0 + hi0)[:, None])
    _store_row(out_ptr, tl.sum(acc0, axis=0), m0, offs_n, n_mask, pid_k, 1, N, 0, 1)


def bf16_forms(n: int, k: int) -> tuple[Gemv, dict[str, Gemv]]:
    """(served, {launch: fn}) for an [n, k] bf16 weight, each ``fn(x, w) -> out``; the launches
    (BLOCK_N, BLOCK_K, warps, STAGES) through the served ``gemv`` (1 stage: one chunk ahead in
    registers)."""
    from kernels.triton_gemv import gemv, pick_config

    served = pick_config(n, k, torch.device("cuda"))
    launches = {(*served, 1)[:4], *BF16_LAUNCHES}
    forms: dict[str, Gemv] = {
        str(c): functools.partial(gemv, config=c) for c in sorted(launches) if k % c[1] == 0
    }
    return functools.partial(gemv, config=served), forms


def _fp8(
    x: torch.Tensor, w: torch.Tensor, *, scale: torch.Tensor, config: tuple[int, ...] | None
) -> torch.Tensor:
    from kernels.triton_quant import fp8_linear

    return fp8_linear(x, w, scale, w.shape[1], config=config)


def fp8_forms(n: int, k: int, scale: torch.Tensor) -> tuple[Gemv, dict[str, Gemv]]:
    """As :func:`bf16_forms` for e4m3 weights with one scale a row, through ``fp8_linear``:
    (BLOCK_N, BLOCK_K, warps, SPLIT, STAGES)."""
    from kernels.triton_quant import fp8_gemv_config

    launches = {(*fp8_gemv_config(n, k, k), 1, 1)[:5], *FP8_LAUNCHES}
    forms: dict[str, Gemv] = {
        str(c): functools.partial(_fp8, scale=scale, config=c)
        for c in sorted(launches)
        if k % c[1] == 0
    }
    return functools.partial(_fp8, scale=scale, config=None), forms


def int4_forms(n: int, k: int) -> tuple[Gemv, dict[str, Gemv]]:
    from kernels.bench.w4_unpack import GROUP
    from kernels.triton_quant import PLANE_MAGIC_HI, PLANE_MAGIC_LO, w4_gemv_config, w4a16_linear

    def staged(bn: int, bk: int, warps: int, stages: int, whole: bool) -> Gemv:
        def fn(x: torch.Tensor, w: tuple[torch.Tensor, ...]) -> torch.Tensor:
            qw, s, z = w
            out = torch.empty(1, n, device=x.device, dtype=x.dtype)
            _w4_gemv_staged_kernel[(triton.cdiv(n, bn), 1)](
                x, qw, s, z, out, n, k, qw.stride(0), s.stride(0), PLANE_MAGIC_LO,
                PLANE_MAGIC_HI, GROUP=GROUP, BLOCK_N=bn, BLOCK_K=bk, STAGES=stages,
                X_WHOLE=whole, num_warps=warps, **pdl(x.device, 1),
            )  # fmt: skip
            return out

        return fn

    bn, bk, warps = w4_gemv_config(n, k)[:3]
    launches = {(bn, bk, warps), *INT4_LAUNCHES}
    forms = {
        str((*c, s)) + (" x whole" if whole else ""): staged(c[0], c[1], c[2], s, whole)
        for c, s, whole in itertools.product(sorted(launches), STAGES, (False, True))
        if k % c[1] == 0
    }

    def served(x: torch.Tensor, w: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return w4a16_linear(x, w[0], w[1], w[2], GROUP)

    return served, forms


def time_shape(
    kind: str, name: str, n: int, k: int, copy: float, rows: int = 1, device: str = "cuda"
) -> dict:
    """One projection's served GEMV and each launch of ``kind`` for ``rows`` rows of x, in a
    graph; whether each launch gives the served bits (only launches of the served chunk length
    can) and, from two rows, each row the bits it gets alone (what a verify step needs)."""
    from kernels.bench import gemv_graph
    from kernels.bench.w4_unpack import awq_weights, weight_bytes

    dev = torch.device(device)
    x = torch.randn(rows, k, device=dev, dtype=torch.bfloat16)
    weights: list
    if kind == "bf16":
        weights = [
            torch.randn(n, k, device=dev, dtype=torch.bfloat16) for _ in range(gemv_graph.REPS)
        ]
        served, forms = bf16_forms(n, k)
        nbytes = 2 * n * k
    elif kind == "fp8":
        weights = [
            torch.randn(n, k, device=dev).clamp(-400, 400).to(torch.float8_e4m3fn)
            for _ in range(gemv_graph.REPS)
        ]
        scale = torch.rand(n, 1, device=dev) + 0.5
        served, forms = fp8_forms(n, k, scale)
        nbytes = n * k
    else:
        if rows != 1:
            raise ValueError("the staged int4 GEMV takes one row of x")
        weights = awq_weights(n, k, dev)
        served, forms = int4_forms(n, k)
        nbytes = weight_bytes(n, k)
    want = served(x, weights[0])

    def run(fn: Callable) -> Callable[[], None]:
        def launches() -> None:
            for w in weights:
                fn(x, w)

        return launches

    timed = {"served": gemv_graph.graph_us(run(served))}
    same: dict[str, bool] = {}
    alone: dict[str, bool] = {}
    for label, fn in forms.items():
        got = fn(x, weights[0])
        same[label] = bool(torch.equal(got, want))
        if rows > 1:
            alone[label] = all(
                torch.equal(fn(x[i : i + 1], weights[0]), got[i : i + 1]) for i in range(rows)
            )
        timed[label] = gemv_graph.graph_us(run(fn))
    floor = nbytes / copy / 1e3
    best = min(forms, key=lambda c: timed[c])
    print(f"{kind:5s} {name:8s} x{rows} floor {floor:6.1f} us  served {timed['served']:6.1f} "
          f"({100 * floor / timed['served']:4.1f}%)  best {best} {timed[best]:6.1f} "
          f"({100 * floor / timed[best]:4.1f}%)  served bits: {sum(same.values())}/{len(same)}"
          + (f"  rows alone: {sum(alone.values())}/{len(alone)}" if alone else ""),
          flush=True)  # fmt: skip
    weights.clear()
    torch.cuda.empty_cache()
    return {"kind": kind, "shape": name, "rows": rows, "n": n, "k": k, "bytes": nbytes,
            "floor_us": floor, "served_us": timed["served"], "best": best,
            "best_us": timed[best], "all_us": timed, "served_bits": same,
            "rows_alone_bits": alone}  # fmt: skip


def _rows(kind: str, rows: list[int]) -> list[int]:
    """The rows of x a kind's GEMV takes: bf16 up to 8, FP8 up to ``GEMV_ROWS`` (the GEMM
    above), int4 here one."""
    from kernels.triton_quant import GEMV_ROWS

    most = {"bf16": 8, "fp8": GEMV_ROWS, "int4": 1}[kind]
    return [m for m in rows if m <= most]


def main(argv: list[str] | None = None) -> int:
    from kernels.bench.gemv_graph import SHAPES
    from kernels.bench.roofline import copy_bandwidth, write_results

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--kinds", nargs="+", choices=("bf16", "fp8", "int4"),
                   default=["int4", "fp8", "bf16"])  # fmt: skip
    p.add_argument("--rows", type=int, nargs="+", default=[1],
                   help="rows of x (bf16 up to 8; fp8 and int4 take one)")  # fmt: skip
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv)
    if min(args.rows) < 1 or max(args.rows) > 8:
        p.error("--rows takes 1 to 8")
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA GPU")
    copy = copy_bandwidth()
    print(f"copy bandwidth {copy:.0f} GB/s", flush=True)
    results = [
        time_shape(kind, name, n, k, copy, rows)
        for kind in args.kinds
        for rows in _rows(kind, args.rows)
        for name, (n, k) in SHAPES.items()
    ]
    if args.json_out:
        from kernels.bench.gemv_graph import REPS

        write_results(args.json_out, copy, results, reps=REPS)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
