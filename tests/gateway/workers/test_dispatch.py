"""Request flows through failing, slow and departing parties: retries, aborts, error frames."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import pytest

from gateway.core.config import WorkerSpec
from gateway.workers.router import prefix_key, rank_by_affinity
from tests.gateway.fake_workers import FakeWorker
from tests.gateway.stack import Stack, dead_address, wait_for

pytestmark = pytest.mark.timeout(60)
PROMPT = "Hello world, this is a test of the gateway"


def sse_lines(response: httpx.Response) -> Iterator[str]:
    for line in response.iter_lines():
        if line.startswith("data: "):
            yield line[len("data: ") :]


def chosen_prefill(stack: Stack, prompt: str):
    ids = stack.state.tokenizer.encode(prompt)
    workers = stack.state.registry.healthy("prefill")
    address = rank_by_affinity(workers, prefix_key(ids, 16, 4))[0].address
    return next(w for w in stack.role("prefill") if w.address == address)


def test_retry_on_another_prefill_worker_before_the_first_token(
    disagg: Stack, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="gateway.workers.client")
    first = chosen_prefill(disagg, PROMPT)
    first.behavior.fail_before_first = 1
    r = httpx.post(f"{disagg.base_url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 3})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "Hello world,"
    other = next(w for w in disagg.role("prefill") if w is not first)
    assert len(first.records.requests) == 1 and other.records.requests[0].endswith("-retry1")
    decode = disagg.role("decode")[0]
    # the first attempt's reservation is freed
    assert wait_for(lambda: first.records.requests[0] in decode.records.aborts)
    assert wait_for(lambda: not decode.records.reservations)
    # UNAVAILABLE marks it unhealthy at once (read from the log: the stack's 0.2 s health poll
    # finds the fake worker serving again and may already have put it back)
    marked = [r.getMessage() for r in caplog.records if "is unhealthy" in r.getMessage()]
    assert any(first.address in m and "Prefill failed" in m for m in marked), marked


def test_error_frame_then_done_when_decode_dies_mid_stream(disagg: Stack) -> None:
    decode = disagg.role("decode")[0]
    decode.behavior.fail_after_tokens = 3
    body = {"prompt": PROMPT, "max_tokens": 8, "stream": True}
    with httpx.stream("POST", f"{disagg.base_url}/v1/completions", json=body) as r:
        frames = list(sse_lines(r))
    assert frames[-1] == "[DONE]"
    error = json.loads(frames[-2])["error"]
    assert error["code"] == "worker_unavailable" and "Decode" in error["message"]
    texts = [json.loads(f)["choices"][0]["text"] for f in frames[:-2]]
    assert "".join(texts) == "Hello world,"  # 1 token from prefill, 2 from decode
    assert wait_for(lambda: len(decode.records.aborts) == 1)


def test_non_streaming_failure_after_tokens_is_a_5xx(disagg: Stack) -> None:
    disagg.role("decode")[0].behavior.fail_after_tokens = 2
    r = httpx.post(f"{disagg.base_url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 8})
    assert r.status_code == 503 and r.json()["error"]["code"] == "worker_unavailable"


def test_transfer_failure_aborts_both_sides_and_the_stream_resumes(disagg: Stack) -> None:
    """The KV transfer fails after the first token reached the client: both sides of that
    attempt are aborted (decode never runs on KV that did not arrive), and the request resumes
    on the decode worker as a local prefill of the prompt and that token: one stream, whole."""
    url = f"{disagg.base_url}/v1/completions"
    body = {"prompt": PROMPT, "max_tokens": 8, "stream": True}
    whole = httpx.post(url, json={**body, "stream": False}).json()["choices"][0]["text"]
    decode = disagg.role("decode")[0]
    decode.records.aborts.clear()
    prefill = chosen_prefill(disagg, PROMPT)
    prefill.behavior.fail_transfer = True
    with httpx.stream("POST", url, json=body) as r:
        frames = list(sse_lines(r))
    assert json.loads(frames[0])["choices"][0]["text"] == "Hello"  # the first token got out
    assert frames[-1] == "[DONE]" and not [f for f in frames[:-1] if "error" in json.loads(f)]
    text = "".join(json.loads(f)["choices"][0]["text"] for f in frames[:-1])
    assert text == whole
    first = prefill.records.requests[-1]
    assert wait_for(lambda: first in decode.records.aborts and first in prefill.records.aborts)
    assert first not in decode.records.decode_calls  # no Decode on the KV that did not arrive
    assert decode.records.local_prefills == [f"{first}-retry1"]


@pytest.mark.parametrize("phase", ["prefill", "transfer"])
def test_a_decode_worker_gone_before_its_kv_arrived_fails_the_request_at_once(
    tokenizer_dir: str, phase: str
) -> None:
    """The decode worker holding the reservation dies while the prompt is in prefill or its KV
    on the way: the client hears it within a health poll, not at the prefill's KV timeout."""
    stack = Stack(tokenizer_dir, ["prefill", "decode"]).start()
    try:
        prefill, decode = stack.role("prefill")[0], stack.role("decode")[0]
        if phase == "prefill":
            prefill.behavior.first_delay_s = 60.0
        else:
            prefill.behavior.transfer_s = 60.0
        body = {"prompt": PROMPT, "max_tokens": 8, "stream": True}
        with httpx.stream("POST", f"{stack.base_url}/v1/completions", json=body) as r:
            frames = sse_lines(r)
            if phase == "transfer":
                assert json.loads(next(frames))["choices"][0]["text"] == "Hello"
            else:
                assert wait_for(lambda: bool(prefill.records.requests))
            stack.run(decode.stop())
            t0 = time.monotonic()
            rest = list(frames)
            elapsed = time.monotonic() - t0
        assert rest[-1] == "[DONE]"
        error = json.loads(rest[-2])["error"]
        assert error["code"] == "worker_unavailable" and "went away" in error["message"]
        assert elapsed < 5.0  # one health poll (0.2 s here) and slack; was the KV timeout
        assert wait_for(lambda: len(prefill.records.aborts) == 1)  # its KV has nowhere to go
    finally:
        stack.stop()


