"""The app as a whole: torch-free, auth, the small endpoints, OpenAI-shaped errors."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from gateway.core.errors import APIError, error_type
from gateway.http.admin_api import openapi_document
from tests.gateway.stack import Stack

pytestmark = pytest.mark.timeout(120)

_NO_TORCH = """
import sys
from gateway.http.app import build_app
from gateway.core.config import GatewayConfig, WorkerSpec
app = build_app(GatewayConfig(tokenizer=sys.argv[1], workers=(WorkerSpec("colocated", "127.0.0.1:1"),)))
import gateway.http.server, gateway.http.openai_api, gateway.workers.disagg
bad = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "transformers", "services.engine")
             or m.startswith("services.engine"))
print("BAD", bad)
"""


def test_gateway_imports_no_torch(tokenizer_dir: str) -> None:
    out = subprocess.run(
        [sys.executable, "-c", _NO_TORCH, tokenizer_dir],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    assert out.stdout.strip().splitlines()[-1] == "BAD []"


@pytest.fixture(scope="module")
def secured(tokenizer_dir: str) -> Iterator[Stack]:
    stack = Stack(tokenizer_dir, ["colocated"], api_key="sekret", served_model_name="smol").start()
    try:
        yield stack
    finally:
        stack.stop()


def test_api_key_required_except_on_open_endpoints(secured: Stack) -> None:
    url = secured.base_url
    body = {"model": "smol", "prompt": "hi", "max_tokens": 2}
    r = httpx.post(f"{url}/v1/completions", json=body)
    assert r.status_code == 401
    assert r.json()["error"]["code"] == "invalid_api_key"
    wrong = httpx.post(f"{url}/v1/completions", json=body, headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401
    ok = httpx.post(f"{url}/v1/completions", json=body, headers={"Authorization": "Bearer sekret"})
    assert ok.status_code == 200
    assert httpx.get(f"{url}/v1/models").status_code == 401
    for path in ("/health", "/metrics", "/version", "/openapi.json"):
        assert httpx.get(url + path).status_code == 200, path
        # a probe written with a trailing slash is redirected, not asked for the key
        r = httpx.get(url + path + "/", follow_redirects=True)
        assert r.status_code == 200 and len(r.history) == 1, path
    assert httpx.get(f"{url}/v1/models/").status_code == 401  # not open for its slash
    # an OPTIONS without CORS headers runs nothing: the router's 405, as vLLM answers it
    assert httpx.options(f"{url}/v1/completions").status_code == 405


PREFLIGHT = {
    "Origin": "https://app.example.com",
    "Access-Control-Request-Method": "POST",
    "Access-Control-Request-Headers": "authorization, content-type",
}


def test_a_browser_preflight_is_answered_without_the_api_key(secured: Stack) -> None:
    """vLLM's CORS defaults (any origin, method and header): a browser's preflight carries no
    Authorization header, so it is answered before the key is checked."""
    r = httpx.options(f"{secured.base_url}/v1/completions", headers=PREFLIGHT)
    assert r.status_code == 200, r.text
    assert r.headers["access-control-allow-origin"] == "*"
    assert "POST" in r.headers["access-control-allow-methods"]
    assert r.headers["access-control-allow-headers"] == "authorization, content-type"
    assert "access-control-allow-credentials" not in r.headers


def test_a_cross_origin_request_still_needs_the_key_and_carries_cors_headers(
    secured: Stack,
) -> None:
    url = f"{secured.base_url}/v1/completions"
    body = {"model": "smol", "prompt": "hi", "max_tokens": 2}
    origin = {"Origin": "https://app.example.com"}
    r = httpx.post(url, json=body, headers=origin)
    assert r.status_code == 401  # readable by the page: the CORS headers are on the 401 too
    assert r.headers["access-control-allow-origin"] == "*"
    ok = httpx.post(url, json=body, headers={**origin, "Authorization": "Bearer sekret"})
    assert ok.status_code == 200
    assert ok.headers["access-control-allow-origin"] == "*"
    assert ok.headers["access-control-expose-headers"] == "x-tandem-timing"
    streamed = {**body, "stream": True}
    with httpx.stream(
        "POST", url, json=streamed, headers={**origin, "Authorization": "Bearer sekret"}
    ) as s:
        assert s.status_code == 200 and s.headers["access-control-allow-origin"] == "*"
        assert "[DONE]" in s.read().decode()


def test_cors_allows_only_the_origins_methods_and_headers_given(tokenizer_dir: str) -> None:
    from gateway.core.config import GatewayConfig, WorkerSpec
    from gateway.http.app import build_app

    config = GatewayConfig(
        tokenizer=tokenizer_dir, workers=(WorkerSpec("colocated", "127.0.0.1:1"),),
        api_key="sekret", allowed_origins=("https://app.example.com",),
        allowed_methods=("POST",), allowed_headers=("Authorization",), allow_credentials=True,
    )  # fmt: skip
    url = "/v1/chat/completions"

    async def check() -> None:
        # no lifespan (ASGITransport runs none): nothing here reaches a worker
        transport = httpx.ASGITransport(app=build_app(config))
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
            r = await client.options(url, headers=PREFLIGHT)
            assert r.status_code == 200
            assert r.headers["access-control-allow-origin"] == "https://app.example.com"
            assert r.headers["access-control-allow-credentials"] == "true"
            for other in (
                {"Origin": "https://evil.example"},
                {"Access-Control-Request-Method": "PUT"},
                {"Access-Control-Request-Headers": "x-other"},
            ):
                r = await client.options(url, headers={**PREFLIGHT, **other})
                assert r.status_code == 400, other
                if "Origin" in other:
                    assert "access-control-allow-origin" not in r.headers
            r = await client.get("/v1/models", headers={"Origin": "https://evil.example"})
            assert r.status_code == 401 and "access-control-allow-origin" not in r.headers
            # without Origin it is no preflight: it runs nothing either, the router's 405 (as
            # vLLM, which lets every OPTIONS past its key check)
            assert (await client.options(url)).status_code == 405

    asyncio.run(check())


def test_served_model_name_and_404_for_other_models(secured: Stack) -> None:
    headers = {"Authorization": "Bearer sekret"}
    models = httpx.get(f"{secured.base_url}/v1/models", headers=headers).json()
    assert [m["id"] for m in models["data"]] == ["smol"]
    assert models["data"][0]["max_model_len"] == 2048
    # vLLM's card: parent null for the base model, one permission entry
    card = models["data"][0]
    assert card["parent"] is None and card["permission"][0]["object"] == "model_permission"
    assert card["permission"][0]["allow_sampling"] is True
    r = httpx.post(
        f"{secured.base_url}/v1/completions",
        json={"model": "gpt-4", "prompt": "hi"},
        headers=headers,
    )
    assert r.status_code == 404
    assert r.json()["error"]["param"] == "model"
    assert "smol" in r.json()["error"]["message"]
    for model in ("", None):  # the base model, as vLLM takes an empty name
        body = {"model": model, "prompt": "hi", "max_tokens": 1}
        r = httpx.post(f"{secured.base_url}/v1/completions", json=body, headers=headers)
        assert r.status_code == 200 and r.json()["model"] == "smol", r.text


def test_get_one_model_by_id(secured: Stack) -> None:
    headers = {"Authorization": "Bearer sekret"}
    listed = httpx.get(f"{secured.base_url}/v1/models", headers=headers).json()["data"][0]
    one = httpx.get(f"{secured.base_url}/v1/models/smol", headers=headers)
    assert one.status_code == 200 and one.json() == listed
    assert one.json()["object"] == "model" and one.json()["id"] == "smol"
    missing = httpx.get(f"{secured.base_url}/v1/models/gpt-4", headers=headers)
    assert missing.status_code == 404
    error = missing.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == "model_not_found" and "gpt-4" in error["message"]
    assert httpx.get(f"{secured.base_url}/v1/models/smol").status_code == 401


def test_unknown_route_and_wrong_method_are_openai_errors(colocated: Stack) -> None:
    r = httpx.get(f"{colocated.base_url}/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()
    assert r.json()["error"]["type"] == "invalid_request_error"
    for path, allowed in (("/v1/completions", "POST"), ("/v1/chat/completions", "POST")):
        r = httpx.get(f"{colocated.base_url}{path}")
        assert r.status_code == 405 and r.headers["allow"] == allowed, r.headers
        assert r.json()["error"]["type"] == "invalid_request_error", r.text
    r = httpx.post(f"{colocated.base_url}/v1/models", json={})
    assert r.status_code == 405 and "GET" in r.headers["allow"]
    assert r.json()["error"]["type"] == "invalid_request_error"


def test_responses_endpoints_not_served_are_404s_not_405s(colocated: Stack) -> None:
    """POST /v1/responses/input_tokens and /compact (the openai client's
    responses.input_tokens.count and responses.compact) match /v1/responses/{response_id},
    which takes GET and DELETE: the router's 405 said they were served under another method."""
    for path in ("/v1/responses/input_tokens", "/v1/responses/compact"):
        r = httpx.post(f"{colocated.base_url}{path}", json={"model": "smol", "input": "hi"})
        assert r.status_code == 404, r.text
        assert "allow" not in r.headers
        error = r.json()["error"]
        assert error["code"] == "not_found" and f"POST {path} is not supported" in error["message"]
    # a stored response's own routes are unchanged
    r = httpx.post(f"{colocated.base_url}/v1/responses/resp_1", json={})
    assert r.status_code == 405 and set(r.headers["allow"].split(", ")) >= {"GET", "DELETE"}


