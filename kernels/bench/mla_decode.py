"""DeepSeek's latent decode attention: ``triton_mla.mla_decode_attention`` against the general
decode kernel over the same cache (one 576-dim KV head read as keys and values, the path it
replaced) and the copy-bandwidth floor, its tiles swept.

    python -m kernels.bench.mla_decode [--quick] [--json-out mla_decode.json]

Cases: DeepSeek-V2-Lite's 16 heads (and V3's 128 on one GPU, 16 a rank on eight) at batch 1,
64 and 256 of 1024 keys, bf16 and an FP8 cache. Bytes are the cache rows a step reads (576
values a token: 1,152 bytes bf16, 576 FP8) plus q and the output; every launch is first checked
against the torch reference. Times are ``do_bench`` medians (L2 flushed) of the eager call; the
best tiles and the old path are then measured in a CUDA graph too.
"""

from __future__ import annotations

import argparse
import functools
import itertools
from dataclasses import dataclass
from typing import Any

import torch

ROPE, LATENT, BLOCK = 64, 512, 16
CASES = [  # (name, heads, batch, context)
    ("v2-lite", 16, 1, 1024), ("v2-lite", 16, 64, 1024), ("v2-lite", 16, 256, 1024),
    ("v3 (one GPU)", 128, 64, 1024), ("v3 (a rank of 8)", 16, 64, 4096),
]  # fmt: skip
TILES = [  # (block_g, block_n, num_warps, num_stages)
    (g, n, w, s) for g, n, w, s in itertools.product((16, 32), (16, 32, 64), (4, 8), (2, 3))
]
QUICK_TILES = [(16, 32, 4, 2), (16, 64, 4, 2), (16, 32, 8, 2), (32, 32, 8, 2), (64, 16, 8, 2)]


@dataclass
class Case:
    """One case's inputs (q, cache, block tables, context lengths, scale), the reference's
    output, the bytes a step reads (the cache rows, q and the output) and its name."""

    args: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float]
    want: torch.Tensor
    nbytes: int
    shape: str


