"""Quantized Mixture-of-Experts checkpoints: FP8 experts held in FP8, AWQ's and GPTQ's int4 ones
held packed (GPTQ act-order ones too, their columns sorted by group), the attention and dense
layers kept quantized, the router as stored; logits equal those of the same model built from the
dequantized weights (float32, CPU: the tolerance of ``test_loading``)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kernels.moe import dequant_fp8_expert, dequant_int4_expert
from services.config import ConfigError
from services.engine.models.llama import Linear, LlamaForCausalLM
from services.engine.models.moe import Experts
from services.engine.quantization.config import QuantConfig
from services.engine.quantization.experts import ExpertDequantizer
from services.engine.quantization.fp8 import Fp8Linear
from services.engine.quantization.int4 import Int4Linear
from tests.services.engine.quantization import checkpoints as ck
from tests.services.engine.quantization.test_loading import TOL, load, run

LAYER = {"fp8-block": Fp8Linear, "fp8-channel": Fp8Linear, "awq": Int4Linear,
         "gptq": Int4Linear, "gptq-act-order": Int4Linear}  # fmt: skip


def check(tmp_path: Path, family: str, method: str, **kw: object) -> tuple[LlamaForCausalLM, str]:
    path, deq = ck.moe_checkpoint(tmp_path / "q", family, method, **kw)  # type: ignore[arg-type]
    model = load(path)
    ref = load(ck.float_checkpoint(tmp_path / "ref", deq, path))
    out = run(model)
    torch.testing.assert_close(out, run(ref), rtol=TOL, atol=TOL)
    orig = ck.moe_weights(ck.tiny_config(**ck.MOE[family]))  # before quantizing
    unquantized = run(load(ck.float_checkpoint(tmp_path / "float", orig, path)))
    assert (out - unquantized).abs().max() > 100 * TOL  # the quantized weights were used
    # FP8 experts held in FP8, AWQ's and GPTQ's (act-order too) packed int4, whose values
    # dequantized are the reference's; the others hold the dequantized values, in the model's
    # dtype
    experts = model.model.layers[0].mlp.experts
    want = ref.model.layers[0].mlp.experts
    quantized = "experts" not in str(kw.get("unquantized", ""))
    held = method.startswith("fp8") and quantized
    packed = method in ("awq", "gptq", "gptq-act-order") and quantized
    assert experts.fp8 == held and experts.int4 == packed
    dtype = torch.float8_e4m3fn if held else torch.int32 if packed else torch.float32
    assert experts.gate_up_proj.dtype == dtype
    assert experts.down_proj.dtype == experts.gate_up_proj.dtype
    act_order = packed and method == "gptq-act-order"
    # down_proj's permutation folded into gate_up_proj's rows (Experts.finish_loading)
    perms = (experts.gate_up_proj_perm, experts.intermediate_order)
    assert all((p is not None) == act_order for p in perms) and experts.down_proj_perm is None
    if packed:  # 4 bits a weight, float32 scales and uint8 zeros a row and group (128, or 32
        # act-order), act-order's int32 permutation of each expert's H and I columns
        e, two_i, h8 = experts.gate_up_proj.shape
        weights = e * two_i * h8 * 8 + e * h8 * 8 * (two_i // 2)
        assert experts.gate_up_proj_zeros is not None and experts.down_proj_zeros is not None
        assert experts.gate_up_proj_zeros.dtype == torch.uint8
        group = 32 if act_order else 128
        order = e * (h8 * 8 + two_i // 2) * 4 if act_order else 0
        assert experts.memory() == weights // 2 + weights // group * 5 + order
        assert experts.memory() * (5 if act_order else 6) < want.memory()  # float32: 8x, less
    assert torch.equal(dequantized(experts, True), want.gate_up_proj)
    assert torch.equal(dequantized(experts, False), want.down_proj)
    return model, path.name


def dequantized(experts: Experts, halves: bool) -> torch.Tensor:
    """Stacked expert weights as float32 (``halves``: gate_up_proj, else down_proj); FP8 ones
    through their scales."""
    w = experts.gate_up_proj if halves else experts.down_proj
    if experts.int4:  # act-order: each expert's columns back in the input's order
        s = experts.gate_up_proj_scale if halves else experts.down_proj_scale
        z = experts.gate_up_proj_zeros if halves else experts.down_proj_zeros
        p = experts.gate_up_proj_perm if halves else experts.down_proj_perm
        assert s is not None and z is not None
        perms = [None] * len(w) if p is None else list(p)
        out = torch.stack([dequant_int4_expert(w[e], s[e], z[e], perms[e]) for e in range(len(w))])  # fmt: skip
        order = experts.intermediate_order  # down_proj's permutation folded: undone here
        if order is None:
            return out
        back = torch.empty_like(out)
        for e, cols in enumerate(order.long()):
            if halves:  # row i holds the checkpoint's gate (up) row cols[i] (I + cols[i])
                back[e][torch.cat((cols, cols + len(cols)))] = out[e]
            else:  # column i, sorted by group, the checkpoint's column cols[i]
                back[e][:, cols] = out[e]
        return back
    if not experts.fp8:
        return w.float()
    s = experts.gate_up_proj_scale if halves else experts.down_proj_scale
    assert s is not None
    blocks = experts.fp8_block or (1, w.shape[2])
    return torch.stack([dequant_fp8_expert(w[e], s[e], blocks, halves) for e in range(len(w))])


@pytest.mark.parametrize("method", list(LAYER))
@pytest.mark.parametrize("family", list(ck.MOE))
def test_quantized_moe_checkpoints(
    tmp_path: Path, family: str, method: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level("INFO", logger="services.engine.loader"):
        model, _ = check(tmp_path, family, method)
    attn = model.model.layers[0].self_attn
    assert isinstance(attn.qkv_proj, LAYER[method]) and isinstance(attn.o_proj, LAYER[method])
    router = model.model.layers[0].mlp.gate
    assert type(router) is torch.nn.Linear and router.weight.dtype == torch.float32
    if family == "qwen3_moe":  # layer 1: a dense MLP, quantized as in a dense model
        assert isinstance(model.model.layers[1].mlp.down_proj, LAYER[method])
    if family == "qwen2_moe":  # its shared expert quantized as a dense MLP, its gate float
        moe = model.model.layers[1].mlp
        assert isinstance(moe.shared_expert.down_proj, LAYER[method])
        assert type(moe.shared_expert_gate) is torch.nn.Linear
    if method.startswith("fp8"):
        layers = {"qwen3_moe": 1, "mixtral": 2, "qwen2_moe": 2}[family]  # the sparse layers
        scales = "128x128 block" if method == "fp8-block" else "per-channel"
        assert f"experts of {layers} layers held as fp8 e4m3 with {scales} scales" in caplog.text
        assert "dequantized to float32 as they loaded" not in caplog.text
        return
    layers = {"qwen3_moe": 1, "mixtral": 2, "qwen2_moe": 2}[family]
    kind = method.split("-")[0]
    assert f"experts of {layers} layers held as {kind} int4, packed" in caplog.text
    sorted_groups = "act-order: each expert's columns sorted by group"
    assert (sorted_groups in caplog.text) == (method == "gptq-act-order")
    assert "dequantized" not in caplog.text


@pytest.mark.parametrize("method", ["fp8-block", "awq", "gptq-act-order"])
def test_layers_the_checkpoint_leaves_unquantized_stay_float(
    tmp_path: Path, method: str, caplog: pytest.LogCaptureFixture
) -> None:
    """modules_to_not_convert naming o_proj (every layer's) and one expert: those load as
    stored, the others quantized (that expert's layer's experts dequantized as they load: one
    stacked tensor holds one format)."""
    with caplog.at_level("INFO", logger="services.engine.loader"):
        model, _ = check(tmp_path, "qwen3_moe", method, unquantized=("o_proj", "experts.1."))
    layer = model.model.layers[0].self_attn
    assert type(layer.o_proj) is Linear and isinstance(layer.qkv_proj, LAYER[method])
    assert "an expert of their layer stored unquantized" in caplog.text


def test_part_of_a_fused_layer_left_unquantized_is_refused(tmp_path: Path) -> None:
    path, _ = ck.moe_checkpoint(tmp_path / "q", "qwen3_moe", "awq", unquantized=("k_proj",))
    with pytest.raises(ConfigError, match=r"leaves \['model\.layers\.0\.self_attn\.k_proj'\]"):
        load(path)


def test_online_fp8_quantizes_the_attention_and_the_experts(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """``--quantization fp8`` of a float MoE checkpoint: the experts too, per output row of each
    expert (as the dense layers), held in FP8."""
    cfg = ck.tiny_config(**ck.MOE["mixtral"])
    w = ck.moe_weights(cfg)
    path = ck.float_checkpoint(tmp_path / "float", w, ck.write(tmp_path / "c", cfg, {}))
    with caplog.at_level("INFO", logger="services.engine.loader"):
        model = load(path, quantization="fp8")
    assert isinstance(model.model.layers[0].self_attn.qkv_proj, Fp8Linear)
    assert "experts of 2 layers held as fp8 e4m3 with per-channel scales" in caplog.text
    experts = model.model.layers[1].mlp.experts
    assert experts.down_proj.dtype == torch.float8_e4m3fn and experts.down_proj_scale is not None
    assert experts.down_proj_scale.shape == (4, 128, 1)
    names = ("_proj.weight", ".w1.weight", ".w2.weight", ".w3.weight")
    deq = {n: ck.fp8_channel(t)[2] if n.endswith(names) else t for n, t in w.items()}
    stacked = torch.stack([deq[f"model.layers.1.block_sparse_moe.experts.{e}.w2.weight"] for e in range(4)])  # fmt: skip
    assert torch.equal(dequantized(experts, False), stacked)
    want = run(load(ck.float_checkpoint(tmp_path / "r", deq, path)))
    torch.testing.assert_close(run(model), want, rtol=TOL, atol=TOL)


def _edited(tmp_path: Path, family: str, method: str, edit: Callable[[dict], None]) -> Path:
    """A tiny ``family`` checkpoint in ``method`` whose tensors ``edit`` changed in place."""
    path, _ = ck.moe_checkpoint(tmp_path / "q", family, method)
    tensors = load_file(str(path / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(path / "model.safetensors"))
    return path


def test_a_missing_expert_piece_is_named(tmp_path: Path) -> None:
    def drop(tensors: dict) -> None:
        del tensors["model.layers.1.block_sparse_moe.experts.2.w3.weight_scale_inv"]

    path = _edited(tmp_path, "mixtral", "fp8-block", drop)
    with pytest.raises(ConfigError, match=r"gate_up_proj_scale \(expert 2's up projection scales"):
        load(path)


def test_act_order_gate_and_up_of_different_orders_are_refused(tmp_path: Path) -> None:
    """An expert's gate and up projections are one stacked layer reading one input through one
    permutation: their g_idx must agree (as a dense layer's stacked shards')."""

    def flip(tensors: dict) -> None:
        name = "model.layers.1.block_sparse_moe.experts.2.w3.g_idx"
        tensors[name] = tensors[name].flip(0).contiguous()  # every group still 32 rows

    path = _edited(tmp_path, "mixtral", "gptq-act-order", flip)
    with pytest.raises(ConfigError, match=r"experts\.2: the gate and up .* g_idx differ"):
        load(path)


def test_act_order_groups_of_other_sizes_are_refused(tmp_path: Path) -> None:
    """An expert's g_idx that gives a group more rows than group_size (and another fewer)
    cannot be sorted into the kernels' whole groups: refused, naming the projection."""

    def merge(tensors: dict) -> None:
        name = "model.layers.0.mlp.experts.3.down_proj.g_idx"
        g_idx = tensors[name].clone()
        g_idx[g_idx == 1] = 0  # group 0 of 64 rows, group 1 of none
        tensors[name] = g_idx

    path = _edited(tmp_path, "qwen3_moe", "gptq-act-order", merge)
    with pytest.raises(ConfigError, match=r"experts\.3\.down_proj: .* every one of 4 groups 32"):
        load(path)


def test_act_order_experts_without_g_idx_are_refused(tmp_path: Path) -> None:
    def drop(tensors: dict) -> None:
        del tensors["model.layers.0.mlp.experts.1.up_proj.g_idx"]

    path = _edited(tmp_path, "qwen3_moe", "gptq-act-order", drop)
    with pytest.raises(ConfigError, match=r"missing .*experts\.1\.up_proj\.g_idx"):
        load(path)


def test_act_order_permutations_in_order_are_dropped_and_down_projs_folded() -> None:
    """A permutation that keeps every expert's input order (g_idx already in order) is dropped
    once loaded, so the kernels read the activations as they are; down_proj's is folded into
    gate_up_proj's rows (their scales and zeros too: the intermediate comes out in the order
    down_proj's sorted columns read), and x's stays, attached with the groups."""
    gen = torch.Generator().manual_seed(0)
    for gate_up_in_order in (True, False):
        experts = Experts(3, 64, 32)
        experts.hold_int4(32, act_order=True)
        assert experts.gate_up_proj_perm is not None and experts.down_proj_perm is not None
        x_order = torch.stack([torch.randperm(64, generator=gen) for _ in range(3)])
        if gate_up_in_order:
            x_order = torch.arange(64).expand(3, 64)
        experts.gate_up_proj_perm.data.copy_(x_order)
        down = torch.stack([torch.randperm(32, generator=gen) for _ in range(3)]).int()
        experts.down_proj_perm.data.copy_(down)
        held = [experts.gate_up_proj, experts.gate_up_proj_scale, experts.gate_up_proj_zeros]
        for t in held:
            assert t is not None
            t.data.copy_(torch.randint(0, 16, t.shape, generator=gen))
        before = [t.data.clone() for t in held if t is not None]
        experts.finish_loading()
        assert experts.down_proj_perm is None and torch.equal(experts.intermediate_order, down)
        rows = torch.cat((down, down + 32), dim=1)  # [3, 64]: gate rows, then up rows
        for t, was in zip(held, before, strict=True):
            assert t is not None
            for e in range(3):
                assert torch.equal(t.data[e], was[e][rows[e]])
        int4 = experts.gate_up_proj.int4_scales  # type: ignore[attr-defined]
        assert int4.w2_perm is None
        if gate_up_in_order:
            assert experts.gate_up_proj_perm is None and int4.w13_perm is None
        else:
            assert torch.equal(int4.w13_perm, x_order.to(torch.int32))


def test_an_expert_piece_of_another_format_is_refused() -> None:
    stream = ExpertDequantizer(QuantConfig("awq"), torch.float32, torch.device("cpu")).stream(
        iter([("model.layers.0.mlp.experts.0.up_proj.weight_scale_inv", torch.ones(1, 1))])
    )
    with pytest.raises(ConfigError, match="not a piece of a awq expert"):
        list(stream)


@pytest.mark.parametrize(
    ("model_type", "why"),
    [
        ("gpt_oss", "stored stacked"),
        ("granitemoe", "stored stacked"),
        ("ernie4_5_moe", "q and k rows are reordered"),
    ],
)
def test_quantized_stacked_expert_checkpoints_are_refused(
    tmp_path: Path, model_type: str, why: str
) -> None:
    path, _ = ck.moe_checkpoint(tmp_path / "q", "mixtral", "fp8-block")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "model_type": model_type}))
    with pytest.raises(ConfigError, match=rf"quantized {model_type} checkpoints .* {why}"):
        load(path)


