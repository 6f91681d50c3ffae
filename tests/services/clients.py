"""Test clients for real workers: the disaggregated flow driven by hand over gRPC (what the
gateway does: Reserve -> Prefill -> Decode), the colocated Generate, loads and health."""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.workers.convert import sampling_to_pb
from protos import (
    common_pb2,
    decode_pb2,
    decode_pb2_grpc,
    kv_control_pb2,
    prefill_pb2,
    prefill_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)
from protos.auth import client_interceptors
from protos.sampling_params import SamplingParams

STUBS: dict[str, Callable[[Any], Any]] = {
    "prefill": prefill_pb2_grpc.PrefillServiceStub,
    "decode": decode_pb2_grpc.DecodeServiceStub,
    "worker": worker_pb2_grpc.WorkerServiceStub,
}


def greedy(max_tokens: int, **kw: Any) -> common_pb2.SamplingParams:
    return sampling_to_pb(SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw))


@dataclass
class Result:
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: int = common_pb2.FINISH_REASON_UNSPECIFIED
    error: str = ""
    first_at: float | None = None  # monotonic time of the first token

    def add(self, chunk: common_pb2.TokenChunk) -> None:
        if chunk.token_ids and self.first_at is None:
            self.first_at = time.monotonic()
        self.token_ids += list(chunk.token_ids)
        self.text += chunk.text
        if chunk.finish_reason:
            self.finish_reason, self.error = chunk.finish_reason, chunk.error


class Conn:
    """An aio channel to one worker, with its stub and health stub."""

    def __init__(self, address: str, role: str, token: str = "") -> None:
        self.address, self.role = address, role
        self.channel = grpc.aio.insecure_channel(address, interceptors=client_interceptors(token))
        self.stub: Any = STUBS[role](self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)

    async def load(self) -> common_pb2.WorkerLoad:
        reply: common_pb2.WorkerLoad = await self.stub.GetLoad(common_pb2.LoadRequest(), timeout=5)
        return reply

    async def status(self) -> int:
        check = await self.health.Check(health_pb2.HealthCheckRequest(), timeout=2)
        return int(check.status)

    async def abort(self, rid: str) -> bool:
        reply = await self.stub.Abort(common_pb2.AbortRequest(request_id=rid), timeout=5)
        return bool(reply.found)

    async def close(self) -> None:
        await self.channel.close(grace=None)

    async def __aenter__(self) -> Conn:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


async def wait_pool_free(conns: list[Conn], timeout_s: float = 2.0) -> list[common_pb2.WorkerLoad]:
    """Poll until every worker reports its whole pool free and nothing reserved or running."""
    deadline = time.monotonic() + timeout_s
    while True:
        loads = [await c.load() for c in conns]
        if all(is_idle(ld) for ld in loads) or time.monotonic() > deadline:
            return loads
        await asyncio.sleep(0.05)


def is_idle(ld: common_pb2.WorkerLoad) -> bool:
    return (ld.free_blocks == ld.total_blocks and ld.num_reserved == 0 and ld.num_running == 0
            and ld.num_waiting == 0)  # fmt: skip


def assert_idle(loads: list[common_pb2.WorkerLoad]) -> None:
    for ld in loads:
        assert (ld.free_blocks, ld.num_reserved, ld.num_running, ld.num_waiting) == (
            ld.total_blocks, 0, 0, 0,
        ), f"{ld.worker_id} still holds KV or requests:\n{ld}"  # fmt: skip


async def reserve(decode: Conn, rid: str, num_prompt: int, max_tokens: int, ttl_s: float = 60.0,
                  grant: bool = False) -> kv_control_pb2.ReserveResponse:  # fmt: skip
    """A reservation as the gateway asks for it: by default for as long as a request may take
    (its ``--reserve-ttl`` default), so a prefill slowed by a busy machine does not outlive it.
    ``grant``: the blocks granted ahead too (the gateway asks for a whole-KV prefill worker)."""
    req = kv_control_pb2.ReserveRequest(
        request_id=rid, num_prompt_tokens=num_prompt, max_tokens=max_tokens, ttl_s=ttl_s,
        grant=grant,
    )  # fmt: skip
    reply: kv_control_pb2.ReserveResponse = await decode.stub.Reserve(req, timeout=5)
    return reply


