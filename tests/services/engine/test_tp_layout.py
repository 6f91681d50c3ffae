"""Which heads, MLP rows and vocabulary rows each tensor-parallel rank holds."""

from __future__ import annotations

from dataclasses import replace

import pytest

from services.config import ConfigError
from services.engine.model_config import ArchConfig, MoeConfig
from services.engine.quantization.config import QuantConfig
from services.engine.tp_layout import CheckpointSlice, TPLayout, split

# SmolLM2-135M's shapes
ARCH = ArchConfig(
    model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
    num_layers=2, num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5,
    rope_theta=1e4,
)  # fmt: skip


def _layouts(arch: ArchConfig, size: int) -> list[TPLayout]:
    return [TPLayout.of(arch, rank, size) for rank in range(size)]


def test_split_covers_everything_once_longer_runs_first() -> None:
    assert [split(10, 4, i) for i in range(4)] == [(0, 3), (3, 6), (6, 8), (8, 10)]
    assert [split(8, 4, i) for i in range(4)] == [(0, 2), (2, 4), (4, 6), (6, 8)]


def test_uneven_kv_heads_go_with_their_query_groups() -> None:
    """SmolLM2's 3 KV heads over 2 ranks: 2 + 1, each with its 3 query heads."""
    a, b = _layouts(ARCH, 2)
    assert (a.kv_heads, a.q_heads) == ((0, 2), (0, 6))
    assert (b.kv_heads, b.q_heads) == ((2, 3), (6, 9))
    assert a.local_arch(ARCH).num_heads == 6 and b.local_arch(ARCH).num_kv_heads == 1


def test_fewer_kv_heads_than_ranks_replicates_them() -> None:
    arch = replace(ARCH, num_heads=8, num_kv_heads=2)
    layouts = _layouts(arch, 4)
    assert [t.kv_heads for t in layouts] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert [t.q_heads for t in layouts] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert {t.local_arch(arch).num_kv_heads for t in layouts} == {1}


@pytest.mark.parametrize(
    ("heads", "size", "needle"),
    [
        ((9, 3), 4, "cannot be split over 4 ranks"),  # KV heads replicated, query heads not
        ((8, 2), 3, "cannot be split over 3 ranks"),
        ((9, 2), 2, "not a multiple of 2 KV heads"),
    ],
)
def test_heads_that_cannot_be_split_are_refused(
    heads: tuple[int, int], size: int, needle: str
) -> None:
    arch = replace(ARCH, num_heads=heads[0], num_kv_heads=heads[1])
    with pytest.raises(ConfigError, match=needle) as err:
        TPLayout.of(arch, 0, size)
    assert f"--tensor-parallel-size {size}" in str(err.value)