def test_quantized_experts_cut_off_their_groups_are_refused_over_ranks(tmp_path: Path) -> None:
    """Two ranks of 192 intermediate rows: the down projections' input columns [0, 192) miss
    GPTQ's groups of 128 (tests/services/engine/quantization/test_tensor_parallel.py serves
    the splits that fall on them)."""
    from services.config import ModelConfig
    from services.engine.loader import check_tp_split

    shapes = {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 128, "moe_intermediate_size": 384}  # fmt: skip
    path, _ = ck.moe_checkpoint(tmp_path / "q", "qwen3_moe", "gptq", config=shapes)
    with pytest.raises(ConfigError, match=r"experts' down input columns \[0, 192\)"):
        check_tp_split(ModelConfig(model=str(path)), 2)
    check_tp_split(ModelConfig(model=str(path)), 1)


def test_act_order_experts_are_refused_over_ranks(tmp_path: Path) -> None:
    """An act-order checkpoint's groups run across every rank's slice of a down projection's
    input columns (the experts' as the dense layers'): refused before any rank starts, naming
    the fix (one rank serves it, its experts held packed: test_quantized_moe_checkpoints)."""
    from services.config import ModelConfig
    from services.engine.loader import check_tp_split

    path, _ = ck.moe_checkpoint(tmp_path / "q", "qwen3_moe", "gptq-act-order")
    with pytest.raises(ConfigError, match=r"act-order .* use 1, or a checkpoint without"):
        check_tp_split(ModelConfig(model=str(path)), 2)


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="the Triton kernel on the CPU: TRITON_INTERPRET=1",
)
@pytest.mark.parametrize(
    "method", ["fp8-block", "awq", "gptq", "gptq-act-order", "ct-w4a16", "ct-channel-asym"]
)
def test_greedy_tokens_through_the_triton_moe_kernel(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, method: str
) -> None:
    """The engine (prefill and decode steps) on an FP8-block, AWQ, GPTQ or compressed-tensors
    (W4A16 in groups of 128, or asymmetric with one group a row) Qwen3-MoE checkpoint, its
    experts (FP8, packed int4; act-order's x read through its permutation, down's folded)
    through the fused Triton kernels (under the interpreter), gives the greedy tokens of the
    float32 model of the dequantized weights (on the CPU's torch MoE)."""
    from kernels import ops, triton_moe
    from protos.sampling_params import SamplingParams
    from services.engine.llm import LLM
    from tests.services.engine.conftest import BESIDE, save_test_tokenizer

    held: list[torch.dtype] = []

    def fused_moe(x: torch.Tensor, w13: torch.Tensor, *args: object, **kw: object) -> torch.Tensor:
        held.append(w13.dtype)
        return triton_moe.fused_moe(x, w13, *args, **kw)  # type: ignore[arg-type]

    if method.startswith("ct-"):
        group, sym = (128, True) if method == "ct-w4a16" else (None, False)
        path, deq = ck.ct_int4_checkpoint(tmp_path / "q", group, sym, moe="qwen3_moe")
    else:
        path, deq = ck.moe_checkpoint(tmp_path / "q", "qwen3_moe", method)
    ref = ck.float_checkpoint(tmp_path / "ref", deq, path)
    tokens = []
    for where in (path, ref):  # the reference through the CPU's torch MoE (not interpreted)
        save_test_tokenizer(where)
        with monkeypatch.context() as patch, LLM(str(where), **BESIDE) as llm:
            if where == path:
                patch.setattr(ops, "fused_moe", fused_moe)
            out = llm.generate(
                [{"prompt_token_ids": [5, 77, 130, 9]}, {"prompt_token_ids": [200, 3]}],
                # the prefill's token and two decode steps' (each step's MoE through the
                # kernels: the count is the suite's time, not the point)
                SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True),
            )
        tokens.append([r.outputs[0].token_ids for r in out])
    # the quantized experts went through the kernels as held
    assert held and set(held) == {torch.float8_e4m3fn if method == "fp8-block" else torch.int32}
    assert tokens[0] == tokens[1]


