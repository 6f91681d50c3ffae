"""``tandem worker`` (colocated) as a real process: greedy parity with the offline engine,
Abort and cancel, bad input, and draining on SIGTERM (the last test: it stops the worker)."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import grpc
import pytest

from deploy.procfs import descendants
from protos import common_pb2, worker_pb2
from tests.services.clients import (
    Conn,
    assert_idle,
    chat_ids,
    generate,
    greedy,
    parity_prompts,
    rpc_code,
    wait_pool_free,
)
from tests.services.procs import Fleet, fleet
from tests.services.reference import greedy_reference

__all__ = ["fleet"]
pytestmark = pytest.mark.slow
NOT_SERVING = 2


def generate_call(
    conn: Conn, rid: str, ids: list[int], sampling: common_pb2.SamplingParams
) -> grpc.aio.UnaryStreamCall:
    req = worker_pb2.GenerateRequest(request_id=rid, prompt_token_ids=ids, sampling=sampling)
    return conn.stub.Generate(req, timeout=60)


async def test_greedy_output_equals_the_offline_engine(fleet: Fleet) -> None:
    (worker,) = fleet.shared("worker")
    prompts = parity_prompts()
    expected = greedy_reference(prompts, 24)
    async with Conn(worker.address, "worker") as w:
        results = await asyncio.gather(
            *(generate(w, f"parity-{i}", ids, 24) for i, ids in enumerate(prompts))
        )
        for exp, got in zip(expected, results, strict=True):
            assert (got.token_ids, got.text) == (exp.token_ids, exp.text)
        load = await w.load()
        assert load.role == "colocated" and load.prefix_cache_hits >= 2 * 3 * 16
        steps = load.iteration_tokens  # each token sampled needs one computed in some step
        assert steps.count >= max(len(r.token_ids) for r in results)
        assert steps.sum >= sum(len(r.token_ids) for r in results)
        assert list(steps.bounds[:3]) == [1, 8, 16] and steps.counts[-1] <= steps.count
        assert_idle(await wait_pool_free([w]))


async def test_abort_ends_the_stream_and_frees_its_blocks(fleet: Fleet) -> None:
    (worker,) = fleet.shared("worker")
    async with Conn(worker.address, "worker") as w:
        call = generate_call(
            w, "abort-me", chat_ids("Tell me a story."), greedy(500, ignore_eos=True)
        )
        assert (await call.read()).token_ids
        assert await w.abort("abort-me")
        chunks = []
        while (chunk := await call.read()) is not grpc.aio.EOF:
            chunks.append(chunk)
        assert chunks[-1].finish_reason == common_pb2.FINISH_REASON_ABORT
        assert not await w.abort("abort-me")
        assert_idle(await wait_pool_free([w], timeout_s=1.0))


async def test_cancelling_the_call_frees_its_blocks_within_a_second(fleet: Fleet) -> None:
    (worker,) = fleet.shared("worker")
    async with Conn(worker.address, "worker") as w:
        calls = [
            generate_call(w, f"cancel-{i}", chat_ids(f"Story {i}."), greedy(500, ignore_eos=True))
            for i in range(4)
        ]
        for call in calls:
            assert (await call.read()).token_ids
        assert (await w.load()).num_running == 4
        for call in calls:
            call.cancel()
        assert_idle(await wait_pool_free([w], timeout_s=1.0))


async def test_a_request_id_in_use_is_refused(fleet: Fleet) -> None:
    (worker,) = fleet.shared("worker")
    async with Conn(worker.address, "worker") as w:
        call = generate_call(w, "twice", [1, 2, 3], greedy(300, ignore_eos=True))
        assert (await call.read()).token_ids
        again = generate_call(w, "twice", [1, 2, 3], greedy(3))
        assert await rpc_code(again) == grpc.StatusCode.ALREADY_EXISTS
        call.cancel()
        assert_idle(await wait_pool_free([w]))


@pytest.mark.parametrize(
    ("rid", "ids", "sampling"),
    [
        ("r", [], greedy(4)),
        ("r", [1, 49152], greedy(4)),
        ("r", [1, 2], common_pb2.SamplingParams(max_tokens=0)),
        ("r", [1, 2], common_pb2.SamplingParams(max_tokens=4, top_p=1.5)),
        ("", [1, 2], greedy(4)),
    ],
)
async def test_bad_input_is_invalid_argument(
    fleet: Fleet, rid: str, ids: list[int], sampling: common_pb2.SamplingParams
) -> None:
    (worker,) = fleet.shared("worker")
    async with Conn(worker.address, "worker") as w:
        assert await rpc_code(generate_call(w, rid, ids, sampling)) == (
            grpc.StatusCode.INVALID_ARGUMENT
        )
        assert await w.status() == 1


async def test_sigterm_drains_then_exits_cleanly(fleet: Fleet) -> None:
    """Last in this module: it stops the shared worker (started with --drain-timeout 3)."""
    (worker,) = fleet.shared("worker")
    children = descendants(worker.pid)
    async with Conn(worker.address, "worker") as w:
        call = generate_call(w, "in-flight", chat_ids("Story."), greedy(800, ignore_eos=True))
        assert (await call.read()).token_ids
        fleet.forget(worker)
        t0 = time.monotonic()
        os.killpg(worker.pid, signal.SIGTERM)  # what `tandem up` and Kubernetes send
        while await w.status() != NOT_SERVING:
            assert time.monotonic() - t0 < 2.5  # at once: not after the 3 s drain
            await asyncio.sleep(0.02)
        code = await rpc_code(generate_call(w, "late", [1, 2, 3], greedy(4)))
        assert code == grpc.StatusCode.UNAVAILABLE
        last = None
        while (chunk := await call.read()) is not grpc.aio.EOF:
            last = chunk
        assert last is not None
        assert last.finish_reason in (
            common_pb2.FINISH_REASON_ABORT,
            common_pb2.FINISH_REASON_LENGTH,
        )
        assert time.monotonic() - t0 < 3.0 + 1.0
    assert await asyncio.to_thread(worker.wait_exit, 15) == 0
    assert not [pid for pid in children if os.path.exists(f"/proc/{pid}")]
