"""Deterministic fake workers (grpc.aio) speaking the real protos.

Output token i of a request is prompt token i (the prompt is echoed, cycling), one token per
chunk, its text decoded with the real tokenizer. EOS (unless ignore_eos), stop strings and
max_tokens end a request as a real worker would. Behaviour knobs make calls fail or slow down;
records keep every request, abort and the gRPC metadata seen. ``FakeWorker.freeze`` makes a
worker answer nothing at all, as a process stopped with SIGSTOP, until ``thaw``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tokenizers import Tokenizer

from protos import (
    common_pb2,
    decode_pb2_grpc,
    kv_control_pb2,
    prefill_pb2,
    prefill_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)
from services.common.multiplex import multiplex

EOS_ID = 2
TOTAL_BLOCKS = 1000
# what every fake reports as its tokens per engine step: 2 steps of 1 token, 3 of up to 8, 1 of 300
ITERATION_TOKENS = common_pb2.Histogram(bounds=[1, 8, 16], counts=[2, 5, 5], sum=321, count=6)


@dataclass
class Behavior:
    token_delay_s: float = 0.0
    first_delay_s: float = 0.0
    fail_before_first: int = 0  # how many calls fail with UNAVAILABLE before any token
    fail_after_tokens: int | None = None  # the stream breaks (UNAVAILABLE) after N tokens
    fail_transfer: bool = False  # prefill: the stream breaks between first and done
    transfer_s: float = 0.005  # prefill: how long the KV takes between first and done
    done_first: bool = False  # prefill: TransferDone overtakes the first token
    error_chunk: bool = False  # the first chunk is a FINISH_REASON_ERROR chunk
    reserve_code: grpc.StatusCode | None = None  # Reserve fails with this code
    full_for_s: float | None = None  # Reserve: no room now; one that may wait gets it after this
    invalid_argument: bool = False  # Generate/Prefill answer INVALID_ARGUMENT
    serving: bool = True
    engine_stalled_s: float = 0.0  # what GetLoad reports of a step past --engine-stall-timeout
    health_delay_s: float = 0.0  # the health check answers this late
    max_model_len: int = 2048
    vocab_size: int = 49152
    cached_tokens: int = 0
    num_waiting: int = 0  # what GetLoad reports waiting (the gateway reads it at its next poll)
    kv_whole: bool = False  # prefill: GetLoad says it ships whole KV (--kv-streaming off)
    task: str = "generate"  # a colocated worker's --task: embed answers Embed, generate refuses it
    scheduling_policy: str = ""  # what GetLoad reports of --scheduling-policy ("": nothing)
    lora_names: tuple[str, ...] = ()  # the LoRA adapters GetLoad reports
    lora_paths: dict[str, str] = field(default_factory=dict)  # their directories (LoadLoRA's)
    lora_updates: bool = False  # LoadLoRA/UnloadLoRA change lora_names (else: refused, as off)
    instance: str = "run-1"  # GetLoad's: the worker process's run (a new one: started again)
    lora_load_code: grpc.StatusCode | None = None  # LoadLoRA fails with this code
    lora_unload_code: grpc.StatusCode | None = None  # UnloadLoRA fails with this code


@dataclass
class Records:
    requests: list[str] = field(default_factory=list)  # request ids per streaming call
    aborts: list[str] = field(default_factory=list)
    metadata: list[dict[str, str]] = field(default_factory=list)
    reservations: dict[str, str] = field(default_factory=dict)  # request id -> reservation
    reserve_ttls: list[float] = field(default_factory=list)  # ttl_s of each Reserve call
    reserve_waits: list[float] = field(default_factory=list)  # wait_s of each Reserve call
    reserve_grants: list[bool] = field(default_factory=list)  # grant of each Reserve call
    kv_grants: list[str] = field(default_factory=list)  # target.kv_grant of each Prefill call
    decode_calls: list[str] = field(default_factory=list)
    local_prefills: list[str] = field(default_factory=list)  # Decode calls with local_prefill
    samplings: list[common_pb2.SamplingParams] = field(default_factory=list)
    embeds: list[worker_pb2.EmbedRequest] = field(default_factory=list)
    lora_updates: list[str] = field(default_factory=list)  # "load NAME" / "unload NAME"


class FakeEngine:
    """Produces the fake output tokens of a request as TokenChunks."""

    def __init__(self, tokenizer: Tokenizer, behavior: Behavior, records: Records, role: str):
        self.tok, self.behavior, self.records, self.role = tokenizer, behavior, records, role
        self.cancelled: set[str] = set()
        # cleared: frozen, every handler waits here (a call the caller gave up on is cancelled
        # while it waits, as a real worker never sees it once its deadline passed)
        self.thawed = asyncio.Event()
        self.thawed.set()

    async def gate(self) -> None:
        """Returns at once unless the worker is frozen: then once it thaws."""
        if not self.thawed.is_set():
            await self.thawed.wait()

    def _note(self, rid: str, context: grpc.aio.ServicerContext) -> None:
        self.records.requests.append(rid)
        self.records.metadata.append({k: str(v) for k, v in context.invocation_metadata() or ()})

    def _text(self, token: int, sp: common_pb2.SamplingParams) -> str:
        return str(self.tok.decode([token], skip_special_tokens=sp.skip_special_tokens))

    def _prompt_logprobs(
        self, prompt: list[int], sp: common_pb2.SamplingParams
    ) -> list[common_pb2.PositionLogprobs]:
        """Positions 1.. of the prompt: its token at -0.25 (rank 2), and N others at -1 - k."""
        if not sp.HasField("prompt_logprobs"):
            return []
        out = []
        for token in prompt[1:]:
            chosen = common_pb2.TokenLogprob(token_id=token, logprob=-0.25, rank=2,
                                             token=self._text(token, sp))  # fmt: skip
            top = [common_pb2.TokenLogprob(token_id=token + k, logprob=-1.0 - k, rank=k,
                                           token=self._text(token + k, sp))
                   for k in range(1, sp.prompt_logprobs + 1)]  # fmt: skip
            out.append(common_pb2.PositionLogprobs(chosen=chosen, top=top))
        return out

    def _logprobs(
        self, token: int, sp: common_pb2.SamplingParams
    ) -> list[common_pb2.PositionLogprobs]:
        if not sp.HasField("logprobs"):
            return []
        chosen = common_pb2.TokenLogprob(token_id=token, logprob=-0.5, token=self._text(token, sp))
        top = [chosen] + [
            common_pb2.TokenLogprob(
                token_id=token + k, logprob=-1.0 - k, token=self._text(token + k, sp)
            )
            for k in range(1, sp.logprobs)
        ]
        return [common_pb2.PositionLogprobs(chosen=chosen, top=top[: sp.logprobs])]

    async def tokens(
        self,
        rid: str,
        prompt: list[int],
        sp: common_pb2.SamplingParams,
        start: int,
        stop_at: int | None,
    ) -> AsyncIterator[common_pb2.TokenChunk]:
        """Chunks for output positions [start, stop_at) (stop_at None: until finished)."""
        b, text = self.behavior, ""
        for i in range(start, sp.max_tokens):
            if stop_at is not None and i >= stop_at:
                return
            await asyncio.sleep(b.first_delay_s if i == start else b.token_delay_s)
            await self.gate()
            if rid in self.cancelled:
                return
            if b.fail_after_tokens is not None and i >= b.fail_after_tokens:
                raise _Broken()
            token = prompt[i % len(prompt)]
            piece = self._text(token, sp)
            finish, stop = common_pb2.FINISH_REASON_UNSPECIFIED, {}
            hit = next((s for s in sp.stop if s in text + piece), None)
            if hit is not None:
                piece = (text + piece)[: (text + piece).index(hit)][len(text) :]
                finish, stop = common_pb2.FINISH_REASON_STOP, {"stop_string": hit}
            elif token in sp.stop_token_ids:  # as vLLM: the token id, null for EOS
                finish, stop = common_pb2.FINISH_REASON_STOP, {"stop_token_id": token}
            elif token == EOS_ID and not sp.ignore_eos and i + 1 >= sp.min_tokens:
                finish = common_pb2.FINISH_REASON_STOP
            elif i + 1 >= sp.max_tokens:
                finish = common_pb2.FINISH_REASON_LENGTH
            text += piece
            yield common_pb2.TokenChunk(
                request_id=rid, token_ids=[token], text=piece, logprobs=self._logprobs(token, sp),
                finish_reason=finish, **stop, num_prompt_tokens=len(prompt),
                num_cached_tokens=b.cached_tokens,
                timing=common_pb2.Timing(queue_s=0.001, prefill_s=0.002, decode_s=0.003 * i),
                prompt_logprobs=self._prompt_logprobs(prompt, sp) if i == 0 else [],
            )  # fmt: skip
            if finish != common_pb2.FINISH_REASON_UNSPECIFIED:
                return

    def load(self, reserved: int = 0) -> common_pb2.WorkerLoad:
        b = self.behavior
        return common_pb2.WorkerLoad(
            worker_id=f"fake-{self.role}", role=self.role, model="embedded",
            max_model_len=b.max_model_len, block_size=16, num_running=0, num_waiting=b.num_waiting,
            free_blocks=TOTAL_BLOCKS - reserved, total_blocks=TOTAL_BLOCKS,
            kv_cache_usage=reserved / TOTAL_BLOCKS, vocab_size=b.vocab_size, prompt_tokens=7,
            kv_transfer_bytes=1234, kv_transfer_granted=5, num_reserved=reserved, iteration_tokens=ITERATION_TOKENS,
            task=b.task if self.role == "colocated" else "", lora_names=list(b.lora_names),
            lora_paths=[b.lora_paths.get(n, "") for n in b.lora_names],
            kv_whole=b.kv_whole, scheduling_policy=b.scheduling_policy,
            engine_stalled_s=b.engine_stalled_s, instance=b.instance,
            lora_runtime_updating=b.lora_updates,
        )  # fmt: skip


class _Broken(Exception):
    """Raised inside a fake stream to break it like a dying worker."""


async def _guard(context: grpc.aio.ServicerContext, behavior: Behavior) -> None:
    if behavior.invalid_argument:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "fake worker: bad request")
    if behavior.fail_before_first > 0:
        behavior.fail_before_first -= 1
        await context.abort(grpc.StatusCode.UNAVAILABLE, "fake worker: down before the first token")


async def _stream(
    context: grpc.aio.ServicerContext, chunks: AsyncIterator[common_pb2.TokenChunk], wrap=None
):
    try:
        async for chunk in chunks:
            yield wrap(chunk) if wrap else chunk
    except _Broken:
        await context.abort(grpc.StatusCode.UNAVAILABLE, "fake worker: died mid-stream")


def _lora_update(b: Behavior) -> common_pb2.LoRAUpdateResponse:
    names = sorted(b.lora_names)
    return common_pb2.LoRAUpdateResponse(
        lora_names=names, lora_paths=[b.lora_paths.get(n, "") for n in names]
    )


async def _no_lora_updates(context: grpc.aio.ServicerContext) -> None:
    """As a worker started without --allow-runtime-lora-updating answers."""
    await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "runtime LoRA updates are off")


class LoRAUpdates:
    """LoadLoRA and UnloadLoRA as a worker with --allow-runtime-lora-updating answers them
    (``Behavior.lora_updates``; ``lora_load_code`` and ``lora_unload_code`` make them fail),
    else refused."""

    e: FakeEngine

    async def LoadLoRA(self, request, context):
        b, name = self.e.behavior, request.lora_name
        if not b.lora_updates:
            await _no_lora_updates(context)
        self.e.records.lora_updates.append(f"load {name}")
        if b.lora_load_code is not None:
            await context.abort(b.lora_load_code, f"fake worker: cannot load {name!r}")
        if name in b.lora_names:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{name!r} is already loaded")
        b.lora_names = (*b.lora_names, name)
        b.lora_paths[name] = request.lora_path
        return _lora_update(b)

    async def UnloadLoRA(self, request, context):
        b, name = self.e.behavior, request.lora_name
        if not b.lora_updates:
            await _no_lora_updates(context)
        self.e.records.lora_updates.append(f"unload {name}")
        if b.lora_unload_code is not None:
            await context.abort(b.lora_unload_code, f"fake worker: cannot unload {name!r}")
        if name not in b.lora_names:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"{name!r} is not loaded")
        b.lora_names = tuple(n for n in b.lora_names if n != name)
        return _lora_update(b)


class Worker(LoRAUpdates, worker_pb2_grpc.WorkerServiceServicer):
    def __init__(self, engine: FakeEngine) -> None:
        self.e = engine

    async def Generate(self, request, context):
        self.e._note(request.request_id, context)
        self.e.records.samplings.append(request.sampling)
        await _guard(context, self.e.behavior)
        if self.e.behavior.error_chunk:
            yield common_pb2.TokenChunk(
                finish_reason=common_pb2.FINISH_REASON_ERROR, error="fake OOM"
            )
            return
        chunks = self.e.tokens(
            request.request_id, list(request.prompt_token_ids), request.sampling, 0, None
        )
        async for chunk in _stream(context, chunks):
            yield chunk

    async def GenerateStream(self, request_iterator, context):
        async for batch in multiplex(request_iterator, "generate", self.Generate):
            yield batch

    async def Embed(self, request, context):
        """Input i's vector: [its length, its first id, its last id, 0.5] (normalize ignored)."""
        self.e._note(request.request_id, context)
        self.e.records.embeds.append(request)
        await _guard(context, self.e.behavior)
        if self.e.behavior.task != "embed":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "fake worker: --task generate")
        await asyncio.sleep(self.e.behavior.first_delay_s)
        await self.e.gate()
        return worker_pb2.EmbedResponse(
            embeddings=[
                worker_pb2.Embedding(
                    values=[len(x.token_ids), x.token_ids[0], x.token_ids[-1], 0.5],
                    num_prompt_tokens=len(x.token_ids),
                )
                for x in request.inputs
            ]
        )

    async def Abort(self, request, context):
        await self.e.gate()
        self.e.records.aborts.append(request.request_id)
        self.e.cancelled.add(request.request_id)
        return common_pb2.AbortResponse(found=True)

    async def GetLoad(self, request, context):
        await self.e.gate()
        return self.e.load()


