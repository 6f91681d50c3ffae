"""The bf16 GEMMs of a large decode batch (64-256 rows) against cuBLAS: a probe, not a kept kernel.

    python -m kernels.bench.decode_gemm [--rows 64 128 256] [--json-out decode_gemm.json]

At batch 256 a Llama-3.1-8B decode step's four projections take ~7 ms of cuBLAS on an H100
(gate_up ~104 us a layer: 578 TFLOP/s), where the tensor cores and the weight bytes each allow
~80 us. One suspect is wave quantization: 256 x 28672 outputs in 128 x 256 tiles are 224 tiles
for 132 SMs (two waves for 1.7 waves of work), and the smaller projections have fewer tiles than
SMs. Each projection runs over ``REPS`` distinct weights back to back in one CUDA graph (as the
decode graph replays its layers), every output checked against a float32 reference first:

- ``cublas``: ``F.linear`` as served; ``cublaslt``: the same with cuBLASLt preferred.
- ``split (BM, BN, BK, warps, stages, S)``: a Triton tile GEMM, K cut in ``S`` slices whose fp32
  partials a second kernel sums (``S`` = 1: one kernel storing bf16).
- ``streamk (BM, BN, BK, warps, stages)``: one program an SM, each taking an equal share of the
  (tile, K-step) iterations; a tile cut between programs is finished by the program holding its
  last K-step, which adds the earlier pieces' fp32 partials in program order (deterministic;
  each program walks its share from the end, so the piece it publishes is its first).
"""

from __future__ import annotations

import argparse
import functools
import itertools
from collections.abc import Callable

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
REPS = 24


def ref_gemm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The torch reference both probe GEMMs are tested against: ``x @ w^T`` in float32."""
    return x.float() @ w.float().t()


@triton.jit
def _tile_dot(x_ptr, w_ptr, M, N, stride_xm, stride_wn, pid_m, pid_n, k_first, k_last,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    """fp32 ``x[m tile, k] @ w[n tile, k]^T`` over the K-steps ``[k_first, k_last)``."""
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
    b_ptrs = w_ptr + offs_n[None, :] * stride_wn + offs_k[:, None]
    m_ok = offs_m[:, None] < M
    n_ok = offs_n[None, :] < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for step in range(k_first, k_last):
        a = tl.load(a_ptrs + step * BLOCK_K, mask=m_ok, other=0.0)
        b = tl.load(b_ptrs + step * BLOCK_K, mask=n_ok, other=0.0)
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def _split_kernel(x_ptr, w_ptr, out_ptr, part_ptr, M, N, stride_xm, stride_wn, stride_om,
                  TILES_M, STEPS_PER_SLICE, SPLIT: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    pid = tl.program_id(0)
    pid_s = tl.program_id(1)
    pid_m = pid % TILES_M
    pid_n = pid // TILES_M
    acc = _tile_dot(x_ptr, w_ptr, M, N, stride_xm, stride_wn, pid_m, pid_n,
                    pid_s * STEPS_PER_SLICE, (pid_s + 1) * STEPS_PER_SLICE,
                    BLOCK_M, BLOCK_N, BLOCK_K)  # fmt: skip
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    if SPLIT == 1:
        tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], acc, mask=mask)
    else:
        base = part_ptr + pid_s * M * N
        tl.store(base + offs_m[:, None] * N + offs_n[None, :], acc, mask=mask)


@triton.jit
def _sum_slices(part_ptr, out_ptr, MN, SPLIT: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < MN
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(SPLIT):
        acc += tl.load(part_ptr + s * MN + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, acc, mask=mask)


def split_gemm(x: torch.Tensor, w: torch.Tensor, config: tuple[int, ...],
               part: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    bm, bn, bk, warps, stages, split = config
    m, k = x.shape
    n = w.shape[0]
    if k % (bk * split):
        raise ValueError(f"K ({k}) is not a multiple of BLOCK_K x SPLIT ({bk} x {split})")
    out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    tiles_m, tiles_n = triton.cdiv(m, bm), triton.cdiv(n, bn)
    if split > 1 and part is None:
        part = torch.empty(split, m, n, device=x.device, dtype=torch.float32)
    _split_kernel[(tiles_m * tiles_n, split)](
        x, w, out, part if split > 1 else out, m, n, x.stride(0), w.stride(0), out.stride(0),
        tiles_m, k // bk // split, SPLIT=split, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    if part is not None and split > 1:
        _sum_slices[(triton.cdiv(m * n, 1024),)](part, out, m * n, SPLIT=split, BLOCK=1024)
    return out


@triton.jit
def _streamk_kernel(x_ptr, w_ptr, out_ptr, ws_ptr, flags_ptr, M, N, stride_xm, stride_wn,
                    stride_om, TILES_M, STEPS, TOTAL, PROGS, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    """Each program walks its share of the iterations from the last: a piece that ends a
    tile's K-steps finishes the tile (adding the earlier programs' partials, nearest first);
    one that does not is the program's first piece walked, published at once for the next."""
    pid = tl.program_id(0)
    start = (pid * TOTAL) // PROGS
    it_end = ((pid + 1) * TOTAL) // PROGS
    tile_offs = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    while it_end > start:
        tile = (it_end - 1) // STEPS
        k_last = it_end - tile * STEPS
        k_first = tl.maximum(0, start - tile * STEPS)
        pid_m = tile % TILES_M
        pid_n = tile // TILES_M
        acc = _tile_dot(x_ptr, w_ptr, M, N, stride_xm, stride_wn, pid_m, pid_n, k_first,
                        k_last, BLOCK_M, BLOCK_N, BLOCK_K)  # fmt: skip
        if k_last != STEPS:  # the tile goes on in the next program, which finishes it
            tl.store(ws_ptr + pid * BLOCK_M * BLOCK_N + tile_offs, acc)
            tl.debug_barrier()
            tl.atomic_xchg(flags_ptr + pid, 1)
        else:
            done_from = k_first
            prv = pid - 1
            while done_from > 0:  # the tile's earlier pieces, program by program
                while tl.atomic_add(flags_ptr + prv, 0) == 0:
                    pass
                acc += tl.load(ws_ptr + prv * BLOCK_M * BLOCK_N + tile_offs, cache_modifier=".cg")
                tl.atomic_xchg(flags_ptr + prv, 0)
                done_from = tl.maximum(0, (prv * TOTAL) // PROGS - tile * STEPS)
                prv -= 1
            offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
            offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
            tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], acc, mask=mask)
        it_end -= k_last - k_first


