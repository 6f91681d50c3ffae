"""Speculative decoding behind the gateway, on real workers (the embedded model on the CPU): a
decode worker started with n-gram --speculative-config (behind the shared prefill worker), and a
colocated worker with the embedded model as its own draft model, give the same greedy text as the
shared workers without it, on 16 prompts of 16 tokens each, and report their drafts in
/metrics. (No colocated n-gram worker: the suite's time; the engine's tests run n-gram drafts in
one process.)"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import pytest

from tests.gateway.test_e2e_real import pools_free, wait_healthy
from tests.services.engine.test_speculative import PROMPTS
from tests.services.procs import Fleet, Proc, fleet

__all__ = ["fleet"]
pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct"
SPEC = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}'
DRAFT = '{"method": "draft_model", "model": "embedded", "num_speculative_tokens": 3}'


@pytest.fixture(scope="module")
def gateways(fleet: Fleet) -> Iterator[dict[str, Proc]]:
    prefill, decode = fleet.shared("prefill", "decode")
    spec_decode = fleet.spawn("decode", "--speculative-config", SPEC, name="spec-decode")
    draft_worker = fleet.spawn("worker", "--speculative-config", DRAFT, name="draft-worker")
    spec_decode.wait_ready()
    draft_worker.wait_ready()
    found = {
        "plain": fleet.shared_gateway(prefill=[prefill], decode=[decode]),  # not killed below
        "disagg": fleet.gateway(prefill=[prefill], decode=[spec_decode]),
        "draft-colocated": fleet.gateway(worker=[draft_worker]),
    }
    for name, gateway in found.items():
        wait_healthy(gateway, 1 if "colocated" in name else 2)
    yield found
    try:  # while the gateways run: they release what their last requests held (see both_topologies)
        asyncio.run(pools_free(prefill, spec_decode, draft_worker, timeout_s=10.0))
    finally:
        for name in ("disagg", "draft-colocated"):
            found[name].kill()
    for proc in (spec_decode, draft_worker):
        fleet.forget(proc)
        proc.kill()


async def _complete(gateway: Proc) -> list[str]:
    async with httpx.AsyncClient(base_url=f"{gateway.url}/v1", timeout=120) as client:
        # 16 tokens: drafts are kept on the copying prompts (checked below) within them
        bodies = [
            {"model": MODEL, "prompt": p, "max_tokens": 16, "temperature": 0} for p in PROMPTS
        ]
        answers = await asyncio.gather(*(client.post("/completions", json=b) for b in bodies))
    for a in answers:
        assert a.status_code == 200, a.text
    return [a.json()["choices"][0]["text"] for a in answers]


def _accepted(gateway: Proc) -> float:
    text = httpx.get(f"{gateway.url}/metrics", timeout=5).text
    lines = [
        ln
        for ln in text.splitlines()
        if ln.startswith("tandem:spec_decode_num_accepted_tokens_total")
    ]
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in lines)


@pytest.fixture(scope="module")
def plain_text(gateways: dict[str, Proc]) -> list[str]:
    """What the workers without speculation answer (asked once for every topology below)."""
    return asyncio.run(_complete(gateways["plain"]))


@pytest.mark.parametrize("topology", ["disagg", "draft-colocated"])
def test_greedy_text_equals_the_workers_without_speculation(
    gateways: dict[str, Proc], plain_text: list[str], topology: str
) -> None:
    got = asyncio.run(_complete(gateways[topology]))
    assert got == plain_text
    assert _accepted(gateways[topology]) > 0  # drafts were kept, and /metrics says how many
    assert _accepted(gateways["plain"]) == 0
