"""The named configs of services/engine/configs: the published shapes, built on the meta device
(no memory), as the engine reads them and as the transformers peer does."""

from __future__ import annotations

import json

import pytest
import torch

from protos.multimodal import VisionSpec
from services.engine.loader import _no_param_init
from services.engine.model_config import ArchConfig
from services.engine.models.gemma3 import Gemma3ForCausalLM
from services.engine.models.llama import LlamaForCausalLM
from services.engine.models.qwen2_vl import Qwen2VLForCausalLM
from services.engine.models.qwen3_vl import Qwen3VLForCausalLM
from services.engine.rope import cos_sin_cache
from services.model_files import named_configs, named_model_dir, resolve_model


def _params(arch: ArchConfig) -> dict[str, int]:
    cls: type[LlamaForCausalLM] = LlamaForCausalLM
    if arch.gemma is not None:
        cls = Gemma3ForCausalLM
    if arch.vision is not None:
        cls = Qwen3VLForCausalLM if arch.vision.qwen3 else Qwen2VLForCausalLM
    with torch.device("meta"), _no_param_init():
        model = cls(arch, 64)
    return {name: p.numel() for name, p in model.named_parameters()}


def test_every_named_config_is_listed_and_reads() -> None:
    names = named_configs()
    assert {"llama-3.1-8b", "qwen3-8b", "qwen3-30b-a3b", "qwen2-vl-7b", "qwen3-vl-8b"} <= set(names)
    for path in names.values():
        ArchConfig.from_file(path)


def test_gemma_3_1b_has_the_published_shape() -> None:
    """Gemma 3 1B: 26 layers, every sixth global (a 512-token window on the others), one KV
    head of 256, 262k tied embeddings: about a billion parameters."""
    arch = ArchConfig.from_file(resolve_model("gemma-3-1b").path)
    assert arch.gemma is not None and arch.tie_word_embeddings and arch.qk_norm
    assert (arch.num_layers, arch.num_heads, arch.num_kv_heads, arch.head_dim) == (26, 4, 1, 256)
    assert arch.sliding_window == 512
    assert [i for i in range(26) if i not in arch.sliding_layers] == [5, 11, 17, 23]
    assert (arch.rope_theta, arch.gemma.local_rope_theta, arch.gemma.query_scale) == (
        1e6,
        1e4,
        1 / 16,
    )
    assert sum(_params(arch).values()) == pytest.approx(1.0e9, rel=0.01)


def test_qwen3_30b_a3b_has_the_published_shape() -> None:
    files = resolve_model("qwen3-30b-a3b")
    arch = ArchConfig.from_file(files.path)
    assert files.kind == "named" and named_model_dir(files) is None
    assert (arch.model_type, arch.hidden_size, arch.num_layers) == ("qwen3_moe", 2048, 48)
    assert (arch.num_heads, arch.num_kv_heads, arch.head_dim) == (32, 4, 128)
    assert (arch.vocab_size, arch.rope_theta, arch.qk_norm) == (151936, 1e6, True)
    moe = arch.moe
    assert moe is not None and moe.layers == tuple(range(48))
    assert (moe.num_experts, moe.top_k, moe.intermediate_size, moe.renormalize) == (
        128,
        8,
        768,
        True,
    )
    params = _params(arch)
    total = sum(params.values())
    experts = sum(n for name, n in params.items() if ".experts." in name)
    active = total - experts + experts * moe.top_k // moe.num_experts
    assert total == pytest.approx(30.53e9, rel=2e-3)  # "30.5B in total, 3.3B activated"
    assert active == pytest.approx(3.35e9, rel=1e-2)
    assert total * 2 / 1e9 == pytest.approx(61.1, abs=0.1)  # GB in bf16: an 80 GB GPU holds it


def test_qwen2_vl_7b_is_a_directory_with_its_preprocessor_config() -> None:
    files = resolve_model("qwen2-vl-7b")
    directory = named_model_dir(files)
    assert files.kind == "named" and directory is not None
    arch = ArchConfig.from_file(files.path)
    assert (arch.model_type, arch.hidden_size, arch.num_layers, arch.vocab_size) == (
        "qwen2_vl", 3584, 28, 152064,
    )  # fmt: skip
    assert (arch.num_heads, arch.num_kv_heads, arch.intermediate_size) == (28, 4, 18944)
    vis = arch.vision
    assert vis is not None and (vis.depth, vis.embed_dim, vis.num_heads) == (32, 1280, 16)
    assert (vis.image_token_id, vis.mrope_section) == (151655, (16, 24, 24))
    assert sum(_params(arch).values()) == pytest.approx(8.29e9, rel=2e-3)
    # the published rope_scaling {"type": "mrope"}: default frequencies, split 3-D elsewhere
    default = cos_sin_cache(arch.head_dim, 8, arch.rope_theta)
    assert torch.equal(cos_sin_cache(arch.head_dim, 8, arch.rope_theta, arch.rope_scaling), default)
    spec = VisionSpec.of_model_dir(directory)
    assert spec is not None
    assert (spec.image_token_id, spec.vision_start_id, spec.vision_end_id) == (
        151655,
        151652,
        151653,
    )
    assert (spec.patch_size, spec.merge_size, spec.temporal_patch_size) == (14, 2, 2)
    assert (spec.min_pixels, spec.max_pixels) == (3136, 12845056)
    grid = spec.grid(448, 448)
    assert grid == (1, 32, 32) and spec.tokens_of(grid) == 256  # W1 with images: 256 per prompt
    pre = json.loads((directory / "preprocessor_config.json").read_text())
    assert pre["image_mean"][0] == pytest.approx(0.48145466)