def test_without_a_healthy_prefill_worker_the_decode_worker_prefills_the_prompt(
    tokenizer_dir: str,
) -> None:
    """tandem up with one prefill worker: while it was restarting (kill -9) or frozen (SIGSTOP),
    every request got 503 "no healthy worker", and one in prefill when it died ended with an
    error, though the decode worker can prefill a prompt itself (as it does for conditional
    disaggregation). Now the request is served there: mode=local, local_reason=no_prefill."""
    stack = Stack(tokenizer_dir, ["decode"], [WorkerSpec("prefill", dead_address())]).start()
    try:
        decode = stack.role("decode")[0]
        r = httpx.post(f"{stack.base_url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 3})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "Hello world,", r.text
        assert "mode=local;local_reason=no_prefill" in r.headers["x-tandem-timing"]
        assert len(decode.records.local_prefills) == 1
        assert httpx.get(f"{stack.base_url}/health").status_code == 200
        assert wait_for(lambda: not decode.records.reservations)
    finally:
        stack.stop()


def test_a_prefill_worker_dying_before_the_first_token_is_retried_on_the_decode_worker(
    tokenizer_dir: str,
) -> None:
    stack = Stack(tokenizer_dir, ["prefill", "decode"]).start()
    try:
        prefill, decode = stack.role("prefill")[0], stack.role("decode")[0]
        prefill.behavior.fail_before_first = 1  # UNAVAILABLE: the worker is gone
        body = {"prompt": PROMPT, "max_tokens": 3, "stream": True}
        with httpx.stream("POST", f"{stack.base_url}/v1/completions", json=body) as r:
            frames = list(sse_lines(r))
        text = "".join(json.loads(f)["choices"][0]["text"] for f in frames[:-1] if "choices" in f)
        assert frames[-1] == "[DONE]" and text == "Hello world,", frames
        (retried,) = decode.records.local_prefills
        assert retried.endswith("-retry1")
    finally:
        stack.stop()


def test_first_token_finishing_skips_decode_and_frees_the_reservation(disagg: Stack) -> None:
    r = httpx.post(f"{disagg.base_url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 1})
    assert r.json()["choices"][0] == {
        "index": 0, "text": "Hello", "logprobs": None, "finish_reason": "length",
        "stop_reason": None,
    }  # fmt: skip
    decode = disagg.role("decode")[0]
    assert wait_for(lambda: len(decode.records.aborts) == 1 and not decode.records.reservations)
    assert decode.records.decode_calls == []


def test_transfer_done_overtaking_the_first_token_is_accepted(disagg: Stack) -> None:
    chosen_prefill(disagg, PROMPT).behavior.done_first = True
    r = httpx.post(f"{disagg.base_url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 4})
    assert r.json()["choices"][0]["text"] == "Hello world, this"
    timing = dict(p.split("=") for p in r.headers["x-tandem-timing"].split(";"))
    assert float(timing["transfer"]) == pytest.approx(0.004)


@pytest.mark.parametrize("topology", ["disagg", "colocated"])
def test_client_disconnect_mid_stream_aborts_the_workers(topology: str, request) -> None:
    stack: Stack = request.getfixturevalue(topology)
    generator = stack.role("decode" if topology == "disagg" else "colocated")[0]
    generator.behavior.token_delay_s = 0.05
    body = {"prompt": PROMPT, "max_tokens": 200, "stream": True}
    with httpx.stream("POST", f"{stack.base_url}/v1/completions", json=body) as r:
        lines = sse_lines(r)
        for _ in range(3):
            next(lines)
    assert wait_for(lambda: len(generator.records.aborts) == 1)
    rid = generator.records.aborts[0]
    assert rid.startswith("cmpl-")
    assert wait_for(lambda: not stack.state.active and generator.records.reservations == {})


def test_client_timeout_on_a_non_streaming_request_aborts_the_workers(colocated: Stack) -> None:
    worker = colocated.workers[0]
    worker.behavior.token_delay_s = 0.05
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            f"{colocated.base_url}/v1/completions",
            json={"prompt": PROMPT, "max_tokens": 200},
            timeout=0.3,
        )
    assert wait_for(lambda: len(worker.records.aborts) == 1)


def test_reservation_lives_as_long_as_the_request_may(disagg: Stack) -> None:
    """An unclaimed decode reservation outlives a slow prefill of a long prompt: the gateway asks
    for the request's remaining time (--request-timeout), never less than reserve_ttl_s."""
    from gateway.core.config import GatewayConfig

    r = httpx.post(f"{disagg.base_url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
    assert r.status_code == 200
    (ttl,) = disagg.role("decode")[0].records.reserve_ttls
    defaults = GatewayConfig(tokenizer="", workers=())
    assert defaults.request_timeout_s - 30 < ttl <= defaults.request_timeout_s
    assert ttl > defaults.reserve_ttl_s


def test_reserve_refused_even_when_asked_to_wait_is_a_503(disagg: Stack) -> None:
    """A decode worker that answers no capacity at once, even to a Reserve that may wait (one
    that does not queue): 503, not a deadline."""
    disagg.role("decode")[0].behavior.reserve_code = grpc.StatusCode.RESOURCE_EXHAUSTED
    r = httpx.post(f"{disagg.base_url}/v1/completions", json={"prompt": PROMPT})
    assert r.status_code == 503 and r.json()["error"]["code"] == "no_capacity"
    assert all(not w.records.requests for w in disagg.role("prefill"))
    first, then = disagg.role("decode")[0].records.reserve_waits
    assert first == 0 and then > 0  # asked for room now, then to wait in the admission queue


def test_a_full_decode_pool_queues_the_request_until_blocks_free(disagg: Stack) -> None:
    """No room now: the request waits in the decode worker's admission queue and is served;
    the wait shows as queue= in its timing."""
    disagg.role("decode")[0].behavior.full_for_s = 0.3
    r = httpx.post(f"{disagg.base_url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 3})
    assert r.status_code == 200, r.text
    timing = dict(kv.split("=") for kv in r.headers["x-tandem-timing"].split(";"))
    assert float(timing["queue"]) >= 0.3
    assert disagg.role("decode")[0].records.reserve_waits[-1] > 0


def test_a_reservation_the_decode_worker_let_go_of_is_a_503_not_a_404(disagg: Stack) -> None:
    """The decode worker freed the request's reservation before Decode claimed it (its lease ran
    out while this gateway was frozen: SIGSTOP for 40 s on tandem up). The worker's NOT_FOUND
    named the gateway's own reservation, so the client got 404 invalid_request_error
    "not_found"; it is the service's failure: 503, and the reservation is named as lost."""
    decode = disagg.role("decode")[0]
    for prefill in disagg.role("prefill"):
        prefill.behavior.first_delay_s = 0.5
    with ThreadPoolExecutor(1) as pool:
        body = {"prompt": PROMPT, "max_tokens": 3}
        reply = pool.submit(httpx.post, f"{disagg.base_url}/v1/completions", json=body,
                            timeout=30)  # fmt: skip
        assert wait_for(lambda: bool(decode.records.reservations))
        decode.records.reservations.clear()  # expired there: the prefill is still running
        r = reply.result(30)
    error = r.json()["error"]
    assert r.status_code == 503, r.text
    assert error["type"] == "service_unavailable_error" and error["code"] == "reservation_lost"
    assert "reservation" in error["message"]


def test_one_late_health_answer_is_forgiven_two_in_a_row_are_not(tokenizer_dir: str) -> None:
    stack = Stack(
        tokenizer_dir, ["colocated"], health_interval_s=60.0, health_timeout_s=0.3
    ).start()
    try:
        (worker,) = stack.workers
        (client,) = stack.state.registry.clients
        assert client.healthy
        worker.behavior.health_delay_s = 1.0
        stack.run(stack.state.registry.poll_all())
        assert client.healthy  # a busy host answers late once: still serving
        stack.run(stack.state.registry.poll_all())
        assert not client.healthy and "DEADLINE_EXCEEDED" in client.last_error
        worker.behavior.health_delay_s = 0.0
        stack.run(stack.state.registry.poll_all())
        assert client.healthy
    finally:
        stack.stop()


def test_an_internal_error_of_one_call_has_the_worker_checked_not_dropped(
    tokenizer_dir: str,
) -> None:
    """Reserve answers INTERNAL (say an exception in the worker's handler for that request):
    the request fails, and the one decode worker, whose health check still answers, serves the
    next request at once. Where its check fails too, that check, made at once, takes it out of
    rotation (the regular poll is a minute away here)."""
    stack = Stack(tokenizer_dir, ["prefill", "decode"], health_interval_s=60.0).start()
    try:
        decode = stack.role("decode")[0]
        (client,) = [c for c in stack.state.registry.clients if c.role == "decode"]
        url = f"{stack.base_url}/v1/completions"
        decode.behavior.reserve_code = grpc.StatusCode.INTERNAL
        r = httpx.post(url, json={"prompt": PROMPT, "max_tokens": 3})
        assert r.status_code == 502 and "INTERNAL" in r.json()["error"]["message"], r.text
        decode.behavior.reserve_code = None
        r = httpx.post(url, json={"prompt": PROMPT, "max_tokens": 3})
        assert r.status_code == 200, r.text
        assert client.healthy
        decode.behavior.reserve_code = grpc.StatusCode.INTERNAL
        decode.behavior.serving = False
        httpx.post(url, json={"prompt": PROMPT, "max_tokens": 3})
        assert wait_for(lambda: not client.healthy), "the failed call did not have it checked"
        assert "not serving" in client.last_error
    finally:
        stack.stop()


def test_waiting_for_decode_blocks_past_the_deadline_is_a_504(tokenizer_dir: str) -> None:
    stack = Stack(tokenizer_dir, ["prefill", "decode"], request_timeout_s=1.0).start()
    try:
        stack.role("decode")[0].behavior.full_for_s = 30.0
        r = httpx.post(f"{stack.base_url}/v1/completions", json={"prompt": PROMPT})
        assert r.status_code == 504 and r.json()["error"]["code"] == "deadline_exceeded"
        assert "waited" in r.json()["error"]["message"]
        assert not stack.role("prefill")[0].records.requests  # never prefilled
    finally:
        stack.stop()


def test_worker_invalid_argument_is_a_400(colocated: Stack) -> None:
    colocated.workers[0].behavior.invalid_argument = True
    r = httpx.post(f"{colocated.base_url}/v1/completions", json={"prompt": PROMPT})
    assert r.status_code == 400 and r.json()["error"]["message"] == "fake worker: bad request"


def test_worker_error_chunk_is_a_502(colocated: Stack) -> None:
    colocated.workers[0].behavior.error_chunk = True
    r = httpx.post(f"{colocated.base_url}/v1/completions", json={"prompt": PROMPT})
    assert r.status_code == 502 and "fake OOM" in r.json()["error"]["message"]


def test_not_serving_worker_gives_503_until_it_recovers(colocated: Stack) -> None:
    worker = colocated.workers[0]
    worker.behavior.serving = False
    colocated.run(colocated.state.registry.poll_all())
    r = httpx.post(f"{colocated.base_url}/v1/completions", json={"prompt": PROMPT})
    assert r.status_code == 503 and "0 of 1 colocated" in r.json()["error"]["message"]
    assert httpx.get(f"{colocated.base_url}/health").status_code == 503
    worker.behavior.serving = True
    assert wait_for(lambda: httpx.get(f"{colocated.base_url}/health").status_code == 200)


@pytest.mark.parametrize("live, dead", [([], []), ([], ["colocated"]), (["prefill"], ["decode"])])
def test_503_without_any_healthy_worker(
    tokenizer_dir: str, live: list[str], dead: list[str]
) -> None:
    stack = Stack(tokenizer_dir, live, [WorkerSpec(role, dead_address()) for role in dead])
    stack.start()
    try:
        r = httpx.post(f"{stack.base_url}/v1/chat/completions",
                       json={"messages": [{"role": "user", "content": "hi"}]})  # fmt: skip
        assert r.status_code == 503
        assert r.json()["error"]["message"].startswith("no healthy worker can serve requests")
        assert httpx.get(f"{stack.base_url}/health").status_code == 503
    finally:
        stack.stop()


def test_health_names_the_workers_that_are_down_while_the_rest_serve(tokenizer_dir: str) -> None:
    dead = dead_address()
    stack = Stack(tokenizer_dir, ["colocated"], [WorkerSpec("colocated", dead)]).start()
    try:
        r = httpx.get(f"{stack.base_url}/health")
        assert r.status_code == 200
        assert r.json() == {
            "status": "ok", "workers": {"healthy": 1, "total": 2, "down": ["colocated-1"]}
        }  # fmt: skip
        assert dead not in r.text and stack.workers[0].address not in r.text  # open endpoint
    finally:
        stack.stop()


def test_deadline_is_a_504(tokenizer_dir: str) -> None:
    stack = Stack(tokenizer_dir, ["colocated"], request_timeout_s=0.3).start()
    try:
        stack.workers[0].behavior.token_delay_s = 0.1
        r = httpx.post(
            f"{stack.base_url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 50}
        )
        assert r.status_code == 504 and r.json()["error"]["code"] == "deadline_exceeded"
    finally:
        stack.stop()


def test_a_burst_spreads_over_the_decode_workers(tokenizer_dir: str) -> None:
    """16 streams at once, faster than the load polls: each Reserve counts on its worker at
    once, so the burst splits about evenly instead of landing on one decode worker."""
    stack = Stack(tokenizer_dir, ["prefill", "decode", "decode"]).start()
    try:
        for w in stack.role("decode"):
            w.behavior.token_delay_s = 0.05

        def one(i: int) -> int:
            body = {"prompt": f"{PROMPT} {i}", "max_tokens": 8}
            return httpx.post(f"{stack.base_url}/v1/completions", json=body, timeout=30).status_code

        with ThreadPoolExecutor(16) as pool:
            assert list(pool.map(one, range(16))) == [200] * 16
        split = sorted(len(w.records.reserve_waits) for w in stack.role("decode"))
        assert sum(split) == 16 and split[0] >= 6, split
        assert [c.inflight for c in stack.state.registry.clients] == [0, 0, 0]  # counts end too
    finally:
        stack.stop()


def test_the_internal_token_goes_with_every_worker_call(tokenizer_dir: str) -> None:
    stack = Stack(tokenizer_dir, ["prefill", "decode"], internal_token="tok-123").start()
    try:
        r = httpx.post(f"{stack.base_url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 3})
        assert r.status_code == 200
        # real calls (a multiplexed Decode's item metadata travels inside its stream)
        calls = [md for w in stack.workers for md in w.records.metadata if "user-agent" in md]
        assert len(calls) == 2  # Reserve, Prefill
        assert all(md.get("x-tandem-internal-token") == "tok-123" for md in calls), calls
    finally:
        stack.stop()


def test_short_prompts_are_prefilled_by_the_decode_worker_under_conditional_disaggregation(
    tokenizer_dir: str,
) -> None:
    """--max-local-prefill-tokens N: a prompt of at most N tokens skips the prefill worker and
    the KV transfer (the decode worker it was admitted to prefills it); longer ones do not."""
    stack = Stack(tokenizer_dir, ["prefill", "decode"], max_local_prefill_tokens=16).start()
    try:
        prefill, decode = stack.role("prefill")[0], stack.role("decode")[0]
        short = httpx.post(f"{stack.base_url}/v1/completions",
                           json={"prompt": PROMPT, "max_tokens": 3})  # fmt: skip
        assert short.status_code == 200 and short.json()["choices"][0]["text"] == "Hello world,"
        timing = dict(kv.split("=") for kv in short.headers["x-tandem-timing"].split(";"))
        assert timing["mode"] == "local" and float(timing["transfer"]) == 0.0
        assert not prefill.records.requests and len(decode.records.local_prefills) == 1
        assert decode.records.reserve_waits  # still admitted through a reservation
        counted = [
            line for line in httpx.get(f"{stack.base_url}/metrics").text.splitlines()
            if line.startswith("tandem:request_prefill_mode_total{") and 'mode="local"' in line
        ]  # fmt: skip
        assert len(counted) == 1 and counted[0].endswith(" 1.0")
        long_prompt = PROMPT + " and a much longer prompt that takes more than sixteen tokens"
        r = httpx.post(f"{stack.base_url}/v1/completions",
                       json={"prompt": long_prompt, "max_tokens": 3, "stream": True})  # fmt: skip
        assert r.status_code == 200
        assert len(prefill.records.requests) == 1 and len(decode.records.local_prefills) == 1
        assert wait_for(lambda: not decode.records.reservations)
    finally:
        stack.stop()


def test_max_local_prefill_tokens_must_not_be_negative() -> None:
    from gateway.core.config import GatewayConfig
    from services.config import ConfigError

    with pytest.raises(ConfigError, match="--max-local-prefill-tokens"):
        GatewayConfig(tokenizer="t", max_local_prefill_tokens=-1)


def test_a_lora_request_goes_only_to_workers_serving_its_adapter(disagg: Stack) -> None:
    serving, other = disagg.role("prefill")
    serving.behavior.lora_names = ("sql",)
    disagg.role("decode")[0].behavior.lora_names = ("sql",)
    disagg.run(disagg.state.registry.poll_all())
    for i in range(4):  # prefix affinity would spread these prompts over both prefill workers
        body = {"model": "sql", "prompt": f"{i} {PROMPT}", "max_tokens": 2}
        r = httpx.post(f"{disagg.base_url}/v1/completions", json=body)
        assert r.status_code == 200 and r.json()["model"] == "sql", r.text
    assert [s.lora_name for s in serving.records.samplings] == ["sql"] * 4
    assert not other.records.requests
    models = httpx.get(f"{disagg.base_url}/v1/models").json()["data"]
    assert [(m["id"], m.get("parent")) for m in models][1:] == [("sql", models[0]["id"])]
    r = httpx.post(f"{disagg.base_url}/v1/completions", json={"model": "sq1", "prompt": "x"})
    assert r.status_code == 404 and "`sql`" in r.json()["error"]["message"]
    disagg.role("decode")[0].behavior.lora_names = ()  # no decode worker has it any more
    disagg.run(disagg.state.registry.poll_all())
    r = httpx.post(f"{disagg.base_url}/v1/completions", json={"model": "sql", "prompt": "x"})
    assert r.status_code == 503 and "serves the LoRA adapter 'sql'" in r.text, r.text


def _stopped_while_queued(stack: Stack, decode: FakeWorker) -> httpx.Response:
    """A 3-token completion's reply when ``decode``, in whose admission queue the request
    waits, stops before the request had a token."""
    body = {"prompt": PROMPT, "max_tokens": 3}
    with ThreadPoolExecutor(1) as pool:
        reply = pool.submit(httpx.post, f"{stack.base_url}/v1/completions", json=body,
                            timeout=30)  # fmt: skip
        assert wait_for(lambda: any(w > 1.0 for w in decode.records.reserve_waits))
        stack.run(decode.stop())
        return reply.result(30)


def test_a_decode_worker_gone_before_the_first_token_hands_the_request_to_another(
    tokenizer_dir: str,
) -> None:
    """No decode worker has room, so the request waits in one's admission queue; that worker
    dies before the request had a token. Nothing reached the client yet, so it is retried with
    the other decode worker and completes (it used to end in 503 "Reserve ... unavailable")."""
    stack = Stack(tokenizer_dir, ["prefill", "decode", "decode"]).start()
    try:
        doomed, other = stack.role("decode")
        doomed.behavior.full_for_s = 60.0  # full: a Reserve that may wait waits here
        other.behavior.full_for_s = 0.3  # full now, room for one that waits 0.3 s
        other.behavior.num_waiting = 5  # the longer queue: the request waits with ``doomed``
        clients = {c.address: c for c in stack.state.registry.clients}
        assert wait_for(lambda: clients[other.address].queue_depth == 5)
        r = _stopped_while_queued(stack, doomed)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == "Hello world,"
        assert [rid for rid in other.records.decode_calls if rid.endswith("-retry1")]
        assert not doomed.records.decode_calls
    finally:
        stack.stop()


def test_with_no_other_decode_worker_the_request_fails_clearly(tokenizer_dir: str) -> None:
    """The same death with one decode worker: nothing to retry on, one clear 503."""
    stack = Stack(tokenizer_dir, ["prefill", "decode"]).start()
    try:
        (decode,) = stack.role("decode")
        decode.behavior.full_for_s = 60.0
        r = _stopped_while_queued(stack, decode)
        assert r.status_code == 503
        assert r.json()["error"]["code"] == "worker_unavailable", r.text
    finally:
        stack.stop()


def test_a_decode_worker_gone_while_the_prompt_is_in_prefill_hands_it_to_another(
    tokenizer_dir: str,
) -> None:
    """The decode worker holding the reservation dies while the prompt is in prefill, before its
    first token: the prefill is aborted and the request runs again with the other decode worker."""
    stack = Stack(tokenizer_dir, ["prefill", "decode", "decode"]).start()
    try:
        (prefill,) = stack.role("prefill")
        prefill.behavior.first_delay_s = 60.0
        body = {"prompt": PROMPT, "max_tokens": 3}
        with ThreadPoolExecutor(1) as pool:
            reply = pool.submit(httpx.post, f"{stack.base_url}/v1/completions", json=body,
                                timeout=30)  # fmt: skip
            assert wait_for(lambda: bool(prefill.records.requests))
            doomed = next(d for d in stack.role("decode") if d.records.reservations)
            stack.run(doomed.stop())
            prefill.behavior.first_delay_s = 0.0  # the retry's prefill answers at once
            r = reply.result(30)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == "Hello world,"
        other = next(d for d in stack.role("decode") if d is not doomed)
        assert [rid for rid in other.records.decode_calls if rid.endswith("-retry1")]
        assert wait_for(lambda: prefill.records.requests[0] in prefill.records.aborts)
    finally:
        stack.stop()


@pytest.mark.parametrize("stream", [True, False])
def test_a_decode_worker_dying_mid_stream_hands_the_stream_to_another(
    tokenizer_dir: str, stream: bool
) -> None:
    """The decode worker streaming a request dies after 3 of its 8 tokens reached the client:
    the request resumes on the other decode worker (its prompt and those 3 tokens prefilled
    there) and the client gets the whole text in one stream, no error frame."""
    stack = Stack(tokenizer_dir, ["prefill", "decode", "decode"]).start()
    try:
        doomed, other = stack.role("decode")
        other.behavior.num_waiting = 5  # the longer queue: the request goes to ``doomed``
        clients = {c.address: c for c in stack.state.registry.clients}
        assert wait_for(lambda: clients[other.address].queue_depth == 5)
        body = {"prompt": PROMPT, "max_tokens": 8, "stream": stream}
        url = f"{stack.base_url}/v1/completions"
        whole = httpx.post(url, json={**body, "stream": False}).json()["choices"][0]["text"]
        doomed.behavior.fail_after_tokens = 3  # the first token came from prefill
        if stream:
            with httpx.stream("POST", url, json=body) as r:
                frames = list(sse_lines(r))
            assert frames[-1] == "[DONE]"
            chunks = [json.loads(f) for f in frames[:-1]]
            assert not [c for c in chunks if "error" in c]
            text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
            assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        else:
            r = httpx.post(url, json=body)
            assert r.status_code == 200, r.text
            text = r.json()["choices"][0]["text"]
            assert r.json()["usage"]["completion_tokens"] == 8
        assert text == whole and len(whole) > len("Hello world,")
        resumed = [rid for rid in other.records.local_prefills if rid.endswith("-retry1")]
        assert len(resumed) == 1
        assert wait_for(lambda: not doomed.records.reservations)
        metrics = httpx.get(f"{stack.base_url}/metrics").text
        assert "tandem:request_prefill_mode_total{" in metrics and 'reason="resumed"' in metrics
    finally:
        stack.stop()


def test_without_another_decode_worker_a_mid_stream_death_is_an_error_frame(
    disagg: Stack,
) -> None:
    """One decode worker: nothing to resume on, the stream ends with an error frame (as before)."""
    disagg.role("decode")[0].behavior.fail_after_tokens = 3
    body = {"prompt": PROMPT, "max_tokens": 8, "stream": True}
    with httpx.stream("POST", f"{disagg.base_url}/v1/completions", json=body) as r:
        frames = list(sse_lines(r))
    assert frames[-1] == "[DONE]" and "error" in json.loads(frames[-2])


def test_blocks_are_granted_for_a_prefill_worker_that_ships_whole_kv(tokenizer_dir: str) -> None:
    """The gateway asks the decode worker to grant its blocks with the reservation only for a
    prefill worker that ships the whole KV (--kv-streaming off: it reports kv_whole), and passes
    the grant on in the Prefill call's target; a streaming one is asked nothing."""
    stack = Stack(tokenizer_dir, ["prefill", "decode"]).start()
    try:
        prefill, decode = stack.role("prefill")[0], stack.role("decode")[0]
        r = httpx.post(f"{stack.base_url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
        assert r.status_code == 200
        assert decode.records.reserve_grants == [False] and prefill.records.kv_grants == [""]
        prefill.behavior.kv_whole = True
        stack.run(stack.state.registry.poll_all())
        r = httpx.post(f"{stack.base_url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
        assert r.status_code == 200
        assert decode.records.reserve_grants == [False, True]
        rid = prefill.records.requests[1]  # the second request's grant reached its prefill
        assert prefill.records.kv_grants[1] == f'{{"fake-grant": "res-{rid}"}}'
    finally:
        stack.stop()
