"""CPU linear layers: block-quantized weights (``kernels.cpu_blocks``) against float32 ones.

    python -m kernels.bench.cpu_blocks [--rows 1 4 16 64] [--json-out cpu_blocks.json]

The embedded model's shapes (SmolLM2-135M: 30 layers of qkv, o, gate_up and down, and its
lm_head), each layer a weight of its own as in a model (so a pass reads them from memory, not
from cache), Q4 blocks for the layers and Q8 for the lm_head as its GGUF has them. For each
batch size: the time of one pass over every layer (the best of ``--repeats``) through
oneDNN's float32 layout (``kernels.cpu_linear``, the default before), MKL's sgemm (plain
``F.linear``), and the block kernel, and the block layer's weight bytes read per second
against the float32 layer's. Outputs are checked against the dense product first.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

LAYERS = 30
SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
LM_HEAD = (49152, 576)


def _q4_weight(n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """A float32 weight that is exactly Q4 blocks (codes times a float16 scale plus offset)."""
    codes = torch.randint(0, 16, (n * k // 32, 32), generator=gen).float()
    codes[:, 0], codes[:, 1] = 0, 15  # each block spans its codes, as a quantizer makes it
    d = (torch.rand(n * k // 32, 1, generator=gen) * 0.01 + 1e-3).half().float()
    m = (-torch.rand(n * k // 32, 1, generator=gen) * 0.08).half().float()
    return (codes * d + m).reshape(n, k)


def _q8_weight(n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    codes = torch.randint(-127, 128, (n * k // 32, 32), generator=gen).float()
    codes[:, 0] = 127
    d = (torch.rand(n * k // 32, 1, generator=gen) * 0.01 + 1e-3).half().float()
    return (codes * d).reshape(n, k)


def _best_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def main(argv: list[str] | None = None) -> int:
    from kernels import cpu_blocks, cpu_linear

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64])
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv)
    if cpu_blocks.library() is None:
        raise SystemExit("the block kernel did not build (no C compiler?)")
    gen = torch.Generator().manual_seed(0)
    dense = [_q4_weight(n, k, gen) for _ in range(LAYERS) for n, k in SHAPES.values()]
    dense.append(_q8_weight(*LM_HEAD, gen))
    blocks = [cpu_blocks.find_blocks(w) for w in dense]
    if any(b is None for b in blocks):
        raise SystemExit("a test weight did not pack into blocks")
    onednn = [cpu_linear.pack(w) for w in dense] if cpu_linear.enabled() else None
    f32_bytes = sum(w.numel() * 4 for w in dense)
    block_bytes = sum(b.nbytes for b in blocks if b is not None)
    results = []
    for rows in args.rows:
        xs = {k: torch.randn(rows, k, generator=gen) for k in {w.shape[1] for w in dense}}
        for w, b in zip(dense[:: len(SHAPES)], blocks[:: len(SHAPES)], strict=True):
            assert b is not None
            ref = F.linear(xs[w.shape[1]], w)
            got = cpu_blocks.linear(xs[w.shape[1]], b)
            torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)

        def run_blocks(xs: dict[int, torch.Tensor] = xs) -> None:
            for b in blocks:
                assert b is not None
                cpu_blocks.linear(xs[b.in_features], b)

        def run_sgemm(xs: dict[int, torch.Tensor] = xs) -> None:
            for w in dense:
                F.linear(xs[w.shape[1]], w)

        row = {"rows": rows, "blocks_ms": _best_ms(run_blocks, args.repeats)}
        row["sgemm_ms"] = _best_ms(run_sgemm, args.repeats)
        if onednn is not None:

            def run_onednn(xs: dict[int, torch.Tensor] = xs) -> None:
                assert onednn is not None
                for w in onednn:
                    cpu_linear.linear(xs[w.shape[1]], w)

            row["onednn_ms"] = _best_ms(run_onednn, args.repeats)
        row["blocks_gb_s"] = block_bytes / row["blocks_ms"] / 1e6
        row["float32_gb_s_at_blocks_time"] = f32_bytes / row["blocks_ms"] / 1e6
        results.append(row)
    out = {
        "threads": torch.get_num_threads(),
        "float32_mb": f32_bytes / 1e6,
        "blocks_mb": block_bytes / 1e6,
        "rows": results,
    }
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(out, f, indent=2)
    print(f"weights: float32 {f32_bytes / 1e6:.0f} MB, blocks {block_bytes / 1e6:.0f} MB")
    print(f"{'rows':>5} {'blocks ms':>10} {'oneDNN ms':>10} {'sgemm ms':>9} {'blocks GB/s':>12}")
    for r in results:
        onednn_ms = f"{r['onednn_ms']:10.2f}" if "onednn_ms" in r else f"{'-':>10}"
        print(
            f"{r['rows']:>5} {r['blocks_ms']:10.2f} {onednn_ms} {r['sgemm_ms']:9.2f} "
            f"{r['blocks_gb_s']:12.1f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