def _case(name: str, heads: int, batch: int, ctx: int, cache_dtype: torch.dtype) -> Case:
    from kernels.attention import ref_mla_decode_attention

    blocks = -(-ctx // BLOCK)
    cache = torch.randn((batch * blocks + 1, BLOCK, 1, ROPE + LATENT), device="cuda")
    cache = cache.to(cache_dtype)
    order = torch.randperm(batch * blocks, device="cuda").int() + 1
    q = torch.randn((batch, heads, ROPE + LATENT), device="cuda", dtype=torch.bfloat16)
    lens = torch.full((batch,), ctx, device="cuda", dtype=torch.int32)
    args = (q, cache, order.view(batch, blocks), lens, 192**-0.5)
    want = ref_mla_decode_attention(q.float(), cache.float(), *args[2:], ROPE)
    elem = cache.element_size()
    nbytes = batch * ctx * (ROPE + LATENT) * elem + q.numel() * 2 + batch * heads * LATENT * 2
    kind = "fp8" if elem == 1 else "bf16"
    return Case(args, want, nbytes, f"{name} {heads} heads, {batch} x {ctx}, {kind} cache")


def bench_case(c: Case, tiles: list[tuple[int, int, int, int]], copy: float) -> list[dict[str, Any]]:  # fmt: skip
    from triton.testing import do_bench

    from kernels.bench.roofline import measure
    from kernels.triton_decode import paged_decode_attention
    from kernels.triton_mla import mla_decode_attention

    (q, cache, tables, lens, scale), want, nbytes, shape = c.args, c.want, c.nbytes, c.shape
    rows, best = [], None
    for g, n, w, s in tiles:
        fn = functools.partial(mla_decode_attention, q, cache, tables, lens, scale, ROPE,
                               block_g=g, block_n=n, num_warps=w, num_stages=s)  # fmt: skip
        try:
            got = fn()
            torch.cuda.synchronize()
        except Exception as e:  # out of shared memory or registers: the tile is not a choice
            rows.append({"shape": shape, "tiles": [g, n, w, s], "error": str(e)[:160]})
            continue
        err = (got.float() - want).abs().max().item()
        if err > 0.05:
            rows.append({"shape": shape, "tiles": [g, n, w, s], "error": f"max error {err}"})
            continue
        ms = do_bench(fn, warmup=5, rep=40)
        rows.append({"shape": shape, "tiles": [g, n, w, s], "ms": ms,
                     "pct_of_copy": 100 * nbytes / ms / 1e6 / copy})  # fmt: skip
        if best is None or ms < best[0]:
            best = (ms, (g, n, w, s), fn)
    old = functools.partial(paged_decode_attention, q, cache, cache, tables, lens, scale)
    if best is not None:
        rows.append(measure("latent decode (triton_mla), best tiles", shape, best[2],
                            nbytes=nbytes, copy_gbps=copy, tiles=list(best[1])))  # fmt: skip
        default = functools.partial(mla_decode_attention, q, cache, tables, lens, scale, ROPE)
        rows.append(measure("latent decode (triton_mla), default tiles", shape, default,
                            nbytes=nbytes, copy_gbps=copy))  # fmt: skip
    rows.append(measure("  general decode kernel (576-dim head as K and V)", shape, old,
                        nbytes=nbytes, copy_gbps=copy))  # fmt: skip
    return rows


SPLITS = [1, 2, 3, 4, 6, 8, 12, 16, 32]


def sweep_splits(c: Case, tiles: tuple[int, int, int, int], copy: float) -> list[dict[str, Any]]:  # fmt: skip
    """The kernel with ``tiles`` at each split count of :data:`SPLITS` (its partial sums,
    float32 and ``L`` wide a head, are written and merged: more splits fill more SMs and cost
    more bytes), each checked against the reference, timed in a CUDA graph."""
    from kernels.bench.roofline import graph_ms
    from kernels.triton_mla import mla_decode_attention

    g, n, w, st = tiles
    rows = []
    for splits in SPLITS:
        fn = functools.partial(mla_decode_attention, *c.args, ROPE, num_splits=splits,
                               block_g=g, block_n=n, num_warps=w, num_stages=st)  # fmt: skip
        err = (fn().float() - c.want).abs().max().item()
        ms = graph_ms(fn)
        rows.append({"shape": c.shape, "tiles": list(tiles), "num_splits": splits,
                     "graph_ms": ms, "max_error": err,
                     "pct_of_copy": 100 * c.nbytes / ms / 1e6 / copy})  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    from kernels.bench.roofline import copy_bandwidth, write_results

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="a few tiles, not the whole sweep")
    p.add_argument("--json-out", default=None)
    p.add_argument("--splits", nargs=4, type=int, metavar=("G", "N", "WARPS", "STAGES"),
                   help="these tiles at each split count of SPLITS, not the tile sweep")  # fmt: skip
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("kernels.bench.mla_decode needs a CUDA GPU")
    copy = copy_bandwidth()
    print(f"copy bandwidth {copy:.0f} GB/s", flush=True)
    rows: list[dict[str, Any]] = []
    for (name, heads, batch, ctx), dt in itertools.product(
        CASES, (torch.bfloat16, torch.float8_e4m3fn)
    ):
        c = _case(name, heads, batch, ctx, dt)
        if args.splits:
            case = sweep_splits(c, tuple(args.splits), copy)
            rows += case
            print(f"{c.shape:46s} " + " ".join(
                f"{r['num_splits']}:{r['graph_ms'] * 1e3:.1f}" for r in case) + " us", flush=True)  # fmt: skip
            continue
        case = bench_case(c, QUICK_TILES if args.quick else TILES, copy)
        rows += case
        for r in case:
            if "name" in r:
                print(f"{r['shape']:44s} {r['name']:50s} {r['ms'] * 1e3:8.1f} us eager "
                      f"{r['graph_ms'] * 1e3:8.1f} us graph {r['graph_pct_of_copy']:5.1f}% of copy "
                      f"{r.get('tiles', '')}", flush=True)  # fmt: skip
    if args.json_out:
        write_results(args.json_out, copy, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