class Prefill(LoRAUpdates, prefill_pb2_grpc.PrefillServiceServicer):
    def __init__(self, engine: FakeEngine) -> None:
        self.e = engine

    async def Prefill(self, request, context):
        e = self.e
        e._note(request.request_id, context)
        e.records.samplings.append(request.sampling)
        e.records.kv_grants.append(request.target.kv_grant)
        await _guard(context, e.behavior)
        first = None
        done = kv_control_pb2.TransferDone(bytes=4096, seconds=0.004, num_blocks=2)
        if e.behavior.done_first:
            yield prefill_pb2.PrefillEvent(done=done)
        chunks = e.tokens(
            request.request_id, list(request.prompt_token_ids), request.sampling, 0, 1
        )
        async for chunk in _stream(context, chunks):
            first = chunk
            yield prefill_pb2.PrefillEvent(first=chunk)
        if first is None or first.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
            return
        await asyncio.sleep(e.behavior.transfer_s)
        await e.gate()
        if e.behavior.fail_transfer:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "fake worker: KV transfer failed")
        if not e.behavior.done_first:
            yield prefill_pb2.PrefillEvent(done=done)

    async def Abort(self, request, context):
        await self.e.gate()
        self.e.records.aborts.append(request.request_id)
        self.e.cancelled.add(request.request_id)
        return common_pb2.AbortResponse(found=True)

    async def GetLoad(self, request, context):
        await self.e.gate()
        return self.e.load()


