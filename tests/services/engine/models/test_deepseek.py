"""DeepSeek-V2 and V3 against transformers 5: tiny random checkpoints (float32, seeded) give
transformers' greedy tokens, token for token: V2 with q_proj and with the low-rank q, greedy and
group-limited routing; V3 with noaux_tc routing (sigmoid, correction bias, groups), YaRN with
mscale_all_dim, and its rotary dims interleaved or not; through the torch references and the
Triton kernels (under the interpreter). The KV cache holds the latent (one plane, one KV head of
kv_lora_rank + qk_rope_head_dim): its bytes, a prefix-cache hit, an FP8 cache and a hand-off of
its blocks to another engine. Refusals of what is not served."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from kernels import ops
from kvtransfer import KvLayout
from protos.sampling_params import SamplingParams
from services.config import CacheConfig, ConfigError, LoRAConfig
from services.engine.kv_cache import GIB, block_bytes, plan_num_blocks
from services.engine.llm import LLM
from services.engine.model_config import ArchConfig
from tests.services.engine.conftest import (
    BESIDE,
    hand_off,
    rank_processes,
    save_test_tokenizer,
    token_prompts,
)

VOCAB = 49152  # the embedded tokenizer's
COMMON = {
    "vocab_size": VOCAB, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 4,
    "intermediate_size": 96, "moe_intermediate_size": 32, "kv_lora_rank": 24,
    "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16, "n_routed_experts": 8,
    "num_experts_per_tok": 2, "first_k_dense_replace": 1, "num_hidden_layers": 3,
    "max_position_embeddings": 1024, "initializer_range": 0.2, "bos_token_id": None,
    "eos_token_id": None, "pad_token_id": None,
}  # fmt: skip
CONFIGS = {
    # q_proj (no q_lora_rank), greedy softmax routing scaled, two shared experts, a v head
    # narrower than the key's (24)
    "v2": ("deepseek_v2", {
        "q_lora_rank": None, "topk_method": "greedy", "n_shared_experts": 2,
        "routed_scaling_factor": 1.5,
    }),
    # the low-rank q (q_a_proj, its norm, q_b_proj), group-limited routing (2 of 4 groups),
    # biased q_a / kv_a / o projections, a value wider than the key (32 > 24)
    "v2-lora-groups": ("deepseek_v2", {
        "q_lora_rank": 32, "topk_method": "group_limited_greedy", "n_group": 4, "topk_group": 2,
        "n_shared_experts": 1, "attention_bias": True, "v_head_dim": 32,
    }),
    # noaux_tc (sigmoid, correction bias, 2 of 4 groups by their top two), renormalized and
    # scaled; YaRN over a short original length with mscale and mscale_all_dim (the softmax
    # scale times mscale squared), rotary dims interleaved (the default)
    "v3": ("deepseek_v3", {
        "q_lora_rank": 32, "n_group": 4, "topk_group": 2, "norm_topk_prob": True,
        "routed_scaling_factor": 2.5, "n_shared_experts": 1, "first_k_dense_replace": 1,
        "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                            "original_max_position_embeddings": 64, "mscale": 0.707,
                            "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1},
        "max_position_embeddings": 256,
    }),
    # rope_interleave off (halves, as Llama), one group (Kimi-K2's), unnormalized, every layer
    # sparse, no shared expert
    "v3-halves": ("deepseek_v3", {
        "q_lora_rank": None, "rope_interleave": False, "n_group": 1, "topk_group": 1,
        "norm_topk_prob": False, "first_k_dense_replace": 0, "n_shared_experts": 0,
    }),
    # for tensor parallelism: 3 heads over 2 ranks (2 + 1), experts' and shared experts' rows
    # odd (33: 17 + 16), the low-rank q, biased q_a / kv_a / o (o's bias added once)
    "v3-tp": ("deepseek_v3", {
        "hidden_size": 96, "num_attention_heads": 3, "num_key_value_heads": 3,
        "q_lora_rank": 32, "moe_intermediate_size": 33, "n_group": 2, "topk_group": 1,
        "n_shared_experts": 1, "attention_bias": True,
    }),
    "v2-tp": ("deepseek_v2", {
        "q_lora_rank": None, "moe_intermediate_size": 33, "n_shared_experts": 2,
        "topk_method": "group_limited_greedy", "n_group": 4, "topk_group": 2,
    }),
    # GLM-4.5: the Llama attention (2 KV heads, q/k/v biased, per-head q/k norms, half of each
    # head rotating by halves) with V3's MoE (2 of 4 groups, renormalized, scaled)
    "glm4_moe": ("glm4_moe", {
        "head_dim": 16, "num_key_value_heads": 2, "use_qk_norm": True, "attention_bias": True,
        "n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5, "n_shared_experts": 1,
    }),
    # 3 KV heads over 2 ranks (2 + 1), the experts' and shared experts' rows 33: 17 + 16
    "glm4_moe-tp": ("glm4_moe", {
        "hidden_size": 96, "num_attention_heads": 6, "num_key_value_heads": 3, "head_dim": 16,
        "moe_intermediate_size": 33, "n_group": 2, "topk_group": 1, "attention_bias": True,
        "use_qk_norm": True,
    }),
}  # fmt: skip
PROMPT_LENS = [1, 9, 23, 150]  # 150 > the CPU's 128-token step: a chunked prefill
NEW_TOKENS = 16
# through the Triton kernels (under the interpreter, ~0.8 s a decode step): a 45-token prompt's
# decode steps at positions 45 to 48, the last in a block of its own (16-token blocks)
TRITON_PROMPT = 45
TRITON_TOKENS = 5


def _build(path: Path, model_type: str, extra: dict[str, Any]) -> Any:
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = AutoConfig.for_model(model_type, **{**COMMON, **extra})
    cfg._experts_implementation = "eager"  # torch's grouped_mm takes no odd expert widths
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # transformers starts biases at 0, norms at 1 and the correction
        # bias at 0: one left out or read wrong would go unseen
        for name, param in model.named_parameters():
            if name.endswith((".bias", "norm.weight")):
                param.add_(torch.randn_like(param) * 0.2)
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.randn_like(buf) * 0.3)
    model.save_pretrained(path)
    save_test_tokenizer(path)
    return model.eval()


Built = tuple[Path, Any]


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Built]:
    cache: dict[str, Built] = {}

    def get(name: str) -> Built:
        if name not in cache:
            path = tmp_path_factory.mktemp(name)
            cache[name] = (path, _build(path, *CONFIGS[name]))
        return cache[name]

    return get


def _prompts(seed: int, lens: list[int]) -> list[list[int]]:
    return token_prompts(seed, lens, VOCAB)


def _hf_greedy_along(model: Any, prompt: list[int], got: list[int]) -> list[int]:
    """transformers' greedy pick at each of ``got``'s steps: one forward over the prompt and
    ``got`` but its last token, each position's argmax from the prompt's last on. It equals
    ``got`` exactly when ``got`` is transformers' greedy continuation (each token its argmax
    given the tokens before it, as ``generate`` picks them), in one prefill instead of a
    forward pass per new token."""
    assert got, "no tokens to check"
    with torch.no_grad():
        logits = model(torch.tensor([prompt + got[:-1]])).logits[0, len(prompt) - 1 :]
    return logits.argmax(-1).tolist()


def _is_hf_greedy(
    model: Any, prompt: list[int], got: list[int], new_tokens: int = NEW_TOKENS
) -> bool:
    """``got`` is ``new_tokens`` long and transformers' greedy continuation of ``prompt``."""
    return len(got) == new_tokens and _hf_greedy_along(model, prompt, got) == got


