"""LoRA in the scheduler: a step never runs more distinct adapters than the device has slots
(max_loras), the base model's requests are never held back by it, and the prefix cache keys
blocks by adapter (the cache salt)."""

from __future__ import annotations

from dataclasses import replace

from services.config import SchedulerConfig
from services.scheduling.kv_manager import KVCacheManager
from services.scheduling.request import Request
from services.scheduling.scheduler import Scheduler
from tests.services.scheduling.conftest import make_request, prompt


def lora_request(rid: str, adapter: str, tokens: list[int] | int = 6) -> Request:
    req = make_request(rid, tokens, max_tokens=3)
    req.sampling_params = replace(req.sampling_params, lora_name=adapter)
    req.cache_salt = f"lora:{adapter}" if adapter else ""
    return req


def scheduler(max_loras: int) -> Scheduler:
    config = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=64, max_loras=max_loras)
    return Scheduler(config, KVCacheManager(64, 4, True))


def adapters_of(sched: Scheduler) -> list[set[str]]:
    """Each step's adapters until every request finished (tokens sampled: always 1)."""
    from services.scheduling.outputs import SampledToken

    steps = []
    while sched.has_unfinished:
        out = sched.schedule()
        steps.append({sched_req.sampling_params.lora_name for sched_req in out.requests})
        sched.update(out, {r.request_id: [SampledToken(1)] for r in out.requests if r.sample})
    return steps


def test_a_step_runs_at_most_max_loras_adapters_beside_the_base_model() -> None:
    sched = scheduler(max_loras=2)
    for i, adapter in enumerate(["a", "b", "c", "", "a", "c", ""]):
        sched.add(lora_request(f"r{i}", adapter))
    steps = adapters_of(sched)
    assert all(len(s - {""}) <= 2 for s in steps), steps
    assert "" in steps[0], "a base-model request waited for an adapter's slot"
    assert steps[0] - {""} == {"a", "b"}, "the first adapters in line take the slots"
    assert any("c" in s for s in steps), "the third adapter never ran"


def test_without_lora_every_request_runs_at_once() -> None:
    sched = scheduler(max_loras=0)
    for i, adapter in enumerate(["", "", ""]):
        sched.add(lora_request(f"r{i}", adapter))
    assert len(sched.schedule().requests) == 3


def test_the_same_prompt_under_two_adapters_shares_no_block() -> None:
    sched = scheduler(max_loras=2)
    tokens = prompt(13, "shared")
    first = lora_request("base", "", tokens)
    sched.add(first)
    adapters_of(sched)  # finished: its full blocks stay cached
    under_a = lora_request("a", "a", tokens)
    assert sched.kv.find_cached_prefix(under_a) == [], "an adapter read the base model's KV"
    again = lora_request("base-again", "", tokens)
    assert len(sched.kv.find_cached_prefix(again)) == 3, "the base model's own prefix missed"