def prefill_call(prefill: Conn, rid: str, ids: list[int], sampling: common_pb2.SamplingParams,
                 res: kv_control_pb2.ReserveResponse | None, timeout: float = 60,
                 kv_grant: str | None = None) -> Any:  # fmt: skip
    """``kv_grant``: what the target carries instead of the reservation's grant."""
    target = None
    if res is not None:
        grant = res.kv_grant if kv_grant is None else kv_grant
        target = kv_control_pb2.KvTarget(kv_endpoint=res.kv_endpoint,
                                         reservation_id=res.reservation_id,
                                         decode_worker_id=res.decode_worker_id,
                                         kv_grant=grant)  # fmt: skip
    req = prefill_pb2.PrefillRequest(
        request_id=rid, prompt_token_ids=ids, sampling=sampling, target=target
    )
    return prefill.stub.Prefill(req, timeout=timeout)


def decode_call(decode: Conn, rid: str, ids: list[int], first: list[int],
                sampling: common_pb2.SamplingParams, kv_wait_s: float = 5.0,
                timeout: float = 60) -> Any:  # fmt: skip
    req = decode_pb2.DecodeRequest(request_id=rid, reservation_id=rid, prompt_token_ids=ids,
                                   output_token_ids=first, sampling=sampling, kv_wait_s=kv_wait_s)  # fmt: skip
    return decode.stub.Decode(req, timeout=timeout)


async def disagg(prefill: Conn, decode: Conn, rid: str, ids: list[int], max_tokens: int,
                 grant: bool = False, kv_grant: str | None = None, **kw: Any) -> Result:  # fmt: skip
    """One request as the gateway runs it: reserve, prefill (first token, then TransferDone),
    decode. On any failure the decode reservation is aborted (as the gateway does). ``grant``:
    the blocks granted with the reservation, as for a whole-KV prefill worker; ``kv_grant``: a
    grant to pass instead of the reservation's."""
    sampling = greedy(max_tokens, **kw)
    result = Result()
    res = await reserve(decode, rid, len(ids), max_tokens, grant=grant)
    try:
        events = [ev async for ev in prefill_call(prefill, rid, ids, sampling, res, kv_grant=kv_grant)]  # fmt: skip
        kinds = [ev.WhichOneof("event") for ev in events]
        result.add(events[0].first)
        if result.finish_reason:
            assert kinds == ["first"], kinds
            await decode.abort(rid)
            return result
        assert kinds == ["first", "done"], kinds
        async for chunk in decode_call(decode, rid, ids, result.token_ids, sampling):
            result.add(chunk)
    except BaseException:
        await decode.abort(rid)
        raise
    return result


async def generate(worker: Conn, rid: str, ids: list[int], max_tokens: int, **kw: Any) -> Result:
    result = Result()
    req = worker_pb2.GenerateRequest(request_id=rid, prompt_token_ids=ids,
                                     sampling=greedy(max_tokens, **kw))  # fmt: skip
    async for chunk in worker.stub.Generate(req, timeout=60):
        result.add(chunk)
    return result


async def rpc_code(call: Any) -> grpc.StatusCode:
    """The status a (unary or streaming) call ends with; OK if it succeeds."""
    try:
        if hasattr(call, "read"):
            while await call.read() is not grpc.aio.EOF:
                pass
        else:
            await call
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


@functools.cache
def tokenizer() -> Any:
    from transformers import AutoTokenizer

    from services.model_files import prepare_model

    return AutoTokenizer.from_pretrained(str(prepare_model("embedded").hf_dir))


def chat_ids(content: str, system: str | None = None) -> list[int]:
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": content}
    ]
    enc = tokenizer().apply_chat_template(messages, add_generation_prompt=True, return_dict=True)
    return list(enc["input_ids"])


SYSTEM = (
    "You are a careful assistant for a company that ships parcels across Europe. Answer in one "
    "short sentence, never use lists, and say 'I do not know' when you are not sure."
)


def parity_prompts() -> list[list[int]]:
    """Nine prompts: short ones, several spanning many 16-token blocks, and three chats that
    share one long system prompt (prefix-cache hits on the prefill worker)."""
    tok = tokenizer()
    story = " ".join(f"Step {i}: the parcel moved to depot number {i * 7}." for i in range(12))
    return [
        chat_ids("What is the capital of France?"),
        list(tok.encode("The quick brown fox")),
        [1, 2, 3],
        list(tok.encode(f"Summarise this log. {story}")),
        chat_ids(f"How many steps are in this story? {story}"),
        chat_ids("Where is my parcel?", SYSTEM),
        chat_ids("How long does shipping to Spain take?", SYSTEM),
        chat_ids("Can I send a parcel to Norway?", SYSTEM),
        chat_ids("Write a haiku about autumn."),
    ]


def long_prompt(num_tokens: int, text: str = "The parcel went from depot to depot. ") -> list[int]:
    """A raw prompt of exactly ``num_tokens`` tokens (a long prefill and a large transfer)."""
    ids = list(tokenizer().encode(text * (num_tokens // 4 + 1)))[:num_tokens]
    assert len(ids) == num_tokens
    return ids