# every family in FP8 blocks; AWQ and GPTQ (groups of 32; act-order too) across DeepSeek-V2,
# V3 and GLM-4.5
DEEPSEEK_CASES = [*((t, "fp8") for t in ck.DEEPSEEK_TYPES), ("deepseek_v3", "awq"),
                  ("deepseek_v2", "gptq"), ("glm4_moe", "awq"), ("glm4_moe", "gptq"),
                  ("deepseek_v3", "gptq-act-order")]  # fmt: skip


@pytest.mark.parametrize(("model_type", "fmt"), DEEPSEEK_CASES)
def test_quantized_deepseek_and_glm_checkpoints(
    tmp_path: Path, model_type: str, fmt: str, caplog: pytest.LogCaptureFixture
) -> None:
    """DeepSeek-V2/V3's and GLM-4.5's FP8 block checkpoints (were refused for DeepSeek) and
    their AWQ (GEMM) and GPTQ (no act-order) int4 ones: the experts held in FP8 or packed int4
    (their values the reference's), o_proj, the dense MLP and the shared experts quantized
    layers, DeepSeek's other latent attention projections (kv_b_proj among them) dequantized
    to float weights as they load; greedy tokens and their logprobs those of the float32 model
    of the dequantized weights."""
    from protos.sampling_params import SamplingParams
    from services.engine.llm import LLM
    from tests.services.engine.conftest import BESIDE

    path, ref = ck.deepseek_checkpoints(tmp_path, model_type, fmt=fmt)
    with caplog.at_level("INFO", logger="services.engine.loader"):
        model = load(path)
    moe, reference = model.model.layers[1].mlp, load(ref)
    layer = LAYER["fp8-block" if fmt == "fp8" else fmt]
    if fmt == "fp8":
        assert moe.experts.gate_up_proj.dtype == torch.float8_e4m3fn and moe.experts.fp8_block == (32, 32)  # fmt: skip
        assert "experts of 1 layers held as fp8 e4m3 with 32x32 block scales" in caplog.text
    else:  # packed, not dequantized: 8 weights an int32, groups of 32 (act-order: sorted)
        assert moe.experts.gate_up_proj.dtype == torch.int32 and moe.experts.int4_group == 32
        kind, act_order = fmt.split("-")[0], fmt == "gptq-act-order"
        assert f"experts of 1 layers held as {kind} int4, packed (groups of 32" in caplog.text
        assert (moe.experts.gate_up_proj_perm is not None) == act_order
        assert (moe.experts.intermediate_order is not None) == act_order  # down's, folded
    want = reference.model.layers[1].mlp.experts
    assert torch.equal(dequantized(moe.experts, True), want.gate_up_proj)
    assert torch.equal(dequantized(moe.experts, False), want.down_proj)
    assert isinstance(moe.shared_experts.gate_up_proj, layer)
    assert isinstance(model.model.layers[0].mlp.down_proj, layer)
    attn, want = model.model.layers[1].self_attn, reference.model.layers[1].self_attn
    assert isinstance(attn.o_proj, layer)
    if model_type != "glm4_moe":  # the latent attention's float weights, as the reference's
        for proj in ("kv_b_proj", "kv_a_proj_with_mqa", "q_b_proj" if "v3" in model_type else "q_proj"):  # fmt: skip
            got = getattr(attn, proj).weight
            assert got.dtype == torch.float32 and torch.equal(got, getattr(want, proj).weight)
        assert "latent attention's" in caplog.text
    else:  # GLM-4.5's q, k and v stay quantized layers
        assert isinstance(attn.qkv_proj, layer)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0)
    prompts = [{"prompt_token_ids": [5, 77, 130, 9, 4000]}, {"prompt_token_ids": [200, 3]}]
    outs = []
    for where in (path, ref):
        with LLM(str(where), **BESIDE) as llm:
            outs.append(llm.generate(prompts, params))
    for got, exp in zip(*outs, strict=True):
        assert got.outputs[0].token_ids == exp.outputs[0].token_ids
        a = [p.chosen.logprob for p in got.outputs[0].logprobs]
        b = [p.chosen.logprob for p in exp.outputs[0].logprobs]
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=TOL, atol=TOL)


