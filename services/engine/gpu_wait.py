"""Read a step's results on the host, waiting for the GPU with the GIL released.

Reading a CUDA tensor on the host (``.tolist()``, ``.item()``) blocks inside torch while holding
the GIL, so a worker's gRPC event loop, which shares the process, cannot stream tokens while the
GPU computes the next ones: the two serialize. Here every tensor is copied into pinned host
memory without blocking, then one wait on a CUDA event (torch releases the GIL in
``Event.synchronize``) covers them all, and the lists are built from host memory.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class GpuReader:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._event = torch.cuda.Event() if device.type == "cuda" else None
        self._pinned: dict[torch.dtype, torch.Tensor] = {}
        self._while: Callable[[], None] | None = None

    def while_waiting(self, work: Callable[[], None] | None) -> None:
        """Run ``work`` once, at the next :meth:`read`, after the copies are queued and before
        the host waits for the GPU: host work that overlaps the step's GPU time (None: forget
        the work left, unrun)."""
        self._while = work

    def run_pending(self) -> None:
        """Run the work :meth:`while_waiting` left, if no read ran it (a step that read nothing)."""
        work, self._while = self._while, None
        if work is not None:
            work()

    def read(self, *tensors: torch.Tensor) -> list[list]:
        """Each tensor's values as (nested) Python lists, once the GPU has produced them."""
        if self._event is None:
            self.run_pending()
            return [t.tolist() for t in tensors]
        need: dict[torch.dtype, int] = {}
        for t in tensors:
            need[t.dtype] = need.get(t.dtype, 0) + t.numel()
        for dtype, n in need.items():
            buf = self._pinned.get(dtype)
            if buf is None or buf.numel() < n:
                self._pinned[dtype] = torch.empty(max(n, 1024), dtype=dtype, pin_memory=True)
        at = dict.fromkeys(need, 0)
        views = []
        for t in tensors:
            view = self._pinned[t.dtype][at[t.dtype] : at[t.dtype] + t.numel()].view(t.shape)
            at[t.dtype] += t.numel()
            view.copy_(t, non_blocking=True)
            views.append(view)
        self._event.record(torch.cuda.current_stream(self.device))  # the copies' stream
        self.run_pending()
        self._event.synchronize()
        return [v.tolist() for v in views]
