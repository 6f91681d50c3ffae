"""Quantized-weight linear layers against the roofline: int4 (w4a16) and fp8 against bf16.

    python -m kernels.bench.quant [--rows 1 4 16] [--w8a8-rows 256 8192] [--w4-rows 64 256 8192]
                                  [--fused-rows 224 8192] [--json-out quant.json]

Shapes are Llama-3.1-8B's decode projections. At batch 1-16 a linear layer is bound by the bytes
of its weight, so each row reports GB/s of what the kernel must read (the packed weight, its
scales and zeros, x and the output written) against the device copy bandwidth, and the time
against the time bf16 weights take (cuBLAS). The napkin math for one 4096 x 14336 layer on an
H100 (~3 TB/s copy): bf16 117 MB -> ~39 us; fp8 59 MB + 1.8 MB of row scales -> ~20 us; int4
29 MB + 1.8 MB of scales and zeros at group 128 -> ~10 us. Each Triton kernel's best launch of
a small sweep is reported; every launch is checked against the torch reference first. Times are
``do_bench`` medians with L2 flushed between runs.

``--w8a8-rows`` times the large-batch FP8 path (prefill, big decode batches) the engine takes
above ``kernels.ops.FP8_GEMV_ROWS``: x quantized per token (torch's five passes against the one
Triton kernel, each against the bytes it must move: read x, write the fp8 copy and the scales),
``torch._scaled_mm`` on the FP8 tensor cores, and the whole layer against bf16 cuBLAS in TFLOP/s.

``--fused-rows`` times the kernels that hand a W8A8 layer its input quantized (the RMSNorm with
the residual add, the SiLU-and-mul, each ending in the per-token quantization) against the two
kernels they replace.

``--w4-rows`` times int4 at larger batches both ways: the Triton GEMM (at its default tiles and
at 128 x 128 ones) and the weight dequantized to bf16 then torch's matmul (what the engine does
above ``kernels.triton_quant.W4_DEQUANT_ROWS``), against bf16 cuBLAS; and the dequantization
alone against the bytes it moves (the packed weight, scales and zeros read, bf16 written).
"""

from __future__ import annotations

import argparse
import functools
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

SHAPES = {  # name -> (N, K)
    "qkv 4096->6144": (6144, 4096),
    "o 4096->4096": (4096, 4096),
    "gate_up 4096->28672": (28672, 4096),
    "down 14336->4096": (4096, 14336),
}
GROUP = 128  # int4 group size and fp8 block
GEMV_CONFIGS = {
    # int4: the GEMV's long chunks (several scale groups) through few columns (2026-11-30)
    "int4": [(bn, bk, w) for bn, bk, w in itertools.product((8, 16, 32), (512, 1024, 2048), (4, 8))
             if bn * bk <= 32768],
    "fp8": [(bn, bk, w) for bn, bk, w in itertools.product((4, 8, 16), (256, 512, 1024), (4, 8))
            if bn * bk <= 16384],
    # per-channel scales (what --quantization fp8 makes at load): chunks of K not bound by a
    # scale block, so longer ones
    "fp8-row": [(bn, bk, w) for bn, bk, w in
                itertools.product((2, 4, 8, 16, 32), (512, 1024, 2048, 4096), (4, 8))
                if 2048 <= bn * bk <= 32768],
}  # fmt: skip
GEMM_CONFIGS = [(16, 64, 64, 4), (16, 128, 64, 4), (16, 64, 128, 4), (32, 64, 64, 4),
                (32, 128, 128, 8)]  # fmt: skip


@dataclass
class Case:
    """One layer's inputs in every format: bf16, int4 (serving layout) and fp8 (block scales
    expanded to rows, as the engine keeps them)."""

    x: torch.Tensor  # [M, K]
    w: torch.Tensor  # [N, K] in x's dtype
    qweight: torch.Tensor  # [K/8, N] int32
    scales: torch.Tensor  # [K/G, N]
    zeros: torch.Tensor  # [K/G, N]
    fp8: torch.Tensor  # [N, K] float8_e4m3fn
    fp8_scale: torch.Tensor  # [N, ceil(K/G)] float32
    fp8_row_scale: torch.Tensor  # [N, 1] float32: per-channel scales

    def bytes(self, fmt: str) -> int:
        """Bytes a kernel must move: its weight format, x read and the output written."""
        io = self.x.numel() * self.x.element_size() * (1 + self.w.shape[0] / self.w.shape[1])
        weight = {
            "bf16": [self.w],
            "int4": [self.qweight, self.scales, self.zeros],
            "fp8": [self.fp8, self.fp8_scale],
            "fp8-row": [self.fp8, self.fp8_row_scale],
        }[fmt]
        return int(io) + sum(t.numel() * t.element_size() for t in weight)


