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
"""

from __future__ import annotations

import argparse
import functools
from dataclasses import dataclass

import torch

K, N, RANK, SHARDS, SLOTS, ADAPTERS = 4096, 6144, 16, 3, 8, 4
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

    def args(self) -> tuple[T, T, T, T, T, T, T, T, int]:
        return (self.y, self.x, self.a, self.b, self.rows, self.starts, self.lens, self.slots,
                self.longest)  # fmt: skip

    def bytes(self) -> int:
        """x read, y read and written, and each touched adapter's A and B read once."""
        touched = len(set(self.slots.tolist()))
        size = self.x.element_size()
        adapters = touched * (self.a[0].numel() + self.b[0].numel()) * size
        return adapters + (self.x.numel() + 2 * self.y.numel()) * size

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
                idx(list(range(groups))), max(lens))  # fmt: skip


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


def main(argv: list[str] | None = None) -> int:
    from kernels.bench.roofline import copy_bandwidth, graph_ms, host_us, median_ms, write_results

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 256, 4096])
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_lora needs a CUDA GPU")
    from kernels.lora import ref_add_lora
    from kernels.triton_lora import add_lora

    copy = copy_bandwidth()
    print(f"copy bandwidth {copy:.0f} GB/s", flush=True)
    rows = []
    for tokens in args.tokens:
        case = build(tokens, K, N, RANK * SHARDS, SLOTS, ADAPTERS, torch.device("cuda"))
        check(case)
        fn = functools.partial(add_lora, *case.args())
        ms, gms, cpu = median_ms(fn), graph_ms(fn), host_us(fn)
        torch_ms = median_ms(lambda c=case: ref_add_lora(*c.args()))  # type: ignore[misc]
        gbs, floor_us = case.bytes() / gms / 1e6, case.bytes() / copy / 1e3
        rows.append({"tokens": tokens, "triton_ms": ms, "graph_ms": gms, "host_us": cpu,
                     "torch_ms": torch_ms, "gb_per_s": gbs, "tflops": case.flops() / gms / 1e9,
                     "floor_us": floor_us})  # fmt: skip
        print(f"T={tokens:5d} Triton {gms * 1e3:8.1f} us in a graph, {gbs:6.0f} GB/s (floor "
              f"{floor_us:6.1f} us); eager {ms * 1e3:8.1f} us, host {cpu:6.1f} us | torch loop "
              f"{torch_ms * 1e3:8.1f} us", flush=True)  # fmt: skip
    if args.json_out:
        write_results(args.json_out, copy, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