def test_qwen2_vl_7b_preprocesses_a_448_image_into_the_grid_its_tokens_were_counted_for() -> None:
    from services.engine.bench.hf_peer import image_prompts
    from services.engine.vision import load_image_processor, preprocess

    directory = named_model_dir(resolve_model("qwen2-vl-7b"))
    assert directory is not None
    spec = VisionSpec.of_model_dir(directory)
    assert spec is not None
    prompts, images = image_prompts(spec, [[151655, 5, 6]], 448)
    ((image,),), (ids,) = images, prompts
    assert image.grid == (1, 32, 32) and (image.offset, image.num_tokens) == (1, 256)
    assert ids[0] == spec.vision_start_id and ids[257] == spec.vision_end_id
    assert ids.count(spec.image_token_id) == 256 and ids[258:] == [100, 5, 6]  # no stray image id
    pixels = preprocess(load_image_processor(directory), image)
    assert pixels.shape == (32 * 32, 3 * 2 * 14 * 14)


def test_qwen3_vl_8b_has_the_published_shape() -> None:
    from services.engine.bench.hf_peer import image_prompts
    from services.engine.vision import load_image_processor, preprocess

    files = resolve_model("qwen3-vl-8b")
    directory = named_model_dir(files)
    assert files.kind == "named" and directory is not None
    arch = ArchConfig.from_file(files.path)
    assert (arch.model_type, arch.hidden_size, arch.num_layers, arch.vocab_size) == (
        "qwen3_vl", 4096, 36, 151936,
    )  # fmt: skip
    assert (arch.num_heads, arch.num_kv_heads, arch.head_dim) == (32, 8, 128)
    assert (arch.rope_theta, arch.qk_norm, arch.attention_bias) == (5e6, True, False)
    vis = arch.vision
    assert vis is not None and (vis.depth, vis.embed_dim, vis.num_heads) == (27, 1152, 16)
    assert (vis.mrope_section, vis.mrope_interleaved) == ((24, 20, 20), True)
    assert (vis.deepstack_blocks, vis.num_position_embeddings) == ((8, 16, 24), 2304)
    assert sum(_params(arch).values()) == pytest.approx(8.77e9, rel=2e-3)  # "8.77B"
    spec = VisionSpec.of_model_dir(directory)
    assert spec is not None and (spec.patch_size, spec.min_pixels) == (16, 65536)
    prompts, images = image_prompts(spec, [[151655, 5, 6]], 448)
    ((image,),), (ids,) = images, prompts
    assert image.grid == (1, 28, 28) and image.num_tokens == 196  # 448 / 32 = 14 a side
    assert ids.count(spec.image_token_id) == 196
    pixels = preprocess(load_image_processor(directory), image)
    assert pixels.shape == (28 * 28, 3 * 2 * 16 * 16)


def test_gpt_oss_20b_has_the_published_shape() -> None:
    """gpt-oss-20b: 24 layers alternating a 128-key window and the whole context, 64 query
    heads over 8 KV heads of 64, top-4 of 32 biased experts with the clamped SwiGLU, sinks,
    MXFP4 experts (dequantized as they load): about 21 billion parameters."""
    arch = ArchConfig.from_file(resolve_model("gpt-oss-20b").path)
    assert arch.moe is not None and arch.moe.mxfp4 and arch.moe.biases and arch.attention_sinks
    assert (arch.moe.num_experts, arch.moe.top_k, arch.moe.swiglu_limit) == (32, 4, 7.0)
    assert arch.sliding_window == 128 and arch.sliding_layers == tuple(range(0, 24, 2))
    assert arch.quantization_config == {}  # served unquantized once dequantized
    assert sum(_params(arch).values()) == pytest.approx(20.9e9, rel=0.01)


def test_deepseek_v2_lite_has_the_published_shape() -> None:
    """DeepSeek-V2-Lite: 27 layers of MLA (no q LoRA, a 512-wide latent and 64 rotary dims: the
    KV cache's 576 values a token and layer), the first dense, then 64 routed experts (6 a
    token) and 2 shared: "15.7B total parameters, 2.4B activated"."""
    from services.engine.models.deepseek import DeepseekForCausalLM

    arch = ArchConfig.from_file(resolve_model("deepseek-v2-lite").path)
    mla, moe = arch.mla, arch.moe
    assert mla is not None and moe is not None
    assert (mla.q_lora_rank, mla.kv_lora_rank, mla.qk_rope_head_dim) == (0, 512, 64)
    assert (moe.num_experts, moe.top_k, moe.layers) == (64, 6, tuple(range(1, 27)))
    # the latent cache: 27 layers x (512 + 64) values a token, one plane (bf16: 31 KB)
    assert arch.kv_bytes_per_token(2) == 27 * 576 * 2
    with torch.device("meta"), _no_param_init():
        model = DeepseekForCausalLM(arch, 64)
    params = {name: p.numel() for name, p in model.named_parameters()}
    total = sum(params.values())
    experts = sum(n for name, n in params.items() if ".experts." in name)
    active = total - experts + experts * moe.top_k // moe.num_experts
    assert total == pytest.approx(15.7e9, rel=5e-3)
    # activated: what a token multiplies by (the input embedding is a lookup, not counted)
    assert active - params["model.embed_tokens.weight"] == pytest.approx(2.4e9, rel=3e-2)
