"""On a GPU: decode steps launched ahead (CUDA graphs, token ids that never leave the device)
give the tokens of step-by-step scheduling, under stop tokens, length limits and seeded draws."""

from __future__ import annotations

import pytest
import torch

from protos.sampling_params import SamplingParams
from services.engine.llm import LLM
from tests.services.engine.conftest import count_launches

pytestmark = pytest.mark.gpu


def test_launched_graph_steps_give_the_tokens_of_step_by_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    llm = LLM("smollm2-135m", load_format="dummy", dtype="bfloat16", max_model_len=512,
              max_num_seqs=16)  # fmt: skip
    engine = llm.engine
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, 40000, (n,), generator=gen).tolist() for n in range(5, 21)]

    def run(params: list[SamplingParams]) -> list[list[int]]:
        return [r.outputs[0].token_ids for r in llm.generate(prompts, params)]

    monkeypatch.setattr(engine, "async_decode", False)
    free = run([SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)] * len(prompts))
    monkeypatch.undo()
    # stop tokens that end some requests mid-run, and length limits that end others
    # and seeded draws (temperature, top-p) beside them, sampled on the device
    params = [
        SamplingParams(temperature=0, max_tokens=8 + 3 * i, stop_token_ids=[free[i][10 + i]])
        if i % 2 else SamplingParams(temperature=0, max_tokens=8 + 3 * i, ignore_eos=True)
        for i in range(len(prompts) - 4)
    ] + [
        SamplingParams(temperature=0.9, top_p=0.95, seed=i, max_tokens=30, ignore_eos=True)
        for i in range(4)
    ]  # fmt: skip
    launches = count_launches(engine, monkeypatch)
    graphs = engine.runner.forwards.graph
    ahead = run(params)
    assert launches[0] > 10 and launches[1] > 5 and engine.runner.forwards.graph - graphs > 10
    monkeypatch.setattr(engine, "async_decode", False)
    assert ahead == run(params)
    assert engine.stats().free_blocks == engine.stats().total_blocks