def test_experts_keep_every_expert_with_a_share_of_its_rows() -> None:
    """Mixtral's and Qwen3-MoE's experts: gate and up cut along their rows, down along its
    columns, in each expert's checkpoint tensors and in our stacked parameters (dummy weights);
    the router is whole on every rank."""
    moe = MoeConfig(4, 2, 33, True, (0,), True)  # 33 rows: 17 + 16
    arch = replace(ARCH, moe=moe)
    a, b = _layouts(arch, 2)
    assert (a.moe_intermediate, b.moe_intermediate) == ((0, 17), (17, 33))
    assert b.local_arch(arch).moe == replace(moe, intermediate_size=16)
    for name, dim in [("model.layers.0.mlp.experts.3.gate_proj.weight", 0),
                      ("model.layers.0.mlp.experts.3.down_proj.weight", 1),
                      ("model.layers.1.block_sparse_moe.experts.0.w3.weight", 0),
                      ("model.layers.1.block_sparse_moe.experts.0.w2.weight", 1)]:  # fmt: skip
        assert b.checkpoint_slice(name) == CheckpointSlice(dim, 17, 33)
    assert b.checkpoint_slice("model.layers.0.mlp.gate.weight") is None
    assert b.param_slice("model.layers.0.mlp.experts.gate_up_proj", arch) == (
        1, 66, [(17, 33), (50, 66)]
    )  # fmt: skip
    assert b.param_slice("model.layers.0.mlp.experts.down_proj", arch) == (2, 33, [(17, 33)])
    with pytest.raises(ConfigError, match="experts' intermediate size 1 is too small"):
        TPLayout.of(replace(ARCH, moe=replace(moe, intermediate_size=1)), 0, 2)
    # a shared expert's rows split as an MLP's (48: 24 a rank), whatever its family's names
    shared = replace(ARCH, model_type="qwen2_moe", moe=replace(moe, shared_intermediate_size=48))
    s = TPLayout.of(shared, 1, 2)
    assert s.local_arch(shared).moe == replace(
        moe, intermediate_size=16, shared_intermediate_size=24
    )
    for name, cut in [
        ("model.layers.0.mlp.shared_expert.gate_proj.weight", CheckpointSlice(0, 24, 48)),
        ("model.layers.0.mlp.shared_expert.down_proj.weight", CheckpointSlice(1, 24, 48)),
        ("model.layers.0.mlp.shared_experts.up_proj.weight", CheckpointSlice(0, 24, 48)),
        ("model.layers.0.shared_mlp.input_linear.weight",
         CheckpointSlice(0, 0, 0, runs=((24, 48), (72, 96)))),
        ("model.layers.0.shared_mlp.output_linear.weight", CheckpointSlice(1, 24, 48)),
        ("model.layers.0.mlp.shared_expert_gate.weight", None),
    ]:  # fmt: skip
        assert s.checkpoint_slice(name) == cut, name
    assert s.param_slice("model.layers.0.mlp.shared_expert.gate_up_proj.weight", shared) == (
        0, 96, [(24, 48), (72, 96)]
    )  # fmt: skip
    assert s.param_slice("model.layers.0.mlp.shared_expert.down_proj.weight", shared) == (
        1, 48, [(24, 48)]
    )  # fmt: skip
    # quantized experts: a rank's rows land on the format's units, or the split is refused
    for quant in (QuantConfig("awq", group_size=16), QuantConfig("fp8", weight_block=(16, 16))):
        with pytest.raises(ConfigError, match=r"rank 0's experts' gate and up rows \[0, 17\)"):
            TPLayout.of(replace(ARCH, moe=moe), 0, 2, quant)
        assert TPLayout.of(replace(ARCH, moe=moe), 0, 1, quant) is not None
    assert TPLayout.of(replace(ARCH, moe=moe), 0, 2, QuantConfig("fp8", serialized=False))


def test_quantized_experts_are_cut_per_piece() -> None:
    """An AWQ or FP8-block expert's packed words, scales and zeros: a rank's gate/up rows and
    down input columns in each piece's own units (64 rows: 32 a rank)."""
    arch = replace(ARCH, moe=MoeConfig(4, 2, 64, True, (0,), True))
    awq = TPLayout.of(arch, 1, 2, QuantConfig("awq", group_size=16))
    gate, down = "model.layers.0.mlp.experts.3.gate_proj", "model.layers.0.mlp.experts.3.down_proj"
    assert awq.checkpoint_slice(f"{gate}.qweight") == CheckpointSlice(1, 4, 8)  # [K, N/8]
    assert awq.checkpoint_slice(f"{gate}.scales") == CheckpointSlice(1, 32, 64)  # [K/G, N]
    assert awq.checkpoint_slice(f"{down}.qweight") == CheckpointSlice(0, 32, 64)  # K rows
    assert awq.checkpoint_slice(f"{down}.qzeros") == CheckpointSlice(0, 2, 4)  # [K/G, N/8]
    fp8 = TPLayout.of(arch, 1, 2, QuantConfig("fp8", weight_block=(16, 16)))
    assert fp8.checkpoint_slice(f"{gate}.weight_scale_inv") == CheckpointSlice(0, 2, 4)
    assert fp8.checkpoint_slice(f"{down}.weight_scale_inv") == CheckpointSlice(1, 2, 4)
    assert fp8.checkpoint_slice(f"{down}.weight") == CheckpointSlice(1, 32, 64)


