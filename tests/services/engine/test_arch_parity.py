"""Mixture-of-Experts models in our engine against transformers: tiny random Qwen3-MoE and
Mixtral checkpoints (float32, seeded), greedy, token for token."""

from __future__ import annotations

import os
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from kernels import ops
from protos.sampling_params import SamplingParams
from services.engine.llm import LLM
from services.engine.llm_engine import load_tokenizer
from services.model_files import prepare_model

VOCAB = 49152  # the embedded tokenizer's
COMMON = {
    "vocab_size": VOCAB, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 1024, "initializer_range": 0.2, "bos_token_id": None,
    "eos_token_id": None,
}  # fmt: skip
CONFIGS = {
    # layer 1 dense (mlp_only_layers), the router's top-2 weights left unnormalized
    "qwen3_moe-dense-layer": ("qwen3_moe", {
        "num_hidden_layers": 3, "head_dim": 16, "intermediate_size": 96,
        "moe_intermediate_size": 32, "num_experts": 8, "num_experts_per_tok": 2,
        "norm_topk_prob": False, "mlp_only_layers": [1],
    }),
    # every second layer sparse (decoder_sparse_step), top-4 of 16 renormalized
    "qwen3_moe-sparse-step": ("qwen3_moe", {
        "num_hidden_layers": 4, "head_dim": 16, "intermediate_size": 80,
        "moe_intermediate_size": 24, "num_experts": 16, "num_experts_per_tok": 4,
        "norm_topk_prob": True, "decoder_sparse_step": 2,
    }),
    "mixtral": ("mixtral", {
        "num_hidden_layers": 2, "intermediate_size": 48, "num_local_experts": 4,
        "num_experts_per_tok": 2,
    }),
}  # fmt: skip
PROMPT_LENS = [1, 4, 9, 23, 61, 150]  # 150 > the CPU's 128-token step: a chunked prefill
NEW_TOKENS = 16


def _build(path: Path, model_type: str, extra: dict[str, Any]) -> Any:
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = AutoConfig.for_model(model_type, **COMMON, **extra)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.save_pretrained(path)
    load_tokenizer(str(prepare_model("embedded").hf_dir)).save_pretrained(path)
    return model.eval()


def _prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB) for _ in range(n)] for n in PROMPT_LENS]


def _hf_greedy(model: Any, prompt: list[int]) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
            do_sample=False, pad_token_id=0,
        )  # fmt: skip
    return out[0, len(prompt) :].tolist()


Built = tuple[Path, Any]  # the checkpoint's directory, transformers' model of it


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Built]:
    cache: dict[str, Built] = {}

    def get(name: str) -> Built:
        if name not in cache:
            path = tmp_path_factory.mktemp(name)
            cache[name] = (path, _build(path, *CONFIGS[name]))
        return cache[name]

    return get


def _assert_greedy_matches(name: str, path: Path, hf: Any) -> None:
    prompts = _prompts(len(name))
    ours = LLM(str(path)).generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    )
    for prompt, got in zip(prompts, ours, strict=True):
        want = _hf_greedy(hf, prompt)
        assert got.outputs[0].token_ids == want, f"{name}: diverged on a {len(prompt)}-token prompt"


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_matches_transformers(name: str, built: Callable[[str], Built]) -> None:
    _assert_greedy_matches(name, *built(name))


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="the Triton kernel on the CPU: TRITON_INTERPRET=1",
)
@pytest.mark.parametrize("name", ["qwen3_moe-dense-layer", "mixtral"])
def test_greedy_matches_transformers_through_the_triton_kernel(
    name: str, built: Callable[[str], Built], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine's CPU path runs the reference; here the model calls the fused Triton kernel
    (under the interpreter) instead, and must still give transformers' tokens."""
    from kernels import triton_moe

    monkeypatch.setattr(ops, "fused_moe", triton_moe.fused_moe)
    _assert_greedy_matches(name, *built(name))
