"""Which weight each batch-1 GEMV brings into L2 for the next one (applied from outside the model).

Between a layer's qkv projection and its o projection a decode step at batch 1 runs only small
kernels (rotary and the KV write, attention, its split merge) that leave the GPU's memory
mostly idle for ~10 us; the o projection's weight (8-34 MB for an 8B model) can come into L2
in that time if something asks for it. :func:`plan_l2_prefetch` gives each attention block's
``qkv_proj`` a function returning the tensor its ``o_proj`` streams; the GEMV of ``qkv_proj``
then prefetches it after its own loads (``kernels.triton_common.prefetch_l2``), and the o
projection reads it from L2. A hint only: where the GEMV does not run (longer batches, the CPU)
nothing is prefetched and nothing else changes.
"""

from __future__ import annotations

import functools
import os

import torch
from torch import nn


def enabled() -> bool:
    """``TANDEM_L2_PREFETCH`` (default 1): 0 turns the prefetch off."""
    return os.environ.get("TANDEM_L2_PREFETCH", "1").strip() != "0"


def l2_source(layer: nn.Module) -> torch.Tensor | None:
    """The tensor a linear layer's GEMV streams: the packed ``qweight`` of an int4 layer, else
    its ``weight`` (bf16 or FP8); None for a layer without one it can name (a wrapper)."""
    for name in ("qweight", "weight"):
        t = getattr(layer, name, None)
        if isinstance(t, torch.Tensor) and t.is_contiguous() and t.device.type == "cuda":
            return t.detach()
    return None


def plan_l2_prefetch(model: nn.Module) -> int:
    """Point each attention block's ``qkv_proj`` at its ``o_proj``'s weight (``l2_next``), on
    CUDA, unless turned off. Returns how many blocks were planned."""
    if not enabled():
        return 0
    planned = 0
    for module in model.modules():
        qkv, o = getattr(module, "qkv_proj", None), getattr(module, "o_proj", None)
        if qkv is None or o is None or not hasattr(qkv, "l2_next"):
            continue
        if l2_source(o) is None:
            continue
        # a function, not the tensor: a Parameter set as an attribute would register on qkv_proj
        qkv.l2_next = functools.partial(l2_source, o)
        planned += 1
    return planned
