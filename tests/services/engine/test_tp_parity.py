"""Tensor parallelism on the CPU (Gloo): N ranks give the tokens of one, token for token, in
float32 greedy decoding, on tiny random Llama and Qwen3 checkpoints and the embedded model."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from protos.sampling_params import SamplingParams
from services.engine.llm import LLM
from tests.services.engine.conftest import (
    BESIDE,
    rank_processes,
    tiny_checkpoint,
    tiny_mistral3,
    token_prompts,
)

# every engine here on the test tokenizer, loaded once (tests/services/engine/_tp_tokenizers.py)
pytestmark = pytest.mark.usefixtures("tokenizers_loaded_once")

MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-2kv": ("llama", {
        "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 8,
        "num_key_value_heads": 2, "intermediate_size": 96,
    }),
    # 3 KV heads over 2 ranks (2 + 1, as SmolLM2's) and an odd MLP (51 + 50 rows)
    "llama-3kv-uneven": ("llama", {
        "num_hidden_layers": 2, "hidden_size": 96, "num_attention_heads": 6,
        "num_key_value_heads": 3, "intermediate_size": 101,
    }),
    "qwen3-2kv": ("qwen3", {
        "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 96,
    }),
    # per-head q/k norms, four norms a layer, a GELU MLP, scaled tied embeddings, a sliding
    # layer (its own rotary base) beside a global one
    "gemma3-2kv": ("gemma3_text", {
        "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 96,
        "query_pre_attn_scalar": 16, "sliding_window": 8,
        "layer_types": ["sliding_attention", "full_attention"],
    }),
    # Mistral 3's language model (Mistral Small's layout: head_dim 32 of a 64-wide model, its
    # own language_model.lm_head cut by vocabulary rows) read from its multimodal checkpoint,
    # the Pixtral tower skipped
    "mistral3-2kv": ("mistral3", {
        "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 32, "intermediate_size": 96,
    }),
    # q/k/v and gate/up stored fused (qkv_proj, gate_up_proj): a rank's rows of each piece are
    # cut out of the one tensor (3 KV heads: 2 + 1; MLP rows 51 + 50)
    "phi3-3kv-uneven": ("phi3", {
        "num_hidden_layers": 2, "hidden_size": 96, "num_attention_heads": 6,
        "num_key_value_heads": 3, "intermediate_size": 101,
    }),
    # GLM-4: its q and k rows reordered per head on each rank (partial rotary, dims paired),
    # gate/up stored fused, q/k/v biases, four norms a layer
    "glm4-2kv": ("glm4", {
        "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 96, "pad_token_id": None,
    }),
    # StarCoder2: LayerNorms with biases, c_fc cut by rows with its bias, c_proj by columns
    # (its bias added once), biased q/k/v/o, 3 KV heads over 2 ranks, an odd MLP (51 + 50)
    "starcoder2-3kv-uneven": ("starcoder2", {
        "num_hidden_layers": 2, "hidden_size": 96, "num_attention_heads": 6,
        "num_key_value_heads": 3, "intermediate_size": 101,
    }),
    # Cohere: attention and MLP side by side, its per-head q/k LayerNorm weights cut by head
    # (1 KV head replicated on both ranks), rotary dims reordered per head
    "cohere-qk-1kv": ("cohere", {
        "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
        "num_key_value_heads": 1, "intermediate_size": 96, "use_qk_norm": True,
        "pad_token_id": None,
    }),
    # OLMo 2: its q/k norms over the whole projection, each rank's weights and squares of its
    # heads' rows summed over the ranks (3 KV heads: 2 + 1)
    "olmo2-3kv-uneven": ("olmo2", {
        "num_hidden_layers": 2, "hidden_size": 96, "num_attention_heads": 6,
        "num_key_value_heads": 3, "intermediate_size": 101,
    }),
    # OLMo 3: one KV head replicated on both ranks (its k norm's squares and width counted on
    # each), a sliding layer and a full one
    "olmo3-1kv": ("olmo3", {
        "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
        "num_key_value_heads": 1, "intermediate_size": 96, "sliding_window": 8,
        "layer_types": ["sliding_attention", "full_attention"],
    }),
    # Arcee: the ungated MLP's up rows (with their bias) and down columns cut as c_fc / c_proj
    "arcee-3kv-uneven": ("arcee", {
        "num_hidden_layers": 2, "hidden_size": 96, "num_attention_heads": 6,
        "num_key_value_heads": 3, "intermediate_size": 101, "mlp_bias": True,
    }),
    # EXAONE 4: post-branch norms, per-head q/k norms, a sliding layer and a NoPE global one
    "exaone4-2kv": ("exaone4", {
        "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": 96, "sliding_window": 8,
        "sliding_window_pattern": 2,
    }),
    # every expert on both ranks, each with half its rows (33: 17 + 16); the router whole
    "mixtral": ("mixtral", {
        "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 8,
        "num_key_value_heads": 2, "intermediate_size": 33, "num_local_experts": 4,
        "num_experts_per_tok": 2,
    }),
    # a sparse layer, then a dense one (mlp_only_layers), the top-2 weights not renormalized
    "qwen3-moe": ("qwen3_moe", {
        "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 96,
        "moe_intermediate_size": 33, "num_experts": 4, "num_experts_per_tok": 2,
        "norm_topk_prob": False, "mlp_only_layers": [1],
    }),
    # OLMoE: q/k norms over the whole projection (3 KV heads: 2 + 1), q/k/v clipped, each
    # expert's rows split (33: 17 + 16), random norms and biases
    "olmoe-3kv-uneven": ("olmoe", {
        "num_hidden_layers": 2, "hidden_size": 96, "num_attention_heads": 6,
        "num_key_value_heads": 3, "intermediate_size": 33, "num_experts": 4,
        "num_experts_per_tok": 2, "clip_qkv": 0.5, "attention_bias": True, "pad_token_id": None,
    }),
    # Granite MoE (shared): its experts stored stacked ([E, 2I, H]), read whole and cut to each
    # rank's rows (33: 17 + 16), its shared MLP's stacked gate/up rows cut as two runs (25:
    # 13 + 12); Granite's scalings, q/k/v/o biases
    "granitemoeshared": ("granitemoeshared", {
        "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": 33, "num_local_experts": 4,
        "num_experts_per_tok": 2, "embedding_multiplier": 12.0, "residual_multiplier": 0.22,
        "attention_multiplier": 0.0625, "logits_scaling": 8.0, "attention_bias": True,
        "shared_intermediate_size": 25,
    }),
    # ERNIE 4.5 MoE: the float32 router and its correction bias whole on each rank, the experts'
    # rows split (33: 17 + 16) and its ungated-sum shared experts' (66: 33 + 33), a dense
    # layer first, rotary dims paired
    "ernie4_5_moe": ("ernie4_5_moe", {
        "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": 96, "moe_intermediate_size": 33,
        "moe_num_experts": 4, "moe_k": 2, "moe_num_shared_experts": 2, "pad_token_id": None,
    }),
    # Qwen2-MoE: its shared expert's rows split (41: 21 + 20), its sigmoid gate whole on each
    # rank (gate * a rank's partial sum, summed, is gate * the whole), q/k/v biases
    "qwen2-moe": ("qwen2_moe", {
        "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": 96, "moe_intermediate_size": 33,
        "num_experts": 4, "num_experts_per_tok": 2, "shared_expert_intermediate_size": 41,
    }),
    # sinks cut by query head, the experts' gate/up biases by their rows (33: 17 + 16), the
    # down projection's bias on rank 0 only (the ranks' sum counts it once): random biases
    "gpt-oss": ("gpt_oss", {
        "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 33,
        "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 8,
    }),
}  # fmt: skip
PROMPT_LENS = [1, 5, 23, 150]


def _random_biases(path: Path) -> None:
    """transformers starts gpt-oss's expert biases at zero: a bias cut or counted wrong would
    go unseen; these are random."""
    from safetensors.torch import load_file, save_file

    file = path / "model.safetensors"
    tensors = load_file(file)
    gen = torch.Generator().manual_seed(0)
    for name in [n for n in tensors if n.endswith("_bias")]:
        tensors[name] = torch.randn(tensors[name].shape, generator=gen) * 0.5
    save_file(
        tensors, file, metadata={"format": "pt"}
    )  # 150 > the CPU's 128-token step: a chunked prefill


def _random_norms_and_biases(path: Path) -> None:
    """transformers starts biases at zero and norm weights at one: a bias added on both ranks
    or a per-head norm weight cut wrong would go unseen; these are random."""
    from safetensors.torch import load_file, save_file

    file = path / "model.safetensors"
    tensors = load_file(file)
    gen = torch.Generator().manual_seed(0)
    for name in [n for n in tensors if n.endswith((".bias", "norm.weight"))]:
        tensors[name] += torch.randn(tensors[name].shape, generator=gen) * 0.3
    save_file(tensors, file, metadata={"format": "pt"})


# families whose checkpoints get random norms and biases (transformers starts them at 1 and 0)
RANDOM_NORMS = ("starcoder2", "cohere", "arcee", "exaone4", "olmo2", "olmo3", "olmoe",
                "granitemoeshared", "ernie4_5_moe", "qwen2_moe")  # fmt: skip
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module", autouse=True)
def no_rank_left() -> Iterator[None]:
    yield  # after the module's engines are closed
    assert rank_processes() == [], "a tensor-parallel rank outlived its engine"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], str]:
    paths: dict[str, str] = {}

    def get(name: str) -> str:
        if name not in paths:
            model_type, config = MODELS[name]
            path = tmp_path_factory.mktemp(name)
            if model_type == "mistral3":
                tiny_mistral3(path, config, tie_word_embeddings=False)
            else:
                tiny_checkpoint(path, model_type, **config)
            if model_type == "gpt_oss":
                _random_biases(path)
            elif model_type in RANDOM_NORMS:
                _random_norms_and_biases(path)
            paths[name] = str(path)
        return paths[name]

    return get


@pytest.fixture(scope="module")
def engine(checkpoint: Callable[[str], str]) -> Iterator[Callable[[str, int], LLM]]:
    """``engine(name, size)``: the model's engine on ``size`` ranks, kept for the next test
    that asks for it; one engine of several ranks at a time, closed gracefully when the next
    one starts (every rank took the stop message and exited 0)."""
    engines: dict[tuple[str, int], LLM] = {}

    def close(key: tuple[str, int]) -> None:
        llm = engines.pop(key)
        ranks = llm.engine.runner.ranks
        llm.close()
        if ranks is not None:
            assert [p.returncode for p in ranks.procs] == [0] * (key[1] - 1)

    def get(name: str, size: int) -> LLM:
        if (name, size) not in engines:
            if size > 1:
                for key in [k for k in engines if k[1] > 1]:
                    close(key)
            engines[name, size] = LLM(checkpoint(name), tensor_parallel_size=size, **BESIDE)
        return engines[name, size]

    yield get
    for key in list(engines):
        close(key)


def _prompts(seed: int) -> list[list[int]]:
    return token_prompts(seed, PROMPT_LENS)


def _generate(llm: LLM, prompts: list[Any], params: SamplingParams) -> list[Any]:
    return [r.outputs[0] for r in llm.generate(prompts, params)]


@pytest.mark.parametrize(
    ("name", "size"),
    [
        ("llama-2kv", 2),
        ("llama-3kv-uneven", 2),
        pytest.param("llama-2kv", 4, id="llama-2kv-tp4-kv-replicated"),
        ("gemma3-2kv", 2),
        ("mistral3-2kv", 2),
        ("phi3-3kv-uneven", 2),
        ("glm4-2kv", 2),
        ("starcoder2-3kv-uneven", 2),
        ("cohere-qk-1kv", 2),
        ("arcee-3kv-uneven", 2),
        ("olmo2-3kv-uneven", 2),
        ("olmo3-1kv", 2),
        ("exaone4-2kv", 2),
        ("mixtral", 2),
        ("qwen3-moe", 2),
        ("gpt-oss", 2),
        ("olmoe-3kv-uneven", 2),
        ("granitemoeshared", 2),
        ("ernie4_5_moe", 2),
        ("qwen2-moe", 2),
        ("qwen3-2kv", 2),  # last: the next test goes on with its engine
    ],
)
def test_greedy_tokens_equal_one_rank(
    name: str, size: int, engine: Callable[[str, int], LLM]
) -> None:
    if torch.cuda.is_available() and torch.cuda.device_count() < size:
        pytest.skip(f"{size} ranks need {size} GPUs here")  # on the CPU they share its cores
    prompts = _prompts(len(name))
    want = [o.token_ids for o in _generate(engine(name, 1), prompts, GREEDY)]
    got = [o.token_ids for o in _generate(engine(name, size), prompts, GREEDY)]
    assert got == want


def test_logprobs_and_seeded_sampling_equal_one_rank(engine: Callable[[str, int], LLM]) -> None:
    """Rank 0 samples from the gathered logits; prompt logprobs are scored through them too."""
    prompts = _prompts(3)[1:3]
    params = [
        SamplingParams(temperature=0.0, max_tokens=6, logprobs=3, prompt_logprobs=2),
        SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=12, ignore_eos=True),
    ]
    want = [engine("qwen3-2kv", 1).generate(prompts, p) for p in params]
    got = [engine("qwen3-2kv", 2).generate(prompts, p) for p in params]
    for w, g in zip(want[1], got[1], strict=True):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
    for w, g in zip(want[0], got[0], strict=True):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert w.prompt_logprobs is not None and g.prompt_logprobs is not None
        pairs = [*zip(w.outputs[0].logprobs, g.outputs[0].logprobs, strict=True),
                 *zip(w.prompt_logprobs[1:], g.prompt_logprobs[1:], strict=True)]  # fmt: skip
        for a, b in pairs:
            assert a is not None and b is not None
            assert [t.token_id for t in a.top] == [t.token_id for t in b.top]
            assert b.chosen.logprob == pytest.approx(a.chosen.logprob, abs=1e-4)


def test_decode_graphs_are_built_on_every_rank_and_give_the_tokens_of_one(
    engine: Callable[[str, int], LLM],
) -> None:
    """On a GPU rank 0 has the other ranks capture their decode graphs with it, then replays
    them where they do; on the CPU the same buffers run eagerly: the follower's pick of the
    graph path, fed by the step rank 0 sent, must be rank 0's, or its collectives would not pair
    up (a hang, or another rank's rows)."""
    prompts = _prompts(11)
    want = [o.token_ids for o in _generate(engine("qwen3-2kv", 1), prompts, GREEDY)]
    runner = engine("qwen3-2kv", 2).engine.runner
    runner.capture_graphs()
    try:
        before = runner.forwards.graph
        got = [o.token_ids for o in _generate(engine("qwen3-2kv", 2), prompts, GREEDY)]
        # the seeded sampling of the test above takes the same graphs (its logits) too
        params = SamplingParams(temperature=0.8, seed=3, max_tokens=8, ignore_eos=True)
        sampled = [o.token_ids for o in _generate(engine("qwen3-2kv", 2), prompts, params)]
        # every decode step of both batches (each prompt's first token comes from its prefill)
        assert runner.forwards.graph - before == GREEDY.max_tokens - 1 + params.max_tokens - 1
        # rank 0 without its graphs (release_kv_cache drops them): it decides each step's
        # path and sends it, so the others run eagerly too, their graphs unused
        # (3 rows: a padded bucket of 4 on a rank that replays, 3 rows on one that does not)
        runner.graphs = None
        again = [o.token_ids for o in _generate(engine("qwen3-2kv", 2), prompts[:3], GREEDY)]
        alone = [o.token_ids for o in _generate(engine("qwen3-2kv", 1), prompts[:3], GREEDY)]
    finally:
        runner.graphs = None
    assert got == want and again == alone
    assert sampled == [o.token_ids for o in _generate(engine("qwen3-2kv", 1), prompts, params)]


def test_dummy_weights_of_two_ranks_are_those_of_one(checkpoint: Callable[[str], str]) -> None:
    """--load-format dummy: each rank draws every tensor whole and keeps its part (uneven KV
    heads and MLP rows here), so the random model is the same on any number of ranks."""
    path = checkpoint("llama-3kv-uneven")
    prompts = _prompts(5)
    want = _generate(LLM(path, load_format="dummy", **BESIDE), prompts, GREEDY)
    with LLM(path, load_format="dummy", tensor_parallel_size=2, **BESIDE) as tp:
        got = _generate(tp, prompts, GREEDY)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]


