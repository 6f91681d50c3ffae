"""Prompt logprobs through the gateway against REAL workers (the embedded model on the CPU), in
both topologies: every prompt position's logprob and its top alternatives equal transformers'
log-softmax of the same forward pass, for a prompt that spans several prefill chunks; echo with
logprobs (lm-eval's loglikelihood) and max_tokens 0 give the same numbers; nothing leaks."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.gateway.test_e2e_real import both_topologies
from tests.services.procs import Fleet, Proc, fleet
from tests.services.reference import transformers_logprobs

__all__ = ["fleet"]
pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct"
# about 300 tokens: three chunks of a CPU worker's 128-token step
PROMPT = "In the beginning the river ran north, and the villages along it traded salt. " * 18
TOL = 1e-4


@pytest.fixture(scope="module")
def gateways(fleet: Fleet) -> Iterator[dict[str, Proc]]:
    yield from both_topologies(fleet)


def _ids(gateway: Proc) -> list[int]:
    body = httpx.post(f"{gateway.url}/tokenize", json={"prompt": PROMPT}, timeout=10).json()
    ids: list[int] = body["tokens"]
    return ids


@pytest.mark.parametrize("topology", ["disagg", "colocated"])
def test_prompt_logprobs_equal_transformers_at_every_position(
    gateways: dict[str, Proc], topology: str
) -> None:
    gateway = gateways[topology]
    ids = _ids(gateway)
    assert len(ids) > 256
    r = httpx.post(f"{gateway.url}/v1/completions", timeout=120, json={
        "model": MODEL, "prompt": ids, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 3,
    })  # fmt: skip
    assert r.status_code == 200, r.text
    scores = r.json()["choices"][0]["prompt_logprobs"]
    ref = transformers_logprobs(ids)
    assert len(scores) == len(ids) and scores[0] is None
    for q in range(len(ids) - 1):
        position = scores[q + 1]
        ours = position[str(ids[q + 1])]
        assert abs(ours["logprob"] - ref[q, ids[q + 1]].item()) < TOL, q
        # its rank among transformers' scores: tokens within TOL of it may fall either side
        chosen = ref[q, ids[q + 1]]
        assert (
            int((ref[q] > chosen + TOL).sum()) < ours["rank"] <= int((ref[q] > chosen - TOL).sum())
        )
        top = sorted((v["logprob"] for v in position.values() if v["rank"] <= 3), reverse=True)
        assert (
            max(abs(a - b) for a, b in zip(top, ref[q].topk(3).values.tolist(), strict=True)) < TOL
        )


async def test_echo_with_logprobs_scores_like_lm_eval(gateways: dict[str, Proc]) -> None:
    """lm-eval's local-completions loglikelihood request: echo, logprobs 1, max_tokens 0."""
    gateway = gateways["disagg"]
    ids = _ids(gateway)
    ref = transformers_logprobs(ids)
    async with openai.AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key="x", max_retries=0) as c:
        out = await c.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=0, echo=True, logprobs=1, temperature=0
        )
    choice = out.choices[0]
    lp: Any = choice.logprobs
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert out.usage is not None and out.usage.completion_tokens == 0
    assert len(lp.tokens) == len(ids) and lp.token_logprobs[0] is None
    total = sum(lp.token_logprobs[1:])
    expected = sum(ref[q, ids[q + 1]].item() for q in range(len(ids) - 1))
    assert abs(total - expected) < TOL * len(ids)
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
