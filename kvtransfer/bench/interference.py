"""What a KV transfer arriving over NCCL costs the decode steps of the GPU it lands on (2 GPUs).

    python -m kvtransfer.bench.interference --json-out interference.json
    python -m kvtransfer.bench.interference --max-ctas 0 1 2 4 --batch 32 --layers 32

A streamed transfer posts its receives when the header comes, at the start of the prefill that
computes the KV, and the sender sends each chunk once its layers are written: every receive
kernel NCCL launched waits on the decode GPU, on the SMs it holds, for most of a prefill. Two
processes (rank 0 on GPU 0 sends, rank 1 on GPU 1 receives) measure, on rank 1, the replay time
of a CUDA graph shaped like an 8B model's decode step (its GEMMs at ``--batch`` rows):

- ``alone``: nothing else on the GPU;
- ``pending``: one receive posted, its data sent only after the steps (the worst case: the
  kernel waits through all of them);
- ``streamed``: ``--chunks`` chunks posted at once, the sender sending one every ``--gap-ms``
  (a prefill computing the layers), the steps running meanwhile;

each over an NCCL group whose communicator is built with ``max_ctas`` = each of ``--max-ctas``
(0: NCCL's default), and the time one ``--whole-mib`` transfer takes end to end with each.
Prints a table; ``--json-out`` writes every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _nccl(store: Any, rank: int, max_ctas: int) -> Any:
    opts = dist.ProcessGroupNCCL.Options()  # type: ignore[attr-defined]
    opts._timeout = timedelta(seconds=120)
    if max_ctas:
        opts.config.max_ctas = max_ctas
    return dist.ProcessGroupNCCL(dist.PrefixStore(f"ctas{max_ctas}", store), rank, 2, opts)  # type: ignore[attr-defined]


def _decode_graph(batch: int, layers: int, hidden: int, inter: int, qkv: int) -> Any:
    """A CUDA graph of one decode step's GEMMs (bf16) and its static input."""
    dev = torch.device("cuda")
    ws = [
        (
            torch.randn(hidden, qkv, device=dev, dtype=torch.bfloat16) * 0.01,
            torch.randn(hidden, hidden, device=dev, dtype=torch.bfloat16) * 0.01,
            torch.randn(hidden, 2 * inter, device=dev, dtype=torch.bfloat16) * 0.01,
            torch.randn(inter, hidden, device=dev, dtype=torch.bfloat16) * 0.01,
        )
        for _ in range(layers)
    ]
    x = torch.randn(batch, hidden, device=dev, dtype=torch.bfloat16)

    def step() -> torch.Tensor:
        h = x
        for wqkv, wo, w13, w2 in ws:
            a = h @ wqkv
            h = h + a[:, :hidden] @ wo
            g = h @ w13
            h = h + (torch.nn.functional.silu(g[:, :inter]) * g[:, inter:]) @ w2
        return h

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph, ws


def _time_steps(graph: Any, n: int) -> list[float]:
    """Milliseconds of each of ``n`` replays, back to back."""
    events = [torch.cuda.Event(enable_timing=True) for _ in range(n + 1)]
    events[0].record()
    for i in range(n):
        graph.replay()
        events[i + 1].record()
    events[-1].synchronize()  # not the device: a receive still pending on NCCL's stream
    return [events[i].elapsed_time(events[i + 1]) for i in range(n)]


def _summary(ms: list[float]) -> dict[str, float]:
    qs = statistics.quantiles(ms, n=10)
    return {"p50_ms": statistics.median(ms), "p90_ms": qs[-1], "mean_ms": statistics.fmean(ms)}


