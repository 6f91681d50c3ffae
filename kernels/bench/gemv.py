"""Batch-1 linear layers: cuBLAS (``F.linear``) against the Triton GEMV over launch configs.

    python -m kernels.bench.gemv [--json-out gemv.json]

Shapes are Llama-3.1-8B's decode projections (bf16). Each row reports GB/s of weight read
(the whole cost at batch 1) against the device copy bandwidth; times are ``do_bench`` medians
with L2 flushed between runs, so a 32 MB weight is not served from cache.
"""

from __future__ import annotations

import argparse
import functools
import itertools

import torch
import torch.nn.functional as F

SHAPES = {
    "qkv 4096->6144": (6144, 4096),
    "o 4096->4096": (4096, 4096),
    "gate_up 4096->28672": (28672, 4096),
    "down 14336->4096": (4096, 14336),
    "lm_head 4096->128256": (128256, 4096),
}
CONFIGS = [
    (bn, bk, w) for bn, bk, w in itertools.product((2, 4, 8, 16, 32), (256, 512, 1024), (4, 8))
    if bn * bk <= 16384
]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    from kernels.bench.roofline import copy_bandwidth, median_ms, write_results
    from kernels.triton_gemv import gemv

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_gemv needs a CUDA GPU")
    copy = copy_bandwidth()
    print(f"copy bandwidth {copy:.0f} GB/s", flush=True)
    rows = []
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        gb = n * k * 2 / 1e9
        ref = F.linear(x, w).float()
        cublas = median_ms(functools.partial(F.linear, x, w))
        best = None
        for cfg in CONFIGS:
            out = gemv(x, w, config=cfg).float()
            err = ((out - ref).norm() / ref.norm()).item()
            if not err < 1e-2:
                raise SystemExit(f"{name} config {cfg}: relative error {err:.2e}")
            ms = median_ms(functools.partial(gemv, x, w, config=cfg))
            if best is None or ms < best[1]:
                best = (cfg, ms)
        assert best is not None
        row = {"shape": name, "n": n, "k": k, "cublas_ms": cublas, "cublas_gbs": gb / cublas * 1e3,
               "triton_ms": best[1], "triton_gbs": gb / best[1] * 1e3, "best_config": best[0],
               "copy_gbs": copy}  # fmt: skip
        rows.append(row)
        print(
            f"{name:24s} cuBLAS {cublas * 1e3:7.1f} us {row['cublas_gbs']:6.0f} GB/s | Triton "
            f"{best[1] * 1e3:7.1f} us {row['triton_gbs']:6.0f} GB/s {best[0]}",
            flush=True,
        )
    if args.json_out:
        write_results(args.json_out, copy, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
