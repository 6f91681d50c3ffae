"""Start-up warm-up steps: valid steps within the pool, and harmless to what is served after."""

from __future__ import annotations

import pytest
import torch

from protos.sampling_params import SamplingParams
from services.engine.llm import build_config
from services.engine.llm_engine import LLMEngine
from services.engine.warmup import warmup_steps


@pytest.mark.parametrize(
    ("budget", "max_len", "max_seqs", "block_size", "num_blocks"),
    [(8192, 2048, 256, 16, 10_000), (8192, 2048, 256, 16, 300), (512, 128, 8, 8, 1000),
     (64, 16, 2, 16, 6), (8192, 100, 1, 16, 100)],
)  # fmt: skip
def test_steps_stay_within_the_pool_the_model_and_the_limits(
    budget: int, max_len: int, max_seqs: int, block_size: int, num_blocks: int
) -> None:
    steps = warmup_steps(budget, max_len, max_seqs, block_size, num_blocks, vocab_size=1000)
    assert steps, "at least one step even for a small pool"
    for step in steps:
        assert 0 < step.num_tokens <= budget and len(step.requests) <= max_seqs
        for r in step.requests:
            assert r.context_len <= max_len
            assert len(r.block_ids) == -(-r.context_len // block_size)
            assert all(0 <= b < num_blocks for b in r.block_ids)
            assert len(set(r.block_ids)) == len(r.block_ids)
            assert all(0 <= t < 1000 for t in r.token_ids)
        blocks = [b for r in step.requests for b in r.block_ids]
        assert len(blocks) == len(set(blocks)), "two sequences of one step share a block"


@pytest.mark.parametrize(
    ("budget", "max_len", "max_seqs"), [(8192, 2048, 64), (8192, 2048, 4), (8192, 4096, 2),
                                        (8192, 2048, 1), (512, 300, 3)],
)  # fmt: skip
def test_the_budget_after_a_prefix_runs_whatever_the_batch_limit(budget: int, max_len: int, max_seqs: int) -> None:  # fmt: skip
    steps = warmup_steps(budget, max_len, max_seqs, 16, 100_000, vocab_size=1000)
    after = [s for s in steps if s.requests and all(r.start_pos == 16 for r in s.requests)]
    assert len(after) == 1, "one step of prompt chunks after a cached prefix"
    step = after[0]
    assert len(step.requests) <= max_seqs
    # the budget, or as much of it as the batch limit lets chunks of max_len - 1 - 16 tokens be
    assert step.num_tokens == min(budget, (max_len - 1 - 16) * max_seqs)
    assert all(r.context_len <= max_len for r in step.requests)


def test_no_prefix_step_when_a_sequence_is_at_most_a_block() -> None:
    steps = warmup_steps(64, 17, 4, 16, 100, vocab_size=1000)
    assert not any(r.start_pos == 16 for s in steps for r in s.requests)


def test_the_steps_cover_the_budget_a_mixed_step_and_single_decodes() -> None:
    steps = warmup_steps(8192, 2048, 256, 16, 10_000, vocab_size=50_000)
    shapes = [(s.num_tokens, [r.num_new_tokens for r in s.requests]) for s in steps]
    assert shapes[0][0] == 8192  # the largest step a worker can run
    assert shapes[0][1][0] % 2 == 1 and max(shapes[0][1]) <= 2047
    assert all(r.start_pos == 0 for r in steps[0].requests)
    # the budget again after a cached prefix: the paged prefill path's large-step tiles
    assert shapes[1][0] == 8192 and all(r.start_pos == 16 for r in steps[1].requests)
    mixed = shapes[2][1]
    assert mixed.count(1) == 3 and max(mixed) > 1 and shapes[2][0] % 16 != 0
    assert (1, [1]) in shapes and (3, [1, 1, 1]) in shapes


def _greedy(engine: LLMEngine, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    out: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    while engine.has_unfinished:
        for o in engine.step():
            out[o.request_id] += o.token_ids
    return [out[f"r{i}"] for i in range(len(prompts))]


def test_warmup_runs_and_changes_nothing_served_after_it() -> None:
    def engine() -> LLMEngine:
        return LLMEngine(
            build_config("smollm2-135m", load_format="dummy", dtype="float32", device="cpu",
                         max_model_len=128, num_blocks=40, max_num_seqs=4,
                         max_num_batched_tokens=96)
        )  # fmt: skip

    prompts = [[(11 * i + 5) % 4000 for i in range(n)] for n in (20, 33)]
    cold = _greedy(engine(), prompts)
    warm = engine()
    assert warm.runner.warmup() >= 0.0
    assert not warm.has_unfinished and warm.kv.num_free_blocks == warm.kv.num_blocks
    assert _greedy(warm, prompts) == cold
    assert torch.isfinite(warm.runner.kv_caches[0]).all()