def test_embedded_model_two_ranks_equal_one(llm: LLM, chat_ids: list[list[int]]) -> None:
    """SmolLM2-135M (float32): 3 KV heads over 2 ranks (2 + 1), tied embeddings."""
    params = SamplingParams(temperature=0.0, max_tokens=12)
    want = [o.token_ids for o in _generate(llm, chat_ids[:2], params)]
    with LLM("embedded", tensor_parallel_size=2) as tp:
        got = [o.token_ids for o in _generate(tp, chat_ids[:2], params)]
    assert got == want


def test_gpt_oss_dummy_weights_split_as_one_ranks_and_count_the_down_bias_once() -> None:
    """gpt-oss with --load-format dummy on two ranks (built here without starting them): each
    rank's sinks and gate/up biases are its slice of the one-rank draw; the experts' down bias,
    added inside the sum the ranks all-reduce, is rank 0's alone (zeros on rank 1)."""
    from services.engine.loader import _no_param_init, dummy_weights
    from services.engine.model_config import ArchConfig
    from services.engine.models.llama import LlamaForCausalLM
    from services.engine.tp_layout import TPLayout

    _, config = MODELS["gpt-oss"]
    arch = ArchConfig.from_dict({**config, "model_type": "gpt_oss", "vocab_size": 64})

    def params(rank: int, size: int) -> dict[str, torch.Tensor]:
        layout = TPLayout.of(arch, rank, size) if size > 1 else None
        with torch.device("meta"), _no_param_init():
            model = LlamaForCausalLM(layout.local_arch(arch) if layout else arch, 16)
        model = model.to_empty(device="cpu")
        dummy_weights(model, 0, layout, arch)
        return dict(model.named_parameters())

    whole, ranks = params(0, 1), [params(r, 2) for r in (0, 1)]
    attn, experts = "model.layers.0.self_attn.", "model.layers.0.mlp.experts."
    assert torch.equal(torch.cat([p[attn + "sinks"] for p in ranks]), whole[attn + "sinks"])
    i, halves = 33, [(0, 17), (17, 33)]  # each rank's rows of the gate half, then the up half
    for p, (a, b) in zip(ranks, halves, strict=True):
        rows = torch.cat([whole[experts + "gate_up_proj_bias"][:, a:b],
                          whole[experts + "gate_up_proj_bias"][:, i + a : i + b]], 1)  # fmt: skip
        assert torch.equal(p[experts + "gate_up_proj_bias"], rows)
    assert torch.equal(ranks[0][experts + "down_proj_bias"], whole[experts + "down_proj_bias"])
    assert not ranks[1][experts + "down_proj_bias"].any()