def test_error_types_follow_the_status() -> None:
    """Every 4xx is the client's (invalid_request_error) unless it has its own type; every
    other status is the server's."""
    assert error_type(400) == error_type(405) == error_type(422) == "invalid_request_error"
    assert error_type(429) == error_type(404) == "invalid_request_error"
    assert error_type(401) == "authentication_error"
    assert error_type(500) == error_type(502) == error_type(507) == "server_error"
    assert error_type(503) == "service_unavailable_error" and error_type(504) == "timeout_error"
    assert APIError(405, "m").type == "invalid_request_error"


def test_version_openapi_and_workers(colocated: Stack) -> None:
    url = colocated.base_url
    assert httpx.get(f"{url}/version").json()["version"]
    assert httpx.get(f"{url}/openapi.json").json() == openapi_document()
    workers = httpx.get(f"{url}/workers").json()["workers"]
    assert [(w["role"], w["healthy"]) for w in workers] == [("colocated", True)]
    assert workers[0]["load"]["max_model_len"] == 2048


def test_tokenize_and_detokenize(colocated: Stack) -> None:
    url = colocated.base_url
    r = httpx.post(f"{url}/tokenize", json={"prompt": "Hello world"}).json()
    assert r == {"count": 2, "max_model_len": 2048, "tokens": [19556, 905], "token_strs": None}
    chat = httpx.post(
        f"{url}/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}
    ).json()
    assert chat["count"] == 31 and chat["tokens"][-4:] == [1, 520, 9531, 198]
    assert httpx.post(f"{url}/detokenize", json={"tokens": [19556, 905]}).json() == {
        "prompt": "Hello world"
    }
    bad = httpx.post(f"{url}/detokenize", json={"tokens": [10**6]})
    assert bad.status_code == 400 and "outside the vocabulary" in bad.json()["error"]["message"]


