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


def _export(t: torch.Tensor) -> dict[str, Any]:
    """The IPC descriptor of CUDA tensor ``t``'s storage, and where ``t`` starts in it."""
    (device, handle, size, offset, ref_handle, ref_offset, event, event_sync) = (
        t.untyped_storage()._share_cuda_()  # type: ignore[attr-defined]
    )
    return {
        "device": int(device), "handle": _b64(handle), "size": int(size),
        "offset": int(offset), "ref_handle": _b64(ref_handle), "ref_offset": int(ref_offset),
        "event": _b64(event), "event_sync": bool(event_sync), "elem_offset": t.storage_offset(),
    }  # fmt: skip


def export_pool(caches: list[torch.Tensor]) -> list[dict[str, Any]]:
    """One descriptor per layer of CUDA ``caches`` (each contiguous ``[planes, blocks, bs, H,
    D]``)."""
    out = []
    for i, cache in enumerate(caches):
        if not cache.is_cuda or not cache.is_contiguous():
            raise ValueError(f"caches[{i}] must be a contiguous CUDA tensor to be shared")
        out.append({**_export(cache), "num_blocks": cache.shape[1]})
    return out


def export_fence(fence: torch.Tensor) -> dict[str, Any]:
    """The descriptor of a receiver's grant fence (``kvtransfer.grants``: int64 ``[slots, 2]``)."""
    if not fence.is_cuda or not fence.is_contiguous() or fence.dtype != torch.int64:
        raise ValueError("the fence must be a contiguous int64 CUDA tensor to be shared")
    return {**_export(fence), "slots": fence.shape[0]}


def _check_storage(doc: Any) -> None:
    if not isinstance(doc, dict):
        raise ValueError("shared pool: each descriptor must be an object")
    for key in ("device", "size", "offset", "ref_offset", "elem_offset"):
        _int(doc, key)
    for key in ("handle", "ref_handle", "event"):
        _raw(doc, key)
    if not isinstance(doc["event_sync"], bool):
        raise ValueError("shared pool: event_sync must be a boolean")


def _open(doc: dict[str, Any], index: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
    storage = torch.UntypedStorage._new_shared_cuda(  # type: ignore[attr-defined]
        index, _raw(doc, "handle"), doc["size"], doc["offset"],
        _raw(doc, "ref_handle"), doc["ref_offset"], _raw(doc, "event") or None,
        doc["event_sync"],
    )  # fmt: skip
    t = torch.empty(0, dtype=dtype, device=torch.device("cuda", index))
    stride = torch.empty(shape, device="meta").stride()
    t.set_(storage, doc["elem_offset"], shape, stride)
    return t


def open_fence(doc: Any, device: torch.device) -> torch.Tensor:
    """A receiver's fence (:func:`export_fence`) as a tensor of this process on ``device``;
    raises ValueError for a malformed descriptor."""
    _check_storage(doc)
    slots = _int(doc, "slots")
    if not 0 < slots <= 1 << 24 or (doc["elem_offset"] + 2 * slots) * 8 > doc["size"]:
        raise ValueError("shared pool: the fence does not fit its storage")
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _open(doc, index, (slots, 2), torch.int64)


def check_pool(descriptors: Any, layout: KvLayout) -> int:
    """Validate descriptors received from a peer against ``layout``; returns the sender's pool
    size in blocks. Raises ValueError."""
    if not isinstance(descriptors, list) or len(descriptors) != layout.num_layers:
        raise ValueError(f"shared pool: expected {layout.num_layers} layer descriptors")
    sizes = set()
    for doc in descriptors:
        _check_storage(doc)
        _int(doc, "num_blocks")
        blocks, itemsize = doc["num_blocks"], layout.torch_dtype.itemsize
        block_elems = layout.block_bytes // layout.num_layers // itemsize  # a layer's planes
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
    shape = (layout.block_size, layout.num_kv_heads, layout.head_dim)
    return [_open(doc, index, (layout.planes, doc["num_blocks"], *shape), layout.torch_dtype) for doc in descriptors]  # fmt: skip


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