def test_fused_checkpoint_tensors_are_cut_per_piece() -> None:
    """Phi-3 stores q, k and v as one qkv_proj tensor and gate, up as one gate_up_proj: a
    rank's rows of each are one run per piece, at that piece's offset in the whole tensor."""
    arch = replace(ARCH, model_type="phi3")
    d, nq, nkv, inter = arch.head_dim, arch.num_heads, arch.num_kv_heads, arch.intermediate_size
    for rank in range(2):
        layout = TPLayout.of(arch, rank, 2)
        spans = layout.row_spans()
        (q0, q1), (k0, k1), (i0, i1) = spans["q"], spans["kv"], spans["mlp"]
        qkv = layout.checkpoint_slice("model.layers.3.self_attn.qkv_proj.weight")
        assert qkv is not None and qkv.dim == 0
        assert qkv.runs == ((q0, q1), (nq * d + k0, nq * d + k1),
                            ((nq + nkv) * d + k0, (nq + nkv) * d + k1))  # fmt: skip
        gate_up = layout.checkpoint_slice("model.layers.3.mlp.gate_up_proj.weight")
        assert gate_up is not None and gate_up.runs == ((i0, i1), (inter + i0, inter + i1))
    # each piece's rows once over the ranks
    rows = [r for rank in range(2) for a, b in TPLayout.of(arch, rank, 2).fused_runs("qkv_proj")
            for r in range(a, b)]  # fmt: skip
    assert sorted(rows) == list(range((nq + 2 * nkv) * d))


def test_act_order_checkpoints_are_refused() -> None:
    with pytest.raises(ConfigError, match="act-order"):
        TPLayout.of(ARCH, 0, 2, QuantConfig("gptq", desc_act=True))


@pytest.mark.parametrize(
    ("quant", "needle"),
    [
        # head_dim 32, 4 heads over 2 ranks: a rank's 64 query rows cut a 128-row block
        (QuantConfig("fp8", weight_block=(128, 128)), r"rank 0's q_proj rows \[0, 64\) .* 128 rows"),
        # MLP 208 rows: rank 0's down_proj columns end at 104, inside a 64-column group
        (QuantConfig("awq", group_size=64), r"rank 0's down_proj input columns \[0, 104\)"),
    ],
)  # fmt: skip
def test_quantized_cuts_off_their_units_are_refused(quant: QuantConfig, needle: str) -> None:
    arch = replace(ARCH, num_heads=4, num_kv_heads=2, head_dim=32, intermediate_size=208)
    with pytest.raises(ConfigError, match=needle):
        TPLayout.of(arch, 1, 2, quant)  # every rank is checked, whichever asks
    TPLayout.of(arch, 1, 2, QuantConfig("fp8", serialized=False))  # quantized per rank: no units


def test_quantized_pieces_are_cut_along_their_own_layout() -> None:
    """Rank 1 of SmolLM2's shape: q rows [384, 576), MLP rows [768, 1536)."""
    layer = "model.layers.0"
    fp8 = TPLayout.of(ARCH, 1, 2, QuantConfig("fp8", weight_block=(64, 128)))
    assert fp8.checkpoint_slice(f"{layer}.self_attn.q_proj.weight_scale_inv") == CheckpointSlice(
        0, 6, 9
    )
    assert fp8.checkpoint_slice(f"{layer}.mlp.down_proj.weight_scale_inv") == CheckpointSlice(
        1, 6, 12
    )
    channel = TPLayout.of(ARCH, 1, 2, QuantConfig("fp8"))
    assert channel.checkpoint_slice(
        f"{layer}.mlp.up_proj.weight_scale", (1536, 1)
    ) == CheckpointSlice(0, 768, 1536)
    assert channel.checkpoint_slice(f"{layer}.mlp.down_proj.weight_scale", (576, 1)) is None
    assert channel.checkpoint_slice(f"{layer}.mlp.up_proj.weight_scale", ()) is None  # per tensor
    awq = TPLayout.of(ARCH, 1, 2, QuantConfig("awq", group_size=64))
    assert awq.checkpoint_slice(f"{layer}.mlp.up_proj.qweight") == CheckpointSlice(1, 96, 192)
    assert awq.checkpoint_slice(f"{layer}.mlp.down_proj.qweight") == CheckpointSlice(0, 768, 1536)
    assert awq.checkpoint_slice(f"{layer}.mlp.down_proj.qzeros") == CheckpointSlice(0, 12, 24)
    assert awq.checkpoint_slice(f"{layer}.mlp.up_proj.scales") == CheckpointSlice(1, 768, 1536)
    gptq = TPLayout.of(ARCH, 1, 2, QuantConfig("gptq", group_size=64))
    assert gptq.checkpoint_slice(f"{layer}.mlp.down_proj.qweight") == CheckpointSlice(0, 96, 192)
    assert gptq.checkpoint_slice(f"{layer}.mlp.up_proj.qweight") == CheckpointSlice(1, 768, 1536)
    assert gptq.checkpoint_slice(f"{layer}.mlp.up_proj.qzeros") == CheckpointSlice(1, 96, 192)
    assert gptq.checkpoint_slice(f"{layer}.mlp.down_proj.g_idx") == CheckpointSlice(
        0, 0, 0, skip=True
    )


