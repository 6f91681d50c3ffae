"""KV transfer of a tensor-parallel worker: whole blocks on the wire, gathered from and scattered
to the ranks' KV-head shards over the ranks' own ``kv`` group.

Each rank's pool holds its KV heads of every block (``TPLayout.kv_heads``: contiguous runs, or
one replicated head per ``size / Hkv`` ranks). Only rank 0 talks to the peer worker, and what
travels is always the whole model's block (``KvLayout`` with every KV head), so a prefill worker
of any TP size pairs with a decode worker of any TP size: the regrouping happens on each side,
inside the worker. :class:`ShardedCopier` is rank 0's ``kvtransfer.Copier``: a gather asks every
other rank for its heads of the blocks and concatenates them (a replicated head is taken from
its first holder); a scatter sends each rank its heads and waits until every rank has written
them. :func:`serve_kv` is the loop each other rank runs on a thread of its own.

Why it is safe next to the engine's steps: the blocks a transfer reads or writes belong to the
transfer (a finished prompt's, a reservation's), so the forward never writes them meanwhile, and
a rank's KV writes of a layer precede its all-reduces of that layer, which rank 0 waits for:
once rank 0 has passed layer i + 1's KV write (or ended its forward), every rank has written
layer i (``AfterPeers``, the streaming hand-off's sink on rank 0).
"""

from __future__ import annotations

import os
import threading
import traceback
from typing import Any

import torch

from kvtransfer import Copier, KvLayout
from services.engine.kv_handoff import LayerSink
from services.engine.tp_group import broadcast_object
from services.engine.tp_layout import Span

STOP_GRACE_S = 2.0  # how long a failed KV thread waits for its rank's stop before exiting 1

_GATHER, _SCATTER = "gather", "scatter"


def owned(spans: list[Span]) -> list[Span]:
    """The heads each rank contributes to a whole block: its span minus those an earlier rank
    holds (a replicated head comes from its first holder; later holders contribute nothing)."""
    out, covered = [], 0
    for start, end in spans:
        a = max(start, covered)
        out.append((a, max(a, end)))
        covered = max(covered, end)
    return out


def _flat(x: torch.Tensor) -> torch.Tensor:
    """Host bytes of ``x`` (Gloo carries no fp8, and no device tensors)."""
    return x.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)


