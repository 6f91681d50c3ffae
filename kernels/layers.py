"""Element-wise layers of the Llama family: the pure-torch references.

The Triton kernels in ``kernels.triton_layers`` have the same signatures.

Rounding follows transformers' Llama modelling code (``LlamaRMSNorm``, ``apply_rotary_pos_emb``,
``LlamaMLP``) operation by operation: in bf16/fp16 every intermediate that transformers holds in
the activation dtype is rounded to it here too (each op computed in fp32 and rounded once, as
torch does for 16-bit tensors). In float32 every such rounding is the identity.
"""

from __future__ import annotations

import torch


def ref_rms_norm(
    x: torch.Tensor,  # [T, H]
    weight: torch.Tensor,  # [H]
    eps: float,
    residual: torch.Tensor | None = None,  # [T, H]
) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm fused with the residual add: returns (norm(x + residual), x + residual).

    Without a residual, the second value is ``x`` itself. As ``LlamaRMSNorm``: the sum is rounded
    to x's dtype (transformers adds the residual in the model dtype), normalized in fp32, rounded
    to x's dtype, then multiplied by the weight: ``weight * normed.to(x.dtype)``. The result has
    x's dtype: when weight and x dtypes differ, torch would promote (e.g. an fp32 weight gives an
    fp32 result); we return that promoted product cast to x's dtype. In the engine the weight
    has the model dtype, so there is no difference.
    """
    if residual is not None:
        x = (x.float() + residual.float()).to(x.dtype)
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    # a 16-bit * 16-bit product is exact in fp32: this is torch's `weight * normed`, rounded once
    return (weight.float() * normed.float()).to(x.dtype), x


def ref_gemma_rms_norm(
    x: torch.Tensor,  # [T, H]
    weight: torch.Tensor,  # [H], stored as an offset from 1
    eps: float,
    residual: torch.Tensor | None = None,  # [T, H]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gemma's RMSNorm fused with the residual add, (norm(x + residual), x + residual): as
    ``Gemma3RMSNorm``, the weight applies as ``1 + weight`` and the product is taken in fp32
    before the one rounding to x's dtype (Llama rounds the normalized x first)."""
    if residual is not None:
        x = (x.float() + residual.float()).to(x.dtype)
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * (1.0 + weight.float())).to(x.dtype), x


def ref_gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:  # [T, 2I] -> [T, I]
    """GELU (tanh approximation, transformers' ``gelu_pytorch_tanh``) of the first half times
    the second half, as ``act_fn(gate) * up`` in x's dtype: the activation rounded to x's dtype,
    then the product rounded."""
    gate, up = x.chunk(2, dim=-1)
    act = torch.nn.functional.gelu(gate.float(), approximate="tanh").to(x.dtype)
    return (act.float() * up.float()).to(x.dtype)


def ref_silu_and_mul(x: torch.Tensor) -> torch.Tensor:  # [T, 2I] -> [T, I]
    """SiLU of the first half times the second half (gate, up), as ``act_fn(gate) * up`` in x's
    dtype: silu rounded to x's dtype, then the product rounded."""
    gate, up = x.chunk(2, dim=-1)
    act = torch.nn.functional.silu(gate.float()).to(x.dtype)
    return (act.float() * up.float()).to(x.dtype)


def ref_rotary_embedding(
    positions: torch.Tensor,  # [T] int64
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hkv, D]
    cos_sin_cache: torch.Tensor,  # [max_pos, R] float32: cos in [:, :R/2], sin in [:, R/2:]
) -> None:
    """Rotate q and k in place, NeoX style (halves rotated, as HF Llama does).

    As ``apply_rotary_pos_emb`` with cos/sin cast to the tensor's dtype: for each of q and k,
    ``o1 = rnd(rnd(x1 * c) - rnd(x2 * s))`` and ``o2 = rnd(rnd(x2 * c) + rnd(x1 * s))`` with
    ``c, s = rnd(cos), rnd(sin)`` and ``rnd`` rounding to that tensor's dtype. A table narrower
    than the head (R < D: partial rotary, Phi-4-mini's) rotates the first R dims of each head,
    halves of R, and leaves the others as they are (transformers' Phi-3 ``q_pass``).
    """
    rot = check_rotary_width(cos_sin_cache, q.shape[-1])
    cs = cos_sin_cache[positions.long()]
    for t in (q, k):
        t[..., :rot].copy_(rotated(t[..., :rot], cs))


def rotated(t: torch.Tensor, cs: torch.Tensor) -> torch.Tensor:
    """``t`` [T, H, R] rotated by its rows' ``cs`` [T, R] (cos halves, then sin halves; a
    gather of the table at the positions) as :func:`ref_rotary_embedding` rotates in place: a
    new contiguous tensor of t's dtype."""
    half = cs.shape[-1] // 2
    return _rotate(t, cs[:, None, :half], cs[:, None, half:])


def check_rotary_width(cos_sin_cache: torch.Tensor, head_dim: int) -> int:
    """The rotated dims R (the table's width): even and at most the head's."""
    rot = int(cos_sin_cache.shape[-1])
    if rot % 2 != 0 or not 0 < rot <= head_dim:
        raise ValueError(f"cos_sin_cache width {rot} must be even and at most head_dim {head_dim}")
    return rot


def _rotate(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """t rotated in t's dtype (each product and sum computed in fp32 and rounded once)."""
    dt, half = t.dtype, t.shape[-1] // 2

    def rnd(y: torch.Tensor) -> torch.Tensor:
        return y.to(dt).float()

    c, s = rnd(cos), rnd(sin)
    x1, x2 = t[..., :half].float(), t[..., half:].float()
    o1 = rnd(x1 * c) - rnd(x2 * s)
    o2 = rnd(x2 * c) + rnd(x1 * s)
    return torch.cat([o1, o2], dim=-1).to(dt)
