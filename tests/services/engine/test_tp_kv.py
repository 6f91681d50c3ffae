"""A tensor-parallel worker's KV transfer: rank 0 gathers whole blocks from every rank's KV heads
and scatters whole blocks back to them (rank 1 a child process, over a real Gloo group), for
heads split unevenly and replicated; and the streaming sink that waits for every rank."""

from __future__ import annotations

import multiprocessing as mp
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from kvtransfer import KvLayout
from kvtransfer.blockcopy import make_copier
from services.engine.model_config import ArchConfig
from services.engine.tp_group import _gloo
from services.engine.tp_kv import AfterPeers, ShardedCopier, owned, serve_kv
from services.engine.tp_layout import TPLayout

LAYERS, BLOCKS, BS, D = 3, 6, 4, 2


def _arch(q: int, kv: int) -> ArchConfig:
    return ArchConfig(model_type="llama", vocab_size=64, hidden_size=q * D, intermediate_size=16,
                      num_layers=LAYERS, num_heads=q, num_kv_heads=kv, head_dim=D,
                      rms_norm_eps=1e-6, rope_theta=1e4)  # fmt: skip


def _whole(kv: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, BLOCKS, BS, kv, D, generator=g) for _ in range(LAYERS)]


def _pool(kv: int, span: tuple[int, int], seed: int = 1) -> list[torch.Tensor]:
    """One rank's pool: its heads of what a TP 1 pool would hold."""
    return [c[..., span[0] : span[1], :].clone() for c in _whole(kv, seed)]


def _follower(rank: int, size: int, port: int, kv: int, span: tuple[int, int], out: Any) -> None:
    """Rank ``rank`` (a child process): serve rank 0's gathers and scatters of its pool until
    told to stop, then hand the pool back."""
    store = dist.TCPStore("127.0.0.1", port, size, False, timeout=timedelta(seconds=60))
    group = _gloo(dist.PrefixStore("kv", store), rank, size)
    pool = _pool(kv, span)
    serve_kv(group, rank, make_copier(pool), KvLayout.of(pool))
    out.put((rank, [c.numpy() for c in pool]))


@pytest.mark.parametrize(
    ("q", "kv", "size"),
    [(6, 3, 2), (4, 1, 2)],  # (8, 2, 2), the even split, runs end to end in tests/deploy
    ids=["uneven-2+1", "replicated"],
)
def test_whole_blocks_gather_from_and_scatter_to_every_ranks_heads(
    q: int, kv: int, size: int
) -> None:
    arch = _arch(q, kv)
    spans = [TPLayout.of(arch, r, size).kv_heads for r in range(size)]
    source = _whole(kv, seed=1)
    store = dist.TCPStore("127.0.0.1", 0, size, True, timeout=timedelta(seconds=60),
                          wait_for_workers=False)  # fmt: skip
    ctx = mp.get_context("spawn")  # a child of its own: a Gloo group per process
    out = ctx.Queue()
    procs = [ctx.Process(target=_follower, args=(r, size, store.port, kv, spans[r], out))
             for r in range(1, size)]  # fmt: skip
    for p in procs:
        p.start()
    try:
        group = _gloo(dist.PrefixStore("kv", store), 0, size)
        pool = _pool(kv, spans[0])
        whole = KvLayout(LAYERS, BS, kv, D, "float32")
        copier = ShardedCopier(make_copier(pool), group, spans, whole, torch.device("cpu"))
        ids = torch.tensor([4, 1, 3])
        got = copier.gather(ids)  # [L, 2, n, bs, kv, D]
        assert torch.equal(got, torch.stack([c[:, ids] for c in source]))
        part = torch.empty(2, 2, 3, BS, kv, D)
        copier.gather(ids, 1, 3, out=part)
        assert torch.equal(part, got[1:3])
        incoming = torch.stack([c[:, :3] for c in _whole(kv, seed=2)])  # [L, 2, 3, bs, kv, D]
        target = torch.tensor([5, 0, 2])
        copier.scatter(incoming, target)
        copier.close()
        pools = {0: pool, **{r: [torch.from_numpy(c) for c in p] for r, p in
                             (out.get(timeout=60) for _ in procs)}}  # fmt: skip
        for rank, (s, e) in enumerate(spans):
            for layer, cache in enumerate(pools[rank]):
                assert torch.equal(cache[:, target], incoming[layer, ..., s:e, :])
                assert torch.equal(cache[:, 1], source[layer][:, 1, ..., s:e, :])  # untouched
        for p in procs:
            p.join(30)
            assert p.exitcode == 0
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()


def test_a_replicated_head_comes_from_its_first_holder() -> None:
    assert owned([(0, 1), (0, 1), (1, 2), (1, 2)]) == [(0, 1), (1, 1), (1, 2), (2, 2)]
    assert owned([(0, 2), (2, 3)]) == [(0, 2), (2, 3)]


class Sink:
    def __init__(self) -> None:
        self.recorded: list[int] = []
        self.failed = ""

    def record(self, layer: int) -> None:
        self.recorded.append(layer)

    def fail(self, reason: str) -> None:
        self.failed = reason


def test_a_streamed_layer_counts_once_every_rank_has_written_it() -> None:
    """Rank 0 writing layer i + 1 means every rank wrote layer i; the last layer is whole at
    the end of rank 0's forward."""
    inner = Sink()
    sink = AfterPeers(inner, 3)
    sink.record(0)
    assert inner.recorded == []
    sink.record(1)
    sink.record(2)
    assert inner.recorded == [0, 1]
    sink.finish()
    assert inner.recorded == [0, 1, 2]
    sink.fail("boom")
    assert inner.failed == "boom"


def _serve_with_a_broken_group(stopping: bool) -> None:
    """A follower's KV thread whose group fails at once (a peer closed its side)."""
    import threading

    from services.engine import tp_kv

    class Closed:
        def broadcast(self, *args: Any) -> Any:
            raise RuntimeError("Connection closed by peer")

    tp_kv.STOP_GRACE_S = 0.2
    event = threading.Event()
    if stopping:
        event.set()
    pool = _pool(1, (0, 1))
    serve_kv(Closed(), 1, make_copier(pool), KvLayout.of(pool), event)


@pytest.mark.parametrize(("stopping", "status"), [(True, 0), (False, 1)])
def test_a_kv_thread_failing_while_its_rank_stops_exits_0(stopping: bool, status: int) -> None:
    """At a graceful stop the ranks leave in any order: a KV thread whose group breaks then
    is part of the stop (status 0, which rank 0 checks); otherwise it is a failure (1)."""
    proc = mp.get_context("spawn").Process(target=_serve_with_a_broken_group, args=(stopping,))
    proc.start()
    proc.join(60)
    assert proc.exitcode == status
