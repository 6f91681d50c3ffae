"""A fake engine that drives a Scheduler the way the real one does and checks it after every step.

It keeps a model of the KV cache: each block slot records a key of the whole token prefix it was
computed for. Within a step every request's new KV is written before any request attends (as a
paged-attention forward does per layer), so a request may attend to a block that another request
of the same step fills. Every position a request attends to must hold its own prefix's key, so a prefix hit
on the wrong block, a block overwritten while shared, or KV that never arrived is caught at once.
"""

from __future__ import annotations

from collections.abc import Callable

from services.scheduling.outputs import SampledToken, ScheduledRequest, SchedulerOutput, StepUpdate
from services.scheduling.request import Request, RequestStatus
from services.scheduling.scheduler import Scheduler
from tests.services.scheduling.conftest import fake_token

Sampler = Callable[[str, int], int]


def prefix_keys(tokens: list[int]) -> list[int]:
    keys, key = [], 0
    for token in tokens:
        key = hash((key, token))
        keys.append(key)
    return keys


class FakeEngine:
    def __init__(self, scheduler: Scheduler, sampler: Sampler = fake_token) -> None:
        self.scheduler = scheduler
        self.sampler = sampler
        self.block_size = scheduler.kv.block_size
        self.kv_store: dict[int, dict[int, int]] = {}  # block id -> slot -> prefix key
        self.streamed: dict[str, list[int]] = {}  # request id -> tokens the client received
        self.finished: dict[str, StepUpdate] = {}
        self.outputs: list[SchedulerOutput] = []

    # ---- the engine's side ---------------------------------------------------------------
    def add(self, *requests: Request) -> None:
        for req in requests:
            self.scheduler.add(req)

    def transfer(self, request_id: str, req: Request) -> None:
        """Write a reserved request's prompt KV, as the KV transfer layer would."""
        self._write(req.prompt_token_ids, 0, len(req.prompt_token_ids), self._table(request_id))

    def step(self, during: Callable[[], object] | None = None) -> SchedulerOutput:
        """One engine step; ``during`` runs while the model computes (an abort, say)."""
        out = self.scheduler.schedule()
        self.check_batch(out)
        for sr in out.requests:  # every layer writes its new KV before attending
            self._write(self._tokens(sr), sr.start_pos, sr.context_len, sr.block_ids)
        for sr in out.requests:
            self._check_reads(sr)
        if during is not None:
            during()
        sampled = {
            sr.request_id: [SampledToken(self.sampler(sr.request_id, sr.context_len))]
            for sr in out.requests
            if sr.sample
        }
        for update in self.scheduler.update(out, sampled):
            assert update.token is not None
            self.streamed.setdefault(update.request_id, []).append(update.token.token_id)
            if update.finished:
                self.finished[update.request_id] = update
        self.outputs.append(out)
        self.check_state()
        return out

    def run(self, max_steps: int = 5000, on_step: Callable[[int], None] | None = None) -> None:
        for i in range(max_steps):
            if not self.scheduler.has_unfinished:
                return
            if on_step is not None:
                on_step(i)
            self.step()
        raise AssertionError(f"requests still unfinished after {max_steps} steps")

    # ---- checks ----------------------------------------------------------------------------
    def check_batch(self, out: SchedulerOutput) -> None:
        config = self.scheduler.config
        assert out.num_tokens <= config.token_budget, "token budget exceeded"
        assert len(out.requests) <= config.max_num_seqs, "max_num_seqs exceeded"
        ids = [sr.request_id for sr in out.requests]
        assert len(set(ids)) == len(ids), f"a request scheduled twice in one step: {ids}"
        written: set[int] = set()
        for sr in out.requests:
            req = self.scheduler.requests[sr.request_id]
            assert req.status is RequestStatus.RUNNING
            assert sr.num_new_tokens >= 1, f"{sr.request_id} scheduled with nothing to compute"
            assert sr.start_pos == req.num_computed_tokens
            assert sr.token_ids == req.token_ids(sr.start_pos, sr.context_len)
            assert sr.sample == (sr.context_len == req.num_tokens)
            assert len(sr.block_ids) * self.block_size >= sr.context_len, "too few blocks"
            assert len(set(sr.block_ids)) == len(sr.block_ids), "a block twice in one table"
            for bid in self._written_blocks(sr):  # readers of it are checked by the KV model
                assert bid not in written, f"two requests write block {bid} in one step"
                written.add(bid)

    def check_state(self) -> None:
        """Invariants plus: every block in use belongs to a request the scheduler knows."""
        sched = self.scheduler
        sched.check_invariants()
        owners = [*sched.running, *sched.waiting, *sched.held.values(), *sched.reserved.values()]
        owned = {bid for req in owners for bid in sched.kv.block_ids(req.request_id)}
        in_use = {b.block_id for b in sched.kv.pool.blocks if b.ref_cnt > 0}
        assert in_use == owned, f"blocks {sorted(in_use - owned)} are used but owned by nobody"
        for req in sched.waiting:
            if req.num_computed_tokens == 0:
                assert not sched.kv.block_ids(req.request_id), f"waiting {req.request_id} holds KV"

    # ---- the KV model ------------------------------------------------------------------------
    def _table(self, request_id: str) -> list[int]:
        return self.scheduler.kv.block_ids(request_id)

    def _tokens(self, sr: ScheduledRequest) -> list[int]:
        return (sr.prompt_token_ids + sr.output_token_ids)[: sr.context_len]

    def _written_blocks(self, sr: ScheduledRequest) -> set[int]:
        bs = self.block_size
        return {sr.block_ids[pos // bs] for pos in range(sr.start_pos, sr.context_len)}

    def _write(self, tokens: list[int], start: int, end: int, table: list[int]) -> None:
        keys = prefix_keys(tokens[:end])
        for pos in range(start, end):
            block = self.kv_store.setdefault(table[pos // self.block_size], {})
            block[pos % self.block_size] = keys[pos]

    def _check_reads(self, sr: ScheduledRequest) -> None:
        keys = prefix_keys(self._tokens(sr))
        for pos in range(sr.context_len):
            slot = self.kv_store.get(sr.block_ids[pos // self.block_size], {})
            assert slot.get(pos % self.block_size) == keys[pos], (
                f"{sr.request_id} attends to wrong KV at position {pos}"
            )
