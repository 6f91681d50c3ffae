"""Probe: how close a Triton causal prefill kernel gets to torch SDPA when K/V are contiguous.

Issue 23 asks the paged prefill kernel for 85% of SDPA's FLOP/s on 8 x 1024-token prompts (8B
heads). This times a minimal flash-attention kernel over contiguous K/V (no block table, no
varlen search, no masks on loads) beside the paged kernel and SDPA, so the gap that paging costs
and the gap that is Triton's own show apart. ``tiles`` sweeps tile shapes with plain loads and
TMA tensor descriptors; ``variants`` takes the best tiles and adds lazy rescaling (the running max
moves only when a row's grows by more than 2^8) and warp specialization of the unmasked loop.
Each configuration is checked against SDPA first and timed as CUDA-graph replays. On a GPU::

    python -m kernels.bench.prefill_probe tiles|variants    # JSON to $OUT/prefill_probe.json
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import sys

import torch
import triton
import triton.language as tl

from kernels.triton_prefill import _softmax_update

LOG2E = 1.4426950408889634


@triton.jit
def _load_kv(k_ptr, v_ptr, kd, vd, row0, n0, kvh, s_kt, s_vt, D: tl.constexpr,
             BLOCK_N: tl.constexpr, TMA: tl.constexpr):  # fmt: skip
    """Keys and values ``n0 .. n0 + BLOCK_N`` of one KV head: TMA descriptors or plain loads."""
    if TMA:
        return kd.load([row0 + n0, kvh * D]), vd.load([row0 + n0, kvh * D])
    else:
        rows = (row0 + n0 + tl.arange(0, BLOCK_N)).to(tl.int64)[:, None]
        cols = kvh * D + tl.arange(0, D)[None, :]
        return tl.load(k_ptr + rows * s_kt + cols), tl.load(v_ptr + rows * s_vt + cols)


@triton.jit
def _contig_kernel(q_ptr, k_ptr, v_ptr, o_ptr, qd, kd, vd, od, scale_log2e, N,
                   s_qt, s_kt, s_vt, s_ot,
                   HQ: tl.constexpr, GROUP: tl.constexpr, HEADS: tl.constexpr, D: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TMA: tl.constexpr,
                   STAGES: tl.constexpr, LAZY: tl.constexpr, WS: tl.constexpr):  # fmt: skip
    # one program: TOKENS tokens x HEADS heads of one sequence; sequences have N tokens each
    TOKENS: tl.constexpr = BLOCK_M // HEADS
    pid = tl.program_id(0)
    hsets: tl.constexpr = HQ // HEADS
    h0 = (pid % hsets) * HEADS
    tiles_per_seq = N // TOKENS
    t = pid // hsets
    tile = tiles_per_seq - 1 - (t % tiles_per_seq)  # long tiles first
    b = t // tiles_per_seq
    m0 = tile * TOKENS
    kvh = h0 // GROUP
    row0 = b * N
    r = tl.arange(0, BLOCK_M)
    tok = m0 + r // HEADS
    head = h0 + r % HEADS
    offs_d = tl.arange(0, D)
    if TMA and HEADS == 1:
        q = qd.load([row0 + m0, h0 * D])
    else:
        q = tl.load(q_ptr + (row0 + tok).to(tl.int64)[:, None] * s_qt + head[:, None] * D
                    + offs_d[None, :])  # fmt: skip
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    full_end = m0 // BLOCK_N * BLOCK_N
    for n0 in tl.range(0, full_end, BLOCK_N, num_stages=STAGES, warp_specialize=WS):
        k, v = _load_kv(k_ptr, v_ptr, kd, vd, row0, n0, kvh, s_kt, s_vt, D, BLOCK_N, TMA)
        s = tl.dot(q, tl.trans(k))
        if LAZY:
            # the running max moves only when a row's grows by more than 2^8: p stays <= 256
            m_new = tl.maximum(m_i, tl.max(s, 1) * scale_log2e)
            if tl.max(m_new - m_i) > 8.0:
                alpha = tl.math.exp2(m_i - m_new)
                l_i = l_i * alpha
                acc = acc * alpha[:, None]
                m_i = m_new
            p = tl.math.exp2(s * scale_log2e - m_i[:, None])
            l_i = l_i + tl.sum(p, 1)
            acc = acc + tl.dot(p.to(v.dtype), v)
        else:
            m_i, alpha, p, l_i = _softmax_update(s, m_i, l_i, scale_log2e, False, 0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    for n0 in tl.range(full_end, m0 + TOKENS, BLOCK_N, num_stages=STAGES):
        pos = n0 + tl.arange(0, BLOCK_N)
        k, v = _load_kv(k_ptr, v_ptr, kd, vd, row0, n0, kvh, s_kt, s_vt, D, BLOCK_N, TMA)
        s = tl.dot(q, tl.trans(k))
        s = tl.where(pos[None, :] <= tok[:, None], s, float("-inf"))
        m_i, alpha, p, l_i = _softmax_update(s, m_i, l_i, scale_log2e, False, 0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    out = (acc / l_i[:, None]).to(o_ptr.dtype.element_ty)
    tl.store(o_ptr + (row0 + tok).to(tl.int64)[:, None] * s_ot + head[:, None] * D
             + offs_d[None, :], out)  # fmt: skip


def contig(q, k, v, n, cfg, out):
    bm, bn, warps, stages, heads, tma, lazy, ws = cfg
    t, hq, d = q.shape
    hkv = k.shape[1]
    group = hq // hkv
    q2, k2, v2 = (x.view(t, -1) for x in (q, k, v))
    if tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        qd = TensorDescriptor.from_tensor(q2, [bm, d]) if heads == 1 else q2
        kd = TensorDescriptor.from_tensor(k2, [bn, d])
        vd = TensorDescriptor.from_tensor(v2, [bn, d])
    else:
        qd = kd = vd = q2
    grid = (t // (bm // heads) * (hq // heads),)
    _contig_kernel[grid](
        q, k, v, out, qd, kd, vd, qd, LOG2E / d**0.5, n, q.stride(0), k.stride(0), v.stride(0),
        out.stride(0), HQ=hq, GROUP=group, HEADS=heads, D=d, BLOCK_M=bm, BLOCK_N=bn, TMA=tma,
        STAGES=stages, LAZY=lazy, WS=ws, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out


def tile_configs() -> list[tuple]:
    """(BLOCK_M, BLOCK_N, warps, stages, heads per tile, TMA, lazy, warp-specialized)."""
    configs = []
    for bm, bn, warps, stages, heads, tma in itertools.product(
        (128, 256), (64, 128), (4, 8, 16), (2, 3, 4), (1, 4), (False, True)
    ):
        fits = (stages * 2 * bn + bm) * 128 * 2 <= 200 * 1024  # bf16, D = 128
        if fits and (bm, warps) not in ((128, 16), (256, 4)):
            configs.append((bm, bn, warps, stages, heads, tma, False, False))
    return configs


def variant_configs() -> list[tuple]:
    """The best tiles of ``tile_configs`` (an H200, 2026-11-28), with and without the knobs."""
    base = [
        (128, 64, 4, 2, 4), (256, 64, 8, 4, 4), (128, 64, 8, 3, 4), (128, 64, 4, 2, 1),
        (256, 64, 8, 3, 4), (128, 128, 8, 2, 4), (128, 64, 8, 3, 1), (256, 64, 16, 4, 4),
    ]  # fmt: skip
    return [
        (*b, tma, lazy, ws)
        for b, tma, lazy, ws in itertools.product(base, (False, True), (False, True), (False, True))
        if tma or not ws
    ]


# the probe configurations that led the variants sweep in graph timing (2026-11-29)
ENGINE_PEERS = [
    (128, 64, 4, 2, 4, True, False),
    (256, 64, 8, 3, 4, True, False),
    (256, 64, 8, 3, 4, False, False),
    (128, 64, 8, 3, 4, False, False),
]


def engine_rows(p, n: int, b: int, flops: float) -> list[tuple[str, float, float]]:
    """The engine's prefill kernel reading the chunk's K/V contiguously (``k_new``/``v_new``),
    with and without TMA and the no-prefix hint, over a few tiles; checked against the paged
    call's output."""
    from kernels.bench.cases import new_kv
    from kernels.triton_prefill import Tiles, prefill_attention

    args = (p.q, p.k_cache, p.v_cache, p.block_tables, p.query_start_loc, p.context_lens, p.scale)
    want = prefill_attention(*args).float()
    k_new, v_new = new_kv(p, [n] * b, [n] * b)
    rows = []
    tiles_list = [None, Tiles(256, 64, 8, 3, True), Tiles(128, 64, 4, 2, True),
                  Tiles(256, 64, 16, 2, True), Tiles(256, 32, 16, 3, True)]  # fmt: skip
    for tiles, tma, whole in itertools.product(tiles_list, (False, True), (False, True)):
        name = f"engine k_new {tiles.code() if tiles else 'rule'} tma={tma} no_prefix={whole}"
        run = functools.partial(prefill_attention, *args, tiles=tiles, k_new=k_new, v_new=v_new,
                                tma=tma, no_prefix=whole)  # fmt: skip
        try:
            err = (run().float() - want).abs().max().item()
            t = ms(run)
        except Exception as exc:  # a configuration Triton cannot compile here
            print(name, "failed:", str(exc).splitlines()[0][:200], flush=True)
            continue
        rows.append((name, t, err))
        print(name, f"{t:.3f} ms {flops / t / 1e9:.1f} TFLOP/s err {err:.3g}", flush=True)
    return rows


