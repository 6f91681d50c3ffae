"""Each text architecture in our engine against transformers: tiny random Llama, Mistral, Qwen2,
Qwen3 (also with YaRN rope scaling), Gemma 1, 2 and 3, Qwen3-MoE, Qwen2-MoE, Mixtral, Phi-3, SmolLM3,
gpt-oss, OLMo 2 and 3, GLM and GLM-4, StarCoder2, Cohere, ERNIE 4.5, Seed-OSS, EXAONE 4,
Arcee, OLMoE, Granite MoE and ERNIE 4.5 MoE checkpoints
(float32, seeded), greedy, token for token, sliding windows included (Mistral's on every layer,
Qwen2's from max_window_layers on, Gemma 3's on its local layers, SmolLM3's on its NoPE ones),
Phi's partial rotary and LongRoPE, and Granite's scalings."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from kernels import ops
from protos.sampling_params import InvalidRequestError, SamplingParams
from services.engine.llm import LLM
from tests.services.engine.conftest import (
    BESIDE,
    save_test_tokenizer,
    token_prompts,
    transformers_greedy,
)

# every engine here on the test tokenizer, loaded once (tests/services/engine/_tp_tokenizers.py)
pytestmark = pytest.mark.usefixtures("tokenizers_loaded_once")

VOCAB = 49152  # the embedded tokenizer's
COMMON = {
    "vocab_size": VOCAB, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 1024, "initializer_range": 0.2, "bos_token_id": None,
    "eos_token_id": None,
}  # fmt: skip
CONFIGS = {
    "llama": ("llama", {"num_hidden_layers": 2, "intermediate_size": 96}),
    # attention_bias (q, k, v and o) and mlp_bias (gate, up, down)
    "llama-biases": ("llama", {
        "num_hidden_layers": 2, "intermediate_size": 96, "attention_bias": True, "mlp_bias": True,
    }),
    # no window here (transformers' default is 4096): the windowed one is its own test below
    "mistral": ("mistral", {
        "num_hidden_layers": 2, "intermediate_size": 96, "head_dim": 32, "sliding_window": None,
    }),
    "qwen2": ("qwen2", {"num_hidden_layers": 2, "intermediate_size": 96}),  # q/k/v biases
    # the second layer through a 24-key window (use_sliding_window, max_window_layers 1)
    "qwen2-window": ("qwen2", {
        "num_hidden_layers": 2, "intermediate_size": 96, "use_sliding_window": True,
        "sliding_window": 24, "max_window_layers": 1,
    }),
    "qwen3": ("qwen3", {"num_hidden_layers": 2, "intermediate_size": 96, "head_dim": 16}),
    # YaRN as Qwen's long-context setting turns it on (over a short original length, so the
    # prompts here reach the interpolated frequencies)
    "qwen3-yarn": ("qwen3", {
        "num_hidden_layers": 2, "intermediate_size": 96, "head_dim": 16,
        "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                            "original_max_position_embeddings": 64},
        "max_position_embeddings": 256,  # YaRN's reach (64 x 4): the longest prompt fits
    }),
    # 2 sliding layers (a 24-key window and the local rotary base) and a global one (its own
    # base, linearly scaled), the softmax scale from query_pre_attn_scalar, not head_dim
    "gemma3": ("gemma3_text", {
        "num_hidden_layers": 3, "intermediate_size": 96, "head_dim": 16,
        "query_pre_attn_scalar": 32, "sliding_window": 24,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
        },
    }),
    # the first Gemma: Llama's two norms (Gemma's), GELU-tanh, scaled embeddings, head_dim 16
    "gemma": ("gemma", {"num_hidden_layers": 2, "intermediate_size": 96, "head_dim": 16}),
    # alternating sliding (24 keys) and global layers, scores and logits soft-capped low enough
    # to bind on these random weights, the softmax scale from query_pre_attn_scalar
    "gemma2": ("gemma2", {
        "num_hidden_layers": 3, "intermediate_size": 96, "head_dim": 16,
        "query_pre_attn_scalar": 32, "sliding_window": 24, "attn_logit_softcapping": 1.5,
        "final_logit_softcapping": 5.0,
    }),
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
    # the shared expert (its own width, gated by a sigmoid) beside top-2 of 8 experts, layer 1
    # dense, q/k/v biased
    "qwen2_moe": ("qwen2_moe", {
        "num_hidden_layers": 3, "intermediate_size": 96, "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 48, "num_experts": 8, "num_experts_per_tok": 2,
        "mlp_only_layers": [1],
    }),
    "mixtral": ("mixtral", {
        "num_hidden_layers": 2, "intermediate_size": 48, "num_local_experts": 4,
        "num_experts_per_tok": 2,
    }),
    # q/k/v and gate/up stored fused (qkv_proj, gate_up_proj), every layer through a window
    "phi3": ("phi3", {"num_hidden_layers": 2, "intermediate_size": 96, "sliding_window": 24}),
    # Phi-4-mini's partial rotary: 12 of each head's 16 dims rotate, 4 pass
    "phi3-partial-rotary": ("phi3", {
        "num_hidden_layers": 2, "intermediate_size": 96, "partial_rotary_factor": 0.75,
    }),
    # Phi-3.5's LongRoPE over a 64-token original length (prompts within it rotate by the short
    # factors, longer ones by the long factors), partial rotary
    "phi3-longrope": ("phi3", {
        "num_hidden_layers": 2, "intermediate_size": 96, "partial_rotary_factor": 0.75,
        "original_max_position_embeddings": 64,
        "rope_scaling": {"type": "longrope", "short_factor": [1.0, 1.1, 1.3, 1.8, 2.5, 4.0],
                         "long_factor": [1.0, 1.9, 3.1, 5.0, 7.2, 12.0]},
    }),
    # Granite's four scalings away from 1 (its published 3.x values' kind), biases everywhere
    "granite": ("granite", {
        "num_hidden_layers": 2, "intermediate_size": 96, "embedding_multiplier": 12.0,
        "residual_multiplier": 0.22, "attention_multiplier": 0.015625, "logits_scaling": 8.0,
        "attention_bias": True, "mlp_bias": True,
    }),
    # layer 1 without rotary embedding (NoPE) and, with use_sliding_window, through a window
    "smollm3": ("smollm3", {
        "num_hidden_layers": 3, "intermediate_size": 96, "no_rope_layers": [1, 0, 1],
        "use_sliding_window": True, "sliding_window": 24, "pad_token_id": None,
    }),
    # gpt-oss: attention sinks, q/k/v/o biases, alternating 24-key windows, YaRN (untruncated)
    # over a short original length, top-2 of 8 experts with router and expert biases and the
    # clamped SwiGLU (its limit low enough to bind on these weights)
    "gpt_oss": ("gpt_oss", {
        "num_hidden_layers": 3, "intermediate_size": 32, "num_local_experts": 8,
        "num_experts_per_tok": 2, "head_dim": 16, "sliding_window": 24, "swiglu_limit": 0.6,
        "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0,
                            "beta_slow": 1.0, "truncate": False, "rope_theta": 150000.0,
                            "original_max_position_embeddings": 64},
        "max_position_embeddings": 256,  # YaRN's reach (64 x 4): the longest prompt fits
    }),
    # OLMo 2: norms after attention and the MLP (none before), q/k RMSNorms over the whole
    # projection, q/k/v/o biases
    "olmo2": ("olmo2", {"num_hidden_layers": 2, "intermediate_size": 96, "attention_bias": True}),
    # OLMo 3: two sliding layers (a 24-key window, their default table at their own base) and
    # a full one (its own base, linearly scaled)
    "olmo3": ("olmo3", {
        "num_hidden_layers": 3, "intermediate_size": 96, "sliding_window": 24,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
        },
    }),
    # GLM (glm-4-9b-hf): q/k/v biases, half of each head rotating with its dims paired (0, 1),
    # (2, 3), ..., gate and up stored as one gate_up_proj
    "glm": ("glm", {
        "num_hidden_layers": 2, "intermediate_size": 96, "head_dim": 16, "pad_token_id": None,
    }),
    # GLM-4-0414: four norms a layer; a quarter of each 32-dim head rotating
    "glm4": ("glm4", {
        "num_hidden_layers": 2, "intermediate_size": 96, "head_dim": 32,
        "partial_rotary_factor": 0.25, "pad_token_id": None,
    }),
    # StarCoder2: LayerNorms with biases, a GELU-tanh MLP of biased c_fc/c_proj, biased
    # q/k/v/o, every layer through a 24-key window, tied embeddings
    "starcoder2": ("starcoder2", {
        "num_hidden_layers": 2, "intermediate_size": 96, "sliding_window": 24,
    }),
    # Cohere (Command-R): attention and MLP side by side from one bias-free LayerNorm, rotary
    # dims paired (0, 1), (2, 3), ..., logits scaled, tied embeddings
    "cohere": ("cohere", {
        "num_hidden_layers": 2, "intermediate_size": 96, "logit_scale": 0.5,
        "pad_token_id": None,
    }),
    # with use_qk_norm: a LayerNorm of each q and k head, its own weight per head; biases
    "cohere-qk-norm": ("cohere", {
        "num_hidden_layers": 2, "intermediate_size": 96, "use_qk_norm": True,
        "attention_bias": True, "pad_token_id": None,
    }),
    # ERNIE 4.5: whole heads rotating with their dims paired, use_bias on every projection
    "ernie4_5": ("ernie4_5", {
        "num_hidden_layers": 2, "intermediate_size": 96, "head_dim": 16, "use_bias": True,
        "pad_token_id": None,
    }),
    # Seed-OSS: q/k/v biased, o_proj by attention_out_bias, the MLP by mlp_bias
    "seed_oss": ("seed_oss", {
        "num_hidden_layers": 2, "intermediate_size": 96, "head_dim": 16,
        "attention_out_bias": True, "mlp_bias": True, "pad_token_id": None,
    }),
    # EXAONE 4: OLMo 2's norms after each branch, per-head q/k norms; sliding layers (every
    # other one, sliding_window_pattern 2) rotate and attend through 24 keys, the global ones
    # take no rotary embedding
    "exaone4": ("exaone4", {
        "num_hidden_layers": 4, "intermediate_size": 96, "sliding_window": 24,
        "sliding_window_pattern": 2,
    }),
    # Arcee (AFM): an ungated MLP of up and down around ReLU squared; biases
    "arcee": ("arcee", {
        "num_hidden_layers": 2, "intermediate_size": 96, "mlp_bias": True, "attention_bias": True,
    }),
    # OLMoE: q/k RMSNorms over the whole projection, q/k/v clipped (low enough to bind on
    # these weights), top-2 of 8 experts not renormalized (its default), q/k/v/o biases
    "olmoe": ("olmoe", {
        "num_hidden_layers": 2, "intermediate_size": 32, "num_experts": 8,
        "num_experts_per_tok": 2, "clip_qkv": 0.5, "attention_bias": True, "pad_token_id": None,
    }),
    # renormalized top-3 of 6, no clipping
    "olmoe-norm-topk": ("olmoe", {
        "num_hidden_layers": 2, "intermediate_size": 32, "num_experts": 6,
        "num_experts_per_tok": 3, "norm_topk_prob": True, "pad_token_id": None,
    }),
    # Granite MoE: the dense Granite's four scalings away from 1, top-2 of 8 experts (a softmax
    # over the top-k logits), its experts stored stacked, q/k/v/o biases
    "granitemoe": ("granitemoe", {
        "num_hidden_layers": 2, "intermediate_size": 32, "num_local_experts": 8,
        "num_experts_per_tok": 2, "embedding_multiplier": 12.0, "residual_multiplier": 0.22,
        "attention_multiplier": 0.015625, "logits_scaling": 8.0, "attention_bias": True,
    }),
    # with its shared MLP (its own width), added ungated beside top-3 of 6 experts
    "granitemoeshared": ("granitemoeshared", {
        "num_hidden_layers": 2, "intermediate_size": 32, "num_local_experts": 6,
        "num_experts_per_tok": 3, "shared_intermediate_size": 48, "embedding_multiplier": 12.0,
        "residual_multiplier": 0.22, "attention_multiplier": 0.015625, "logits_scaling": 8.0,
    }),
    # ERNIE 4.5 MoE: layers 1 and 2 sparse (moe_layer_start_index 1, end 2), 0 and 3 dense;
    # top-2 of 8 chosen with the (random) correction bias, two shared experts added ungated,
    # rotary dims paired, tied embeddings
    "ernie4_5_moe": ("ernie4_5_moe", {
        "num_hidden_layers": 4, "intermediate_size": 96, "moe_intermediate_size": 16,
        "moe_num_experts": 8, "moe_k": 2, "moe_num_shared_experts": 2,
        "moe_layer_start_index": 1, "moe_layer_end_index": 2, "pad_token_id": None,
    }),
    # every other layer sparse (moe_layer_interval 2), no shared expert
    "ernie4_5_moe-interval": ("ernie4_5_moe", {
        "num_hidden_layers": 4, "intermediate_size": 96, "moe_intermediate_size": 16,
        "moe_num_experts": 6, "moe_k": 3, "moe_num_shared_experts": 0,
        "moe_layer_start_index": 0, "moe_layer_interval": 2, "pad_token_id": None,
    }),
}  # fmt: skip
PROMPT_LENS = [1, 4, 9, 23, 61, 150]  # 150 > the CPU's 128-token step: a chunked prefill
NEW_TOKENS = 16
# through the Triton kernels (under the interpreter, a second or so a decode step): a 40-token
# prompt's decode steps at positions 40 to 48, the last in a block of its own (16-token blocks)
TRITON_TOKENS = 10


def _build(path: Path, model_type: str, extra: dict[str, Any]) -> Any:
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = AutoConfig.for_model(model_type, **{**COMMON, **extra})  # extra wins
    # Gemma 2's soft-capping runs in the eager attention only (older transformers take SDPA,
    # without it, unless told)
    eager = {"attn_implementation": "eager"} if model_type == "gemma2" else {}
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, **eager)
    with torch.no_grad():  # transformers starts biases at 0 and norm weights at 1 (Gemma's
        # at 0, an offset from 1): a bias left out or a norm read wrong would go unseen
        for name, param in model.named_parameters():
            if name.endswith((".bias", "_bias", "norm.weight")):
                param.add_(torch.randn_like(param) * 0.2)
            elif name.endswith(".sinks"):  # gpt-oss's: large enough to take a share
                param.copy_(torch.randn_like(param) * 2.0)
    for module in model.modules():  # transformers 5.17 (the GPU image's) builds gpt-oss's
        if hasattr(module, "limit") and hasattr(module, "alpha"):  # experts with the published
            module.limit = getattr(cfg, "swiglu_limit", 7.0)  # clamp (7.0) whatever the
            module.alpha = getattr(cfg, "swiglu_alpha", 1.702)  # config says: the reference
            # takes the config's (the engine does), or its defaults where 5.17's has none
    model.save_pretrained(path)
    save_test_tokenizer(path)
    return model.eval()


def _prompts(seed: int, lens: list[int] = PROMPT_LENS) -> list[list[int]]:
    return token_prompts(seed, lens, VOCAB)


def _hf_greedy(model: Any, prompt: list[int], new_tokens: int = NEW_TOKENS) -> list[int]:
    return transformers_greedy(model, prompt, new_tokens)


def _hf_greedy_along(model: Any, prompt: list[int], got: list[int]) -> list[int]:
    """transformers' greedy pick at each of ``got``'s steps: one forward over the prompt and
    ``got`` but its last token, each position's argmax from the prompt's last on. It equals
    ``got`` exactly when ``got`` is transformers' greedy continuation (each token its argmax
    given the tokens before it, as ``generate`` picks them; at the first that differs, the
    token transformers would have picked there): the check of :func:`_hf_greedy`, token for
    token, in one prefill instead of a forward pass per new token."""
    assert got, "no tokens to check"
    with torch.no_grad():
        logits = model(torch.tensor([prompt + got[:-1]])).logits[0, len(prompt) - 1 :]
    return logits.argmax(-1).tolist()


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


def _assert_greedy_matches(
    name: str, path: Path, hf: Any, lens: list[int] = PROMPT_LENS, new_tokens: int = NEW_TOKENS,
    **knobs: Any,
) -> None:  # fmt: skip
    prompts = _prompts(len(name), lens)
    ours = LLM(str(path), **BESIDE, **knobs).generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    )
    _assert_transformers_greedy(name, hf, prompts, [r.outputs[0].token_ids for r in ours],
                                new_tokens)  # fmt: skip


def _assert_transformers_greedy(
    name: str, hf: Any, prompts: list[list[int]], got: list[list[int]], new_tokens: int
) -> None:
    """Each of ``got`` is ``new_tokens`` long and transformers' greedy continuation of its
    prompt, token for token."""
    for prompt, ids in zip(prompts, got, strict=True):
        assert len(ids) == new_tokens, f"{name}: {len(ids)} tokens on a {len(prompt)}-token prompt"
        want = _hf_greedy_along(hf, prompt, ids)
        assert ids == want, f"{name}: diverged on a {len(prompt)}-token prompt"


# prompts that stay within LongRoPE's original length (64) with their new tokens, and longer
# ones (150: a chunked prefill), on which transformers and the engine agree; one that grows
# past it while decoding is the test after
LONGROPE_LENS = [1, 9, 23, 40, 65, 150]


# families whose differences lie away from the prompt's length (norms, scalings, experts,
# biases, rope frequencies) or whose windows are tested by others: one short prompt, one mid,
# one chunked (the suite's time); Llama and the windowed families take every length
FEW_LENS = [4, 23, 150]
# the MoE families run through the fused Triton kernel under the interpreter too
TRITON_MOE = ["qwen3_moe-dense-layer", "mixtral", "olmoe", "granitemoeshared", "ernie4_5_moe"]
FEW = ("gemma", "granite", "qwen2_moe", "phi3-partial-rotary", "llama-biases", "qwen2", "qwen3",
       "qwen3-yarn", "qwen3_moe-dense-layer", "qwen3_moe-sparse-step", "mixtral",
       "olmo2", "glm", "cohere", "cohere-qk-norm", "ernie4_5", "seed_oss", "arcee", "olmoe",
       "olmoe-norm-topk", "granitemoe", "granitemoeshared", "ernie4_5_moe",
       "ernie4_5_moe-interval")  # fmt: skip


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_matches_transformers(name: str, built: Callable[[str], Built]) -> None:
    lens = LONGROPE_LENS if name == "phi3-longrope" else FEW_LENS if name in FEW else PROMPT_LENS
    _assert_greedy_matches(name, *built(name), lens)


@pytest.mark.filterwarnings("ignore:.*past_key_values:FutureWarning")
def test_a_longrope_sequence_growing_past_the_original_length(
    built: Callable[[str], Built],
) -> None:
    """A 61-token prompt decoded past LongRoPE's original length (64): the keys it cached keep
    the short factors and the positions from 64 on take the long ones, as transformers' own
    forward passes rotate them with its cache kept (its ``generate`` for Phi-3 instead drops
    the cache at that point and computes the sequence again with the long factors)."""
    path, hf = built("phi3-longrope")
    (prompt,) = _prompts(7, [61])
    from transformers import DynamicCache

    want, cache, ids = [], DynamicCache(), torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            out = hf(input_ids=ids, past_key_values=cache, use_cache=True)
            want.append(int(out.logits[0, -1].argmax()))
            ids, cache = torch.tensor([[want[-1]]]), out.past_key_values
    got = LLM(str(path), **BESIDE).generate(
        [prompt], SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    )
    assert got[0].outputs[0].token_ids == want


def test_longrope_prompts_of_both_kinds_never_share_cached_blocks(
    built: Callable[[str], Built],
) -> None:
    """A prompt within LongRoPE's original length and a longer one that begins with it rotate
    their keys by different factors: neither reuses the other's cached blocks (one engine,
    the short prompt before and after the long one), and each gives transformers' tokens."""
    path, hf = built("phi3-longrope")
    (long,) = _prompts(11, [150])
    short = long[:40]
    llm, greedy = (
        LLM(str(path), **BESIDE, block_size=16),
        SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True),
    )
    want = {len(p): _hf_greedy(hf, p) for p in (short, long)}  # each prompt's, computed once
    for prompt in (short, long, short, long):
        (out,) = llm.generate([prompt], greedy)
        assert out.outputs[0].token_ids == want[len(prompt)], f"{len(prompt)} tokens"
        cached = out.num_cached_tokens
        assert cached in (0, len(prompt) // 16 * 16, (len(prompt) - 1) // 16 * 16), cached
    assert cached > 0  # the second long prompt found the first's blocks


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="the Triton kernel on the CPU: TRITON_INTERPRET=1",
)
@pytest.mark.parametrize("name", TRITON_MOE)
def test_greedy_matches_transformers_through_the_triton_kernel(
    name: str, built: Callable[[str], Built], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine's CPU path runs the reference; here the model calls the fused Triton kernel
    (under the interpreter) instead, and must still give transformers' tokens (10 of them)."""
    from kernels import triton_moe

    monkeypatch.setattr(ops, "fused_moe", triton_moe.fused_moe)
    _assert_greedy_matches(name, *built(name), PROMPT_LENS, TRITON_TOKENS)


WINDOW = 24  # keys a query sees (itself included), as transformers' mask counts them


@pytest.fixture(scope="module")
def windowed(tmp_path_factory: pytest.TempPathFactory) -> Built:
    path = tmp_path_factory.mktemp("mistral-window")
    extra = {"num_hidden_layers": 2, "intermediate_size": 96, "sliding_window": WINDOW}
    return path, _build(path, "mistral", extra)


def test_a_sliding_window_model_attends_through_its_window(windowed: Built) -> None:
    """Mistral 7B v0.1's kind: every layer sees the last WINDOW keys. Prompts shorter and far
    longer than the window (150 tokens: chunked, so a later chunk's prefix reaches past it),
    and 16 decode steps past it; transformers' own model, window and all, is the reference."""
    path, hf = windowed
    _assert_greedy_matches("mistral-window", path, hf)


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="the Triton kernels on the CPU: TRITON_INTERPRET=1",
)
def test_the_window_through_the_triton_attention_kernels(
    windowed: Built, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As above, with decode and prefill attention in the Triton kernels (under the
    interpreter) instead of the torch references (10 tokens, the 40-token prompt's last decode
    step in a block of its own)."""
    from kernels import triton_attention

    monkeypatch.setattr(
        ops, "_triton", lambda name, x: triton_attention if name == "triton_attention" else None
    )
    _assert_greedy_matches("mistral-window", *windowed, [9, 40], TRITON_TOKENS, block_size=16)


@pytest.mark.parametrize("name", ["gemma2", "granite", "cohere"])
def test_prompt_logprobs_through_the_final_logit_transforms(
    name: str, built: Callable[[str], Built]
) -> None:
    """Gemma 2's final soft-capping and Granite's and Cohere's logits scalings leave the greedy
    token as it is (all monotonic) but not the distribution: every prompt position's log-probabilities,
    transformers' own."""
    path, hf = built(name)
    (prompt,) = _prompts(5, [30])
    res = LLM(str(path), **BESIDE).generate(
        [prompt], SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=3)
    )[0]
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0].float().log_softmax(-1)
    for q in range(len(prompt) - 1):
        entry = res.prompt_logprobs[q + 1]
        assert entry is not None
        assert abs(entry.chosen.logprob - ref[q, prompt[q + 1]].item()) < 1e-4
        assert [t.token_id for t in entry.top] == ref[q].topk(3).indices.tolist()


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="the Triton kernels on the CPU: TRITON_INTERPRET=1",
)
@pytest.mark.parametrize("name", ["gemma3", "gemma2"])
def test_gemma_through_the_triton_kernels(
    name: str, built: Callable[[str], Built], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Gemma 3 and 2 with their norms (the kernel's Gemma variant), rotary, KV writes and
    attention (Gemma 2's soft-capped) in the Triton kernels (under the interpreter): still
    transformers' tokens (Gemma 2 on one prompt past its window: the suite's time; 10 tokens,
    the 40-token prompt's last decode step in a block of its own)."""
    from kernels import triton_attention, triton_layers

    kernels = {"triton_attention": triton_attention, "triton_layers": triton_layers}
    monkeypatch.setattr(ops, "_triton", lambda name, x: kernels.get(name))
    lens = [40] if name == "gemma2" else [9, 40]
    _assert_greedy_matches(name, *built(name), lens, TRITON_TOKENS, block_size=16)


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="the Triton kernels on the CPU: TRITON_INTERPRET=1",
)
def test_gpt_oss_through_the_triton_kernels(
    built: Callable[[str], Built], monkeypatch: pytest.MonkeyPatch
) -> None:
    """gpt-oss's sinks in the decode and prefill attention kernels and its biased, clamped
    experts in the fused MoE kernel (under the interpreter): transformers' tokens on a prompt
    past its window, chunked in 16-token blocks (10 tokens, the last decode step in a block of
    its own)."""
    from kernels import triton_attention, triton_moe

    monkeypatch.setattr(
        ops, "_triton", lambda name, x: triton_attention if name == "triton_attention" else None
    )
    monkeypatch.setattr(ops, "fused_moe", triton_moe.fused_moe)
    _assert_greedy_matches("gpt_oss", *built("gpt_oss"), [40], TRITON_TOKENS, block_size=16)


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="the Triton kernels on the CPU: TRITON_INTERPRET=1",
)
@pytest.mark.parametrize("name", ["olmo3", "glm4", "starcoder2", "cohere-qk-norm", "exaone4"])
def test_the_llama_deltas_through_the_triton_kernels(
    name: str, built: Callable[[str], Built], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The families built on the Llama layers with their norms, rotary (OLMo 3's two tables,
    GLM-4's partial one and Cohere's over reordered rows, EXAONE 4's NoPE layers), KV writes and attention (its windows) in the Triton kernels (under the interpreter): still
    transformers' tokens on a prompt past the window, in 16-token blocks (10 tokens, the last
    decode step in a block of its own)."""
    from kernels import triton_attention, triton_layers

    kernels = {"triton_attention": triton_attention, "triton_layers": triton_layers}
    monkeypatch.setattr(ops, "_triton", lambda name, x: kernels.get(name))
    _assert_greedy_matches(name, *built(name), [40], TRITON_TOKENS, block_size=16)


def test_a_window_no_context_outgrows_is_left_to_whole_attention(windowed: Built) -> None:
    """Where max_model_len keeps every query within its window, the layers attend without the
    kernels' window masks (the same keys, less work)."""
    from services.engine.models.llama import Attention

    for max_len, want in ((WINDOW, {0}), (WINDOW + 1, {WINDOW})):
        llm = LLM(str(windowed[0]), max_model_len=max_len)
        modules = llm.engine.runner.model.modules()
        assert {m.window for m in modules if isinstance(m, Attention)} == want
        llm.close()


def _gemma3_with_vision(path: Path) -> Any:
    """A tiny Gemma 3 checkpoint with a vision tower (model_type gemma3, as the 4B-27B ones):
    its config.json names only the text_config keys that differ from transformers' defaults."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    torch.manual_seed(0)
    _, text = CONFIGS["gemma3"]
    cfg = Gemma3Config(
        text_config={**COMMON, **text},
        vision_config={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                       "num_attention_heads": 2, "image_size": 28, "patch_size": 14},
        mm_tokens_per_image=4, image_token_index=VOCAB - 1, boi_token_index=VOCAB - 2,
        eoi_token_index=VOCAB - 3,
    )  # fmt: skip
    model = Gemma3ForConditionalGeneration(cfg).to(torch.float32)
    with torch.no_grad():  # norms off their initial values, as in _build
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.add_(torch.randn_like(param) * 0.2)
    model.save_pretrained(path)
    save_test_tokenizer(path)
    return model.eval()


def test_a_gemma3_checkpoint_with_vision_serves_its_language_model(tmp_path: Path) -> None:
    """google/gemma-3-4b-it's layout: the language model's greedy tokens are transformers' (its
    defaults filling the text config), from the Hub's tensor names and from those of
    transformers' module tree; the vision tower is skipped, images refused."""
    from safetensors.torch import load_file, save_file

    hf = _gemma3_with_vision(tmp_path)
    # as the Hub's configs: only the text_config keys that differ from transformers' defaults
    from transformers import Gemma3TextConfig

    defaults = Gemma3TextConfig().to_dict()
    config = json.loads((tmp_path / "config.json").read_text())
    config["text_config"] = {k: v for k, v in config["text_config"].items()
                             if k == "model_type" or defaults.get(k) != v}  # fmt: skip
    assert "num_attention_heads" in config["text_config"]
    assert "rms_norm_eps" not in config["text_config"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    prompts = _prompts(3, [1, 9, 61])
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    with torch.no_grad():
        want = [
            hf.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                        do_sample=False, pad_token_id=0)[0, len(p):].tolist()
            for p in prompts
        ]  # fmt: skip
    llm = LLM(str(tmp_path))
    assert llm.engine.runner.arch.language_of == "gemma3"
    assert [r.outputs[0].token_ids for r in llm.generate(prompts, params)] == want
    with pytest.raises(InvalidRequestError, match=r"language model only .* takes no images"):
        llm.generate({"prompt": "hi", "multi_modal_data": {"image": [b"png"]}}, params)
    llm.close()
    # transformers saves the Hub's names (language_model.model.*, vision_tower.*); the same
    # tensors under the names of its module tree (model.language_model.*, model.vision_tower.*)
    (file,) = tmp_path.glob("*.safetensors")
    stored = load_file(str(file))
    assert any(k.startswith("language_model.model.") for k in stored)
    assert any(k.startswith("vision_tower.") for k in stored)
    old = {}
    for name, tensor in stored.items():
        if name.startswith("language_model.model."):
            name = "model.language_model." + name.removeprefix("language_model.model.")
        elif name.startswith(("vision_tower.", "multi_modal_projector.")):
            name = "model." + name
        old[name] = tensor
    save_file(old, str(file), metadata={"format": "pt"})
    with LLM(str(tmp_path)) as again:
        assert [r.outputs[0].token_ids for r in again.generate(prompts, params)] == want


# Mistral 3 (Mistral Small 3.1/3.2's layout): head_dim 32 (not hidden / heads), Mistral
# Small's rotary base, tied embeddings (transformers 5's Mistral3Config default: no lm_head
# saved); YaRN over a short original length with an lm_head of its own
MISTRAL3 = {
    "mistral3": ({"num_hidden_layers": 2, "intermediate_size": 96, "hidden_size": 64,
                  "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
                  "rope_parameters": {"rope_type": "default", "rope_theta": 1e9}}, True),
    "mistral3-yarn": ({"num_hidden_layers": 2, "intermediate_size": 96, "hidden_size": 64,
                       "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                       "max_position_embeddings": 256,
                       "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6,
                                           "original_max_position_embeddings": 64}}, False),
}  # fmt: skip


