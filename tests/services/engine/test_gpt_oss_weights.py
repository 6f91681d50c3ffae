"""gpt-oss's MXFP4 experts: the format's values, and a tiny checkpoint written in it served as
transformers serves the same weights in float32."""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from protos.sampling_params import SamplingParams
from services.config import ConfigError
from services.engine.gpt_oss_weights import FP4_VALUES, MXFP4_BLOCK, dequantize_mxfp4
from services.engine.llm import LLM
from tests.services.engine.conftest import BESIDE, save_test_tokenizer


def test_codes_take_their_values_low_nibble_first_times_the_block_power_of_two() -> None:
    blocks = torch.zeros(2, 16, dtype=torch.uint8)
    blocks[0, 0] = 0x21  # low nibble 1 (0.5), high nibble 2 (1.0)
    blocks[0, 1] = 0xF7  # 7 (6.0), then 15 (-6.0)
    blocks[1, 15] = 0x9A  # 10 (-1.0), then 9 (-0.5)
    scales = torch.tensor([128, 120], dtype=torch.uint8)  # 2 ** 1, 2 ** -7
    got = dequantize_mxfp4(blocks, scales, torch.float32)
    assert got.shape == (2 * MXFP4_BLOCK,)
    want = torch.zeros(64)
    want[:4] = torch.tensor([0.5, 1.0, 6.0, -6.0]) * 2
    want[62:] = torch.tensor([-1.0, -0.5]) * 2**-7
    assert torch.equal(got, want)


def test_malformed_blocks_are_refused() -> None:
    with pytest.raises(ConfigError, match="must be"):
        dequantize_mxfp4(
            torch.zeros(2, 8, dtype=torch.uint8), torch.zeros(2, dtype=torch.uint8), torch.float32
        )
    with pytest.raises(ConfigError, match="uint8"):
        dequantize_mxfp4(torch.zeros(1, 16), torch.zeros(1, dtype=torch.uint8), torch.float32)


def _quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., K] float as MXFP4 ([..., K/32, 16] codes, [..., K/32] exponents): each block's
    power of two the least that brings its largest magnitude within 6, each value its nearest
    code."""
    blocks = w.unflatten(-1, (-1, MXFP4_BLOCK))  # [..., G, 32]
    peak = blocks.abs().amax(-1).clamp_min(1e-30)
    exp = torch.ceil(torch.log2(peak / 6.0)).clamp(-127, 127)  # [..., G]
    lut = torch.tensor(FP4_VALUES)
    scaled = blocks / torch.exp2(exp)[..., None]
    codes = (scaled[..., None] - lut).abs().argmin(-1).to(torch.uint8)  # [..., G, 32]
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)  # [..., G, 16]
    return packed, (exp + 127).to(torch.uint8)


@pytest.fixture(scope="module")
def mxfp4_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object]:
    """A tiny gpt-oss whose experts are stored as MXFP4 (as the published checkpoints), and
    transformers' model holding exactly the values those blocks stand for."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = AutoConfig.for_model(
        "gpt_oss", vocab_size=49152, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
        num_experts_per_tok=2, sliding_window=16, initializer_range=0.2, bos_token_id=None,
        eos_token_id=None, max_position_embeddings=1024,
    )  # fmt: skip
    hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    path = tmp_path_factory.mktemp("gpt-oss-mxfp4")
    hf.save_pretrained(path)
    save_test_tokenizer(path)
    tensors = load_file(path / "model.safetensors")
    params = dict(hf.named_parameters())
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = _quantize(tensors.pop(name).transpose(1, 2).contiguous())  # [E, out, in]
        tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
        with torch.no_grad():  # transformers' model holds what the blocks stand for
            params[name].copy_(dequantize_mxfp4(blocks, scales, torch.float32).transpose(1, 2))
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                   "model.embed_tokens", "lm_head"],
    }  # fmt: skip
    (path / "config.json").write_text(json.dumps(config))
    return path, hf


def test_an_mxfp4_checkpoint_serves_the_values_its_blocks_stand_for(
    mxfp4_checkpoint: tuple[Path, object], caplog: pytest.LogCaptureFixture
) -> None:
    path, hf = mxfp4_checkpoint
    rng = random.Random(3)
    prompts = [[rng.randrange(49152) for _ in range(n)] for n in (5, 40)]
    with caplog.at_level(logging.INFO):
        llm = LLM(str(path), **BESIDE)
    assert "MXFP4" in caplog.text  # start-up says what it did with them
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    for prompt, out in zip(prompts, outs, strict=True):
        with torch.no_grad():
            want = hf.generate(  # type: ignore[attr-defined]
                torch.tensor([prompt]), max_new_tokens=12, min_new_tokens=12, do_sample=False,
                pad_token_id=0,
            )[0, len(prompt) :].tolist()  # fmt: skip
        assert out.outputs[0].token_ids == want


def test_an_mxfp4_tensor_without_its_scales_is_refused(
    mxfp4_checkpoint: tuple[Path, object], tmp_path: Path
) -> None:
    path, _ = mxfp4_checkpoint
    for f in path.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.1.mlp.experts.down_proj_scales"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ConfigError, match="without their blocks or scales"):
        LLM(str(tmp_path), **BESIDE)
