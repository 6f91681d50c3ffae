"""The MoE references against transformers' own MoE blocks: routing and experts, bit for bit in
float32 and bfloat16 (the rounding ``kernels.moe`` documents is transformers'); gpt-oss's experts
(biases, clamped SwiGLU) in float32."""

from __future__ import annotations

import pytest
import torch

from kernels.moe import ClampedSwiGLU, ref_fused_moe, ref_moe_routing, sum_contributions


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


def _gpt_oss_experts() -> torch.nn.Module:
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    cfg = GptOssConfig(hidden_size=64, intermediate_size=40, num_local_experts=8,
                       num_experts_per_tok=4)  # fmt: skip
    cfg._experts_implementation = "eager"
    return GptOssExperts(cfg)


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


def test_gpt_oss_experts_equal_transformers(gen: torch.Generator) -> None:
    """Biases and the clamped SwiGLU against ``GptOssExperts`` in float32: its interleaved gate/up
    columns ([E, H, 2I], gate at even columns) de-interleaved into the stacked [E, 2I, H]
    layout, weights large enough that the clamp bites (gate above the limit, up past both)."""
    experts = _gpt_oss_experts()
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    x = torch.randn((23, 64), generator=gen)
    weights, ids = ref_moe_routing(torch.randn((23, 8), generator=gen), 4, True)
    gate_up, gate_up_bias = experts.gate_up_proj.detach(), experts.gate_up_proj_bias.detach()
    w13 = torch.cat([gate_up[..., ::2], gate_up[..., 1::2]], -1).transpose(1, 2)  # [E, 2I, H]
    b13 = torch.cat([gate_up_bias[:, ::2], gate_up_bias[:, 1::2]], -1)  # [E, 2I]
    w2 = experts.down_proj.detach().transpose(1, 2).contiguous()  # [E, H, I]
    clamp = ClampedSwiGLU(experts.alpha, experts.limit)
    with torch.no_grad():
        want = experts(x, ids, weights)
        got = ref_fused_moe(x, w13, w2, weights, ids, b13=b13,
                            b2=experts.down_proj_bias.detach(), clamp=clamp)  # fmt: skip
    routed = torch.einsum("th,tkhn->tkn", x, gate_up[ids]) + gate_up_bias[ids]  # [T, k, 2I]
    gate, up = routed[..., ::2], routed[..., 1::2]
    assert (gate > 7).any() and (gate < -7).any() and (up > 7).any() and (up < -7).any()
    assert (routed.abs() < 7).float().mean() > 0.5  # most values pass the clamp untouched
    scale = want.abs().max()
    torch.testing.assert_close(got / scale, want / scale, rtol=1e-6, atol=1e-6)


def test_bias_errors_name_the_argument() -> None:
    x, w13, w2 = torch.zeros(3, 8), torch.zeros(4, 10, 8), torch.zeros(4, 8, 5)
    weights, ids = torch.ones(3, 2), torch.zeros((3, 2), dtype=torch.int64)
    b13, b2 = torch.zeros(4, 10), torch.zeros(4, 8)
    for bad, match in (({"b13": b13[:, :5]}, "b13"), ({"b2": b2[:3]}, "b2"),
                       ({"b13": b13.double()}, "b13"), ({"b2": b2.T}, "b2")):  # fmt: skip
        with pytest.raises(ValueError, match=match):
            ref_fused_moe(x, w13, w2, weights, ids, **{"b13": b13, "b2": b2, **bad})
    assert ref_fused_moe(x, w13, w2, weights, ids, b13=b13, b2=b2).shape == (3, 8)


def _deepseek_router(version: int, **cfg: object) -> torch.nn.Module:
    if version == 2:
        from transformers import DeepseekV2Config
        from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter

        return DeepseekV2TopkRouter(DeepseekV2Config(hidden_size=64, **cfg))
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    return DeepseekV3TopkRouter(DeepseekV3Config(hidden_size=64, **cfg))


@pytest.mark.parametrize(
    ("version", "cfg"),
    [
        (2, {"topk_method": "greedy", "routed_scaling_factor": 1.0}),
        (2, {"topk_method": "greedy", "routed_scaling_factor": 16.0}),
        (2, {"topk_method": "group_limited_greedy", "n_group": 4, "topk_group": 2,
             "routed_scaling_factor": 2.5}),
        (3, {"n_group": 4, "topk_group": 2, "norm_topk_prob": True, "routed_scaling_factor": 2.5}),
        (3, {"n_group": 4, "topk_group": 1, "norm_topk_prob": False}),
        (3, {"n_group": 1, "topk_group": 1, "norm_topk_prob": True}),  # Kimi-K2's: one group
    ],
)  # fmt: skip
def test_grouped_routing_equals_transformers_deepseek_routers(
    version: int, cfg: dict[str, object], gen: torch.Generator
) -> None:
    """DeepSeek-V2's (softmax; greedy or the best groups by their best expert) and V3's
    (sigmoid plus the correction bias to choose, groups by their two best, renormalized or not)
    routers: the same experts and weights as transformers', bit for bit (float32)."""
    from kernels.moe import ref_grouped_topk

    router = _deepseek_router(version, n_routed_experts=16, num_experts_per_tok=4, **cfg)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=gen))
        if version == 3:  # large enough to change which experts win
            router.e_score_correction_bias.copy_(torch.randn(16, generator=gen) * 0.3)
        x = torch.randn((37, 64), generator=gen)
        logits, want_w, want_ids = router(x)
    grouped = cfg.get("topk_method") != "greedy"
    got_w, got_ids = ref_grouped_topk(
        logits, 4, sigmoid=version == 3,
        correction_bias=router.e_score_correction_bias if version == 3 else None,
        num_groups=int(cfg.get("n_group") or 1) if grouped else 1,
        topk_groups=int(cfg.get("topk_group") or 1) if grouped else 1,
        renormalize=version == 3 and bool(cfg.get("norm_topk_prob")),
        scaling=float(cfg.get("routed_scaling_factor", 2.5 if version == 3 else 1.0)),  # type: ignore[arg-type]
    )  # fmt: skip
    order, want_order = got_ids.sort(dim=-1), want_ids.sort(dim=-1)
    assert torch.equal(order.values, want_order.values)
    assert torch.equal(got_w.gather(1, order.indices), want_w.gather(1, want_order.indices))


def test_grouped_routing_keeps_to_the_best_groups() -> None:
    """With one group of four kept, every chosen expert lies in the group whose best (V2) or
    two best (V3) scores rank first, though a lone higher score sits in another group."""
    from kernels.moe import ref_grouped_topk

    logits = torch.tensor([[0.0, 0.0, 0.0, 5.0, 3.0, 3.0, 3.0, 0.0]])  # groups of 4
    v2 = ref_grouped_topk(logits, 2, num_groups=2, topk_groups=1)[1]
    assert 3 in v2[0].tolist() and all(i < 4 for i in v2[0].tolist())  # 5 beats 3
    v3 = ref_grouped_topk(logits, 2, sigmoid=True, num_groups=2, topk_groups=1)[1]
    assert all(4 <= i < 8 for i in v3[0].tolist())  # 3 + 3 beats 5 + 0