class ShardedCopier:
    """Rank 0's copier of whole blocks over every rank's shard (thread-safe: one op at a time)."""

    def __init__(
        self, local: Copier, group: Any, spans: list[Span], layout: KvLayout, device: torch.device
    ) -> None:
        self._local, self._group, self._spans = local, group, spans
        self._owned = owned(spans)
        self.layout, self.device = layout, device
        self._lock = threading.Lock()

    def _shape(self, rank: int, n: int, first: int, last: int) -> tuple[int, ...]:
        heads = self._spans[rank][1] - self._spans[rank][0]
        lay = self.layout
        return (last - first, lay.planes, n, lay.block_size, heads, lay.head_dim)

    def gather(
        self, block_ids: torch.Tensor, first: int = 0, last: int | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """Whole blocks: [layers, planes, n, block_size, all KV heads, head_dim]."""
        last = self.layout.num_layers if last is None else last
        ids = [int(b) for b in block_ids.tolist()]
        if self.device.type == "cuda":  # what the stream waits for (a layer's event) is done:
            torch.cuda.current_stream(self.device).synchronize()  # so is every rank's write
        with self._lock:
            broadcast_object(self._group, 0, (_GATHER, ids, first, last))
            parts = [self._local.gather(block_ids, first, last).to("cpu")]
            for rank in range(1, len(self._spans)):
                shape = self._shape(rank, len(ids), first, last)
                buf = torch.empty(shape, dtype=self.layout.torch_dtype)
                self._group.recv([buf.view(-1).view(torch.uint8)], rank, 0).wait()
                parts.append(buf)
        pieces = [
            part[..., a - s : b - s, :]  # [l, planes, n, bs, contributed heads, D]
            for part, (s, _), (a, b) in zip(parts, self._spans, self._owned, strict=True)
            if b > a
        ]
        whole = torch.cat(pieces, dim=-2).to(self.device)  # [l, planes, n, bs, H, D]
        if out is None:
            return whole
        out.copy_(whole)
        return out

    def scatter(
        self, buffer: torch.Tensor, block_ids: torch.Tensor, first: int = 0,
        last: int | None = None,
    ) -> None:  # fmt: skip
        """Write whole blocks ([layers, planes, n, block_size, H, D]): each rank its own heads;
        returns once every rank has written them."""
        last = self.layout.num_layers if last is None else last
        ids = [int(b) for b in block_ids.tolist()]
        with self._lock:
            broadcast_object(self._group, 0, (_SCATTER, ids, first, last))
            for rank, (s, e) in enumerate(self._spans[1:], 1):
                self._group.send([_flat(buffer[..., s:e, :])], rank, 0).wait()
            s, e = self._spans[0]
            self._local.scatter(buffer[..., s:e, :].contiguous(), block_ids, first, last)
            for rank in range(1, len(self._spans)):
                done = torch.zeros(1, dtype=torch.uint8)
                self._group.recv([done], rank, 0).wait()

    def close(self) -> None:
        """End the other ranks' KV loops (a graceful stop, once rank 0's transfers are over;
        one still holding the ranks after a few seconds is left to the ranks' own stop)."""
        if self._lock.acquire(timeout=5.0):
            try:
                broadcast_object(self._group, 0, None)
            finally:
                self._lock.release()

    def copy_from(self, src: Any, src_ids: torch.Tensor, dst_ids: torch.Tensor,
                  first: int = 0, last: int | None = None) -> None:  # fmt: skip
        raise NotImplementedError("a sharded pool is never shared over CUDA IPC")


def serve_kv(
    group: Any, rank: int, local: Copier, layout: KvLayout,
    stopping: threading.Event | None = None,
) -> None:  # fmt: skip
    """A rank other than 0 (``layout``: its own pool's, its heads only): run rank 0's gathers
    and scatters until rank 0 sends None (``ShardedCopier.close``). Any failure ends the process (rank 0's transfer and next step then fail and
    name this rank) rather than leave rank 0 waiting for bytes that never come. A failure
    while the rank is stopping (``stopping`` set, or set within ``STOP_GRACE_S``: rank 0 told
    the ranks to stop, and a rank that left first closed its side of this group) ends it with
    status 0, as the stop does."""
    device = local_device(local)
    try:
        if device.type == "cuda":  # the current device is per thread
            torch.cuda.set_device(device)
        while (cmd := broadcast_object(group, rank)) is not None:
            op, ids, first, last = cmd
            dev_ids = torch.tensor(ids, dtype=torch.int64, device=device)
            shape = layout.buffer_shape(len(ids))[1:]
            if op == _GATHER:
                group.send([_flat(local.gather(dev_ids, first, last))], 0, 0).wait()
                continue
            buf = torch.empty((last - first, *shape), dtype=layout.torch_dtype)
            group.recv([buf.view(-1).view(torch.uint8)], 0, 0).wait()
            local.scatter(buf.to(dev_ids.device), dev_ids, first, last)
            if dev_ids.is_cuda:
                torch.cuda.synchronize(dev_ids.device)
            group.send([torch.ones(1, dtype=torch.uint8)], 0, 0).wait()
    except BaseException:
        if stopping is not None and stopping.wait(STOP_GRACE_S):
            os._exit(0)
        traceback.print_exc()
        os._exit(1)


def local_device(local: Copier) -> torch.device:
    return torch.device(getattr(local, "device", "cpu"))


class AfterPeers:
    """Rank 0's sink of a streaming hand-off: a layer counts as written once every rank has
    written it, which rank 0 knows one layer later (its KV write of layer i + 1 comes after
    layer i's all-reduces) or at the end of its forward (``finish``)."""

    def __init__(self, inner: LayerSink, num_layers: int) -> None:
        self.inner, self.num_layers = inner, num_layers

    def record(self, layer: int) -> None:
        if layer > 0:
            self.inner.record(layer - 1)

    def finish(self) -> None:
        self.inner.record(self.num_layers - 1)

    def fail(self, reason: str) -> None:
        self.inner.fail(reason)
