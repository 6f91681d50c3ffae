"""The KV-transfer checksum against the roofline: the Triton kernel and the torch reference.

    python -m kernels.bench.checksum [--json-out checksum.json]

A checksum reads each byte once and writes 8 bytes per program, so its floor is N bytes / HBM
bandwidth; the device copy bandwidth (a 1 GiB copy, read + write counted) stands in for the
bandwidth. Napkin math for a Llama-3.1-8B KV of 1024 tokens (32 layers x 2 x 8 heads x 128 x bf16
= 128 KiB a token, 134 MB) on an H100 (~3 TB/s copy): ~45 us. The reference widens each 4-byte
word to int64 and multiplies and sums in separate passes (~8x the bytes; 0.76 ms measured).
Seen on one H100 (2026-11-24, a copy of the kernel under ``do_bench``): 60-62 us at 1024 tokens,
of which ~5 us is the second-stage sum's launch; a bare read of the same bytes took 56.5 us, so
the kernel itself runs at the read rate ``do_bench`` sees (~2.4 TB/s); 193 us at 4096 tokens
(2.8 TB/s); unaligned slices 80-140 us (byte loads); the reference 0.65-0.74 ms. Sizes:
one layer of that KV (a transfer chunk, 4 MiB), 1024 and 4096 tokens, and the 1024-token KV at
an odd byte offset (read byte by byte). Every launch of a small sweep is checked bit-exact
against the reference first. Times are ``do_bench`` medians with L2 flushed between runs.
"""

from __future__ import annotations

import argparse
import functools
from typing import Any

import torch

TOKEN_BYTES = 32 * 2 * 8 * 128 * 2  # Llama-3.1-8B KV bytes per token
SIZES = {  # name -> (bytes, byte offset of the slice)
    "1 layer, 1024 tokens": (TOKEN_BYTES * 1024 // 32, 0),
    "1024 tokens": (TOKEN_BYTES * 1024, 0),
    "4096 tokens": (TOKEN_BYTES * 4096, 0),
    "1024 tokens, offset 1": (TOKEN_BYTES * 1024, 1),
}
CONFIGS = [(1024, 4), (2048, 4), (4096, 4), (4096, 8), (8192, 8), (16384, 16)]  # (BLOCK, warps)


def roofline_ms(nbytes: int, copy_gbps: float) -> float:
    """The floor: every byte read once at the copy bandwidth."""
    return nbytes / copy_gbps / 1e6


def data(nbytes: int, offset: int, device: torch.device) -> torch.Tensor:  # [nbytes] uint8
    gen = torch.Generator(device=device).manual_seed(0)
    raw = torch.randint(0, 256, (nbytes + offset,), dtype=torch.uint8, device=device, generator=gen)  # fmt: skip
    return raw[offset:]


def check(x: torch.Tensor, config: tuple[int, int] | None) -> None:
    """Raises SystemExit unless the launch gives the reference's bits."""
    from kernels.checksum import ref_checksum
    from kernels.triton_checksum import checksum

    got, want = int(checksum(x, config=config)), int(ref_checksum(x))
    if got != want:
        raise SystemExit(f"checksum config {config}: {got} != reference {want}")


def bench_size(name: str, nbytes: int, offset: int, copy_gbps: float) -> dict[str, Any]:
    from kernels.bench.roofline import median_ms
    from kernels.checksum import ref_checksum
    from kernels.triton_checksum import checksum

    x = data(nbytes, offset, torch.device("cuda"))
    ref_ms = median_ms(functools.partial(ref_checksum, x))
    best: tuple[tuple[int, int], float] | None = None
    for cfg in CONFIGS:
        check(x, cfg)
        ms = median_ms(functools.partial(checksum, x, config=cfg))
        if best is None or ms < best[1]:
            best = (cfg, ms)
    assert best is not None
    floor = roofline_ms(nbytes, copy_gbps)
    return {"size": name, "bytes": nbytes, "offset": offset, "roofline_ms": floor,
            "ref_ms": ref_ms, "ref_gbs": nbytes / ref_ms / 1e6,
            "triton_ms": best[1], "triton_gbs": nbytes / best[1] / 1e6,
            "pct_of_roofline": 100 * floor / best[1], "best_config": best[0]}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    from kernels.bench.roofline import copy_bandwidth, write_results

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("kernels.bench.checksum needs a CUDA GPU")
    copy = copy_bandwidth()
    print(f"copy bandwidth {copy:.0f} GB/s", flush=True)
    rows = []
    for name, (nbytes, offset) in SIZES.items():
        r = bench_size(name, nbytes, offset, copy)
        rows.append(r)
        print(
            f"{name:24s} {nbytes / 1e6:7.1f} MB | floor {r['roofline_ms'] * 1e3:7.1f} us | "
            f"torch {r['ref_ms'] * 1e3:7.1f} us {r['ref_gbs']:5.0f} GB/s | Triton "
            f"{r['triton_ms'] * 1e3:7.1f} us {r['triton_gbs']:5.0f} GB/s "
            f"({r['pct_of_roofline']:3.0f}% of floor) {r['best_config']}",
            flush=True,
        )
    if args.json_out:
        write_results(args.json_out, copy, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
