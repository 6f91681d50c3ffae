"""Workers started with an internal token: every RPC but health checks needs it, the KV
rendezvous needs it, and a prefill worker ships KV only to a decode worker that proves it."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import httpx
import pytest

from kvtransfer import KvSender, SenderOptions, TransferError
from protos import common_pb2
from tests.kvtransfer.peer import make_caches
from tests.services.clients import (
    Conn,
    assert_idle,
    chat_ids,
    disagg,
    greedy,
    prefill_call,
    reserve,
    rpc_code,
    wait_pool_free,
)
from tests.services.procs import Fleet, Proc, fleet
from tests.services.reference import greedy_reference

__all__ = ["fleet"]
pytestmark = pytest.mark.slow
TOKEN = "internal-test-token"


@pytest.fixture(scope="module")
def secured(fleet: Fleet) -> Iterator[tuple[Proc, Proc]]:
    """A prefill and a decode worker that require the token (killed after this module)."""
    procs = [fleet.spawn(role, "--internal-token", TOKEN) for role in ("prefill", "decode")]
    try:
        yield procs[0].wait_ready(), procs[1].wait_ready()
    finally:
        for p in procs:
            p.kill()


async def test_calls_without_the_token_are_unauthenticated_but_health_is_open(
    secured: tuple[Proc, Proc],
) -> None:
    prefill, decode = secured
    for token in ("", "wrong"):
        async with (
            Conn(prefill.address, "prefill", token) as p,
            Conn(decode.address, "decode", token) as d,
        ):
            assert await rpc_code(d.stub.GetLoad(common_pb2.LoadRequest(), timeout=5)) == (
                grpc.StatusCode.UNAUTHENTICATED
            )
            assert await rpc_code(reserve(d, "sneaky", 40, 8)) == grpc.StatusCode.UNAUTHENTICATED
            abort = d.stub.Abort(common_pb2.AbortRequest(request_id="x"), timeout=5)
            assert await rpc_code(abort) == grpc.StatusCode.UNAUTHENTICATED
            call = prefill_call(p, "free-compute", [1, 2, 3], greedy(4), None)
            assert await rpc_code(call) == grpc.StatusCode.UNAUTHENTICATED
            assert await p.status() == 1 and await d.status() == 1  # SERVING, no token needed
    async with Conn(decode.address, "decode", TOKEN) as d:
        assert_idle(await wait_pool_free([d]))  # nothing was reserved by the refused calls


async def test_with_the_token_the_disaggregated_flow_works(secured: tuple[Proc, Proc]) -> None:
    prefill, decode = secured
    prompt = chat_ids("What is the capital of France?")
    async with (
        Conn(prefill.address, "prefill", TOKEN) as p,
        Conn(decode.address, "decode", TOKEN) as d,
    ):
        got = await disagg(p, d, "authorized", prompt, 8)
        assert got.token_ids == greedy_reference([prompt], 8)[0].token_ids
        assert_idle(await wait_pool_free([p, d]))


async def test_the_kv_rendezvous_refuses_a_sender_without_the_token(
    secured: tuple[Proc, Proc],
) -> None:
    _, decode = secured
    opts = SenderOptions(timeout_s=5)
    with (
        KvSender(make_caches(1, 8), "intruder", opts) as sender,
        pytest.raises(TransferError, match="did not prove the internal token"),
    ):
        sender.send(decode.ready["kv_endpoint"], "anything", [0])


async def test_a_prefill_worker_sends_no_kv_to_a_decode_worker_without_the_token(
    fleet: Fleet, secured: tuple[Proc, Proc]
) -> None:
    prefill, _ = secured
    (open_decode,) = fleet.shared("decode")  # no token: it cannot prove one
    ids = chat_ids("Tell me about parcels.")
    async with (
        Conn(prefill.address, "prefill", TOKEN) as p,
        Conn(open_decode.address, "decode") as d,
    ):
        received = (await d.load()).kv_transfer_bytes
        res = await reserve(d, "lured", len(ids), 8)
        assert await rpc_code(prefill_call(p, "lured", ids, greedy(8), res)) == (
            grpc.StatusCode.ABORTED
        )
        assert (await d.load()).kv_transfer_bytes == received  # not a byte was sent to it
        assert await d.abort("lured")  # what the gateway does after the failed prefill
        assert_idle(await wait_pool_free([p, d], timeout_s=5))


def test_a_gateway_with_the_token_serves_through_secured_workers(
    fleet: Fleet, secured: tuple[Proc, Proc]
) -> None:
    prefill, decode = secured
    gateway = fleet.gateway(prefill=[prefill], decode=[decode], args=["--internal-token", TOKEN])
    try:
        body = {"model": "SmolLM2-135M-Instruct", "max_tokens": 8, "temperature": 0,
                "messages": [{"role": "user", "content": "What is the capital of France?"}]}  # fmt: skip
        r = httpx.post(f"{gateway.url}/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        assert "Paris" in r.json()["choices"][0]["message"]["content"]
    finally:
        gateway.kill()
