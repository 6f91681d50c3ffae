"""compressed-tensors int4 weight-only checkpoints (llm-compressor's W4A16, ``pack-quantized``):
the test checkpoints are packed by the compressed-tensors library itself and checked against
its own decompression; the engine converts their pieces to the int4 serving layout (dense
layers, MoE experts held packed), and the logits equal those of the float32 model of the
dequantized weights (``test_loading``'s tolerance); what cannot be served is refused."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from services.config import ConfigError, ModelConfig
from services.engine.loader import check_tp_split
from services.engine.models.llama import Linear
from services.engine.quantization.config import QuantConfig, resolve_quantization
from services.engine.quantization.int4 import Int4Linear
from tests.services.engine.quantization import checkpoints as ck
from tests.services.engine.quantization.test_experts import dequantized
from tests.services.engine.quantization.test_loading import (
    TOL,
    check_matches_dequantized,
    load,
    run,
)

CT = "compressed-tensors"


def _config(
    group: int | None = 128, sym: bool = True, actorder: str | None = None
) -> dict[str, Any]:
    return ck.ct_int4_config(ck.ct_int4_scheme(group, sym, actorder), ["lm_head"])


def _weights(config: dict[str, Any], **changes: Any) -> dict[str, Any]:
    """``config`` with its one group's weights args changed."""
    group = config["config_groups"]["group_0"]
    weights = {**group["weights"], **changes}
    return {**config, "config_groups": {"group_0": {**group, "weights": weights}}}


@pytest.mark.parametrize(
    ("checkpoint", "flag", "expected"),
    [
        (_config(), None, QuantConfig(CT, zero_points=False, unquantized=())),
        (_config(64, sym=False), None, QuantConfig(CT, group_size=64)),
        (_config(None), CT, QuantConfig(CT, zero_points=False, channel=True)),
        (_config(actorder="group"), None, QuantConfig(CT, desc_act=True, zero_points=False)),
        (_config(actorder="weight"), None, QuantConfig(CT, zero_points=False)),
        # sparse weights stored dense, and empty sparsity / transform configs, load as they are
        ({**_config(), "sparsity_config": {"format": "dense", "sparsity_structure": "2:4"},
          "transform_config": {}}, None, QuantConfig(CT, zero_points=False)),
        # the FP8 scheme's checkpoint takes the library's name on the flag too
        ({"quant_method": CT, "format": "float-quantized", "config_groups": {"g": {
            "weights": {"num_bits": 8, "type": "float", "strategy": "channel"},
            "targets": ["Linear"]}}}, CT, QuantConfig("fp8")),
        # two groups of one scheme (their targets apart) are one format
        ({**_config(), "config_groups": {"a": _config()["config_groups"]["group_0"],
                                         "b": _config()["config_groups"]["group_0"]}},
         None, QuantConfig(CT, zero_points=False)),
    ],
)  # fmt: skip
def test_the_scheme_comes_from_the_checkpoint(
    checkpoint: dict[str, Any], flag: str | None, expected: QuantConfig
) -> None:
    assert resolve_quantization(checkpoint, flag) == expected


