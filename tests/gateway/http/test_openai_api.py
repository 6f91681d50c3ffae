"""The official openai client against the gateway (fake workers echo the prompt's tokens)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest

from tests.gateway.stack import Stack

pytestmark = pytest.mark.timeout(60)
PROMPT = "Hello world, this is a test of the gateway"  # 10 tokens; the fakes echo them


def client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0)


def test_completion_echoes_prompt_tokens(disagg: Stack) -> None:
    out = client(disagg).completions.create(model="embedded", prompt=PROMPT, max_tokens=4)
    assert out.object == "text_completion" and out.id.startswith("cmpl-")
    assert out.choices[0].text == "Hello world, this"
    assert out.choices[0].finish_reason == "length"
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) == (
        10,
        4,
        14,
    )


def test_default_max_tokens_is_16_for_completions(colocated: Stack) -> None:
    out = client(colocated).completions.create(model="embedded", prompt=PROMPT * 3)
    assert out.usage.completion_tokens == 16


def test_chat_default_max_tokens_is_the_context_left(colocated: Stack) -> None:
    colocated.workers[0].behavior.max_model_len = 40
    colocated.run(colocated.state.registry.poll_all())
    chat = client(colocated).chat.completions.create(
        model="embedded", messages=[{"role": "user", "content": "hi"}]
    )
    assert colocated.workers[0].records.samplings[-1].max_tokens == 40 - 31
    assert chat.choices[0].message.role == "assistant"


def test_chat_stops_on_eos_and_counts_usage(disagg: Stack) -> None:
    out = client(disagg).chat.completions.create(
        model="embedded", messages=[{"role": "user", "content": "hi"}], max_completion_tokens=100
    )
    # the echoed chat prompt holds <|im_end|> (EOS) at position 20: the fake stops there
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].message.content.startswith("system\nYou are a helpful AI assistant")
    assert out.usage.prompt_tokens == 31 and out.usage.completion_tokens == 20


def test_streaming_completion_with_usage(disagg: Stack) -> None:
    stream = client(disagg).completions.create(
        model="embedded", prompt=PROMPT, max_tokens=5, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == "Hello world, this is"
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5


@pytest.mark.parametrize("cached", [0, 16])
def test_usage_always_reports_cached_prompt_tokens(colocated: Stack, cached: int) -> None:
    """prompt_tokens_details.cached_tokens is there even when nothing hit the prefix cache
    (OpenAI's and vLLM's usage): benchmark clients (aiperf) read an absent key as a server that
    does not report its prefix cache, and leave the misses out of their cache-hit averages."""
    colocated.workers[0].behavior.cached_tokens = cached
    whole = client(colocated).completions.create(model="embedded", prompt=PROMPT, max_tokens=2)
    stream = client(colocated).chat.completions.create(
        model="embedded", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
        stream=True, stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(stream)
    for usage in (whole.usage, chunks[-1].usage):
        assert usage is not None and usage.prompt_tokens_details is not None
        assert usage.prompt_tokens_details.cached_tokens == cached


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_continuous_usage_counts_every_chunk(disagg: Stack, endpoint: str) -> None:
    # vLLM's continuous_usage_stats (guidellm sends it): the usage so far in every chunk
    options = {"include_usage": True, "continuous_usage_stats": True}
    if endpoint == "chat":
        stream: Any = client(disagg).chat.completions.create(
            model="embedded", messages=[{"role": "user", "content": "hi"}], max_tokens=5,
            stream=True, stream_options=options,
        )  # fmt: skip
    else:
        stream = client(disagg).completions.create(
            model="embedded", prompt=PROMPT, max_tokens=5, stream=True, stream_options=options
        )
    chunks = list(stream)
    assert all(c.usage is not None for c in chunks)
    counts = [c.usage.completion_tokens for c in chunks]
    assert counts == sorted(counts) and counts[-1] == 5 and counts[0] < 5
    assert {c.usage.prompt_tokens for c in chunks} == {31 if endpoint == "chat" else 10}


@pytest.mark.parametrize("include_usage", [False, None])
def test_continuous_usage_without_include_usage_gives_no_usage(
    disagg: Stack, include_usage: bool | None
) -> None:
    """As vLLM: continuous_usage_stats counts only beside include_usage."""
    options: dict[str, Any] = {"continuous_usage_stats": True}
    if include_usage is not None:
        options["include_usage"] = include_usage
    chunks = list(client(disagg).completions.create(
        model="embedded", prompt=PROMPT, max_tokens=3, stream=True, stream_options=options
    ))  # fmt: skip
    assert chunks and all(c.usage is None for c in chunks)
    assert all(c.choices for c in chunks)  # no usage-only chunk at the end either


def test_an_unknown_stream_option_is_a_400(disagg: Stack) -> None:
    body = {"prompt": PROMPT, "stream": True, "stream_options": {"include_usag": True}}
    r = httpx.post(f"{disagg.base_url}/v1/completions", json=body)
    assert r.status_code == 400 and "stream_options.include_usag" in r.json()["error"]["message"]


def test_streaming_chat_role_first_then_content(colocated: Stack) -> None:
    stream = client(colocated).chat.completions.create(
        model="embedded", messages=[{"role": "user", "content": "hi"}], max_tokens=6, stream=True
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "system\nYou are a"
    assert chunks[-1].choices[0].finish_reason == "length"


async def test_async_client_n2_with_seed(disagg: Stack) -> None:
    async with openai.AsyncOpenAI(
        base_url=f"{disagg.base_url}/v1", api_key="x", max_retries=0
    ) as c:
        out = await c.completions.create(model="embedded", prompt=PROMPT, max_tokens=3, n=2, seed=7)
    assert sorted(ch.index for ch in out.choices) == [0, 1]
    assert all(ch.text == "Hello world," for ch in out.choices)
    assert out.usage.prompt_tokens == 10 and out.usage.completion_tokens == 6
    seeds = sorted(s.seed for w in disagg.role("prefill") for s in w.records.samplings)
    assert seeds == [7, 8]


async def test_async_streaming_chat_n2_merges_choices(colocated: Stack) -> None:
    async with openai.AsyncOpenAI(
        base_url=f"{colocated.base_url}/v1", api_key="x", max_retries=0
    ) as c:
        stream = await c.chat.completions.create(
            model="embedded", messages=[{"role": "user", "content": "hi"}], max_tokens=4, n=2,
            stream=True, seed=1,
        )  # fmt: skip
        texts: dict[int, str] = {0: "", 1: ""}
        async for chunk in stream:
            for ch in chunk.choices:
                texts[ch.index] += ch.delta.content or ""
    assert texts == {0: "system\nYou", 1: "system\nYou"}
    assert sorted(s.seed for s in colocated.workers[0].records.samplings) == [1, 2]


def test_stop_strings_reach_the_worker_and_end_the_choice(colocated: Stack) -> None:
    out = client(colocated).completions.create(
        model="embedded", prompt=PROMPT, max_tokens=10, stop=[" test"]
    )
    assert out.choices[0].text == "Hello world, this is a"
    assert out.choices[0].finish_reason == "stop"
    assert list(colocated.workers[0].records.samplings[-1].stop) == [" test"]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("endpoint", ["completions", "chat/completions"])
def test_stop_reason_names_what_ended_the_choice(
    disagg: Stack, endpoint: str, stream: bool
) -> None:
    """vLLM's stop_reason beside finish_reason: a stop string (digits stay a string), a stop
    token id (an int), null for the end-of-sequence token and for a length cut; in a stream
    null on every chunk but the one that finishes."""
    ids = [9690, 28, 216, 33, 34, 35, 198, 2]
    digits = "012"

    def body(**fields: Any) -> dict[str, Any]:
        if endpoint == "chat/completions":
            fields["messages"] = [{"role": "user", "content": "hi"}]
        else:
            fields.setdefault("prompt", ids)
        return {"max_tokens": 40, "stream": stream, **fields}

    def finished(fields: dict[str, Any]) -> tuple[str, Any]:
        r = httpx.post(f"{disagg.base_url}/v1/{endpoint}", json=fields, timeout=30)
        assert r.status_code == 200, r.text
        if not stream:
            choice = r.json()["choices"][0]
            return choice["finish_reason"], choice["stop_reason"]
        frames = [json.loads(line[6:]) for line in r.text.splitlines()
                  if line.startswith("data: {")]  # fmt: skip
        choices = [c for f in frames for c in f["choices"]]
        assert all(c["stop_reason"] is None for c in choices[:-1])
        return choices[-1]["finish_reason"], choices[-1]["stop_reason"]

    chat = endpoint == "chat/completions"
    if not chat:  # a prompt of token ids, echoed: 35 at position 5, EOS (2) last
        assert finished(body(stop_token_ids=[35])) == ("stop", 35)
        assert finished(body()) == ("stop", None)
        assert finished(body(prompt="abc " + digits + " def", stop=[digits])) == ("stop", digits)
    else:  # the chat prompt echoed: "system\nYou are ..." and EOS at position 20
        assert finished(body(stop=["You"])) == ("stop", "You")
        assert finished(body()) == ("stop", None)
    assert finished(body(max_tokens=2)) == ("length", None)


def test_completion_echo_with_logprobs_scores_the_prompt(colocated: Stack) -> None:
    """echo + logprobs (lm-eval's loglikelihood): the prompt's tokens come first with their
    logprobs (the first has none), then the generated ones; max_tokens 0 scores the prompt only."""
    out = client(colocated).completions.create(
        model="embedded", prompt="Hello world", max_tokens=2, logprobs=2, echo=True
    )
    lp = out.choices[0].logprobs
    assert out.choices[0].text.startswith("Hello world")
    assert lp.tokens[:2] == ["Hello", " world"] and lp.token_logprobs[:2] == [None, -0.25]
    # the two most likely and, as OpenAI and vLLM always add it, the prompt's own token
    assert lp.top_logprobs[0] is None and len(lp.top_logprobs[1]) == 3
    assert lp.top_logprobs[1][" world"] == -0.25
    assert all(lp.tokens[i] in lp.top_logprobs[i] for i in range(1, 4))
    assert len(lp.tokens) == 4 and lp.token_logprobs[2:] == [-0.5, -0.5]
    assert colocated.workers[0].records.samplings[-1].prompt_logprobs == 2
    scored = client(colocated).completions.create(
        model="embedded", prompt="Hello world", max_tokens=0, logprobs=1, echo=True
    )
    choice = scored.choices[0]
    assert choice.text == "Hello world" and choice.finish_reason == "length"
    assert choice.logprobs.token_logprobs == [None, -0.25]
    assert scored.usage.completion_tokens == 0
    # a prompt as long as the context cannot be scored (one token is sampled beside it): a 400
    # that says so, not "you requested 2049 tokens (... 1 in the completion)" for max_tokens 0
    with pytest.raises(openai.BadRequestError, match="max_tokens 0 may have at most 2047"):
        client(colocated).completions.create(
            model="embedded", prompt=[5] * 2048, max_tokens=0, echo=True
        )
    longest = client(colocated).completions.create(
        model="embedded", prompt=[5] * 2047, max_tokens=0, echo=True
    )
    assert longest.usage.prompt_tokens == 2047 and longest.usage.completion_tokens == 0
    out = client(colocated).completions.create(  # logprobs alone: the generated tokens only
        model="embedded", prompt="Hello world", max_tokens=2, logprobs=2
    )
    lp = out.choices[0].logprobs
    assert lp.tokens == ["Hello", " world"] and lp.token_logprobs == [-0.5, -0.5]
    assert lp.text_offset == [0, 5] and len(lp.top_logprobs[0]) == 2


def test_prompt_logprobs_in_vllms_form(disagg: Stack) -> None:
    out = client(disagg).completions.create(
        model="embedded", prompt="Hello world", max_tokens=1, extra_body={"prompt_logprobs": 1}
    )
    scores = out.choices[0].model_extra["prompt_logprobs"]
    world = str(disagg.state.tokenizer.encode("Hello world", False)[1])
    assert scores[0] is None and scores[1][world] == {"logprob": -0.25, "rank": 2,
                                                      "decoded_token": " world"}  # fmt: skip
    assert len(scores[1]) == 2  # the prompt's token and one alternative
    chat = client(disagg).chat.completions.create(
        model="embedded", messages=[{"role": "user", "content": "hi"}], max_tokens=1,
        extra_body={"prompt_logprobs": 0},
    )  # fmt: skip
    scores = chat.model_extra["prompt_logprobs"]
    assert scores[0] is None and all(len(s) == 1 for s in scores[1:])
    with httpx.stream("POST", f"{disagg.base_url}/v1/completions", json={
        "prompt": "Hello world", "max_tokens": 2, "stream": True, "prompt_logprobs": 1,
    }) as r:  # fmt: skip
        frames = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    firsts = [
        f["choices"][0]["prompt_logprobs"] for f in frames if "prompt_logprobs" in f["choices"][0]
    ]
    assert len(firsts) == 1 and firsts[0][1][world]["logprob"] == -0.25


@pytest.mark.parametrize("stream", [False, True])
def test_echo_logprobs_and_prompt_logprobs_each_show_what_they_ask(
    disagg: Stack, stream: bool
) -> None:
    """Completions with echo, logprobs and prompt_logprobs: the workers compute the prompt's
    alternatives for the larger of the two, and each field shows its own count (it showed the
    larger in both): logprobs N gives an echoed prompt token N alternatives beside its own,
    prompt_logprobs M gives M, as vLLM answers."""
    for logprobs, prompt_logprobs in ((3, 1), (1, 4)):
        body = {"prompt": "Hello big world", "max_tokens": 1, "echo": True, "stream": stream,
                "logprobs": logprobs, "prompt_logprobs": prompt_logprobs}  # fmt: skip
        if stream:
            with httpx.stream("POST", f"{disagg.base_url}/v1/completions", json=body) as r:
                frames = [json.loads(line[6:]) for line in r.iter_lines()
                          if line.startswith("data: {")]  # fmt: skip
            choices = [c for f in frames for c in f["choices"]]
            echo = next(c for c in choices if c.get("prompt_logprobs"))
        else:
            echo = httpx.post(f"{disagg.base_url}/v1/completions", json=body).json()["choices"][0]
        echoed = echo["logprobs"]["top_logprobs"][1:3]  # the prompt's positions 1 and 2
        assert [len(top) for top in echoed] == [logprobs + 1] * 2  # + the prompt's own token
        assert [len(p) for p in echo["prompt_logprobs"][1:]] == [prompt_logprobs + 1] * 2


def test_truncate_prompt_tokens_keeps_the_prompt_s_last_tokens(colocated: Stack) -> None:
    """vLLM's truncate_prompt_tokens on completions (echo shows what was kept) and chats (the
    end of the rendered chat, its generation prompt, stays)."""
    c = client(colocated)
    tok = colocated.state.tokenizer
    ids = tok.encode(PROMPT)
    out = c.completions.create(
        model="embedded", prompt=PROMPT, max_tokens=1, echo=True,
        extra_body={"truncate_prompt_tokens": 4},
    )  # fmt: skip
    assert out.usage.prompt_tokens == 4
    assert out.choices[0].text.startswith(tok.decode(ids[-4:]))
    messages = [{"role": "user", "content": PROMPT}]
    full = c.chat.completions.create(model="embedded", messages=messages, max_tokens=1)
    cut = c.chat.completions.create(
        model="embedded", messages=messages, max_tokens=1,
        extra_body={"truncate_prompt_tokens": 5},
    )  # fmt: skip
    assert cut.usage.prompt_tokens == 5 < full.usage.prompt_tokens
    kept = c.completions.create(  # shorter than the limit: the prompt as it is
        model="embedded", prompt=[5, 6], max_tokens=1, extra_body={"truncate_prompt_tokens": 9}
    )
    assert kept.usage.prompt_tokens == 2
    r = httpx.post(f"{colocated.base_url}/v1/completions",
                   json={"prompt": "hi", "truncate_prompt_tokens": 4096})  # fmt: skip
    assert r.status_code == 400 and "larger than the model's maximum context length" in r.text


def test_bad_prompt_logprobs_requests_are_400s(colocated: Stack) -> None:
    cases = [
        ({"prompt": "hi", "prompt_logprobs": 21}, "prompt_logprobs"),
        ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "hi", "max_tokens": 0, "stream": True}, "max_tokens"),
    ]
    for body, param in cases:
        r = httpx.post(f"{colocated.base_url}/v1/completions", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_chat_logprobs_and_top_logprobs(disagg: Stack) -> None:
    out = client(disagg).chat.completions.create(
        model="embedded", messages=[{"role": "user", "content": "hi"}], max_tokens=3,
        logprobs=True, top_logprobs=3,
    )  # fmt: skip
    content = out.choices[0].logprobs.content
    assert [c.token for c in content] == ["", "system", "\n"]
    assert all(c.logprob == -0.5 and len(c.top_logprobs) == 3 for c in content)


def test_return_tokens_as_token_ids_names_every_logprob_token_by_its_id(colocated: Stack) -> None:
    """vLLM's return_tokens_as_token_ids: "token_id:N" in place of each token's text, in
    legacy logprobs (echoed prompt and top alternatives too, text offsets unchanged) and in
    chat logprobs, streamed or not; a chat's bytes stay the token's own."""
    c = client(colocated)
    extra = {"return_tokens_as_token_ids": True}
    kw = {"model": "embedded", "prompt": "Hello world", "max_tokens": 2, "logprobs": 2}
    plain = c.completions.create(**kw, echo=True).choices[0].logprobs
    named = c.completions.create(**kw, echo=True, extra_body=extra).choices[0]
    assert named.logprobs.tokens[:2] == ["token_id:19556", "token_id:905"]
    assert all(t.startswith("token_id:") for t in named.logprobs.tokens[2:])
    assert len(named.logprobs.tokens) == len(plain.tokens)
    assert named.logprobs.text_offset == plain.text_offset
    for position in named.logprobs.top_logprobs[1:]:
        assert position and all(k.startswith("token_id:") for k in position)
    chat = {"model": "embedded", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
            "logprobs": True, "top_logprobs": 2, "extra_body": extra}  # fmt: skip
    content = c.chat.completions.create(**chat).choices[0].logprobs.content
    plain_chat = c.chat.completions.create(**{**chat, "extra_body": {}}).choices[0].logprobs
    assert [x.token for x in content] == ["token_id:1", "token_id:9690", "token_id:198"]
    assert [x.bytes for x in content] == [x.bytes for x in plain_chat.content]
    assert all(t.token.startswith("token_id:") for x in content for t in x.top_logprobs)
    streamed = [x.choices[0].logprobs for x in c.chat.completions.create(**chat, stream=True)
                if x.choices and x.choices[0].logprobs]  # fmt: skip
    assert [t.token for lp in streamed for t in lp.content] == [x.token for x in content]
    legacy = [x.choices[0].logprobs.tokens for x in c.completions.create(
        **kw, stream=True, extra_body=extra) if x.choices and x.choices[0].logprobs]  # fmt: skip
    assert [t for tokens in legacy for t in tokens] == named.logprobs.tokens[2:]


def test_token_id_prompts_and_multiple_prompts(colocated: Stack) -> None:
    out = client(colocated).completions.create(
        model="embedded", prompt=[[19556, 905], [19556]], max_tokens=2, n=2
    )
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert [c.text for c in out.choices] == [
        "Hello world",
        "Hello world",
        "HelloHello",
        "HelloHello",
    ]
    assert out.usage.prompt_tokens == 3


def test_sampling_fields_are_forwarded(colocated: Stack) -> None:
    httpx.post(f"{colocated.base_url}/v1/completions", json={
        "prompt": PROMPT, "max_tokens": 3, "temperature": 0.5, "top_p": 0.9, "top_k": 5,
        "min_p": 0.1, "presence_penalty": 0.5, "frequency_penalty": -0.5,
        "repetition_penalty": 1.1, "min_tokens": 2, "stop_token_ids": [9], "ignore_eos": True,
        "priority": 3, "user": "u",
    }).raise_for_status()  # fmt: skip
    sp = colocated.workers[0].records.samplings[-1]
    assert (sp.temperature, sp.top_k, sp.min_tokens, list(sp.stop_token_ids)) == (0.5, 5, 2, [9])
    assert sp.ignore_eos and not sp.HasField("seed") and not sp.HasField("logprobs")
    assert abs(sp.top_p - 0.9) < 1e-6 and abs(sp.repetition_penalty - 1.1) < 1e-6


def test_a_priority_under_first_come_first_served_workers_is_a_400(disagg: Stack) -> None:
    """Workers that report --scheduling-policy fcfs would refuse a priority other than 0 once
    the response had begun: the gateway answers the 400 first, naming the field; workers that
    schedule by priority take it."""
    url = f"{disagg.base_url}/v1/chat/completions"
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True}
    try:
        for policy, status in (("fcfs", 400), ("priority", 200)):
            for worker in disagg.workers:
                worker.behavior.scheduling_policy = policy
            disagg.run(disagg.state.registry.poll_all())
            before = sum(len(w.records.requests) for w in disagg.workers)
            r = httpx.post(url, json={**body, "priority": 3})
            assert r.status_code == status, r.text
            if status == 400:
                assert r.json()["error"]["param"] == "priority"
                assert "--scheduling-policy priority" in r.json()["error"]["message"]
                assert sum(len(w.records.requests) for w in disagg.workers) == before
            assert httpx.post(url, json={**body, "priority": 0}).status_code == 200
    finally:
        for worker in disagg.workers:
            worker.behavior.scheduling_policy = ""
        disagg.run(disagg.state.registry.poll_all())


def test_a_cache_salt_travels_to_the_workers_and_a_bad_one_is_a_400(disagg: Stack) -> None:
    """vLLM's cache_salt reaches the prefill and the decode worker (both key cached blocks by
    it); an empty or non-string salt is a 400 naming it."""
    url = f"{disagg.base_url}/v1/chat/completions"
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert httpx.post(url, json={**body, "cache_salt": "tenant-7"}).status_code == 200
    got = [w.records.samplings[-1].cache_salt for w in disagg.workers if w.records.samplings]
    assert got == ["tenant-7", "tenant-7"]  # the prefill worker chosen, the decode worker
    for bad in ("", 7, "x" * 1025):
        r = httpx.post(url, json={**body, "cache_salt": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt", r.text


def test_chat_echo_starts_the_reply_with_the_answer_the_client_began(colocated: Stack) -> None:
    """vLLM's chat echo: the final message's content first, when that message is the
    assistant's (streamed: in the first delta); a final user message is not echoed."""
    c = client(colocated)
    began = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure, "}]
    go_on = {"continue_final_message": True, "add_generation_prompt": False}
    extra = {"echo": True, **go_on}
    plain = c.chat.completions.create(model="embedded", messages=began, max_tokens=3,
                                      extra_body=go_on)  # fmt: skip
    out = c.chat.completions.create(model="embedded", messages=began, max_tokens=3,
                                    extra_body=extra)  # fmt: skip
    assert out.choices[0].message.content == "Sure, " + plain.choices[0].message.content
    stream = c.chat.completions.create(model="embedded", messages=began, max_tokens=3,
                                       extra_body=extra, stream=True)  # fmt: skip
    text = "".join(x.choices[0].delta.content or "" for x in stream if x.choices)
    assert text == out.choices[0].message.content
    asked = c.chat.completions.create(model="embedded", messages=began[:1], max_tokens=3,
                                      extra_body={"echo": True})  # fmt: skip
    unasked = c.chat.completions.create(model="embedded", messages=began[:1], max_tokens=3)
    assert asked.choices[0].message.content == unasked.choices[0].message.content


