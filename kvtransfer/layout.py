"""The shape of a worker's paged KV caches, as both ends of a transfer must agree on it.

Per-layer caches are ``[planes, num_blocks, block_size, num_kv_heads, head_dim]``: K then V
(2 planes), or one plane whose keys are also the values (DeepSeek's latent cache); the pool size
``num_blocks`` may differ between workers, everything else must match.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch

# dtypes a cache may have, by the name that travels in headers (never eval'd: looked up here)
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
}
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}


@dataclass(frozen=True)
class KvLayout:
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # a key of DTYPES
    planes: int = 2  # K and V; 1: the keys are the values (a peer that sends none means 2)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def block_bytes(self) -> int:
        """Bytes one block occupies across all layers and planes."""
        itemsize = self.torch_dtype.itemsize
        per_plane = self.block_size * self.num_kv_heads * self.head_dim * itemsize
        return self.num_layers * self.planes * per_plane

    def buffer_shape(self, num_blocks: int) -> tuple[int, int, int, int, int, int]:
        """Shape of the contiguous transfer buffer (the gather output) for ``num_blocks``."""
        return (self.num_layers, self.planes, num_blocks, self.block_size, self.num_kv_heads,
                self.head_dim)  # fmt: skip

    def mismatch(self, other: KvLayout) -> str:
        """Human-readable differences from ``other`` ('' if none)."""
        diffs = [
            f"{name} {mine} != {theirs}"
            for name, mine in asdict(self).items()
            if mine != (theirs := getattr(other, name))
        ]
        return ", ".join(diffs)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Any) -> KvLayout:
        """Parse and validate a layout received from a peer; raises ValueError."""
        if not isinstance(data, dict):
            raise ValueError("layout must be an object")
        ints = {}
        for name in ("num_layers", "block_size", "num_kv_heads", "head_dim"):
            value = data.get(name)
            if not isinstance(value, int) or isinstance(value, bool) or not 0 < value < 1 << 20:
                raise ValueError(f"layout.{name} must be a positive integer, got {value!r}")
            ints[name] = value
        dtype = data.get("dtype")
        if dtype not in DTYPES:
            raise ValueError(f"layout.dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        planes = data.get("planes", 2)
        if planes not in (1, 2) or isinstance(planes, bool):
            raise ValueError(f"layout.planes must be 1 or 2, got {planes!r}")
        return cls(dtype=dtype, planes=planes, **ints)

    @classmethod
    def of(cls, kv_caches: list[torch.Tensor]) -> KvLayout:
        """Layout of a list of per-layer caches; raises ValueError if they are not uniform."""
        if not kv_caches:
            raise ValueError("kv_caches must hold at least one layer")
        first = kv_caches[0]
        if first.dim() != 5 or first.shape[0] not in (1, 2):
            raise ValueError(
                "each cache must be [planes (1 or 2), num_blocks, block_size, heads, head_dim], "
                f"got {tuple(first.shape)}"
            )
        if first.dtype not in DTYPE_NAMES:
            raise ValueError(f"unsupported cache dtype {first.dtype}")
        for i, cache in enumerate(kv_caches):
            if cache.shape != first.shape or cache.dtype != first.dtype:
                raise ValueError(
                    f"kv_caches[{i}] is {tuple(cache.shape)} {cache.dtype}, layer 0 is "
                    f"{tuple(first.shape)} {first.dtype}"
                )
            if cache.device != first.device:
                raise ValueError(f"kv_caches[{i}] is on {cache.device}, layer 0 on {first.device}")
        planes, _, block_size, heads, head_dim = first.shape
        return cls(len(kv_caches), block_size, heads, head_dim, DTYPE_NAMES[first.dtype], planes)


def check_block_ids(block_ids: list[int], num_blocks: int) -> None:
    """Raise ValueError unless ``block_ids`` are distinct indices into a pool of ``num_blocks``."""
    if not block_ids:
        raise ValueError("block_ids must not be empty")
    # the common case at C speed (a transfer's hot path): plain ints, all in range
    if set(map(type, block_ids)) != {int} or not 0 <= min(block_ids) <= max(block_ids) < num_blocks:  # fmt: skip
        for b in block_ids:
            if not isinstance(b, int) or isinstance(b, bool) or not 0 <= b < num_blocks:
                raise ValueError(f"block id {b!r} is outside the pool [0, {num_blocks})")
    if len(set(block_ids)) != len(block_ids):
        raise ValueError("block_ids must be distinct")
