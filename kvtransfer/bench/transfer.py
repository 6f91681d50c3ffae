"""KV transfer benchmark: GPU0 -> GPU1 over NCCL, two processes on one GPU (CUDA IPC), raw NCCL.

    python -m kvtransfer.bench.transfer --json-out kv.json            # needs 2 GPUs for the NCCL rows
    python -m kvtransfer.bench.transfer --cpu --tokens 16 --iters 2    # smoke run on CPU (Gloo)

Two processes (sender on GPU0, receiver on GPU1) hold Llama-3.1-8B-shaped caches (32 layers,
8 KV heads, head_dim 128, bf16, block size 16). "e2e" is one ``KvSender.send`` of a KV already
computed, from the call to its return: the hand-off to the pair's thread, gather the blocks,
header, send, receiver scatters + synchronizes, acknowledgement; one row per pipeline chunk
size ("pair" keeps the older measure, from the pair's thread taking the job to the ack, which
left out ~0.1 ms of submit and hand-off on an H200 host; rows before 2026-11-28 are that one).
Its "landed" column is the hand-off as the decode side sees it:
from ``send()`` called to the receiver resolving the transfer (every block written), without the
acknowledgement's way back to the sender. "ttft" simulates the prefill that writes the KV
(:mod:`kvtransfer.bench.sim_prefill`, Llama-3.1-8B layer compute over N tokens on GPU0) and times
(a) the prefill alone, (b) the prefill then the transfer, (c) the two overlapped layer by layer
(``send(..., ready=LayerReady)`` while the prefill runs on another thread); added TTFT = (b)-(a)
and (c)-(t), (t) being (c)'s prefill alone on a thread of its own (a fresh thread's prefill can
take much longer than the main thread's: (c)-(a) would count that as the transfer's). The last
(c) transfer is checked bit for bit against the sender's blocks, so a layer shipped before it
was written would show. Napkin math: a 1024-token KV is 32*2*1024*8*128*2 B = 134 MB; at NCCL's
~350 GB/s NVLink P2P that is 0.38 ms on the wire, and the gather and the scatter each move it
once more at HBM speed (~0.05 ms).

Before the changes of issue #7, on 2 x H200 (NV18, torch 2.11, NCCL 2.28), medians of 20:
  1024 tokens: raw send/recv 0.39 ms (347 GB/s); e2e 1.1-1.2 ms (110-121 GB/s)
  4096 tokens: raw send/recv 1.46 ms (367 GB/s); e2e 2.4-2.5 ms (214-222 GB/s)
  one GPU, two processes (Gloo, host staging): 34-41 ms / 130-150 ms (3.4-4.1 GB/s)
The time went to per-call CPU cost: cache checks and a blocking host-to-device copy in every
gather and scatter call (0.1-0.2 ms each), receives posted behind the engine's stream, ~60 us
poll granularity on the receiver, and one chunk (no pipelining) at 1024 tokens.

On one GPU the receiver shares its pool through CUDA IPC and the sender copies the blocks into
it GPU to GPU, one kernel per range of written layers ("move" row: that kernel alone, in one
process; the copy roofline reads and writes every byte once; "push": the fenced copy of blocks
granted ahead); the "ttft" rows run there too, so the tail left after the prefill's last layer
can be compared with a whole transfer. "e2e granted" is the hand-off when the receiver granted
its blocks with the reservation (``expect(..., grant=True)``, ``send(..., grant=...)``,
:mod:`kvtransfer.grants`): the sender copies at once, without the header and ``Go`` round trip.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import statistics
import time
import traceback
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.distributed as dist

from kvtransfer.bench import timeline
from kvtransfer.bench.sim_prefill import SimPrefill, slots_of
from kvtransfer.blockcopy import make_copier
from kvtransfer.config import ReceiverOptions, SenderOptions
from kvtransfer.grants import Grant
from kvtransfer.ready import LayerReady
from kvtransfer.receiver import KvReceiver
from kvtransfer.sender import KvSender
from kvtransfer.stores import serve_store

LAYERS, HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16
TIMELINE = os.environ.get("TANDEM_KV_TIMELINE") == "1"  # kvtransfer.bench.timeline
REPLY_S = 120.0  # the longest any one command to a child may take
IO_S = 30.0  # sender and receiver timeouts


def log(msg: str) -> None:
    print(f"[kvbench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def kv_bytes(tokens: int) -> int:
    return tokens * LAYERS * 2 * HEADS * HEAD_DIM * 2


def make_caches(device: torch.device, num_blocks: int) -> list[torch.Tensor]:
    shape = (2, num_blocks, BLOCK, HEADS, HEAD_DIM)
    return [torch.randn(shape, device=device).to(torch.bfloat16) for _ in range(LAYERS)]


def digest(caches: list[torch.Tensor], ids: list[int]) -> int:
    """Exact fingerprint of blocks ``ids`` (compares the two ends bit for bit), a layer at a
    time (a 32k-token KV is 4 GiB: its int64 words would not fit beside the caches)."""
    idx = torch.tensor(ids, device=caches[0].device)
    total = 0
    for layer, cache in enumerate(caches):
        words = cache.index_select(1, idx).reshape(-1).view(torch.int16).to(torch.int64)
        weights = torch.arange(words.numel(), device=words.device) % 977 + 1 + layer
        total += int((words * weights).sum())
    return total


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_copy(caches: list[torch.Tensor], ids: list[int], iters: int, gather: bool) -> float:
    """Median seconds of one gather (or scatter) of ``ids`` through the transfer's copier."""
    copier = make_copier(caches)
    idx = torch.tensor(ids, device=caches[0].device)
    buf = copier.gather(idx)
    times = []
    for _ in range(iters):
        _sync(caches[0].device)
        start = time.perf_counter()
        if gather:
            copier.gather(idx, out=buf)
        else:
            copier.scatter(buf, idx)
        _sync(caches[0].device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


MOVE_VARIANTS = ((4096, 4), (8192, 4), (8192, 8), (16384, 8), (16384, 16))  # (chunk, warps)


def timed_move(caches: list[torch.Tensor], ids: list[int], iters: int) -> dict[str, float]:
    """Median seconds of one block-to-block copy of ``ids`` into as many other blocks of the
    same pool (the kernel a sender runs into a shared pool on one GPU), per kernel variant
    (elements per program, warps); the first is the default."""
    copier = make_copier(caches)
    src = torch.tensor(ids, device=caches[0].device)
    dst = src + len(ids)
    out = {}
    for chunk, warps in MOVE_VARIANTS:
        times = []
        for _ in range(iters + 1):
            _sync(caches[0].device)
            start = time.perf_counter()
            copier.copy_from(copier, src, dst, chunk=chunk, num_warps=warps)  # type: ignore[call-arg]
            _sync(caches[0].device)
            times.append(time.perf_counter() - start)
        out[f"{chunk}x{warps}"] = statistics.median(times[1:])
    # the fenced copy a sender runs into blocks granted ahead (kvtransfer.grants), default tiles
    meta = torch.tensor([4, 0, len(ids), *ids, *(i + len(ids) for i in ids)], device=caches[0].device)  # fmt: skip
    fence = torch.zeros((1, 2), dtype=torch.int64, device=caches[0].device)
    for chunk, warps in MOVE_VARIANTS[:3]:
        times = []
        for _ in range(iters + 1):
            fence.copy_(torch.tensor([[4, 0]]))
            _sync(caches[0].device)
            start = time.perf_counter()
            copier.push_from(copier, meta, fence, chunk=chunk, num_warps=warps)  # type: ignore[attr-defined]
            _sync(caches[0].device)
            times.append(time.perf_counter() - start)
        if int(fence[0, 0]) != 6:
            raise RuntimeError(f"the fenced copy did not land: fence state {int(fence[0, 0])}")
        out[f"push {chunk}x{warps}"] = statistics.median(times[1:])
    return out


def raw_send_recv(rank: int, port: int, nbytes: int, iters: int, device: torch.device) -> float:
    """Seconds per back-to-back send/recv of ``nbytes`` over a bare pairwise group."""
    store = dist.TCPStore("127.0.0.1", port, None, False, timedelta(seconds=120))
    prefixed = dist.PrefixStore(f"raw/{nbytes}", store)
    if device.type == "cuda":
        pg: Any = dist.ProcessGroupNCCL(prefixed, rank, 2, dist.ProcessGroupNCCL.Options())
    else:
        pg = dist.ProcessGroupGloo(prefixed, rank, 2, timedelta(seconds=120))
    buf = torch.empty(nbytes, dtype=torch.uint8, device=device)

    def one() -> None:
        (pg.send if rank == 0 else pg.recv)([buf], 1 - rank, 0).wait()

    for _ in range(3):
        one()
    _sync(device)
    start = time.perf_counter()
    for _ in range(iters):
        one()
    _sync(device)
    elapsed = (time.perf_counter() - start) / iters
    if device.type == "cuda":
        pg.abort()
    return elapsed


class Child:
    """The state of a sender or receiver process; :meth:`handle` runs one command."""

    def __init__(self, role: str, device: torch.device, num_blocks: int) -> None:
        self.role, self.device = role, device
        self.caches = make_caches(device, num_blocks)
        options = ReceiverOptions(io_timeout_s=IO_S, connect_timeout_s=IO_S)
        self.rx = KvReceiver(self.caches, options) if role == "receiver" else None
        self.sender: tuple[SenderOptions, KvSender] | None = None  # one pair at a time
        self.handles: dict[str, Any] = {}
        self.model: SimPrefill | None = None
        self.copier = type(make_copier(self.caches)).__name__  # Triton's BlockCopier on CUDA

    def _sender(self, options: SenderOptions) -> KvSender:
        if self.sender is None or self.sender[0] != options:
            self.close_sender()
            name = f"bench-{options.chunk_bytes}-{options.streaming_chunk_bytes}"
            self.sender = (options, KvSender(self.caches, name, options))
        return self.sender[1]

    def close_sender(self) -> None:
        if self.sender is not None:
            self.sender[1].close()
            self.sender = None

    def handle(self, op: str, args: list[Any]) -> Any:
        if op == "expect" and self.rx is not None:  # each transfer's grant (or None), if asked
            tids, ids, grant = args
            self.handles.update({tid: self.rx.expect(tid, ids, REPLY_S, grant=grant) for tid in tids})  # fmt: skip
            grants = {tid: self.handles[tid].grant for tid in tids}
            return {tid: g.to_json() if g is not None else None for tid, g in grants.items()}
        if op == "wait":  # each transfer's error ('' if ok), the receiver's seconds, and
            # when it had the KV (time.monotonic(): the sender's clock too, on one host)
            results = [self.handles.pop(tid).wait(IO_S) for tid in args[0]]
            return [(r.error if not r.ok else "", r.seconds, r.finished) if r
                    else ("no result", 0.0, 0.0) for r in results]  # fmt: skip
        if op == "send":  # per transfer: its seconds to the ack, and when send() was called
            endpoint, tids, ids, chunk, grants = args
            chunk = chunk or SenderOptions().chunk_bytes  # 0: the default (a granted push: unused)
            sender = self._sender(SenderOptions(timeout_s=IO_S, chunk_bytes=chunk))
            given = {tid: Grant.from_json(g) for tid, g in grants.items() if g is not None}
            out = []
            for tid in tids:
                called = time.monotonic()
                pair_s = sender.send(endpoint, tid, ids, grant=given.get(tid)).seconds
                out.append((time.monotonic() - called, called, pair_s))
            return out
        if op == "ttft":
            return self.ttft(*args)
        if op == "digest":
            return digest(self.caches, args[0])
        if op == "copy":
            return timed_copy(self.caches, args[0], args[1], gather=self.role == "sender")
        if op == "move":
            return timed_move(self.caches, args[0], args[1])
        if op == "timeline":
            return timeline.take()
        if op == "backend":
            return self.rx.backends() if self.rx is not None else {}
        if op == "raw":
            self.close_sender()  # one NCCL communicator at a time
            rank = 0 if self.role == "sender" else 1
            return raw_send_recv(rank, args[0], args[1], args[2], self.device)
        raise ValueError(f"unknown command {op!r} for the {self.role}")

    def ttft(
        self, endpoint: str, tids: list[tuple[str, str]], ids: list[int], tokens: int, stream: int
    ) -> dict[str, list[float]]:
        """Per iteration: (a) prefill, (b) prefill then send, (c) the two overlapped."""
        sender = self._sender(SenderOptions(timeout_s=IO_S, streaming_chunk_bytes=stream))
        if self.model is None:
            if self.device.type == "cpu":  # a smoke run: Llama-8B layers would take minutes
                self.model = SimPrefill(self.device, 128, 8, intermediate=128, dtype=torch.float32)
            else:
                self.model = SimPrefill(self.device)
        model, slots = self.model, slots_of(ids, BLOCK, tokens, self.device)
        times: dict[str, list[float]] = {"prefill": [], "sequential": [], "overlapped": [],
                                         "threaded": [], "tail": [], "computed_at": []}  # fmt: skip
        for it, (tid_b, tid_c) in enumerate(tids):
            x = model.tokens(tokens, seed=3 * it)
            _sync(self.device)
            start = time.perf_counter()
            model.run(self.caches, slots, x)
            _sync(self.device)
            times["prefill"].append(time.perf_counter() - start)

            x = model.tokens(tokens, seed=3 * it + 1)
            _sync(self.device)
            start = time.perf_counter()
            model.run(self.caches, slots, x)
            _sync(self.device)  # the engine reads the sampled token: the step is over
            sender.send(endpoint, tid_b, ids)
            times["sequential"].append(time.perf_counter() - start)

            # the prefill alone on its own thread, recording its layers (what (c) runs beside
            # the transfer): tells the thread's own cost from the transfer's
            x = model.tokens(tokens, seed=3 * it + 2)
            _sync(self.device)
            start = time.perf_counter()
            alone = model.run_in_thread(self.caches, slots, x, LayerReady(LAYERS, self.device))
            alone.join(IO_S)
            _sync(self.device)
            times["threaded"].append(time.perf_counter() - start)

            x = model.tokens(tokens, seed=3 * it + 2)
            _sync(self.device)
            start = time.perf_counter()
            ready = LayerReady(LAYERS, self.device)
            producer = model.run_in_thread(self.caches, slots, x, ready)
            try:
                future = sender.submit(endpoint, tid_c, ids, ready=ready)
                last = ready.latest(LAYERS - 1, time.monotonic() + IO_S)
                if last is None:
                    raise RuntimeError("the simulated prefill did not record its last layer")
                if last[1] is not None:  # the driver's wait, without the GIL: a Python spin
                    last[1].synchronize()  # would hold it from the transfer's own thread
                computed = time.perf_counter()
                times["computed_at"].append(time.monotonic())
                timeline.mark("last layer computed")
                future.result(IO_S)
                times["tail"].append(time.perf_counter() - computed)
            finally:
                producer.join(IO_S)
            if producer.is_alive():
                raise RuntimeError("the simulated prefill thread did not finish")
            _sync(self.device)
            times["overlapped"].append(time.perf_counter() - start)
        return times

    def close(self) -> None:
        self.close_sender()
        if self.rx is not None:
            self.rx.close()


def _profiled(cls: Any, name: str, role: str) -> None:
    """TANDEM_KV_PROFILE=1: profile every call of ``cls.name`` (on whichever thread runs it)
    and print the top functions when the process ends (where a transfer's time goes)."""
    import atexit
    import cProfile
    import pstats

    prof = cProfile.Profile()
    inner = getattr(cls, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        prof.enable()
        try:
            return inner(*args, **kwargs)
        finally:
            prof.disable()

    setattr(cls, name, wrapper)

    def report() -> None:
        print(f"--- profile of the {role}'s {cls.__name__}.{name}", flush=True)
        pstats.Stats(prof).sort_stats("tottime").print_stats(18)

    atexit.register(report)


def _child(conn: Connection, role: str, device_name: str, num_blocks: int) -> None:
    """A sender or receiver process, serving commands from the parent until "exit"; every
    reply is ("ok", value) or ("error", traceback)."""
    if os.environ.get("TANDEM_KV_DIAG") == "nocopy" and role == "sender":
        # what a transfer costs without its copies (a diagnosis: the data then never lands)
        from kernels.triton_block_copy import BlockCopier

        BlockCopier.copy_from = lambda *_a, **_k: None  # type: ignore[method-assign]
    if TIMELINE:
        timeline.install(role)
    if os.environ.get("TANDEM_KV_PROFILE") == "1":
        from kvtransfer.receiver_pair import ReceiverPair
        from kvtransfer.sender_pair import SenderPair

        if role == "receiver":
            _profiled(ReceiverPair, "_transfer_ipc", role)
        else:
            _profiled(SenderPair, "transfer", role)
    try:
        device = torch.device(device_name)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        state = Child(role, device, num_blocks)
    except Exception:
        conn.send(("error", traceback.format_exc()))
        return
    conn.send(("ok", (state.rx.endpoint if state.rx is not None else "", state.copier)))
    try:
        while True:
            try:
                op, *args = conn.recv()
            except EOFError:  # the parent is gone
                break
            if op == "exit":
                break
            try:
                conn.send(("ok", state.handle(op, args)))
            except Exception:
                conn.send(("error", traceback.format_exc()))
    finally:
        state.close()


class ChildFailed(RuntimeError):
    """A command failed inside a child (its traceback is the message); the child lives on."""


class Pair:
    """Two child processes driven over pipes; every reply is awaited with a timeout."""

    def __init__(self, tx_device: str, rx_device: str, num_blocks: int) -> None:
        ctx = mp.get_context("spawn")
        self.conns: dict[str, Connection] = {}
        self.procs: dict[str, Any] = {}
        for role, device in (("receiver", rx_device), ("sender", tx_device)):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_child, args=(child, role, device, num_blocks), daemon=True)
            proc.start()
            self.conns[role] = parent
            self.procs[role] = proc
        try:
            self.endpoint, rx_copier = self.reply("receiver")
            _, tx_copier = self.reply("sender")
            log(f"block copies: {tx_copier} on the sender, {rx_copier} on the receiver")
        except BaseException:
            self.close()
            raise

    def reply(self, role: str) -> Any:
        conn = self.conns[role]
        if not conn.poll(REPLY_S):
            raise TimeoutError(f"the {role} process did not answer in {REPLY_S:.0f} s")
        try:
            status, value = conn.recv()
        except EOFError:
            code = self.procs[role].exitcode
            raise RuntimeError(f"the {role} process died (exit code {code})") from None
        if status != "ok":
            raise ChildFailed(f"the {role} process failed:\n{value}")
        return value

    def call(self, role: str, *cmd: Any) -> Any:
        self.conns[role].send(cmd)
        return self.reply(role)

    def both(self, op: str, *args: Any) -> tuple[Any, Any]:
        for conn in self.conns.values():
            conn.send((op, *args))
        replies, failed = {}, []
        for role in ("sender", "receiver"):  # read both, so no stale reply is left behind
            try:
                replies[role] = self.reply(role)
            except ChildFailed as e:
                failed.append(e)
        if failed:
            raise failed[0]
        return replies["sender"], replies["receiver"]

    def close(self) -> None:
        for conn in self.conns.values():
            with contextlib.suppress(OSError):  # a child that died already
                conn.send(("exit",))
        for proc in self.procs.values():
            proc.join(30)
            if proc.is_alive():
                proc.kill()


def _row(path: str, tokens: int, seconds: list[float], **extra: Any) -> dict[str, Any]:
    med = statistics.median(seconds)
    p90 = sorted(seconds)[int(0.9 * (len(seconds) - 1))]
    nbytes = kv_bytes(tokens)
    return {"path": path, "tokens": tokens, "bytes": nbytes, "median_ms": med * 1e3,
            "p90_ms": p90 * 1e3, "gbps": nbytes / med / 1e9, **extra}  # fmt: skip


def _ids(tokens: int) -> tuple[list[int], list[int]]:
    n = tokens // BLOCK
    return list(range(n)), list(range(n, 2 * n))[::-1]  # reversed: a real permutation


def _tids(prefix: str, count: int) -> list[str]:
    return [f"{prefix}-{time.monotonic_ns()}-{i}" for i in range(count)]


def _exact(pair: Pair, src: list[int], dst: list[int]) -> bool:
    return bool(pair.call("sender", "digest", src) == pair.call("receiver", "digest", dst))


def _timeline(pair: Pair, title: str, skip: int, **how: Any) -> dict[str, Any]:
    """TANDEM_KV_TIMELINE=1: both sides' events since the last call, split by transfer."""
    tx, rx = pair.call("sender", "timeline"), pair.call("receiver", "timeline")
    if not TIMELINE or not title:
        return {}
    steps = timeline.breakdown(tx, rx, skip, **how)
    timeline.print_breakdown(title, steps)
    return {"timeline": steps}


def bench_e2e(pair: Pair, name: str, tokens: int, args: argparse.Namespace, chunk_mb: float, granted: bool = False) -> dict[str, Any]:  # fmt: skip
    """``granted``: the receiver grants its blocks with the reservation and the sender copies
    without asking for them (kvtransfer.grants; one GPU only)."""
    src, dst = _ids(tokens)
    tids = _tids(f"e2e-{tokens}", args.warmup + args.iters)
    grants = pair.call("receiver", "expect", tids, dst, granted)
    if granted and not all(grants.values()):
        raise ChildFailed("the receiver granted no blocks")
    _timeline(pair, "", 0)  # forget what came before
    sent = pair.call("sender", "send", pair.endpoint, tids, src, int(chunk_mb * 2**20), grants)
    waited = pair.call("receiver", "wait", tids)
    errors = [e for e, _, _ in waited if e]
    ok = not errors and _exact(pair, src, dst)
    # the receiver's part: from its header to its ack (the rest is the round trip around it)
    rx_ms = statistics.median(s for _, s, _ in waited[args.warmup :]) * 1e3
    # the hand-off as the decode side sees it: from send() called to the receiver resolving the
    # transfer (all KV in its blocks; one clock on one host), without the ack's way back
    landed = [w[2] - s[1] for s, w in zip(sent, waited, strict=True)][args.warmup :]
    pair_ms = statistics.median(s[2] for s in sent[args.warmup :]) * 1e3
    how = "granted" if granted else f"{chunk_mb:g}MB"
    title = f"{name} e2e {how}, {tokens} tokens"
    row = _row(f"{name} e2e {how}", tokens, [s[0] for s in sent[args.warmup :]],
               ok=ok, receiver_ms=rx_ms, landed_ms=statistics.median(landed) * 1e3,
               pair_ms=pair_ms, **_timeline(pair, title, args.warmup))  # fmt: skip
    return {**row, "errors": errors[:3]} if errors else row


def bench_ttft(pair: Pair, tokens: int, args: argparse.Namespace) -> dict[str, Any]:
    src, dst = _ids(tokens)
    count = args.warmup + args.iters
    tids = list(zip(_tids(f"seq-{tokens}", count), _tids(f"ovl-{tokens}", count), strict=True))
    pair.call("receiver", "expect", [t for both in tids for t in both], dst, False)
    stream = int(args.stream_chunk_mb * 2**20)
    _timeline(pair, "", 0)
    times = pair.call("sender", "ttft", pair.endpoint, tids, src, tokens, stream)
    tail = _timeline(pair, f"the streamed tail, {tokens} tokens", args.warmup,
                     anchor="last layer computed", window_ms=20.0)  # fmt: skip
    waited = pair.call("receiver", "wait", [t for b in tids for t in b])
    errors = [e for e, _, _ in waited if e]
    ok = not errors and _exact(pair, src, dst)  # the last transfer was an overlapped one
    # the tail: from the last layer computed to the decode side having all the KV (the
    # receiver resolved the transfer; one clock on one host), not to the sender's ack
    landed = [finished for _, _, finished in waited[1::2]]
    times["tail_rx"] = [f - c for f, c in zip(landed, times.pop("computed_at"), strict=True)]
    med = {mode: statistics.median(t[args.warmup :]) * 1e3 for mode, t in times.items()}
    p90 = {m: sorted(t[args.warmup :])[int(0.9 * (args.iters - 1))] * 1e3 for m, t in times.items()}
    return {"path": "ttft", "tokens": tokens, "bytes": kv_bytes(tokens), "ok": ok,
            "prefill_ms": med["prefill"], "sequential_ms": med["sequential"],
            "overlapped_ms": med["overlapped"], "threaded_ms": med["threaded"],
            # from the last layer computed to the decode side having the KV (issue 15: at
            # most 15% of a whole transfer of the same KV), and to the sender's acknowledgement
            "tail_ms": med["tail_rx"], "tail_to_ack_ms": med["tail"],
            "added_sequential_ms": med["sequential"] - med["prefill"],
            "added_overlapped_ms": med["overlapped"] - med["prefill"],
            # (c) runs its prefill on a thread of its own, as the engine does: against that
            # thread alone, what the transfer adds (on 2 x H200 a fresh thread's prefill of 1024
            # tokens took 75-81 ms against 28 on the main thread: (c)-(a) was the thread's cost)
            "added_overlapped_vs_thread_ms": med["overlapped"] - med["threaded"],
            "p90_ms": p90, "stream_chunk_mb": args.stream_chunk_mb, **tail,
            **({"errors": errors[:3]} if errors else {})}  # fmt: skip


def run_pair(name: str, tx: str, rx: str, args: argparse.Namespace, full: bool) -> tuple[list[dict[str, Any]], list[str]]:  # fmt: skip
    """Every section on one pair of processes; a failed section is reported and skipped."""
    rows: list[dict[str, Any]] = []
    errors: list[str] = []
    log(f"{name}: starting the sender ({tx}) and receiver ({rx}) processes")
    pair = Pair(tx, rx, num_blocks=2 * max(*args.tokens, *args.ttft_tokens) // BLOCK)

    def section(what: str, fn: Any) -> None:
        log(f"{name}: {what}")
        try:
            result = fn()
        except ChildFailed as e:  # that command failed; the processes are fine
            errors.append(f"{name} {what}: {e}")
            log(f"FAILED {what}: {e}")
            return
        rows.extend(result if isinstance(result, list) else [result])

    try:
        for tokens in args.tokens if full else []:
            nbytes = kv_bytes(tokens)

            def raw(tokens: int = tokens, nbytes: int = nbytes) -> dict[str, Any]:
                store, port = serve_store("127.0.0.1", 0, 120)
                tx_s, rx_s = pair.both("raw", port, nbytes, args.iters)
                del store
                return _row(f"{name} raw send/recv", tokens, [max(tx_s, rx_s)])

            section(f"raw send/recv, {tokens} tokens", raw)
        for tokens in args.tokens:
            ids = list(range(tokens // BLOCK))

            def copy(tokens: int = tokens, ids: list[int] = ids) -> list[dict[str, Any]]:
                gather_s, scatter_s = pair.both("copy", ids, args.iters)
                return [_row(f"{name} gather", tokens, [gather_s]),
                        _row(f"{name} scatter", tokens, [scatter_s])]  # fmt: skip

            section(f"gather/scatter, {tokens} tokens", copy)
            if tx == rx != "cpu":  # one GPU: the block-to-block copy into the shared pool

                def move(tokens: int = tokens, ids: list[int] = ids) -> list[dict[str, Any]]:
                    variants = pair.call("receiver", "move", ids, args.iters)
                    return [_row(f"{name} move {v}", tokens, [sec]) for v, sec in variants.items()]

                section(f"block move, {tokens} tokens", move)
        for chunk_mb in args.chunk_mb if full else [SenderOptions().chunk_bytes / 2**20]:
            for tokens in args.tokens:
                section(f"e2e, {tokens} tokens, {chunk_mb:g} MiB chunks",
                        lambda t=tokens, c=chunk_mb: bench_e2e(pair, name, t, args, c))  # fmt: skip
        for tokens in args.tokens if tx == rx != "cpu" else []:  # one GPU: blocks granted ahead
            section(f"e2e granted, {tokens} tokens",
                    lambda t=tokens: bench_e2e(pair, name, t, args, 0.0, granted=True))  # fmt: skip
        log(f"{name}: transports {pair.call('receiver', 'backend')}")
        for tokens in args.ttft_tokens if not args.no_ttft else []:
            section(f"ttft, {tokens} tokens", lambda t=tokens: bench_ttft(pair, t, args))
    except Exception as e:  # a child died or hung: the pair is unusable
        errors.append(f"{name}: {type(e).__name__}: {e}")
        log(f"FAILED {name}, skipping the rest of it: {type(e).__name__}: {e}")
    finally:
        pair.close()
    return rows, errors


def _nccl_version() -> str:
    try:
        version = torch.cuda.nccl.version()
    except Exception as e:  # metadata only: never lose the results over it
        return f"unknown ({e})"
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def print_tables(rows: list[dict[str, Any]]) -> None:
    print("\ne2e: send() called to returned (the ack); landed: from send() to the decode side "
          "having the KV")  # fmt: skip
    print(f"{'path':<32}{'tokens':>7}{'MB':>9}{'median ms':>11}{'p90 ms':>9}{'GB/s':>9}"
          f"{'landed':>9}  ok")  # fmt: skip
    for r in rows:
        if r["path"] != "ttft":
            landed = f"{r['landed_ms']:>9.3f}" if "landed_ms" in r else f"{'':>9}"
            print(
                f"{r['path']:<32}{r['tokens']:>7}{r['bytes'] / 1e6:>9.1f}{r['median_ms']:>11.3f}"
                f"{r['p90_ms']:>9.3f}{r['gbps']:>9.1f}{landed}  {r.get('ok', '')}"
            )
    ttft = [r for r in rows if r["path"] == "ttft"]
    if ttft:
        print(
            "\nadded TTFT: (a) prefill alone, (b) prefill then transfer, (c) overlapped per layer"
            "\n(t) (c)'s prefill alone on a thread of its own: (c)-(t) is what the transfer adds"
        )
        print("tail: from the last layer computed to the decode side having all the KV "
              "(and to the sender's ack)")  # fmt: skip
        print(f"{'tokens':>7}{'(a) ms':>10}{'(b) ms':>10}{'(b)-(a)':>10}{'(t) ms':>10}"
              f"{'(c) ms':>10}{'(c)-(t)':>10}{'tail':>9}{'to ack':>9}  ok")  # fmt: skip
        for r in ttft:
            print(
                f"{r['tokens']:>7}{r['prefill_ms']:>10.3f}{r['sequential_ms']:>10.3f}"
                f"{r['added_sequential_ms']:>+10.3f}{r['threaded_ms']:>10.3f}"
                f"{r['overlapped_ms']:>10.3f}{r['added_overlapped_vs_thread_ms']:>+10.3f}"
                f"{r.get('tail_ms', 0.0):>9.3f}{r.get('tail_to_ack_ms', 0.0):>9.3f}  {r['ok']}"
            )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json-out", default="", help="write the rows here as JSON")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--cpu", action="store_true", help="smoke run on CPU over Gloo")
    parser.add_argument("--chunk-mb", type=float, nargs="+", default=[8.0, 16.0, 32.0, 64.0, 4096.0],
                        help="pipeline chunk sizes to compare (4096: one chunk)")  # fmt: skip
    parser.add_argument("--stream-chunk-mb", type=float, default=8.0,
                        help="chunk size of the layer-by-layer (overlapped) transfers")  # fmt: skip
    parser.add_argument("--no-ttft", action="store_true", help="skip the added-TTFT section")
    parser.add_argument("--ttft-tokens", type=int, nargs="+", default=None,
                        help="prompt lengths of the added-TTFT section (default: --tokens)")  # fmt: skip
    parser.add_argument("--skip-same-gpu", action="store_true")
    args = parser.parse_args(argv)
    args.ttft_tokens = args.tokens if args.ttft_tokens is None else args.ttft_tokens
    lengths = [*args.tokens, *args.ttft_tokens]
    if args.iters < 1 or args.warmup < 0 or any(t < BLOCK or t % BLOCK for t in lengths):
        parser.error(f"--iters >= 1, --warmup >= 0, --tokens multiples of {BLOCK}")
    started = time.monotonic()
    gpus = 0 if args.cpu else torch.cuda.device_count()
    rows: list[dict[str, Any]] = []
    errors: list[str] = []
    runs = []
    if args.cpu:
        runs.append(("cpu gloo", "cpu", "cpu", True))
    if gpus >= 2:
        runs.append(("gpu0->gpu1 nccl", "cuda:0", "cuda:1", True))
    if gpus >= 1 and not args.skip_same_gpu:
        runs.append(("same-gpu", "cuda:0", "cuda:0", False))
    if not runs:
        raise SystemExit("no GPU found: run with --cpu for a smoke run")
    for name, tx, rx, full in runs:
        got, failed = run_pair(name, tx, rx, args, full)
        rows += got
        errors += failed
    print_tables(rows)
    if args.json_out:
        meta = {
            "torch": torch.__version__,
            "nccl": _nccl_version() if gpus else "",
            "gpus": [torch.cuda.get_device_name(i) for i in range(gpus)],
            "args": vars(args),
            "seconds": time.monotonic() - started,
            "errors": errors,
        }
        with open(args.json_out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=2)
        log(f"wrote {args.json_out}")
    log(
        f"done in {time.monotonic() - started:.0f} s"
        + (f", {len(errors)} errors" if errors else "")
    )
    if errors:
        raise SystemExit("\n".join(errors))


if __name__ == "__main__":
    main()
