"""gpt-oss checkpoints' tensors under our names and layout: the router is our MoE block's
``gate``; the experts' stacked tensors are transposed from transformers' ``[E, in, out]`` to our
``[E, out, in]``, their gate and up columns (interleaved: gate, up, gate, up, ...) split into
our gate half and up half; MXFP4 experts (the published weights: ``*_blocks`` and ``*_scales``)
dequantized to the model's dtype on the way.

MXFP4 (the OCP microscaling format): each block of 32 weights along the input dim is 16 bytes
of FP4 (e2m1) codes, two a byte (the low nibble first), and one E8M0 scale byte, the power of
two ``2 ** (scale - 127)`` every code of the block is multiplied by.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from services.config import ConfigError

# the 16 values of an e2m1 code: sign bit, 2 exponent bits, 1 mantissa bit
FP4_VALUES = (
    0.0,
    0.5,
    1.0,
    1.5,
    2.0,
    3.0,
    4.0,
    6.0,
    -0.0,
    -0.5,
    -1.0,
    -1.5,
    -2.0,
    -3.0,
    -4.0,
    -6.0,
)
MXFP4_BLOCK = 32  # weights per scale

_EXPERT_TENSORS = ("gate_up_proj", "down_proj")


def dequantize_mxfp4(
    blocks: torch.Tensor,  # [..., G, 16] uint8: two e2m1 codes a byte, the low nibble first
    scales: torch.Tensor,  # [..., G] uint8: E8M0 exponents (biased by 127)
    dtype: torch.dtype,
) -> torch.Tensor:  # [..., G * 32] of dtype
    """The weights of MXFP4 blocks: each code's value times its block's power of two (exact in
    float32; rounded to ``dtype`` once)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ConfigError(
            f"MXFP4 blocks and scales must be uint8, got {blocks.dtype}, {scales.dtype}"
        )
    if blocks.shape[-1] != MXFP4_BLOCK // 2 or blocks.shape[:-1] != scales.shape:
        raise ConfigError(
            f"MXFP4 blocks {tuple(blocks.shape)} must be [..., G, 16] with scales [..., G], "
            f"got scales {tuple(scales.shape)}"
        )
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).long()  # [..., G, 16, 2]
    values = lut[codes].flatten(-2)  # [..., G, 32]
    exponents = scales.to(torch.int32) - 127  # [..., G]
    return torch.ldexp(values, exponents[..., None]).flatten(-2).to(dtype)  # [..., G * 32]


def _dequantize_experts(
    kind: str,  # gate_up_proj or down_proj
    blocks: torch.Tensor,  # [E, out, G, 16] uint8
    scales: torch.Tensor,  # [E, out, G] uint8
    dtype: torch.dtype,
) -> torch.Tensor:  # [E, out, G * 32], in our layout
    """A stacked MXFP4 tensor one expert at a time into one output, each expert's gate/up
    rows split as they land (a layer's float experts exist once: gpt-oss-120b's gate/up is
    4.2 GB of bf16 a layer)."""
    if blocks.dim() != 4 or scales.shape != blocks.shape[:-1]:
        raise ConfigError(
            f"MXFP4 experts' blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} must "
            "be [E, out, G, 16] and [E, out, G]"
        )
    e, out_dim, groups, _ = blocks.shape
    out = torch.empty(e, out_dim, groups * MXFP4_BLOCK, dtype=dtype)
    for i in range(e):
        out[i] = _ours(kind, dequantize_mxfp4(blocks[i], scales[i], dtype), dim=0)
    return out


def _split_gate_up(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Interleaved gate/up columns (gate, up, gate, up, ...) along ``dim`` as our gate half
    then up half."""
    gate, up = t.unflatten(dim, (-1, 2)).unbind(dim + 1 if dim >= 0 else dim)
    return torch.cat([gate, up], dim)


def _ours(kind: str, tensor: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """An expert tensor already ``[..., out, in]`` (or a bias ``[..., out]``), its out rows
    along ``dim`` (1 for the stacked ``[E, ...]``, 0 for one expert's), in our layout: gate/up
    halves apart."""
    return _split_gate_up(tensor, dim) if kind.startswith("gate_up_proj") else tensor


def gpt_oss_tensors(
    weights: Iterator[tuple[str, torch.Tensor]], dtype: torch.dtype
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors under the names and in the layouts our model holds (MXFP4
    experts dequantized to ``dtype``, one expert at a time so a layer's float weights never
    exist twice)."""
    pending: dict[str, dict[str, torch.Tensor]] = {}  # an MXFP4 tensor waiting for its pair
    for name, tensor in weights:
        name = name.replace(".mlp.router.", ".mlp.gate.")
        prefix, _, leaf = name.rpartition(".")
        if not prefix.endswith(".mlp.experts"):
            yield name, tensor
            continue
        base, _, part = leaf.rpartition("_")
        if part in ("blocks", "scales") and base in _EXPERT_TENSORS:
            pair = pending.setdefault(f"{prefix}.{base}", {})
            pair[part] = tensor
            if len(pair) == 2:
                del pending[f"{prefix}.{base}"]
                yield (
                    f"{prefix}.{base}",
                    _dequantize_experts(base, pair["blocks"], pair["scales"], dtype),
                )
            continue
        if leaf in _EXPERT_TENSORS:  # transformers' float layout: [E, in, out]
            yield name, _ours(leaf, tensor.transpose(1, 2))
        elif leaf in ("gate_up_proj_bias", "down_proj_bias"):
            yield name, _ours(leaf, tensor)
        else:
            raise ConfigError(f"unexpected weight {name!r} for a gpt_oss model")
    if pending:
        raise ConfigError(f"MXFP4 tensors without their blocks or scales: {sorted(pending)[:3]}")
