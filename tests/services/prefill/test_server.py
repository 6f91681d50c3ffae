"""``tandem prefill`` as a real process, driven over gRPC beside a real decode worker:
greedy parity with the offline engine (the KV streamed layer by layer, the default, and shipped
whole after the first token), its prefix cache, bad input, and a decode worker that dies while
the KV is on its way."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import grpc
import pytest

from protos import common_pb2
from tests.services.clients import (
    Conn,
    assert_idle,
    chat_ids,
    disagg,
    greedy,
    long_prompt,
    parity_prompts,
    prefill_call,
    reserve,
    tokenizer,
    wait_pool_free,
)
from tests.services.procs import Fleet, fleet
from tests.services.reference import greedy_reference

__all__ = ["fleet"]
pytestmark = pytest.mark.slow
MAX_TOKENS = 24


async def test_disaggregated_greedy_output_equals_the_offline_engine(fleet: Fleet) -> None:
    prefill, decode = fleet.shared("prefill", "decode")
    # the default on the CPU (auto): the KV leaves layer by layer
    assert prefill.ready["kv_streaming"] is True
    prompts = parity_prompts()
    expected = greedy_reference(prompts, MAX_TOKENS)
    # sent together (the workers batch them), in two waves: the 2nd and 3rd of the chats that
    # share a system prompt (prompts 6 and 7) after the 1st is done, so they find it cached
    waves = [[i for i in range(len(prompts)) if i not in (6, 7)], [6, 7]]
    async with Conn(prefill.address, "prefill") as p, Conn(decode.address, "decode") as d:
        hits_before = (await p.load()).prefix_cache_hits
        done: dict[int, Any] = {}
        for wave in waves:
            got_wave = await asyncio.gather(
                *(disagg(p, d, f"parity-{i}", prompts[i], MAX_TOKENS) for i in wave)
            )
            done.update(zip(wave, got_wave, strict=True))
        results = [done[i] for i in range(len(prompts))]
        for ids, exp, got in zip(prompts, expected, results, strict=True):
            assert got.token_ids == exp.token_ids, tokenizer().decode(ids)
            assert got.text == exp.text
            reason = {"stop": common_pb2.FINISH_REASON_STOP,
                      "length": common_pb2.FINISH_REASON_LENGTH}[exp.finish_reason]  # fmt: skip
            assert got.finish_reason == reason
        load = await p.load()
        # the three chats share a 3-block system prompt: the 2nd and 3rd find it cached
        assert load.prefix_cache_hits - hits_before >= 2 * 3 * 16
        assert_idle(await wait_pool_free([p, d]))
    log = prefill.log_path.read_text()  # no streamed transfer fell back to the whole-KV path
    assert "not submitted" not in log and "hook failed" not in log


async def test_the_whole_kv_after_the_first_token_gives_the_same_output(fleet: Fleet) -> None:
    """--kv-streaming off: the KV leaves after the first token, all at once. Same tokens as the
    streamed path and the offline engine, for a prompt of several chunks and for one cached up
    to its last token (the second time, only that token is computed and streams the KV). The
    whole-KV worker says so in its load (the gateway then asks for blocks granted ahead); a
    grant its pair cannot use (this CPU decode worker grants nothing; one of another pool) is
    ignored and the blocks asked for as usual, and one that is not a grant is refused."""
    whole = fleet.spawn("prefill", "--kv-streaming", "off", name="whole-prefill")
    try:
        streamed, decode = fleet.shared("prefill", "decode")
        cached = long_prompt(16 * 20 + 1)  # the second time, all of it but its last token
        prompts = [parity_prompts()[4], cached, cached]
        expected = greedy_reference(prompts, 8)  # while it loads
        assert whole.wait_ready().ready["kv_streaming"] is False
        async with (
            Conn(streamed.address, "prefill") as s,
            Conn(whole.address, "prefill") as w,
            Conn(decode.address, "decode") as d,
        ):
            assert (await w.load()).kv_whole and not (await s.load()).kv_whole

            async def run(name: str, p: Conn) -> None:
                hits = (await p.load()).prefix_cache_hits
                got = [await disagg(p, d, f"{name}-{i}", ids, 8, grant=name == "whole")
                       for i, ids in enumerate(prompts)]  # fmt: skip
                assert [g.token_ids for g in got] == [e.token_ids for e in expected], name
                assert (await p.load()).prefix_cache_hits - hits >= 20 * 16

            # the two prefill workers side by side, into the one decode worker
            await asyncio.gather(run("streamed", s), run("whole", w))
            assert_idle(await wait_pool_free([s, w, d]))
            foreign = json.dumps({"pool": "elsewhere", "slot": 0, "token": 4, "blocks": [1, 2]})
            got1 = await disagg(w, d, "whole-foreign", prompts[0], 8, kv_grant=foreign)
            assert got1.token_ids == expected[0].token_ids
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await disagg(w, d, "whole-bad", prompts[0], 8, kv_grant='{"pool": 1}')
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "target.kv_grant is not a KV grant" in (info.value.details() or "")
            assert_idle(await wait_pool_free([w, d]))
    finally:
        whole.kill()


async def test_a_first_token_that_ends_the_request_leaves_nothing_behind(fleet: Fleet) -> None:
    """max_tokens 1: no KV is needed. A streamed transfer, submitted before the first token,
    is cancelled or allowed to end before the blocks are freed; the gateway then frees the
    reservation. Both pools end whole, and the pair still works."""
    prefill, decode = fleet.shared("prefill", "decode")
    ids = long_prompt(300)
    async with Conn(prefill.address, "prefill") as p, Conn(decode.address, "decode") as d:
        for i in range(3):
            res = await reserve(d, f"one-{i}", len(ids), 1)
            events = [ev async for ev in prefill_call(p, f"one-{i}", ids, greedy(1), res)]
            assert [ev.WhichOneof("event") for ev in events] == ["first"]
            assert events[0].first.finish_reason == common_pb2.FINISH_REASON_LENGTH
            assert await d.abort(f"one-{i}")  # the gateway, once the prefill call ended
        assert_idle(await wait_pool_free([p, d], timeout_s=5.0))
        prompt = chat_ids("What is the capital of France?")
        got = await disagg(p, d, "after-one", prompt, 8)
        assert got.token_ids == greedy_reference([prompt], 8)[0].token_ids
        assert_idle(await wait_pool_free([p, d]))


async def test_a_first_token_that_is_a_stop_token_ends_the_request_as_colocated(
    fleet: Fleet,
) -> None:
    """The first token, sampled here, is one of the request's stop_token_ids: the output ends
    with it as a stop (stop_reason the token, its text left out, as the offline engine gives
    it), no KV moves, and both pools end whole."""
    prefill, decode = fleet.shared("prefill", "decode")
    prompt = chat_ids("What is the capital of France?")
    first = greedy_reference([prompt], 1)[0].token_ids[0]
    async with Conn(prefill.address, "prefill") as p, Conn(decode.address, "decode") as d:
        res = await reserve(d, "stop-first", len(prompt), 8)
        params = greedy(8, stop_token_ids=[first])
        events = [ev async for ev in prefill_call(p, "stop-first", prompt, params, res)]
        assert [ev.WhichOneof("event") for ev in events] == ["first"]
        got = events[0].first
        assert list(got.token_ids) == [first] and got.text == ""
        assert got.finish_reason == common_pb2.FINISH_REASON_STOP
        assert got.WhichOneof("stop_reason") == "stop_token_id" and got.stop_token_id == first
        assert await d.abort("stop-first")  # the gateway, once the prefill call ended
        assert_idle(await wait_pool_free([p, d], timeout_s=5.0))


async def test_a_stop_string_that_begins_in_the_first_token_is_found_across_the_hand_off(
    fleet: Fleet,
) -> None:
    """The prefill worker's first token may begin a stop string the decode worker's tokens end:
    the prefill worker holds that text back, the decode worker holds it too, matches the stop
    string across the two, and the client gets the text before it (it got the whole first token
    and then the text to max_tokens: the stop string was never seen)."""
    prefill, decode = fleet.shared("prefill", "decode")

    async def check(p: Conn, d: Conn, i: int, ids: list[int]) -> bool:
        """One prompt's steps in turn; False if its text allows no such stop string."""
        plain = await disagg(p, d, f"plain-{i}", ids, 12)
        res = await reserve(d, f"first-{i}", len(ids), 12)
        events = [ev async for ev in prefill_call(p, f"first-{i}", ids, greedy(12), res)]
        assert await d.abort(f"first-{i}")
        first = events[0].first.text
        cut = len(first) - 1  # the stop string: the first token's last character and two more
        stop = plain.text[cut : cut + 3]
        if cut < 0 or len(stop) < 3 or plain.text.find(stop) != cut:
            return False
        got = await disagg(p, d, f"stop-{i}", ids, 12, stop=[stop])
        assert got.text == plain.text[:cut], (stop, plain.text)
        assert got.finish_reason == common_pb2.FINISH_REASON_STOP
        assert got.token_ids == plain.token_ids[: len(got.token_ids)]
        # what the prefill worker sent first: its token's text but for the last two
        # characters (the longest stop string's length less one), which may begin one
        res = await reserve(d, f"held-{i}", len(ids), 12)
        sampling = greedy(12, stop=[stop])
        events = [ev async for ev in prefill_call(p, f"held-{i}", ids, sampling, res)]
        assert await d.abort(f"held-{i}")
        assert events[0].first.text == first[: max(len(first) - 2, 0)]
        return True

    async with Conn(prefill.address, "prefill") as p, Conn(decode.address, "decode") as d:
        # the prompts side by side (the workers batch them)
        found = await asyncio.gather(
            *(check(p, d, i, ids) for i, ids in enumerate(parity_prompts()))
        )
        assert sum(found) >= 3, "too few prompts whose text allows such a stop string"
        assert_idle(await wait_pool_free([p, d]))


