"""``tandem decode`` as a real process beside a real prefill worker: admission (Reserve) and its
deadline, 32 concurrent requests, cancellation, bad input, and a prefill worker killed while
the KV is on its way."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from protos import common_pb2, decode_pb2, kv_control_pb2
from services.decode.server import MAX_TTL_S, UNOWNED_MAX_TTL_S, reservation_ttl
from tests.services.clients import (
    Conn,
    assert_idle,
    chat_ids,
    decode_call,
    disagg,
    greedy,
    long_prompt,
    parity_prompts,
    prefill_call,
    reserve,
    rpc_code,
    wait_pool_free,
)
from tests.services.procs import Fleet, fleet
from tests.services.reference import greedy_reference

__all__ = ["fleet"]
pytestmark = pytest.mark.slow


async def test_reservations_hold_blocks_until_aborted_or_expired(fleet: Fleet) -> None:
    (decode,) = fleet.shared("decode")
    async with Conn(decode.address, "decode") as d:
        total = (await d.load()).total_blocks
        res = await reserve(d, "held", 40, 8, ttl_s=0.5)
        assert res.num_blocks == 3 and res.kv_endpoint == decode.ready["kv_endpoint"]
        assert await rpc_code(d.stub.Reserve(_reserve_req("held"), timeout=5)) == (
            grpc.StatusCode.ALREADY_EXISTS
        )
        await reserve(d, "aborted", 40, 8)
        load = await d.load()
        assert load.num_reserved == 2 and load.free_blocks <= total - 6
        assert await d.abort("aborted")
        assert not await d.abort("aborted")  # idempotent: nothing left to abort
        assert_idle(await wait_pool_free([d], timeout_s=2.0))  # "held" expired after 0.5 s
        code = await rpc_code(decode_call(d, "held", [1] * 40, [5], greedy(4)))
        assert code == grpc.StatusCode.NOT_FOUND


async def test_a_reservation_has_one_deadline_and_its_expiry_frees_both_pools(
    fleet: Fleet,
) -> None:
    """A reservation lives until its own deadline, wherever it stands: claimed by a Decode call
    willing to wait 30 s for the KV, a 0.5 s reservation still ends at 0.5 s (the call fails
    UNAVAILABLE, naming the expiry); a prefill worker then told to ship into it is refused by
    the receiver (ABORTED) and frees its own blocks. Both KV pools end whole."""
    prefill, decode = fleet.shared("prefill", "decode")
    ids = long_prompt(200)
    sampling = greedy(4)
    async with Conn(prefill.address, "prefill") as p, Conn(decode.address, "decode") as d:
        res = await reserve(d, "lapses", len(ids), 4, ttl_s=0.5)
        t0 = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as waited:
            async for _ in decode_call(d, "lapses", ids, [1], sampling, kv_wait_s=30):
                pass
        assert waited.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "expired" in (waited.value.details() or "")
        assert time.monotonic() - t0 < 20  # the reservation's deadline, not the 30 s KV wait
        with pytest.raises(grpc.aio.AioRpcError) as shipped:
            async for _ in prefill_call(p, "lapses", ids, sampling, res):
                pass
        assert shipped.value.code() == grpc.StatusCode.ABORTED
        assert "expired" in (shipped.value.details() or "")
        assert_idle(await wait_pool_free([p, d], timeout_s=5.0))


async def test_a_reserve_that_may_wait_queues_until_blocks_free(fleet: Fleet) -> None:
    """Four 1000-token reservations fill the 256-block pool (63 blocks each): a fifth waits in
    the admission queue (counted as waiting), is admitted the moment one is aborted, and a
    waiter whose caller gives up leaves nothing behind."""
    (decode,) = fleet.shared("decode")
    async with Conn(decode.address, "decode") as d:
        for i in range(4):
            await reserve(d, f"fill-{i}", 1000, 8)
        now = _reserve_req("now", num_prompt=1000)
        assert await rpc_code(d.stub.Reserve(now, timeout=5)) == grpc.StatusCode.RESOURCE_EXHAUSTED
        queued = asyncio.ensure_future(
            d.stub.Reserve(_reserve_req("queued", 1000, wait_s=30), timeout=35)
        )
        while (await d.load()).num_waiting < 1:
            await asyncio.sleep(0.02)
        # someone waits: a Reserve that may not wait does not jump the queue, even if it fits
        small = _reserve_req("small", num_prompt=16)
        assert (
            await rpc_code(d.stub.Reserve(small, timeout=5)) == grpc.StatusCode.RESOURCE_EXHAUSTED
        )
        gives_up = d.stub.Reserve(_reserve_req("gives-up", 1000, wait_s=30), timeout=35)
        while (await d.load()).num_waiting < 2:
            await asyncio.sleep(0.02)
        gives_up.cancel()
        # an Abort for a waiter whose caller still waits (a gateway's Abort that overtook its
        # own cancel of the call): the waiter leaves the queue and its call ends CANCELLED
        while (await d.load()).num_waiting != 1:  # "gives-up" has left, "aborted" not come
            await asyncio.sleep(0.02)
        aborted = asyncio.ensure_future(
            rpc_code(d.stub.Reserve(_reserve_req("aborted", 1000, wait_s=30), timeout=35))
        )
        while (await d.load()).num_waiting < 2:
            await asyncio.sleep(0.02)
        assert await d.abort("aborted")
        assert await asyncio.wait_for(aborted, 10) == grpc.StatusCode.CANCELLED
        t0 = time.monotonic()
        assert await d.abort("fill-0")
        assert (await queued).num_blocks == 63
        assert time.monotonic() - t0 < 10.0  # granted by the abort, not after its 30 s wait
        load = await d.load()
        assert (load.num_reserved, load.num_waiting) == (4, 0)
        for rid in ("fill-1", "fill-2", "fill-3", "queued"):
            assert await d.abort(rid)
        assert_idle(await wait_pool_free([d]))
        short = _reserve_req("short-wait", 1000, wait_s=0.3)
        for i in range(4):
            await reserve(d, f"again-{i}", 1000, 8)
        t0 = time.monotonic()  # nothing frees: the wait ends RESOURCE_EXHAUSTED after wait_s
        assert (
            await rpc_code(d.stub.Reserve(short, timeout=5)) == grpc.StatusCode.RESOURCE_EXHAUSTED
        )
        assert 0.3 <= time.monotonic() - t0 < 4.5  # the RPC deadline is 5 s
        for i in range(4):
            assert await d.abort(f"again-{i}")
        assert_idle(await wait_pool_free([d]))


async def test_an_unclaimed_reservation_lives_only_while_its_owner_polls(fleet: Fleet) -> None:
    """Owner A keeps polling GetLoad, owner B goes silent (a gateway killed with -9): B's
    reservation is freed after the decode worker's --lease-timeout (6 s), A's stays."""
    (decode,) = fleet.shared("decode")
    async with Conn(decode.address, "decode") as d:
        for rid, owner in (("kept", "gw-alive"), ("orphan", "gw-dead")):
            req = kv_control_pb2.ReserveRequest(
                request_id=rid, num_prompt_tokens=40, max_tokens=8, ttl_s=600, owner=owner
            )
            await d.stub.Reserve(req, timeout=5)
        t0 = time.monotonic()
        while (load := await d.stub.GetLoad(common_pb2.LoadRequest(owner="gw-alive"), timeout=5)
               ).num_reserved == 2:  # fmt: skip
            assert time.monotonic() - t0 < 12, "the silent owner's reservation was never freed"
            await asyncio.sleep(0.5)
        assert time.monotonic() - t0 >= 5.0  # not before its lease ran out
        assert load.num_reserved == 1
        code = await rpc_code(decode_call(d, "orphan", [1] * 40, [5], greedy(4)))
        assert code == grpc.StatusCode.NOT_FOUND
        assert await d.abort("kept")  # still there, although its owner never claimed it
        assert_idle(await wait_pool_free([d]))


def _reserve_req(
    rid: str, num_prompt: int = 40, max_tokens: int = 8, wait_s: float = 0.0
) -> kv_control_pb2.ReserveRequest:
    return kv_control_pb2.ReserveRequest(
        request_id=rid, num_prompt_tokens=num_prompt, max_tokens=max_tokens, ttl_s=5,
        wait_s=wait_s,
    )  # fmt: skip


async def test_bad_reservations_and_decodes_are_invalid_argument(fleet: Fleet) -> None:
    (decode,) = fleet.shared("decode")
    async with Conn(decode.address, "decode") as d:
        for req in (_reserve_req(""), _reserve_req("zero", num_prompt=0)):
            assert await rpc_code(d.stub.Reserve(req, timeout=5)) == (
                grpc.StatusCode.INVALID_ARGUMENT
            )
        code = await rpc_code(d.stub.Reserve(_reserve_req("huge", num_prompt=5000), timeout=5))
        assert code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED)
        # a bad Decode fails at once (before any KV wait) and frees its reservation
        bad = [
            ([1, 2, 99999], [5], greedy(4)),  # prompt outside the vocabulary
            ([1, 2], [5], greedy(4)),  # not the reserved length
            ([1, 2, 3], [49152], greedy(4)),  # first token outside the vocabulary
            ([1, 2, 3], [], greedy(4)),  # no first token
            ([1, 2, 3], [5], common_pb2.SamplingParams(max_tokens=0)),
        ]
        for i, (ids, first, sampling) in enumerate(bad):
            await reserve(d, f"bad-{i}", 3, 4)
            t0 = time.monotonic()
            call = decode_call(d, f"bad-{i}", ids, first, sampling, kv_wait_s=10)
            assert await rpc_code(call) == grpc.StatusCode.INVALID_ARGUMENT, i
            assert time.monotonic() - t0 < 5.0  # not after the 10 s KV wait
            # the reservation is freed on the engine thread right after the reply: on a busy
            # machine a load read at once can still count it (CI saw 1), so wait for it
            assert_idle(await wait_pool_free([d], timeout_s=10))
        assert (await d.status()) == 1


async def test_32_concurrent_requests_complete_and_free_every_block(fleet: Fleet) -> None:
    """32 requests at once through one pair (``--kv-timeout 5``): their transfers queue behind
    each other on the pair for longer than 5 s on a slow machine, and none fails for it. (Six
    tokens each: the transfers are the point, and the first token and five decode steps check
    that each request ran on its own KV.)"""
    prefill, decode = fleet.shared("prefill", "decode")
    base = parity_prompts()
    prompts = [base[i % len(base)] + [28 + i] for i in range(32)]  # 32 distinct prompts
    expected = greedy_reference(prompts, 6)
    async with Conn(prefill.address, "prefill") as p, Conn(decode.address, "decode") as d:
        failures = [(await c.load()).kv_transfer_failures for c in (p, d)]
        results = await asyncio.wait_for(
            asyncio.gather(*(disagg(p, d, f"load-{i}", ids, 6) for i, ids in enumerate(prompts))),
            timeout=120,
        )
        for exp, got in zip(expected, results, strict=True):
            assert got.token_ids == exp.token_ids
        loads = await wait_pool_free([p, d], timeout_s=2.0)
        assert_idle(loads)
        assert [ld.kv_transfer_failures for ld in loads] == failures


async def test_decode_called_before_the_kv_arrives_waits_for_it(fleet: Fleet) -> None:
    """Decode right after the first token, before TransferDone (the transfers queue behind
    each other): every call waits for its KV, and none runs on KV that has not arrived. (Eight
    requests of eight blocks each: enough that the transfers queue.)"""
    prefill, decode = fleet.shared("prefill", "decode")
    prompts = [long_prompt(120, f"Question {i}: name a colour. ") for i in range(8)]
    expected = greedy_reference(prompts, 6)

    async def early(p: Conn, d: Conn, i: int, ids: list[int]) -> list[int]:
        rid = f"early-{i}"
        call = prefill_call(p, rid, ids, greedy(6), await reserve(d, rid, len(ids), 6))
        first = list((await call.read()).first.token_ids)
        tokens = list(first)
        decoding = decode_call(d, rid, ids, first, greedy(6), kv_wait_s=60)
        assert await rpc_code(call) == grpc.StatusCode.OK  # the rest of Prefill: TransferDone
        while (chunk := await decoding.read()) is not grpc.aio.EOF:
            tokens += list(chunk.token_ids)
        return tokens

    async with Conn(prefill.address, "prefill") as p, Conn(decode.address, "decode") as d:
        failures = [(await c.load()).kv_transfer_failures for c in (p, d)]
        got = await asyncio.gather(*(early(p, d, i, ids) for i, ids in enumerate(prompts)))
        assert got == [e.token_ids for e in expected]
        loads = await wait_pool_free([p, d])
        assert_idle(loads)
        assert [ld.kv_transfer_failures for ld in loads] == failures


async def test_a_transfer_the_receiver_refuses_frees_both_sides_at_once(fleet: Fleet) -> None:
    """A prefill sends 8 blocks into a 3-block reservation: the receiver refuses them, the
    prefill call ends ABORTED, and the reservation is freed then, not when its TTL runs out."""
    prefill, decode = fleet.shared("prefill", "decode")
    ids = long_prompt(120)
    async with Conn(prefill.address, "prefill") as p, Conn(decode.address, "decode") as d:
        failures = (await p.load()).kv_transfer_failures
        res = await reserve(d, "too-big", 40, 4, ttl_s=600)
        assert res.num_blocks == 3
        call = prefill_call(p, "too-big", ids, greedy(4), res)
        assert await rpc_code(call) == grpc.StatusCode.ABORTED
        assert_idle(await wait_pool_free([p, d], timeout_s=2.0))  # no Abort sent, TTL 600 s
        assert (await p.load()).kv_transfer_failures == failures + 1


async def test_cancelling_a_decode_stream_frees_both_sides_promptly(fleet: Fleet) -> None:
    """Within 3 s of the cancel, on a loaded machine; the 400 tokens it would otherwise go on
    decoding take far longer on the CPU."""
    prefill, decode = fleet.shared("prefill", "decode")
    ids = chat_ids("Tell me a very long story about a parcel.")
    sampling = greedy(400, ignore_eos=True)
    async with Conn(prefill.address, "prefill") as p, Conn(decode.address, "decode") as d:
        res = await reserve(d, "cancel-me", len(ids), 400)
        events = [ev async for ev in prefill_call(p, "cancel-me", ids, sampling, res)]
        call = decode_call(d, "cancel-me", ids, list(events[0].first.token_ids), sampling)
        for _ in range(3):
            assert (await call.read()).token_ids
        assert (await d.load()).num_running == 1
        call.cancel()
        t0 = time.monotonic()
        assert_idle(await wait_pool_free([p, d], timeout_s=3.0))
        assert time.monotonic() - t0 < 3.0


async def test_cancelling_a_prefill_mid_prompt_frees_both_sides_within_a_second(
    fleet: Fleet,
) -> None:
    prefill, decode = fleet.shared("prefill", "decode")
    ids = long_prompt(900)
    async with Conn(prefill.address, "prefill") as p, Conn(decode.address, "decode") as d:
        res = await reserve(d, "cancel-early", len(ids), 8)
        call = prefill_call(p, "cancel-early", ids, greedy(8), res)
        while (await p.load()).num_running == 0:
            await asyncio.sleep(0.01)
        call.cancel()  # what the gateway does when the client goes away ...
        assert await d.abort("cancel-early")  # ... and it aborts the reservation
        t0 = time.monotonic()
        loads = await wait_pool_free([p, d], timeout_s=1.0)
        # the engine notices the abort between steps: at worst one prefill step later
        if time.monotonic() - t0 >= 1.0:
            loads = await wait_pool_free([p, d], timeout_s=6.0)
        assert_idle(loads)


async def test_prefill_killed_mid_transfer_fails_fast_and_a_new_prefill_works(
    fleet: Fleet,
) -> None:
    """Killed as soon as its first token arrives, the prefill worker has almost always not
    finished the transfer (~60 blocks); the rare run where it had is valid too, and checked for
    what it must be: the whole KV arrived, so decoding gives the reference tokens."""
    prefill, decode = fleet.shared("prefill", "decode")
    ids = long_prompt(960)
    sampling = greedy(8)
    async with Conn(prefill.address, "prefill") as p, Conn(decode.address, "decode") as d:
        res = await reserve(d, "orphan", len(ids), 8, ttl_s=30)
        call = prefill_call(p, "orphan", ids, sampling, res)
        first = await call.read()
        assert first.WhichOneof("event") == "first"
        fleet.forget(prefill)
        prefill.kill()  # the transfer began with the first token: it is (almost always) on its way
        t0 = time.monotonic()
        assert await rpc_code(call) in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.OK)
        # the decode worker does not wait for KV that cannot come (kv_wait_s is 4 s): the broken
        # transfer already freed the reservation (NOT_FOUND), or, if the prefill died before its
        # header, the KV wait ends UNAVAILABLE; it runs (OK) only on KV that fully arrived
        tokens = list(first.first.token_ids)
        decoding = decode_call(d, "orphan", ids, tokens, sampling, kv_wait_s=4)
        code = grpc.StatusCode.OK
        try:
            while (chunk := await decoding.read()) is not grpc.aio.EOF:
                tokens += list(chunk.token_ids)
        except grpc.aio.AioRpcError as e:
            code = e.code()
        assert time.monotonic() - t0 < 5.0
        if code == grpc.StatusCode.OK:
            assert tokens == greedy_reference([ids], 8)[0].token_ids  # the KV was whole
        else:
            assert code in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNAVAILABLE)
        assert_idle(await wait_pool_free([d], timeout_s=2.0))
    (new_prefill,) = fleet.shared("prefill")
    async with Conn(new_prefill.address, "prefill") as p, Conn(decode.address, "decode") as d:
        prompt = chat_ids("What is the capital of France?")
        got = await disagg(p, d, "after-restart", prompt, 12)
        assert got.token_ids == greedy_reference([prompt], 12)[0].token_ids
        assert decode.alive and fleet.shared("decode")[0] is decode  # never restarted
        assert_idle(await wait_pool_free([p, d]))


async def test_a_local_prefill_on_the_decode_worker_equals_the_offline_engine(fleet: Fleet) -> None:
    """Conditional disaggregation: Decode with local_prefill (no KV comes) prefills the prompt
    on the decode worker; greedy output as the offline engine's; its blocks all free after. With
    output_token_ids (a request moved here from a decode worker that died mid-stream) those are
    prefilled too and the worker streams the tokens after them; outputs that leave nothing to
    generate are refused."""
    (decode,) = fleet.shared("decode")
    prompts = [chat_ids("What is the capital of France?"), chat_ids("Name three colours.")]
    expected = greedy_reference(prompts, 12)
    async with Conn(decode.address, "decode") as d:
        for i, (ids, exp) in enumerate(zip(prompts, expected, strict=True)):
            rid = f"local-{i}"
            await reserve(d, rid, len(ids), 12)
            req = decode_pb2.DecodeRequest(
                request_id=rid, reservation_id=rid, prompt_token_ids=ids, sampling=greedy(12),
                local_prefill=True,
            )  # fmt: skip
            tokens = [t async for chunk in d.stub.Decode(req, timeout=60) for t in chunk.token_ids]
            assert tokens == exp.token_ids
            await reserve(d, f"{rid}-resumed", len(ids), 12)
            resumed = decode_pb2.DecodeRequest(
                request_id=f"{rid}-resumed", reservation_id=f"{rid}-resumed",
                prompt_token_ids=ids, output_token_ids=exp.token_ids[:5], sampling=greedy(12),
                local_prefill=True,
            )  # fmt: skip
            rest = [t async for c in d.stub.Decode(resumed, timeout=60) for t in c.token_ids]
            assert rest == exp.token_ids[5:]
        await reserve(d, "local-bad", len(prompts[0]), 4)
        bad = decode_pb2.DecodeRequest(
            request_id="local-bad", reservation_id="local-bad", prompt_token_ids=prompts[0],
            output_token_ids=[5, 6, 7, 8], sampling=greedy(4), local_prefill=True,
        )  # fmt: skip
        assert await rpc_code(d.stub.Decode(bad, timeout=60)) == grpc.StatusCode.INVALID_ARGUMENT
        assert_idle(await wait_pool_free([d]))


def test_reservation_ttls_are_capped_shorter_without_an_owner() -> None:
    """Only a caller that renews a lease (a gateway) may hold KV for long: an unowned
    reservation lives at most a minute, whatever it asks for."""
    assert reservation_ttl(600.0, "gateway-1") == 600.0
    assert reservation_ttl(1e9, "gateway-1") == MAX_TTL_S
    assert reservation_ttl(3600.0, "") == UNOWNED_MAX_TTL_S == 60.0
    assert reservation_ttl(5.0, "") == 5.0
    assert reservation_ttl(0.0, "") == 10.0  # not said: the proto default