def test_dummy_weights_of_an_fp8_moe_config_draw_fp8_experts(tmp_path: Path) -> None:
    """--load-format dummy on an FP8 checkpoint's config: the experts held in FP8, drawn as
    the float weights are (within +-0.02 once dequantized) with their block scales."""
    path, _ = ck.moe_checkpoint(tmp_path / "q", "qwen3_moe", "fp8-block")
    experts = load(path, load_format="dummy").model.layers[0].mlp.experts
    assert experts.gate_up_proj.dtype == torch.float8_e4m3fn
    for halves in (True, False):
        w = dequantized(experts, halves)
        assert 0.019 < w.abs().max() <= 0.0201 and w.std() > 0.01


@pytest.mark.parametrize("method", ["awq", "gptq-act-order"])
def test_dummy_weights_of_an_int4_moe_config_draw_packed_int4_experts(
    tmp_path: Path, method: str
) -> None:
    """--load-format dummy on an AWQ (or act-order GPTQ) checkpoint's config: the experts held
    packed, drawn as the dense int4 layers are (within +-0.02 once dequantized); act-order
    ones with a random permutation of each expert's columns, as a real checkpoint's."""
    path, _ = ck.moe_checkpoint(tmp_path / "q", "qwen3_moe", method)
    experts = load(path, load_format="dummy").model.layers[0].mlp.experts
    assert experts.gate_up_proj.dtype == torch.int32 and experts.int4
    assert experts.down_proj_perm is None  # folded into gate_up_proj's rows
    for perm in (experts.gate_up_proj_perm, experts.intermediate_order):
        assert (perm is not None) == (method == "gptq-act-order")
        if perm is not None:
            order = torch.arange(perm.shape[1], dtype=perm.dtype)
            assert torch.equal(perm.sort(dim=1).values, order.expand_as(perm))
            assert not torch.equal(perm, order.expand_as(perm))
    for halves in (True, False):
        w = dequantized(experts, halves)
        assert w.abs().max() <= 0.0201 and w.std() > 0.005
