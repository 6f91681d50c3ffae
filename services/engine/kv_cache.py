"""KV cache tensors and how many blocks fit: the memory knobs and their errors."""

from __future__ import annotations

from typing import Any

import torch

from protos.blocks import blocks_for
from services.config import CacheConfig, ConfigError
from services.engine.model_config import ArchConfig

GIB = 1024**3
# On the CPU, without --max-model-len, a worker serves this much context (or the model's limit if
# smaller), and without --kv-cache-gib/--num-blocks its KV pool holds CPU_DEFAULT_KV_SEQS sequences
# of that length. For the embedded model that is 2048 tokens of float32 KV, 90 MiB, and the
# default prefill + decode pair with the gateway stays under 2.5 GB resident (docs/benchmarks.md,
# "First run on the CPU"); each worker's float32 weights and runtime take about 0.9 GB of that.
CPU_DEFAULT_MAX_MODEL_LEN = 2048
CPU_DEFAULT_KV_SEQS = 1


def kv_cache_dtype(name: str, model_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """``--kv-cache-dtype``: auto keeps the model's dtype; fp8 stores e4m3 (the attention layers
    scale and round what they write and read it back in the model's dtype: kernels.attention)."""
    if name == "auto":
        return model_dtype
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        major, minor = torch.cuda.get_device_capability(device)
        raise ConfigError(
            f"--kv-cache-dtype {name} needs FP8 conversions (compute capability 8.9+: Ada, Hopper "
            f"or later); this GPU is {major}.{minor}: drop the flag"
        )
    return torch.float8_e4m3fn


def block_bytes(arch: ArchConfig, block_size: int, dtype: torch.dtype) -> int:
    return arch.kv_bytes_per_token(torch.empty((), dtype=dtype).element_size()) * block_size


def allocate_kv_caches(
    arch: ArchConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
) -> list[torch.Tensor]:  # per layer: [planes, num_blocks, block_size, Hkv, D]
    """Per layer ``[arch.kv_planes, num_blocks, block_size, Hkv, D]``: K then V, or DeepSeek's
    latent alone (its keys are its values)."""
    shape = (arch.kv_planes, num_blocks, block_size, arch.num_kv_heads, arch.head_dim)
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(arch.num_layers)]


