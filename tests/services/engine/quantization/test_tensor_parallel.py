"""Quantized checkpoints split over tensor-parallel ranks (Gloo on the CPU): two ranks give the
greedy tokens of one, for every on-disk format that can be split and for fp8 quantized at load
time; what cannot be split is refused before any rank starts, naming the cause."""

from __future__ import annotations

import functools
import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from protos.sampling_params import SamplingParams
from services.config import ConfigError
from services.engine.llm import LLM
from tests.services.engine.conftest import rank_processes, tokenizer_dir
from tests.services.engine.quantization import checkpoints as ck

# every engine here on the test tokenizer, loaded once (tests/services/engine/_tp_tokenizers.py)
pytestmark = pytest.mark.usefixtures("tokenizers_loaded_once")

# head_dim 128: a rank's 2 query heads (256 rows), its KV head (128 rows) and its half of the
# 512 MLP rows all fall on 128-row fp8 blocks and int4 groups of 128 input columns
SPLITTABLE = {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 128}  # fmt: skip
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module", autouse=True)
def no_rank_left() -> Iterator[None]:
    yield
    assert rank_processes() == [], "a tensor-parallel rank outlived its engine"


def _prompts() -> list[list[int]]:
    rng = random.Random(11)
    return [[rng.randrange(3, 256) for _ in range(n)] for n in (1, 9, 40)]


def _checkpoint(root: Path, fmt: str, **config: Any) -> Path:
    config = config or SPLITTABLE
    if fmt.startswith("fp8-"):
        path = ck.fp8_checkpoint(root / fmt, fmt.removeprefix("fp8-"), **config)[0]
    elif fmt == "float":
        cfg = ck.tiny_config(**config)
        path = ck.write(root / fmt, cfg, ck.random_weights(cfg))
    else:
        path = ck.int4_checkpoint(root / fmt, fmt, **config)[0]
    _tokenizer().save_pretrained(path)  # the engine detokenizes (ids < 256 stay ids)
    return path


@functools.cache
def _tokenizer() -> Any:
    from services.engine.llm_engine import load_tokenizer

    return load_tokenizer(tokenizer_dir())


def _tokens(path: Path, size: int, **knobs: Any) -> list[list[int]]:
    with LLM(str(path), dtype="float32", tensor_parallel_size=size, **knobs) as llm:
        return [r.outputs[0].token_ids for r in llm.generate(_prompts(), GREEDY)]


@pytest.mark.parametrize("fmt", ["fp8-block", "fp8-channel", "fp8-tensor", "awq", "gptq"])
def test_two_ranks_give_the_tokens_of_one(fmt: str, tmp_path: Path) -> None:
    """Each rank reads its slice of the packed weights, zero points and scales straight from
    the file; the row-parallel layers (o_proj, down_proj) sum their partial products."""
    path = _checkpoint(tmp_path, fmt)
    assert _tokens(path, 2) == _tokens(path, 1)


def test_fp8_quantized_at_load_time_on_two_ranks(tmp_path: Path) -> None:
    """--quantization fp8 quantizes each rank's float slice: the column-parallel layers get the
    per-channel scales of one rank as they are, a row-parallel layer's ranks agree on each
    row's magnitude first, so two ranks hold the fp8 model of one."""
    path = _checkpoint(tmp_path, "float")
    one = _tokens(path, 1, quantization="fp8")
    assert one != _tokens(path, 1)  # the fp8 weights were used
    assert _tokens(path, 2, quantization="fp8") == one


def test_what_cannot_be_split_is_refused_before_a_rank_starts(tmp_path: Path) -> None:
    """head_dim 32: a rank's 64 query rows cut a 128-row fp8 block; GPTQ act-order groups
    mix every rank's input columns."""
    block = _checkpoint(tmp_path, "fp8-block", head_dim=32)
    with pytest.raises(ConfigError, match=r"q_proj rows \[0, 64\) .* fp8 block unit of 128 rows"):
        LLM(str(block), dtype="float32", tensor_parallel_size=2)
    act_order = ck.int4_checkpoint(tmp_path / "act", "gptq", desc_act=True, **SPLITTABLE)[0]
    _tokenizer().save_pretrained(act_order)
    assert json.loads((act_order / "config.json").read_text())["quantization_config"]["desc_act"]
    with pytest.raises(ConfigError, match="act-order"):
        LLM(str(act_order), dtype="float32", tensor_parallel_size=2)


@pytest.mark.parametrize("fmt", ["awq", "gptq"])
def test_int4_deepseek_heads_off_the_groups_are_refused(fmt: str, tmp_path: Path) -> None:
    """DeepSeek-V2 in int4 groups of 32 over 4 ranks: a rank's one head is 16 of o_proj's
    input columns, half a group (the dense MLP's and q's cuts whole units): refused before a
    rank starts, naming the cut."""
    path, _ = ck.deepseek_checkpoints(tmp_path, "deepseek_v2", fmt=fmt)
    unit = rf"{fmt.upper()} unit of 32 columns"
    with pytest.raises(ConfigError, match=rf"rank 0's o_proj input columns \[0, 16\) .* {unit}"):
        LLM(str(path), dtype="float32", tensor_parallel_size=4)
    assert rank_processes() == []