def ms(fn):
    """Median GPU time of CUDA-graph replays: what the kernel costs, not its launcher (each
    eager call here would be timed from before the launcher's argument checks, and the paged
    kernel's launcher checks much more than the probe's)."""
    import triton.testing

    return float(triton.testing.do_bench_cudagraph(fn, rep=40, return_mode="median"))


def main() -> None:
    if hasattr(triton, "set_allocator"):
        triton.set_allocator(
            lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda")
        )
    b, n, hq, hkv, d = 8, 1024, 32, 8, 128
    dt = torch.bfloat16
    torch.manual_seed(0)
    q = torch.randn(b * n, hq, d, device="cuda", dtype=dt)
    k = torch.randn(b * n, hkv, d, device="cuda", dtype=dt)
    v = torch.randn(b * n, hkv, d, device="cuda", dtype=dt)
    flops = 4.0 * d * hq * b * n * (n + 1) / 2
    qs = q.view(b, n, hq, d).transpose(1, 2)
    ks = k.view(b, n, hkv, d).transpose(1, 2)
    vs = v.view(b, n, hkv, d).transpose(1, 2)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    ref = sdpa(qs, ks, vs, is_causal=True, enable_gqa=True).transpose(1, 2).reshape(b * n, hq, d)
    rows = []
    t_sdpa = ms(lambda: sdpa(qs, ks, vs, is_causal=True, enable_gqa=True))
    rows.append(("sdpa", t_sdpa, 0.0))
    # the paged kernel on the same K/V laid out as a paged cache with shuffled blocks
    from kernels.bench.cases import paged
    from kernels.triton_prefill import prefill_attention

    p = paged([n] * b, [n] * b)
    fn = functools.partial(
        prefill_attention,
        *(p.q, p.k_cache, p.v_cache, p.block_tables, p.query_start_loc, p.context_lens, p.scale),
    )
    rows.append(("paged (rule)", ms(fn), 0.0))
    if "engine" in sys.argv[1:]:
        rows += engine_rows(p, n, b, flops)
    out = torch.empty_like(q)
    configs = tile_configs() if "variants" not in sys.argv[1:] else variant_configs()
    if "engine" in sys.argv[1:]:  # the probe's own best four of the variants sweep beside them
        configs = [c for c in variant_configs() if c[:7] in ENGINE_PEERS]
    only = os.environ.get("PROBE_ONLY")
    for cfg in configs:
        if only and only not in str(cfg):
            continue
        try:
            contig(q, k, v, n, cfg, out)
            torch.cuda.synchronize()
            err = (out.float() - ref.float()).abs().max().item()
            t = ms(lambda cfg=cfg: contig(q, k, v, n, cfg, out))
        except Exception as exc:  # a configuration Triton cannot compile here
            print(cfg, "failed:", str(exc).splitlines()[0][:200], flush=True)
            continue
        rows.append((str(cfg), t, err))
        print(cfg, f"{t:.3f} ms {flops / t / 1e9:.1f} TFLOP/s err {err:.3g}", flush=True)
    rows.sort(key=lambda r: r[1])
    res = [{"name": r[0], "ms": r[1], "tflops": flops / r[1] / 1e9, "err": r[2]} for r in rows]
    out_dir = os.environ.get("OUT", ".")
    with open(os.path.join(out_dir, "prefill_probe.json"), "w") as f:
        json.dump(
            {"triton": triton.__version__, "torch": torch.__version__, "rows": res}, f, indent=1
        )
    print("\nname | ms | TFLOP/s | % sdpa | err")
    for r in res[:25]:
        print(
            f"{r['name']} | {r['ms']:.3f} | {r['tflops']:.1f} | {100 * t_sdpa / r['ms']:.0f}% | {r['err']:.3g}"
        )
    print("sdpa", f"{flops / t_sdpa / 1e9:.1f}", file=sys.stderr)


if __name__ == "__main__":
    main()
