"""Stop strings through the gateway against REAL workers (the embedded model on the CPU), in both
topologies: a stop string that begins in the first token (which a disaggregated request gets from
its prefill worker) ends the text where the colocated worker ends it, and a streamed completion's
logprobs count ``text_offset`` as the whole response does while the workers hold text back for a
stop string."""

from __future__ import annotations

import concurrent.futures
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.gateway.test_e2e_real import both_topologies
from tests.services.procs import Fleet, Proc, fleet

__all__ = ["fleet"]
pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct"
PROMPTS = ["The capital of France is", "My favourite colour is", "Once upon a time, there"]


@pytest.fixture(scope="module")
def gateways(fleet: Fleet) -> Iterator[dict[str, Proc]]:
    yield from both_topologies(fleet)


@pytest.fixture(scope="module")
def pool() -> Iterator[concurrent.futures.ThreadPoolExecutor]:
    """Room for every request of a test at once: sent together, the workers batch them (one
    request after another, the module took about three times as long)."""
    with concurrent.futures.ThreadPoolExecutor(32) as executor:
        yield executor


@pytest.fixture(scope="module")
def plain(
    gateways: dict[str, Proc], pool: concurrent.futures.ThreadPoolExecutor
) -> dict[tuple[str, str], dict[str, Any]]:
    """Each topology's greedy choice for each prompt, without a stop string (with its first
    token's logprobs), asked once for the module and all at once."""
    calls = {(topology, prompt): pool.submit(complete, gateway, prompt, logprobs=0)
             for topology, gateway in gateways.items() for prompt in PROMPTS}  # fmt: skip
    return {key: call.result() for key, call in calls.items()}


def complete(gateway: Proc, prompt: str, **kw: Any) -> dict[str, Any]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 16, "temperature": 0, **kw}
    r = httpx.post(f"{gateway.url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    choice: dict[str, Any] = r.json()["choices"][0]
    return choice


def streamed(gateway: Proc, prompt: str, **kw: Any) -> dict[str, Any]:
    """The stream's choice put together: text, finish and stop reasons, its logprobs' lists."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 16, "temperature": 0, "stream": True,
            **kw}  # fmt: skip
    text, finish, stop_reason, lists = "", None, None, {"tokens": [], "text_offset": []}
    with httpx.stream("POST", f"{gateway.url}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[6:]).get("choices", []):
                text += choice["text"]
                finish = choice["finish_reason"] or finish
                stop_reason = choice["stop_reason"] if finish else stop_reason
                for key in lists:
                    lists[key] += (choice.get("logprobs") or {}).get(key, [])
    return {"text": text, "finish_reason": finish, "stop_reason": stop_reason, "logprobs": lists}


def test_a_stop_string_that_begins_in_the_first_token_ends_the_text_in_both_topologies(
    gateways: dict[str, Proc],
    plain: dict[tuple[str, str], dict[str, Any]],
    pool: concurrent.futures.ThreadPoolExecutor,
) -> None:
    stops = {}
    for prompt in PROMPTS:
        text = plain["colocated", prompt]["text"]
        first = plain["colocated", prompt]["logprobs"]["tokens"][0]
        cut = len(first) - 1  # the first token's last character and the two after it
        stop = text[cut : cut + 3]
        if cut >= 0 and len(stop) == 3 and text.find(stop) == cut:
            stops[prompt] = (stop, cut)
    assert len(stops) >= 2, "too few prompts whose text allows such a stop string"
    calls = {
        (prompt, topology, fn.__name__): pool.submit(fn, gateway, prompt, stop=[stop])
        for prompt, (stop, _) in stops.items()
        for topology, gateway in gateways.items()
        for fn in (complete, streamed)
    }  # every prompt, topology and form at once (batched by the engines)
    for (prompt, topology, _), call in calls.items():
        got, (stop, cut) = call.result(), stops[prompt]
        text = plain["colocated", prompt]["text"]
        assert got["text"] == text[:cut], (topology, stop, text)
        assert (got["finish_reason"], got["stop_reason"]) == ("stop", stop), topology


@pytest.mark.parametrize("topology", ["disagg", "colocated"])
def test_streamed_text_offsets_equal_the_whole_responses_under_a_stop_string(
    gateways: dict[str, Proc],
    plain: dict[tuple[str, str], dict[str, Any]],
    pool: concurrent.futures.ThreadPoolExecutor,
    topology: str,
) -> None:
    gateway = gateways[topology]
    stops = {}
    for prompt in PROMPTS:
        text = plain[topology, prompt]["text"]
        # a stop string first found late in the text: most tokens come before it
        late = [k for k in range(len(text) // 2, len(text) - 3) if text.find(text[k : k + 3]) == k]
        if late:
            stops[prompt] = text[late[0] : late[0] + 3]
    assert len(stops) >= 2, "too few prompts whose text allows such a stop string"
    calls = {
        prompt: (pool.submit(complete, gateway, prompt, logprobs=1, stop=[stop]),
                 pool.submit(streamed, gateway, prompt, logprobs=1, stop=[stop]))
        for prompt, stop in stops.items()
    }  # fmt: skip
    for prompt, (whole_call, streamed_call) in calls.items():
        whole, got = whole_call.result(), streamed_call.result()
        assert got["text"] == whole["text"]
        assert got["logprobs"]["tokens"] == whole["logprobs"]["tokens"]
        assert got["logprobs"]["text_offset"] == whole["logprobs"]["text_offset"], prompt
        offsets = whole["logprobs"]["text_offset"]
        assert offsets == sorted(offsets) and len(offsets) > 2 and offsets[-1] > 0


def test_min_tokens_holds_back_stop_strings_in_both_topologies(
    gateways: dict[str, Proc],
    plain: dict[tuple[str, str], dict[str, Any]],
    pool: concurrent.futures.ThreadPoolExecutor,
) -> None:
    """vLLM's min_tokens: a stop string met in the first min_tokens tokens (here one the first
    token holds, which a disaggregated request gets from its prefill worker) does not end the
    output; the same greedy text goes on past it."""
    m = 6
    stops = {prompt: plain["colocated", prompt]["logprobs"]["tokens"][0].strip()
             for prompt in PROMPTS}  # fmt: skip
    stops = {prompt: stop for prompt, stop in stops.items() if stop}
    assert len(stops) >= 2, "too few prompts whose first token holds a stop string"
    # every prompt's and topology's four requests at once (batched by the engines)
    calls = {
        (prompt, topology, kind): pool.submit(fn, gateway, prompt, **kw)
        for prompt, stop in stops.items()
        for topology, gateway in gateways.items()
        for kind, fn, kw in (
            ("cut", complete, {"stop": [stop], "logprobs": 0}),
            # the same greedy text without the stop string (min_tokens holds back EOS too)
            ("free", complete, {"min_tokens": m}),
            ("whole", complete, {"stop": [stop], "min_tokens": m, "logprobs": 0}),
            ("stream", streamed, {"stop": [stop], "min_tokens": m, "logprobs": 0}),
        )
    }
    for prompt, stop in stops.items():
        for topology in gateways:
            cut = calls[prompt, topology, "cut"].result()
            assert len(cut["logprobs"]["tokens"]) == 1 and cut["finish_reason"] == "stop"
            free = calls[prompt, topology, "free"].result()["text"]
            for kind in ("whole", "stream"):
                got = calls[prompt, topology, kind].result()
                assert len(got["logprobs"]["tokens"]) >= m, (topology, stop, got)
                assert free.startswith(got["text"]), (topology, stop, got["text"], free)
