"""Quantization applied from outside the model: swap its ``Linear`` modules for quantized ones.

The decoder layers' projections are quantized; embed_tokens and lm_head stay in the model's
dtype. A quantized checkpoint's layers are swapped in before the weights are loaded (on the
meta device, so nothing of the float layers is ever allocated); ``--quantization fp8`` on a
float checkpoint quantizes each layer once its float weights are loaded.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn

from services.config import ConfigError
from services.engine.models.llama import MLP, DecoderLayer
from services.engine.quantization.base import QuantLinear
from services.engine.quantization.config import QuantConfig
from services.engine.quantization.fp8 import Fp8InputNorm, Fp8Linear, Fp8SiluAndMul
from services.engine.quantization.int4 import Int4Linear
from services.engine.tp_layers import RowParallelLinear

QUANTIZED = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


# the checkpoint's modules each of our fused layers is stacked from
_PIECES = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def _targets(model: nn.Module) -> list[tuple[str, nn.Module, str, nn.Linear]]:
    """(parent's name, parent, attribute, layer) of every linear layer that gets quantized."""
    return [
        (name, parent, attr, child)
        for name, parent in model.named_modules()
        for attr, child in parent.named_children()
        if attr in QUANTIZED and isinstance(child, nn.Linear)
    ]


def _stored_unquantized(qcfg: QuantConfig, parent: str, attr: str) -> bool:
    """Whether the checkpoint leaves this layer unquantized (all of its stacked pieces; some
    but not all is refused: one fused layer has one format)."""
    names = [f"{parent}.{piece}" for piece in _PIECES.get(attr, (attr,))]
    left = [n for n in names if qcfg.leaves_unquantized(n)]
    if left and len(left) < len(names):
        raise ConfigError(
            f"quantization_config leaves {left} unquantized but not the rest of "
            f"{names}, which this engine runs as one layer: not supported"
        )
    return bool(left)


def quantize_model(
    model: nn.Module, qcfg: QuantConfig, dtype: torch.dtype, stacked: dict[str, list[int]]
) -> None:
    """Replace the layers with empty quantized ones that the loader fills; ``stacked`` gives
    the output rows of each shard of a fused layer (``qkv_proj``: q, k, v). Layers the
    checkpoint stores unquantized stay float."""
    for name, parent, attr, linear in _targets(model):
        if _stored_unquantized(qcfg, name, attr):
            continue
        n, k, bias = linear.out_features, linear.in_features, linear.bias is not None
        shards = stacked.get(attr, [n])
        layer: QuantLinear
        if qcfg.is_int4:
            layer = Int4Linear(
                k, n, shards, bias, dtype, qcfg.method, qcfg.group_size, qcfg.desc_act
            )
        else:
            layer = Fp8Linear(k, n, shards, bias, dtype, qcfg.weight_block)
        layer.group = _row_parallel_group(linear)
        setattr(parent, attr, layer)


def quantize_loaded(model: nn.Module) -> None:
    """Quantize the loaded float layers to fp8 (per-channel scales), one at a time. On a
    tensor-parallel rank each layer is the rank's slice; a row-parallel layer's scales are
    those of its whole rows (agreed over the ranks)."""
    for _, parent, attr, linear in _targets(model):
        group = _row_parallel_group(linear)
        layer = Fp8Linear.from_linear(linear, group)
        layer.group = group
        setattr(parent, attr, layer)


def fuse_fp8_inputs(model: nn.Module) -> None:
    """Let the norms and the SiLU-and-mul before FP8 layers quantize their outputs for them
    (``quantization.fp8``'s docstring): each decoder layer's two norms and its MLP's activation,
    the consumer looked up at every call."""
    for layer in model.modules():
        if not isinstance(layer, DecoderLayer) or not isinstance(layer.mlp, MLP):
            continue  # a sparse MLP's experts are not Fp8Linear layers
        attn, mlp = layer.self_attn, layer.mlp
        for norm, parent, taker in (
            ("input_layernorm", attn, "qkv_proj"),
            ("post_attention_layernorm", mlp, "gate_up_proj"),
        ):
            setattr(layer, norm, Fp8InputNorm(getattr(layer, norm), _Child(parent, taker)))
        mlp.act_fn = Fp8SiluAndMul(_Child(mlp, "down_proj"))


class _Child:
    """``parent.name``, looked up at each call through a weak reference: the activation is the
    MLP's own submodule, and a strong one would make a cycle that keeps the MLP's weights (most
    of the model) alive after the model is dropped, until the cycle collector runs."""

    def __init__(self, parent: nn.Module, name: str) -> None:
        self.parent, self.name = weakref.ref(parent), name

    def __call__(self) -> nn.Module | None:
        parent = self.parent()
        return None if parent is None else getattr(parent, self.name)


def _row_parallel_group(linear: nn.Linear) -> Any:
    """The tensor-parallel group a row-parallel layer sums over (None: any other layer)."""
    return linear.group if isinstance(linear, RowParallelLinear) else None


def quantized_modules(model: nn.Module) -> dict[str, QuantLinear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, QuantLinear)}


def dummy_quantized(model: nn.Module, seed: int) -> None:
    """Random packed weights for int4 layers under ``--load-format dummy``."""
    gen = torch.Generator().manual_seed(seed)
    for module in quantized_modules(model).values():
        if isinstance(module, Int4Linear):
            module.fill_dummy(gen)