@pytest.mark.parametrize(
    ("checkpoint", "flag", "message"),
    [
        (_weights(_config(), num_bits=8), None, "8-bit int weights .* W8A16"),
        ({**_config(), "config_groups": {"group_0": {
            **_config()["config_groups"]["group_0"],
            "input_activations": {"num_bits": 8, "type": "int", "strategy": "token",
                                  "dynamic": True}}}}, None, "input_activations \\(W4A8"),
        ({**_config(), "config_groups": {"a": _config()["config_groups"]["group_0"],
                                         "b": _config(64)["config_groups"]["group_0"]}},
         None, "different schemes \\(2 groups\\)"),
        (_weights(_config(), group_size=256), None, "group_size 256 is not supported"),
        (_weights(_config(), strategy="tensor"), None, "strategy 'tensor'"),
        ({**_config(), "kv_cache_scheme": {"num_bits": 8, "type": "float"}}, None,
         "kv_cache_scheme"),
        ({**_config(), "config_groups": {"group_0": {
            **_config()["config_groups"]["group_0"], "targets": ["re:.*self_attn.*"]}}},
         None, "targets \\['re:.\\*self_attn.\\*'\\]"),
        ({**_config(), "config_groups": {"W4A16": ["Linear"]}}, None, "preset names"),
        ({**_config(), "format": "marlin-24"}, None, "format 'marlin-24'"),
        (_config(), "gptq", "pass --quantization compressed-tensors"),
        ({**_config(), "sparsity_config": {"format": "sparse-24-bitmask",
                                           "sparsity_structure": "2:4"}}, None,
         "sparsity_config format 'sparse-24-bitmask'"),
        ({**_config(), "transform_config": {"config_groups": {"u": {"type": "hadamard"}}}},
         None, "transform_config"),
    ],
)  # fmt: skip
def test_what_cannot_be_served_is_refused(
    checkpoint: dict[str, Any], flag: str | None, message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        resolve_quantization(checkpoint, flag)


def test_the_flag_takes_the_library_name() -> None:
    assert ModelConfig(quantization=CT).quantization == CT


@pytest.mark.parametrize(
    ("group", "sym", "actorder"),
    [(128, True, None), (128, False, None), (None, True, None), (None, False, None),
     (32, False, "group")],
)  # fmt: skip
def test_the_writer_is_the_library_format(
    tmp_path: Path, group: int | None, sym: bool, actorder: str | None
) -> None:
    """Each projection's pieces, decompressed by compressed-tensors itself, are the float
    weights the reference model holds (so the engine is checked against the real format)."""
    from compressed_tensors.compressors.pack_quantized import (
        PackedQuantizationCompressor,
        unpack_from_int32,
    )
    from compressed_tensors.quantization import QuantizationScheme

    path, deq = ck.ct_int4_checkpoint(tmp_path / "q", group, sym, actorder)
    tensors = load_file(str(path / "model.safetensors"))
    scheme = ck.ct_int4_scheme(group, sym)  # 0.20 refuses actorder "group": its own ordering
    name = "model.layers.0.mlp.down_proj"  # [128, 256]
    pieces = {p: tensors[f"{name}.{p}"] for p in ("weight_packed", "weight_scale", "weight_shape")}
    assert pieces["weight_packed"].shape == (128, 256 // 8)
    assert pieces["weight_scale"].shape == (128, 256 // (group or 256))
    if not sym:
        pieces["weight_zero_point"] = tensors[f"{name}.weight_zero_point"]
        assert pieces["weight_zero_point"].shape == (128 // 8, 256 // (group or 256))
    if actorder is None:
        out = PackedQuantizationCompressor.decompress(pieces, QuantizationScheme(**scheme))
        weight = out["weight"]  # in the scales' dtype (fp16): ours rounded once to it
        assert torch.equal(weight, deq[f"{name}.weight"].to(weight.dtype))
    else:  # the values and groups by g_idx, as the library's older releases dequantized them
        q = unpack_from_int32(pieces["weight_packed"], 4, torch.Size([128, 256])).float()
        g = tensors[f"{name}.weight_g_idx"].long()
        assert not torch.equal(g, torch.arange(256) // 32)  # the groups are shuffled
        zp = unpack_from_int32(pieces["weight_zero_point"], 4, torch.Size([128, 8]), 0)
        want = (q - zp.float()[:, g]) * pieces["weight_scale"].float()[:, g]
        assert torch.equal(want, deq[f"{name}.weight"])


@pytest.mark.parametrize(
    ("group", "sym", "actorder"),
    [(128, True, None), (128, False, None), (64, True, "weight"), (None, True, None),
     (None, False, None), (32, False, "group")],
    ids=["w4a16", "w4a16-asym", "g64-actorder-weight", "channel", "channel-asym",
         "asym-g32-actorder-group"],
)  # fmt: skip
def test_dense_checkpoints_match_the_dequantized_model(
    tmp_path: Path, group: int | None, sym: bool, actorder: str | None,
    caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    path, deq = ck.ct_int4_checkpoint(tmp_path / "q", group, sym, actorder)
    with caplog.at_level("INFO", logger="services.engine.loader"):
        model = check_matches_dequantized(tmp_path, path, deq, Int4Linear)
    down, qkv = model.model.layers[0].mlp.down_proj, model.model.layers[0].self_attn.qkv_proj
    assert isinstance(down, Int4Linear) and isinstance(qkv, Int4Linear)
    assert (down.perm is not None) == (actorder == "group")  # shuffled groups sorted once
    if group is None:  # one scale a row, repeated over groups of 128 (K = 128 and 256)
        assert down.group_size == qkv.group_size == 128
        assert torch.equal(down.scales[0], down.scales[1])
    if sym:
        assert (down.zeros == 8).all()
    kind = "symmetric" if sym else "asymmetric"
    scales = "per-channel scales" if group is None else f"group size {group}"
    line = f"compressed-tensors int4 weights (w4a16, pack-quantized, {kind}), {scales}"
    assert line in caplog.text and "lm_head" in caplog.text


def test_the_ignore_list_leaves_layers_float(tmp_path: Path) -> None:
    """lm_head (always) and the layers ``ignore`` names stay float: a checkpoint storing
    o_proj unquantized, listed by pattern."""
    path, deq = ck.ct_int4_checkpoint(tmp_path / "q")
    tensors = load_file(str(path / "model.safetensors"))
    orig = ck.random_weights(ck.tiny_config())  # the writer's float weights
    for layer in range(2):
        o = f"model.layers.{layer}.self_attn.o_proj"
        for piece in ("weight_packed", "weight_scale", "weight_shape"):
            del tensors[f"{o}.{piece}"]
        tensors[f"{o}.weight"] = deq[f"{o}.weight"] = orig[f"{o}.weight"]
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"]["ignore"] += ["re:.*o_proj$"]
    path = ck.write(tmp_path / "ignore", cfg, tensors)
    model = load(path)
    assert type(model.model.layers[0].self_attn.o_proj) is Linear
    assert type(model.lm_head) is Linear
    assert isinstance(model.model.layers[0].self_attn.qkv_proj, Int4Linear)
    ref = load(ck.float_checkpoint(tmp_path / "ref", deq, path))
    torch.testing.assert_close(run(model), run(ref), rtol=TOL, atol=TOL)


@pytest.mark.parametrize(
    ("family", "group", "sym", "actorder"),
    [("qwen3_moe", 128, True, None), ("mixtral", 128, False, None),
     ("qwen3_moe", None, False, None), ("qwen3_moe", 32, True, "group")],
    ids=["qwen3-w4a16", "mixtral-asym", "qwen3-channel", "qwen3-actorder-group"],
)  # fmt: skip
def test_moe_experts_held_packed(
    tmp_path: Path, family: str, group: int | None, sym: bool, actorder: str | None,
    caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    """The experts are held as packed int4 (weight_packed is already the fused MoE kernels'
    layout), their values the dequantized reference's; the router, ignored by pattern, stays
    float; actorder "group" experts (shuffled groups) too, each expert's columns sorted by
    group and its permutation held."""
    path, deq = ck.ct_int4_checkpoint(tmp_path / "q", group, sym, actorder, moe=family)
    with caplog.at_level("INFO", logger="services.engine.loader"):
        model = load(path)
    ref = load(ck.float_checkpoint(tmp_path / "ref", deq, path))
    out = run(model)
    torch.testing.assert_close(out, run(ref), rtol=TOL, atol=TOL)
    orig = ck.moe_weights(ck.tiny_config(**ck.MOE[family]))
    unquantized = run(load(ck.float_checkpoint(tmp_path / "float", orig, path)))
    assert (out - unquantized).abs().max() > 100 * TOL  # the quantized weights were used
    moe = model.model.layers[0].mlp
    assert type(moe.gate) is torch.nn.Linear and moe.gate.weight.dtype == torch.float32
    assert isinstance(model.model.layers[0].self_attn.qkv_proj, Int4Linear)
    experts, want = moe.experts, ref.model.layers[0].mlp.experts
    assert experts.int4 and experts.gate_up_proj.dtype == torch.int32
    assert torch.equal(dequantized(experts, True), want.gate_up_proj)
    assert torch.equal(dequantized(experts, False), want.down_proj)
    assert experts.int4_group == group  # None: one group a row
    assert f"held as {CT} int4, packed" in caplog.text and "dequantized" not in caplog.text
    act_order = actorder == "group"
    assert (experts.gate_up_proj_perm is not None) == act_order
    assert (experts.intermediate_order is not None) == act_order  # down's, folded
    assert ("act-order: each expert's columns sorted by group" in caplog.text) == act_order


def test_tensor_parallel_refusals_come_before_the_ranks(tmp_path: Path) -> None:
    """actorder "group" mixes every rank's input columns; per-channel layers need each rank's
    input columns in groups of 32 at least."""
    from tests.services.engine.quantization.test_tensor_parallel import SPLITTABLE

    act = ck.ct_int4_checkpoint(tmp_path / "act", 32, True, "group", **SPLITTABLE)[0]
    with pytest.raises(ConfigError, match="compressed-tensors actorder"):
        check_tp_split(ModelConfig(model=str(act)), 2)
    shapes = {**SPLITTABLE, "intermediate_size": 528}  # 264 rows a rank: not groups of 32
    channel = ck.ct_int4_checkpoint(tmp_path / "channel", None, **shapes)[0]
    with pytest.raises(ConfigError, match=r"down_proj input columns \[0, 264\) .* unit of 32"):
        check_tp_split(ModelConfig(model=str(channel)), 2)
    check_tp_split(ModelConfig(model=str(ck.ct_int4_checkpoint(tmp_path / "c", None, **SPLITTABLE)[0])), 2)  # fmt: skip


@pytest.mark.parametrize(
    ("moe", "group", "sym"),
    [(None, 128, True), (None, 128, False), (None, None, False), ("qwen3_moe", 128, True)],
    ids=["w4a16", "w4a16-asym", "channel-asym", "qwen3-moe"],
)  # fmt: skip
def test_two_ranks_give_the_tokens_of_one(
    tmp_path: Path, moe: str | None, group: int | None, sym: bool
) -> None:
    """Each rank reads its rows of weight_packed and weight_scale (and of the zero points,
    packed eight rows a word), or its columns in whole words and groups; the experts' halves
    alike (held packed on each rank)."""
    from tests.services.engine.quantization import test_tensor_parallel as tp

    shapes = {**tp.SPLITTABLE, **({"moe_intermediate_size": 256} if moe else {})}
    path = ck.ct_int4_checkpoint(tmp_path / "q", group, sym, moe=moe, **shapes)[0]
    tp._tokenizer().save_pretrained(path)
    assert tp._tokens(path, 2) == tp._tokens(path, 1)
    assert tp.rank_processes() == []
