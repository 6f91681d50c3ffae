"""The synthetic decode step the profiler runs is a valid step (CPU here, references)."""

from __future__ import annotations

import torch

from services.engine.bench.profile_step import decode_step, prefill_step
from services.engine.llm import build_config
from services.engine.llm_engine import LLMEngine


def test_synthetic_decode_step_runs_and_gives_one_row_of_logits_per_sequence() -> None:
    engine = LLMEngine(
        build_config("smollm2-135m", load_format="dummy", dtype="float32", device="cpu",
                     max_model_len=64, num_blocks=16, max_num_seqs=4)
    )  # fmt: skip
    step = decode_step(engine, batch=3, context=33)  # one past a block boundary
    assert [r.block_ids for r in step.requests][1] == [3, 4, 5]
    with torch.inference_mode():
        logits = engine.runner.forward_logits(step)
    assert logits is not None and logits.shape == (3, engine.vocab_size)
    assert torch.isfinite(logits).all()


def test_synthetic_prefill_step_equals_one_prompt_prefilled_alone() -> None:
    """Whole prompts from position 0, one sampling row each: the batched step's last-token logits
    are each prompt's own."""
    engine = LLMEngine(
        build_config("smollm2-135m", load_format="dummy", dtype="float32", device="cpu",
                     max_model_len=64, num_blocks=16, max_num_seqs=4)
    )  # fmt: skip
    step = prefill_step(engine, batch=2, context=17)
    assert [r.start_pos for r in step.requests] == [0, 0]
    assert [len(r.token_ids) for r in step.requests] == [17, 17]
    with torch.inference_mode():
        both = engine.runner.forward_logits(step)
        step.requests = step.requests[1:]
        alone = engine.runner.forward_logits(step)
    assert both is not None and alone is not None and both.shape == (2, engine.vocab_size)
    torch.testing.assert_close(both[1:], alone, rtol=1e-4, atol=1e-4)
