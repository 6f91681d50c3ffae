"""Tensor parallelism on the CPU (Gloo): N ranks give the tokens of one, token for token, in
float32 greedy decoding, on tiny random Llama and Qwen3 checkpoints and the embedded model."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from protos.sampling_params import SamplingParams
from services.engine.llm import LLM
from tests.services.engine.conftest import rank_processes, tiny_checkpoint

MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-2kv": ("llama", {
        "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 8,
        "num_key_value_heads": 2, "intermediate_size": 96,
    }),
    "llama-4kv": ("llama", {
        "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 8,
        "num_key_value_heads": 4, "intermediate_size": 80,
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
}  # fmt: skip
PROMPT_LENS = [1, 5, 23, 150]  # 150 > the CPU's 128-token step: a chunked prefill
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(autouse=True)
def no_rank_left() -> Iterator[None]:
    yield
    assert rank_processes() == [], "a tensor-parallel rank outlived its engine"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    cache: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in cache:
            model_type, config = MODELS[name]
            cache[name] = tiny_checkpoint(tmp_path_factory.mktemp(name), model_type, **config)
        return cache[name]

    return get


def _prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(49152) for _ in range(n)] for n in PROMPT_LENS]


def _generate(llm: LLM, prompts: list[Any], params: SamplingParams) -> list[Any]:
    return [r.outputs[0] for r in llm.generate(prompts, params)]


def _tp(model: str, size: int, **knobs: Any) -> LLM:
    llm = LLM(model, tensor_parallel_size=size, **knobs)
    assert llm.engine.runner.ranks is not None
    assert len(llm.engine.runner.ranks.procs) == size - 1
    return llm


def _close(llm: LLM) -> None:
    """Stopped gracefully: every rank took the stop message and exited 0."""
    ranks = llm.engine.runner.ranks
    assert ranks is not None
    llm.close()
    assert [p.returncode for p in ranks.procs] == [0] * len(ranks.procs)


@pytest.mark.parametrize(
    ("name", "size"),
    [
        ("llama-2kv", 2),
        ("llama-4kv", 2),
        ("llama-3kv-uneven", 2),
        ("qwen3-2kv", 2),
        pytest.param("llama-2kv", 4, id="llama-2kv-tp4-kv-replicated"),
    ],
)
def test_greedy_tokens_equal_one_rank(
    name: str, size: int, checkpoint: Callable[[str], Path]
) -> None:
    path, prompts = str(checkpoint(name)), _prompts(len(name))
    want = [o.token_ids for o in _generate(LLM(path), prompts, GREEDY)]
    llm = _tp(path, size)
    try:
        got = [o.token_ids for o in _generate(llm, prompts, GREEDY)]
    finally:
        _close(llm)
    assert got == want


def test_logprobs_and_seeded_sampling_equal_one_rank(checkpoint: Callable[[str], Path]) -> None:
    """Rank 0 samples from the gathered logits; prompt logprobs are scored through them too."""
    path, prompts = str(checkpoint("qwen3-2kv")), _prompts(3)[1:3]
    params = [
        SamplingParams(temperature=0.0, max_tokens=6, logprobs=3, prompt_logprobs=2),
        SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=12, ignore_eos=True),
    ]
    one = LLM(path)
    want = [one.generate(prompts, p) for p in params]
    llm = _tp(path, 2)
    try:
        got = [llm.generate(prompts, p) for p in params]
    finally:
        _close(llm)
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


def test_embedded_model_two_ranks_equal_one(llm: LLM, chat_ids: list[list[int]]) -> None:
    """SmolLM2-135M (float32): 3 KV heads over 2 ranks (2 + 1), tied embeddings."""
    params = SamplingParams(temperature=0.0, max_tokens=24)
    want = [o.token_ids for o in _generate(llm, chat_ids[:3], params)]
    tp = _tp("embedded", 2)
    try:
        got = _generate(tp, chat_ids[:3], params)
    finally:
        _close(tp)
    assert [o.token_ids for o in got] == want
