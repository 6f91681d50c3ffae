"""Backend choice: NCCL between two different GPUs, CUDA IPC on one GPU, Gloo otherwise."""

from __future__ import annotations

import pytest
import torch

from kvtransfer.device import GLOO, IPC, NCCL, DeviceInfo, choose_backend

CPU = DeviceInfo("cpu")
GPU0 = DeviceInfo("cuda", 0, "GPU-0", True)
GPU1 = DeviceInfo("cuda", 1, "GPU-1", True)
GPU1_OTHER_PROCESS = DeviceInfo("cuda", 0, "GPU-1", True)  # same GPU seen under another index
GPU1_IPC = DeviceInfo("cuda", 1, "GPU-1", True, ipc=True, process="a")


@pytest.mark.parametrize(
    ("sender", "receiver", "backend"),
    [
        (CPU, CPU, GLOO),
        (GPU0, GPU1, NCCL),
        (GPU1, GPU1_OTHER_PROCESS, GLOO),  # one GPU cannot host both ends of an NCCL pair
        (GPU1_IPC, DeviceInfo("cuda", 0, "GPU-1", True, ipc=True, process="b"), IPC),  # a pool
        (GPU1_IPC, GPU1_IPC, GLOO),  # one process: CUDA does not open its own IPC handles
        (GPU1_IPC, GPU1_OTHER_PROCESS, GLOO),  # an end without IPC (an older peer)
        (DeviceInfo("cuda", 0, "", ipc=True), DeviceInfo("cuda", 1, "", ipc=True), GLOO),
        (GPU0, CPU, GLOO),
        (GPU0, DeviceInfo("cuda", 1, "GPU-1", False), GLOO),  # no NCCL on one end
        (DeviceInfo("cuda", 0, ""), DeviceInfo("cuda", 1, ""), GLOO),  # unknown identity
    ],
)
def test_choose_backend(sender, receiver, backend):
    assert choose_backend(sender, receiver) == backend


def test_cpu_device_description():
    assert DeviceInfo.of(torch.device("cpu")) == CPU
