"""The batch-1 Triton GEMV as a decode step runs it: back to back inside one CUDA graph.

    python -m kernels.bench.gemv_graph [--fp8 [--rows 1 2 4 8 16]] [--json-out gemv_graph.json]

``kernels.bench.gemv`` times one launch at a time with L2 flushed, which charges each call its
launch and ramp. Here each shape's GEMV runs over ``REPS`` distinct weights (so no weight is in
L2) in one captured graph, as the decode graph replays its 32 layers: the time per call against
the weight bytes at the copy bandwidth says what is left to gain in the GEMV itself. Shapes are
Llama-3.1-8B's projections (bf16); the default launch (``pick_config``), cuBLAS, and a few
others (one chunk spanning the whole row, pipelining stages) are timed. ``--fp8``: the FP8
weight-only GEMV of ``--quantization fp8`` (e4m3 weights, one scale per output channel) over its
launches (rows per program, chunk, warps, K slices), against its own weight bytes; with
``--rows`` for a few rows of x too, where the FP8 GEMM's launches join the sweep.
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Callable, Sequence
from unittest import mock

import torch
import torch.nn.functional as F

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
REPS = 48


def graph_us(fn: Callable[[], object]) -> float:
    """Microseconds per call of ``fn``'s REPS launches, replayed from one CUDA graph."""
    from kernels.bench.roofline import graph_ms

    return graph_ms(fn) * 1e3 / REPS


def time_shape(name: str, n: int, k: int, copy: float) -> dict:
    """One projection's default launch, cuBLAS and the other launches, per call in a graph."""
    from kernels.triton_gemv import gemv, pick_config

    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(REPS)]
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)

    def launch(bn: int, bk: int, warps: int, stages: int) -> Callable[[], None]:
        def run() -> None:
            for w in ws:
                gemv(x, w, config=(bn, bk, warps, stages))

        return run

    default = (*pick_config(n, k, x.device), 1)[:4]
    timed = {"cublas": graph_us(lambda: [F.linear(x, w) for w in ws])}
    configs = {default}
    configs |= {(bn, 4096, w, 1) for bn, w in itertools.product((1, 2, 4), (4, 8))}
    configs |= set(itertools.product((4, 8), (512, 1024), (4, 8), (1,)))
    configs |= set(itertools.product((8, 16), (256, 512), (4,), (3, 4)))
    for c in sorted(configs):
        timed[str(c)] = graph_us(launch(*c))
    best = min(timed, key=lambda key: timed[key])
    floor_us = n * k * 2 / copy / 1e3
    dflt = timed[str(default)]
    print(f"{name:8s} floor {floor_us:6.1f} us  default {default} {dflt:6.1f} us "
          f"({100 * floor_us / dflt:5.1f}% of copy)  cuBLAS {timed['cublas']:6.1f} us  "
          f"best {best} {timed[best]:6.1f} us", flush=True)  # fmt: skip
    return {"shape": name, "n": n, "k": k, "floor_us": floor_us, "default": default,
            "default_us": dflt, "cublas_us": timed["cublas"], "best": best,
            "best_us": timed[best], "all_us": timed}  # fmt: skip


FP8_LAUNCHES = [(1, 4096, 4), (1, 4096, 8), (2, 4096, 4), (2, 4096, 8), (4, 4096, 8),
                (4, 2048, 4), (8, 1024, 8), (8, 512, 4), (2, 2048, 4), (4, 1024, 4),
                (16, 512, 8), (16, 1024, 8)]  # fmt: skip
FP8_CONFIGS = [(*launch, split) for launch in FP8_LAUNCHES for split in (1, 2)]
# the FP8 GEMM's launches for a few rows of x (BLOCK_M, BLOCK_N, BLOCK_K, warps, SPLIT; 0: the
# default slices of K)
FP8_GEMM_CONFIGS = [
    (16, bn, bk, warps, split)
    for bn in (32, 64, 128) for bk in (128, 256) for warps in (4, 8) for split in (0, 1)
]  # fmt: skip


