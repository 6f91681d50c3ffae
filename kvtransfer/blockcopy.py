"""Block gather/scatter: ``kernels.ops`` (Triton on CUDA) if present, else the torch references."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import cast

import torch

from kernels.block_copy import ref_gather_blocks, ref_scatter_blocks

GatherFn = Callable[[list[torch.Tensor], torch.Tensor], torch.Tensor]
ScatterFn = Callable[[torch.Tensor, list[torch.Tensor], torch.Tensor], None]


def _load() -> tuple[GatherFn, ScatterFn]:
    try:
        ops = importlib.import_module("kernels.ops")
        return cast(GatherFn, ops.gather_blocks), cast(ScatterFn, ops.scatter_blocks)
    except (ImportError, AttributeError):
        return ref_gather_blocks, ref_scatter_blocks


gather_blocks, scatter_blocks = _load()
