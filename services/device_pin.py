"""A worker started on ``--device cuda:N`` sees only its own GPUs, as GPU 0 onwards.

CUDA's current device is per thread: ``torch.cuda.set_device`` in the thread that builds the
engine leaves every other thread of the process on GPU 0 (the engine loop, the KV transfer
threads), so a worker on ``cuda:1`` launched its kernels and graphs against GPU 0. Narrowing
``CUDA_VISIBLE_DEVICES`` to the worker's GPUs before CUDA starts makes GPU N the default of every
thread, as ``tandem up`` does for the workers it starts. Torch-free: it runs before torch loads.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path

_CUDA_N = re.compile(r"^cuda:(\d+)$")
NVIDIA_GPUS = Path("/proc/driver/nvidia/gpus")  # one entry per GPU the driver sees (Linux)


def gpu_count() -> int | None:
    """How many GPUs the NVIDIA driver sees, without CUDA; None where it cannot be read."""
    try:
        return sum(1 for _ in NVIDIA_GPUS.iterdir())
    except OSError:
        return None


def pin_device(
    device: str, tp_size: int, env: Mapping[str, str], gpus: int | None = None
) -> tuple[str, str | None]:
    """(the device to use, the CUDA_VISIBLE_DEVICES to set, or None to leave it): ``cuda:N`` with
    ``tp_size`` ranks becomes ``cuda:0`` over GPUs N..N+tp_size-1 of those visible (``gpus``:
    how many the host has, when CUDA_VISIBLE_DEVICES does not say; None: not known). Anything
    else, or GPUs past those visible (the engine then refuses, naming the device asked for and
    how many it needs), is left as it is."""
    m = _CUDA_N.match(device.strip())
    if m is None or int(m.group(1)) == 0:
        return device, None
    first, size = int(m.group(1)), max(1, tp_size)
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        if gpus is not None and first + size > gpus:
            return device, None
        return "cuda:0", ",".join(str(i) for i in range(first, first + size))
    ids = [v.strip() for v in visible.split(",") if v.strip()]
    if first + size > len(ids):
        return device, None
    return "cuda:0", ",".join(ids[first : first + size])
