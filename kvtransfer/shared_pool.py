"""A worker's KV pool shared with another process on the same GPU through CUDA IPC.

The receiver (decode side) exports its per-layer caches once per pair (:func:`export_pool`: one
descriptor per layer, plain JSON-able data: the allocation's IPC handle, where the layer starts
in it, and the owner's reference counter); the sender opens them (:func:`open_pool`) into tensors
of its own process that alias the receiver's memory, and copies its blocks straight into the
reserved ones with one block-to-block kernel per range of layers, after an interprocess event
(:func:`share_event`, :func:`open_event`) the receiver polls to know they have run. No byte goes
through host memory or a process group.

What the receiver shares is its whole pool: only a sender whose hello proved the internal token
(when one is set) gets it, and CUDA IPC works only between processes on the same machine and
GPU. The receiver keeps its caches for its lifetime, so the memory never goes away under an open
pool; the sender drops its tensors when the pair ends (torch's IPC reference counter then lets
the receiver's allocator reuse it).
"""

from __future__ import annotations

import base64
from typing import Any

import torch

from kvtransfer.layout import KvLayout

_MAX_HANDLE = 512  # bytes of one handle (cudaIpcMemHandle_t is 64; expandable segments more)


def _b64(raw: bytes | None) -> str:
    return base64.b64encode(raw or b"").decode()


def _raw(doc: dict[str, Any], key: str) -> bytes:
    value = doc[key]
    if not isinstance(value, str) or len(value) > _MAX_HANDLE * 2:
        raise ValueError(f"shared pool: {key} must be a short base64 string")
    return base64.b64decode(value, validate=True)


def _int(doc: dict[str, Any], key: str) -> int:
    value = doc[key]
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"shared pool: {key} must be an integer >= 0, got {value!r}")
    return value


def export_pool(caches: list[torch.Tensor]) -> list[dict[str, Any]]:
    """One descriptor per layer of CUDA ``caches`` (each contiguous ``[2, blocks, bs, H, D]``)."""
    out = []
    for i, cache in enumerate(caches):
        if not cache.is_cuda or not cache.is_contiguous():
            raise ValueError(f"caches[{i}] must be a contiguous CUDA tensor to be shared")
        (device, handle, size, offset, ref_handle, ref_offset, event, event_sync) = (
            cache.untyped_storage()._share_cuda_()  # type: ignore[attr-defined]
        )
        out.append({
            "device": int(device), "handle": _b64(handle), "size": int(size),
            "offset": int(offset), "ref_handle": _b64(ref_handle), "ref_offset": int(ref_offset),
            "event": _b64(event), "event_sync": bool(event_sync),
            "elem_offset": cache.storage_offset(), "num_blocks": cache.shape[1],
        })  # fmt: skip
    return out


def check_pool(descriptors: Any, layout: KvLayout) -> int:
    """Validate descriptors received from a peer against ``layout``; returns the sender's pool
    size in blocks. Raises ValueError."""
    if not isinstance(descriptors, list) or len(descriptors) != layout.num_layers:
        raise ValueError(f"shared pool: expected {layout.num_layers} layer descriptors")
    sizes = set()
    for doc in descriptors:
        if not isinstance(doc, dict):
            raise ValueError("shared pool: each descriptor must be an object")
        for key in ("device", "size", "offset", "ref_offset", "elem_offset", "num_blocks"):
            _int(doc, key)
        for key in ("handle", "ref_handle", "event"):
            _raw(doc, key)
        if not isinstance(doc["event_sync"], bool):
            raise ValueError("shared pool: event_sync must be a boolean")
        blocks, itemsize = doc["num_blocks"], layout.torch_dtype.itemsize
        block_elems = layout.block_bytes // layout.num_layers // itemsize  # K and V of one layer
        if blocks < 1 or (doc["elem_offset"] + blocks * block_elems) * itemsize > doc["size"]:
            raise ValueError(f"shared pool: a layer of {blocks} blocks does not fit its storage")
        sizes.add(blocks)
    if len(sizes) != 1:
        raise ValueError("shared pool: layers of different sizes")
    return sizes.pop()


def open_pool(
    descriptors: list[dict[str, Any]], layout: KvLayout, device: torch.device
) -> list[torch.Tensor]:
    """The sender's caches as tensors of this process, on ``device`` (this process's index of
    the GPU both share: the sender's own index may differ); call :func:`check_pool` first."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    caches = []
    for doc in descriptors:
        storage = torch.UntypedStorage._new_shared_cuda(  # type: ignore[attr-defined]
            index, _raw(doc, "handle"), doc["size"], doc["offset"],
            _raw(doc, "ref_handle"), doc["ref_offset"], _raw(doc, "event") or None,
            doc["event_sync"],
        )  # fmt: skip
        shape = (2, doc["num_blocks"], layout.block_size, layout.num_kv_heads, layout.head_dim)
        cache = torch.empty(0, dtype=layout.torch_dtype, device=torch.device("cuda", index))
        stride = torch.empty(shape, device="meta").stride()
        cache.set_(storage, doc["elem_offset"], shape, stride)
        caches.append(cache)
    return caches


def share_event(device: torch.device) -> tuple[torch.cuda.Event, str]:
    """An interprocess event on ``device`` (recorded once: CUDA shares only a recorded event)
    and its IPC handle as hex, for :func:`open_event` in another process on the same GPU."""
    event = torch.cuda.Event(interprocess=True)
    with torch.cuda.device(device):
        event.record()
    return event, bytes(event.ipc_handle()).hex()


def open_event(device: torch.device, handle: str) -> torch.cuda.Event:
    """The event another process shared with :func:`share_event`: querying it here says whether
    the work that process queued before its latest ``record`` has run."""
    raw = bytes.fromhex(handle)
    if len(raw) > _MAX_HANDLE:
        raise ValueError("shared event: the handle is too long")
    return torch.cuda.Event.from_ipc_handle(device, raw)