def test_vocabulary_shards_are_equal_the_last_one_padded() -> None:
    layouts = _layouts(replace(ARCH, vocab_size=10, num_heads=8, num_kv_heads=4), 4)
    assert [t.vocab for t in layouts] == [(0, 3), (3, 6), (6, 9), (9, 10)]
    assert {t.vocab_shard for t in layouts} == {3}
    assert layouts[3].checkpoint_slice("lm_head.weight") == CheckpointSlice(0, 9, 10, pad_to=3)


def test_checkpoint_slices_cut_rows_of_column_parallel_and_columns_of_row_parallel() -> None:
    b = TPLayout.of(ARCH, 1, 2)  # KV head 2, query heads 6..8; MLP rows 768..1535
    layer = "model.layers.3"
    assert b.checkpoint_slice(f"{layer}.self_attn.q_proj.weight") == CheckpointSlice(0, 384, 576)
    assert b.checkpoint_slice(f"{layer}.self_attn.k_proj.bias") == CheckpointSlice(0, 128, 192)
    assert b.checkpoint_slice(f"{layer}.self_attn.o_proj.weight") == CheckpointSlice(1, 384, 576)
    assert b.checkpoint_slice(f"{layer}.mlp.up_proj.weight") == CheckpointSlice(0, 768, 1536)
    assert b.checkpoint_slice(f"{layer}.mlp.down_proj.weight") == CheckpointSlice(1, 768, 1536)
    assert b.checkpoint_slice(f"{layer}.input_layernorm.weight") is None
    assert b.checkpoint_slice(f"{layer}.self_attn.q_norm.weight") is None


def test_fused_parameters_are_cut_per_piece() -> None:
    """Our qkv_proj and gate_up_proj stack pieces: a rank's rows are its part of each piece."""
    b = TPLayout.of(ARCH, 1, 2)
    qkv = b.param_slice("model.layers.0.self_attn.qkv_proj.weight", ARCH)
    assert qkv == (0, 960, [(384, 576), (576 + 128, 576 + 192), (768 + 128, 768 + 192)])
    gate_up = b.param_slice("model.layers.0.mlp.gate_up_proj.weight", ARCH)
    assert gate_up == (0, 3072, [(768, 1536), (2304, 3072)])
    assert b.param_slice("model.layers.0.mlp.down_proj.weight", ARCH) == (1, 1536, [(768, 1536)])
    assert b.param_slice("model.norm.weight", ARCH) is None


def test_the_latent_cache_is_whole_on_every_rank() -> None:
    """DeepSeek's MLA: the query heads split (3 over 2 ranks: 2 + 1, no multiple needed), the
    cache's one latent KV head held whole by every rank; a hand-off takes it from rank 0."""
    from services.engine.tp_kv import owned

    arch = ArchConfig.from_dict({
        "model_type": "deepseek_v3", "vocab_size": 256, "hidden_size": 96,
        "num_attention_heads": 3, "num_key_value_heads": 3, "intermediate_size": 64,
        "moe_intermediate_size": 32, "kv_lora_rank": 24, "q_lora_rank": None,
        "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16, "n_routed_experts": 4,
        "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1, "num_hidden_layers": 2,
    })  # fmt: skip
    a, b = _layouts(arch, 2)
    assert (a.q_heads, a.kv_heads, b.q_heads, b.kv_heads) == ((0, 2), (0, 1), (2, 3), (0, 1))
    assert [x.local_arch(arch).num_kv_heads for x in (a, b)] == [1, 1]
    assert [x.local_arch(arch).head_dim for x in (a, b)] == [32, 32]
    assert owned([a.kv_heads, b.kv_heads]) == [(0, 1), (1, 1)]
    with pytest.raises(ConfigError, match="3 query heads cannot be split over 4 ranks"):
        TPLayout.of(arch, 0, 4)