class Decode(LoRAUpdates, decode_pb2_grpc.DecodeServiceServicer):
    def __init__(self, engine: FakeEngine) -> None:
        self.e = engine

    async def Reserve(self, request, context):
        e = self.e
        await e.gate()
        e.records.metadata.append({k: str(v) for k, v in context.invocation_metadata() or ()})
        e.records.reserve_waits.append(request.wait_s)
        e.records.reserve_grants.append(request.grant)
        if e.behavior.reserve_code is not None:
            await context.abort(e.behavior.reserve_code, "fake decode: cannot reserve")
        full_for = e.behavior.full_for_s
        if full_for is not None:
            if request.wait_s < full_for:
                await asyncio.sleep(request.wait_s)
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "fake decode: full")
            await asyncio.sleep(full_for)
        reservation = f"res-{request.request_id}"
        e.records.reserve_ttls.append(request.ttl_s)
        e.records.reservations[request.request_id] = reservation
        return kv_control_pb2.ReserveResponse(
            reservation_id=reservation,
            num_blocks=3,
            kv_endpoint="127.0.0.1:1",
            decode_worker_id="fake-decode",
            # as a decode worker that can grant (one GPU) answers a request for a grant
            kv_grant=f'{{"fake-grant": "{reservation}"}}' if request.grant else "",
        )

    async def Decode(self, request, context):
        e = self.e
        e._note(request.request_id, context)
        e.records.decode_calls.append(request.request_id)
        e.records.samplings.append(request.sampling)
        if request.local_prefill:
            e.records.local_prefills.append(request.request_id)
        if e.records.reservations.get(request.request_id) != request.reservation_id:
            await context.abort(grpc.StatusCode.NOT_FOUND, "fake decode: no such reservation")
        try:
            start = len(request.output_token_ids)
            chunks = e.tokens(
                request.request_id, list(request.prompt_token_ids), request.sampling, start, None
            )
            async for chunk in _stream(context, chunks):
                yield chunk
        finally:
            e.records.reservations.pop(request.request_id, None)

    async def DecodeStream(self, request_iterator, context):
        async for batch in multiplex(request_iterator, "decode", self.Decode):
            yield batch

    async def Abort(self, request, context):
        await self.e.gate()
        self.e.records.aborts.append(request.request_id)
        self.e.cancelled.add(request.request_id)
        found = self.e.records.reservations.pop(request.request_id, None) is not None
        return common_pb2.AbortResponse(found=found)

    async def GetLoad(self, request, context):
        await self.e.gate()
        return self.e.load(reserved=len(self.e.records.reservations))