def test_fp8_experts_quantized_at_load_time_on_two_ranks(tmp_path: Path) -> None:
    """--quantization fp8 of a float Mixtral: each rank's experts hold their intermediate rows
    in FP8, the down projections' rows (split over the ranks) with the magnitudes agreed, so
    two ranks give the tokens of one."""
    cfg = ck.tiny_config(**ck.MOE["mixtral"])
    path = ck.write(tmp_path / "mixtral", cfg, ck.moe_weights(cfg))
    _tokenizer().save_pretrained(path)
    one = _tokens(path, 1, quantization="fp8")
    assert one != _tokens(path, 1)  # the fp8 weights were used
    assert _tokens(path, 2, quantization="fp8") == one


@pytest.mark.parametrize(
    ("family", "fmt"), [("qwen3_moe", "fp8-block"), ("qwen3_moe", "awq"), ("qwen2_moe", "gptq")]
)
def test_quantized_experts_on_two_ranks_give_the_tokens_of_one(
    family: str, fmt: str, tmp_path: Path
) -> None:
    """A Qwen3-MoE checkpoint's experts (FP8 blocks, or AWQ / GPTQ int4 held packed): each
    rank reads its half of every expert's intermediate rows, in each piece's units (packed
    words, scales, zeros), and sums the down projections' partial products with the rest;
    Qwen2-MoE's GPTQ shared expert cut alike (128 of its 256 rows a rank), its gate whole."""
    import torch

    from services.engine.models.moe import Experts

    shapes = {**SPLITTABLE, "moe_intermediate_size": 256}  # 128 rows a rank: whole units
    path = ck.moe_checkpoint(tmp_path / fmt, family, fmt, config=shapes)[0]
    _tokenizer().save_pretrained(path)
    with LLM(str(path), dtype="float32", tensor_parallel_size=2) as llm:
        two = [r.outputs[0].token_ids for r in llm.generate(_prompts(), GREEDY)]
        experts = [m for m in llm.engine.runner.model.modules() if isinstance(m, Experts)]
        held = {m.gate_up_proj.dtype for m in experts}
        rows = {m.down_proj.shape[-1] * (8 if fmt != "fp8-block" else 1) for m in experts}
        if family == "qwen2_moe":
            shared = llm.engine.runner.model.model.layers[0].mlp.shared_expert
            assert shared.down_proj.in_features == 128  # rank 0's half of its 256 rows
    assert held == {torch.float8_e4m3fn if fmt == "fp8-block" else torch.int32}  # not dequantized
    assert rows == {128}  # rank 0's half of each expert's 256 intermediate rows
    assert two == _tokens(path, 1)


@pytest.mark.parametrize(
    ("model_type", "fmt"),
    [("deepseek_v3", "fp8"), ("glm4_moe", "fp8"), ("deepseek_v3", "awq"),
     ("deepseek_v2", "gptq"), ("glm4_moe", "gptq")],
)  # fmt: skip
def test_quantized_deepseek_on_two_ranks_gives_the_tokens_of_one(
    model_type: str, fmt: str, tmp_path: Path
) -> None:
    """DeepSeek-V3's FP8 block format (16 x 16 blocks here: each rank's 2 heads and half of
    every expert's rows are whole blocks), and AWQ and GPTQ int4 in groups of 32 (each rank's
    o_proj columns and half of the MLP's, shared and routed experts' rows whole groups): each
    rank reads its heads' rows of q_b_proj (V2's q_proj) and kv_b_proj (dequantized as they
    load) with their block scales or packed words, zeros and group scales, its o_proj columns,
    its half of the dense MLP's, the shared expert's and every routed expert's rows; GLM-4.5 its
    attention heads and its shared expert's rows alike."""
    import torch

    path, _ = ck.deepseek_checkpoints(tmp_path, model_type, block=16 if fmt == "fp8" else 32, fmt=fmt)  # fmt: skip
    shared = ck.DEEPSEEK_INT4["moe_intermediate_size"] if fmt != "fp8" else 32
    prompts = _prompts()
    with LLM(str(path), dtype="float32", tensor_parallel_size=2) as llm:
        two = [r.outputs[0].token_ids for r in llm.generate(prompts, GREEDY)]
        model = llm.engine.runner.model
        moe = model.model.layers[1].mlp
        # held in FP8 or packed int4, cut: rank 0's half of each expert's rows
        held = torch.float8_e4m3fn if fmt == "fp8" else torch.int32
        assert moe.experts.gate_up_proj.dtype == held
        assert moe.experts.gate_up_proj.shape[1] == shared  # gate and up: half of each
        assert moe.shared_experts.down_proj.in_features == shared // 2  # rank 0's half
        if model_type != "glm4_moe":  # rank 0's 2 heads of kv_b (nope key + value rows)
            assert model.model.layers[1].self_attn.kv_b_proj.weight.shape[0] == 2 * 32
    with LLM(str(path), dtype="float32") as llm:
        assert two == [r.outputs[0].token_ids for r in llm.generate(prompts, GREEDY)]