@pytest.fixture(scope="module")
def mistral3(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Built]:
    cache: dict[str, Built] = {}

    def get(name: str) -> Built:
        if name not in cache:
            from tests.services.engine.conftest import tiny_mistral3

            path = tmp_path_factory.mktemp(name)
            text, tied = MISTRAL3[name]
            cache[name] = (path, tiny_mistral3(path, text, tie_word_embeddings=tied))
        return cache[name]

    return get


@pytest.mark.parametrize("name", list(MISTRAL3))
def test_a_mistral3_checkpoint_serves_its_language_model(
    name: str, mistral3: Callable[[str], Built]
) -> None:
    """Mistral3ForConditionalGeneration's language model: transformers' greedy tokens on text
    prompts; the Pixtral tower and projector skipped at load, images refused by the engine
    (and by the gateway: no VisionSpec, so its 'served for text only' 400)."""
    from protos.multimodal import VisionSpec
    from services.engine.model_config import ArchConfig

    path, hf = mistral3(name)
    _, tied = MISTRAL3[name]
    arch = ArchConfig.from_file(path / "config.json")
    assert (arch.model_type, arch.language_of, arch.tie_word_embeddings) == (
        "mistral", "mistral3", tied
    )  # fmt: skip
    assert arch.head_dim == MISTRAL3[name][0]["head_dim"]
    assert VisionSpec.of_model_dir(path) is None
    llm = LLM(str(path), **BESIDE)
    prompts = _prompts(len(name), FEW_LENS)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    got = [r.outputs[0].token_ids for r in llm.generate(prompts, params)]
    assert len({t for g in got for t in g}) > 4  # not a degenerate model
    _assert_transformers_greedy(name, hf, prompts, got, NEW_TOKENS)
    with pytest.raises(InvalidRequestError, match=r"language model only \(mistral3's vision"):
        llm.generate({"prompt": "hi", "multi_modal_data": {"image": [b"png"]}}, params)
    llm.close()