def build(m: int, n: int, k: int, device: torch.device, dtype: torch.dtype = torch.bfloat16) -> Case:  # fmt: skip
    from kernels.quant import expand_block_scales, pack_rows

    gen = torch.Generator().manual_seed(0)
    g = k // GROUP
    q = torch.randint(0, 16, (k, n), generator=gen)
    zeros = torch.randint(0, 16, (g, n), generator=gen).to(dtype)
    scales = (torch.rand(g, n, generator=gen) * 0.004).to(dtype)
    blocks = torch.rand(-(-n // GROUP), -(-k // GROUP), generator=gen) * 1e-4
    fp8 = torch.randn(n, k, generator=gen).mul(100).clamp(-448, 448).to(torch.float8_e4m3fn)
    return Case(
        x=torch.randn(m, k, generator=gen).to(device=device, dtype=dtype),
        w=(torch.randn(n, k, generator=gen) * 0.02).to(device=device, dtype=dtype),
        qweight=pack_rows(q).to(device), scales=scales.to(device), zeros=zeros.to(device),
        fp8=fp8.to(device), fp8_scale=expand_block_scales(blocks, n, GROUP).to(device),
        fp8_row_scale=(torch.rand(n, 1, generator=gen) * 1e-4).to(device),
    )  # fmt: skip


def runners(case: Case, config: tuple[int, ...] | None = None) -> dict[str, tuple[Any, Any]]:
    """format -> (the Triton call, its torch reference)."""
    from kernels import quant, triton_quant

    c = case
    k = c.x.shape[1]
    return {
        "int4": (
            functools.partial(
                triton_quant.w4a16_linear, c.x, c.qweight, c.scales, c.zeros, GROUP, config=config
            ),
            functools.partial(quant.ref_w4a16_linear, c.x, c.qweight, c.scales, c.zeros, GROUP),
        ),
        "fp8": (
            functools.partial(
                triton_quant.fp8_linear, c.x, c.fp8, c.fp8_scale, GROUP, config=config
            ),
            functools.partial(quant.ref_fp8_linear, c.x, c.fp8, c.fp8_scale, GROUP),
        ),
        "fp8-row": (
            functools.partial(
                triton_quant.fp8_linear, c.x, c.fp8, c.fp8_row_scale, k, config=config
            ),
            functools.partial(quant.ref_fp8_linear, c.x, c.fp8, c.fp8_row_scale, k),
        ),
    }


def check(fmt: str, case: Case, config: tuple[int, ...] | None) -> float:
    """Relative error of one launch against the reference; raises SystemExit past 1e-2."""
    fn, ref_fn = runners(case, config)[fmt]
    out, ref = fn().float(), ref_fn().float()
    err = ((out - ref).norm() / ref.norm().clamp(min=1e-30)).item()
    if not err < 1e-2:
        raise SystemExit(f"{fmt} config {config}: relative error {err:.2e}")
    return err


def _configs(fmt: str, m: int) -> list[tuple[int, ...] | None]:
    from kernels.triton_quant import GEMV_ROWS, W4_GEMV_ROWS

    rows = W4_GEMV_ROWS if fmt == "int4" else GEMV_ROWS
    return [None, *(GEMV_CONFIGS[fmt] if m <= rows else GEMM_CONFIGS)]


def bench_shape(name: str, n: int, k: int, m: int, copy: float) -> dict[str, Any]:
    from kernels.bench.roofline import median_ms

    case = build(m, n, k, torch.device("cuda"))
    bf16_ms = median_ms(functools.partial(F.linear, case.x, case.w))
    row: dict[str, Any] = {"shape": name, "m": m, "n": n, "k": k, "copy_gbs": copy,
                           "bf16_ms": bf16_ms, "bf16_gbs": case.bytes("bf16") / bf16_ms / 1e6}  # fmt: skip
    for fmt in ("int4", "fp8", "fp8-row"):
        best: tuple[tuple[int, ...] | None, float] | None = None
        for cfg in _configs(fmt, m):
            check(fmt, case, cfg)
            ms = median_ms(runners(case, cfg)[fmt][0])
            if best is None or ms < best[1]:
                best = (cfg, ms)
        assert best is not None
        gbs = case.bytes(fmt) / best[1] / 1e6
        row.update({f"{fmt}_ms": best[1], f"{fmt}_gbs": gbs, f"{fmt}_pct_of_copy": 100 * gbs / copy,
                    f"{fmt}_speedup_vs_bf16": bf16_ms / best[1], f"{fmt}_config": best[0]})  # fmt: skip
    return row


def bench_w8a8(name: str, n: int, k: int, m: int, copy: float) -> dict[str, Any]:
    """The W8A8 layer at a large batch: its quantization step and its GEMM, against bf16."""
    from kernels import quant, triton_quant
    from kernels.bench.roofline import median_ms

    gen = torch.Generator().manual_seed(0)
    dev = torch.device("cuda")
    x = torch.randn(m, k, generator=gen).to(device=dev, dtype=torch.bfloat16)
    w = (torch.randn(n, k, generator=gen) * 0.02).to(device=dev, dtype=torch.bfloat16)
    wq, ws = quant.quantize_fp8_rows(w)
    ref_q, ref_s = quant.ref_per_token_quant_fp8(x)
    q, s = triton_quant.per_token_quant_fp8(x)
    if not (torch.equal(s, ref_s) and torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8))):
        raise SystemExit(f"per_token_quant_fp8 differs from its reference at {m} x {k}")
    xq, xs = q, s
    scale_b = ws.float().T.contiguous()
    gemm = functools.partial(
        torch._scaled_mm, xq, wq.T, scale_a=xs, scale_b=scale_b, out_dtype=torch.bfloat16
    )
    whole = functools.partial(
        quant.scaled_mm_w8a8_linear, x, wq, ws, triton_quant.per_token_quant_fp8
    )
    out, ref = whole().float(), F.linear(x, w).float()
    err = ((out - ref).norm() / ref.norm()).item()
    if not err < 5e-2:
        raise SystemExit(f"W8A8 {name} at M={m}: relative error {err:.2e} against bf16")
    quant_bytes = m * k * (x.element_size() + 1) + 4 * m
    flop = 2 * m * n * k
    r: dict[str, Any] = {
        "shape": name,
        "m": m,
        "n": n,
        "k": k,
        "copy_gbs": copy,
        "rel_err_vs_bf16": err,
    }
    # the GEMM's other modes at the same shapes: fast accumulation (the tensor cores' own
    # accumulator over the whole K loop, no promotion to fp32 every few steps) and one scale
    # per tensor for each side (cuBLASLt instead of CUTLASS's row-wise kernel)
    one = torch.ones((), device=dev)
    fast = functools.partial(gemm, use_fast_accum=True)
    tensorwise = functools.partial(
        torch._scaled_mm, xq, wq.T, scale_a=one, scale_b=one, out_dtype=torch.bfloat16
    )
    fast_err = ((fast().float() - gemm().float()).norm() / gemm().float().norm()).item()
    r_extra = {"fast_accum_rel_err_vs_scaled_mm": fast_err}
    timed: dict[str, Callable[[], object]] = {
        "bf16_linear": functools.partial(F.linear, x, w),
        "quant_torch": functools.partial(quant.ref_per_token_quant_fp8, x),
        "quant_triton": functools.partial(triton_quant.per_token_quant_fp8, x),
        "scaled_mm": gemm,
        "scaled_mm_fast_accum": fast,
        "scaled_mm_tensorwise": tensorwise,
        "scaled_mm_tensorwise_fast_accum": functools.partial(tensorwise, use_fast_accum=True),
        "w8a8_linear": whole,
    }
    for key, fn in timed.items():
        r[f"{key}_ms"] = median_ms(fn)
    for key in ("quant_torch", "quant_triton"):
        r[f"{key}_pct_of_copy"] = 100 * quant_bytes / r[f"{key}_ms"] / 1e6 / copy
    r.update(r_extra)
    for key in (
        "bf16_linear", "scaled_mm", "scaled_mm_fast_accum", "scaled_mm_tensorwise",
        "scaled_mm_tensorwise_fast_accum", "w8a8_linear",
    ):  # fmt: skip
        r[f"{key}_tflops"] = flop / r[f"{key}_ms"] / 1e9
    r["w8a8_speedup_vs_bf16"] = r["bf16_linear_ms"] / r["w8a8_linear_ms"]
    return r


