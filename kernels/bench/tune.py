"""Sweep of the attention kernels' tile knobs on the GPU (``python -m kernels.bench.tune``).

Prints, per benchmark shape, each configuration's time and the fraction of copy bandwidth
(decode) or TFLOP/s (prefill, with torch SDPA's rate on the same prompts where it has a peer),
best first. The defaults in ``triton_decode`` and ``triton_prefill`` come from this sweep; rerun
it on a new GPU before changing them. Arguments: ``prefill`` or ``decode`` runs one half,
``graph`` times CUDA-graph replays, ``m64 m128 m256`` restrict the prefill sweep to tiles of
those many rows (to split it over runs), ``fp8`` sweeps decode over an e4m3 KV cache (read as
bf16 and as fp16: ``f16_read``), ``b1`` only its batch-1 case, ``b64`` only the batched ones,
``w1`` adds W1's decode steps (224 sequences at 1100 tokens), ``maxreg`` times each decode
configuration uncapped and with the registers capped at 168 and 128 a thread (``max_registers``:
more programs a multiprocessor), ``halfd`` times each decode configuration with the kernel
working on the head dim in halves (the default) and whole (``half_d``), ``quick`` leaves
32-key tiles, 4 stages and the FP8 cache's bf16 read out of the decode sweep (they never led it),
``cap`` only times the FP8 cache's
register cap against none at batch 1 to 256 (``check_default``), ``halves`` the head dim in
halves against whole over both caches, ``contig`` runs the whole-prompt
cases as the engine does on a GPU (their new K/V contiguous, ``k_new``/``v_new``, and
``no_prefix``); the cases after a prefix stay paged, as there.

The prefill sweep times tile shapes with every kernel variant off, then the variants
(``Tiles``' knobs) on the leading shapes, then what the launcher's own shape rule picks for each
case, and prints the candidates for ``TILE_CHOICES[0]`` and ``LARGE_TILES[0]`` as ``Tiles(...)``
literals to paste.
"""

from __future__ import annotations

import functools
import itertools
import sys
from collections.abc import Callable
from typing import Any

import torch
import triton.testing

from kernels import triton_prefill
from kernels.attention import ref_prefill_attention
from kernels.bench.cases import (
    DECODE_CASES,
    DTYPE,
    HEAD_DIM,
    KV_HEADS,
    PREFILL_CASES,
    Q_HEADS,
    Paged,
    new_kv,
    paged,
    prefill_flops,
)
from kernels.bench.roofline import copy_bandwidth, sdpa_prefill
from kernels.triton_common import sm_count
from kernels.triton_decode import paged_decode_attention
from kernels.triton_prefill import (
    Tiles,
    filled_programs,
    prefill_attention,
    step_tiles,
    tiles_fit,
)

GRAPH = "graph" in sys.argv[1:]  # time CUDA-graph replays: GPU time without Python launches
# "contig": whole prompts' K/V passed contiguously with no_prefix, as the engine does on a GPU
CONTIG = "contig" in sys.argv[1:]
# "m128" and the like: only prefill tiles of that many rows (to split the sweep over runs)
ROWS = [int(a[1:]) for a in sys.argv[1:] if a[:1] == "m" and a[1:].isdigit()]