def test_mistral3_under_its_module_tree_names_and_the_hubs_untied_config(
    mistral3: Callable[[str], Built], tmp_path: Path
) -> None:
    """Mistral Small 3.1's published config names no tie_word_embeddings (Mistral3Config's
    default: tied) yet its checkpoint holds an lm_head: transformers leaves the two apart, and
    so does the engine. The same tensors under transformers 5's module-tree names
    (model.language_model.*, lm_head.weight, model.vision_tower.*) load as well."""
    from safetensors.torch import load_file, save_file

    from services.engine.model_config import ArchConfig

    path, hf = mistral3("mistral3-yarn")
    (file,) = path.glob("*.safetensors")
    stored = load_file(str(file))
    assert "language_model.lm_head.weight" in stored
    assert any(k.startswith("vision_tower.") for k in stored)
    renamed = {}
    for name, tensor in stored.items():
        if name.startswith("language_model.model."):
            name = "model.language_model." + name.removeprefix("language_model.model.")
        elif name.startswith("language_model.lm_head."):
            name = name.removeprefix("language_model.")
        else:
            name = "model." + name
        renamed[name] = tensor
    save_file(renamed, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    for other in path.iterdir():
        if other.suffix != ".safetensors" and other.is_file():
            (tmp_path / other.name).write_bytes(other.read_bytes())
    config = json.loads((tmp_path / "config.json").read_text())
    del config["tie_word_embeddings"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert not ArchConfig.from_file(tmp_path / "config.json").tie_word_embeddings
    prompts = _prompts(5, [9, 70])
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    with LLM(str(tmp_path), **BESIDE) as llm:
        got = [r.outputs[0].token_ids for r in llm.generate(prompts, params)]
    _assert_transformers_greedy("mistral3-yarn", hf, prompts, got, NEW_TOKENS)


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="the Triton kernels on the CPU: TRITON_INTERPRET=1",
)
def test_mistral3_through_the_triton_kernels(
    mistral3: Callable[[str], Built], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Mistral 3's language model (head_dim 32 of a 64-wide model) with its norms, rotary, KV
    writes and attention in the Triton kernels (under the interpreter): transformers' tokens
    on a prompt in 16-token blocks (10 tokens, the last decode step in a block of its own)."""
    from kernels import triton_attention, triton_layers

    kernels = {"triton_attention": triton_attention, "triton_layers": triton_layers}
    monkeypatch.setattr(ops, "_triton", lambda name, x: kernels.get(name))
    _assert_greedy_matches("mistral3", *mistral3("mistral3"), [40], TRITON_TOKENS, block_size=16)