def bench_fused_inputs(m: int, hidden: int, inter: int, copy: float) -> dict[str, Any]:
    """A W8A8 layer's input made by the kernel before it (``rms_norm_fp8``, ``silu_and_mul_fp8``)
    against that kernel then ``per_token_quant_fp8``: microseconds and % of copy bandwidth of
    the fused kernel's bytes (read its input, write e4m3 and the scales)."""
    from kernels import triton_layers, triton_quant
    from kernels.bench.roofline import median_ms

    gen = torch.Generator().manual_seed(0)
    dev = torch.device("cuda")
    x = torch.randn(m, hidden, generator=gen).to(device=dev, dtype=torch.bfloat16)
    res = torch.randn(m, hidden, generator=gen).to(device=dev, dtype=torch.bfloat16)
    w = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(device=dev, dtype=torch.bfloat16)
    gu = torch.randn(m, 2 * inter, generator=gen).to(device=dev, dtype=torch.bfloat16)

    def norm_then_quant() -> object:
        return triton_quant.per_token_quant_fp8(triton_layers.rms_norm(x, w, 1e-5, res)[0])

    def silu_then_quant() -> object:
        return triton_quant.per_token_quant_fp8(triton_layers.silu_and_mul(gu))

    r: dict[str, Any] = {"shape": "fused inputs", "m": m, "hidden": hidden, "inter": inter,
                         "copy_gbs": copy}  # fmt: skip
    timed: dict[str, Callable[[], object]] = {
        "norm_then_quant": norm_then_quant,
        "rms_norm_fp8": functools.partial(triton_layers.rms_norm_fp8, x, w, 1e-5, res),
        "silu_then_quant": silu_then_quant,
        "silu_and_mul_fp8": functools.partial(triton_layers.silu_and_mul_fp8, gu),
    }
    for key, fn in timed.items():
        r[f"{key}_ms"] = median_ms(fn)
    moved = {  # bytes the fused kernel must move: its inputs read, e4m3 and scales written
        "rms_norm_fp8": m * hidden * (2 + 2 + 2 + 1) + 4 * m,  # x, residual in; residual, q out
        "silu_and_mul_fp8": m * inter * (4 + 1) + 4 * m,
    }
    for key, nbytes in moved.items():
        r[f"{key}_pct_of_copy"] = 100 * nbytes / r[f"{key}_ms"] / 1e6 / copy
    return r


