"""Quantized checkpoints in each on-disk format load through the engine's loader, and their
logits equal those of the same model built from the dequantized weights.

Tolerance: both sides run float32 on the CPU over weights with identical values (the scales
are fp16 or fp32 numbers, the dequantization is exact in fp32), so they differ only in the
order of fp32 sums: ~1e-6 relative on logits of order 1; 1e-4 leaves room and is still two
orders of magnitude below what quantization itself changes (checked in each test, so a loader
that ignored the quantized tensors could not pass).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from services.config import ConfigError, ModelConfig
from services.engine.attention_metadata import AttentionMetadata
from services.engine.loader import load_model
from services.engine.models.llama import Linear, LlamaForCausalLM
from services.engine.quantization.fp8 import Fp8Linear
from services.engine.quantization.int4 import Int4Linear
from tests.services.engine.quantization import checkpoints as ck

TOL = 1e-4
PROMPT = [1, 17, 200, 3, 99, 45, 45, 128, 7, 250, 64]  # 11 tokens: an odd M


def run(model: LlamaForCausalLM, prompt: list[int] = PROMPT) -> torch.Tensor:
    """[T, V] logits of one prefill of ``prompt`` (at most 32 tokens)."""
    arch, t = model.cfg, len(prompt)
    caches = [
        torch.zeros(2, 2, 16, arch.num_kv_heads, arch.head_dim) for _ in range(arch.num_layers)
    ]
    meta = AttentionMetadata(
        slot_mapping=torch.arange(t), block_tables=torch.tensor([[0, 1]], dtype=torch.int32),
        context_lens=torch.tensor([t], dtype=torch.int32),
        query_start_loc=torch.tensor([0, t], dtype=torch.int32), num_decodes=0,
    )  # fmt: skip
    with torch.no_grad():
        hidden = model(torch.tensor(prompt), torch.arange(t), caches, meta)
        return model.compute_logits(hidden)


def load(path: Path, **knobs: object) -> LlamaForCausalLM:
    return load_model(ModelConfig(model=str(path), **knobs), torch.device("cpu"), 64)[0]  # type: ignore[arg-type]


def check_matches_dequantized(tmp_path: Path, path: Path, deq: ck.Weights, layer: type) -> LlamaForCausalLM:  # fmt: skip
    orig = ck.random_weights(json.loads((path / "config.json").read_text()))  # before quantizing
    model = load(path)
    assert isinstance(model.model.layers[1].self_attn.qkv_proj, layer)
    assert isinstance(model.model.layers[0].mlp.down_proj, layer)
    assert type(model.lm_head) is Linear
    out = run(model)
    ref = run(load(ck.float_checkpoint(tmp_path / "ref", deq, path)))
    torch.testing.assert_close(out, ref, rtol=TOL, atol=TOL)
    unquantized = run(load(ck.float_checkpoint(tmp_path / "float", orig, path)))
    assert (out - unquantized).abs().max() > 100 * TOL  # the quantized weights were used
    return model


@pytest.mark.parametrize("scheme", ["block", "channel", "tensor"])
def test_fp8_checkpoints(tmp_path: Path, scheme: str, caplog: pytest.LogCaptureFixture) -> None:
    path, deq = ck.fp8_checkpoint(tmp_path / "fp8", scheme)
    with caplog.at_level("INFO", logger="services.engine.loader"):
        check_matches_dequantized(tmp_path, path, deq, Fp8Linear)
    line = "128x128 block scales" if scheme == "block" else "per-channel (or per-tensor)"
    assert line in caplog.text and "lm_head" in caplog.text


@pytest.mark.parametrize(
    ("method", "desc_act", "group"),
    [("awq", False, 128), ("awq", False, 64), ("gptq", False, 128), ("gptq", True, 128),
     ("gptq", True, 32)],
    ids=["awq", "awq-g64", "gptq", "gptq-act-order", "gptq-act-order-g32"],
)  # fmt: skip
def test_int4_checkpoints(tmp_path: Path, method: str, desc_act: bool, group: int, caplog: pytest.LogCaptureFixture) -> None:  # fmt: skip
    path, deq = ck.int4_checkpoint(tmp_path / method, method, desc_act, group)
    with caplog.at_level("INFO", logger="services.engine.loader"):
        model = check_matches_dequantized(tmp_path, path, deq, Int4Linear)
    down, qkv = model.model.layers[0].mlp.down_proj, model.model.layers[0].self_attn.qkv_proj
    assert isinstance(down, Int4Linear) and isinstance(qkv, Int4Linear)
    assert (down.perm is not None) == desc_act  # K = 256: two or more groups to shuffle
    assert (qkv.perm is not None) == (desc_act and group < 128)  # K = 128: one group of 128
    assert f"{method} int4 weights (w4a16), group size {group}" in caplog.text


def test_awq_qwen2_with_qkv_biases(tmp_path: Path) -> None:
    """The unquantized biases of the stacked q/k/v shards land beside the packed weights."""
    path, deq = ck.int4_checkpoint(tmp_path / "qwen2", "awq", model_type="qwen2")
    model = check_matches_dequantized(tmp_path, path, deq, Int4Linear)
    bias = model.model.layers[1].self_attn.qkv_proj.bias
    assert bias is not None
    want = [deq[f"model.layers.1.self_attn.{p}_proj.bias"] for p in "qkv"]
    assert torch.equal(bias, torch.cat(want))


@pytest.mark.parametrize("method", ["fp8-block", "awq", "gptq-act-order"])
def test_gemma3_checkpoints(tmp_path: Path, method: str) -> None:
    """Gemma 3's layers are the Llama projections behind its own norms and GELU: the quantized
    layers quantize their FP8 inputs themselves (not fused into its norms)."""
    if method == "fp8-block":
        path, deq = ck.fp8_checkpoint(tmp_path / method, "block", model_type="gemma3_text")
        layer: type = Fp8Linear
    else:
        kind = method.split("-")[0]
        path, deq = ck.int4_checkpoint(tmp_path / method, kind, kind == "gptq",
                                       model_type="gemma3_text")  # fmt: skip
        layer = Int4Linear
    model = check_matches_dequantized(tmp_path, path, deq, layer)
    assert model.cfg.gemma is not None and model.cfg.sliding_layers == (0,)


def test_online_fp8_quantizes_a_float_checkpoint(tmp_path: Path) -> None:
    w = ck.random_weights(ck.tiny_config())
    path = ck.float_checkpoint(tmp_path / "float", w)
    model = load(path, quantization="fp8")
    assert isinstance(model.model.layers[0].self_attn.o_proj, Fp8Linear)
    assert type(model.lm_head) is Linear and model.lm_head.weight.dtype == torch.float32
    deq = {n: ck.fp8_channel(t)[2] if n.endswith(ck.LINEARS_SUFFIXES) else t for n, t in w.items()}
    torch.testing.assert_close(run(model), run(load(ck.float_checkpoint(tmp_path / "r", deq))), rtol=TOL, atol=TOL)  # fmt: skip


def test_online_fp8_quantizes_a_float_gemma3(tmp_path: Path) -> None:
    w = ck.random_weights(ck.tiny_config(model_type="gemma3_text"))
    path = ck.float_checkpoint(tmp_path / "float", w, ck.write(tmp_path / "cfg", ck.tiny_config(model_type="gemma3_text"), {}))  # fmt: skip
    model = load(path, quantization="fp8")
    assert isinstance(model.model.layers[1].mlp.down_proj, Fp8Linear)
    deq = {n: ck.fp8_channel(t)[2] if n.endswith(ck.LINEARS_SUFFIXES) else t for n, t in w.items()}
    want = run(load(ck.float_checkpoint(tmp_path / "r", deq, path)))
    torch.testing.assert_close(run(model), want, rtol=TOL, atol=TOL)
    assert (run(model) - run(load(path))).abs().max() > 100 * TOL  # quantized weights were used


def test_online_fp8_with_dummy_weights(tmp_path: Path) -> None:
    path = ck.float_checkpoint(tmp_path / "float", ck.random_weights(ck.tiny_config()))
    plain = load(path, load_format="dummy", seed=3)
    model = load(path, load_format="dummy", seed=3, quantization="fp8")
    layer = model.model.layers[1].mlp.gate_up_proj
    assert isinstance(layer, Fp8Linear)
    w = plain.model.layers[1].mlp.gate_up_proj.weight.detach()
    deq = layer.weight.float() * layer.scale
    # e4m3 keeps 3 mantissa bits: within 2^-4 relative, or the subnormal step, of the float weight
    assert ((deq - w).abs() <= w.abs() / 16 + layer.scale * 2**-9).all()
    assert torch.isfinite(run(model)).all()


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_int4_with_dummy_weights(tmp_path: Path, method: str) -> None:
    path = ck.float_checkpoint(tmp_path / "float", ck.random_weights(ck.tiny_config()))
    model = load(path, load_format="dummy", quantization=method)
    assert isinstance(model.model.layers[0].mlp.down_proj, Int4Linear)
    logits = run(model)
    assert torch.isfinite(logits).all() and logits.std() > 0


def test_awq_flag_on_a_float_checkpoint_is_refused(tmp_path: Path) -> None:
    path = ck.float_checkpoint(tmp_path / "float", ck.random_weights(ck.tiny_config()))
    with pytest.raises(ConfigError, match="--quantization awq needs a AWQ checkpoint"):
        load(path, quantization="awq")


def test_a_quantized_checkpoint_with_fused_qkv_tensors_is_refused(tmp_path: Path) -> None:
    """Phi-3's layout (q, k and v in one qkv_proj tensor) quantized: refused at start, with
    what to serve instead, not loaded piece by piece as the unfused layout."""
    import json

    path, _ = ck.fp8_checkpoint(tmp_path / "fp8", "block")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "model_type": "phi3"}))
    with pytest.raises(ConfigError, match=r"quantized phi3 checkpoints .* --quantization fp8"):
        load(path)


@pytest.mark.parametrize(
    ("model_type", "why"),
    [("glm", "reordered"), ("glm4", "reordered"), ("cohere", "reordered"),
     ("ernie4_5", "reordered"), ("starcoder2", "ungated MLP are not quantized layers"),
     ("arcee", "ungated MLP are not quantized layers")],
)  # fmt: skip
def test_a_quantized_checkpoint_of_a_family_without_quantized_layers_is_refused(
    tmp_path: Path, model_type: str, why: str
) -> None:
    """GLM's and Cohere's q and k rows are reordered as they load (their rotary pairs dims
    (0, 1), ...), which a quantized checkpoint's packed rows and block scales are not;
    StarCoder2's and Arcee's ungated MLP layers are not quantized ones: refused at start, not loaded wrong."""
    import json

    path, _ = ck.fp8_checkpoint(tmp_path / "fp8", "block")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "model_type": model_type}))
    with pytest.raises(ConfigError, match=rf"quantized {model_type} checkpoints .* {why}"):
        load(path)


def test_a_missing_quantized_tensor_is_named(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    path, _ = ck.int4_checkpoint(tmp_path / "awq", "awq")
    tensors = load_file(str(path / "model.safetensors"))
    del tensors["model.layers.1.self_attn.k_proj.qzeros"]
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(ConfigError, match=r"model\.layers\.1\.self_attn\.qkv_proj\.qzeros#1"):
        load(path)


def test_shards_with_different_act_order_are_refused(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    path, _ = ck.int4_checkpoint(tmp_path / "gptq", "gptq", desc_act=True, group=32)
    tensors = load_file(str(path / "model.safetensors"))
    name = "model.layers.0.mlp.up_proj.g_idx"
    tensors[name] = tensors[name].flip(0).contiguous()
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(ConfigError, match="g_idx differ"):
        load(path)


def test_zero_biases_of_bias_free_layers_are_accepted_and_others_refused(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    path, _ = ck.int4_checkpoint(tmp_path / "gptq", "gptq")
    tensors = load_file(str(path / "model.safetensors"))
    tensors["model.layers.0.mlp.down_proj.bias"] = torch.zeros(128)
    save_file(tensors, str(path / "model.safetensors"))
    load(path)
    tensors["model.layers.0.mlp.down_proj.bias"] = torch.ones(128)
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(ConfigError, match=r"'model\.layers\.0\.mlp\.down_proj\.bias': unexpected"):
        load(path)


def test_act_order_without_g_idx_is_refused(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    path, _ = ck.int4_checkpoint(tmp_path / "gptq", "gptq", desc_act=True, group=32)
    tensors = load_file(str(path / "model.safetensors"))
    del tensors["model.layers.1.self_attn.o_proj.g_idx"]
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(ConfigError, match=r"model\.layers\.1\.self_attn\.o_proj\.g_idx#0"):
        load(path)
