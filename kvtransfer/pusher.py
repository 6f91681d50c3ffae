"""The sender's fenced copy into blocks a receiver on the same GPU granted ahead, launched at a
low host cost: the hot path of the one-GPU hand-off (:mod:`kvtransfer.grants`).

The copy kernel reads its whole description from one int64 buffer on the device (token, slot,
block count, source and destination ids: ``BlockCopier.push_from``), so one launch of it serves
every transfer of up to as many blocks as its grid covers. It is captured in a CUDA graph per
power-of-two block count (on first use: a few per pair); a transfer then writes its ids into a
pinned host buffer (numpy, no tensor op) and replays the graph on the sender's stream, which
copies them to the device buffer and runs the kernels: one call into the driver instead of a
host-to-device upload of a fresh tensor plus two Triton launches with their argument checks
(about 0.1 ms of Python per transfer on an H200's host). Where the capture fails it does the
same three steps itself.
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
        self._remote, self._local, self._fence = remote, local, fence
        self._stream = stream
        self._capacity = capacity
        size = 3 + 2 * capacity
        self._meta = torch.zeros(size, dtype=torch.int64, device=fence.device)
        self._host = torch.zeros(size, dtype=torch.int64, pin_memory=True)
        self._view: np.ndarray = self._host.numpy()
        self._copied = torch.cuda.Event()
        self._copied.record(torch.cuda.current_stream(fence.device))
        # one graph per power-of-two block count: the grid covers that many blocks
        self._graphs: dict[int, torch.cuda.CUDAGraph | None] = {}

    @property
    def graphs(self) -> dict[int, bool]:
        """Block-count buckets seen so far, and whether each runs from a captured graph."""
        return {bucket: graph is not None for bucket, graph in self._graphs.items()}

    def push(self, token: int, slot: int, src: Sequence[int], dst: Sequence[int]) -> torch.Tensor:
        """Queue the copy of blocks ``src`` (ours) into ``dst`` (the grant's) on the stream;
        returns the device buffer's source ids (valid until the next push)."""
        n = len(src)
        end = 3 + 2 * n
        if not 0 < n <= self._capacity:
            raise ValueError(f"a push carries 1 to {self._capacity} blocks, not {n}")
        bucket = min(1 << (n - 1).bit_length(), self._capacity)
        if bucket not in self._graphs:
            self._graphs[bucket] = self._capture(bucket)
        self._copied.synchronize()  # the last push's ids are out of the host buffer (long ago)
        view = self._view
        view[0], view[1], view[2] = token, slot, n
        view[3 : 3 + n] = src
        view[3 + n : end] = dst
        with on_stream(self._stream):
            graph = self._graphs[bucket]
            if graph is not None:  # the ids' copy to the device is in the graph too
                graph.replay()
            else:
                self._launch(bucket)
            self._copied.record()  # the host buffer is read once this has run
        return self._meta[3 : 3 + n]

    def _launch(self, bucket: int) -> None:
        size = 3 + 2 * bucket
        self._meta[:size].copy_(self._host[:size], non_blocking=True)
        self._remote.push_from(self._local, self._meta[:size], self._fence)

    def _capture(self, bucket: int) -> torch.cuda.CUDAGraph | None:
        """The push of up to ``bucket`` blocks as a graph (None: launched directly)."""
        self._copied.synchronize()
        self._view[0] = _NO_GRANT  # a token no slot holds: the warm-up writes nothing
        with on_stream(self._stream):  # compiles the kernels
            self._launch(bucket)
        if self._stream is not None:
            self._stream.synchronize()
        try:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                self._launch(bucket)
        except Exception as e:  # the same copy, launched each time: more host time
            log.info("the KV push of %d blocks is launched without a CUDA graph: %s", bucket, e)
            return None
        return graph
