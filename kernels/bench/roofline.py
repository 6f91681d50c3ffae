"""``tandem bench kernels``: the Triton kernels against the roofline, on a CUDA GPU.

Measures the device copy bandwidth first (one large device-to-device copy, bytes read + written)
and reports every memory-bound kernel as a fraction of it: paged decode attention (K/V read once
+ q + out), the element-wise layers, KV writes, block gathers and the KV-transfer checksum (its
bytes read once; ``python -m kernels.bench.checksum`` sweeps it). Prefill attention is reported
in TFLOP/s (causal pairs only). Times are ``triton.testing.do_bench`` medians, which flush L2
between runs. ``--check`` runs a correctness pass against the torch references instead.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from kernels.triton_common import interpreting

GPU_NEEDED = (
    "tandem bench kernels needs a CUDA GPU and compiled Triton kernels; {why}. "
    "(The kernels' correctness tests run on the CPU: TRITON_INTERPRET=1 pytest tests/kernels)"
)


def median_ms(fn: Callable[[], object]) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median"))


def write_results(path: str, copy_gbps: float, rows: list[dict[str, Any]], **extra: Any) -> None:
    """A kernel bench's JSON: the device, torch, the copy bandwidth, ``extra`` and its rows."""
    doc = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "copy_gb_per_s": copy_gbps, **extra, "rows": rows}  # fmt: skip
    with open(path, "w") as fh:
        json.dump(doc, fh, indent=1)


def copy_bandwidth() -> float:
    """GB/s of a 1 GiB device-to-device copy, counting bytes read and written."""
    src = torch.randn(1 << 29, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src))
    return 2 * src.numel() * src.element_size() / ms / 1e6