def time_fp8_shape(
    name: str, n: int, k: int, copy: float, rows: int = 1, device: str = "cuda"
) -> dict:
    """The FP8 linear (per-channel scales) at its default launch and the others, in a graph:
    for ``rows`` rows of x the GEMV's launches (up to ``GEMV_ROWS`` rows) and the GEMM's."""
    from kernels import triton_quant
    from kernels.triton_quant import (
        GEMM_CONFIG,
        GEMV_ROWS,
        fp8_gemm_config,
        fp8_gemv_config,
        fp8_linear,
    )

    ws = [
        torch.randn(n, k, device=device).clamp(-400, 400).to(torch.float8_e4m3fn)
        for _ in range(REPS)
    ]
    scale = torch.rand(n, 1, device=device) + 0.5
    x = torch.randn(rows, k, device=device, dtype=torch.bfloat16)
    ref = fp8_linear(x, ws[0], scale, k).float()

    def launch(config: tuple[int, ...] | None) -> Callable[[], None]:
        def run() -> None:
            for w in ws:
                fp8_linear(x, w, scale, k, config=config)

        return run

    default = fp8_gemv_config(n, k, k) if rows <= GEMV_ROWS else fp8_gemm_config(rows)
    timed = {"default": graph_us(launch(None))}
    gemv = FP8_CONFIGS if rows <= GEMV_ROWS else []
    gemm = [*FP8_GEMM_CONFIGS, (*GEMM_CONFIG, 0)] if rows > 1 else []
    for c in [*gemv, *gemm]:
        if len(c) == 4 and c[1] > k:
            continue
        # a GEMM's launch for rows the GEMV would take: the GEMV's limit lowered meanwhile
        limit = min(GEMV_ROWS, rows - 1) if len(c) == 5 else GEMV_ROWS
        with mock.patch.object(triton_quant, "GEMV_ROWS", limit):
            got = fp8_linear(x, ws[0], scale, k, config=c).float()
            if not torch.allclose(got, ref, rtol=2e-2, atol=1e-1):
                print(f"  {name} {c}: differs from the default launch", flush=True)
                continue
            timed[str(c)] = graph_us(launch(c))
    best = min(timed, key=lambda key: timed[key])
    floor_us = n * k / copy / 1e3
    print(f"{name:8s} x{rows:<3d} fp8 floor {floor_us:6.1f} us  default {default} {timed['default']:6.1f} us "
          f"({100 * floor_us / timed['default']:5.1f}% of copy)  best {best} {timed[best]:6.1f} us "
          f"({100 * floor_us / timed[best]:5.1f}%)", flush=True)  # fmt: skip
    top = sorted(timed.items(), key=lambda kv: kv[1])[:5]
    print("          " + "  ".join(f"{c} {us:.1f}" for c, us in top), flush=True)
    return {"shape": name, "n": n, "k": k, "rows": rows, "dtype": "float8_e4m3fn",
            "floor_us": floor_us, "default": default, "default_us": timed["default"], "best": best,
            "best_us": timed[best], "all_us": timed}  # fmt: skip


def sweep(time_fn: Callable[..., dict], json_out: str | None, rows: Sequence[int] = (1,)) -> int:
    """``time_fn(name, n, k, copy GB/s[, rows])`` over the 8B projections (and each count of
    ``rows`` but the lone 1); the results to ``json_out``."""
    from kernels.bench.roofline import copy_bandwidth, write_results

    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA GPU")
    copy = copy_bandwidth()
    print(f"copy bandwidth {copy:.0f} GB/s", flush=True)
    results = []
    for m in rows:
        for name, (n, k) in SHAPES.items():
            results.append(time_fn(name, n, k, copy) if m == 1 else time_fn(name, n, k, copy, m))
            torch.cuda.empty_cache()
    if json_out:
        write_results(json_out, copy, results, reps=REPS)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json-out", default=None)
    p.add_argument("--fp8", action="store_true", help="the FP8 weight-only GEMV instead")
    p.add_argument("--rows", type=int, nargs="+", default=[1],
                   help="rows of x (--fp8 only; from 2 the FP8 GEMM's launches too)")  # fmt: skip
    args = p.parse_args(argv)
    if not args.fp8 and args.rows != [1]:
        p.error("--rows needs --fp8")
    if min(args.rows) < 1:
        p.error("--rows must be 1 or more")
    return sweep(time_fp8_shape if args.fp8 else time_shape, args.json_out, args.rows)


if __name__ == "__main__":
    raise SystemExit(main())
