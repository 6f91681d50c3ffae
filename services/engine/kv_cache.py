"""KV cache tensors and how many blocks fit: the memory knobs and their errors."""

from __future__ import annotations

from typing import Any

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


class HostKV:
    """The host tier's bytes (``services.scheduling.host_tier`` keeps the books): per layer a
    [2, slots, block_size, Hkv, D] tensor, pinned when the pool is on a GPU.

    Offloads are queued on the device stream before the step's forward (which may overwrite the
    evicted blocks: stream order keeps the copy first) into pinned staging, and land in their
    slots at the next ``move``, long after the copy finished; restores wait for those first."""

    def __init__(
        self, arch: ArchConfig, num_slots: int, block_size: int, dtype: torch.dtype,
        device: torch.device,
    ) -> None:  # fmt: skip
        self.device = device
        pin = device.type == "cuda"
        shape = (2, num_slots, block_size, arch.num_kv_heads, arch.head_dim)
        self.layers = [
            torch.zeros(shape, dtype=dtype, pin_memory=pin) for _ in range(arch.num_layers)
        ]
        self._landing: list[tuple[Any, torch.Tensor, list[torch.Tensor]]] = []

    @staticmethod
    def slots_for(gib: float, arch: ArchConfig, block_size: int, dtype: torch.dtype) -> int:
        return int(gib * GIB) // block_bytes(arch, block_size, dtype)

    def move(
        self, caches: list[torch.Tensor], offloads: list[tuple[int, int]],
        restores: list[tuple[int, int]],
    ) -> None:  # fmt: skip
        """Copy (device block -> host slot) offloads, then (host slot -> device block) restores.
        Called every step: the last step's offloads land first (their copies are done)."""
        self._land()
        if offloads:
            self._offload(caches, offloads)
        if restores:
            self._land()  # a block evicted and found again in one step
            self._restore(caches, restores)

    def _restore(self, caches: list[torch.Tensor], restores: list[tuple[int, int]]) -> None:
        """Gathered on the host into pinned staging, one async copy per layer, scattered on the
        device; the step's forward follows on the same stream."""
        slots = torch.tensor([s for s, _ in restores])
        blocks = torch.tensor([b for _, b in restores], device=self.device)
        pin = self.device.type == "cuda"
        for cache, host in zip(caches, self.layers, strict=True):
            shape = (2, len(restores), *host.shape[2:])  # [2, n, bs, Hkv, D]
            staged = torch.empty(shape, dtype=host.dtype, pin_memory=pin)
            torch.index_select(host, 1, slots, out=staged)
            cache.index_copy_(1, blocks, staged.to(self.device, non_blocking=True))

    def _offload(self, caches: list[torch.Tensor], offloads: list[tuple[int, int]]) -> None:
        blocks = torch.tensor([b for b, _ in offloads], device=self.device)
        slots = torch.tensor([s for _, s in offloads])
        if self.device.type != "cuda":
            for cache, host in zip(caches, self.layers, strict=True):
                host.index_copy_(1, slots, cache.index_select(1, blocks))
            return
        staged = []
        for cache in caches:  # [2, n, bs, Hkv, D] gathered on the device, then one async copy
            gathered = cache.index_select(1, blocks)
            pinned = torch.empty(gathered.shape, dtype=gathered.dtype, pin_memory=True)
            pinned.copy_(gathered, non_blocking=True)
            staged.append(pinned)
        event = torch.cuda.Event()
        event.record()
        self._landing.append((event, slots, staged))

    def _land(self) -> None:
        for event, slots, staged in self._landing:
            event.synchronize()
            for host, part in zip(self.layers, staged, strict=True):
                host.index_copy_(1, slots, part)
        self._landing.clear()
