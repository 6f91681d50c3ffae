"""Argument checks and small helpers shared by the Triton launchers.

Every launcher validates shapes, strides, dtypes and devices up front and raises ``ValueError``
with a message naming the argument, so a bad call fails in Python instead of reading or writing
out of bounds on the GPU.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterable

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def require(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(message)


def check_tensor(
    name: str,
    t: object,
    *,
    ndim: int | None = None,
    dtypes: Iterable[torch.dtype] | None = None,
    inner_contiguous: bool = True,
) -> torch.Tensor:
    """Check one argument: a tensor of ``ndim`` dims, one of ``dtypes``, unit last stride."""
    require(isinstance(t, torch.Tensor), f"{name} must be a torch.Tensor, got {type(t).__name__}")
    assert isinstance(t, torch.Tensor)
    if ndim is not None:
        require(t.dim() == ndim, f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    if dtypes is not None:
        allowed = tuple(dtypes)
        require(t.dtype in allowed, f"{name} has dtype {t.dtype}; expected one of {allowed}")
    if inner_contiguous and t.dim() > 0 and t.shape[-1] > 1:
        require(t.stride(-1) == 1, f"{name} must be contiguous in its last dim, strides {t.stride()}")
    return t


def check_devices(**tensors: torch.Tensor) -> torch.device:
    """All tensors on one device, and that device is CUDA unless the interpreter runs."""
    devices = {t.device for t in tensors.values()}
    where = ", ".join(f"{k} on {t.device}" for k, t in tensors.items())
    require(len(devices) == 1, f"tensors are on different devices: {where}")
    device = devices.pop()
    require(
        device.type == "cuda" or interpreting(),
        f"Triton kernels need CUDA tensors (got {device}); use kernels.ops for CPU tensors",
    )
    return device


def next_pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


@functools.cache
def num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors on ``device`` (a nominal 132 under the interpreter)."""
    if device.type != "cuda":
        return 132
    return num_sms(device.index if device.index is not None else torch.cuda.current_device())


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs use exact fp32 dots (tf32 would cost ~1e-3 relative error)."""
    return "ieee" if dtype == torch.float32 else "tf32"


def check_kv_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int, int, int]:
    """Paged caches ``[num_blocks, block_size, Hkv, D]``; returns (num_blocks, block_size, Hkv, D)."""
    check_tensor("k_cache", k_cache, ndim=4, dtypes=FLOAT_DTYPES)
    check_tensor("v_cache", v_cache, ndim=4, dtypes=FLOAT_DTYPES)
    require(
        k_cache.shape == v_cache.shape,
        f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} differ in shape",
    )
    require(
        k_cache.dtype == v_cache.dtype,
        f"k_cache ({k_cache.dtype}) and v_cache ({v_cache.dtype}) differ in dtype",
    )
    n, bs, hkv, d = k_cache.shape
    require(bs >= 1 and hkv >= 1 and d >= 1, f"empty KV cache shape {tuple(k_cache.shape)}")
    return n, bs, hkv, d


def check_heads(q_heads: int, kv_heads: int, q_dim: int, kv_dim: int) -> int:
    """Query and KV head layouts agree (GQA/MQA); returns the group size Hq // Hkv."""
    require(q_dim == kv_dim, f"q head_dim {q_dim} != KV cache head_dim {kv_dim}")
    require(
        q_heads % kv_heads == 0,
        f"query heads ({q_heads}) must be a multiple of KV heads ({kv_heads})",
    )
    require(kv_dim <= 256, f"head_dim {kv_dim} > 256 is not supported")
    return q_heads // kv_heads
