"""Conditional disaggregation: a short prompt, or one that comes while every prefill worker is
busy, is prefilled by the decode worker; the choice and its reason show in the timing and the
metrics."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.workers.prefill_choice import DECODE_LOAD, QUEUE, SHORT, local_prefill_reason
from tests.gateway.stack import Stack, wait_for

pytestmark = pytest.mark.timeout(60)
SHORT_PROMPT = "Hello world, this is a test of the gateway"  # 10 tokens
LONG_PROMPT = SHORT_PROMPT + " and a much longer prompt that takes more than sixteen tokens"


@dataclass
class Prefill:
    queue_depth: int


@pytest.mark.parametrize(
    "prompt_len, depths, max_tokens, min_queue, reason",
    [
        (16, [0], 16, 0, SHORT),
        (17, [0], 16, 0, None),
        (17, [5, 5], 16, 0, None),  # the queue rule is off
        (17, [2, 3], 16, 2, QUEUE),  # every worker at the threshold or past it
        (17, [2, 1], 16, 2, None),  # one worker has room
        (17, [], 16, 2, None),  # no prefill worker at all: not a queue to avoid
        (4, [9, 9], 16, 2, SHORT),  # both rules hold: the prompt's length says it first
        (1, [0], 0, 0, None),  # both off: always disaggregate
    ],
)
def test_the_rules(
    prompt_len: int, depths: list[int], max_tokens: int, min_queue: int, reason: str | None
) -> None:
    prefills = [Prefill(d) for d in depths]
    assert local_prefill_reason(prompt_len, prefills, max_tokens, min_queue) == reason


@dataclass
class Decode:
    inflight: int  # this gateway's, the request being placed included
    reported_depth: int = 0  # every gateway's running or waiting, at the last poll


@pytest.mark.parametrize(
    "decode, min_load, depths, reason",
    [
        (Decode(1), 1, [0], None),  # only this request on it: idle otherwise
        (Decode(2), 1, [0], DECODE_LOAD),  # one other request of this gateway
        (Decode(1, 1), 1, [0], DECODE_LOAD),  # one of another gateway, as reported
        (Decode(3, 2), 3, [0], None),  # two others, the threshold is three
        (Decode(9), 0, [0], None),  # the rule is off
        (Decode(5), 1, [4], QUEUE),  # the prefill queue says it first
    ],
)
def test_the_decode_load_rule(
    decode: Decode, min_load: int, depths: list[int], reason: str | None
) -> None:
    prefills = [Prefill(d) for d in depths]
    assert local_prefill_reason(100, prefills, 16, 4, decode, min_load) == reason
    assert local_prefill_reason(100, prefills, 16, 4, None, min_load) == (
        QUEUE if reason == QUEUE else None
    )


def complete(stack: Stack, prompt: str) -> tuple[str, dict[str, str]]:
    r = httpx.post(f"{stack.base_url}/v1/completions", json={"prompt": prompt, "max_tokens": 3})
    assert r.status_code == 200, r.text
    timing = dict(kv.split("=") for kv in r.headers["x-tandem-timing"].split(";"))
    return r.json()["choices"][0]["text"], timing


def mode_counts(stack: Stack) -> dict[tuple[str, str], float]:
    text = httpx.get(f"{stack.base_url}/metrics").text
    return {
        (s.labels["mode"], s.labels["reason"]): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "tandem:request_prefill_mode_total"
    }


def test_short_or_queued_prompts_are_prefilled_locally_and_say_why(tokenizer_dir: str) -> None:
    """Two prefill workers; their load as polled. Local for a short prompt, or while both are at
    --local-prefill-queue; a long prompt goes to a prefill worker while one of them has room."""
    stack = Stack(tokenizer_dir, ["prefill", "prefill", "decode"],
                  max_local_prefill_tokens=16, local_prefill_queue=2).start()  # fmt: skip
    try:
        prefills, decode = stack.role("prefill"), stack.role("decode")[0]

        def sent_to_prefill() -> int:
            return sum(len(p.records.requests) for p in prefills)

        def report_waiting(*waiting: int) -> None:
            for p, n in zip(prefills, waiting, strict=True):
                p.behavior.num_waiting = n
            stack.run(stack.state.registry.poll_all())

        _, timing = complete(stack, SHORT_PROMPT)
        assert (timing["mode"], timing["local_reason"]) == ("local", "short")
        disagg_text, timing = complete(stack, LONG_PROMPT)
        assert timing["mode"] == "disagg" and "local_reason" not in timing
        report_waiting(2, 0)
        assert complete(stack, LONG_PROMPT)[1]["mode"] == "disagg"
        assert sent_to_prefill() == 2
        report_waiting(2, 3)
        text, timing = complete(stack, LONG_PROMPT)
        assert (timing["mode"], timing["local_reason"]) == ("local", "queue")
        assert float(timing["transfer"]) == 0.0
        assert text == disagg_text  # the same tokens, whoever prefilled them
        assert sent_to_prefill() == 2 and len(decode.records.local_prefills) == 2
        assert mode_counts(stack) == {
            ("local", "short"): 1.0, ("disagg", ""): 2.0, ("local", "queue"): 1.0
        }  # fmt: skip
        assert wait_for(lambda: not decode.records.reservations)
    finally:
        stack.stop()


def test_requests_open_on_the_prefill_worker_count_before_its_load_says_so(
    tokenizer_dir: str,
) -> None:
    """The gateway counts its own prefills in flight: a burst finds the worker busy at once,
    while its polled load (0 waiting here, always) still says idle."""
    stack = Stack(tokenizer_dir, ["prefill", "decode"], local_prefill_queue=1).start()
    try:
        prefill = stack.role("prefill")[0]
        prefill.behavior.first_delay_s = 0.5
        with ThreadPoolExecutor(1) as pool:
            slow = pool.submit(complete, stack, LONG_PROMPT)
            assert wait_for(lambda: bool(prefill.records.requests))
            text, timing = complete(stack, LONG_PROMPT)
            first_text, first_timing = slow.result()
        assert (timing["mode"], timing["local_reason"]) == ("local", "queue")
        assert first_timing["mode"] == "disagg" and first_text == text
        assert len(prefill.records.requests) == 1
    finally:
        stack.stop()


def test_a_busy_decode_worker_prefills_the_next_prompt_itself(tokenizer_dir: str) -> None:
    """--local-prefill-decode-load 1: while a request decodes on the decode worker (its load as
    this gateway counts it), the next long prompt is prefilled there too; alone, a prompt goes
    to the prefill worker."""
    stack = Stack(tokenizer_dir, ["prefill", "decode"], local_prefill_decode_load=1).start()
    try:
        prefill, decode = stack.role("prefill")[0], stack.role("decode")[0]
        text, timing = complete(stack, LONG_PROMPT)
        assert timing["mode"] == "disagg" and len(prefill.records.requests) == 1
        decode.behavior.num_waiting = 1  # another gateway's request is queued there
        stack.run(stack.state.registry.poll_all())
        local_text, timing = complete(stack, LONG_PROMPT)
        assert (timing["mode"], timing["local_reason"]) == ("local", "decode_load")
        assert local_text == text and len(prefill.records.requests) == 1
        assert mode_counts(stack)[("local", "decode_load")] == 1.0
    finally:
        stack.stop()
