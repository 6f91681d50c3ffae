"""Which device each end of a pair holds its caches on, and the backend that follows from it."""

from __future__ import annotations

import socket
import uuid
from contextlib import AbstractContextManager, nullcontext
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist

_PROCESS = uuid.uuid4().hex  # tells two ends whether they are one process (no IPC to oneself)
GLOO = "gloo"
NCCL = "nccl"
IPC = "cuda_ipc"  # one GPU: the receiver copies straight out of the sender's pool (kvtransfer.shared_pool)


@dataclass(frozen=True)
class DeviceInfo:
    """Where one end's caches live. ``uuid`` tells two CUDA processes whether they share a GPU."""

    type: str  # "cpu" | "cuda"
    index: int = -1
    uuid: str = ""
    nccl: bool = False  # whether this process can build a ProcessGroupNCCL
    ipc: bool = False  # whether this process can share its caches through CUDA IPC
    process: str = ""  # random per process: CUDA cannot open its own IPC handles

    @classmethod
    def of(cls, device: torch.device, shared: bool = True) -> DeviceInfo:
        """``shared`` False: the pool may not be shared over CUDA IPC (it holds part of each
        block, see ``KvShards``)."""
        if device.type != "cuda":
            return cls("cpu")
        index = device.index if device.index is not None else torch.cuda.current_device()
        uuid = str(getattr(torch.cuda.get_device_properties(index), "uuid", ""))
        return cls("cuda", index, uuid, dist.is_nccl_available(), ipc=shared, process=_PROCESS)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Any) -> DeviceInfo:
        if not isinstance(data, dict) or data.get("type") not in ("cpu", "cuda"):
            raise ValueError(f"bad device description {data!r}")
        index, uuid, nccl = data.get("index", -1), data.get("uuid", ""), data.get("nccl", False)
        ipc, process = data.get("ipc", False), data.get("process", "")
        if not isinstance(index, int) or not isinstance(uuid, str) or not isinstance(process, str):
            raise ValueError(f"bad device description {data!r}")
        if not isinstance(nccl, bool) or not isinstance(ipc, bool):
            raise ValueError(f"bad device description {data!r}")
        return cls(data["type"], index, uuid[:128], nccl, ipc, process[:64])


def choose_backend(sender: DeviceInfo, receiver: DeviceInfo) -> str:
    """NCCL when both ends are CUDA on *different* GPUs and both can use it; CUDA IPC when both
    are on the *same* GPU in two processes (which cannot form an NCCL pair: the receiver opens
    the sender's pool and copies GPU to GPU); else (CPU or mixed pairs, or an end that cannot
    share) Gloo with host staging. The receiver falls back to Gloo if opening the pool fails."""
    both_cuda = sender.type == receiver.type == "cuda"
    known = bool(sender.uuid) and bool(receiver.uuid)
    apart = bool(sender.process) and sender.process != receiver.process
    if (
        both_cuda
        and known
        and sender.uuid == receiver.uuid
        and sender.ipc
        and receiver.ipc
        and apart
    ):
        return IPC
    distinct = known and sender.uuid != receiver.uuid
    return NCCL if both_cuda and distinct and sender.nccl and receiver.nccl else GLOO


def local_address_towards(host: str, port: int) -> str:
    """The local IP this machine would use to reach ``host`` (no packet is sent)."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0][0]
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect((host, port))
            return str(probe.getsockname()[0])
    except OSError:
        return ""


def gloo_device(address: str, interface: str) -> Any:
    """A Gloo transport device bound to ``interface`` or ``address`` (neither: Gloo's default)."""
    gloo = dist.ProcessGroupGloo
    if interface:
        return gloo.create_device(interface=interface)
    if address and address not in ("0.0.0.0", "::"):
        return gloo.create_device(hostname=address)
    return gloo.create_default_device()


def on_stream(stream: torch.cuda.Stream | None) -> AbstractContextManager[Any]:
    """Make ``stream`` (one end's dedicated CUDA stream) current; a no-op without one."""
    return torch.cuda.stream(stream) if stream is not None else nullcontext()
