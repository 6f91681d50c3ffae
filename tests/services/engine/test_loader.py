"""Loading MoE checkpoints: per-expert tensors (Qwen3-MoE's names, Mixtral's w1/w3/w2) stacked
into one tensor per layer, transformers' own stacked layout accepted too, and a checkpoint that
lacks an expert, or a quantized MoE, refused."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from services.config import ConfigError, ModelConfig
from services.engine.loader import iter_safetensors, load_model, load_weights
from services.engine.model_config import ArchConfig
from services.engine.models.llama import LlamaForCausalLM

TINY = {"vocab_size": 128, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
        "num_key_value_heads": 1, "max_position_embeddings": 64}  # fmt: skip
ARCHS = {
    "qwen3_moe": {"intermediate_size": 48, "moe_intermediate_size": 16, "num_experts": 4,
                  "num_experts_per_tok": 2, "head_dim": 16, "mlp_only_layers": [1]},
    "mixtral": {"intermediate_size": 24, "num_local_experts": 3, "num_experts_per_tok": 2},
}  # fmt: skip


@pytest.fixture(scope="module", params=list(ARCHS))
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:  # fmt: skip
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = AutoConfig.for_model(request.param, **TINY, **ARCHS[request.param])
    hf = AutoModelForCausalLM.from_config(cfg)
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)  # per-expert tensors, as on the Hub
    return path, hf


def _empty_model(path: Path) -> LlamaForCausalLM:
    return LlamaForCausalLM(ArchConfig.from_file(path / "config.json"), 64)


def test_per_expert_tensors_are_stacked(checkpoint: tuple[Path, Any]) -> None:
    path, hf = checkpoint
    names = [name for name, _ in iter_safetensors(path)]
    assert any(".experts.0." in n for n in names)  # the Hub's layout, not transformers' memory
    model = _empty_model(path)
    load_weights(model, iter_safetensors(path))
    ours, theirs = model.state_dict(), hf.state_dict()
    for name in ("model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj",
                 "model.layers.0.mlp.gate.weight"):  # fmt: skip
        assert torch.equal(ours[name], theirs[name])


def test_transformers_stacked_layout_loads_too(checkpoint: tuple[Path, Any]) -> None:
    path, hf = checkpoint
    model = _empty_model(path)
    load_weights(model, iter(hf.state_dict().items()))
    assert torch.equal(
        model.model.layers[0].mlp.experts.gate_up_proj,
        hf.model.layers[0].mlp.experts.gate_up_proj,
    )


def test_a_missing_expert_is_refused(checkpoint: tuple[Path, Any]) -> None:
    path, _ = checkpoint
    weights = ((n, t) for n, t in iter_safetensors(path) if ".experts.1." not in n)
    with pytest.raises(ConfigError, match="missing"):
        load_weights(_empty_model(path), weights)


def test_online_fp8_quantizes_the_experts_too(checkpoint: tuple[Path, Any]) -> None:
    """--quantization fp8 on an MoE model: its attention quantized, and its experts, one scale
    per output row of each expert, held in FP8."""
    from kernels.moe import quantize_fp8_experts
    from services.engine.quantization.fp8 import Fp8Linear

    path, hf = checkpoint
    model, _, _ = load_model(ModelConfig(str(path), quantization="fp8"), torch.device("cpu"), 64)
    assert isinstance(model.model.layers[0].self_attn.o_proj, Fp8Linear)
    experts = model.model.layers[0].mlp.experts
    assert experts.fp8 and experts.down_proj.dtype == torch.float8_e4m3fn
    q, scale = quantize_fp8_experts(hf.model.layers[0].mlp.experts.down_proj, None, False)
    assert torch.equal(experts.down_proj.view(torch.uint8), q.view(torch.uint8))
    assert experts.down_proj_scale is not None
    assert torch.equal(experts.down_proj_scale, scale)


def test_a_model_that_cannot_fit_the_host_is_refused_before_loading(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # the 8B shape in float32 is 32 GB: the OOM killer would end a CPU worker with no word
    from services.engine import loader

    monkeypatch.setattr(loader, "available_host_bytes", lambda: 24 << 30)
    config = ModelConfig(model="llama-3.1-8b", dtype="float32")
    with pytest.raises(ConfigError, match=r"needs 29\.\d GiB .* only 24\.0 GiB .* available"):
        loader.load_model(config, torch.device("cpu"), 64)
    monkeypatch.setattr(loader, "available_host_bytes", lambda: 1 << 20)
    with pytest.raises(ConfigError, match="smaller model"):
        loader.load_model(ModelConfig(model="smollm2-135m"), torch.device("cpu"), 64)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/meminfo is Linux's")
def test_the_available_memory_is_read_on_linux() -> None:
    from services.engine.loader import available_host_bytes

    avail = available_host_bytes()
    assert avail is not None and 0 < avail < 1 << 50


@pytest.mark.parametrize("cut", ["truncated", "foreign"])
def test_a_weights_file_safetensors_cannot_read_is_named(tmp_path: Path, cut: str) -> None:
    """An interrupted download: a ConfigError naming the file (the CLI's exit 2), no traceback
    out of safetensors."""
    from safetensors.torch import save_file

    file = tmp_path / "model-00002-of-00002.safetensors"
    save_file({"w": torch.zeros(256, 256)}, str(file))
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2] if cut == "truncated" else b"\0" * 1000)
    with pytest.raises(ConfigError, match=rf"{file.name} is not a readable safetensors file"):
        list(iter_safetensors(tmp_path))


def test_a_model_directory_without_tokenizer_files_is_a_config_error(tmp_path: Path) -> None:
    from services.engine.llm_engine import load_tokenizer

    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(ConfigError, match=r"tokenizer of .*: it holds none of tokenizer\.json"):
        load_tokenizer(str(tmp_path))


@pytest.mark.parametrize("stored", ["lm_head apart", "lm_head only", "both equal"])
def test_a_tied_config_reads_the_lm_head_the_checkpoint_stores_as_transformers_does(
    tmp_path: Path, stored: str
) -> None:
    """A tied config whose checkpoint holds an lm_head: transformers 5 unties the two where the
    lm_head's values differ from the embedding's (its logits from that lm_head), and ties the
    embedding to it where it is the only one stored. The engine skipped the lm_head, serving
    the embedding's logits (other tokens), or refused the second as missing its embedding."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    from protos.sampling_params import SamplingParams
    from services.engine.llm import LLM
    from tests.services.engine.conftest import (
        BESIDE,
        tiny_checkpoint,
        token_prompts,
        transformers_greedy,
    )

    path = tiny_checkpoint(
        tmp_path / "tied", "qwen2", num_hidden_layers=2, hidden_size=64, intermediate_size=96,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
    )  # fmt: skip
    tensors = load_file(path / "model.safetensors")
    embedding = tensors["model.embed_tokens.weight"]
    if stored == "lm_head apart":
        tensors["lm_head.weight"] = torch.randn_like(embedding) * 0.2
    elif stored == "lm_head only":
        tensors["lm_head.weight"] = tensors.pop("model.embed_tokens.weight")
    else:
        tensors["lm_head.weight"] = embedding.clone()
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    arch = ArchConfig.from_file(path / "config.json")
    assert arch.tie_word_embeddings == (stored != "lm_head apart")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = token_prompts(5, [3, 40])
    ours = LLM(str(path), **BESIDE).generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    )
    for prompt, out in zip(prompts, ours, strict=True):
        assert out.outputs[0].token_ids == transformers_greedy(hf, prompt, 8)


def test_missing_projections_are_named_as_the_checkpoint_names_them(tmp_path: Path) -> None:
    """A checkpoint short of a layer's q/k/v and gate/up (a config of more layers than it
    holds) is refused naming q_proj, gate_proj, ...: the error named our stacked qkv_proj and
    gate_up_proj, which no file of a Llama checkpoint holds."""
    from safetensors.torch import load_file, save_file

    from tests.services.engine.conftest import tiny_checkpoint

    path = tiny_checkpoint(
        tmp_path / "llama", "llama", num_hidden_layers=2, hidden_size=64, intermediate_size=96,
        num_attention_heads=4, num_key_value_heads=2,
    )  # fmt: skip
    tensors = load_file(path / "model.safetensors")
    for piece in ("self_attn.k_proj", "mlp.up_proj"):
        del tensors[f"model.layers.1.{piece}.weight"]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    model = _empty_model(path)
    with pytest.raises(ConfigError) as refused:
        load_weights(model, iter_safetensors(path))
    said = str(refused.value)
    assert "model.layers.1.self_attn.k_proj.weight" in said
    assert "model.layers.1.mlp.up_proj.weight" in said
    assert "qkv_proj" not in said and "gate_up_proj" not in said
