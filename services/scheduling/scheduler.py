"""Iteration-level scheduling: continuous batching with chunked prefill, prefix hits and preemption.

Each step spends a token budget (max-num-batched-tokens) over at most max-num-seqs requests:
running requests first (their next token, or the next chunk of their prompt), then waiting ones
in policy order. When blocks run out, the lowest-priority running request is preempted: its
blocks are freed and it is recomputed later (it keeps its generated tokens). With LoRA
(max_loras > 0) a step holds requests of at most max_loras distinct adapters (the device's
slots) besides the base model's: a request of another adapter waits for a later step.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from operator import attrgetter

from services.config import SchedulerConfig
from services.scheduling.kv_manager import KVCacheManager
from services.scheduling.outputs import (
    NO_TOKEN,
    SampledToken,
    ScheduledRequest,
    SchedulerOutput,
    StepUpdate,
)
from services.scheduling.request import FinishReason, Request, RequestStatus


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.held: dict[str, Request] = {}  # finished prefill-only requests keeping their blocks
        self.reserved: dict[str, Request] = {}  # decode side: blocks held for KV in flight
        self.num_preemptions = 0
        # async scheduling: the requests of the steps queued on the device and not read yet;
        # one of them that finishes keeps its blocks (``_unsettled``) until ``settle``
        self._in_flight: frozenset[str] = frozenset()
        self._unsettled: dict[str, Request] = {}
        # the policy's order (lowest first), an attrgetter: it keys a sort of every running
        # request every step
        fields = ("arrival_time", "seq")
        self._order_key = attrgetter(
            *(("priority", *fields) if config.policy == "priority" else fields)
        )

    # ---- admission and removal -------------------------------------------------------------
    def _in_use(self, rid: str) -> bool:
        """Whether ``rid`` names a request this scheduler still tracks (its blocks included)."""
        return any(rid in d for d in (self.requests, self.held, self.reserved, self._unsettled))

    def add(self, request: Request) -> None:
        if self._in_use(request.request_id):
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def abort(self, request_id: str) -> Request | None:
        req = self.requests.get(request_id)
        if req is not None:
            self._finish(req, FinishReason.ABORT)
            return req
        reserved = self.reserved.get(request_id)
        if reserved is not None:
            self.cancel_reservation(request_id)
            reserved.status = RequestStatus.FINISHED
            reserved.finish_reason = FinishReason.ABORT
            return reserved
        return self.release(request_id)

    def finish(self, request_id: str, reason: FinishReason, stop_reason: str | None = None) -> None:
        """Finish a request for a reason found outside the scheduler (a stop string)."""
        req = self.requests.get(request_id)
        if req is not None:
            req.stop_reason = stop_reason
            self._finish(req, reason)

    def reserve(self, request: Request) -> bool:
        """Hold blocks for a prompt whose KV another worker will write; False if they don't fit."""
        rid = request.request_id
        if self._in_use(rid):
            raise ValueError(f"request id {rid!r} is already in use")
        # not registered as a prefix: the KV is not there until activate()
        if not self.kv.allocate(request, request.num_prompt_tokens, register=False):
            return False
        self.reserved[rid] = request
        return True

    def activate(self, request_id: str, output_token_ids: list[int]) -> Request:
        """The reserved prompt's KV has arrived: the request joins the queue with it computed."""
        req = self.reserved.pop(request_id)
        req.queued_time = time.monotonic()  # it waited for its KV, not for this engine
        req.num_computed_tokens = req.num_prompt_tokens
        req.output_token_ids = list(output_token_ids)
        self.requests[request_id] = req
        last = req.output_token_ids[-1] if req.output_token_ids else None
        reason = req.check_stop(last) if last is not None else None
        if reason is not None:
            self._finish(req, reason)
        else:
            self.waiting.append(req)
        return req

    def cancel_reservation(self, request_id: str) -> bool:
        req = self.reserved.pop(request_id, None)
        if req is None:
            return False
        self.kv.free(req)
        return True

    def release(self, request_id: str) -> Request | None:
        """Free the blocks a finished prefill-only request kept for its transfer."""
        req = self.held.pop(request_id, None)
        if req is not None:
            self.kv.free(req)
        return req

    def _finish(self, req: Request, reason: FinishReason) -> None:
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        if req in self.running:
            self.running.remove(req)
        if req in self.waiting:
            self.waiting.remove(req)
        self.requests.pop(req.request_id, None)
        if req.hold_blocks_on_finish and reason is not FinishReason.ABORT:
            self.held[req.request_id] = req
        elif req.request_id in self._in_flight:  # a queued step still writes its KV
            self._unsettled[req.request_id] = req
        else:
            self.kv.free(req)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # ---- schedule ----------------------------------------------------------------------------
    def _num_new_tokens(self, left: int, budget: int) -> int:
        """Of the ``left`` tokens a running request has to compute, this step's share."""
        n = left
        if self.config.long_prefill_token_threshold > 0:
            n = min(n, self.config.long_prefill_token_threshold)
        return min(n, budget)

    @staticmethod
    def _whole_images(req: Request, start: int, n: int, budget: int) -> int:
        """Of ``n`` tokens from ``start``, the share that cuts no image of a request whose
        images must be computed whole (``Request.whole_images``): a chunk that would end inside
        an image ends before it, or, when the image starts the chunk (or the chunk starts
        inside it: a prefix-cache hit within the image), takes the rest of the image when the
        step's ``budget`` holds it, else nothing this step (the engine refuses an image longer
        than a step's whole budget)."""
        if not req.whole_images or n <= 0:
            return n
        end = start + n
        for image in req.images:
            if image.offset < end < image.end:
                if image.offset > start:
                    return image.offset - start
                rest = image.end - start
                return rest if rest <= budget else 0
        return n

    def _preempt_victim(self) -> Request:
        # activated requests waiting for a seat hold KV too; sparing them can livelock the pool
        holders = [r for r in self.waiting if r.num_computed_tokens > 0]
        return max([*self.running, *holders], key=self._order_key)

    def _preempt(self, victim: Request) -> None:
        if victim in self.running:
            self.running.remove(victim)
            self.waiting.append(victim)
        self.kv.free(victim)
        victim.status = RequestStatus.PREEMPTED
        victim.num_computed_tokens = 0
        victim.num_preemptions += 1
        self.num_preemptions += 1

    def schedule(self) -> SchedulerOutput:
        self.kv.offload_on_evict = True
        try:
            out = self._schedule()
        finally:
            self.kv.offload_on_evict = False
        out.kv_offloads, out.kv_restores = self.kv.drain_moves()
        return out

    def _schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.token_budget
        scheduled: list[tuple[Request, int]] = []
        adapters: set[str] = set()  # the LoRA adapters this step runs so far
        self.running.sort(key=self._order_key)
        # a token of budget is kept for each running decode, so no (re)prefill starves them
        decodes_left = sum(1 for r in self.running if r.num_tokens - r.num_computed_tokens == 1)
        for req in list(self.running):
            # preempted earlier in this loop (status checked: list membership is O(n) per call)
            if req.status is not RequestStatus.RUNNING or budget <= 0:
                continue
            left = req.num_tokens - req.num_computed_tokens
            is_decode = left == 1
            decodes_left -= is_decode
            if self.config.max_loras and not self._adapter_fits(req, adapters):
                continue
            n = self._num_new_tokens(left, budget if is_decode else budget - decodes_left)
            n = self._whole_images(req, req.num_computed_tokens, n, budget)
            if n <= 0:
                continue
            while not self.kv.allocate(req, n):
                victim = self._preempt_victim()
                self._preempt(victim)
                out.preempted.append(victim.request_id)
                if victim is req:
                    break
            if req.status is RequestStatus.RUNNING:
                scheduled.append((req, n))
                budget -= n
        if not out.preempted:
            budget = self._admit_waiting(budget, scheduled, out.preempted, adapters)
        scheduled = self._add_drafts(scheduled, budget)
        out.requests = [self._to_scheduled(req, n) for req, n in scheduled]
        return out

    def _add_drafts(
        self, scheduled: list[tuple[Request, int]], budget: int
    ) -> list[tuple[Request, int]]:
        """Draft tokens (speculative decoding) after the decodes that carry them, from what is
        left once every request, running or admitted, has its share: the step's budget and
        free blocks. Drafts never take a block or a token another request needs."""
        if not any(req.spec_token_ids for req, _ in scheduled):
            return scheduled
        out = []
        for req, n in scheduled:
            drafts = len(req.spec_token_ids)
            if drafts and n == 1 and req.num_tokens - req.num_computed_tokens == 1 and budget > 0:
                extra = min(drafts, budget)
                # within the blocks it holds, plus free ones (allocate fails without side effects)
                while extra > 0 and not self.kv.allocate(req, 1 + extra):
                    held = len(self.kv.block_ids(req.request_id)) * self.kv.block_size
                    extra = min(extra - 1, held - req.num_computed_tokens - 1)
                if extra > 0:
                    n += extra
                    budget -= extra
            out.append((req, n))
        return out

    def _adapter_fits(self, req: Request, adapters: set[str]) -> bool:
        """Whether ``req`` may join a step running ``adapters`` (added to them if so)."""
        name = req.lora_name
        if not name or self.config.max_loras == 0 or name in adapters:
            return True
        if len(adapters) >= self.config.max_loras:
            return False
        adapters.add(name)
        return True

    def _admit_waiting(
        self, budget: int, scheduled: list[tuple[Request, int]], preempted: list[str],
        adapters: set[str],
    ) -> int:  # fmt: skip
        self.waiting.sort(key=self._order_key)
        i = 0  # requests of adapters the step has no slot for are passed over, in place
        while i < len(self.waiting) and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[i]
            if not self._adapter_fits(req, adapters):
                i += 1
                continue
            fresh = req.num_computed_tokens == 0
            cached = self.kv.find_cached_prefix(req) if fresh else []
            host = self.kv.find_host_prefix(req, len(cached)) if fresh else []
            num_cached = (len(cached) + len(host)) * self.kv.block_size
            n = min(req.num_tokens - req.num_computed_tokens - num_cached, budget)
            if self.config.long_prefill_token_threshold > 0:
                n = min(n, self.config.long_prefill_token_threshold)
            n = self._whole_images(req, req.num_computed_tokens + num_cached, n, budget)
            if n <= 0:  # its next image does not fit what is left of this step
                break
            if not self.kv.allocate(req, n, cached, restore=host):
                # requests queued behind the head may hold KV (activated): free theirs first
                holders = [r for r in self.waiting[i + 1 :] if r.num_computed_tokens > 0]
                if not holders:
                    break
                victim = max(holders, key=self._order_key)
                self._preempt(victim)
                preempted.append(victim.request_id)
                continue
            self.waiting.pop(i)
            self.kv.record_prefix_query(req, num_cached, len(host) * self.kv.block_size)
            if req.num_preemptions == 0:  # a recompute's hits are not prompt-cache hits
                req.num_cached_tokens = num_cached
            req.num_computed_tokens += num_cached
            req.status = RequestStatus.RUNNING
            if req.first_scheduled_time is None:
                req.first_scheduled_time = time.monotonic()
            self.running.append(req)
            scheduled.append((req, n))
            budget -= n
        return budget

    def _to_scheduled(self, req: Request, n: int) -> ScheduledRequest:
        start, total = req.num_computed_tokens, req.num_tokens
        known = min(start + n, total)
        num_spec = start + n - known  # draft tokens after the known ones
        token_ids = req.token_ids(start, known)
        if req.spec_token_ids:
            token_ids += req.spec_token_ids[:num_spec]
            req.spec_token_ids = []
        return self._scheduled(req, start, token_ids, known == total, num_spec)

    def _scheduled(
        self, req: Request, start: int, token_ids: list[int], sample: bool, num_spec: int = 0
    ) -> ScheduledRequest:
        return ScheduledRequest(
            request_id=req.request_id,
            token_ids=token_ids,
            start_pos=start,
            block_ids=self.kv.block_ids(req.request_id),
            sample=sample,
            sampling_params=req.sampling_params,
            output_token_ids=req.output_token_ids,
            prompt_token_ids=req.prompt_token_ids,
            num_spec=num_spec,
            pooling=req.pooling,
            images=req.images,
            position_offset=req.position_offset,
        )

    # ---- async scheduling --------------------------------------------------------------------
    def schedule_ahead(
        self, running: SchedulerOutput, may_admit: Callable[[Request], bool] | None = None
    ) -> tuple[SchedulerOutput, list[int]] | None:
        """The step after ``running`` (a step on the device, not read yet), scheduled without its
        sampled tokens: a request ``running`` samples for decodes that token (a placeholder
        here: its id stays on the device), one it prefills a chunk of goes on with its next
        chunk (known tokens), and waiting requests take free seats as the full schedule would
        (only if ``may_admit`` accepts every one waiting: what the device cannot run alone waits
        for the full schedule). Also, per request of the new step, the row of ``running``'s
        sampled tokens that is its input id (-1: its tokens are known here).
        None when only the synchronous ``schedule`` may say what runs next: a running request
        not in ``running``, one that would need the sampler's host work (``min_tokens``), drafts,
        images in a chunk, blocks that are not free (no preemption here), or a seat that
        ``running`` frees by length while requests wait. A request that ``running`` finishes by
        length is left out; one that it ends with a stop token is in, and its token is dropped
        by ``update``."""
        decodes: list[tuple[Request, ScheduledRequest, int]] = []
        chunks: list[tuple[Request, ScheduledRequest]] = []
        live, row, frees_a_seat = 0, -1, False
        for sr in running.requests:
            row += sr.samples_token  # rows of ``running``'s sampled tokens, in request order
            req = self.requests.get(sr.request_id)
            if req is None or req.status is not RequestStatus.RUNNING:
                continue  # aborted since
            live += 1
            if req.num_computed_tokens != sr.start_pos or req.spec_token_ids or sr.num_spec:
                return None
            if req.hold_blocks_on_finish:  # its blocks outlive it: never under a queued step
                return None
            if not sr.samples_token:
                if req.images:  # a chunk's image embeddings: the full schedule's checks
                    return None
                chunks.append((req, sr))
                continue
            n_out = len(req.output_token_ids) + 1  # after ``running``
            if req.ends_by_length(n_out):
                frees_a_seat = True
                continue  # ends with ``running``
            if n_out < req.sampling_params.min_tokens:
                return None  # its stop tokens are masked by the sampler
            decodes.append((req, sr, row))
        if live != len(self.running):
            return None
        admit = bool(self.waiting) and len(self.running) < self.config.max_num_seqs
        if self.waiting and not admit and frees_a_seat:
            return None  # the seat opens with ``running``: the full schedule admits
        if admit and (may_admit is None or not all(may_admit(r) for r in self.waiting)):
            return None
        budget = self.config.token_budget - len(decodes)
        if budget < 0:
            return None
        out, rows = SchedulerOutput(), []
        for req, sr, r in decodes:
            # ``running``'s token and this step's; registered in the prefix cache once known
            if not self.kv.allocate(req, sr.num_new_tokens + 1, register=False):
                return None  # what is taken stays: the next steps need it anyway
            out.requests.append(self._scheduled(req, sr.start_pos + sr.num_new_tokens, [0], True))
            rows.append(r)
        for req, sr in chunks:
            start = sr.start_pos + sr.num_new_tokens
            n = self._num_new_tokens(req.num_tokens - start, budget)
            if n <= 0:
                continue  # no budget left: it waits for a later step, as in ``schedule``
            last = start + n == req.num_tokens
            if last and len(req.output_token_ids) < req.sampling_params.min_tokens:
                return None
            if not self.kv.allocate(req, sr.num_new_tokens + n, register=False):
                return None
            out.requests.append(self._scheduled(req, start, req.token_ids(start, start + n), last))
            rows.append(-1)
            budget -= n
        if admit and budget > 0:
            admitted: list[tuple[Request, int]] = []
            self._admit_waiting(budget, admitted, out.preempted, set())
            for req, n in admitted:
                out.requests.append(self._to_scheduled(req, n))
                rows.append(-1)
        if not out.requests:
            return None
        return out, rows

    def settle(self, in_flight: frozenset[str]) -> None:
        """The requests of the steps now queued on the device and not read: those finished
        and no longer among them give their blocks back."""
        self._in_flight = in_flight
        for rid in [r for r in self._unsettled if r not in in_flight]:
            self.kv.free(self._unsettled.pop(rid))

    def register_ahead(self, out: SchedulerOutput) -> None:
        """After the step before ``out`` was read: ``out``'s requests' blocks that are now full
        of known tokens join the prefix cache (``schedule_ahead`` could not hash them)."""
        for sr in out.requests:
            req = self.requests.get(sr.request_id)
            if req is not None and req.status is RequestStatus.RUNNING:
                # within its blocks: registers, allocates nothing
                self.kv.allocate(req, sr.num_new_tokens)

    # ---- update ------------------------------------------------------------------------------
    def update(
        self, out: SchedulerOutput, sampled: Mapping[str, Sequence[SampledToken]]
    ) -> list[StepUpdate]:
        """``sampled``: each sampling request's new tokens, in order. With drafts, all but the
        last are the drafts it kept (their KV is now computed; a rejected draft's slot is
        simply written again later). ``NO_TOKEN`` (its masks left the sampler nothing) ends
        the request with an error there: its update carries it, and no output token."""
        updates: list[StepUpdate] = []
        for sr in out.requests:
            req = self.requests.get(sr.request_id)
            if req is None or req.status is not RequestStatus.RUNNING:
                continue  # aborted while the step ran
            tokens = sampled.get(sr.request_id, ()) if sr.sample else ()
            kept = max(len(tokens) - 1, 0) if sr.num_spec else 0
            req.num_computed_tokens += sr.num_new_tokens - sr.num_spec + kept
            if sr.sample and req.pooling is not None:
                updates.append(self._pooled(req))
                continue
            if sr.num_spec > kept:  # blocks that held only rejected drafts go back
                self.kv.trim(req, req.num_computed_tokens + 1)  # + the token still to compute
            for token in tokens:
                if token.token_id == NO_TOKEN:
                    reason: FinishReason | None = FinishReason.ERROR
                else:
                    req.output_token_ids.append(token.token_id)
                    reason = req.check_stop(token.token_id)
                if reason is not None:
                    self._finish(req, reason)
                updates.append(
                    StepUpdate(
                        request_id=req.request_id,
                        token=token,
                        finished=reason is not None,
                        finish_reason=reason.value if reason else None,
                        stop_reason=req.stop_reason,
                        num_prompt_tokens=req.num_prompt_tokens,
                        num_cached_tokens=req.num_cached_tokens,
                        queue_s=req.queue_s,
                    )
                )
                if reason is not None:
                    break  # the rest of a kept run is past the end
        return updates

    def _pooled(self, req: Request) -> StepUpdate:
        """An embedding whose whole prompt is computed: done, its blocks freed (or cached)."""
        self._finish(req, FinishReason.STOP)
        return StepUpdate(
            request_id=req.request_id, token=None, finished=True, finish_reason="stop",
            stop_reason=None, num_prompt_tokens=req.num_prompt_tokens,
            num_cached_tokens=req.num_cached_tokens, queue_s=req.queue_s,
        )  # fmt: skip

    def check_invariants(self) -> None:
        self.kv.check_invariants()
        for req in self.running:
            assert req.status is RequestStatus.RUNNING
        assert len(self.running) <= self.config.max_num_seqs
