"""The sparse MLP block's router: ERNIE 4.5 MoE's stays in float32 in a 16-bit model, as
transformers keeps it, and chooses as transformers' router does (the correction bias choosing,
the unbiased probabilities weighing)."""

from __future__ import annotations

import torch

from services.engine.model_config import MoeConfig
from services.engine.models.moe import SparseMoeBlock

HIDDEN = 32


def _moe(**extra: object) -> MoeConfig:
    fields = {"num_experts": 8, "top_k": 2, "intermediate_size": 16, "renormalize": True,
              "layers": (0,), "weights_in_model_dtype": True, **extra}  # fmt: skip
    return MoeConfig(**fields)  # type: ignore[arg-type]


def test_a_float32_router_stays_float32_in_a_bfloat16_model() -> None:
    block = SparseMoeBlock(_moe(correction_bias=True, router_fp32=True), HIDDEN)
    block = block.to(torch.bfloat16)
    assert block.gate.weight.dtype == torch.float32
    assert block.e_score_correction_bias is not None
    assert block.e_score_correction_bias.dtype == torch.float32
    assert block.experts.gate_up_proj.dtype == torch.bfloat16
    plain = SparseMoeBlock(_moe(), HIDDEN).to(torch.bfloat16)
    assert plain.gate.weight.dtype == torch.bfloat16


def test_ernie_routing_in_bfloat16_is_transformers() -> None:
    from transformers import Ernie4_5_MoeConfig
    from transformers.models.ernie4_5_moe.modeling_ernie4_5_moe import Ernie4_5_MoeTopKRouter

    cfg = Ernie4_5_MoeConfig(hidden_size=HIDDEN, moe_num_experts=8, moe_k=2)
    theirs = Ernie4_5_MoeTopKRouter(cfg)  # its weight and bias float32, as from_pretrained
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        theirs.weight.copy_(torch.randn(8, HIDDEN, generator=gen) * 0.5)
        bias = torch.randn(1, 8, generator=gen) * 0.1
        theirs.moe_statics.e_score_correction_bias.copy_(bias)
    block = SparseMoeBlock(_moe(correction_bias=True, router_fp32=True), HIDDEN)
    block = block.to(torch.bfloat16)
    assert block.e_score_correction_bias is not None
    with torch.no_grad():
        block.gate.weight.copy_(theirs.weight)
        block.e_score_correction_bias.copy_(bias[0])
    x = torch.randn(64, HIDDEN, generator=gen).to(torch.bfloat16)
    _, want_weights, want_ids = theirs(x)
    weights, ids = block.route(x)
    order, want_order = ids.sort(dim=-1).indices, want_ids.sort(dim=-1).indices
    assert torch.equal(ids.gather(-1, order), want_ids.gather(-1, want_order))
    got = weights.gather(-1, order).to(torch.bfloat16)
    assert torch.equal(got, want_weights.gather(-1, want_order))