def plan_num_blocks(
    cache: CacheConfig, arch: ArchConfig, dtype: torch.dtype, device: torch.device,
    max_model_len: int, free_bytes_after_profile: int | None = None,
) -> int:  # fmt: skip
    per_block = block_bytes(arch, cache.block_size, dtype)
    if cache.num_blocks is not None:
        return cache.num_blocks
    if cache.kv_cache_gib is not None:
        n = max(int(cache.kv_cache_gib * GIB) // per_block, 0)
    elif device.type == "cpu" or free_bytes_after_profile is None:
        n = CPU_DEFAULT_KV_SEQS * blocks_for(max_model_len, cache.block_size)
    else:
        n = max(free_bytes_after_profile // per_block, 0)
    if cache.max_total_tokens is not None:  # a cap, but one longest sequence always fits
        cap = blocks_for(max(cache.max_total_tokens, max_model_len), cache.block_size)
        n = min(n, cap)
    return n


def check_fits(num_blocks: int, block_size: int, max_model_len: int, knob_hint: str) -> None:
    capacity = max(num_blocks, 0) * block_size
    if capacity >= max_model_len and num_blocks >= 1:
        return
    need = f"one sequence of max_model_len {max_model_len} needs {blocks_for(max_model_len, block_size)} blocks of {block_size} tokens"  # fmt: skip
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


def _runs(slots: list[int]) -> list[tuple[int, int, int]]:
    """(index, first slot, length) of each run of consecutive slots in an ascending list."""
    runs: list[tuple[int, int, int]] = []
    for i, slot in enumerate(slots):
        if runs and runs[-1][1] + runs[-1][2] == slot:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((i, slot, 1))
    return runs


class HostKV:
    """The host tier's bytes (``services.scheduling.host_tier`` keeps the books): per layer a
    [planes, slots, block_size, Hkv, D] tensor (the device pool's planes), pinned when the pool
    is on a GPU.

    On a GPU the copies never pass through the CPU: evicted blocks are gathered on the device
    and copied straight into their slots (one copy per run of consecutive slots, per layer and
    K/V half) on one side stream, restores come back the same way on another (PCIe carries both
    directions at once), and the step's forward, which may overwrite the evicted blocks, waits
    for both. Every copy of a slot is ordered after the last one through the main stream."""

    def __init__(
        self, arch: ArchConfig, num_slots: int, block_size: int, dtype: torch.dtype,
        device: torch.device,
    ) -> None:  # fmt: skip
        self.device = device
        cuda = device.type == "cuda"
        shape = (arch.kv_planes, num_slots, block_size, arch.num_kv_heads, arch.head_dim)
        self.layers = [
            torch.zeros(shape, dtype=dtype, pin_memory=cuda) for _ in range(arch.num_layers)
        ]
        self._out: Any = torch.cuda.Stream(device) if cuda else None  # device -> host
        self._in: Any = torch.cuda.Stream(device) if cuda else None  # host -> device

    @staticmethod
    def slots_for(gib: float, arch: ArchConfig, block_size: int, dtype: torch.dtype) -> int:
        return int(gib * GIB) // block_bytes(arch, block_size, dtype)

    def move(
        self, caches: list[torch.Tensor], offloads: list[tuple[int, int]],
        restores: list[tuple[int, int]],
    ) -> None:  # fmt: skip
        """Copy (device block -> host slot) offloads and (host slot -> device block) restores
        before the step's forward."""
        if not offloads and not restores:
            return
        if self._out is None:  # the CPU: plain copies, offloads first
            self._offload(caches, offloads)
            self._restore(caches, restores, [])
            return
        main = torch.cuda.current_stream(self.device)
        self._out.wait_stream(main)  # the evicted blocks hold their final KV
        self._out.wait_stream(self._in)  # earlier restores are done reading slots reused now
        self._in.wait_stream(main)
        self._in.wait_stream(self._out)  # earlier offloads have landed in their slots
        with torch.cuda.stream(self._out):
            gathered = self._offload(caches, offloads)
        if {s for _, s in offloads} & {s for s, _ in restores}:  # evicted and hit in one step
            self._in.wait_stream(self._out)
        with torch.cuda.stream(self._in):
            self._restore(caches, restores, gathered)
        main.wait_stream(self._out)
        main.wait_stream(self._in)

    def _offload(self, caches: list[torch.Tensor], offloads: list[tuple[int, int]]) -> list[Any]:
        """Per layer, the event after its evicted blocks were gathered: a restore of this step
        may write into those very blocks (they were just reallocated), but only after that."""
        if not offloads:
            return []
        pairs = sorted(offloads, key=lambda p: p[1])
        blocks = torch.tensor([b for b, _ in pairs], device=self.device)
        runs = _runs([s for _, s in pairs])
        events = []
        for cache, host in zip(caches, self.layers, strict=True):
            gathered = cache.index_select(1, blocks)  # [planes, n, bs, Hkv, D], slot order
            if self._out is not None:
                events.append(torch.cuda.Event())
                events[-1].record()
            for i, s0, k in runs:
                for half in range(cache.shape[0]):
                    host[half, s0 : s0 + k].copy_(gathered[half, i : i + k], non_blocking=True)
        return events

    def _restore(
        self, caches: list[torch.Tensor], restores: list[tuple[int, int]], gathered: list[Any]
    ) -> None:
        if not restores:
            return
        pairs = sorted(restores)
        blocks = torch.tensor([b for _, b in pairs], device=self.device)
        runs = _runs([s for s, _ in pairs])
        for layer, (cache, host) in enumerate(zip(caches, self.layers, strict=True)):
            staged = torch.empty((host.shape[0], len(pairs), *host.shape[2:]), dtype=host.dtype,
                                 device=self.device)  # fmt: skip
            for i, s0, k in runs:
                for half in range(host.shape[0]):
                    staged[half, i : i + k].copy_(host[half, s0 : s0 + k], non_blocking=True)
            if gathered:  # this layer's evicted blocks were read before they are overwritten
                torch.cuda.current_stream(self.device).wait_event(gathered[layer])
            cache.index_copy_(1, blocks, staged)