# DeepSeek-V3's published shapes (its 61 layers cut to 4)
V3 = {
    "model_type": "deepseek_v3", "vocab_size": 129280, "hidden_size": 7168,
    "num_attention_heads": 128, "num_key_value_heads": 128, "intermediate_size": 18432,
    "moe_intermediate_size": 2048, "kv_lora_rank": 512, "q_lora_rank": 1536,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "n_routed_experts": 256,
    "n_shared_experts": 1, "num_experts_per_tok": 8, "n_group": 8, "topk_group": 4,
    "first_k_dense_replace": 3, "num_hidden_layers": 4,
}  # fmt: skip


def test_deepseek_v3_fp8_blocks_are_cut_per_head_on_eight_ranks() -> None:
    """DeepSeek-V3's FP8 checkpoint (128 x 128 blocks) on 8 ranks: rank 1's 16 heads are 3,072
    q_b rows (blocks 24-48), 4,096 kv_b rows (nope key + value) and 2,048 o_proj columns; its
    256 rows of the shared expert's 2,048; the latent projections whole. 32 ranks cut the dense
    MLP's rows off the blocks (576 a rank): refused."""
    arch, fp8 = ArchConfig.from_dict(V3), QuantConfig("fp8", weight_block=(128, 128))
    rank = TPLayout.of(arch, 1, 8, fp8)
    attn, shared = "model.layers.5.self_attn", "model.layers.5.mlp.shared_experts"
    cuts = {
        f"{attn}.q_b_proj.weight": CheckpointSlice(0, 3072, 6144),
        f"{attn}.q_b_proj.weight_scale_inv": CheckpointSlice(0, 24, 48),
        f"{attn}.kv_b_proj.weight_scale_inv": CheckpointSlice(0, 32, 64),
        f"{attn}.o_proj.weight": CheckpointSlice(1, 2048, 4096),
        f"{attn}.o_proj.weight_scale_inv": CheckpointSlice(1, 16, 32),
        f"{shared}.up_proj.weight_scale_inv": CheckpointSlice(0, 2, 4),
        f"{shared}.down_proj.weight": CheckpointSlice(1, 256, 512),
        f"{shared}.down_proj.weight_scale_inv": CheckpointSlice(1, 2, 4),
        f"{attn}.kv_a_proj_with_mqa.weight_scale_inv": None,
        f"{attn}.q_a_proj.weight": None,
    }
    assert {name: rank.checkpoint_slice(name) for name in cuts} == cuts
    with pytest.raises(ConfigError, match=r"rank 0's gate_proj and up_proj rows \[0, 576\)"):
        TPLayout.of(arch, 0, 32, fp8)


def test_shared_experts_off_the_units_are_refused() -> None:
    """Qwen2-MoE's shared expert of 48 rows: 24 a rank cut a group of 16 input rows of its down
    projection (and 8-row AWQ units of its gate/up are fine): refused naming it; a quantized
    piece of a stacked shared gate/up (Granite's) is refused too."""
    moe = MoeConfig(4, 2, 64, True, (0,), True, shared_intermediate_size=48)
    arch = replace(ARCH, model_type="qwen2_moe", moe=moe)
    with pytest.raises(ConfigError, match=r"rank 0's shared experts' down input columns \[0, 24\)"):
        TPLayout.of(arch, 0, 2, QuantConfig("awq", group_size=16))
    layout = TPLayout.of(arch, 0, 2)
    with pytest.raises(ConfigError, match="quantized stacked shared expert"):
        layout.checkpoint_slice("model.layers.0.shared_mlp.input_linear.qweight")


def test_deepseek_heads_off_the_blocks_are_refused() -> None:
    """2 heads of 24 q dims a rank: 48 q_b rows cut a 128-row block (the dense MLP's and the
    experts' rows fall on whole blocks)."""
    tiny = {**V3, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 4,
            "intermediate_size": 256, "moe_intermediate_size": 256, "kv_lora_rank": 24,
            "q_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
            "n_routed_experts": 8, "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1}  # fmt: skip
    with pytest.raises(ConfigError, match=r"q_proj \(q_b_proj\) rows \[0, 48\) .* 128 rows"):
        TPLayout.of(ArchConfig.from_dict(tiny), 0, 2, QuantConfig("fp8", weight_block=(128, 128)))
