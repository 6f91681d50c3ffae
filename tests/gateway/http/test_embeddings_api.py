"""POST /v1/embeddings against fake workers: the openai client in both encodings, the order and
usage of a batch, and every 400 (a fake worker's vector i is [length, first id, last id, 0.5])."""

from __future__ import annotations

import base64
import struct

import httpx
import openai
import pytest

from tests.gateway.stack import Stack

pytestmark = pytest.mark.timeout(60)


def client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0)


@pytest.fixture
def embed(colocated: Stack) -> Stack:
    """The colocated fake worker started with --task embed (its next poll says so)."""
    colocated.workers[0].behavior.task = "embed"
    colocated.run(colocated.state.registry.poll_all())
    return colocated


def post(stack: Stack, body: object) -> httpx.Response:
    return httpx.post(f"{stack.base_url}/v1/embeddings", json=body, timeout=10)


def test_a_batch_comes_back_in_order_in_both_encodings(embed: Stack) -> None:
    inputs = ["Hello world", "a", "The quick brown fox jumps"]
    floats = client(embed).embeddings.create(
        model="embedded", input=inputs, encoding_format="float"
    )
    packed = client(embed).embeddings.create(model="embedded", input=inputs)  # base64: default
    tok = embed.state.tokenizer
    lengths = [len(tok.encode(t, True)) for t in inputs]
    assert [d.index for d in floats.data] == [0, 1, 2]
    assert [d.embedding[0] for d in floats.data] == lengths
    assert [d.embedding for d in packed.data] == [d.embedding for d in floats.data]
    assert floats.usage.prompt_tokens == floats.usage.total_tokens == sum(lengths)
    assert floats.model == "embedded" and floats.object == "list"
    (request,) = embed.workers[0].records.embeds[-1:]
    assert not request.HasField("normalize") and len(request.inputs) == 3


def test_base64_is_little_endian_float32(embed: Stack) -> None:
    r = post(embed, {"input": [[5, 6, 7]], "encoding_format": "base64"})
    assert r.status_code == 200
    raw = base64.b64decode(r.json()["data"][0]["embedding"])
    assert struct.unpack("<4f", raw) == (3.0, 5.0, 7.0, 0.5)


@pytest.mark.parametrize(
    ("inputs", "expected"),
    [
        ([1, 2, 3], [[3, 1, 3]]),  # one list of token ids
        ([[1, 2], [9]], [[2, 1, 2], [1, 9, 9]]),  # a list of them
    ],
)
def test_token_id_inputs(embed: Stack, inputs: list, expected: list) -> None:
    r = post(embed, {"model": "embedded", "input": inputs})
    assert r.status_code == 200, r.text
    assert [d["embedding"][:3] for d in r.json()["data"]] == expected


