"""Quantized weights: the on-disk formats, their unpacking and the pure-torch references.

Two weight formats are served:

- **w4a16** (AWQ, GPTQ): 4-bit unsigned integers ``q`` in groups of ``G`` input rows, each group
  with a scale and a zero point per output column: ``W[k, n] = (q[k, n] - z[g, n]) * s[g, n]``.
  On disk AWQ packs eight columns per int32 (``qweight [K, N/8]``, nibble ``i`` holds column
  ``AWQ_ORDER[i]``); GPTQ packs eight input rows per int32 in order (``qweight [K/8, N]``), its
  zeros eight columns per int32 and stored minus one (the v1 format), and ``g_idx [K]`` names the
  group of each input row (act-order checkpoints shuffle them). Both are converted at load time
  to one serving layout: ``qweight [K/8, N]`` packed along K in order, ``scales`` and ``zeros``
  ``[K/G, N]`` in the activation dtype, groups contiguous (act-order rows are permuted, and the
  layer permutes x's columns to match).
- **fp8** (e4m3): ``weight [N, K]`` with float32 scales ``[N, ceil(K / block_k)]``: row-wise
  (per-channel, one column) or 128x128 blocks expanded to rows at load time, so any stacked
  shard size works and a kernel finds the scale of ``W[n, k]`` at ``scale[n, k // block_k]``.

``kernels.triton_quant`` has the same signatures as the ``ref_*_linear`` functions and is tested
against them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ int32 holds column AWQ_ORDER[i]
FP8_MAX = 448.0  # largest finite float8_e4m3fn
INV_FP8_MAX = 1.0 / FP8_MAX  # rounded to float32 where it multiplies a float32 tensor
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)  # [8]


def _nibbles(packed: torch.Tensor) -> torch.Tensor:  # [..., P] int32 -> [..., P, 8] in 0..15
    return (packed.unsqueeze(-1) >> _SHIFTS.to(packed.device)) & 0xF


def unpack_cols(packed: torch.Tensor, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """``[..., R, C/8]`` int32 -> ``[..., R, C]`` int32: eight columns per int32, nibble ``i``
    holding column ``order[i]`` of its eight (in order when None: GPTQ's zeros and the fused
    MoE's int4 experts; AWQ_ORDER: AWQ)."""
    nib = _nibbles(packed)  # [..., C/8, 8], nibble-major
    if order is not None:
        inverse = torch.argsort(torch.tensor(order))  # column j sits in nibble inverse[j]
        nib = nib[..., inverse.to(packed.device)]
    return nib.reshape(*packed.shape[:-1], -1)


def pack_cols(q: torch.Tensor, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """Inverse of :func:`unpack_cols`: ``[..., C]`` values in 0..15 -> ``[..., C/8]`` int32."""
    cols = q.to(torch.int32).reshape(*q.shape[:-1], q.shape[-1] // 8, 8)
    if order is not None:
        cols = cols[..., torch.tensor(order, device=q.device)]
    return (cols << _SHIFTS.to(q.device)).sum(-1, dtype=torch.int32)


def unpack_rows(packed: torch.Tensor) -> torch.Tensor:  # [K/8, N] int32 -> [K, N] in 0..15
    """Eight input rows per int32 in order (GPTQ's qweight and the serving layout)."""
    return _nibbles(packed).permute(0, 2, 1).reshape(-1, packed.shape[1])


def pack_rows(q: torch.Tensor) -> torch.Tensor:  # [K, N] in 0..15 -> [K/8, N] int32
    return pack_cols(q.T.contiguous()).T.contiguous()


def ref_dequant_awq(
    qweight: torch.Tensor,  # [K, N/8] int32, AWQ order
    qzeros: torch.Tensor,  # [K/G, N/8] int32, AWQ order
    scales: torch.Tensor,  # [K/G, N]
) -> torch.Tensor:  # [K, N] float32
    q, z = unpack_cols(qweight, AWQ_ORDER), unpack_cols(qzeros, AWQ_ORDER)
    group = q.shape[0] // z.shape[0]
    g = torch.arange(q.shape[0], device=q.device) // group
    return (q - z[g]).float() * scales[g].float()


def ref_dequant_gptq(
    qweight: torch.Tensor,  # [K/8, N] int32
    qzeros: torch.Tensor,  # [K/G, N/8] int32, zero points minus one
    scales: torch.Tensor,  # [K/G, N]
    g_idx: torch.Tensor,  # [K] int32: the group of each input row
) -> torch.Tensor:  # [K, N] float32
    q, z = unpack_rows(qweight), unpack_cols(qzeros) + 1
    g = g_idx.long()
    return (q - z[g]).float() * scales[g].float()


def ref_dequant_int4(
    qweight: torch.Tensor,  # [K/8, N] int32, the serving layout
    scales: torch.Tensor,  # [K/G, N]
    zeros: torch.Tensor,  # [K/G, N], integer values 0..15
    group_size: int,
) -> torch.Tensor:  # [K, N] float32
    q = unpack_rows(qweight)
    g = torch.arange(q.shape[0], device=q.device) // group_size
    return (q.float() - zeros[g].float()) * scales[g].float()


def ref_w4a16_linear(
    x: torch.Tensor,  # [M, K]
    qweight: torch.Tensor,  # [K/8, N] int32
    scales: torch.Tensor,  # [K/G, N]
    zeros: torch.Tensor,  # [K/G, N]
    group_size: int,
) -> torch.Tensor:  # [M, N]
    """Dequantize, then ``x @ W`` with fp32 accumulation, rounded once to x's dtype."""
    return (x.float() @ ref_dequant_int4(qweight, scales, zeros, group_size)).to(x.dtype)


def expand_block_scales(scale: torch.Tensor, rows: int, block_n: int) -> torch.Tensor:
    """``[ceil(N / block_n), KB]`` block scales -> ``[N, KB]``: one scale row per weight row."""
    return scale.float().repeat_interleave(block_n, dim=0)[:rows].contiguous()


def ref_dequant_fp8(
    weight: torch.Tensor,  # [N, K] float8_e4m3fn
    scale: torch.Tensor,  # [N, KB] float32, KB = ceil(K / block_k)
    block_k: int,
) -> torch.Tensor:  # [N, K] float32
    cols = torch.arange(weight.shape[1], device=weight.device) // block_k
    return weight.float() * scale.float()[:, cols]


def ref_fp8_linear(
    x: torch.Tensor,  # [M, K]
    weight: torch.Tensor,  # [N, K] float8_e4m3fn
    scale: torch.Tensor,  # [N, KB] float32
    block_k: int,
) -> torch.Tensor:  # [M, N]
    """Weight-only: dequantize, then ``x @ W.T`` with fp32 accumulation."""
    return (x.float() @ ref_dequant_fp8(weight, scale, block_k).T).to(x.dtype)


def quantize_fp8_rows(
    w: torch.Tensor, amax: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row (per-channel) e4m3 quantization: ``[N, K]`` -> (fp8 ``[N, K]``, fp32 ``[N, 1]``).
    ``amax`` ``[N, 1]``: each row's largest magnitude when ``w`` is part of longer rows (a
    tensor-parallel rank's columns), so that the scales are those of the whole rows."""
    if amax is None:
        amax = w.float().abs().amax(dim=1, keepdim=True)
    scale = (amax / FP8_MAX).clamp(min=1e-12)
    return (w.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def ref_per_token_quant_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic activation scales, one per token (row): ``[M, K]`` -> (fp8, fp32 ``[M, 1]``).
    ``scale = max(amax * float32(1 / 448), 1e-12)``, each element ``x * (1 / scale)`` rounded to
    e4m3: products and a correctly rounded reciprocal, which a kernel reproduces bit for bit on
    every device (a float quotient is approximate in compiled Triton, and torch on CUDA divides
    by a scalar as a product by its reciprocal while the CPU divides)."""
    scale = (x.float().abs().amax(dim=1, keepdim=True) * INV_FP8_MAX).clamp(min=1e-12)
    q = (x.float() * scale.reciprocal()).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def ref_fp8_w8a8_linear(
    x: torch.Tensor,  # [M, K]
    weight: torch.Tensor,  # [N, K] float8_e4m3fn
    scale: torch.Tensor,  # [N, 1] float32, per channel
) -> torch.Tensor:  # [M, N]
    """W8A8: x quantized per token, both dequantized, multiplied in fp32."""
    xq, xs = ref_per_token_quant_fp8(x)
    return ((xq.float() * xs) @ (weight.float() * scale.float()).T).to(x.dtype)


def scaled_mm_fp8(
    xq: torch.Tensor,  # [M, K] float8_e4m3fn, quantized per token
    x_scale: torch.Tensor,  # [M, 1] float32
    weight: torch.Tensor,  # [N, K] float8_e4m3fn
    scale: torch.Tensor,  # [N, 1] float32, per channel
    out_dtype: torch.dtype,
) -> torch.Tensor:  # [M, N]
    """``torch._scaled_mm`` of an input already quantized per token and a per-channel weight
    (FP8 tensor cores on sm89+, row-wise scales).

    Fast accumulation (the tensor cores' own accumulator over the whole K loop, as vLLM's
    CUTLASS FP8 kernels do): 5-13% faster at W1's shapes on an H200 (1,300 against 1,160
    TFLOP/s at 8192 rows), 2.3e-3 relative to the fp32-promoted product (3.7e-3 at K = 14336),
    a sixteenth to a tenth of the FP8 rounding's own 3.8e-2 against bf16 (``python -m
    kernels.bench.quant --w8a8-rows``)."""
    return torch._scaled_mm(
        xq, weight.T, scale_a=x_scale, scale_b=scale.float().T.contiguous(),
        out_dtype=out_dtype, use_fast_accum=True,
    )  # fmt: skip


def scaled_mm_w8a8_linear(
    x: torch.Tensor,  # [M, K]
    weight: torch.Tensor,  # [N, K] float8_e4m3fn
    scale: torch.Tensor,  # [N, 1] float32
    quant: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]] = ref_per_token_quant_fp8,
) -> torch.Tensor:  # [M, N]
    """:func:`ref_fp8_w8a8_linear` through :func:`scaled_mm_fp8`; ``quant`` quantizes x per
    token (the Triton kernel on a GPU: one pass instead of torch's five)."""
    return scaled_mm_fp8(*quant(x), weight, scale, x.dtype)
