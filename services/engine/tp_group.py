"""The tensor-parallel ranks of one engine: their own process group and its collectives.

Built straight from a TCPStore (``ProcessGroupGloo`` / ``ProcessGroupNCCL`` constructors, as
``kvtransfer.pair`` does), never through ``init_process_group``: no global default group exists,
so the same process can also hold KV-transfer pairs. The step plans travel as pickled bytes over
a Gloo group on the host; activations over the device group (NCCL on GPUs, the same Gloo group
on the CPU). A third group, ``kv`` (Gloo), carries the KV blocks a worker ships or receives
(``services.engine.tp_kv``) between rank 0's transfer threads and each rank's KV thread, so
they never interleave with the step's collectives. A peer that dies makes the next collective raise (Gloo: "connection closed by
peer") instead of hanging; a stuck one, the group's timeout. Rank 0 forms its groups with a short
rendezvous timeout (it enters the rendezvous only once every rank has joined the store) and sets
the collectives' afterwards. Each other rank marks the store as it enters the start-up agreement,
so that rank 0 can watch their processes until then (``tp_ranks``) instead of blocking.
"""

from __future__ import annotations

import logging
import pickle
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from services.config import ConfigError

log = logging.getLogger(__name__)
TIMEOUT = timedelta(minutes=10)  # a stuck peer; a dead one fails at once


def _gloo(store: Any, rank: int, size: int, form_timeout: timedelta = TIMEOUT) -> Any:
    opts: Any = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    opts._timeout = form_timeout  # the rendezvous
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    group = dist.ProcessGroupGloo(store, rank, size, opts)
    group._set_default_timeout(TIMEOUT)  # the collectives
    return group


class TPGroup:
    """One rank's view of the group: the collectives the model and the runner use."""

    def __init__(
        self, store: Any, rank: int, size: int, device: torch.device,
        form_timeout: timedelta = TIMEOUT,
    ) -> None:  # fmt: skip
        self.rank, self.size = rank, size
        self.store = store
        self.host = _gloo(dist.PrefixStore("host", store), self.rank, self.size, form_timeout)
        if device.type == "cuda":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = TIMEOUT
            self.device_group: Any = dist.ProcessGroupNCCL(
                dist.PrefixStore("device", store), self.rank, self.size, opts
            )
        else:
            self.device_group = self.host
        self.kv = _gloo(dist.PrefixStore("kv", store), self.rank, self.size, form_timeout)
        self.agreed = False  # the start-up agreement took place
        # rank 0's wait, before the agreement, for every other rank to enter it (tp_ranks
        # watches their processes there instead of blocking in the collective)
        self.start_watch: Callable[[], None] = lambda: None

    def agree(self, value: Any, error: str | None = None) -> list[Any]:
        """The start-up agreement: every rank's ``value`` in rank order, or (on every rank) a
        ConfigError naming each rank that failed (``error``) and why."""
        self.agreed = True
        if self.rank == 0:
            self.start_watch()
        else:
            self.store.set(f"agreeing/{self.rank}", "1")
        got = self.exchange((value, error))
        failed = [f"rank {r}: {e}" for r, (_, e) in enumerate(got) if e is not None]
        if failed:
            raise ConfigError("tensor-parallel " + "; ".join(failed))
        return [v for v, _ in got]

    # ---- activations (every rank calls these in the same order) ------------------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place."""
        self.device_group.allreduce([x]).wait()
        return x

    def all_reduce_max(self, x: torch.Tensor) -> torch.Tensor:
        """The element-wise maximum of ``x`` over the ranks, in place."""
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp(dist.ReduceOp.MAX)
        self.device_group.allreduce([x], opts).wait()
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:  # [B, n] -> [B, size * n]
        parts = [torch.empty_like(x) for _ in range(self.size)]
        self.device_group.allgather([parts], [x.contiguous()]).wait()
        return torch.cat(parts, dim=-1)

    # ---- plain data over the host group ------------------------------------------------------
    def abort_device(self) -> None:
        """Abort the device group's collectives (NCCL's ``abort``, not itself a collective):
        one that waits on a rank that died then returns, or raises (NCCL does not notice a dead
        peer: it would wait for the group's timeout). Gloo notices one (its next collective
        raises), so on the CPU this does nothing."""
        if self.device_group is not self.host:
            try:
                self.device_group.abort()
            except Exception:  # rank 0 may then wait for the group's timeout: say why
                log.exception("could not abort the tensor-parallel device group")

    def broadcast(self, obj: Any = None) -> Any:
        """Rank 0's ``obj`` on every rank (the others pass nothing)."""
        return broadcast_object(self.host, self.rank, obj)

    def exchange(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order, on every rank."""
        data = pickle.dumps(obj)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.size)]
        self.host.allgather([sizes], [torch.tensor([len(data)], dtype=torch.int64)]).wait()
        n = max(int(s) for s in sizes)
        buf = torch.zeros(n, dtype=torch.uint8)
        buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        parts = [torch.empty(n, dtype=torch.uint8) for _ in range(self.size)]
        self.host.allgather([parts], [buf]).wait()
        return [
            pickle.loads(p[: int(s)].numpy().tobytes()) for p, s in zip(parts, sizes, strict=True)
        ]


def broadcast_object(group: Any, rank: int, obj: Any = None) -> Any:
    """Rank 0's ``obj`` (pickled) on every rank of ``group`` (the others pass nothing)."""
    data = pickle.dumps(obj) if rank == 0 else b""
    size = torch.tensor([len(data)], dtype=torch.int64)
    group.broadcast(size, 0).wait()
    buf = (
        torch.frombuffer(bytearray(data), dtype=torch.uint8)
        if rank == 0
        else torch.empty(int(size), dtype=torch.uint8)
    )
    group.broadcast(buf, 0).wait()
    return obj if rank == 0 else pickle.loads(buf.numpy().tobytes())
