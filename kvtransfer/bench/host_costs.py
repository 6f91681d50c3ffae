"""What one shared-GPU transfer's host steps cost alone, in one process (median microseconds):
uploading block ids, launching the block-to-block copy, recording an event. The per-step
figures that :mod:`kvtransfer.bench.timeline` shows inside a transfer, without the other
process or the control connection.

    python -m kvtransfer.bench.host_costs --blocks 64 256
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from functools import partial

import torch

from kvtransfer.blockcopy import make_copier
from kvtransfer.staging import DeviceIds


def median_us(fn: Callable[[], object], iters: int) -> float:
    out = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return statistics.median(out) * 1e6


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--blocks", type=int, nargs="+", default=[64, 256])
    p.add_argument("--iters", type=int, default=200)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("needs a GPU")
    dev = torch.device("cuda", 0)
    pool = max(args.blocks)
    shape = (2, pool, 16, 8, 128)
    src = make_copier([torch.zeros(shape, dtype=torch.bfloat16, device=dev) for _ in range(32)])
    dst = make_copier([torch.zeros(shape, dtype=torch.bfloat16, device=dev) for _ in range(32)])
    stream = torch.cuda.Stream(dev)
    uploads = DeviceIds(dev)
    event = torch.cuda.Event()
    with torch.cuda.stream(stream):
        for n in args.blocks:
            ids = list(range(n))
            up = median_us(partial(uploads.upload, ids), args.iters)
            x = uploads.upload(ids)
            torch.cuda.synchronize()
            launch = median_us(partial(dst.copy_from, src, x, x), args.iters // 4)
            torch.cuda.synchronize()
            rec = median_us(lambda: event.record(stream), args.iters)
            tensor = median_us(partial(torch.tensor, ids), args.iters)
            print(f"{n} blocks: upload {up:.1f} us, copy launch {launch:.1f} us, event record "
                  f"{rec:.1f} us, torch.tensor(ids) {tensor:.1f} us")  # fmt: skip


if __name__ == "__main__":
    main()
