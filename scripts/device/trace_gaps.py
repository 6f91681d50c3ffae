"""Where a GPU sits idle in a torch profiler Chrome trace (``profile_step --trace-out``): the
GPU's busy time (the union of its kernels, copies and memsets) against the traced span, then
the longest idle gaps with what the host was doing over each (the CPU ops and CUDA runtime
calls that overlap it, longest first) and the gaps' total by the host op that spans most of
them.

    python scripts/device/trace_gaps.py TRACE.json [--top 15] [--min-us 5]
"""

from __future__ import annotations

import argparse
import gzip
import json
from collections import defaultdict

GPU_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}
HOST_CATS = {"cpu_op", "cuda_runtime", "cuda_driver", "python_function", "user_annotation"}


def load(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as fh:
        return [e for e in json.load(fh)["traceEvents"] if e.get("ph") == "X" and "dur" in e]


def busy_intervals(events: list[dict]) -> list[tuple[float, float]]:
    spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") in GPU_CATS)
    merged: list[tuple[float, float]] = []
    for s, t in spans:
        if merged and s <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], t))
        else:
            merged.append((s, t))
    return merged


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("trace")
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--min-us", type=float, default=5.0)
    args = p.parse_args()
    events = load(args.trace)
    busy = busy_intervals(events)
    if not busy:
        raise SystemExit("no GPU events in the trace")
    span = busy[-1][1] - busy[0][0]
    used = sum(t - s for s, t in busy)
    gaps = [(busy[i][1], busy[i + 1][0]) for i in range(len(busy) - 1)]
    gaps = [(s, t) for s, t in gaps if t - s >= args.min_us]
    host = [e for e in events if e.get("cat") in HOST_CATS]
    print(
        f"GPU busy {used / 1e3:.3f} ms of {span / 1e3:.3f} ms from its first to last kernel; "
        f"{len(gaps)} gaps >= {args.min_us} us, {sum(t - s for s, t in gaps) / 1e3:.3f} ms"
    )
    # the host ops overlapping each gap, found once for both reports
    over = {g: [e for e in host if e["ts"] < g[1] and e["ts"] + e["dur"] > g[0]] for g in gaps}
    by_op: dict[str, float] = defaultdict(float)
    for (s, t), ops in over.items():
        # the innermost op covering most of the gap names it
        covering = [e for e in ops if e["ts"] <= s + 0.5 * (t - s) <= e["ts"] + e["dur"]]
        name = min(covering, key=lambda e: e["dur"])["name"] if covering else "(no host op)"
        by_op[name[:80]] += t - s
    for s, t in sorted(gaps, key=lambda g: g[0] - g[1])[: args.top]:
        inner = sorted(over[(s, t)], key=lambda e: e["dur"])[:4]
        names = "; ".join(f"{e['name'][:50]} {e['dur']:.0f}us" for e in inner)
        print(f"gap {t - s:9.1f} us at +{(s - busy[0][0]) / 1e3:8.3f} ms: {names}")
    print("gaps by the innermost host op spanning their middle (ms):")
    for name, us in sorted(by_op.items(), key=lambda kv: -kv[1])[: args.top]:
        print(f"  {us / 1e3:8.3f}  {name}")


if __name__ == "__main__":
    main()
