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

from kernels.moe import quantize_fp8_experts
from services.config import ConfigError
from services.engine.models.llama import MLP, DecoderLayer
from services.engine.models.moe import Experts
from services.engine.quantization.base import QuantLinear
from services.engine.quantization.config import INT4_GROUP_SIZES, QuantConfig, channel_group
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
    model: nn.Module, qcfg: QuantConfig, dtype: torch.dtype, stacked: dict[str, list[int]],
    fp8_experts: bool = False, float_expert_layers: frozenset[int] = frozenset(),
) -> None:  # fmt: skip
    """Replace the layers with empty quantized ones that the loader fills; ``stacked`` gives
    the output rows of each shard of a fused layer (``qkv_proj``: q, k, v; ``gate_up_proj``'s
    two halves are always those of the layer's own rows, a shared expert's width too). Layers
    the checkpoint stores unquantized stay float. ``fp8_experts``: an FP8 checkpoint's experts
    are held in FP8 (``Experts.hold_fp8``), except in ``float_expert_layers`` (decoder layers
    where the checkpoint stores an expert unquantized: that layer's are dequantized as they
    load, one stacked tensor holding one format). An AWQ, GPTQ or compressed-tensors int4
    checkpoint's experts are held as packed int4 (``Experts.hold_int4``) on every device,
    outside those layers (:func:`holds_int4_experts`); act-order ones with each expert's
    permutation of its input columns."""
    for name, parent, attr, linear in _targets(model):
        if _stored_unquantized(qcfg, name, attr):
            continue
        n, k, bias = linear.out_features, linear.in_features, linear.bias is not None
        shards = [n // 2, n // 2] if attr == "gate_up_proj" else stacked.get(attr, [n])
        layer: QuantLinear
        if qcfg.is_int4:
            group = channel_group(k) if qcfg.channel else qcfg.group_size
            if group is None:
                raise ConfigError(
                    f"{name}.{attr}: per-channel int4 scales over {k} input features: no "
                    f"group of {', '.join(map(str, INT4_GROUP_SIZES))} divides them"
                )
            layer = Int4Linear(
                k, n, shards, bias, dtype, qcfg.method, group, qcfg.desc_act,
                zero_points=qcfg.zero_points, channel=qcfg.channel,
            )  # fmt: skip
        else:
            layer = Fp8Linear(k, n, shards, bias, dtype, qcfg.weight_block)
        layer.group = _row_parallel_group(linear)
        setattr(parent, attr, layer)
    if fp8_experts and qcfg.method == "fp8":
        for name, experts in expert_modules(model).items():
            if _layer_of(name) not in float_expert_layers:
                experts.hold_fp8(qcfg.weight_block)
    if holds_int4_experts(qcfg):
        for name, experts in expert_modules(model).items():
            _, two_i, h = experts.gate_up_proj.shape
            # per channel (one group a row) the kernels take the rows as they are
            unit = 8 if qcfg.channel else qcfg.group_size
            fits = h % unit == 0 and (two_i // 2) % unit == 0
            if _layer_of(name) not in float_expert_layers and fits:
                group = None if qcfg.channel else qcfg.group_size
                experts.hold_int4(group, act_order=qcfg.desc_act)


def holds_int4_experts(qcfg: QuantConfig) -> bool:
    """Whether an int4 checkpoint's experts are held packed: AWQ's, GPTQ's and
    compressed-tensors', act-order ones too (a desc_act or actorder "group" checkpoint's g_idx
    shuffles each expert's groups: its columns are sorted by group as they load and the fused
    MoE kernels read the activations through the permutation, ``kernels.moe.Int4Scales``)."""
    return qcfg.is_int4 and qcfg.serialized


def _layer_of(name: str) -> int | None:
    parts = name.split(".")
    return int(parts[2]) if name.startswith("model.layers.") and parts[2].isdigit() else None


def expert_modules(model: nn.Module) -> dict[str, Experts]:
    return {name: m for name, m in model.named_modules() if isinstance(m, Experts)}


def held_expert_layers(model: nn.Module) -> frozenset[int]:
    """The decoder layers whose experts are held quantized (FP8 or int4)."""
    layers = (_layer_of(name) for name, e in expert_modules(model).items() if e.fp8 or e.int4)
    return frozenset(layer for layer in layers if layer is not None)


def quantize_loaded(model: nn.Module, group: Any = None, fp8_experts: bool = True) -> None:
    """Quantize the loaded float layers to fp8 (per-channel scales), one at a time. On a
    tensor-parallel rank each layer is the rank's slice; a row-parallel layer's scales are
    those of its whole rows (agreed over the ranks). The experts too, per output row of each
    expert: ``group`` the tensor-parallel group, over which the down projections' rows (each
    rank a slice of every row) agree their magnitudes; not with ``fp8_experts`` False (a GPU
    without FP8, where the fused MoE kernel could not read them)."""
    for _, parent, attr, linear in _targets(model):
        group_of = _row_parallel_group(linear)
        layer = Fp8Linear.from_linear(linear, group_of)
        layer.group = group_of
        setattr(parent, attr, layer)
    for experts in expert_modules(model).values():
        if experts.fp8 or not fp8_experts:
            continue
        w13, w2 = experts.gate_up_proj.data, experts.down_proj.data
        amax = None
        if group is not None:  # the ranks hold slices of each row of w2: agree the magnitudes
            amax = group.all_reduce_max(w2.float().abs().amax(dim=2, keepdim=True))
        q13, s13 = quantize_fp8_experts(w13, None, halves=True)
        del w13
        q2, s2 = quantize_fp8_experts(w2, None, halves=False, amax=amax)
        del w2
        experts.hold_fp8(None, (q13, q2), (s13, s2))


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
            if hasattr(parent, taker):  # DeepSeek's latent attention has no qkv_proj
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
    """Random packed weights for int4 layers under ``--load-format dummy``; FP8 experts'
    weights drawn as the float ones are (about +-0.02) and quantized with their scales."""
    gen = torch.Generator().manual_seed(seed)
    for module in quantized_modules(model).values():
        if isinstance(module, Int4Linear):
            module.fill_dummy(gen)
    for experts in expert_modules(model).values():
        if experts.int4:
            _dummy_int4_experts(experts, gen)
        if not experts.fp8:
            continue
        for weight, scale, halves in (
            (experts.gate_up_proj, experts.gate_up_proj_scale, True),
            (experts.down_proj, experts.down_proj_scale, False),
        ):
            assert scale is not None
            for e in range(weight.shape[0]):  # one expert at a time: no float copy of them all
                drawn = torch.empty(weight.shape[1:]).uniform_(-0.02, 0.02, generator=gen)
                q, s = quantize_fp8_experts(drawn[None], experts.fp8_block, halves)
                weight.data[e].copy_(q[0])
                scale.data[e].copy_(s[0])


def _dummy_int4_experts(experts: Experts, gen: torch.Generator) -> None:
    """Random packed int4 experts as ``Int4Linear.fill_dummy`` draws its weights (about
    +-0.02): random nibbles, zero points 8, scales 0.0025; an act-order config's experts a
    random permutation of their input columns each (the activations read as a real
    checkpoint's are, for benchmarks: x through gate_up_proj's, down_proj's folded into
    gate_up_proj's rows by ``Experts.finish_loading``)."""
    for perm in (experts.gate_up_proj_perm, experts.down_proj_perm):
        if perm is not None:
            for e in range(perm.shape[0]):
                perm.data[e].copy_(torch.randperm(perm.shape[1], generator=gen).to(torch.int32))
    for weight, scale, zeros in (
        (experts.gate_up_proj, experts.gate_up_proj_scale, experts.gate_up_proj_zeros),
        (experts.down_proj, experts.down_proj_scale, experts.down_proj_zeros),
    ):
        assert scale is not None and zeros is not None
        for e in range(weight.shape[0]):
            bits = torch.randint(-(2**31), 2**31 - 1, tuple(weight.shape[1:]), generator=gen)
            weight.data[e].copy_(bits.to(torch.int32))
        scale.data.fill_(0.0025)
        zeros.data.fill_(8)
    experts.finish_loading()  # as a checkpoint's: down_proj's permutation folded
