"""Picks the flow (disaggregated or colocated) and the workers, and retries a request once when
it failed before its first token: on another prefill (or colocated) worker when that one failed,
on another decode worker when the one holding (or asked for) its KV went away."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncGenerator, Sequence
from dataclasses import replace

from opentelemetry.trace import Span

from gateway.core.errors import unavailable
from gateway.core.events import Chunk, Embedding, EmbedWork
from gateway.workers.client import WorkerClient
from gateway.workers.colocated import generate
from gateway.workers.disagg import disaggregated, resumed
from gateway.workers.embedding import embed_batch
from gateway.workers.prefill_choice import NO_PREFILL
from gateway.workers.router import prefix_key, rank_by_affinity
from gateway.workers.rpc_errors import UpstreamError
from gateway.workers.work import FlowContext, WorkItem
from protos.roles import Role

log = logging.getLogger(__name__)
MAX_ATTEMPTS = 2


class Dispatcher:
    def __init__(self, ctx: FlowContext) -> None:
        self.ctx = ctx

    def unavailable_reason(self) -> str | None:
        """None when some topology can serve; otherwise what is missing."""
        reg = self.ctx.registry
        if reg.any_healthy():
            return None
        counts = []
        for role in Role:
            total = sum(1 for c in reg.clients if c.role == role)
            counts.append(f"{len(reg.healthy(role))} of {total} {role}")
        return "no healthy worker can serve requests (" + ", ".join(counts) + " workers healthy)"

    def _decode_workers(self, lora: str, exclude: set[str] | None = None) -> list[WorkerClient]:
        gone = exclude or set()
        return [
            w
            for w in self.ctx.registry.healthy("decode")
            if w.serves(lora) and w.address not in gone
        ]

    def _front_workers(self, exclude: set[str], lora: str) -> tuple[list[WorkerClient], str]:
        """Prefill (or colocated) workers for a request under adapter ``lora`` ("" = base):
        only those serving it (a decode worker too, for the prefill path)."""
        reg = self.ctx.registry
        prefills = [
            w for w in reg.healthy("prefill") if w.address not in exclude and w.serves(lora)
        ]
        decodes = self._decode_workers(lora, exclude)
        if prefills and decodes:
            return prefills, "prefill"
        colocated = [w for w in reg.healthy(Role.COLOCATED) if w.task == "generate"]
        colocated = [w for w in colocated if w.address not in exclude and w.serves(lora)]
        if colocated or not decodes:
            return colocated, Role.COLOCATED
        return decodes, Role.DECODE  # no prefill worker (dead, restarting): decode prefills

    def _flow(
        self, item: WorkItem, parent: Span, exclude: set[str], sent: Sequence[int] = ()
    ) -> AsyncGenerator[Chunk, None]:
        lora = item.sampling.lora_name
        if sent:  # resumed: prompt and sent tokens prefilled on a decode worker
            once = replace(item.sampling, prompt_logprobs=None)  # the client has them
            resume = replace(item, sampling=once)
            return resumed(self.ctx, self._decode_workers(lora, exclude), resume, sent, parent)
        workers, role = self._front_workers(exclude, lora)
        if not workers:
            left = (
                f"no healthy worker serves the LoRA adapter {lora!r}" if lora else "no worker left"
            )
            raise UpstreamError(unavailable(self.unavailable_reason() or left), False)
        key = prefix_key(item.prompt_ids, workers[0].block_size, self.ctx.config.prefix_blocks,
                         item.images, lora or "", item.sampling.cache_salt)  # fmt: skip
        ranked = rank_by_affinity(workers, key)
        if role == Role.DECODE:
            parent.set_attribute("tandem.mode", "local")
            parent.set_attribute("tandem.local_reason", NO_PREFILL)
            return resumed(self.ctx, workers, item, (), parent, NO_PREFILL)
        parent.set_attribute("tandem.mode", "disaggregated" if role == "prefill" else "colocated")
        if role == "prefill":
            decodes = self._decode_workers(lora, exclude)
            return disaggregated(self.ctx, ranked, decodes, item, parent)
        return generate(self.ctx, ranked[0], item, parent)

    def _can_retry(self, error: UpstreamError, emitted: bool, failed: set[str], lora: str) -> bool:
        if emitted or not error.retryable or not error.address:
            return False
        roles = {c.role for c in self.ctx.registry.clients if c.address == error.address}
        gone = failed | {error.address}
        if Role.DECODE in roles and not self._decode_workers(lora, gone):
            return False  # no other decode worker to hold the KV
        workers, _ = self._front_workers(gone, lora)
        return bool(workers)

    def _can_resume(self, error: UpstreamError, failed: set[str], lora: str) -> bool:
        """After tokens reached the client: a worker that failed retryably (died, broke its
        stream) hands the request to another decode worker, where its prompt and the tokens
        sent are prefilled; not without one."""
        if not error.retryable or not error.address:
            return False
        return bool(self._decode_workers(lora, failed | {error.address}))

    async def embed(self, work: EmbedWork, parent: Span) -> list[Embedding]:
        """The inputs' vectors from the workers started with ``--task embed``."""
        return await embed_batch(self.ctx, work, parent)

    async def stream(self, item: WorkItem, parent: Span) -> AsyncGenerator[Chunk, None]:
        """The request's chunks; raises UpstreamError when it cannot be served. A worker that
        fails it before its first token: the request runs again elsewhere (:meth:`_can_retry`).
        One that dies after some tokens reached the client: the request resumes on another
        decode worker from the next token (:meth:`_can_resume`), one stream to the client."""
        attempts = self._attempts(item, parent)
        with self.ctx.registry.using_adapter(item.sampling.lora_name):
            async with contextlib.aclosing(attempts):  # closed (its worker calls aborted) first
                async for chunk in attempts:
                    yield chunk

    async def _attempts(self, item: WorkItem, parent: Span) -> AsyncGenerator[Chunk, None]:
        failed: set[str] = set()
        sent: list[int] = []  # the token ids of the chunks the client got
        for attempt in range(MAX_ATTEMPTS):
            request_id = item.request_id if attempt == 0 else f"{item.request_id}-retry{attempt}"
            emitted = False
            try:
                flow = self._flow(replace(item, request_id=request_id), parent, failed, sent)
                async with contextlib.aclosing(flow):
                    async for chunk in flow:
                        emitted = True
                        sent.extend(chunk.token_ids)
                        yield chunk
                return
            except UpstreamError as e:
                lora = item.sampling.lora_name
                if attempt + 1 >= MAX_ATTEMPTS or not (
                    self._can_resume(e, failed, lora)
                    if sent
                    else self._can_retry(e, emitted, failed, lora)
                ):
                    if e.detail:  # the client's message names no address: the log does
                        log.warning("%s failed: %s", item.request_id, e.detail)
                    raise
                how = "resume" if sent else "retry"
                log.warning("%s %s on another worker: %s", how, item.request_id, e.detail or e)
                parent.add_event(how, {"tandem.failed_worker": e.address})
                failed.add(e.address)
