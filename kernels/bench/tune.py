"""Sweep of the attention kernels' tile knobs on the GPU (``python -m kernels.bench.tune``).

Prints, per benchmark shape, each configuration's time and the fraction of copy bandwidth
(decode) or TFLOP/s (prefill, with torch SDPA's rate on the same prompts where it has a peer),
best first. The defaults in ``triton_decode`` and ``triton_prefill`` come from this sweep; rerun
it on a new GPU before changing them. Arguments: ``prefill`` or ``decode`` runs one half,
``graph`` times CUDA-graph replays, ``m64 m128 m256`` restrict the prefill sweep to tiles of
those many rows (to split it over runs).
"""

from __future__ import annotations

import functools
import itertools
import sys
from collections.abc import Callable

import torch
import triton.testing

from kernels.attention import ref_prefill_attention
from kernels.bench.cases import (
    DECODE_CASES,
    DTYPE,
    HEAD_DIM,
    PREFILL_CASES,
    paged,
    prefill_flops,
)
from kernels.bench.roofline import copy_bandwidth, sdpa_prefill
from kernels.triton_decode import paged_decode_attention
from kernels.triton_prefill import Tiles, prefill_attention, tiles_fit

GRAPH = "graph" in sys.argv[1:]  # time CUDA-graph replays: GPU time without Python launches
# "m128" and the like: only prefill tiles of that many rows (to split the sweep over runs)
ROWS = [int(a[1:]) for a in sys.argv[1:] if a[:1] == "m" and a[1:].isdigit()]


def median_ms(fn: Callable[[], object]) -> float:
    if GRAPH:
        return float(triton.testing.do_bench_cudagraph(fn, rep=40, return_mode="median"))
    return float(triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median"))


def tune_decode(copy_gbps: float) -> None:
    cases = [c for c in DECODE_CASES if c[0] == 1] if "b1" in sys.argv[1:] else DECODE_CASES
    for batch, ctx in cases:
        p = paged([ctx] * batch)
        args = (p.q, p.k_cache, p.v_cache, p.block_tables, p.context_lens, p.scale)
        splits = [None] if batch >= 64 else [None, 16, 24, 48, 64, 96, 128]
        rows = []
        for block_n, warps, stages, s in itertools.product((32, 64, 128), (4, 8), (2, 3, 4), splits):  # fmt: skip
            try:
                fn = functools.partial(paged_decode_attention, *args, num_splits=s, block_n=block_n, num_warps=warps, num_stages=stages)  # fmt: skip
                ms = median_ms(fn)
            except Exception as exc:  # out of shared memory and the like
                print(
                    f"  skip block_n={block_n} warps={warps} stages={stages}: {type(exc).__name__}"
                )
                continue
            rows.append((ms, block_n, warps, stages, s))
        rows.sort()
        print(f"decode B={batch} ctx={ctx}")
        for ms, block_n, warps, stages, s in rows[:8]:
            pct = 100 * p.io_bytes() / ms / 1e6 / copy_gbps
            print(f"  {ms:8.4f} ms {pct:5.1f}% copy  block_n={block_n} warps={warps} stages={stages} splits={s}")  # fmt: skip
        del p, args
        torch.cuda.empty_cache()


# (BLOCK_M rows, BLOCK_N, num_warps, num_stages, pack): 128-row tiles skip 32-key steps (too
# little work per K/V tile); pack stacks a GQA group's heads in one tile. A K/V tile feeds
# BLOCK_M rows: at 64 rows and ~400 TFLOP/s the K/V reads from L2 alone run at ~6 TB/s, so
# 256-row tiles of packed groups (64 tokens of 4 heads, one warpgroup per 64 rows) are tried too
PREFILL_KNOBS: list[Tiles] = [
    tiles
    for tiles in itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3, 4), (True, False))
    if tiles[:2] != (128, 32)
] + list(itertools.product((256,), (32, 64), (8, 16), (2, 3), (True,)))


def tune_prefill() -> None:
    """Each case's fastest knobs, then the knobs with the least total time over all cases (the
    candidate for ``triton_prefill.TILE_CHOICES[0]``). Knobs whose output strays from the
    reference by more than bf16's tolerance are dropped, so a fast wrong build cannot win."""
    times: dict[Tiles, list[float]] = {}
    for name, ctx_lens, q_lens in PREFILL_CASES:
        p = paged(ctx_lens, q_lens)
        flops = prefill_flops(ctx_lens, q_lens)
        args = (p.q, p.k_cache, p.v_cache, p.block_tables, p.query_start_loc, p.context_lens, p.scale)  # fmt: skip
        ref = ref_prefill_attention(*args).float()
        rows = []
        for tiles in PREFILL_KNOBS:
            if ROWS and tiles[0] not in ROWS:
                continue
            try:
                err = (prefill_attention(*args, tiles=tiles).float() - ref).abs().max().item()
                ms = median_ms(functools.partial(prefill_attention, *args, tiles=tiles))
            except Exception as exc:  # out of shared memory and the like
                print(f"  skip tiles={tiles}: {type(exc).__name__}")
                continue
            if not err <= 2e-2:
                print(f"  drop tiles={tiles}: max error {err:.3g} against the reference")
                continue
            rows.append((ms, tiles))
            times.setdefault(tiles, []).append(ms)
        rows.sort()
        print(f"prefill {name}")
        sdpa = sdpa_prefill(p, ctx_lens, q_lens)
        if sdpa is not None:
            ms = median_ms(sdpa)
            print(f"  {ms:8.4f} ms {flops / ms / 1e9:6.1f} TFLOP/s  torch sdpa (contiguous KV)")
        for ms, tiles in rows[:8]:
            print(f"  {ms:8.4f} ms {flops / ms / 1e9:6.1f} TFLOP/s  tiles(M, N, warps, stages, pack)={tiles}")  # fmt: skip
        del p, args, ref
        torch.cuda.empty_cache()
    dev = torch.device("cuda")
    totals = [
        (sum(ms), t)
        for t, ms in times.items()
        if len(ms) == len(PREFILL_CASES) and tiles_fit(t, HEAD_DIM, DTYPE, dev)
    ]
    print("prefill, least total time over every case, within default_tiles' shared-memory budget")
    print("(the first is the default to take: triton_prefill.TILE_CHOICES[0]):")
    for ms, tiles in sorted(totals)[:5]:
        print(f"  {ms:8.4f} ms  tiles={tiles}")


if __name__ == "__main__":
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    gbps = copy_bandwidth()
    print(f"copy {gbps:.0f} GB/s")
    if "prefill" not in sys.argv[1:]:
        tune_decode(gbps)
    if "decode" not in sys.argv[1:]:
        tune_prefill()
