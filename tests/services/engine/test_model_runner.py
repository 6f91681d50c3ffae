"""The runner's step inputs: decode rows first for the kernels, logits in the scheduler's order."""

from __future__ import annotations

import pytest
import torch

from protos.sampling_params import SamplingParams
from services.engine.llm import build_config
from services.engine.llm_engine import LLMEngine
from services.scheduling.outputs import ScheduledRequest, SchedulerOutput

GREEDY = SamplingParams(temperature=0.0, max_tokens=4)


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return LLMEngine(
        build_config("smollm2-135m", load_format="dummy", dtype="float32", device="cpu",
                     max_model_len=128, num_blocks=64, max_num_seqs=8)
    )  # fmt: skip


def _req(rid: str, ids: list[int], start: int, blocks: list[int], sample: bool = True) -> ScheduledRequest:  # fmt: skip
    return ScheduledRequest(rid, ids[start:], start, blocks, sample, GREEDY, [], ids)


def _prompt(n: int, seed: int) -> list[int]:
    return [(97 * i + 31 * seed) % 5000 + 10 for i in range(n)]


def test_decode_rows_go_first_and_logits_keep_the_scheduler_order(engine: LLMEngine) -> None:
    runner = engine.runner
    a, b, c, d = _prompt(20, 1), _prompt(9, 2), _prompt(30, 3), _prompt(17, 4)
    # fill the caches of b and d (their decode tokens attend to it) with a prefill-only step
    runner.forward_logits(
        SchedulerOutput([_req("b", b[:-1], 0, [10]), _req("d", d[:-1], 0, [20, 21])])
    )
    step = SchedulerOutput([
        _req("a", a, 0, [0, 1]),  # a whole prompt
        _req("b", b, 8, [10]),  # a decode
        _req("c", c[:12], 0, [30], sample=False),  # a chunk that does not sample
        _req("d", d, 16, [20, 21]),  # a decode one past a block boundary
    ])  # fmt: skip
    inputs = runner.prepare(step)
    meta = inputs.meta
    assert meta.num_decodes == 2 and not meta.decode_only
    assert meta.block_tables[:, 0].tolist() == [10, 20, 0, 30]
    assert meta.query_start_loc.tolist() == [0, 1, 2, 22, 34]
    assert meta.prefill_start_loc is not None and meta.prefill_start_loc.tolist() == [0, 20, 32]
    assert inputs.logits_rows.tolist() == [21, 0, 1]  # a's last token, then b, then d
    with torch.inference_mode():
        mixed = runner.forward_logits(step)
        alone = [
            runner.forward_logits(SchedulerOutput([_req("a", a, 0, [0, 1])])),
            runner.forward_logits(SchedulerOutput([_req("b", b, 8, [10])])),
            runner.forward_logits(SchedulerOutput([_req("d", d, 16, [20, 21])])),
        ]
    assert mixed is not None and all(x is not None for x in alone)
    torch.testing.assert_close(mixed, torch.cat(alone), rtol=1e-4, atol=1e-4)  # type: ignore[arg-type]
