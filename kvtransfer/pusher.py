"""The sender's fenced copy into blocks a receiver on the same GPU granted ahead, launched at a
low host cost: the hot path of the one-GPU hand-off (:mod:`kvtransfer.grants`).

The copy kernel reads its whole description from one int64 buffer on the device (token, slot,
block count, source and destination ids: ``BlockCopier.push_from``), so one launch of it serves
every transfer. It is captured once in a CUDA graph; a transfer then writes its ids into a
pinned host buffer (numpy, no tensor op), copies them into the device buffer on the sender's
stream and replays the graph: two calls into the driver instead of a host-to-device upload of
a fresh tensor plus a Triton launch with its argument checks (about 0.1 ms of Python per transfer
on an H200's host). Where the capture fails it launches the kernel itself, the same way.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from kvtransfer.device import on_stream

log = logging.getLogger(__name__)
_NO_GRANT = -4  # a token no fence slot ever holds: what the warm-up launch carries


class Pusher:
    """Not thread-safe: one per pair, used by one thread at a time (as the pair is)."""

    def __init__(
        self,
        remote: Any,  # Copier over the receiver's opened pool (push_from)
        local: Any,  # Copier over our own caches
        fence: torch.Tensor,  # the receiver's grant table, opened: int64 [slots, 2]
        stream: torch.cuda.Stream | None,
        capacity: int,  # the most blocks one transfer carries (our pool's size)
    ) -> None:
        size = 3 + 2 * capacity
        self._stream = stream
        self._meta = torch.zeros(size, dtype=torch.int64, device=fence.device)
        self._host = torch.zeros(size, dtype=torch.int64, pin_memory=True)
        self._view: np.ndarray = self._host.numpy()
        self._copied = torch.cuda.Event()
        self._copied.record(torch.cuda.current_stream(fence.device))
        self._graph: torch.cuda.CUDAGraph | None = None

        def launch() -> None:
            remote.push_from(local, self._meta, fence)

        self._launch = launch
        with on_stream(stream):  # compiles the kernel; matches no grant, so writes nothing
            self._meta[0] = _NO_GRANT
            launch()
        if stream is not None:
            stream.synchronize()
        try:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                launch()
            self._graph = graph
        except Exception as e:  # launches it directly: the same copy, more host time
            log.info("the KV push is launched without a CUDA graph: %s", e)

    @property
    def graphed(self) -> bool:
        return self._graph is not None

    def push(self, token: int, slot: int, src: Sequence[int], dst: Sequence[int]) -> torch.Tensor:
        """Queue the copy of blocks ``src`` (ours) into ``dst`` (the grant's) on the stream;
        returns the device buffer's source ids (valid until the next push)."""
        n = len(src)
        end = 3 + 2 * n
        if end > self._view.shape[0]:
            raise ValueError(f"{n} blocks is more than this sender's pool holds")
        self._copied.synchronize()  # the last push's ids are out of the host buffer (long ago)
        view = self._view
        view[0], view[1], view[2] = token, slot, n
        view[3 : 3 + n] = src
        view[3 + n : end] = dst
        with on_stream(self._stream):
            self._meta[:end].copy_(self._host[:end], non_blocking=True)
            self._copied.record()
            if self._graph is not None:
                self._graph.replay()
            else:
                self._launch()
        return self._meta[3 : 3 + n]