class Health(health_pb2_grpc.HealthServicer):
    def __init__(self, engine: FakeEngine) -> None:
        self.behavior, self.e = engine.behavior, engine

    async def Check(self, request, context):
        await asyncio.sleep(self.behavior.health_delay_s)
        await self.e.gate()
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if self.behavior.serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        return health_pb2.HealthCheckResponse(status=status)


_SERVICERS = {
    "colocated": (Worker, worker_pb2_grpc.add_WorkerServiceServicer_to_server),
    "prefill": (Prefill, prefill_pb2_grpc.add_PrefillServiceServicer_to_server),
    "decode": (Decode, decode_pb2_grpc.add_DecodeServiceServicer_to_server),
}


class FakeWorker:
    """One fake worker of ``role`` on 127.0.0.1 and a free port; start() in a running loop."""

    def __init__(self, role: str, tokenizer: Tokenizer) -> None:
        self.role = role
        self.behavior = Behavior()
        self.records = Records()
        self.engine = FakeEngine(tokenizer, self.behavior, self.records, role)
        self.server: grpc.aio.Server | None = None
        self.port = 0
        self.loop: asyncio.AbstractEventLoop | None = None  # where it serves (start's)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def reset(self) -> None:
        """Default behaviour and empty records (the objects stay the same), thawed; from any
        thread."""
        self.behavior.__init__()  # type: ignore[misc]
        self.records.__init__()  # type: ignore[misc]
        self.engine.cancelled.clear()
        if self.loop is not None and not self.engine.thawed.is_set():
            self.loop.call_soon_threadsafe(self.engine.thawed.set)

    async def freeze(self) -> None:
        """From now on it answers nothing (health, load, calls, tokens), as a process stopped
        with SIGSTOP: its connections stay open, so no call fails until its deadline."""
        self.engine.thawed.clear()

    async def thaw(self) -> None:
        """Answers again; what waited goes on (what its callers gave up on was cancelled)."""
        self.engine.thawed.set()

    async def start(self, port: int = 0) -> None:
        self.loop = asyncio.get_running_loop()
        self.server = grpc.aio.server()
        servicer, add = _SERVICERS[self.role]
        add(servicer(self.engine), self.server)
        health_pb2_grpc.add_HealthServicer_to_server(Health(self.engine), self.server)
        self.port = self.server.add_insecure_port(f"127.0.0.1:{port}")
        await self.server.start()

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.stop(grace=None)
            self.server = None
