"""Batched LoRA (Triton shrink + expand) against the roofline and a per-segment torch loop.

    python -m kernels.bench.lora [--tokens 1 16 256 4096] [--json-out lora.json]

Shape: Llama-3.1-8B's fused qkv projection (K 4096, N 6144) with rank-16 adapters on q, k and v
(R 48), bf16, the tokens split evenly over 4 adapters of 8 slots, each adapter's rows
interleaved with the others' (gathered by ``seg_rows``). Napkin math: the shrink reads
x (T x K) and each touched adapter's A (R x K); the expand reads B (N x R) per touched adapter
and reads and writes y (T x N). At decode sizes that is bytes-bound: 4 adapters' A and B are
4 x (48 x 4096 + 6144 x 48) x 2 B = 4 MB, ~1.3 us at ~3 TB/s, plus y. FLOPs are
2 T R (K + N) (0.5 GFLOP at 4096 tokens): the layer never approaches the tensor-core roof, so
each row reports GB/s against the copy bandwidth. Times are ``do_bench`` medians of eager calls
(Python launches included: at decode sizes the host, not the GPU, sets them) and of CUDA-graph
replays (the kernels' own time; GB/s are computed from it), and the host's microseconds per call.

The fused path (``LoRALinear`` over a plain base): the base GEMM over the weight extended by
every slot's A (N + S R rows), then ``expand_lora``. Each row also times, in CUDA graphs, the
whole projection both ways against the base GEMM alone (``gemm_us``): ``proj_us`` (GEMM, then
``add_lora``'s shrink and expand) and ``fused_proj_us`` (extended GEMM, then the expand); their
excess over ``gemm_us`` is what LoRA costs the projection. The expand alone (``expand_us``)
reads y's N columns and each row's R columns of x A^T, reads each touched adapter's B once and
writes the output: ``expand_gb_per_s`` against the copy bandwidth.
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

K, N, RANK, SHARDS, SLOTS, ADAPTERS = 4096, 6144, 16, 3, 4, 4  # slots: lora_cost's --max-loras
T = torch.Tensor


@dataclass
class Case:
    y: torch.Tensor  # [T, N]
    x: torch.Tensor  # [T, K]
    a: torch.Tensor  # [S, R, K]
    b: torch.Tensor  # [S, N, R]
    rows: torch.Tensor  # [T]
    starts: torch.Tensor  # [G]
    lens: torch.Tensor  # [G]
    slots: torch.Tensor  # [G]
    longest: int
    row_slots: torch.Tensor  # [T], each row's slot (the fused path's index)

    def args(self) -> tuple[T, T, T, T, T, T, T, T, int]:
        return (self.y, self.x, self.a, self.b, self.rows, self.starts, self.lens, self.slots,
                self.longest)  # fmt: skip

    def bytes(self) -> int:
        """x read, y read and written, and each touched adapter's A and B read once."""
        touched = len(set(self.slots.tolist()))
        size = self.x.element_size()
        adapters = touched * (self.a[0].numel() + self.b[0].numel()) * size
        return adapters + (self.x.numel() + 2 * self.y.numel()) * size

    def expand_bytes(self) -> int:
        """The fused expand: y's N columns and each row's R columns of x A^T read, the output
        written, each touched adapter's B read once."""
        touched = len(set(self.slots.tolist()))
        t, n, r = self.y.shape[0], self.b.shape[1], self.b.shape[2]
        return (touched * self.b[0].numel() + t * (2 * n + r)) * self.y.element_size()

    def flops(self) -> float:
        t, k = self.x.shape
        r, n = self.a.shape[1], self.b.shape[1]
        return 2.0 * t * r * (k + n)