def median_ms(fn: Callable[[], object]) -> float:
    if GRAPH:
        return float(triton.testing.do_bench_cudagraph(fn, rep=40, return_mode="median"))
    return float(triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median"))


def _decode_case(batch: int, ctx: int, fp8: bool) -> tuple[Paged, tuple[Any, ...]]:
    """``batch`` sequences of ``ctx`` keys (an e4m3 cache with ``fp8``) and the decode call's
    positional arguments."""
    p = paged([ctx] * batch)
    if fp8:
        p.k_cache = p.k_cache.to(torch.float8_e4m3fn)
        p.v_cache = p.v_cache.to(torch.float8_e4m3fn)
    return p, (p.q, p.k_cache, p.v_cache, p.block_tables, p.context_lens, p.scale)


CAP_CASES = [(1, 1024), (1, 8192), (1, 32768), (8, 4096), (64, 4096), (224, 1100), (256, 512)]


def check_default(copy_gbps: float, other: dict[str, Any], caches: tuple[bool, ...]) -> None:
    """Decode attention with the launcher's defaults against the same call with ``other``
    knobs, at batch 1 (split-K) to 256, over an FP8 cache and/or a bf16 one (``caches``: fp8 or
    not): a default must not cost anywhere it was not swept. ``cap``: the FP8 cache's register
    cap against none; ``halves``: the head dim in halves against whole (also the largest
    difference between the two outputs, which should be 0)."""
    knobs = " ".join(f"{k}={v}" for k, v in other.items())
    for fp8 in caches:
        print(
            f"decode over {'an FP8' if fp8 else 'a bf16'} cache: the launcher's default / {knobs}"
        )
        for batch, ctx in CAP_CASES:
            p, args = _decode_case(batch, ctx, fp8)
            default = median_ms(functools.partial(paged_decode_attention, *args))
            ms = median_ms(functools.partial(paged_decode_attention, *args, **other))
            diff = (paged_decode_attention(*args) - paged_decode_attention(*args, **other)).abs()
            pct = [100 * p.io_bytes() / t / 1e6 / copy_gbps for t in (default, ms)]
            print(f"  B={batch:3d} ctx={ctx:5d}: {default:8.4f} ms ({pct[0]:5.1f}%) / {ms:8.4f} ms ({pct[1]:5.1f}%)  {ms / default:5.2f}x  max|diff| {diff.max().item():.2e}")  # fmt: skip
            del p, args
            torch.cuda.empty_cache()


def tune_decode(copy_gbps: float) -> None:
    """``fp8``: an e4m3 KV cache (``--kv-cache-dtype fp8``: half the bytes per key, so the
    sweep adds 256-key tiles)."""
    cases = DECODE_CASES + ([(224, 1100)] if "w1" in sys.argv[1:] else [])
    if "b1" in sys.argv[1:]:
        cases = [c for c in cases if c[0] == 1]
    if "b64" in sys.argv[1:]:  # the batched cases only
        cases = [c for c in cases if c[0] >= 64]
    fp8 = "fp8" in sys.argv[1:]
    for batch, ctx in cases:
        p, args = _decode_case(batch, ctx, fp8)
        splits = [None] if batch >= 64 else [None, 16, 24, 48, 64, 96, 128]
        tiles: tuple[int, ...] = (32, 64, 128, 256) if fp8 else (32, 64, 128)
        stage_counts: tuple[int, ...] = (2, 3, 4)
        reads: tuple[bool, ...] = (False, True) if fp8 else (False,)
        if "quick" in sys.argv[1:]:
            tiles, stage_counts, reads = tiles[1:], (2, 3), reads[-1:]
        reg_caps: tuple[int | None, ...] = (0, 168, 128) if "maxreg" in sys.argv[1:] else (None,)
        halves: tuple[bool | None, ...] = (False, True) if "halfd" in sys.argv[1:] else (None,)
        rows = []
        for block_n, warps, stages, s, f16, regs, half in itertools.product(
            tiles, (4, 8), stage_counts, splits, reads, reg_caps, halves
        ):
            try:
                fn = functools.partial(paged_decode_attention, *args, num_splits=s, block_n=block_n, num_warps=warps, num_stages=stages, f16_read=f16, max_registers=regs, half_d=half)  # fmt: skip
                ms = median_ms(fn)
            except Exception as exc:  # out of shared memory and the like
                print(f"  skip block_n={block_n} warps={warps} stages={stages} max_registers={regs} half_d={half}: {type(exc).__name__}")  # fmt: skip
                continue
            rows.append((ms, block_n, warps, stages, s, f16, regs, half))
        rows.sort()
        print(f"decode B={batch} ctx={ctx}" + (" fp8 KV" if fp8 else ""))
        ms = median_ms(functools.partial(paged_decode_attention, *args))
        pct = 100 * p.io_bytes() / ms / 1e6 / copy_gbps
        print(f"  {ms:8.4f} ms {pct:5.1f}% copy  the launcher's default")
        if fp8:  # the launcher's tiles, read each way
            for f16 in reads:
                ms = median_ms(functools.partial(paged_decode_attention, *args, f16_read=f16))
                pct = 100 * p.io_bytes() / ms / 1e6 / copy_gbps
                print(f"  {ms:8.4f} ms {pct:5.1f}% copy  the launcher's tiles, f16_read={f16}")
        if len(halves) > 1:  # the launcher's tiles, the head dim whole
            ms = median_ms(functools.partial(paged_decode_attention, *args, half_d=False))
            pct = 100 * p.io_bytes() / ms / 1e6 / copy_gbps
            print(f"  {ms:8.4f} ms {pct:5.1f}% copy  the launcher's tiles, half_d=False")
        for ms, block_n, warps, stages, s, f16, regs, half in rows[:8]:
            pct = 100 * p.io_bytes() / ms / 1e6 / copy_gbps
            print(f"  {ms:8.4f} ms {pct:5.1f}% copy  block_n={block_n} warps={warps} stages={stages} splits={s} f16_read={f16} max_registers={regs} half_d={half}")  # fmt: skip
        for regs in reg_caps if len(reg_caps) > 1 else ():  # each cap's best, to compare
            best = next((r for r in rows if r[6] == regs), None)
            if best is not None:
                pct = 100 * p.io_bytes() / best[0] / 1e6 / copy_gbps
                print(f"  best with max_registers={regs}: {best[0]:8.4f} ms {pct:5.1f}% copy {best[1:6] + best[7:]}")  # fmt: skip
        for half in halves if len(halves) > 1 else ():  # the best of each kernel variant
            best = next((r for r in rows if r[7] == half), None)
            if best is not None:
                pct = 100 * p.io_bytes() / best[0] / 1e6 / copy_gbps
                print(f"  best with half_d={half}: {best[0]:8.4f} ms {pct:5.1f}% copy {best[1:7]}")  # fmt: skip
        del p, args
        torch.cuda.empty_cache()


# (BLOCK_M rows, BLOCK_N, num_warps, num_stages, pack): 128-row tiles skip 32-key steps (too
# little work per K/V tile); pack stacks a GQA group's heads in one tile. A K/V tile feeds
# BLOCK_M rows: at 64 rows and ~400 TFLOP/s the K/V reads from L2 alone run at ~6 TB/s, so
# 256-row tiles of packed groups (64 tokens of 4 heads, one warpgroup per 64 rows) are tried too.
# Four stages never beat three by more than noise (2026-11-25 sweep), so they are left out.
TILE_SHAPES: list[Tiles] = [
    Tiles(*t)
    for t in itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3), (True, False))
    if t[:2] != (128, 32)
] + [Tiles(*t) for t in itertools.product((256,), (32, 64), (8, 16), (2, 3, 4), (True,))]
# the kernel variants, tried on the shapes that led the 2026-11-25 sweep (and the launcher's
# own choices): each knob alone, the addressing knobs together, and everything at once
VARIANT_SHAPES: list[Tiles] = [
    Tiles(256, 64, 16, 2, True),
    Tiles(256, 64, 8, 3, True),
    Tiles(128, 64, 8, 3, True),
    Tiles(128, 128, 8, 3, False),
    Tiles(64, 64, 4, 3, True),
    Tiles(64, 32, 4, 2, True),
]
VARIANTS: list[dict[str, bool]] = [
    {"narrow": True},
    {"block_reads": True},
    {"k_transposed": True},
    {"narrow": True, "block_reads": True},
    {"narrow": True, "block_reads": True, "k_transposed": True},
]
PREFILL_KNOBS: list[Tiles] = TILE_SHAPES + [
    shape._replace(**knobs) for shape in VARIANT_SHAPES for knobs in VARIANTS
]


