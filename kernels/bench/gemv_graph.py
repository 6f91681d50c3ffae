"""The batch-1 Triton GEMV as a decode step runs it: back to back inside one CUDA graph.

    python -m kernels.bench.gemv_graph [--json-out gemv_graph.json]

``kernels.bench.gemv`` times one launch at a time with L2 flushed, which charges each call its
launch and ramp. Here each shape's GEMV runs over ``REPS`` distinct weights (so no weight is in
L2) in one captured graph, as the decode graph replays its 32 layers: the time per call against
the weight bytes at the copy bandwidth says what is left to gain in the GEMV itself. Shapes are
Llama-3.1-8B's projections (bf16); the default launch (``pick_config``), cuBLAS, and a few
others (one chunk spanning the whole row, pipelining stages) are timed.
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Callable

import torch
import torch.nn.functional as F
import triton

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
REPS = 48


def graph_us(fn: Callable[[], object]) -> float:
    """Microseconds per call of ``fn``'s REPS launches, replayed from one CUDA graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and settle outside the capture
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(5):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[2] * 1e3 / REPS


def time_shape(name: str, n: int, k: int, copy: float) -> dict:
    """One projection's default launch, cuBLAS and the other launches, per call in a graph."""
    from kernels.triton_gemv import _gemv_kernel, pick_config

    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(REPS)]
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(1, n, device="cuda", dtype=torch.bfloat16)

    def launch(bn: int, bk: int, warps: int, stages: int) -> Callable[[], None]:
        def run() -> None:
            for w in ws:
                _gemv_kernel[(triton.cdiv(n, bn),)](
                    x, w, out, 1, n, k, x.stride(0), w.stride(0), out.stride(0), 1,
                    ROWS=1, BLOCK_N=bn, BLOCK_K=bk, EVEN_K=k % bk == 0, num_warps=warps,
                    num_stages=stages,
                )  # fmt: skip

        return run

    default = pick_config(n, k)
    timed = {"cublas": graph_us(lambda: [F.linear(x, w) for w in ws])}
    configs = {(*default, s) for s in (1, 3)}
    configs |= {(bn, 4096, w, 1) for bn, w in itertools.product((1, 2, 4), (4, 8))}
    configs |= set(itertools.product((4, 8), (512, 1024), (4, 8), (1, 3)))
    for c in sorted(configs):
        timed[str(c)] = graph_us(launch(*c))
    best = min(timed, key=lambda key: timed[key])
    floor_us = n * k * 2 / copy / 1e3
    dflt = timed[str((*default, 3))]
    print(f"{name:8s} floor {floor_us:6.1f} us  default {default} {dflt:6.1f} us "
          f"({100 * floor_us / dflt:5.1f}% of copy)  cuBLAS {timed['cublas']:6.1f} us  "
          f"best {best} {timed[best]:6.1f} us", flush=True)  # fmt: skip
    return {"shape": name, "n": n, "k": k, "floor_us": floor_us, "default": default,
            "default_us": dflt, "cublas_us": timed["cublas"], "best": best,
            "best_us": timed[best], "all_us": timed}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    from kernels.bench.roofline import copy_bandwidth, write_results

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("gemv_graph needs a CUDA GPU")
    copy = copy_bandwidth()
    print(f"copy bandwidth {copy:.0f} GB/s", flush=True)
    rows = []
    for name, (n, k) in SHAPES.items():
        rows.append(time_shape(name, n, k, copy))
        torch.cuda.empty_cache()
    if args.json_out:
        write_results(args.json_out, copy, rows, reps=REPS)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
