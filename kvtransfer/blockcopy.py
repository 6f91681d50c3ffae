"""Block gather/scatter through ``kernels.ops``: Triton on CUDA, the torch references elsewhere.

:func:`make_copier` gives the transfer path a copier bound to one list of caches (checked once:
Triton's :class:`BlockCopier` for CUDA caches, the reference elsewhere); the free functions
check their arguments on every call.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, cast

import torch

from kernels import ops
from kernels.block_copy import RefBlockCopier
from kvtransfer.layout import KvLayout

GatherFn = Callable[[list[torch.Tensor], torch.Tensor], torch.Tensor]
ScatterFn = Callable[[torch.Tensor, list[torch.Tensor], torch.Tensor], None]


class Copier(Protocol):
    """Gather/scatter of blocks of layers [first, last) of one fixed list of caches."""

    def gather(
        self,
        block_ids: torch.Tensor,
        first: int = 0,
        last: int | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor: ...

    def scatter(
        self, buffer: torch.Tensor, block_ids: torch.Tensor, first: int = 0, last: int | None = None
    ) -> None: ...

    def copy_from(
        self,
        src: Any,  # a copier of the same kind over another list of caches
        src_ids: torch.Tensor,
        dst_ids: torch.Tensor,
        first: int = 0,
        last: int | None = None,
    ) -> None: ...


@dataclass(frozen=True)
class KvShards:
    """Caches that hold part of each block (a tensor-parallel rank's KV heads): ``copier``
    gathers and scatters whole blocks (the other parts through their owners) and ``layout`` is
    the layout of a whole block, which is what travels."""

    copier: Copier
    layout: KvLayout


def make_copier(kv_caches: list[torch.Tensor]) -> Copier:
    """A copier for ``kv_caches``: Triton on CUDA (one launch per call), else the reference
    (also for caches the kernel does not take, such as fp8 ones: it copies those just as well)."""
    if kv_caches and kv_caches[0].is_cuda and ops.triton_available():
        from kernels.triton_block_copy import BlockCopier

        try:
            return cast(Copier, BlockCopier(kv_caches))
        except ValueError:
            pass
    return RefBlockCopier(kv_caches)


gather_blocks: GatherFn = ops.gather_blocks
scatter_blocks: ScatterFn = ops.scatter_blocks
