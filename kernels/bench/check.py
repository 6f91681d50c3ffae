"""``tandem bench kernels --check``: every Triton kernel against its torch reference on the GPU.

Llama-3.1-8B attention shapes (32 q / 8 kv heads, head_dim 128, bf16, block size 16) with
shuffled block tables, mixed lengths and split-K; tolerance is relative error in the L2 norm.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kernels import attention, block_copy, layers
from kernels import checksum as kv_checksum
from kernels import triton_attention as ta
from kernels import triton_block_copy as tb
from kernels import triton_checksum as tc
from kernels import triton_layers as tl_
from kernels.bench.cases import paged

BF16_TOL = 1e-2


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    if torch.isnan(out).any():
        return float("inf")
    return float((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-12))


def check_decode() -> float:
    worst = 0.0
    for lens in ([4096, 1, 17, 1000, 4095, 33], [32768], [512] * 256):
        p = paged(lens)
        ref = attention.ref_paged_decode_attention(p.q, p.k_cache, p.v_cache, p.block_tables, p.context_lens, p.scale)  # fmt: skip
        for splits in (None, 1, 7):
            out = ta.paged_decode_attention(p.q, p.k_cache, p.v_cache, p.block_tables, p.context_lens, p.scale, num_splits=splits)  # fmt: skip
            worst = max(worst, rel_err(out, ref))
    return worst


def check_prefill() -> float:
    worst = 0.0
    for ctx, qlen in (([1024, 1000, 3], [1024, 1000, 3]), ([4608, 300, 17], [512, 1, 17])):
        p = paged(ctx, qlen)
        args = (
            p.q,
            p.k_cache,
            p.v_cache,
            p.block_tables,
            p.query_start_loc,
            p.context_lens,
            p.scale,
        )
        worst = max(worst, rel_err(ta.prefill_attention(*args), attention.ref_prefill_attention(*args)))  # fmt: skip
    return worst


def check_write_kv() -> float:
    p = paged([100, 37])
    k = torch.randn((50, *p.k_cache.shape[2:]), device="cuda", dtype=p.k_cache.dtype)
    v = torch.randn_like(k)
    slots = torch.randperm(p.k_cache.shape[0] * 16, device="cuda")[:50]
    slots[3] = -1
    ref_k, ref_v = p.k_cache.clone(), p.v_cache.clone()
    attention.ref_write_kv(k, v, ref_k, ref_v, slots)
    ta.write_kv(k, v, p.k_cache, p.v_cache, slots)
    return 0.0 if torch.equal(ref_k, p.k_cache) and torch.equal(ref_v, p.v_cache) else float("inf")


def check_layers() -> float:
    dt, dev = torch.bfloat16, "cuda"
    x, r, w = (torch.randn(s, device=dev, dtype=dt) for s in ((300, 4096), (300, 4096), (4096,)))
    errs = [rel_err(tl_.rms_norm(x, w, 1e-5, r)[0], layers.ref_rms_norm(x, w, 1e-5, r)[0])]
    y = torch.randn((300, 2 * 14336), device=dev, dtype=dt)
    errs.append(rel_err(tl_.silu_and_mul(y), layers.ref_silu_and_mul(y)))
    errs.append(rel_err(tl_.gelu_tanh_and_mul(y), layers.ref_gelu_tanh_and_mul(y)))
    q, k = torch.randn((300, 32, 128), device=dev, dtype=dt), torch.randn((300, 8, 128), device=dev, dtype=dt)  # fmt: skip
    cs, pos = torch.randn((4096, 128), device=dev), torch.randint(0, 4096, (300,), device=dev)
    rq, rk = q.clone(), k.clone()
    layers.ref_rotary_embedding(pos, rq, rk, cs)
    tl_.rotary_embedding(pos, q, k, cs)
    errs += [rel_err(q, rq), rel_err(k, rk)]
    return max(errs)


def check_block_copy() -> float:
    caches = [torch.randn((2, 128, 16, 8, 128), device="cuda", dtype=torch.bfloat16) for _ in range(4)]  # fmt: skip
    ids = torch.randperm(128, device="cuda")[:20]
    buf = tb.gather_blocks(caches, ids)
    ok = torch.equal(buf, block_copy.ref_gather_blocks(caches, ids))
    dst = [torch.randn_like(c) for c in caches]
    ref_dst = [c.clone() for c in dst]
    tb.scatter_blocks(buf, dst, ids)
    block_copy.ref_scatter_blocks(buf, ref_dst, ids)
    ok = ok and all(torch.equal(a, b) for a, b in zip(dst, ref_dst, strict=True))
    return 0.0 if ok else float("inf")


def check_checksum() -> float:
    """Bit-exact: aligned and unaligned slices across the 4M-word piece boundary, with a tail."""
    data = torch.randint(0, 256, ((1 << 24) + 4099,), dtype=torch.uint8, device="cuda")
    ok = all(
        int(tc.checksum(data[a:])) == int(kv_checksum.ref_checksum(data[a:])) for a in (0, 1, 4, 7)
    )
    return 0.0 if ok else float("inf")


CHECKS: dict[str, Callable[[], float]] = {
    "paged_decode_attention": check_decode,
    "prefill_attention": check_prefill,
    "write_kv": check_write_kv,
    "rms_norm / silu_and_mul / gelu_tanh_and_mul / rotary": check_layers,
    "gather_blocks / scatter_blocks": check_block_copy,
    "kv checksum": check_checksum,
}


def run_checks() -> int:
    """Print one line per kernel family; returns 1 if any exceeds the bf16 tolerance."""
    failed = 0
    for name, check in CHECKS.items():
        err = check()
        ok = err <= BF16_TOL
        failed += not ok
        print(f"{'ok  ' if ok else 'FAIL'} {name:36} max relative error {err:.2e} (tolerance {BF16_TOL:.0e})")  # fmt: skip
    return 1 if failed else 0
