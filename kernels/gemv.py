"""Matrix-vector products for batch-1 decode: the pure-torch reference.

``kernels.triton_gemv.gemv`` has the same signature and is tested against it.
"""

from __future__ import annotations

import torch

# the Triton GEMV's rows at most (a program holds 1, 2 or 4 of them): longer batches are a GEMM's
GEMV_MAX_ROWS = 8


def ref_gemv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:  # [M, K] x [N, K] -> [M, N]
    """``x @ weight.T`` with fp32 accumulation, rounded once to x's dtype (what cuBLAS does)."""
    return (x.float() @ weight.float().T).to(x.dtype)
