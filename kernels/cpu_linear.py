"""float32 linear layers on the CPU through oneDNN, their weights laid out for it once at load.

torch's ``F.linear`` on the CPU hands a float32 product to MKL's sgemm (sgemv for one row),
which reads the weight in its row-major form every call. oneDNN's matmul reads a weight that
was reordered once into its blocked layout (``torch.ops.mkldnn._reorder_linear_weight``, the
layout torch's own compiler gives CPU linears when it freezes a model): on this project's
2-core machine the embedded model's lm_head (49152 x 576) took 1.2x less time at one row and
1.7-2.0x less at 2-64 rows, its gate_up projection 1.3x less at 2-32 rows (docs/benchmarks.md,
W7). The reorder is lossless (``to_dense()`` gives the weight back bit for bit); the products
differ from sgemm's only in the order of their float32 sums, as sgemm's and sgemv's already do
between batch sizes.

:func:`pack_linears` swaps the weight of each plain float32 ``Linear`` of a model on the CPU
for its oneDNN layout (from outside the model, after loading); :func:`kernels.ops.linear` sends a
layer whose weight is in that layout here. ``TANDEM_CPU_ONEDNN=0`` keeps sgemm (a benchmark's
other side).
"""

from __future__ import annotations

import os

import torch
from torch import nn

ENV = "TANDEM_CPU_ONEDNN"
# the batch size oneDNN's blocked layout is chosen for (any batch size runs on it): a CPU
# engine's decode batches
LAYOUT_ROWS = 16


def enabled() -> bool:
    """oneDNN is in this torch build and ``TANDEM_CPU_ONEDNN`` does not turn it off."""
    return torch.backends.mkldnn.is_available() and os.environ.get(ENV, "1") != "0"


def _packable(weight: torch.Tensor) -> bool:
    """A dense 2-D float32 CPU tensor (not already in oneDNN's layout)."""
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and weight.dim() == 2
        and not weight.is_mkldnn
    )


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` ([N, K] float32 on the CPU) in oneDNN's layout for a linear layer."""
    if not _packable(weight):
        raise ValueError(
            f"a oneDNN linear weight is a 2-D float32 CPU tensor, got {weight.dtype} "
            f"{tuple(weight.shape)} on {weight.device}"
        )
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), LAYOUT_ROWS)


def linear(
    x: torch.Tensor,  # [..., K] float32
    weight: torch.Tensor,  # [N, K], from :func:`pack`
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:  # [..., N]
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def ref_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """:func:`linear` by the dense weight and sgemm, the reference it is tested against."""
    dense = weight.to_dense() if weight.is_mkldnn else weight
    return torch.nn.functional.linear(x, dense, bias)


def pack_linears(model: nn.Module, kinds: tuple[type[nn.Module], ...]) -> int:
    """Give each module of exactly one of ``kinds`` (a ``Linear`` whose forward is
    :func:`kernels.ops.linear`) with a float32 CPU weight its oneDNN layout; the number of
    layers changed. A weight shared with another module (an lm_head tied to the embedding,
    which looks rows up) gets a laid-out copy of its own; the others are replaced. A module
    whose weight is also read as a tensor (``keep_dense_weight``: DeepSeek's kv_b_proj, whose
    rows are W_UK and W_UV) keeps it."""
    if not enabled():
        return 0
    count = 0
    for module in list(model.modules()):
        if type(module) not in kinds or getattr(module, "keep_dense_weight", False):
            continue
        w = module.weight
        if not isinstance(w, torch.Tensor) or not _packable(w):
            continue
        module.weight = nn.Parameter(pack(w), requires_grad=False)
        count += 1
    return count