W4_GEMM_TILES = {"gemm": (32, 64, 64, 4), "gemm 128x128": (128, 128, 64, 8)}


def bench_w4_rows(
    name: str, n: int, k: int, m: int, copy: float, device: str = "cuda"
) -> dict[str, Any]:
    """int4 at a larger batch: the Triton GEMM against dequantize-then-matmul and bf16."""
    from kernels import triton_quant
    from kernels.bench import roofline

    median_ms = roofline.median_ms
    c = build(m, n, k, torch.device(device))
    ref = runners(c)["int4"][1]().float()
    timed: dict[str, Callable[[], object]] = {"bf16": functools.partial(F.linear, c.x, c.w)}
    for label, tiles in W4_GEMM_TILES.items():
        timed[label] = functools.partial(
            triton_quant.w4a16_linear, c.x, c.qweight, c.scales, c.zeros, GROUP, config=tiles
        )
    timed["dequant+matmul"] = functools.partial(
        triton_quant._dequant_matmul, c.x, c.qweight, c.scales, c.zeros, GROUP,
        torch.empty(m, n, dtype=c.x.dtype, device=c.x.device),
    )  # fmt: skip
    timed["dequant"] = functools.partial(
        triton_quant.w4_dequantize, c.qweight, c.scales, c.zeros, GROUP, c.x.dtype
    )
    r: dict[str, Any] = {"shape": name, "m": m, "n": n, "k": k, "copy_gbs": copy}
    for label, fn in timed.items():
        if label not in ("bf16", "dequant"):
            out = fn().float()  # type: ignore[attr-defined]
            err = ((out - ref).norm() / ref.norm().clamp(min=1e-30)).item()
            if not err < 1e-2:
                raise SystemExit(f"int4 {label} at M={m}: relative error {err:.2e}")
        r[f"{label}_ms"] = median_ms(fn)
    moved = sum(t.numel() * t.element_size() for t in (c.qweight, c.scales, c.zeros)) + k * n * 2
    r["dequant_pct_of_copy"] = 100 * moved / r["dequant_ms"] / 1e6 / copy
    return r


