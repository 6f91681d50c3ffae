"""Wait for the GPU with the GIL released.

Reading a CUDA tensor on the host (``.tolist()``, ``.item()``) blocks inside torch while holding
the GIL, so a worker's gRPC event loop, which shares the process, cannot stream tokens while the
GPU computes the next ones: the two serialize. Waiting on a CUDA event first (torch releases the
GIL in ``Event.synchronize``) lets them overlap; the read that follows finds the data ready.
"""

from __future__ import annotations

import torch


class GpuWait:
    def __init__(self, device: torch.device) -> None:
        self._event = torch.cuda.Event() if device.type == "cuda" else None

    def until_ready(self) -> None:
        """Return once the device's current stream has done all the work queued so far."""
        if self._event is not None:
            self._event.record()
            self._event.synchronize()
