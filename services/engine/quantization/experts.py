"""A quantized checkpoint's experts that are not held quantized, dequantized to the model's dtype
as they load, and int4 ones that are, converted to the packed layout the fused MoE kernels read;
and the start-up line on what the experts are held as.

FP8 experts are held in FP8 (``Experts.hold_fp8``: the fused MoE kernel reads e4m3 tiles), their
tensors passed through here to the loader, except in layers the checkpoint leaves an expert of
unquantized and on GPUs without FP8 (before sm89). AWQ's, GPTQ's and compressed-tensors' int4
experts are held packed (``Experts.hold_int4``: the kernels dequantize them in their tiles):
each projection's ``qweight``, ``qzeros`` and ``scales`` (``weight_packed``, ``weight_scale``,
``weight_zero_point``) are converted here (:func:`pack_expert`) to the ``kernels.moe.Int4Scales``
layout and passed on as ``weight`` (int32), ``weight_scale`` and ``weight_zeros``. Act-order
ones (GPTQ desc_act, compressed-tensors actorder "group"), whose ``g_idx`` shuffles the groups
over the input features, have their columns sorted by group as they are packed (every group
contiguous, as the kernels read them) and pass on that order as ``weight_perm`` (the input
feature of each packed column), through which the kernels read the activations; an expert's
gate and up projections, one stacked layer with one input, must agree on it.

The experts not held quantized (FP8 ones before sm89; a layer's where the checkpoint leaves an
expert unquantized, or whose widths an int4 group does not divide) are dequantized: each expert projection's quantized pieces (fp8 ``weight`` with its
``weight_scale_inv`` blocks or ``weight_scale`` per channel; AWQ's and GPTQ's ``qweight``,
``qzeros``, ``scales`` and act-order ``g_idx``) are gathered from the checkpoint's stream and
replaced by one float ``weight`` [N, K], the tensor a float checkpoint would hold, through the
torch references of ``kernels.quant``. Everything else (the attention and dense layers, which
keep their quantized kernels; an expert the checkpoint stores unquantized; the router) passes
through as read.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from kernels.quant import (
    AWQ_ORDER,
    expand_block_scales,
    pack_cols,
    ref_dequant_awq,
    ref_dequant_fp8,
    ref_dequant_gptq,
    unpack_cols,
)
from services.config import ConfigError
from services.engine.models.moe import Experts
from services.engine.quantization.config import QuantConfig, int4_pieces
from services.engine.quantization.int4 import group_order
from services.engine.tp_layout import QUANT_PIECES

# one piece of one expert's projection (Qwen3-MoE's and DeepSeek's names; Mixtral's w1/w3/w2)
_PIECE = re.compile(
    r"^(.*\.experts\.\d+\.(?:gate_proj|up_proj|down_proj|w1|w2|w3))"
    rf"\.(weight|{QUANT_PIECES})$"
)
# one piece of a projection of DeepSeek's latent attention but o_proj: the model reads them as
# float weights (kv_b_proj split into each head's key and value maps), as vLLM dequantizes
# kv_b_proj; o_proj stays a quantized layer
_MLA_PIECE = re.compile(
    r"^(.*\.self_attn\.(?:q_proj|q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj))"
    rf"\.(weight|{QUANT_PIECES})$"
)


_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
# an expert's gate or up projection (stacked into one: one input, one act-order permutation)
_GATE_UP = re.compile(r"\.(?:gate_proj|up_proj|w1|w3)$")


def expert_pieces(qcfg: QuantConfig) -> tuple[str, ...]:
    """The checkpoint tensors that make up one quantized expert projection."""
    if qcfg.method == "fp8":
        return ("weight", "weight_scale_inv" if qcfg.weight_block else "weight_scale")
    return int4_pieces(qcfg.method, qcfg.zero_points, qcfg.desc_act)


def dequantize(qcfg: QuantConfig, pieces: dict[str, torch.Tensor]) -> torch.Tensor:
    """One projection's quantized pieces -> its float32 weight [N, K]."""
    if qcfg.method == "fp8":
        weight = pieces["weight"]  # [N, K] e4m3
        n, k = weight.shape
        if qcfg.weight_block is not None:
            bn, bk = qcfg.weight_block
            return ref_dequant_fp8(
                weight, expand_block_scales(pieces["weight_scale_inv"], n, bn), bk
            )
        scale = pieces["weight_scale"].float().reshape(-1, 1)  # [N, 1], or one per tensor
        return ref_dequant_fp8(weight, scale.expand(n, 1), k)
    if qcfg.method == "compressed-tensors":
        q, scale, zeros = _compressed_int4(qcfg, pieces)  # [N, K], [N, K/G] twice
        k = q.shape[1]
        g_idx = pieces.get("weight_g_idx")
        cols = torch.arange(k, device=q.device) // (k // scale.shape[1])
        if g_idx is not None:
            cols = g_idx.to(device=q.device, dtype=torch.int64)
        return (q - zeros[:, cols].long()).float() * scale[:, cols].float()
    qweight, qzeros, scales = pieces["qweight"], pieces["qzeros"], pieces["scales"]
    if qcfg.method == "awq":  # [K, N/8], [K/G, N/8], [K/G, N]
        return ref_dequant_awq(qweight, qzeros, scales).T
    k = qweight.shape[0] * 8  # GPTQ [K/8, N]: groups in order unless act-order
    g_idx = pieces.get("g_idx")
    if g_idx is None:
        g_idx = torch.arange(k, device=qweight.device) // qcfg.group_size
    return ref_dequant_gptq(qweight, qzeros, scales, g_idx).T