def time_case(
    call: Callable[..., torch.Tensor], ref: torch.Tensor, knobs: list[Tiles]
) -> list[tuple[float, Tiles]]:
    """(ms, tiles) of every candidate whose output matches the reference, fastest first
    (``call``: prefill attention with the case's arguments, ``tiles=`` left to add)."""
    rows = []
    for tiles in knobs:
        run = functools.partial(call, tiles=tiles)
        try:
            err = (run().float() - ref).abs().max().item()
            ms = median_ms(run)
        except Exception as exc:  # out of shared memory and the like
            print(f"  skip {tiles.code()}: {type(exc).__name__}")
            continue
        if not err <= 2e-2:
            print(f"  drop {tiles.code()}: max error {err:.3g} against the reference")
            continue
        rows.append((ms, tiles))
    return sorted(rows)


def tune_prefill() -> None:
    """Each case's fastest knobs, then what the launcher's shape rule (``step_tiles``) picks for
    each case beside SDPA, and the candidates for its two tables: ``LARGE_TILES[0]`` (the cases
    the rule gives large tiles) and ``TILE_CHOICES[0]`` (the others). Knobs whose output strays
    from the reference by more than bf16's tolerance are dropped, so a fast wrong build cannot win."""
    knobs = [t for t in PREFILL_KNOBS if not ROWS or t.block_m in ROWS]
    print(f"prefill: {len(knobs)} configurations per case")
    times: dict[Tiles, list[float]] = {}
    summary = []
    for name, ctx_lens, q_lens in PREFILL_CASES:
        p = paged(ctx_lens, q_lens)
        flops = prefill_flops(ctx_lens, q_lens)
        args = (p.q, p.k_cache, p.v_cache, p.block_tables, p.query_start_loc, p.context_lens, p.scale)  # fmt: skip
        ref = ref_prefill_attention(*args).float()
        whole: dict[str, Any] = {}
        if CONTIG and ctx_lens == q_lens:
            k_new, v_new = new_kv(p, ctx_lens, q_lens)
            whole = {"k_new": k_new, "v_new": v_new, "no_prefix": True}
        call = functools.partial(prefill_attention, *args, **whole)
        rows = time_case(call, ref, knobs)
        for ms, tiles in rows:
            times.setdefault(tiles, []).append(ms)
        print(f"prefill {name}")
        sdpa_ms = None
        sdpa = sdpa_prefill(p, ctx_lens, q_lens)
        if sdpa is not None:
            sdpa_ms = median_ms(sdpa)
            print(f"  {sdpa_ms:8.4f} ms {flops / sdpa_ms / 1e9:6.1f} TFLOP/s  torch sdpa (contiguous KV)")  # fmt: skip
        for ms, tiles in rows[:12]:
            print(f"  {ms:8.4f} ms {flops / ms / 1e9:6.1f} TFLOP/s  {tiles.code()}")
        chosen = (
            triton_prefill.WHOLE_PROMPT_TILES
            if whole
            else step_tiles(p.q.shape[0], Q_HEADS, Q_HEADS // KV_HEADS, HEAD_DIM, DTYPE, p.q.device)
        )
        chosen_ms = median_ms(call)  # tiles=None: the launcher's rule
        summary.append((name, q_lens, flops, chosen, chosen_ms, sdpa_ms, rows[0] if rows else None))
        del p, args, ref
        torch.cuda.empty_cache()
    print_rule(summary, times)


def print_rule(summary: list[tuple], times: dict[Tiles, list[float]]) -> None:
    dev = torch.device("cuda")
    sms = sm_count(dev)
    group = Q_HEADS // KV_HEADS
    print(f"\nprefill, the launcher's choice (step_tiles; {sms} SMs, LARGE_TILES needs", end="")
    print(f" {triton_prefill.LARGE_TILES[0][1]} programs/SM) beside SDPA and the sweep's best:")
    large_cases: list[int] = []
    small_cases: list[int] = []
    for i, (name, q_lens, flops, chosen, ms, sdpa_ms, best) in enumerate(summary):
        per_sm = {m: filled_programs(Tiles(m, 64, 4, 2, True), sum(q_lens), Q_HEADS, group) / sms for m in (64, 256)}  # fmt: skip
        large = any(chosen == t for t, _ in triton_prefill.LARGE_TILES)
        (large_cases if large else small_cases).append(i)
        rate = flops / ms / 1e9
        vs = (
            f"= {100 * sdpa_ms / ms:5.1f}% of SDPA's {flops / sdpa_ms / 1e9:6.1f}"
            if sdpa_ms
            else "(no SDPA peer)"
        )
        print(f"  {name}: programs/SM {per_sm[64]:.1f} at 64 rows, {per_sm[256]:.1f} at 256")
        print(f"    rule  {rate:6.1f} TFLOP/s {vs}  {chosen.code()}")
        if best is not None:
            print(f"    best  {flops / best[0] / 1e9:6.1f} TFLOP/s  {best[1].code()}")
    n = len(summary)
    fits = [t for t, ms in times.items() if len(ms) == n and tiles_fit(t, HEAD_DIM, DTYPE, dev)]
    for label, cases in (("LARGE_TILES[0]", large_cases), ("TILE_CHOICES[0]", small_cases)):
        if not cases:
            continue
        ranked = sorted((sum(times[t][i] for i in cases), t) for t in fits)
        names = ", ".join(summary[i][0] for i in cases)
        print(f"candidates for triton_prefill.{label} (least total time over: {names}):")
        for ms, tiles in ranked[:5]:
            print(f"  {ms:8.4f} ms  {tiles.code()}")
    print("least total time over every case (one default for all):")
    for ms, tiles in sorted((sum(times[t]), t) for t in fits)[:5]:
        print(f"  {ms:8.4f} ms  {tiles.code()}")


if __name__ == "__main__":
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    gbps = copy_bandwidth()
    print(f"copy {gbps:.0f} GB/s")
    if "cap" in sys.argv[1:] or "halves" in sys.argv[1:]:
        if "cap" in sys.argv[1:]:
            check_default(gbps, {"max_registers": 0}, (True,))
        if "halves" in sys.argv[1:]:
            check_default(gbps, {"half_d": False}, (True, False))
        sys.exit(0)
    if "prefill" not in sys.argv[1:]:
        tune_decode(gbps)
    if "decode" not in sys.argv[1:]:
        tune_prefill()