def test_tokenize_returns_the_token_strings_when_asked(colocated: Stack) -> None:
    """vLLM's return_token_strs (default false): token_strs holds each token's string as
    convert_ids_to_tokens gives it (the byte-level "Ġ" for a space), for a prompt and for a
    chat; null when not asked, as vLLM answers."""
    url, tok = colocated.base_url, colocated.state.tokenizer
    r = httpx.post(f"{url}/tokenize", json={"model": "embedded", "prompt": "Hello world",
                                            "return_token_strs": True})  # fmt: skip
    assert r.status_code == 200, r.text
    assert r.json() == {"count": 2, "max_model_len": 2048, "tokens": [19556, 905],
                        "token_strs": ["Hello", "Ġworld"]}  # fmt: skip
    chat = {"messages": [{"role": "user", "content": "hi"}], "return_token_strs": True}
    body = httpx.post(f"{url}/tokenize", json=chat).json()
    assert body["token_strs"] == [tok.id_to_token(t) for t in body["tokens"]]
    assert "<|im_start|>" in body["token_strs"] and len(body["token_strs"]) == body["count"]
    for asked in (False, None):
        r = httpx.post(f"{url}/tokenize", json={"prompt": "Hi", "return_token_strs": asked})
        assert r.json()["token_strs"] is None
    r = httpx.post(f"{url}/tokenize", json={"prompt": "Hi", "return_token_strs": "yes"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "return_token_strs"


@pytest.fixture(scope="module")
def tools_template(tokenizer_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """A gateway whose chat template writes out the tools it is given."""
    path = tmp_path_factory.mktemp("template") / "tools.jinja"
    path.write_text(
        "{% if tools %}<tools>{% for t in tools %}{{ t.function.name }};{% endfor %}</tools>"
        "{% endif %}{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}"
    )
    stack = Stack(tokenizer_dir, ["colocated"], chat_template=str(path)).start()
    try:
        yield stack
    finally:
        stack.stop()


def test_tokenize_passes_tools_to_the_chat_template_as_a_chat_does(tools_template: Stack) -> None:
    """A chat's tools on /tokenize (vLLM's TokenizeChatRequest takes them): checked as a chat
    completion checks them and rendered by the template, so the ids are the ones a chat
    completion with those tools runs on; tool_choice, no field of vLLM's tokenize, is a 400."""
    url, tok = tools_template.base_url, tools_template.state.tokenizer
    messages = [{"role": "user", "content": "weather?"}]
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}  # fmt: skip
    r = httpx.post(f"{url}/tokenize", json={"messages": messages, "tools": [tool]})
    assert r.status_code == 200, r.text
    tokens = r.json()["tokens"]
    assert tok.decode(tokens) == "<tools>get_weather;</tools>user: weather?\nassistant:"
    plain = httpx.post(f"{url}/tokenize", json={"messages": messages}).json()["tokens"]
    assert tok.decode(plain) == "user: weather?\nassistant:"
    for empty in ([], None):  # no tools: the template sees none
        r = httpx.post(f"{url}/tokenize", json={"messages": messages, "tools": empty})
        assert r.json()["tokens"] == plain
    # the fake worker echoes the prompt's tokens: the reply is the prompt a chat ran on
    chat = httpx.post(f"{url}/v1/chat/completions", json={
        "messages": messages, "tools": [tool], "tool_choice": "none", "max_tokens": len(tokens),
    }).json()  # fmt: skip
    assert chat["usage"]["prompt_tokens"] == len(tokens)
    assert chat["choices"][0]["message"]["content"] == tok.decode(tokens)
    for bad, param in (
        ({"tools": [{"type": "function", "function": {"name": "no spaces"}}]}, "tools"),
        ({"tools": {"name": "f"}}, "tools"),
        ({"tools": [tool], "tool_choice": "none"}, "tool_choice"),
        ({"tools": [tool], "parallel_tool_calls": False}, "parallel_tool_calls"),
    ):
        r = httpx.post(f"{url}/tokenize", json={"messages": messages, **bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    r = httpx.post(f"{url}/tokenize", json={"prompt": "hi", "tools": [tool]})
    assert r.status_code == 400 and "Unrecognized request argument" in r.text  # a chat's only


def test_tokenize_refuses_the_vllm_fields_it_cannot_honour(colocated: Stack) -> None:
    """vLLM's TokenizeChatRequest fields Tandem does not do (a per-request chat template, image
    options: /tokenize takes no images) are a 400 naming the field; neutral values pass; the
    chat's fields on a prompt are unrecognized, as vLLM's TokenizeCompletionRequest lacks them."""
    url = colocated.base_url
    messages = [{"role": "user", "content": "hi"}]
    for name, value in (("chat_template", "{{ messages }}"), ("media_io_kwargs", {"image": {}}),
                        ("mm_processor_kwargs", {"max_pixels": 1})):  # fmt: skip
        r = httpx.post(f"{url}/tokenize", json={"messages": messages, name: value})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == name and f"{name} is not supported" in r.text
        for neutral in (None, {}):
            r = httpx.post(f"{url}/tokenize", json={"messages": messages, name: neutral})
            assert r.status_code == 200, r.text
    for name in ("add_generation_prompt", "chat_template_kwargs", "mm_processor_kwargs"):
        r = httpx.post(f"{url}/tokenize", json={"prompt": "hi", name: None})
        assert r.status_code == 400 and r.json()["error"]["param"] == name, r.text


def test_a_continued_final_message_ends_the_prompt_inside_it(colocated: Stack) -> None:
    """continue_final_message with add_generation_prompt false, on /tokenize and on a chat:
    the prompt ends with the text of the answer the client began (no end of turn, no new
    assistant turn after it); with add_generation_prompt true, given or by its default (as in
    vLLM), it is a 400 that says to send add_generation_prompt: false."""
    url = colocated.base_url
    messages = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "It is"}]
    body = {"messages": messages, "continue_final_message": True, "add_generation_prompt": False}
    tokens = httpx.post(f"{url}/tokenize", json=body).json()["tokens"]
    closed = httpx.post(f"{url}/tokenize", json={"messages": messages}).json()["tokens"]
    tok = colocated.state.tokenizer
    assert tok.decode(tokens).endswith("<|im_start|>assistant\nIt is")
    assert closed[: len(tokens)] == tokens and len(closed) > len(tokens)
    r = httpx.post(f"{url}/v1/chat/completions", json={**body, "max_tokens": 2})
    assert r.status_code == 200, r.text
    given = {**body, "add_generation_prompt": True}
    defaulted = {"messages": messages, "continue_final_message": True}
    for path in ("/v1/chat/completions", "/tokenize"):
        for both in (given, defaulted):
            r = httpx.post(f"{url}{path}", json=both)
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert error["param"] == "add_generation_prompt", r.text
            assert "send add_generation_prompt: false" in error["message"], r.text


def test_chat_template_kwargs_are_the_templates_on_a_chat_and_on_tokenize(colocated: Stack) -> None:
    """chat_template_kwargs whose names are also the renderer's parameters reach the template
    (a 200, not a 500); a template flag given there acts as the field would, on a chat and on
    /tokenize alike; messages there is a 400."""
    url = colocated.base_url
    messages = [{"role": "user", "content": "2+2?"}]
    odd = {"add_special_tokens": True, "self": 1, "allow_special_in_content": True, "fn": 2}
    plain = httpx.post(f"{url}/tokenize", json={"messages": messages}).json()["tokens"]
    r = httpx.post(f"{url}/tokenize", json={"messages": messages, "chat_template_kwargs": odd})
    assert r.status_code == 200 and r.json()["tokens"] == plain, r.text
    r = httpx.post(f"{url}/v1/chat/completions",
                   json={"messages": messages, "max_tokens": 1, "chat_template_kwargs": odd})  # fmt: skip
    assert r.status_code == 200, r.text
    flag = {"messages": messages, "chat_template_kwargs": {"add_generation_prompt": False}}
    unprompted = httpx.post(f"{url}/tokenize", json=flag).json()["tokens"]
    field = {"messages": messages, "add_generation_prompt": False}
    assert unprompted == httpx.post(f"{url}/tokenize", json=field).json()["tokens"]
    assert len(unprompted) < len(plain)
    for path in ("/v1/chat/completions", "/tokenize"):
        bad = {"messages": messages, "chat_template_kwargs": {"messages": []}}
        r = httpx.post(f"{url}{path}", json=bad)
        assert r.status_code == 400 and "chat_template_kwargs.messages" in r.text, r.text


def test_a_large_tokenize_is_answered_in_full_and_never_holds_the_event_loop(
    colocated: Stack, monkeypatch: pytest.MonkeyPatch
) -> None:
    url, tokenizer = colocated.base_url, colocated.state.tokenizer
    text = "Hello world, and more words. " * 3000  # ~21k tokens: rendered in slices
    r = httpx.post(f"{url}/tokenize", json={"prompt": text}, timeout=60)
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    expected = tokenizer.encode(text)
    assert r.json() == {"count": len(expected), "max_model_len": 2048, "tokens": expected,
                        "token_strs": None}  # fmt: skip
    named = httpx.post(f"{url}/tokenize", json={"prompt": text, "return_token_strs": True},
                       timeout=60).json()  # fmt: skip
    assert named["tokens"] == expected
    assert named["token_strs"] == [tokenizer.id_to_token(t) for t in expected]

    # while a tokenization runs (held here), health checks and other requests are answered
    entered, release = threading.Event(), threading.Event()
    real = tokenizer.encode

    def held(*args: object, **kwargs: object) -> list[int]:
        entered.set()
        assert release.wait(30)
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(tokenizer, "encode", held)
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(httpx.post, f"{url}/tokenize", json={"prompt": "Hi"}, timeout=60)
        assert entered.wait(30)
        assert httpx.get(f"{url}/health", timeout=5).status_code == 200
        assert httpx.get(f"{url}/v1/models", timeout=5).status_code == 200
        release.set()
        assert pending.result().json()["count"] == 1


def test_a_bug_is_an_openai_shaped_500(colocated: Stack, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: object, **kwargs: object) -> list[int]:
        raise RuntimeError("boom")

    monkeypatch.setattr(colocated.state.tokenizer, "encode", broken)
    r = httpx.post(f"{colocated.base_url}/v1/completions", json={"prompt": "hi"})
    assert r.status_code == 500
    assert r.json()["error"]["type"] == "server_error"
    assert "RuntimeError" in r.json()["error"]["message"]


def test_reasoning_effort_reaches_a_template_that_reads_it(
    tokenizer_dir: str, tmp_path: Path, colocated: Stack
) -> None:
    """OpenAI's reasoning_effort renders where the template reads it (gpt-oss's "Reasoning:
    high"); where it does not (the embedded SmolLM2's), it would change nothing: a 400 naming
    it rather than a 200 that ignores it."""
    body = {"messages": [{"role": "user", "content": "hi"}], "reasoning_effort": "high"}
    r = httpx.post(f"{colocated.base_url}/v1/chat/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning_effort", r.text
    path = tmp_path / "effort.jinja"
    path.write_text(
        "Reasoning: {{ reasoning_effort | default('medium') }}<|im_end|>"
        "{% for m in messages %}{{ m.content }}{% endfor %}"
    )
    stack = Stack(tokenizer_dir, ["colocated"], chat_template=str(path)).start()
    try:
        for effort, shown in (("high", "Reasoning: high"), (None, "Reasoning: medium")):
            asked = {**body, "reasoning_effort": effort, "max_tokens": 8}
            r = httpx.post(f"{stack.base_url}/v1/chat/completions", json=asked)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["message"]["content"] == shown  # the fake's echo
    finally:
        stack.stop()