def test_normalize_travels_to_the_worker(embed: Stack) -> None:
    assert post(embed, {"input": "hi", "normalize": False}).status_code == 200
    request = embed.workers[0].records.embeds[-1]
    assert request.HasField("normalize") and request.normalize is False


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({"input": ""}, "input", "input[0] is empty"),
        ({"input": []}, "input", "non-empty"),
        ({"input": [[]]}, "input", "input[0] is empty"),
        ({"input": ["a", ""]}, "input", "input[1] is empty"),
        ({}, "input", "input is required"),
        ({"input": ["a", [1, 2]]}, "input", "mix"),
        ({"input": [1.5]}, "input", "input must be"),
        ({"input": [[-1]]}, "input[0]", "between 0"),
        ({"input": [[60000]]}, "input", "outside the vocabulary"),
        ({"input": "a", "dimensions": 32}, "dimensions", "does not support dimensions"),
        ({"input": "a", "encoding_format": "int8"}, "encoding_format", "float or base64"),
        ({"input": "a", "normalize": "yes"}, "normalize", "true or false"),
        ({"input": "a", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens", "at least 1"),
        ({"input": "a", "truncate_prompt_tokens": -2}, "truncate_prompt_tokens", "between"),
        ({"input": "a", "truncate_prompt_tokens": 4096}, "truncate_prompt_tokens", "larger than"),
        ({"input": ["a"] * 2049}, "input", "at most 2048"),
    ],
)
def test_bad_requests_are_400s_naming_the_field(
    embed: Stack, body: dict, param: str, message: str
) -> None:
    r = post(embed, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and message in error["message"]
    assert error["type"] == "invalid_request_error"
    assert not embed.workers[0].records.embeds


def test_unknown_fields_are_refused_as_on_the_other_routes(embed: Stack) -> None:
    assert post(embed, {"input": "a", "user": "me"}).status_code == 200
    r = post(embed, {"input": "a", "x_custom": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "x_custom"


def test_an_input_past_the_context_is_a_400(embed: Stack) -> None:
    embed.workers[0].behavior.max_model_len = 8
    embed.run(embed.state.registry.poll_all())
    r = post(embed, {"input": ["short", "word " * 20]})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["code"] == "context_length_exceeded"
    assert (
        "maximum context length is 8 tokens" in error["message"] and "input[1]" in error["message"]
    )


def test_truncate_prompt_tokens_keeps_each_input_s_last_tokens(embed: Stack) -> None:
    """vLLM's truncate_prompt_tokens: the last N tokens of every input (-1: as many as the
    context holds); usage counts what was kept. The fake's vector is (count, first, last)."""
    embed.workers[0].behavior.max_model_len = 8
    embed.run(embed.state.registry.poll_all())
    r = post(embed, {"input": [[1, 2, 3, 4, 5], [7]], "truncate_prompt_tokens": 3})
    assert r.status_code == 200, r.text
    assert [d["embedding"][:3] for d in r.json()["data"]] == [[3, 3, 5], [1, 7, 7]]
    assert r.json()["usage"]["prompt_tokens"] == 4
    r = post(embed, {"input": list(range(1, 21)), "truncate_prompt_tokens": -1})
    assert r.status_code == 200 and r.json()["data"][0]["embedding"][:3] == [8, 13, 20]


def test_messages_are_embedded_as_the_chat_template_renders_them(embed: Stack) -> None:
    """vLLM's chat-style embeddings request: messages through the gateway's chat template, no
    generation prompt and no extra special tokens unless asked, as vLLM's defaults."""
    messages = [{"role": "user", "content": "Hello there"}]
    tok = embed.state.tokenizer
    plain, _ = tok.chat_ids(messages, False, False, False)
    prompted, _ = tok.chat_ids(messages, True, False, False)
    assert len(prompted) > len(plain)
    r = post(embed, {"model": "embedded", "messages": messages})
    assert r.status_code == 200, r.text
    assert r.json()["data"][0]["embedding"][:3] == [len(plain), plain[0], plain[-1]]
    assert r.json()["usage"]["prompt_tokens"] == len(plain)
    r = post(embed, {"messages": messages, "add_generation_prompt": True,
                     "truncate_prompt_tokens": 4})  # fmt: skip
    assert r.json()["data"][0]["embedding"][:3] == [4, prompted[-4], prompted[-1]]


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({"messages": [{"role": "user", "content": "a"}], "input": "a"}, "messages", "not both"),
        ({"messages": []}, "messages", "messages"),
        ({"messages": [{"role": "user", "content": "a"}], "chat_template": "{{ x }}"},
         "chat_template", "chat template"),
        ({"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]},
         "messages", "does not take images"),
    ],
)  # fmt: skip
def test_bad_chat_style_requests_are_400s(
    embed: Stack, body: dict, param: str, message: str
) -> None:
    r = post(embed, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and message in error["message"], error
    assert not embed.workers[0].records.embeds


def test_an_unknown_model_is_a_404(embed: Stack) -> None:
    r = post(embed, {"input": "a", "model": "gpt-4"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_a_generation_worker_answers_embeddings_with_a_400(colocated: Stack) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client(colocated).embeddings.create(model="embedded", input="hi")
    assert "start it with --task embed" in str(err.value)
    assert not colocated.workers[0].records.embeds


def test_an_embedding_worker_answers_completions_and_chats_with_a_400(embed: Stack) -> None:
    with pytest.raises(openai.BadRequestError, match="--task embed"):
        client(embed).completions.create(model="embedded", prompt="hi", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="--task embed"):
        client(embed).chat.completions.create(
            model="embedded", messages=[{"role": "user", "content": "hi"}]
        )
    assert not embed.workers[0].records.requests


def test_a_worker_refusal_is_a_400_and_a_dead_worker_a_retry(embed: Stack) -> None:
    embed.workers[0].behavior.invalid_argument = True
    assert post(embed, {"input": "a"}).status_code == 400
    embed.workers[0].behavior.invalid_argument = False
    embed.workers[0].behavior.fail_before_first = 1  # UNAVAILABLE: no other embed worker left
    r = post(embed, {"input": "a"})
    assert r.status_code == 503


def test_a_large_batch_travels_in_parts_and_comes_back_in_order(embed: Stack) -> None:
    inputs = [[i + 1, i + 2] for i in range(600)]
    r = post(embed, {"input": inputs})
    assert r.status_code == 200, r.text
    assert [d["embedding"][1] for d in r.json()["data"]] == [i + 1 for i in range(600)]
    assert [d["index"] for d in r.json()["data"]] == list(range(600))
    calls = embed.workers[0].records.embeds
    assert sorted(len(c.inputs) for c in calls) == [88, 256, 256]
    assert len({c.request_id for c in calls}) == 3


def test_metrics_count_the_prompt_tokens_and_one_success_per_input(embed: Stack) -> None:
    def scrape() -> dict[str, float]:
        text = httpx.get(f"{embed.base_url}/metrics", timeout=10).text
        wanted = (
            "tandem:prompt_tokens_total{",
            'tandem:request_success_total{finished_reason="stop"',
        )
        return {
            name: sum(float(x.rsplit(" ", 1)[1]) for x in text.splitlines() if x.startswith(name))
            for name in wanted
        }

    before = scrape()
    assert post(embed, {"input": [[1, 2, 3], [4, 5]]}).status_code == 200
    after = scrape()
    assert [after[k] - before[k] for k in before] == [5, 2]


def test_a_mixed_fleet_routes_each_endpoint_to_its_task(tokenizer_dir: str) -> None:
    stack = Stack(tokenizer_dir, ["colocated", "colocated"]).start()
    try:
        generator, embedder = stack.workers
        embedder.behavior.task = "embed"
        stack.run(stack.state.registry.poll_all())
        for i in range(4):
            assert post(stack, {"input": f"text {i}"}).status_code == 200
            client(stack).completions.create(model="embedded", prompt=f"text {i}", max_tokens=2)
        assert len(embedder.records.embeds) == 4 and not generator.records.embeds
        # requests: every call noted; the embed worker saw only its 4 Embed calls
        assert len(generator.records.requests) == 4 and len(embedder.records.requests) == 4
    finally:
        stack.stop()


def test_a_clients_request_id_is_the_responses_id(embed: Stack) -> None:
    # vLLM's request_id, as on completions; the worker's id stays the gateway's own
    out = client(embed).embeddings.create(
        model="embedded", input="hi", extra_body={"request_id": "doc-1"}
    )
    assert out.id == "embd-doc-1"  # type: ignore[attr-defined]
    (request,) = embed.workers[0].records.embeds[-1:]
    assert "doc-1" not in request.request_id
