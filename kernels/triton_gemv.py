"""Matrix-vector products in Triton for decode at batch 1 (and other very short batches).

A linear layer at batch 1 reads its whole weight once and does 2 FLOP per weight element: it
is a pure bandwidth problem. cuBLAS's heuristics sometimes launch too few CTAs for a square
4096x4096 projection on an H100 (64 tiles for 132 SMs, ~1.6 TB/s measured in a decode step),
while a kernel that gives each program a few output rows fills the machine. Each program owns
``BLOCK_N`` rows of the weight, streams them along K in ``BLOCK_K`` chunks (16-byte loads along
the contiguous dim), keeps an fp32 partial product per element and reduces once at the end:
no split-K, so the result is deterministic and does not depend on the launch configuration's
reduction order beyond the chunking. Each row of x gets its own programs (M <= 8), which run
the same code whatever M is: a row's result is bit for bit the one it gets in a batch of 1 (what a
speculative verify step needs to match plain decoding). The grid is one-dimensional with the row
fastest, so the M programs that read one weight tile run side by side and the tile is read from
HBM about once, the other rows hitting L2.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.gemv import GEMV_MAX_ROWS as MAX_ROWS
from kernels.triton_common import FLOAT_DTYPES, check_devices, check_tensor

# (BLOCK_N, BLOCK_K, num_warps): the launch used unless a caller picks another
DEFAULT_CONFIG = (8, 512, 4)


def pick_config(n: int, k: int) -> tuple[int, int, int]:
    """The launch for an [n, k] weight: the fastest of 30 configurations per Llama-3.1-8B shape
    on an H100 (kernels/bench/gemv.py, 2026-11-22), generalised by shape: long rows (k >= 8192)
    take 16 rows per program, wide or square outputs 4, the rest 8; 1024-wide chunks, 8 warps."""
    if k >= 8192:
        return (16, 1024, 8)
    if n >= 16384 or n <= k:
        return (4, 1024 if n >= 16384 else 512, 8)
    return (8, 1024, 8)


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, out_ptr, M, N, K, s_xm, s_wn, s_om,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    pid_n = pid // M
    m = (pid % M).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * s_wn
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + offs_k
        if EVEN_K:
            xv = tl.load(x_ptr + m * s_xm + ks)
            w = tl.load(w_rows + ks[None, :], mask=n_mask[:, None], other=0.0)
        else:
            k_mask = ks < K
            xv = tl.load(x_ptr + m * s_xm + ks, mask=k_mask, other=0.0)
            w = tl.load(w_rows + ks[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        acc += w.to(tl.float32) * xv.to(tl.float32)[None, :]
    out = tl.sum(acc, axis=1)
    tl.store(out_ptr + m * s_om + offs_n, out.to(out_ptr.dtype.element_ty), mask=n_mask)


def gemv(
    x: torch.Tensor,  # [M, K], M <= 8
    weight: torch.Tensor,  # [N, K]
    *,
    config: tuple[int, int, int] | None = None,
) -> torch.Tensor:  # [M, N]
    """Triton version of :func:`kernels.gemv.ref_gemv` for short batches (M <= 8)."""
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    check_tensor("weight", weight, ndim=2, dtypes=FLOAT_DTYPES)
    m, k = x.shape
    n, wk = weight.shape
    if wk != k:
        raise ValueError(f"x has {k} features but weight {tuple(weight.shape)} expects {wk}")
    if m > MAX_ROWS:
        raise ValueError(f"gemv is for at most {MAX_ROWS} rows, got {m}: use a GEMM")
    check_devices(x=x, weight=weight)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()
    block_n, block_k, warps = config or DEFAULT_CONFIG
    block_k = min(block_k, triton.next_power_of_2(k))
    _gemv_kernel[(triton.cdiv(n, block_n) * m,)](
        x, weight, out, m, n, k, x.stride(0), weight.stride(0), out.stride(0),
        BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=k % block_k == 0, num_warps=warps,
    )  # fmt: skip
    return out