def test_allowed_token_ids_travel_to_the_workers_and_bad_ones_are_400s(colocated: Stack) -> None:
    url = f"{colocated.base_url}/v1/completions"
    r = httpx.post(url, json={"prompt": "hi", "max_tokens": 2, "allowed_token_ids": [5, 9]})
    assert r.status_code == 200, r.text
    assert list(colocated.workers[0].records.samplings[-1].allowed_token_ids) == [5, 9]
    for bad, needle in (([], "at least one"), ([60000], "outside the vocabulary"),
                        (["a"], "integer"), (5, "list")):  # fmt: skip
        r = httpx.post(url, json={"prompt": "hi", "allowed_token_ids": bad})
        assert r.status_code == 400 and needle in r.text, r.text
        assert r.json()["error"]["param"] == "allowed_token_ids"


def test_bad_words_travel_to_the_workers_and_bad_ones_are_400s(colocated: Stack) -> None:
    url = f"{colocated.base_url}/v1/completions"
    r = httpx.post(url, json={"prompt": "hi", "max_tokens": 2, "bad_words": ["foo", " bar"]})
    assert r.status_code == 200, r.text
    assert list(colocated.workers[0].records.samplings[-1].bad_words) == ["foo", " bar"]
    for bad in (["  "], [1], ["x" * 257]):
        r = httpx.post(url, json={"prompt": "hi", "bad_words": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "bad_words", r.text


def test_timing_header(disagg: Stack) -> None:
    r = httpx.post(f"{disagg.base_url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 3})
    parts = dict(p.split("=") for p in r.headers["x-tandem-timing"].split(";"))
    assert set(parts) == {"queue", "prefill", "transfer", "ttft", "decode", "e2e", "mode"}
    assert parts["mode"] == "disagg"
    assert float(parts["transfer"]) == pytest.approx(0.004)
    assert 0 < float(parts["ttft"]) <= float(parts["e2e"])


def test_streaming_echo_sends_the_prompt_first(colocated: Stack) -> None:
    stream = client(colocated).completions.create(
        model="embedded", prompt="Hello world", max_tokens=2, echo=True, stream=True
    )
    texts = [c.choices[0].text for c in stream]
    assert texts == ["Hello world", "Hello", " world"]
    scored = list(client(colocated).completions.create(  # max_tokens 0: the prompt alone
        model="embedded", prompt="Hello world", max_tokens=0, echo=True, stream=True
    ))  # fmt: skip
    assert [(c.choices[0].text, c.choices[0].finish_reason) for c in scored] == [
        ("Hello world", "length")
    ]
    assert scored[0].choices[0].logprobs is None


def test_echoed_split_characters_keep_the_text_whole(colocated: Stack) -> None:
    out = client(colocated).completions.create(
        model="embedded", prompt="Hi 😀!", max_tokens=1, echo=True
    )
    assert out.choices[0].text.startswith("Hi 😀!")


def _frames(stack: Stack, body: dict[str, Any]) -> list[dict[str, Any]]:
    r = httpx.post(f"{stack.base_url}/v1/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text
    return [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]


LEGACY = ("tokens", "token_logprobs", "top_logprobs", "text_offset")


def _assembled(frames: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """Each choice as a whole response would hold it: its text and its logprobs' lists joined
    over its chunks, its last finish_reason and stop_reason."""
    out: dict[int, dict[str, Any]] = {}
    for frame in frames:
        for c in frame["choices"]:
            whole = out.setdefault(c["index"], {"index": c["index"], "text": "",
                                                "logprobs": {k: [] for k in LEGACY}})  # fmt: skip
            whole["text"] += c["text"]
            for k in LEGACY:
                whole["logprobs"][k] += c["logprobs"][k] if c["logprobs"] else []
            whole["finish_reason"], whole["stop_reason"] = c["finish_reason"], c["stop_reason"]
    return out


@pytest.mark.parametrize(
    "fields",
    [
        {"prompt": "Hello world", "max_tokens": 3},
        {"prompt": ["Hello world", "Hi 😀! ü"], "max_tokens": 4, "n": 2},  # split characters
        {"prompt": [[19556, 905, 28], [19556]], "max_tokens": 2, "n": 3},
        {"prompt": PROMPT, "max_tokens": 8, "stop": [" this"]},  # a stop string holds text back
        {"prompt": ["Hello world", "Hi 😀!"], "max_tokens": 0, "n": 2},  # scoring (lm-eval)
        {"prompt": "Hello world", "max_tokens": 2, "return_tokens_as_token_ids": True},
        {"prompt": "Hello world", "max_tokens": 2, "logprobs": 0, "prompt_logprobs": 1},
    ],
)
def test_streamed_echo_with_logprobs_adds_up_to_the_whole_response(
    colocated: Stack, fields: dict[str, Any]
) -> None:
    """echo + logprobs streamed, as vLLM streams it: each choice's first chunk holds the echoed
    prompt with its tokens' logprobs (the first null), then the generated chunks, whose text
    offsets go on from the prompt's text; joined over the chunks, the text and every list of
    logprobs equal the whole response's, choice by choice (n > 1, several prompts, max_tokens 0
    scoring the prompt alone); usage too."""
    body = {"echo": True, "logprobs": 2, **fields}
    tok = colocated.state.tokenizer
    prompts = [fields["prompt"]] if isinstance(fields["prompt"], str) else fields["prompt"]
    whole = httpx.post(f"{colocated.base_url}/v1/completions", json=body, timeout=30).json()
    frames = _frames(colocated, {**body, "stream": True, "stream_options": {"include_usage": True}})
    assert frames[-1]["choices"] == [] and frames[-1]["usage"] == whole["usage"]
    streamed = _assembled(frames[:-1])
    assert len(streamed) == len(whole["choices"]) > 0
    for choice in whole["choices"]:
        got = streamed[choice["index"]]
        assert got["text"] == choice["text"]
        assert got["logprobs"] == choice["logprobs"], choice["index"]
        assert (got["finish_reason"], got["stop_reason"]) == (
            choice["finish_reason"], choice["stop_reason"],
        )  # fmt: skip
        prompt = prompts[choice["index"] // fields.get("n", 1)]
        ids = tok.encode(prompt) if isinstance(prompt, str) else prompt
        firsts = [c for f in frames[:-1] for c in f["choices"] if c["index"] == choice["index"]]
        first = firsts[0]  # the prompt, with its tokens' logprobs
        assert first["text"] == (prompt if isinstance(prompt, str) else tok.decode(ids))
        assert len(first["logprobs"]["tokens"]) == len(ids)
        assert first["logprobs"]["token_logprobs"] == [None] + [-0.25] * (len(ids) - 1)
        assert first["logprobs"]["top_logprobs"][0] is None
        if "prompt_logprobs" in fields:  # vLLM's, asked for too: in that first chunk
            assert first["prompt_logprobs"] == choice["prompt_logprobs"]
        if fields["max_tokens"] == 0:  # one chunk: the prompt, scored, and the finish
            assert firsts == [first] and first["finish_reason"] == "length"
        else:
            assert first["finish_reason"] is None and len(firsts) > 1
    if fields["max_tokens"] == 0:
        assert whole["usage"]["completion_tokens"] == 0


def test_a_clients_request_id_is_the_responses_id(disagg: Stack) -> None:
    # vLLM's request_id (and its X-Request-Id header, which wins): the response's id carries
    # it, streamed or not; the workers' ids stay the gateway's own, so two clients that send
    # the same id do not share a request on a worker
    c = client(disagg)
    out = c.completions.create(model="embedded", prompt=PROMPT, max_tokens=2,
                               extra_body={"request_id": "job-7"})  # fmt: skip
    again = c.completions.create(model="embedded", prompt=PROMPT, max_tokens=2,
                                 extra_body={"request_id": "job-7"})  # fmt: skip
    assert out.id == again.id == "cmpl-job-7"
    chunks = list(c.chat.completions.create(
        model="embedded", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
        stream=True, extra_body={"request_id": "job-8"},
    ))  # fmt: skip
    assert {chunk.id for chunk in chunks} == {"chatcmpl-job-8"}
    chat = c.chat.completions.create(
        model="embedded", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
        extra_body={"request_id": "job-8"}, extra_headers={"X-Request-Id": "trace-1"},
    )  # fmt: skip
    assert chat.id == "chatcmpl-trace-1"
    sent = {rid for w in disagg.workers for rid in w.records.requests}
    assert len(sent) == 4 and not any("job-" in rid or "trace-" in rid for rid in sent)


@pytest.mark.parametrize(
    ("extra", "headers", "param"),
    [({"request_id": ""}, {}, "request_id"), ({"request_id": 7}, {}, "request_id"),
     ({"request_id": "x" * 257}, {}, "request_id"), ({}, {"X-Request-Id": "x" * 257}, None)],
)  # fmt: skip
def test_a_bad_request_id_is_a_400(
    disagg: Stack, extra: dict[str, Any], headers: dict[str, str], param: str | None
) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client(disagg).completions.create(
            model="embedded", prompt=PROMPT, max_tokens=2, extra_body=extra,
            extra_headers=headers,
        )  # fmt: skip
    assert info.value.body["param"] == param
    assert "request_id" in info.value.message.lower().replace("-", "_")
    assert not any(w.records.requests for w in disagg.workers)
