"""``--kv-cache-dtype fp8`` on the embedded SmolLM2 (float32 weights, the CPU): the cache is e4m3,
twice a 16-bit cache's blocks for the same memory; greedy output stays within vLLM's near-tie
check of the model-dtype cache, and a disaggregated hand-off (the blocks copied byte for byte
into a decode engine's reservation) gives the colocated FP8 engine's text."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from protos.sampling_params import SamplingParams
from services.config import CacheConfig, ConfigError
from services.engine.kv_cache import plan_num_blocks
from services.engine.llm import LLM
from services.engine.llm_engine import LLMEngine
from services.engine.model_config import ArchConfig
from services.model_files import resolve_model
from tests.services.engine.conftest import hand_off

PARAMS = SamplingParams(temperature=0.0, max_tokens=16, logprobs=5)


@pytest.fixture(scope="module")
def fp8() -> LLM:
    return LLM("embedded", kv_cache_dtype="fp8", max_num_seqs=16)


def _first_parting(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)


def test_the_cache_is_e4m3_and_greedy_stays_near_the_float_cache(
    fp8: LLM, llm: LLM, chat_ids: list[list[int]]
) -> None:
    runner = fp8.engine.runner
    assert runner.kv_dtype == torch.float8_e4m3fn and runner.dtype == torch.float32
    assert all(c.dtype == torch.float8_e4m3fn for c in runner.kv_caches)
    ref, got = llm.generate(chat_ids, PARAMS), fp8.generate(chat_ids, PARAMS)
    exact = 0
    for r, g in zip(ref, got, strict=True):
        a, b = r.outputs[0], g.outputs[0]
        at = _first_parting(a.token_ids, b.token_ids)
        if at is None:
            exact += 1
            continue
        a_top = {t.token_id for t in a.logprobs[at].top}
        b_top = {t.token_id for t in b.logprobs[at].top}
        assert b.token_ids[at] in a_top and a.token_ids[at] in b_top, f"parted at {at}"
    assert exact >= 1, "no prompt kept the float cache's 16 tokens: the FP8 path is off"
    assert fp8.engine.kv.all_free()


def test_a_disaggregated_hand_off_of_fp8_blocks_equals_the_colocated_engine(
    fp8: LLM, chat_ids: list[list[int]]
) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=12)
    # one at a time, as each goes through the pair below (a batch would compose its steps
    # differently, and a different batch may part an fp8 near-tie on its own); two prompts
    # (was four), the suite's time
    want = [fp8.generate([p], params)[0].outputs[0].token_ids for p in chat_ids[:2]]
    prefill = fp8.engine
    decode = LLM("embedded", kv_cache_dtype="fp8", max_num_seqs=16).engine

    def move_bytes(prefill: LLMEngine, decode: LLMEngine, src: Tensor, dst: Tensor) -> None:
        for theirs, ours in zip(prefill.runner.kv_caches, decode.runner.kv_caches, strict=True):
            ours.view(torch.uint8)[:, dst] = theirs.view(torch.uint8)[:, src]  # the wire's bytes

    assert hand_off(prefill, decode, chat_ids[:2], params, move_bytes) == want


def test_an_fp8_pool_holds_twice_the_blocks_of_a_16_bit_one() -> None:
    arch = ArchConfig.from_file(resolve_model("smollm2-135m").path)
    cache = CacheConfig(kv_cache_gib=1.0, kv_cache_dtype="fp8")
    cpu = torch.device("cpu")
    fp8 = plan_num_blocks(cache, arch, torch.float8_e4m3fn, cpu, 2048)
    assert fp8 // 2 == plan_num_blocks(cache, arch, torch.bfloat16, cpu, 2048)  # floors differ
    assert fp8 // 4 == plan_num_blocks(cache, arch, torch.float32, cpu, 2048)


@pytest.mark.parametrize(
    ("value", "message"),
    [("fp8_e5m2", "fp8_e5m2 is not supported"), ("int8", "must be one of auto, fp8, fp8_e4m3")],
)
def test_unsupported_cache_dtypes_are_refused(value: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        CacheConfig(kv_cache_dtype=value)