def pack_expert(
    qcfg: QuantConfig, pieces: dict[str, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One int4 projection's AWQ, GPTQ or compressed-tensors pieces -> its packed weight
    [N, K / 8] int32, float32 scales and uint8 zeros [N, K / G] (``kernels.moe.Int4Scales``)
    and, act-order, its permutation [K] int32: the columns sorted by group (``g_idx``, stable,
    as the dense layer sorts its rows: ``Int4Linear.finish_loading``), so that packed column
    ``j`` is input feature ``perm[j]`` and every group contiguous. The values ``dequantize``
    gives, bit for bit, once the columns are put back (``kernels.moe.dequant_int4_expert``)."""
    if qcfg.method == "compressed-tensors":  # weight_packed is this layout already
        _, scale, zeros = _compressed_int4(qcfg, pieces)
        packed = pieces["weight_packed"].contiguous()
        scale, zeros = scale.float().contiguous(), zeros.to(torch.uint8).contiguous()
        g_idx = pieces.get("weight_g_idx")
    else:
        qweight, qzeros, scales = pieces["qweight"], pieces["qzeros"], pieces["scales"]
        if qcfg.method == "awq":  # [K, N/8] columns in AWQ's order; zeros [K/G, N/8] alike
            q = unpack_cols(qweight, AWQ_ORDER).T.contiguous()  # [N, K]
            packed = pack_cols(q)
            zeros = unpack_cols(qzeros, AWQ_ORDER)
        else:  # GPTQ [K/8, N]: eight K rows a word in order, ours transposed; zeros minus one
            packed = qweight.T.contiguous()
            zeros = unpack_cols(qzeros) + 1
        scale, zeros = scales.float().T.contiguous(), zeros.T.to(torch.uint8).contiguous()
        g_idx = pieces.get("g_idx")
    if g_idx is None or not qcfg.desc_act:
        return packed, scale, zeros, None
    perm = group_order(g_idx.to(torch.int64), packed.shape[1] * 8, scale.shape[1])
    return pack_cols(unpack_cols(packed)[:, perm]), scale, zeros, perm.to(torch.int32)


def _compressed_int4(
    qcfg: QuantConfig, pieces: dict[str, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One compressed-tensors pack-quantized projection's values [N, K] (0..15), scales and
    zero points [N, K/G] (per channel: [N, 1]): ``weight_packed`` [N, K/8] eight K values a
    word in order, each the signed value plus 8; ``weight_zero_point`` [N/8, K/G] eight output
    rows a word in order, plus 8 (symmetric: none, 8)."""
    packed, scale = pieces["weight_packed"], pieces["weight_scale"]
    n = packed.shape[0]
    if scale.dim() != 2 or scale.shape[0] != n:
        raise ConfigError(f"weight_scale {tuple(scale.shape)} is not [{n}, groups]")
    if qcfg.zero_points:
        zeros = unpack_cols(pieces["weight_zero_point"].T.contiguous()).T[:n]
    else:
        zeros = torch.full(scale.shape, 8, dtype=torch.int32, device=scale.device)
    return unpack_cols(packed), scale, zeros


@dataclass
class ExpertDequantizer:
    """Feeds a checkpoint's tensors through :meth:`stream`, which yields each expert
    projection's float ``weight`` once its last piece has come (int4 experts held packed: its
    packed ``weight``, ``weight_scale`` and ``weight_zeros``); counts what that cost."""

    qcfg: QuantConfig
    dtype: torch.dtype
    device: torch.device
    held: frozenset[int] = frozenset()  # decoder layers whose experts are held quantized
    mla: bool = False  # DeepSeek's latent attention: its projections but o_proj dequantized too
    projections: int = 0
    attention: int = 0  # of which the latent attention's  # expert projections dequantized
    stored_bytes: int = 0  # their quantized pieces' bytes in the checkpoint
    float_bytes: int = 0  # their float weights' bytes as served
    packed: int = 0  # int4 expert projections converted to the packed layout (held int4)
    _pending: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    # act-order: an expert's gate (or up) permutation until the other's comes to compare
    _perms: dict[str, torch.Tensor] = field(default_factory=dict)

    def stream(
        self, weights: Iterator[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        wanted = expert_pieces(self.qcfg)
        for name, tensor in weights:
            match = _PIECE.match(name)
            held = match is not None and self._held(name)
            if held and not self.qcfg.is_int4:  # FP8 experts held in FP8: as read
                match = None
            if match is None and self.mla:
                match = _MLA_PIECE.match(name)
            if match is None or not self._quantized(match.group(2), tensor):
                yield name, tensor
                continue
            module, piece = match.groups()
            if piece not in wanted:
                # GPTQ without act-order: the trivial order; compressed-tensors' weight_shape
                # (the packed words' shape gives it) and a symmetric layer's zero points (8)
                if piece in ("g_idx", "weight_g_idx", "weight_shape", "weight_zero_point"):
                    continue
                raise ConfigError(
                    f"checkpoint tensor {name!r} is not a piece of a {self.qcfg.method} expert "
                    f"(expected {', '.join(wanted)})"
                )
            pieces = self._pending.setdefault(module, {})
            pieces[piece] = tensor
            if len(pieces) == len(wanted):
                del self._pending[module]
                if held:
                    yield from self._pack(module, pieces)
                else:
                    yield f"{module}.weight", self._dequantize(module, pieces)
        if self._pending:
            module, pieces = next(iter(self._pending.items()))
            missing = [f"{module}.{p}" for p in wanted if p not in pieces]
            raise ConfigError(f"quantized expert weights missing from the checkpoint: {missing}")

    def _held(self, name: str) -> bool:
        layer = _LAYER.search(name)
        return layer is not None and int(layer.group(1)) in self.held

    def _quantized(self, piece: str, tensor: torch.Tensor) -> bool:
        """A ``weight`` is a quantized piece only as fp8 (an expert stored unquantized keeps
        its float one); the other pieces always are."""
        return piece != "weight" or tensor.dtype == torch.float8_e4m3fn

    def _pack(
        self, module: str, pieces: dict[str, torch.Tensor]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        on_device = {p: t.to(self.device) for p, t in pieces.items()}
        try:
            *packed, perm = pack_expert(self.qcfg, on_device)
        except (RuntimeError, IndexError, KeyError, ValueError) as e:
            shapes = {p: tuple(t.shape) for p, t in pieces.items()}
            raise ConfigError(f"{module}: quantized pieces {shapes} do not fit: {e}") from None
        self.packed += 1
        for piece, tensor in zip(("weight", "weight_scale", "weight_zeros"), packed, strict=True):
            yield f"{module}.{piece}", tensor
        if perm is not None:
            self._same_input(module, perm)
            yield f"{module}.weight_perm", perm

    def _same_input(self, module: str, perm: torch.Tensor) -> None:
        """ConfigError unless an expert's gate and up projections (stacked into one, which
        reads its input through one permutation) come with the same act-order ``g_idx``."""
        gate_up = _GATE_UP.search(module)
        if gate_up is None:
            return
        key = module[: gate_up.start()]
        other = self._perms.pop(key, None)
        if other is None:
            self._perms[key] = perm
        elif not torch.equal(other, perm):
            raise ConfigError(
                f"{key}: the gate and up projections' act-order g_idx differ; they read the same "
                "input and are served as one layer, through one permutation: not supported"
            )

    def _dequantize(self, module: str, pieces: dict[str, torch.Tensor]) -> torch.Tensor:
        on_device = {p: t.to(self.device) for p, t in pieces.items()}
        try:
            weight = dequantize(self.qcfg, on_device).to(self.dtype).contiguous()
        except (RuntimeError, IndexError, KeyError) as e:  # shapes that do not fit each other
            shapes = {p: tuple(t.shape) for p, t in pieces.items()}
            raise ConfigError(f"{module}: quantized pieces {shapes} do not fit: {e}") from None
        self.projections += 1
        self.attention += ".self_attn." in module
        self.stored_bytes += sum(t.numel() * t.element_size() for t in pieces.values())
        self.float_bytes += weight.numel() * weight.element_size()
        return weight

    def describe(self) -> str:
        """The start-up line on the experts dequantized here."""
        dtype = str(self.dtype).removeprefix("torch.")
        if self.qcfg.is_int4:
            why = (
                "an expert of their layer stored unquantized, or a group size that does not "
                "divide their widths"
            )
        else:
            why = "no FP8 on this GPU, or an expert of their layer stored unquantized"
        experts = self.projections - self.attention
        what = f"the experts' {experts} {self.qcfg.method} projections were"
        if self.attention:  # the latent attention's, whatever the experts are held as
            why = "the latent attention reads float weights" + (f"; {why}" if experts else "")
            what = (
                f"the latent attention's {self.attention} (q, kv_a, kv_b) "
                + (f"and the experts' {experts} " if experts else "")
                + f"{self.qcfg.method} projections were"
            )
        return (
            f"quantization: {what} dequantized to {dtype} as they loaded ({why}): "
            f"{_size(self.float_bytes)} instead of the checkpoint's {_size(self.stored_bytes)}; "
            "the router stays as stored"
        )


def describe_held(
    experts: list[Experts], dtype: torch.dtype, qcfg: QuantConfig | None = None
) -> str | None:
    """The start-up line on the experts held in FP8 or int4: their format and memory (None:
    none)."""
    packed = [e for e in experts if e.int4]
    if packed:
        method = qcfg.method if qcfg is not None else "int4"
        group = packed[0].int4_group
        size = torch.tensor([], dtype=dtype).element_size()
        as_float = sum((e.gate_up_proj.numel() + e.down_proj.numel()) * 8 * size for e in packed)
        shuffled = any(
            e.gate_up_proj_perm is not None or e.intermediate_order is not None for e in packed
        )
        order = (
            "; act-order: each expert's columns sorted by group, x read through its "
            "permutation, down_proj's folded into gate_up_proj's rows"
            if shuffled
            else ""
        )
        return (
            f"quantization: the experts of {len(packed)} layers held as {method} int4, packed "
            f"(groups of {group or 'a whole row'}, float32 scales and uint8 zeros{order}; the "
            f"fused MoE kernels dequantize them in their tiles): "
            f"{_size(sum(e.memory() for e in packed))}, {_size(as_float)} in "
            f"{str(dtype).removeprefix('torch.')}"
        )
    held = [e for e in experts if e.fp8]
    if not held:
        return None
    block = held[0].fp8_block
    scales = f"{block[0]}x{block[1]} block scales" if block else "per-channel scales"
    size = torch.tensor([], dtype=dtype).element_size()
    as_float = sum((e.gate_up_proj.numel() + e.down_proj.numel()) * size for e in held)
    return (
        f"quantization: the experts of {len(held)} layers held as fp8 e4m3 with {scales} "
        f"(the fused MoE kernel dequantizes them in its tiles): "
        f"{_size(sum(e.memory() for e in held))}, {_size(as_float)} in "
        f"{str(dtype).removeprefix('torch.')}"
    )


def _size(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.1f} MiB"
