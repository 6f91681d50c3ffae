"""Builders for requests, schedulers and the deterministic fake sampler used by every test here."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from protos.sampling_params import SamplingParams
from services.config import SchedulerConfig
from services.scheduling.kv_manager import KVCacheManager
from services.scheduling.request import FinishReason, Request
from services.scheduling.scheduler import Scheduler

VOCAB = 1000
EOS = VOCAB  # outside the fake sampler's range unless a test samples it on purpose


def fake_token(request_id: str, position: int) -> int:
    """The token a fake model samples at ``position``: a function of the request and position only."""
    digest = hashlib.blake2b(f"{request_id}@{position}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % VOCAB


def prompt(n: int, seed: str = "p") -> list[int]:
    return [fake_token(seed, -1 - i) for i in range(n)]


def make_request(
    request_id: str,
    prompt_token_ids: Sequence[int] | int = 8,
    *,
    max_tokens: int = 4,
    min_tokens: int = 0,
    ignore_eos: bool = False,
    stop_token_ids: tuple[int, ...] = (),
    eos: frozenset[int] = frozenset({EOS}),
    priority: int = 0,
    arrival_time: float | None = None,
    max_model_len: int | None = None,
    hold: bool = False,
) -> Request:
    tokens = (
        prompt(prompt_token_ids, request_id)
        if isinstance(prompt_token_ids, int)
        else prompt_token_ids
    )
    params = SamplingParams(
        max_tokens=max_tokens,
        min_tokens=min_tokens,
        ignore_eos=ignore_eos,
        stop_token_ids=stop_token_ids,
    )
    req = Request(
        request_id=request_id,
        prompt_token_ids=list(tokens),
        sampling_params=params,
        eos_token_ids=eos,
        priority=priority,
        max_model_len=max_model_len,
        hold_blocks_on_finish=hold,
    )
    if arrival_time is not None:
        req.arrival_time = arrival_time
    return req


def make_scheduler(
    num_blocks: int = 64,
    block_size: int = 4,
    *,
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = 64,
    policy: str = "fcfs",
    long_prefill_token_threshold: int = 0,
    enable_caching: bool = True,
) -> Scheduler:
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        policy=policy,
        long_prefill_token_threshold=long_prefill_token_threshold,
    )
    return Scheduler(config, KVCacheManager(num_blocks, block_size, enable_caching))


def expected_output(req: Request) -> tuple[list[int], FinishReason]:
    """What the fake sampler must produce for ``req``: an oracle written apart from check_stop."""
    sp = req.sampling_params
    out: list[int] = []
    while True:
        token = fake_token(req.request_id, req.num_prompt_tokens + len(out))
        out.append(token)
        total = req.num_prompt_tokens + len(out)
        # a stop token ends the output as a stop even where it is the last one allowed (vLLM)
        stops = (token in req.eos_token_ids and not sp.ignore_eos) or token in sp.stop_token_ids
        if len(out) >= sp.min_tokens and stops:
            return out, FinishReason.STOP
        if len(out) >= sp.max_tokens or (req.max_model_len and total >= req.max_model_len):
            return out, FinishReason.LENGTH
