"""The sparse MLP of Mixture-of-Experts models (Qwen3-MoE, Mixtral, Qwen2-MoE with its gated
shared expert, gpt-oss with its biases and clamped SwiGLU, OLMoE, Granite MoE with its ungated
shared MLP, ERNIE 4.5 MoE with its correction bias and ungated shared experts) in plain PyTorch.

A router picks ``top_k`` experts per token; the experts' gated MLPs run as one fused op
(``kernels.ops.fused_moe``) over weights stacked per expert: the loader stacks the checkpoint's
per-expert tensors into them (``services.engine.loader``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from kernels import ops
from kernels.moe import ClampedSwiGLU, Fp8Scales, Int4Scales, fp8_scale_shapes, int4_scale_shapes
from services.engine.model_config import MoeConfig


class Experts(nn.Module):
    """Every expert's weights stacked: float, or FP8 (e4m3) with their scales once
    :meth:`hold_fp8` has run (a quantized checkpoint's, or ``--quantization fp8``'s), which then
    travel with ``gate_up_proj`` (its ``fp8_scales``) to ``ops.fused_moe``; or packed int4 with
    their groups' scales and zeros once :meth:`hold_int4` has run (an AWQ, GPTQ or
    compressed-tensors checkpoint's, attached as ``int4_scales``; an act-order one's with each
    expert's permutation of its input columns)."""

    gate_up_proj_scale: nn.Parameter | None  # FP8: kernels.moe.Fp8Scales' w13_scale, w2_scale
    down_proj_scale: nn.Parameter | None  # (int4: Int4Scales' w13_scale, w2_scale)
    gate_up_proj_zeros: nn.Parameter | None  # int4: Int4Scales' w13_zeros, w2_zeros (uint8)
    down_proj_zeros: nn.Parameter | None
    # act-order int4: Int4Scales' w13_perm [E, H], w2_perm [E, I] (int32; None: groups in order)
    gate_up_proj_perm: nn.Parameter | None
    down_proj_perm: nn.Parameter | None

    def __init__(self, num_experts: int, hidden: int, inter: int, biases: bool = False) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden))  # [E, 2I, H]
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, inter))  # [E, H, I]
        self.gate_up_proj_bias: nn.Parameter | None = None  # [E, 2I]: gate half, then up half
        self.down_proj_bias: nn.Parameter | None = None  # [E, H]
        if biases:
            self.gate_up_proj_bias = nn.Parameter(torch.empty(num_experts, 2 * inter))
            self.down_proj_bias = nn.Parameter(torch.empty(num_experts, hidden))
        self.gate_up_proj_scale = self.down_proj_scale = None
        self.gate_up_proj_zeros = self.down_proj_zeros = None
        self.gate_up_proj_perm = self.down_proj_perm = None
        # act-order int4 with down_proj's permutation folded into gate_up_proj's rows (see
        # finish_loading): intermediate column i is the checkpoint's column order[e, i]
        self.register_buffer("intermediate_order", None, persistent=False)
        self.fp8_block: tuple[int, int] | None = None  # (block_n, block_k); None: per channel
        self.fp8 = False
        self.int4_group: int | None = None  # int4's group size (None: one group a row)
        self.int4 = False

    def hold_fp8(
        self, block: tuple[int, int] | None, weights: tuple[torch.Tensor, torch.Tensor] | None = None,
        scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:  # fmt: skip
        """Hold the weights as e4m3 with ``block`` scales (None: per output channel): empty
        ones of the right shapes (on this module's device) for a checkpoint to fill, or the
        given ``weights`` and ``scales``."""
        e, two_i, h = self.gate_up_proj.shape
        dev = self.gate_up_proj.device
        if weights is None or scales is None:
            s13, s2 = fp8_scale_shapes(e, h, two_i // 2, block)
            weights = (
                torch.empty((e, two_i, h), dtype=torch.float8_e4m3fn, device=dev),
                torch.empty((e, h, two_i // 2), dtype=torch.float8_e4m3fn, device=dev),
            )
            scales = (torch.empty(s13, device=dev), torch.empty(s2, device=dev))
        self.gate_up_proj = nn.Parameter(weights[0], requires_grad=False)
        self.down_proj = nn.Parameter(weights[1], requires_grad=False)
        self.gate_up_proj_scale = nn.Parameter(scales[0].float(), requires_grad=False)
        self.down_proj_scale = nn.Parameter(scales[1].float(), requires_grad=False)
        self.fp8_block, self.fp8 = block, True
        self._attach()

    def hold_int4(
        self, group_size: int | None, weights: tuple[torch.Tensor, torch.Tensor] | None = None,
        scales: tuple[torch.Tensor, torch.Tensor] | None = None,
        zeros: tuple[torch.Tensor, torch.Tensor] | None = None, act_order: bool = False,
    ) -> None:  # fmt: skip
        """Hold the weights as packed int4 (``kernels.moe.Int4Scales``: [E, N, K / 8] int32,
        float32 scales and uint8 zeros [E, N, K / G]) in groups of ``group_size`` input
        features (None: one a row): empty ones (on this module's device) for a checkpoint to
        fill, or the given ``weights``, ``scales`` and ``zeros``. ``act_order``: with each
        expert's permutation of its input columns, [E, H] and [E, I] int32, for the checkpoint
        to fill (its columns sorted by group at load: ``quantization.experts.pack_expert``);
        :meth:`finish_loading` drops those that keep the input's order."""
        e, two_i, h = self.gate_up_proj.shape
        inter = two_i // 2
        dev = self.gate_up_proj.device
        if act_order:
            for name, k in (("gate_up_proj_perm", h), ("down_proj_perm", inter)):
                perm = torch.empty((e, k), dtype=torch.int32, device=dev)
                setattr(self, name, nn.Parameter(perm, requires_grad=False))
        if weights is None or scales is None or zeros is None:
            s13, s2 = int4_scale_shapes(e, h, inter, group_size)
            weights = (
                torch.empty((e, two_i, h // 8), dtype=torch.int32, device=dev),
                torch.empty((e, h, inter // 8), dtype=torch.int32, device=dev),
            )
            scales = (torch.empty(s13, device=dev), torch.empty(s2, device=dev))
            zeros = (
                torch.empty(s13, dtype=torch.uint8, device=dev),
                torch.empty(s2, dtype=torch.uint8, device=dev),
            )
        self.gate_up_proj = nn.Parameter(weights[0], requires_grad=False)
        self.down_proj = nn.Parameter(weights[1], requires_grad=False)
        self.gate_up_proj_scale = nn.Parameter(scales[0].float(), requires_grad=False)
        self.down_proj_scale = nn.Parameter(scales[1].float(), requires_grad=False)
        self.gate_up_proj_zeros = nn.Parameter(zeros[0], requires_grad=False)
        self.down_proj_zeros = nn.Parameter(zeros[1], requires_grad=False)
        self.int4_group, self.int4 = group_size, True
        self._attach()

    def _attach(self) -> None:
        """The scales onto ``gate_up_proj``, where ``ops.fused_moe`` finds them (DeepSeek's MoE
        block passes only the weights)."""
        if self.fp8 and self.gate_up_proj_scale is not None and self.down_proj_scale is not None:
            scales = Fp8Scales(self.gate_up_proj_scale, self.down_proj_scale, self.fp8_block)
            self.gate_up_proj.fp8_scales = scales  # type: ignore[attr-defined]
        held = (self.gate_up_proj_scale, self.gate_up_proj_zeros, self.down_proj_scale,
                self.down_proj_zeros)  # fmt: skip
        if self.int4 and all(t is not None for t in held):
            groups = Int4Scales(
                *held,  # type: ignore[arg-type]
                group_size=self.int4_group,
                w13_perm=self.gate_up_proj_perm,
                w2_perm=self.down_proj_perm,
            )
            self.gate_up_proj.int4_scales = groups  # type: ignore[attr-defined]

    def finish_loading(self) -> None:
        """Once the weights are in (or drawn): drop an act-order permutation that keeps every
        expert's input order (a checkpoint whose g_idx happen to be in order), and fold
        down_proj's into gate_up_proj, so that only x is read through a permutation.

        down_proj's input is the intermediate, which gate_up_proj's rows make: reordering an
        expert's gate and up rows (their scales, zeros and biases with them) by down_proj's
        permutation ``p`` makes intermediate column ``i`` the checkpoint's column ``p[i]``,
        the order down_proj's group-sorted columns read, so the down kernel reads its input
        as it is (on an H200, Qwen3-30B-A3B's layer in groups of 128 read both through a
        permutation 1.6x slower than in order: docs/benchmarks.md, session 24). The fold is
        exact (a permutation of whole rows) and kept in ``intermediate_order`` for whoever
        reads the weights back. Reads the permutations back from the device, once."""
        for name in ("gate_up_proj_perm", "down_proj_perm"):
            perm = getattr(self, name)
            if perm is None:
                continue
            order = torch.arange(perm.shape[1], dtype=perm.dtype, device=perm.device)
            if torch.equal(perm, order.expand_as(perm)):
                setattr(self, name, None)
        if self.down_proj_perm is not None:
            order = self.down_proj_perm.data
            rows = torch.cat((order, order + order.shape[1]), dim=1).long()  # [E, 2I]
            for name in ("gate_up_proj", "gate_up_proj_scale", "gate_up_proj_zeros",
                         "gate_up_proj_bias"):  # fmt: skip
                t = getattr(self, name, None)
                if t is not None:
                    index = rows.view(*rows.shape, *([1] * (t.dim() - 2))).expand_as(t)
                    t.data = torch.gather(t.data, 1, index)
            self.intermediate_order = order
            self.down_proj_perm = None
        self._attach()

    def _apply(self, fn: Any, recurse: bool = True) -> Experts:
        """As nn.Module's, but FP8 and int4 weights and their float32 scales keep their dtypes
        (a cast of the model to its dtype moves them, never converts them)."""
        if self.fp8 or self.int4:
            fn = _moving_only(fn)
        super()._apply(fn, recurse)
        self._attach()
        return self

    def memory(self) -> int:
        """Bytes of the weights, scales, zeros and act-order permutations (not the biases)."""
        held = (self.gate_up_proj, self.down_proj, self.gate_up_proj_scale, self.down_proj_scale,
                self.gate_up_proj_zeros, self.down_proj_zeros, self.gate_up_proj_perm,
                self.down_proj_perm, self.intermediate_order)  # fmt: skip
        return sum(t.numel() * t.element_size() for t in held if t is not None)


def _moving_only(fn: Any) -> Any:
    """``fn`` (an ``nn.Module._apply`` conversion) without its change of dtype."""

    def move(t: torch.Tensor) -> torch.Tensor:
        out = fn(t)
        return out if out.dtype == t.dtype else t.to(out.device)

    return move


class SharedExpert(nn.Module):
    """Qwen2-MoE's (and Granite MoE's) shared expert: a SiLU-gated MLP every token goes through
    (the checkpoint's gate and up projections stacked into one, as the dense MLP's)."""

    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden, 2 * inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        return _project(self.down_proj, ops.silu_and_mul(_project(self.gate_up_proj, x)))


def _project(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A plain linear layer through ``ops.linear``; one swapped from outside (a quantized
    checkpoint's) through its own forward."""
    if type(layer) is nn.Linear:
        return ops.linear(x, layer.weight)
    return layer(x)


class SparseMoeBlock(nn.Module):
    def __init__(self, moe: MoeConfig, hidden: int) -> None:
        super().__init__()
        self.moe = moe
        self.gate = nn.Linear(hidden, moe.num_experts, bias=moe.biases)  # the router
        self.experts = Experts(moe.num_experts, hidden, moe.intermediate_size, moe.biases)
        self.clamp = ClampedSwiGLU(moe.swiglu_alpha, moe.swiglu_limit) if moe.swiglu_limit else None
        self.shared_expert: SharedExpert | None = None
        self.shared_expert_gate: nn.Linear | None = None
        if moe.shared_intermediate_size:
            self.shared_expert = SharedExpert(hidden, moe.shared_intermediate_size)
        if moe.shared_intermediate_size and moe.shared_gate:
            self.shared_expert_gate = nn.Linear(hidden, 1, bias=False)
        # ERNIE 4.5's moe_statics: added to the probabilities to choose, not to the weights
        self.e_score_correction_bias: nn.Parameter | None = None
        if moe.correction_bias:
            self.e_score_correction_bias = nn.Parameter(torch.zeros(moe.num_experts))  # [E]

    def _apply(self, fn: Any, recurse: bool = True) -> SparseMoeBlock:
        """As nn.Module's; a float32 router (``MoeConfig.router_fp32``) stays float32 whatever
        dtype the model is cast to, as transformers keeps ERNIE 4.5's."""
        super()._apply(fn, recurse)
        if self.moe.router_fp32:
            for p in (self.gate.weight, self.e_score_correction_bias):
                if p is not None:
                    p.data = p.data.float()
        return self

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # [T, k] each
        """The router's weights (float32) and experts for each token."""
        if self.moe.router_fp32:  # ERNIE 4.5: logits of the float32 input and weight
            logits = ops.linear(x.float(), self.gate.weight.float())  # [T, E]
        else:
            logits = ops.linear(x, self.gate.weight, self.gate.bias)  # [T, E]
        bias = self.e_score_correction_bias
        if bias is None:
            return ops.moe_routing(logits, self.moe.top_k, self.moe.renormalize)
        return ops.grouped_topk(
            logits, self.moe.top_k, correction_bias=bias, renormalize=self.moe.renormalize
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        weights, ids = self.route(x)  # [T, k]
        if self.moe.weights_in_model_dtype:
            weights = weights.to(x.dtype)
        experts = self.experts
        out = ops.fused_moe(
            x,
            experts.gate_up_proj,
            experts.down_proj,
            weights,
            ids,
            b13=experts.gate_up_proj_bias,
            b2=experts.down_proj_bias,
            clamp=self.clamp,
        )  # fmt: skip (FP8 and int4 experts' scales travel with gate_up_proj: Experts.hold_*)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            # as transformers: sigmoid(gate(x)) * shared(x), then added, each in x's dtype
            gate = torch.sigmoid(ops.linear(x, self.shared_expert_gate.weight))  # [T, 1]
            out = out + gate * self.shared_expert(x)
        elif self.shared_expert is not None:  # Granite MoE's and ERNIE 4.5's: added as it is
            out = out + self.shared_expert(x)
        return out
