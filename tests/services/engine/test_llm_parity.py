"""Our engine against transformers on the embedded SmolLM2 weights (float32, greedy), and
against itself under engine knobs (on a tiny random Llama: the knobs are the engine's)."""

from __future__ import annotations

from pathlib import Path

import pytest

from protos.sampling_params import SamplingParams
from services.engine.llm import LLM
from tests.services.engine.conftest import CHAT_PROMPTS

GREEDY = SamplingParams(temperature=0.0, max_tokens=48)  # 48: the suite's time (was 64)


def _tokens(llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list[list[int]]:
    return [r.outputs[0].token_ids for r in llm.generate(prompts, params)]


def _strip_eos(ids: list[int], eos: int) -> list[int]:
    return ids[: ids.index(eos) + 1] if eos in ids else ids


def test_prompt_ids_equal_transformers_chat_template(
    llm: LLM, chat_ids: list[list[int]], hf_model: tuple
) -> None:
    _, tok = hf_model
    for prompt, ids in zip(CHAT_PROMPTS, chat_ids, strict=True):
        ref = tok.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, return_dict=True
        )["input_ids"]
        assert ids == list(ref)


def test_greedy_matches_transformers(
    llm: LLM, chat_ids: list[list[int]], hf_greedy, hf_model: tuple
) -> None:
    eos = hf_model[1].eos_token_id
    ours = _tokens(llm, chat_ids)
    for prompt, ids, got in zip(CHAT_PROMPTS, chat_ids, ours, strict=True):
        want = _strip_eos(hf_greedy(ids, GREEDY.max_tokens), eos)
        assert got == want, f"diverged on {prompt!r}"


def test_capital_of_france(llm: LLM) -> None:
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}], GREEDY)
    assert "Paris" in out[0].outputs[0].text
    assert out[0].outputs[0].finish_reason == "stop"


@pytest.fixture(scope="module")
def knob_reference(tiny_llama: Path, chat_ids: list[list[int]]) -> list[list[int]]:
    """A default engine's tokens for half the chat prompts, which every knob below must give
    (computed once; four prompts of 40 tokens still overflow the tiny pool). The knobs change
    how the engine schedules and caches, not the model: a tiny random Llama serves them."""
    return _tokens(LLM(str(tiny_llama)), chat_ids[:4], KNOB_PARAMS)


KNOB_PARAMS = SamplingParams(temperature=0.0, max_tokens=40)


@pytest.mark.parametrize(
    "knobs",
    [
        pytest.param({"max_num_batched_tokens": 16}, id="chunked-prefill-16"),
        pytest.param({"enable_prefix_caching": False}, id="no-prefix-caching"),
        pytest.param(
            {"num_blocks": 10, "max_model_len": 160, "enable_prefix_caching": False},
            id="tiny-pool-preempts",
        ),
    ],
)
def test_same_outputs_under_engine_knobs(
    tiny_llama: Path, knob_reference: list[list[int]], chat_ids: list[list[int]], knobs: dict
) -> None:
    other = LLM(str(tiny_llama), **knobs)
    assert _tokens(other, chat_ids[:4], KNOB_PARAMS) == knob_reference
    stats = other.engine.stats()
    if "num_blocks" in knobs:
        assert stats.num_preemptions > 0, "the tiny pool was meant to force preemption"
    assert other.engine.kv.all_free() or stats.free_blocks == stats.total_blocks


def test_batched_equals_one_at_a_time(llm: LLM, chat_ids: list[list[int]]) -> None:
    prompts = (chat_ids * 2)[:16]
    params = SamplingParams(temperature=0.0, max_tokens=16)
    batched = _tokens(llm, prompts, params)
    single = [_tokens(llm, [p], params)[0] for p in prompts[:3]]
    assert batched[:3] == single
    assert batched[:8] == batched[8:]


def test_prefix_cache_hits_on_shared_system_prompt(
    tiny_llama: Path, chat_ids: list[list[int]]
) -> None:
    """The chat template's system prompt is cached whatever the model: a tiny random one."""
    fresh = LLM(str(tiny_llama))
    short = SamplingParams(temperature=0.0, max_tokens=4)
    fresh.generate([chat_ids[0]], short)
    before = fresh.engine.stats().prefix_cache_hits
    res = fresh.generate([chat_ids[1]], short)
    assert res[0].num_cached_tokens >= 16  # the default system prompt spans whole blocks
    assert fresh.engine.stats().prefix_cache_hits > before
    assert fresh.engine.stats().free_blocks == fresh.engine.stats().total_blocks
