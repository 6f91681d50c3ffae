"""What a KV transfer thread's polling costs the engine thread of the same process (CPU).

    python -m kvtransfer.bench.poll_cost            # the pauses the pair threads use
    python -m kvtransfer.bench.poll_cost --steps 500 --pauses 10e-6 1e-3 --json-out poll.json

A worker's engine thread and its KV threads share one GIL. A thread that sleeps between polls
(``PairChannel.wait`` on an NCCL work, with ``precise_sleeps``: 1 us of timer slack) takes the
GIL back at every wake; a streamed transfer's receiver waited that way for each chunk through the
whole prefill that computes them. Here an engine-like loop (small torch ops and Python work, as
a decode step's host side is) is timed alone and then beside one thread polling a cheap check
with each pause; the ratio is what the polling costs it. Host-bound and noisy: compare rows of
one run.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from typing import Any

import torch

from kvtransfer.pair import precise_sleeps


def engine_step_us(steps: int, ops: int = 20) -> float:
    """Microseconds per step of a loop of ``ops`` small torch ops and some Python work."""
    x = torch.ones(64, 64)
    t0 = time.perf_counter()
    for _ in range(steps):
        y = x
        for _ in range(ops):
            y = y + 1.0
        _ = {i: i for i in range(50)}
    return (time.perf_counter() - t0) / steps * 1e6


def _poll(stop: threading.Event, pause: float, precise: bool) -> None:
    if precise:
        precise_sleeps()
    while not stop.is_set():
        time.sleep(pause)


def measure(steps: int, pauses: list[float], precise: bool = True) -> dict[str, Any]:
    alone = engine_step_us(steps)
    rows = []
    for pause in pauses:
        stop = threading.Event()
        poller = threading.Thread(target=_poll, args=(stop, pause, precise), daemon=True)
        poller.start()
        try:
            beside = engine_step_us(steps)
        finally:
            stop.set()
            poller.join()
        rows.append({"pause_us": pause * 1e6, "step_us": beside, "slowdown": beside / alone})
    return {"steps": steps, "precise_sleeps": precise, "alone_step_us": alone, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--pauses", type=float, nargs="+", default=[10e-6, 0.1e-3, 1e-3])
    ap.add_argument("--json-out")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    doc = measure(args.steps, args.pauses)
    print(f"engine-like step alone: {doc['alone_step_us']:.1f} us")
    for r in doc["rows"]:
        print(f"  beside a poller sleeping {r['pause_us']:7.1f} us: {r['step_us']:7.1f} us "
              f"({r['slowdown']:.2f}x)")  # fmt: skip
    if args.json_out:
        with open(args.json_out, "w") as fh:
            json.dump(doc, fh, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