def streamk_gemm(x: torch.Tensor, w: torch.Tensor, config: tuple[int, ...],
                 scratch: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:  # fmt: skip
    bm, bn, bk, warps, stages, progs = config
    m, k = x.shape
    n = w.shape[0]
    if k % bk:
        raise ValueError(f"K ({k}) is not a multiple of BLOCK_K ({bk})")
    tiles_m, tiles_n = triton.cdiv(m, bm), triton.cdiv(n, bn)
    steps = k // bk
    total = tiles_m * tiles_n * steps
    progs = min(progs, total)
    # each program publishes at most one piece (the first it walks), one slot a program
    if scratch is None:
        scratch = (torch.empty(progs, bm * bn, device=x.device, dtype=torch.float32),
                   torch.zeros(progs + 1, device=x.device, dtype=torch.int32))  # fmt: skip
    out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    _streamk_kernel[(progs,)](
        x, w, out, scratch[0], scratch[1], m, n, x.stride(0), w.stride(0), out.stride(0),
        tiles_m, steps, total, progs, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out


def _each(ws: list[torch.Tensor], gemm: Callable[..., torch.Tensor], x: torch.Tensor,
          *args: object) -> None:  # fmt: skip
    """``gemm(x, w, *args)`` for each weight: one timed call's launches."""
    for w in ws:
        gemm(x, w, *args)


def graph_us(fn: Callable[[], object]) -> float:
    from kernels.bench.roofline import graph_ms

    return graph_ms(fn) * 1e3 / REPS


SPLIT_CONFIGS = [
    (bm, bn, 64, warps, stages, split)
    for bm, bn, warps in ((64, 128, 4), (64, 256, 8), (128, 128, 8), (128, 256, 8), (256, 128, 8))
    for stages in (3, 4)
    for split in (1, 2, 4)
]  # fmt: skip
STREAMK_TILES = [(64, 128, 4), (64, 256, 8), (128, 128, 8), (128, 256, 8), (256, 128, 8)]


def time_shape(name: str, n: int, k: int, m: int, copy: float, flops: float) -> dict:
    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / 64 for _ in range(REPS)]
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    ref = ref_gemm(x, ws[0])
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    timed: dict[str, float] = {}

    def check(label: str, got: torch.Tensor) -> bool:
        err = (got.float() - ref).abs().max().item()
        if err > 0.05 + 0.02 * ref.abs().max().item():
            print(f"  {name} x{m} {label}: max|diff| {err:.3g}: skipped", flush=True)
            return False
        return True

    timed["cublas"] = graph_us(lambda: [F.linear(x, w) for w in ws])
    lib = torch.backends.cuda.preferred_blas_library()
    try:
        torch.backends.cuda.preferred_blas_library("cublaslt")
        if check("cublaslt", F.linear(x, ws[0])):
            timed["cublaslt"] = graph_us(lambda: [F.linear(x, w) for w in ws])
    finally:
        torch.backends.cuda.preferred_blas_library(lib)
    for c in SPLIT_CONFIGS:
        if k % (c[2] * c[5]) or (c[0] > 64 and m <= 64):
            continue
        part = torch.empty(c[5], m, n, device="cuda", dtype=torch.float32) if c[5] > 1 else None
        try:
            if not check(f"split {c}", split_gemm(x, ws[0], c, part)):
                continue
            timed[f"split {c}"] = graph_us(functools.partial(_each, ws, split_gemm, x, c, part))
        except Exception as exc:  # a launch the GPU cannot take is skipped
            print(f"  {name} x{m} split {c}: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
    for (bm, bn, warps), stages in itertools.product(STREAMK_TILES, (3, 4)):
        if bm > 64 and m <= 64:
            continue
        c = (bm, bn, 64, warps, stages, sms)
        scratch = (torch.empty(sms, bm * bn, device="cuda", dtype=torch.float32),
                   torch.zeros(sms + 1, device="cuda", dtype=torch.int32))  # fmt: skip
        try:
            if not check(f"streamk {c}", streamk_gemm(x, ws[0], c, scratch)):
                continue
            timed[f"streamk {c}"] = graph_us(
                functools.partial(_each, ws, streamk_gemm, x, c, scratch)
            )
        except Exception as exc:  # as above
            print(f"  {name} x{m} streamk {c}: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
    floor_us = max(n * k * 2 / copy / 1e3, 2 * m * n * k / flops * 1e6)
    best = min(timed, key=lambda key: timed[key])
    top = sorted(timed.items(), key=lambda kv: kv[1])[:4]
    print(f"{name:8s} x{m:<4d} floor {floor_us:6.1f} us  cublas {timed['cublas']:6.1f}  "
          f"best {best} {timed[best]:6.1f} ({timed['cublas'] / timed[best]:.2f}x)", flush=True)  # fmt: skip
    print("          " + "  ".join(f"{c} {us:.1f}" for c, us in top), flush=True)
    return {"shape": name, "n": n, "k": k, "rows": m, "floor_us": floor_us,
            "cublas_us": timed["cublas"], "best": best, "best_us": timed[best],
            "all_us": timed}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    from kernels.bench.roofline import copy_bandwidth, matmul_flops, write_results

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[64, 128, 256])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES))
    p.add_argument("--json-out")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA GPU")
    copy, flops = copy_bandwidth(), matmul_flops()
    print(f"copy {copy:.0f} GB/s, 8192^3 matmul {flops / 1e12:.0f} TFLOP/s", flush=True)
    rows = []
    for m in args.rows:
        for name in args.shapes:
            n, k = SHAPES[name]
            rows.append(time_shape(name, n, k, m, copy, flops))
            torch.cuda.empty_cache()
    if args.json_out:
        write_results(args.json_out, copy, rows, matmul_flops=flops)
    print("\nshape    rows  floor  cublas  best")
    for r in rows:
        print(f"{r['shape']:8s} {r['rows']:4d} {r['floor_us']:6.1f} {r['cublas_us']:7.1f} "
              f"{r['best_us']:6.1f}  {r['best']}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