def main(argv: list[str] | None = None) -> int:
    from kernels.bench.roofline import copy_bandwidth, write_results

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, nargs="*", default=[1, 4, 16], help="batch sizes (M)")
    p.add_argument(
        "--w8a8-rows", type=int, nargs="*", default=[], help="large batches (M) for W8A8"
    )
    p.add_argument("--w4-rows", type=int, nargs="*", default=[], help="larger batches (M) for int4")
    p.add_argument("--fused-rows", type=int, nargs="*", default=[],
                   help="batches (M) for the norm and SiLU kernels that quantize for W8A8")  # fmt: skip
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("kernels.bench.quant needs a CUDA GPU")
    copy = copy_bandwidth()
    print(f"copy bandwidth {copy:.0f} GB/s", flush=True)
    rows = []
    for m in args.rows:
        for name, (n, k) in SHAPES.items():
            r = bench_shape(name, n, k, m, copy)
            rows.append(r)
            print(
                f"M={m:<3d} {name:22s} bf16 {r['bf16_ms'] * 1e3:7.1f} us | int4 "
                f"{r['int4_ms'] * 1e3:7.1f} us {r['int4_gbs']:5.0f} GB/s "
                f"({r['int4_pct_of_copy']:3.0f}%) | fp8 {r['fp8_ms'] * 1e3:7.1f} us "
                f"{r['fp8_gbs']:5.0f} GB/s ({r['fp8_pct_of_copy']:3.0f}%) | fp8 per channel "
                f"{r['fp8-row_ms'] * 1e3:7.1f} us {r['fp8-row_gbs']:5.0f} GB/s "
                f"({r['fp8-row_pct_of_copy']:3.0f}%) {r['fp8-row_config']}",
                flush=True,
            )
    for m in args.w8a8_rows:
        for name, (n, k) in SHAPES.items():
            r = bench_w8a8(name, n, k, m, copy)
            rows.append(r)
            print(
                f"W8A8 M={m:<5d} {name:22s} bf16 {r['bf16_linear_ms'] * 1e3:7.1f} us "
                f"({r['bf16_linear_tflops']:4.0f} TFLOP/s) | quant torch "
                f"{r['quant_torch_ms'] * 1e3:6.1f} us, triton {r['quant_triton_ms'] * 1e3:6.1f} us "
                f"({r['quant_triton_pct_of_copy']:3.0f}% of copy) | scaled_mm "
                f"{r['scaled_mm_ms'] * 1e3:7.1f} us, fast accum "
                f"{r['scaled_mm_fast_accum_ms'] * 1e3:7.1f} us, per tensor "
                f"{r['scaled_mm_tensorwise_ms'] * 1e3:7.1f} / "
                f"{r['scaled_mm_tensorwise_fast_accum_ms'] * 1e3:7.1f} us | layer "
                f"{r['w8a8_linear_ms'] * 1e3:7.1f} us ({r['w8a8_speedup_vs_bf16']:.2f}x bf16)",
                flush=True,
            )
    for m in args.w4_rows:
        for name, (n, k) in SHAPES.items():
            r = bench_w4_rows(name, n, k, m, copy)
            rows.append(r)
            times = " | ".join(
                f"{label} {r[f'{label}_ms'] * 1e3:7.1f} us"
                for label in ("bf16", *W4_GEMM_TILES, "dequant+matmul")
            )
            print(f"int4 M={m:<5d} {name:22s} {times} | dequant alone "
                  f"{r['dequant_ms'] * 1e3:6.1f} us ({r['dequant_pct_of_copy']:3.0f}% of copy)",
                  flush=True)  # fmt: skip
    for m in args.fused_rows:
        r = bench_fused_inputs(m, 4096, 14336, copy)
        rows.append(r)
        print(f"fused M={m:<5d} norm then quant {r['norm_then_quant_ms'] * 1e3:6.1f} us, "
              f"rms_norm_fp8 {r['rms_norm_fp8_ms'] * 1e3:6.1f} us "
              f"({r['rms_norm_fp8_pct_of_copy']:3.0f}% of copy) | silu then quant "
              f"{r['silu_then_quant_ms'] * 1e3:6.1f} us, silu_and_mul_fp8 "
              f"{r['silu_and_mul_fp8_ms'] * 1e3:6.1f} us "
              f"({r['silu_and_mul_fp8_pct_of_copy']:3.0f}% of copy)", flush=True)  # fmt: skip
    if args.json_out:
        write_results(args.json_out, copy, rows, group=GROUP)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