def _rank(rank: int, args: argparse.Namespace, port: int, out: dict[str, Any]) -> None:
    torch.cuda.set_device(rank)
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=120))
    gloo: Any = dist.ProcessGroupGloo(
        dist.PrefixStore("gloo", store), rank, 2, timedelta(seconds=120)
    )
    zero = torch.zeros(1)

    def barrier() -> None:
        gloo.allreduce([zero]).wait()

    chunk = args.chunk_mib << 20
    whole = args.whole_mib << 20
    bufs = [torch.zeros(chunk, dtype=torch.uint8, device="cuda") for _ in range(args.chunks)]
    big = torch.zeros(whole, dtype=torch.uint8, device="cuda")
    graph = None
    if rank == 1:
        graph, _ = _decode_graph(args.batch, args.layers, 4096, 14336, 6144)
        out["alone"] = _summary(_time_steps(graph, args.steps))
    rows = []
    for ctas in args.max_ctas:
        pg = _nccl(store, rank, ctas)
        # the communicator (built by the first operation) and a warm-up of each size
        for b in (bufs[0], big):
            (pg.send([b], 1, 0) if rank == 0 else pg.recv([b], 0, 0)).wait()
        torch.cuda.synchronize()
        row: dict[str, Any] = {"max_ctas": ctas}
        # pending: one receive waits through every step
        barrier()
        if rank == 1:
            work = pg.recv([bufs[0]], 0, 0)
            time.sleep(0.01)  # its kernel is running
            row["pending"] = _summary(_time_steps(graph, args.steps))
            barrier()
            work.wait()
        else:
            barrier()
            pg.send([bufs[0]], 1, 0).wait()
        torch.cuda.synchronize()
        # streamed: chunks every gap_ms while the steps run
        barrier()
        if rank == 1:
            works = [pg.recv([b], 0, 0) for b in bufs]
            t0 = time.perf_counter()
            ms = _time_steps(graph, args.steps)
            for w in works:
                w.wait()
            torch.cuda.synchronize()
            row["streamed"] = _summary(ms)
            row["streamed_steps_s"] = time.perf_counter() - t0
        else:
            for b in bufs:
                time.sleep(args.gap_ms / 1e3)
                pg.send([b], 1, 0).wait()
            torch.cuda.synchronize()
        # one whole transfer, end to end (both posted, timed on the receiver)
        times = []
        for _ in range(5):
            barrier()
            t0 = time.perf_counter()
            (pg.send([big], 1, 0) if rank == 0 else pg.recv([big], 0, 0)).wait()
            torch.cuda.synchronize()
            times.append((time.perf_counter() - t0) * 1e3)
        row["whole_ms"] = statistics.median(times)
        row["whole_gb_s"] = whole / row["whole_ms"] / 1e6
        rows.append(row)
        barrier()
        pg.abort()
    out["rows"] = rows


def _worker(rank: int, args: argparse.Namespace, port: int, path: str) -> None:
    out: dict[str, Any] = {}
    _rank(rank, args, port, out)
    if rank == 1:
        with open(path, "w") as fh:
            json.dump(out, fh)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-ctas", type=int, nargs="+", default=[0, 1, 2, 4, 8])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--chunks", type=int, default=16)
    ap.add_argument("--chunk-mib", type=int, default=8)
    ap.add_argument("--gap-ms", type=float, default=10.0)
    ap.add_argument("--whole-mib", type=int, default=128)
    ap.add_argument("--port", type=int, default=int(os.environ.get("INTERFERENCE_PORT", "29541")))
    ap.add_argument("--json-out", default="interference.json")
    args = ap.parse_args(argv)
    if torch.cuda.device_count() < 2:
        print("needs 2 GPUs")
        return 2
    mp.spawn(_worker, args=(args, args.port, args.json_out), nprocs=2)
    with open(args.json_out) as fh:
        doc = json.load(fh)
    doc["args"] = vars(args)
    with open(args.json_out, "w") as fh:
        json.dump(doc, fh, indent=2)
    a = doc["alone"]
    print(f"decode-step graph alone: p50 {a['p50_ms']:.3f} ms, p90 {a['p90_ms']:.3f} ms")
    print("| max_ctas | pending p50 / p90 (ms) | streamed p50 / p90 (ms) | whole ms (GB/s) |")
    for r in doc["rows"]:
        p, s = r["pending"], r["streamed"]
        print(f"| {r['max_ctas'] or 'default'} | {p['p50_ms']:.3f} / {p['p90_ms']:.3f} | "
              f"{s['p50_ms']:.3f} / {s['p90_ms']:.3f} | {r['whole_ms']:.2f} "
              f"({r['whole_gb_s']:.0f}) |")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