def matmul_flops() -> float:
    """FLOP/s of an 8192^3 bf16 matrix product on random data (zeros run faster)."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn_like(a)
    return 2 * 8192**3 / median_ms(lambda: a @ b) * 1e3


# The two ceilings as measured on these GPUs in this workplace (targets.md and the lent-GPU notes:
# a 1 GiB device-to-device copy counting bytes read and written; an 8192^3 bf16 product on random
# data). The H200 has the H100's tensor cores and 1.43x its copy bandwidth, so a floor computed
# with the H100's bandwidth on an H200 is too high and its "fraction of floor" above 1.
KNOWN_CEILINGS: dict[str, tuple[float, float]] = {
    "NVIDIA H100 80GB HBM3": (3.0e12, 780e12),
    "NVIDIA H200": (4.3e12, 788e12),
}


@dataclasses.dataclass(frozen=True)
class Ceilings:
    """What a floor is computed against: bytes/s of a device-to-device copy and bf16 FLOP/s."""

    device: str
    copy_bytes_per_s: float
    bf16_flops_per_s: float
    measured_now: bool  # False: KNOWN_CEILINGS' figures for this device


@functools.cache
def device_ceilings() -> Ceilings:
    """The current GPU's ceilings: the known figures for a GPU in :data:`KNOWN_CEILINGS`, else
    measured now (about a second, ~1.4 GB of device memory)."""
    name = torch.cuda.get_device_name()
    known = KNOWN_CEILINGS.get(name)
    if known is not None:
        return Ceilings(name, *known, measured_now=False)
    return Ceilings(name, copy_bandwidth() * 1e9, matmul_flops(), measured_now=True)


def graph_ms(fn: Callable[[], object]) -> float:
    """Median time of ``fn`` replayed from a CUDA graph: the GPU's time without Python launches."""
    import triton.testing

    return float(triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median"))


def host_us(fn: Callable[[], object], calls: int = 200) -> float:
    """Microseconds of CPU per call (launch overhead: argument checks, allocation, Triton's
    launcher), from back-to-back calls; the GPU catches up after the clock stops."""
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def measure(name: str, shape: str, fn: Callable[[], object], *, nbytes: float = 0.0, flops: float = 0.0, copy_gbps: float = 0.0, **extra: Any) -> dict[str, Any]:  # fmt: skip
    """One result row: eager time (Python launch included) and CUDA-graph replay time."""
    ms, gms, cpu = median_ms(fn), graph_ms(fn), host_us(fn)
    out: dict[str, Any] = {"name": name, "shape": shape, "ms": round(ms, 5), "graph_ms": round(gms, 5), "host_us": round(cpu, 1)}  # fmt: skip
    if nbytes:
        out.update(
            gb_per_s=round(nbytes / ms / 1e6, 1),
            pct_of_copy=round(100 * nbytes / ms / 1e6 / copy_gbps, 1),
            graph_pct_of_copy=round(100 * nbytes / gms / 1e6 / copy_gbps, 1),
        )
    if flops:
        out.update(tflop_per_s=round(flops / ms / 1e9, 1), graph_tflop_per_s=round(flops / gms / 1e9, 1))  # fmt: skip
    out.update(extra)
    return out


SOFTCAP = 50.0  # Gemma 2's attn_logit_softcapping


def bench_decode(copy_gbps: float) -> list[dict[str, Any]]:
    from kernels.bench.cases import DECODE_CASES, KV_HEADS, paged
    from kernels.triton_decode import choose_num_splits, paged_decode_attention

    rows = []
    for batch, ctx in DECODE_CASES:
        p = paged([ctx] * batch)
        splits = choose_num_splits(batch, KV_HEADS, p.block_tables.shape[1] * 16, p.q.device)
        fn = functools.partial(paged_decode_attention, p.q, p.k_cache, p.v_cache, p.block_tables, p.context_lens, p.scale)  # fmt: skip
        shape = f"B={batch} ctx={ctx}"
        rows.append(measure("decode attention", shape, fn, nbytes=p.io_bytes(), copy_gbps=copy_gbps, num_splits=splits))  # fmt: skip
        if (batch, ctx) == DECODE_CASES[0]:  # Gemma 2's soft-capped scores: a tanh a score
            capped = functools.partial(fn, softcap=SOFTCAP)
            rows.append(measure("decode attention, soft-capped", shape, capped, nbytes=p.io_bytes(), copy_gbps=copy_gbps, num_splits=splits))  # fmt: skip
        rows.append(measure("  torch sdpa (contiguous KV)", shape, _sdpa_decode(p, batch, ctx), nbytes=p.io_bytes(), copy_gbps=copy_gbps))  # fmt: skip
        del p, fn
    return rows


def _sdpa_decode(p: Any, batch: int, ctx: int) -> Callable[[], object]:
    """The peer: torch's fused attention on the same bytes laid out contiguously (no paging)."""
    q = p.q.view(batch, -1, 1, p.q.shape[-1])
    k = torch.randn((batch, p.k_cache.shape[2], ctx, p.q.shape[-1]), device="cuda", dtype=p.q.dtype)
    v = torch.randn_like(k)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    return functools.partial(sdpa, q, k, v, enable_gqa=True)


def bench_prefill() -> list[dict[str, Any]]:
    from kernels.bench.cases import PREFILL_CASES, new_kv, paged, prefill_flops
    from kernels.triton_prefill import prefill_attention

    rows = []
    for name, ctx_lens, q_lens in PREFILL_CASES:
        p = paged(ctx_lens, q_lens)
        flops = prefill_flops(ctx_lens, q_lens)
        fn = functools.partial(prefill_attention, p.q, p.k_cache, p.v_cache, p.block_tables, p.query_start_loc, p.context_lens, p.scale)  # fmt: skip
        rows.append(measure("prefill attention", name, fn, flops=flops))
        if ctx_lens == q_lens:  # whole prompts, as the engine runs them on a GPU: the new K/V
            # read contiguously, nothing paged compiled in (k_new, no_prefix)
            k_new, v_new = new_kv(p, ctx_lens, q_lens)
            whole = functools.partial(fn, k_new=k_new, v_new=v_new, no_prefix=True)
            rows.append(measure("prefill attention, whole prompts", name, whole, flops=flops))
            if name == PREFILL_CASES[0][0]:  # Gemma 2's soft-capped scores
                capped = functools.partial(whole, softcap=SOFTCAP)
                rows.append(measure("prefill attention, whole, soft-capped", name, capped, flops=flops))  # fmt: skip
        sdpa = sdpa_prefill(p, ctx_lens, q_lens)
        if sdpa is not None:
            rows.append(measure("  torch sdpa (contiguous KV)", name, sdpa, flops=flops))
    return rows + bench_mla_prefill()


def bench_mla_prefill(heads: int = 16, prompts: int = 8, n: int = 1024) -> list[dict[str, Any]]:
    """DeepSeek-V2-Lite's prefill attention (16 heads), whole prompts: expanded (192-dim queries
    and keys, 128-dim values: ``varlen_attention``) against the absorbed form over the latent
    (576 dims, one KV head, values the same rows), and SDPA on the expanded tensors. FLOPs are
    each form's own (the absorbed one does more work for the same result)."""
    from kernels.triton_prefill import prefill_attention
    from kernels.triton_varlen import varlen_attention

    dt, t = torch.bfloat16, prompts * n
    pairs = prompts * n * (n + 1) // 2
    starts = torch.arange(0, t + 1, n, device="cuda", dtype=torch.int32)
    q, k = (torch.randn((t, heads, 192), device="cuda", dtype=dt) for _ in range(2))
    v = torch.randn((t, heads, 128), device="cuda", dtype=dt)
    name = f"{prompts} x {n} prompts, {heads} heads"
    expanded = functools.partial(varlen_attention, q, k, v, starts, 192**-0.5)
    rows = [
        measure("MLA prefill, expanded (varlen)", name, expanded, flops=2.0 * 320 * heads * pairs)
    ]
    ql = torch.randn((t, heads, 576), device="cuda", dtype=dt)
    rows_l = torch.randn((t, 1, 576), device="cuda", dtype=dt)
    cache = rows_l[:, None]  # [T, 1, 1, 576]: one block a token, never read (no_prefix)
    tables = torch.zeros((prompts, 1), device="cuda", dtype=torch.int32)
    lens = torch.full((prompts,), n, device="cuda", dtype=torch.int32)
    absorbed = functools.partial(
        prefill_attention, ql, cache, cache, tables, starts, lens, 192**-0.5, k_new=rows_l,
        v_new=rows_l, no_prefix=True,
    )  # fmt: skip
    rows.append(measure("MLA prefill, absorbed (latent MQA)", name, absorbed, flops=2.0 * 1152 * heads * pairs))  # fmt: skip
    qs, ks, vs = (x.view(prompts, n, heads, -1).transpose(1, 2) for x in (q, k, v))
    sdpa = functools.partial(torch.nn.functional.scaled_dot_product_attention, qs, ks, vs, is_causal=True)  # fmt: skip
    rows.append(measure("  torch sdpa (expanded)", name, sdpa, flops=2.0 * 320 * heads * pairs))
    return rows


def sdpa_prefill(p: Any, ctx_lens: list[int], q_lens: list[int]) -> Callable[[], object] | None:
    """The peer for equal whole prompts: causal SDPA on contiguous K/V (None for other cases)."""
    if ctx_lens != q_lens or len(set(q_lens)) != 1:
        return None
    b, n = len(q_lens), q_lens[0]
    q = p.q.view(b, n, -1, p.q.shape[-1]).transpose(1, 2)
    k = torch.randn((b, p.k_cache.shape[2], n, p.q.shape[-1]), device="cuda", dtype=p.q.dtype)
    v = torch.randn_like(k)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    return functools.partial(sdpa, q, k, v, is_causal=True, enable_gqa=True)


def bench_memory_bound(copy_gbps: float) -> list[dict[str, Any]]:
    from kernels import triton_attention, triton_block_copy, triton_checksum, triton_layers

    t, h, inter, dt = 4096, 4096, 14336, torch.bfloat16
    x, r, w = (torch.randn(s, device="cuda", dtype=dt) for s in ((t, h), (t, h), (h,)))
    y = torch.randn((t, 2 * inter), device="cuda", dtype=dt)
    q, k = torch.randn((t, 32, 128), device="cuda", dtype=dt), torch.randn((t, 8, 128), device="cuda", dtype=dt)  # fmt: skip
    cs, pos = torch.randn((8192, 128), device="cuda"), torch.randint(0, 8192, (t,), device="cuda")
    tk = 4 * t  # write_kv moves little per token: more tokens, so the data outgrows L2
    k_new, v_new = (torch.randn((tk, 8, 128), device="cuda", dtype=dt) for _ in range(2))
    kc = torch.empty((tk // 16 + 64, 16, 8, 128), device="cuda", dtype=dt)
    vc = torch.empty_like(kc)
    slots = torch.randperm(kc.shape[0] * 16, device="cuda")[:tk]
    caches = [torch.randn((2, 512, 16, 8, 128), device="cuda", dtype=dt) for _ in range(32)]
    ids = torch.randperm(512, device="cuda")[:64]
    e = 2  # bytes per bf16 element
    kv = torch.randint(0, 256, (1024 * 32 * 2 * 8 * 128 * e,), dtype=torch.uint8, device="cuda")
    cases = [
        (
            "rms_norm + residual",
            f"{t}x{h}",
            lambda: triton_layers.rms_norm(x, w, 1e-5, r),
            4 * t * h * e,
        ),
        (
            "silu_and_mul",
            f"{t}x{2 * inter}",
            lambda: triton_layers.silu_and_mul(y),
            3 * t * inter * e,
        ),
        (
            "gelu_tanh_and_mul (Gemma)",
            f"{t}x{2 * inter}",
            lambda: triton_layers.gelu_tanh_and_mul(y),
            3 * t * inter * e,
        ),
        (
            "rotary_embedding",
            f"T={t} 32+8 heads",
            lambda: triton_layers.rotary_embedding(pos, q, k, cs),
            2 * (q.numel() + k.numel()) * e + t * 128 * 4,
        ),
        (
            "write_kv",
            f"T={tk} 8 heads",
            lambda: triton_attention.write_kv(k_new, v_new, kc, vc, slots),
            4 * k_new.numel() * e,
        ),
        (
            "gather_blocks",
            "32 layers x 64 blocks",
            lambda: triton_block_copy.gather_blocks(caches, ids),
            2 * 32 * 2 * 64 * 16 * 8 * 128 * e,
        ),
        (
            "kv checksum",
            "1024 tokens (134 MB)",
            lambda: triton_checksum.checksum(kv),
            kv.numel(),  # read once, nothing written but the per-program sums
        ),
    ]
    return [measure(n, s, fn, nbytes=b, copy_gbps=copy_gbps) for n, s, fn, b in cases]


def print_table(report: dict[str, Any]) -> None:
    print(f"\n{report['device']}  triton {report['triton']}  torch {report['torch']}")
    print(f"device copy: {report['copy_gb_per_s']:.0f} GB/s (read + write)")
    print("ms: eager (Python launch included); graph: CUDA-graph replay (GPU time only);")
    print("host us: CPU time per eager call (what CUDA graphs save)\n")
    head = f"{'kernel':30} {'shape':28} {'ms':>8} {'graph ms':>8} {'host us':>7} {'GB/s':>7} {'%copy':>6} {'graph%':>6} {'TFLOP/s':>7} {'graph':>6}"  # fmt: skip
    print(head)
    for r in report["results"]:
        cols = [r.get(k, "") for k in ("gb_per_s", "pct_of_copy", "graph_pct_of_copy", "tflop_per_s", "graph_tflop_per_s")]  # fmt: skip
        gb, pct, gpct, tf, gtf = (f"{c}" for c in cols)
        print(f"{r['name']:30} {r['shape']:28} {r['ms']:8.4f} {r['graph_ms']:8.4f} {r['host_us']:7.1f} {gb:>7} {pct:>6} {gpct:>6} {tf:>7} {gtf:>6}")  # fmt: skip


def run_benchmarks() -> dict[str, Any]:
    import triton

    copy_gbps = copy_bandwidth()
    results = bench_decode(copy_gbps) + bench_prefill() + bench_memory_bound(copy_gbps)
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(),
        "triton": triton.__version__,
        "torch": torch.__version__,
        "copy_gb_per_s": round(copy_gbps, 1),
        "results": results,
    }


def main(args: argparse.Namespace) -> int:
    if not torch.cuda.is_available():
        print(GPU_NEEDED.format(why="no CUDA device is visible"), file=sys.stderr)
        return 2
    if interpreting():
        print(GPU_NEEDED.format(why="TRITON_INTERPRET is set; unset it"), file=sys.stderr)
        return 2
    if getattr(args, "check", False):
        from kernels.bench.check import run_checks

        return run_checks()
    report = run_benchmarks()
    print_table(report)
    if getattr(args, "json_out", None):
        with open(args.json_out, "w") as f:
            json.dump(report, f, indent=2)
        print(f"\nwrote {args.json_out}")
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json-out", default=None)
    parser.add_argument("--check", action="store_true", help="correctness vs references only")
    sys.exit(main(parser.parse_args()))