async def test_first_token_arrives_before_the_transfer_is_done(fleet: Fleet) -> None:
    prefill, decode = fleet.shared("prefill", "decode")
    ids = chat_ids("Tell me a long story about a parcel. " * 20)
    async with Conn(prefill.address, "prefill") as p, Conn(decode.address, "decode") as d:
        res = await reserve(d, "order", len(ids), 8)
        events = [ev async for ev in prefill_call(p, "order", ids, greedy(8), res)]
        assert [ev.WhichOneof("event") for ev in events] == ["first", "done"]
        first, done = events[0].first, events[1].done
        assert len(first.token_ids) == 1 and first.finish_reason == 0
        assert first.num_prompt_tokens == len(ids)
        assert done.num_blocks == -(-len(ids) // 16) and done.bytes > 0
        assert await d.abort("order")  # the reservation, never claimed
        assert_idle(await wait_pool_free([p, d]))


async def test_prefill_without_a_target_only_returns_the_first_token(fleet: Fleet) -> None:
    (prefill,) = fleet.shared("prefill")
    ids = chat_ids("What is the capital of France?")
    (expected,) = greedy_reference([ids], 1)
    async with Conn(prefill.address, "prefill") as p:
        events = [ev async for ev in prefill_call(p, "no-target", ids, greedy(5), None)]
        assert [ev.WhichOneof("event") for ev in events] == ["first"]
        assert list(events[0].first.token_ids) == expected.token_ids
        assert_idle(await wait_pool_free([p]))


@pytest.mark.parametrize(
    ("ids", "sampling", "why"),
    [
        ([], greedy(4), "empty"),
        ([1, 49152, 3], greedy(4), "vocabulary"),
        ([1, -5, 3], greedy(4), "vocabulary"),
        ([1, 2, 3], common_pb2.SamplingParams(max_tokens=0), "max_tokens"),
        ([1, 2, 3], common_pb2.SamplingParams(max_tokens=4, temperature=-1), "temperature"),
        ([1] * 1024, greedy(4), "context length"),
    ],
)
async def test_bad_input_is_invalid_argument(
    fleet: Fleet, ids: list[int], sampling: common_pb2.SamplingParams, why: str
) -> None:
    (prefill,) = fleet.shared("prefill")
    async with Conn(prefill.address, "prefill") as p:
        call = prefill_call(p, "bad", ids, sampling, None)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for _ in call:
                pass
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert why in (info.value.details() or "")
        assert (await p.status()) == 1  # still SERVING
        assert_idle(await wait_pool_free([p]))


async def test_decode_killed_mid_transfer_fails_the_prefill_and_frees_its_blocks(
    fleet: Fleet,
) -> None:
    prefill, decode = fleet.shared("prefill", "decode")
    ids = long_prompt(960)
    async with Conn(prefill.address, "prefill") as p:
        async with Conn(decode.address, "decode") as d:
            res = await reserve(d, "doomed", len(ids), 8)
        call = prefill_call(p, "doomed", ids, greedy(8), res)
        first = await call.read()
        assert first.WhichOneof("event") == "first"
        failures = (await p.load()).kv_transfer_failures
        fleet.forget(decode)
        decode.kill()  # the transfer began with the first token: it is (almost always) on its way
        t0 = time.monotonic()
        try:
            event = await call.read()
            # the rare run where the whole KV had arrived and been acknowledged before the kill
            assert event.WhichOneof("event") == "done" and await call.read() is grpc.aio.EOF
        except grpc.aio.AioRpcError as e:
            assert time.monotonic() - t0 < 7.0  # within the KV timeout (5 s) and some slack
            # ABORTED, not UNAVAILABLE: the prefill worker itself is fine (no retry elsewhere)
            assert e.code() == grpc.StatusCode.ABORTED
            assert "KV transfer" in (e.details() or "")
            assert (await p.load()).kv_transfer_failures == failures + 1
        assert_idle(await wait_pool_free([p]))
        # the same prefill worker serves a request for another decode worker
        (other,) = fleet.shared("decode")
        async with Conn(other.address, "decode") as d2:
            prompt = chat_ids("What is the capital of France?")
            got = await disagg(p, d2, "after-kill", prompt, 8)
            assert got.token_ids == greedy_reference([prompt], 8)[0].token_ids
            assert_idle(await wait_pool_free([p, d2]))


async def test_with_kv_checksums_the_kv_arrives_verified_and_the_output_is_unchanged(
    fleet: Fleet,
) -> None:
    """--kv-checksum: every transfer carries a checksum per chunk, verified by the decode
    worker before the request runs (tests/kvtransfer covers a corrupted chunk failing it)."""
    (decode,) = fleet.shared("decode")
    prefill = fleet.start("prefill", "--kv-checksum", name="checksum-prefill")
    try:
        prompts = parity_prompts()[:3]
        expected = greedy_reference(prompts, MAX_TOKENS)
        async with Conn(prefill.address, "prefill") as p, Conn(decode.address, "decode") as d:
            results = await asyncio.gather(
                *(disagg(p, d, f"checked-{i}", ids, MAX_TOKENS) for i, ids in enumerate(prompts))
            )
            assert [r.token_ids for r in results] == [e.token_ids for e in expected]
            load = await p.load()
            assert load.kv_transfer_failures == 0 and load.kv_transfer_bytes > 0
            assert_idle(await wait_pool_free([p, d]))
    finally:
        prefill.kill()
