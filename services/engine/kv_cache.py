"""KV cache tensors and how many blocks fit: the memory knobs and their errors."""

from __future__ import annotations

import torch

from services.config import CacheConfig, ConfigError
from services.engine.model_config import ArchConfig

CPU_DEFAULT_KV_GIB = 1.0
GIB = 1024**3


def block_bytes(arch: ArchConfig, block_size: int, dtype: torch.dtype) -> int:
    return arch.kv_bytes_per_token(torch.empty((), dtype=dtype).element_size()) * block_size


def allocate_kv_caches(
    arch: ArchConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
) -> list[torch.Tensor]:  # per layer: [2, num_blocks, block_size, Hkv, D]
    shape = (2, num_blocks, block_size, arch.num_kv_heads, arch.head_dim)
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(arch.num_layers)]


def plan_num_blocks(
    cache: CacheConfig, arch: ArchConfig, dtype: torch.dtype, device: torch.device,
    free_bytes_after_profile: int | None = None,
) -> int:  # fmt: skip
    per_block = block_bytes(arch, cache.block_size, dtype)
    if cache.num_blocks is not None:
        return cache.num_blocks
    if cache.kv_cache_gib is not None:
        return max(int(cache.kv_cache_gib * GIB) // per_block, 0)
    if device.type == "cpu" or free_bytes_after_profile is None:
        return int(CPU_DEFAULT_KV_GIB * GIB) // per_block
    return max(free_bytes_after_profile // per_block, 0)


def check_fits(num_blocks: int, block_size: int, max_model_len: int, knob_hint: str) -> None:
    capacity = max(num_blocks, 0) * block_size
    if capacity >= max_model_len and num_blocks >= 1:
        return
    need = f"one sequence of max_model_len {max_model_len} needs {-(-max_model_len // block_size)} blocks of {block_size} tokens"  # fmt: skip
    if num_blocks < 1:  # no --max-model-len helps: the pool must grow
        raise ConfigError(
            f"the KV cache holds no block of {block_size} tokens at all ({need}): give it more "
            f"memory ({knob_hint})."
        )
    raise ConfigError(
        f"max_model_len {max_model_len} does not fit in the KV cache: {need}, but the pool holds "
        f"{num_blocks} blocks ({capacity} tokens). Either set --max-model-len {capacity} or less, "
        f"or give the KV cache more memory ({knob_hint})."
    )