def build(tokens: int, k: int, n: int, rank: int, slots: int, adapters: int,
          device: torch.device, dtype: torch.dtype = torch.bfloat16) -> Case:  # fmt: skip
    """``tokens`` split into ``adapters`` segments (slot i for segment i), every slot filled; the
    adapters' rows interleaved (round robin, as a batch of requests spread over them lies)."""
    gen = torch.Generator().manual_seed(0)

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(shape, generator=gen) * scale).to(device=device, dtype=dtype)

    groups = min(adapters, tokens)
    lens = [tokens // groups + (i < tokens % groups) for i in range(groups)]
    starts = [sum(lens[:i]) for i in range(groups)]
    rows = [t for g in range(groups) for t in range(g, tokens, groups)]
    idx = functools.partial(torch.tensor, dtype=torch.int32, device=device)
    return Case(rand(tokens, n), rand(tokens, k), rand(slots, rank, k, scale=k**-0.5),
                rand(slots, n, rank, scale=rank**-0.5), idx(rows), idx(starts), idx(lens),
                idx(list(range(groups))), max(lens), idx([t % groups for t in range(tokens)]))  # fmt: skip


def check(case: Case) -> float:
    """Relative error of the kernel's update against the reference's; SystemExit past 1e-2."""
    from kernels.lora import ref_add_lora
    from kernels.triton_lora import add_lora

    y = case.y
    base = y.float()
    out = add_lora(y.clone(), *case.args()[1:]).float() - base
    ref = ref_add_lora(y.clone(), *case.args()[1:]).float() - base
    err = ((out - ref).norm() / ref.norm().clamp_min(1e-12)).item()
    if not err < 1e-2:
        raise SystemExit(f"batched LoRA: relative error {err:.2e} against the reference")
    return err


def projections(case: Case, base: torch.Tensor) -> dict[str, Callable[[], object]]:
    """The projection ``base`` [N, K] three ways: the GEMM alone, with ``add_lora``, fused."""
    from kernels import ops

    s, r, k = case.a.shape
    ext = torch.cat([base, case.a.reshape(s * r, k)])  # [N + S R, K]
    x, lora = case.x, case.args()[2:]
    return {
        "gemm": lambda: ops.linear(x, base),
        "proj": lambda: ops.add_lora(ops.linear(x, base), x, *lora),
        "fused_proj": lambda: ops.expand_lora(ops.linear(x, ext), case.b, case.row_slots),
    }


def check_fused(case: Case) -> float:
    """Relative error of the fused path's update against the reference's (its x A^T rounded
    to the activation dtype by the GEMM); SystemExit past 1e-2."""
    from kernels import ops
    from kernels.lora import ref_add_lora

    s, r, k = case.a.shape
    zero = torch.zeros(case.b.shape[1], k, dtype=case.x.dtype, device=case.x.device)  # y = 0
    y_ext = ops.linear(case.x, torch.cat([zero, case.a.reshape(s * r, k)]))
    out = ops.expand_lora(y_ext, case.b, case.row_slots).float()
    ref = ref_add_lora(torch.zeros_like(case.y), *case.args()[1:]).float()
    err = ((out - ref).norm() / ref.norm().clamp_min(1e-12)).item()
    if not err < 1e-2:
        raise SystemExit(f"fused LoRA expand: relative error {err:.2e} against the reference")
    return err


def main(argv: list[str] | None = None) -> int:
    from kernels.bench.roofline import copy_bandwidth, graph_ms, host_us, median_ms, write_results

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 256, 4096])
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_lora needs a CUDA GPU")
    from kernels.lora import ref_add_lora
    from kernels.triton_lora import add_lora, expand_lora

    copy = copy_bandwidth()
    print(f"copy bandwidth {copy:.0f} GB/s", flush=True)
    rows = []
    device = torch.device("cuda")
    base = (torch.randn(N, K, device=device) * K**-0.5).to(torch.bfloat16)
    for tokens in args.tokens:
        case = build(tokens, K, N, RANK * SHARDS, SLOTS, ADAPTERS, device)
        check(case)
        check_fused(case)
        fn = functools.partial(add_lora, *case.args())
        ms, gms, cpu = median_ms(fn), graph_ms(fn), host_us(fn)
        torch_ms = median_ms(lambda c=case: ref_add_lora(*c.args()))  # type: ignore[misc]
        gbs, floor_us = case.bytes() / gms / 1e6, case.bytes() / copy / 1e3
        s, r = case.a.shape[:2]
        y_ext = torch.randn(tokens, N + s * r, device=device).to(torch.bfloat16)
        ems = graph_ms(lambda c=case, y=y_ext: expand_lora(y, c.b, c.row_slots))  # type: ignore[misc]
        proj = {f"{name}_us": graph_ms(f) * 1e3 for name, f in projections(case, base).items()}
        rows.append({"tokens": tokens, "triton_ms": ms, "graph_ms": gms, "host_us": cpu,
                     "torch_ms": torch_ms, "gb_per_s": gbs, "tflops": case.flops() / gms / 1e9,
                     "floor_us": floor_us, "expand_us": ems * 1e3,
                     "expand_gb_per_s": case.expand_bytes() / ems / 1e6,
                     "expand_floor_us": case.expand_bytes() / copy / 1e3, **proj})  # fmt: skip
        print(f"T={tokens:5d} Triton {gms * 1e3:8.1f} us in a graph, {gbs:6.0f} GB/s (floor "
              f"{floor_us:6.1f} us); eager {ms * 1e3:8.1f} us, host {cpu:6.1f} us | torch loop "
              f"{torch_ms * 1e3:8.1f} us | fused expand {ems * 1e3:7.1f} us, "
              f"{rows[-1]['expand_gb_per_s']:6.0f} GB/s | projection: GEMM "
              f"{proj['gemm_us']:7.1f} us, + add_lora {proj['proj_us']:7.1f} us, fused "
              f"{proj['fused_proj_us']:7.1f} us", flush=True)  # fmt: skip
    if args.json_out:
        write_results(args.json_out, copy, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