def _assert_greedy_matches(
    name: str, path: Path, hf: Any, lens: list[int] = PROMPT_LENS, new_tokens: int = NEW_TOKENS,
    **knobs: Any,
) -> None:  # fmt: skip
    prompts = _prompts(len(name), lens)
    llm = LLM(str(path), **BESIDE, **knobs)
    ours = llm.generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    )
    llm.close()
    for prompt, got in zip(prompts, ours, strict=True):
        ids = got.outputs[0].token_ids
        assert _is_hf_greedy(hf, prompt, ids, new_tokens), (
            f"{name}: diverged on a {len(prompt)}-token prompt"
        )


@pytest.mark.parametrize("name", [n for n in CONFIGS if not n.endswith("-tp")])
def test_greedy_matches_transformers(name: str, built: Callable[[str], Built]) -> None:
    _assert_greedy_matches(name, *built(name))


@pytest.mark.parametrize(
    ("prefix_bytes", "expanded"),
    [(512 << 20, True), (0, True), (0, False)],
    ids=["prefix-expanded", "prefix-absorbed", "all-absorbed"],
)
def test_chunks_after_a_prefix_beside_new_prompts_and_decodes(
    built: Callable[[str], Built], monkeypatch: pytest.MonkeyPatch, prefix_bytes: int,
    expanded: bool,
) -> None:  # fmt: skip
    """A 64-token step budget: a long prompt's later chunks (their prefix's keys and values
    expanded from the cached latents; past EXPANDED_PREFIX_BYTES, here 0, absorbed) share steps
    with new prompts (expanded) and decodes (absorbed, through the latent decode op); with the
    expanded form off (as for an FP8 cache) the decode rows of such a step go through the latent
    decode op and its prompt rows through the prefill kernel; transformers' tokens, and the
    steps the test is about did happen."""
    from services.engine.models import deepseek

    monkeypatch.setattr(deepseek, "EXPANDED_PREFIX_BYTES", prefix_bytes)
    monkeypatch.setattr(deepseek, "EXPANDED_PREFILL", expanded)

    seen: list[tuple[int, int, int]] = []
    forward = deepseek.MLAttention.forward

    def record(self: Any, x: torch.Tensor, *args: Any) -> torch.Tensor:
        meta = args[-1]
        seen.append((meta.num_decodes, meta.prefix_prefills, x.shape[0] - meta.num_decodes))
        return forward(self, x, *args)

    monkeypatch.setattr(deepseek.MLAttention, "forward", record)
    path, hf = built("v3")
    prompts = dict(zip("abc", _prompts(7, [9, 150, 40]), strict=True))
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    got: dict[str, list[int]] = {rid: [] for rid in prompts}
    with LLM(str(path), **BESIDE, max_num_batched_tokens=64) as llm:
        engine = llm.engine

        def step() -> None:
            for out in engine.step():
                got[out.request_id] += out.token_ids

        engine.add_request("a", prompts["a"], params)
        step()  # a decodes from here on, beside the others' chunks
        engine.add_request("b", prompts["b"], params)
        engine.add_request("c", prompts["c"], params)
        while engine.has_unfinished:
            step()
    for rid, prompt in prompts.items():
        assert _is_hf_greedy(hf, prompt, got[rid]), rid
    # a step held a decode, a chunk after a prefix and a new prompt's chunk
    assert any(nd and npre and rows > npre for nd, npre, rows in seen), seen


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="the Triton kernels on the CPU: TRITON_INTERPRET=1",
)
@pytest.mark.parametrize("name", ["v2", "v2-lora-groups", "v3", "glm4_moe"])
def test_greedy_matches_transformers_through_the_triton_kernels(
    name: str, built: Callable[[str], Built], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Norms, rotary and KV writes (DeepSeek's: the latent row written once, keys only), decode
    and prefill attention (DeepSeek's decode: 4 query heads over one 8 + 24-dim latent row, its
    latent the values; prefill over the cache given as keys and values; GLM's 16-dim heads),
    and the fused MoE, in the Triton kernels (under the interpreter). A 45-token prompt and
    5 tokens (the suite's time): the last decode step's key opens a fourth 16-token block."""
    from kernels import triton_attention, triton_layers, triton_mla, triton_moe

    kernels = {"triton_attention": triton_attention, "triton_layers": triton_layers,
               "triton_mla": triton_mla}  # fmt: skip
    monkeypatch.setattr(ops, "_triton", lambda name, x: kernels.get(name))
    monkeypatch.setattr(ops, "fused_moe", triton_moe.fused_moe)
    # v3: 45 tokens in chunks of 24 and 21, the second after a prefix (expanded from the cache)
    budget = {"max_num_batched_tokens": 24} if name == "v3" else {}
    lens = [TRITON_PROMPT]
    _assert_greedy_matches(name, *built(name), lens, TRITON_TOKENS, block_size=16, **budget)


@pytest.mark.parametrize("name", ["v3-tp", "v2-tp", "glm4_moe-tp"])
def test_two_ranks_give_transformers_tokens(name: str, built: Callable[[str], Built]) -> None:
    """Tensor parallelism on the CPU (Gloo): q, kv_b and o_proj cut by head at their own
    widths, the latent projections whole, the experts' and shared experts' rows split and
    summed in one all-reduce: still transformers' tokens."""
    if torch.cuda.is_available() and torch.cuda.device_count() < 2:
        pytest.skip("2 ranks need 2 GPUs here")
    _assert_greedy_matches(name, *built(name), [1, 23, 150], tensor_parallel_size=2)
    assert rank_processes() == []


def test_dummy_weights_of_two_ranks_are_those_of_one(built: Callable[[str], Built]) -> None:
    """--load-format dummy: each rank draws every tensor whole and keeps its part (DeepSeek's
    own cuts: q and kv_b by head, o_proj's columns, the shared experts' stacked gate/up)."""
    if torch.cuda.is_available() and torch.cuda.device_count() < 2:
        pytest.skip("2 ranks need 2 GPUs here")
    path, _ = built("v3-tp")
    prompts = _prompts(5, [9, 40])
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    with LLM(str(path), load_format="dummy", **BESIDE) as one:
        want = [r.outputs[0].token_ids for r in one.generate(prompts, greedy)]
    with LLM(str(path), load_format="dummy", tensor_parallel_size=2, **BESIDE) as two:
        got = [r.outputs[0].token_ids for r in two.generate(prompts, greedy)]
    assert got == want


def test_the_router_stays_in_float32_in_a_16_bit_model(built: Callable[[str], Built]) -> None:
    """The router's weight and V3's correction bias keep float32 when the model is bfloat16
    (transformers keeps them so: a rounded bias would move which experts win)."""
    from services.engine.models.deepseek import Router

    llm = LLM(str(built("v3")[0]), dtype="bfloat16", num_blocks=64)
    routers = [m for m in llm.engine.runner.model.modules() if isinstance(m, Router)]
    assert routers and all(p.dtype == torch.float32 for r in routers for p in r.parameters())
    assert llm.engine.runner.model.lm_head.weight.dtype == torch.bfloat16
    llm.close()


def _config(model_type: str, **extra: Any) -> dict[str, Any]:
    return {"model_type": model_type, **COMMON, "q_lora_rank": None, "n_group": 4,
            "topk_group": 2, **extra}  # fmt: skip


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        ({"model_type": "deepseek_v2", "norm_topk_prob": True}, "norm_topk_prob"),
        ({"model_type": "deepseek_v2", "topk_method": "noaux_tc"}, "topk_method"),
        ({"model_type": "deepseek_v3", "scoring_func": "softmax"}, "scoring_func"),
        ({"model_type": "deepseek_v3", "n_group": 3, "topk_group": 1}, "equal groups"),
        ({"model_type": "deepseek_v3", "n_group": 8, "topk_group": 1}, "two or more"),
        ({"model_type": "deepseek_v3", "n_group": 4, "topk_group": 5}, "topk_group"),
        ({"model_type": "deepseek_v2", "moe_layer_freq": 2}, "moe_layer_freq"),
        ({"model_type": "deepseek_v2", "hidden_act": "gelu"}, "hidden_act"),
        ({"model_type": "deepseek_v2", "mlp_bias": True}, "mlp_bias"),
        ({"model_type": "deepseek_v3", "qk_rope_head_dim": 7}, "odd"),
        ({"model_type": "deepseek_v3", "kv_lora_rank": 1020}, "wider"),
        ({"model_type": "deepseek_v3", "kv_lora_rank": None}, "kv_lora_rank"),
        ({"model_type": "glm4_moe", "head_dim": 16, "partial_rotary_factor": 0.1},
         "partial_rotary_factor"),
        ({"model_type": "glm4_moe", "n_group": 3, "topk_group": 1}, "equal groups"),
        ({"model_type": "glm4_moe", "scoring_func": "softmax"}, "scoring_func"),
    ],
)  # fmt: skip
def test_what_is_not_served_is_refused(extra: dict[str, Any], says: str) -> None:
    with pytest.raises(ConfigError, match=says):
        ArchConfig.from_dict(_config(**extra))


def test_the_config_as_the_engine_reads_it() -> None:
    """MLA's cache head: one KV head (whatever num_key_value_heads says) of the latent,
    qk_rope_head_dim + kv_lora_rank dims, the first qk_rope_head_dim rotating, in one plane;
    YaRN's mscale_all_dim in the softmax scale; V3's sparse layers from first_k_dense_replace on,
    its shared experts' width."""
    rope = {"rope_type": "yarn", "factor": 40.0, "rope_theta": 10000.0, "mscale": 1.0,
            "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096}  # fmt: skip
    arch = ArchConfig.from_dict(
        _config("deepseek_v3", num_key_value_heads=1, rope_scaling=rope, n_group=4,
                topk_group=2, n_shared_experts=2, first_k_dense_replace=2)
    )  # fmt: skip
    assert (arch.num_kv_heads, arch.head_dim, arch.rotary_dim, arch.kv_planes) == (1, 32, 8, 1)
    assert arch.mla is not None and arch.moe is not None and arch.moe.grouped is not None
    mscale = 0.1 * 1.0 * torch.log(torch.tensor(40.0)).item() + 1.0
    assert arch.mla.softmax_scale == pytest.approx(24**-0.5 * mscale**2)
    assert arch.moe.layers == (2,) and arch.moe.shared_intermediate_size == 64
    assert arch.moe.grouped.sigmoid and arch.moe.renormalize and arch.moe.grouped.scaling == 2.5
    # layers x (kv_lora_rank + qk_rope_head_dim) x 2 bytes: no V plane, no per-head copies
    assert arch.sliding_window is None and arch.kv_bytes_per_token(2) == 3 * (24 + 8) * 2


def test_v3_multi_token_prediction_layers_are_skipped(
    built: Callable[[str], Built], tmp_path: Path
) -> None:
    """DeepSeek-V3's checkpoints carry their multi-token-prediction module as one more decoder
    layer (num_hidden_layers): skipped as transformers skips it; the tokens stay its."""
    from safetensors.torch import load_file, save_file

    path, hf = built("v3-halves")
    for f in path.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    tensors = load_file(str(tmp_path / "model.safetensors"))
    extra = {k.replace("model.layers.2.", "model.layers.3."): v.clone()
             for k, v in tensors.items() if k.startswith("model.layers.2.")}  # fmt: skip
    save_file({**tensors, **extra}, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 3
    _assert_greedy_matches("v3-halves", tmp_path, hf, [9])


def test_lora_and_quantization_are_refused(built: Callable[[str], Built]) -> None:
    path = str(built("v2")[0])
    with pytest.raises(ConfigError, match="LoRA"):
        LLM(path, **BESIDE, lora_config=LoRAConfig())
    with pytest.raises(ConfigError, match="quantized deepseek_v2"):
        LLM(path, **BESIDE, quantization="fp8")


def test_the_cache_holds_one_plane_of_the_latent(built: Callable[[str], Built]) -> None:
    """Each layer's pool is [1 plane, blocks, bs, 1 KV head, qk_rope_head_dim + kv_lora_rank]:
    a token costs layers x (kv_lora_rank + rope) values, which the pool's sizing, the transfer
    layout and the block copies count; DeepSeek-V3's own shape: 61 x 576 x 2 bytes in bf16."""
    path, _ = built("v3")
    arch = ArchConfig.from_dict(json.loads((path / "config.json").read_text()))
    per_token = 3 * (24 + 8) * 4  # layers x (kv_lora_rank + qk_rope_head_dim) x float32
    assert arch.kv_bytes_per_token(4) == per_token
    assert block_bytes(arch, 16, torch.float32) == per_token * 16
    gib = CacheConfig(block_size=16, kv_cache_gib=0.001)
    assert plan_num_blocks(gib, arch, torch.float32, torch.device("cpu"), 256) == (
        int(0.001 * GIB) // (per_token * 16)
    )
    with LLM(str(path), dtype="float32", num_blocks=24, block_size=16) as llm:
        caches = llm.engine.runner.kv_caches
        assert [tuple(c.shape) for c in caches] == [(1, 24, 16, 1, 32)] * 3
        layout = KvLayout.of(caches)
        assert layout.planes == 1 and layout.block_bytes == per_token * 16
        ids = torch.tensor([3, 7], device=caches[0].device)
        assert tuple(ops.gather_blocks(caches, ids).shape) == layout.buffer_shape(2)
    v3 = ArchConfig.from_dict(
        _config("deepseek_v3", num_hidden_layers=61, num_attention_heads=128,
                kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128)
    )  # fmt: skip
    assert v3.kv_bytes_per_token(2) == 61 * 576 * 2


def test_a_prefix_cache_hit_gives_the_same_tokens(built: Callable[[str], Built]) -> None:
    """A prompt's cached latent blocks serve the next prompt that begins with it: transformers'
    tokens each time, the second and third from 32 cached tokens."""
    path, hf = built("v2-lora-groups")
    (prompt,) = _prompts(12, [40])
    greedy = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    prompts = [prompt, prompt, [*prompt, 5, 6, 7]]
    with LLM(str(path), **BESIDE, block_size=16, enable_prefix_caching=True) as llm:
        outs = [llm.generate([p], greedy)[0] for p in prompts]
    assert [o.num_cached_tokens for o in outs] == [0, 32, 32]
    for p, out in zip(prompts, outs, strict=True):
        assert _is_hf_greedy(hf, p, out.outputs[0].token_ids)


def test_the_host_tier_holds_and_restores_latent_blocks(built: Callable[[str], Built]) -> None:
    """The prefix cache's host tier (one plane a layer, as the pool): a prompt's latent blocks
    pushed out of a 10-block pool by a longer prompt come back from the host, and the tokens
    stay transformers'."""
    path, hf = built("v3")
    prompt, noise = _prompts(31, [40, 150])  # the noise takes all 10 blocks
    greedy = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    with LLM(str(path), dtype="float32", num_blocks=10, block_size=16, max_model_len=160,
             kv_offloading_gib=0.001) as llm:  # fmt: skip
        host = llm.engine.runner.host_kv
        assert host is not None and tuple(host.layers[0].shape[::2]) == (1, 16, 32)
        first = llm.generate([prompt], greedy)[0]
        llm.generate([noise], replace(greedy, max_tokens=1))
        again = llm.generate([prompt], greedy)[0]
        stats = llm.engine.stats()
    assert stats.kv_offload_restored > 0 and stats.prefix_cache_host_hits > 0
    assert again.num_cached_tokens == 32
    want = first.outputs[0].token_ids
    assert _is_hf_greedy(hf, prompt, want) and again.outputs[0].token_ids == want


def _hand_off(
    prefill: Any, decode: Any, prompts: list[list[int]], max_tokens: int
) -> list[list[int]]:
    """Each prompt prefilled by ``prefill`` (its first token), its blocks gathered into one
    transfer buffer (``KvLayout.buffer_shape``) and scattered into ``decode``'s reservation,
    which decodes the rest."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    layout = KvLayout.of(prefill.runner.kv_caches)
    assert layout == KvLayout.of(decode.runner.kv_caches)

    def move(prefill: Any, decode: Any, src: torch.Tensor, dst: torch.Tensor) -> None:
        device = prefill.runner.kv_caches[0].device  # the block ids go where the caches are
        buffer = ops.gather_blocks(prefill.runner.kv_caches, src.to(device))
        assert tuple(buffer.shape) == layout.buffer_shape(len(src))
        ops.scatter_blocks(buffer, decode.runner.kv_caches, dst.to(device))

    return hand_off(prefill, decode, prompts, params, move)


def test_a_hand_off_of_latent_blocks_gives_transformers_tokens(
    built: Callable[[str], Built],
) -> None:
    """Disaggregated: a prefill engine's latent blocks, copied into a decode engine's
    reservation, are all the decode engine needs: transformers' greedy tokens."""
    path, hf = built("v3")
    prompts = _prompts(21, [9, 40])
    with LLM(str(path), **BESIDE) as a, LLM(str(path), **BESIDE) as b:
        got = _hand_off(a.engine, b.engine, prompts, NEW_TOKENS)
    assert all(_is_hf_greedy(hf, p, ids) for p, ids in zip(prompts, got, strict=True))


def test_an_fp8_latent_cache_serves_and_hands_off(built: Callable[[str], Built]) -> None:
    """--kv-cache-dtype fp8: the latent rows stored in e4m3 (one plane); greedy tokens stay
    within a near tie of the float cache's (vLLM's check: at the first parting each engine's
    token is in the other's top 5), and a hand-off of the e4m3 blocks gives the colocated FP8
    engine's tokens."""
    path, _ = built("v3")
    prompts = _prompts(22, [9, 40])
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=5)
    with LLM(str(path), **BESIDE) as f32, LLM(str(path), **BESIDE, kv_cache_dtype="fp8") as fp8:
        caches = fp8.engine.runner.kv_caches
        assert all(c.dtype == torch.float8_e4m3fn and c.shape[0] == 1 for c in caches)
        for want, got in zip(f32.generate(prompts, params), fp8.generate(prompts, params),
                             strict=True):  # fmt: skip
            a, b = want.outputs[0], got.outputs[0]
            pairs = enumerate(zip(a.token_ids, b.token_ids, strict=False))
            at = next((i for i, (x, y) in pairs if x != y), None)
            if at is not None:
                assert b.token_ids[at] in {t.token_id for t in a.logprobs[at].top}
                assert a.token_ids[at] in {t.token_id for t in b.logprobs[at].top}
        greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        alone = [fp8.generate([p], greedy)[0].outputs[0].token_ids for p in prompts]
        with LLM(str(path), **BESIDE, kv_cache_dtype="fp8") as decode:
            assert _hand_off(fp8.engine, decode.engine, prompts, 8) == alone


# DeepSeek-V3's own head widths (keys 128 + 64 = 192, values 128: the kernels' 256-wide tiles,
# masked) on a few small layers
GPU_CONFIG = ("deepseek_v3", {
    "hidden_size": 256, "kv_lora_rank": 64, "q_lora_rank": 96, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64, "v_head_dim": 128, "n_group": 4, "topk_group": 2,
    "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                        "original_max_position_embeddings": 512, "mscale": 1.0,
                        "mscale_all_dim": 1.0},
    "max_position_embeddings": 2048,
})  # fmt: skip


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_v3_head_widths_give_transformers_tokens(tmp_path: Path) -> None:
    """On a GPU (compiled kernels, CUDA graphs): float32 greedy tokens equal to transformers'
    (on the CPU) with V3's 192-dim keys and 128-dim values, prompts past a 512-token chunk;
    in bfloat16 (transformers on the same GPU in bfloat16) the first token of most prompts."""
    hf = _build(tmp_path, *GPU_CONFIG)
    _assert_greedy_matches("v3-gpu", tmp_path, hf, [1, 37, 700])
    prompts = _prompts(3, [5, 17, 33, 64, 90, 128, 200, 300])
    llm = LLM(str(tmp_path), dtype="bfloat16", num_blocks=512)
    ours = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=1))
    llm.close()
    hf16 = hf.to(device="cuda", dtype=torch.bfloat16)
    agree = 0
    with torch.no_grad():
        for prompt, got in zip(prompts, ours, strict=True):
            logits = hf16(torch.tensor([prompt], device="cuda")).logits[0, -1]
            agree += got.outputs[0].token_ids[0] == int(logits.argmax())
    assert agree >= 6, f"bfloat16: {agree} of 8 first tokens agree with transformers'"
