"""The MoE references against transformers' own MoE blocks: routing and experts, bit for bit in
float32 and bfloat16 (the rounding ``kernels.moe`` documents is transformers')."""

from __future__ import annotations

import pytest
import torch

from kernels.moe import ref_fused_moe, ref_moe_routing, sum_contributions


def _qwen3_block(renormalize: bool) -> torch.nn.Module:
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    cfg = Qwen3MoeConfig(hidden_size=64, moe_intermediate_size=40, num_experts=8,
                         num_experts_per_tok=3, norm_topk_prob=renormalize)  # fmt: skip
    cfg._experts_implementation = "eager"
    return Qwen3MoeSparseMoeBlock(cfg)


def _mixtral_block() -> torch.nn.Module:
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    cfg = MixtralConfig(hidden_size=64, intermediate_size=40, num_local_experts=8,
                        num_experts_per_tok=2)  # fmt: skip
    cfg._experts_implementation = "eager"
    return MixtralSparseMoeBlock(cfg)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("arch", "renormalize"), [("qwen3_moe", False), ("qwen3_moe", True), ("mixtral", True)]
)
def test_equals_transformers_sparse_block(arch: str, renormalize: bool, dtype: torch.dtype, gen: torch.Generator) -> None:  # fmt: skip
    block = _qwen3_block(renormalize) if arch == "qwen3_moe" else _mixtral_block()
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    block = block.to(dtype).eval()
    x = torch.randn((23, 64), generator=gen).to(dtype)
    with torch.no_grad():
        want = block(x[None])[0]
        logits = torch.nn.functional.linear(x, block.gate.weight)
        weights, ids = ref_moe_routing(logits, block.gate.top_k, renormalize)
        if arch == "qwen3_moe":  # Qwen3-MoE rounds the router weights to the model dtype
            weights = weights.to(dtype)
        experts = block.experts
        got = ref_fused_moe(x, experts.gate_up_proj, experts.down_proj, weights, ids)
    assert torch.equal(got, want)


def test_routing_is_a_softmax_over_the_top_k_logits_when_renormalized() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]])
    weights, ids = ref_moe_routing(logits, 2, renormalize=True)
    assert ids.tolist() == [[1, 3]]
    torch.testing.assert_close(weights, torch.softmax(torch.tensor([[3.0, 2.0]]), -1))
    raw, _ = ref_moe_routing(logits, 2, renormalize=False)
    torch.testing.assert_close(raw, torch.softmax(logits, -1)[:, [1, 3]])


def test_contributions_are_added_in_order_each_sum_rounded() -> None:
    c = torch.tensor([[[1.0], [2**-8], [2**-8]]], dtype=torch.bfloat16)  # 1 + 2^-8 rounds to 1
    assert sum_contributions(c).item() == 1.0
    assert sum_contributions(c.float()).item() == 1.0 + 2**-7
