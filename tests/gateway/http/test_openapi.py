"""Contract test: schemathesis generates requests from the served OpenAPI document. For valid
requests the gateway never answers 5xx and every response matches the document (status, content
type, body); for invalid ones (negative mode) it never answers 5xx and uses documented codes."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from gateway.flows import embeddings, protocol, unsupported
from gateway.flows.fields import Fields
from gateway.http.admin_api import REQUEST_TABLES, openapi_document
from tests.gateway.stack import Stack

pytestmark = pytest.mark.timeout(120)
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
]


@pytest.fixture(scope="module")
def contract_stack(tokenizer_dir: str) -> Iterator[Stack]:
    # a short context and a small fan-out keep every generated request cheap; the colocated
    # worker serves /v1/embeddings (--task embed), the pair everything else
    stack = Stack(tokenizer_dir, ["prefill", "decode", "colocated"], max_fanout=8)
    stack.start()
    for w in stack.workers:
        w.behavior.max_model_len = 64
    stack.role("colocated")[0].behavior.task = "embed"
    stack.run(stack.state.registry.poll_all())
    try:
        yield stack
    finally:
        stack.stop()


def _operations(base_url: str) -> list[Any]:
    schema = schemathesis.openapi.from_url(f"{base_url}/openapi.json")
    return [result.ok() for result in schema.get_all_operations()]


def _checker(operation: Any, mode: GenerationMode) -> Callable[[], None]:
    checks = CHECKS if mode == GenerationMode.POSITIVE else CHECKS[:2]

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(
        max_examples=30,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        derandomize=True,
        database=None,
    )
    def check(case: Any) -> None:
        case.call_and_validate(checks=checks, timeout=20)

    return check


def test_api_conforms_to_its_openapi_document(contract_stack: Stack) -> None:
    operations = _operations(contract_stack.base_url)
    labels = {op.label for op in operations}  # schemathesis skips /openapi.json itself
    assert {"POST /v1/completions", "POST /v1/chat/completions", "POST /v1/embeddings",
            "POST /tokenize", "POST /v1/responses", "GET /v1/responses/{response_id}",
            "GET /v1/responses/{response_id}/input_items",
            "POST /v1/responses/{response_id}/cancel"} <= labels  # fmt: skip
    for operation, mode in itertools.product(operations, GenerationMode):
        if mode == GenerationMode.NEGATIVE and (
            operation.method.upper() != "POST" or not operation.body
        ):
            continue  # nothing to get wrong in a GET or a POST without a body (only a path)
        _checker(operation, mode)()


MSGS = [{"role": "user", "content": "hi"}]
# each request schema's parsers, with the bodies that lead them through every field they read
PARSERS: dict[str, list[Callable[[], Any]]] = {
    "CompletionRequest": [partial(protocol.parse_completion, {"prompt": "hi"})],
    "ChatCompletionRequest": [partial(protocol.parse_chat, {"messages": MSGS})],
    "EmbeddingRequest": [partial(embeddings.parse_embedding, {"input": "hi"}),
                         partial(embeddings.parse_embedding, {"messages": MSGS})],
    "TokenizeRequest": [partial(protocol.parse_tokenize, {"prompt": "hi"}, 100),
                        partial(protocol.parse_tokenize, {"messages": MSGS}, 100)],
}  # fmt: skip


def test_the_document_lists_every_field_the_server_accepts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each request schema (additionalProperties false) names exactly the fields its parser
    reads, those its tables take with a value that asks for nothing, and the no-effect ones:
    a field accepted but not documented (or documented but refused) fails here."""
    schemas = openapi_document()["components"]["schemas"]
    accepted: set[str] = set()

    def record(f: Fields, *tables: dict[str, Any]) -> None:
        accepted.update(f.read, *tables, unsupported.NO_EFFECT)

    for module in (protocol, embeddings):
        monkeypatch.setattr(module, "refuse_unknown", record)
    assert set(PARSERS) == set(REQUEST_TABLES)
    for name, parsers in PARSERS.items():
        accepted.clear()
        for parse in parsers:
            parse()
        schema = schemas[name]
        assert schema["additionalProperties"] is False, name
        assert sorted(set(schema["properties"]) - accepted) == [], name
        assert sorted(accepted - set(schema["properties"])) == [], name


def test_the_fields_taken_only_when_neutral_are_documented_so(colocated: Stack) -> None:
    """The fields QA found accepted but undocumented: each in the served document, and a body
    with its documented values answered 200."""
    document = httpx.get(f"{colocated.base_url}/openapi.json").json()["components"]["schemas"]
    cases = {
        "/v1/completions": ("CompletionRequest", {"prompt": "hi", "max_tokens": 1}, {
            "metadata": {"k": "v"}, "prompt_cache_key": "k", "safety_identifier": "s",
            "suffix": "", "best_of": 1, "use_beam_search": False, "length_penalty": 1.0,
            "vllm_xargs": None, "kv_transfer_params": None, "logits_processors": None,
        }),
        "/v1/chat/completions": ("ChatCompletionRequest", {"messages": MSGS, "max_tokens": 1}, {
            "metadata": {"k": "v"}, "store": False, "service_tier": "auto",
            "modalities": ["text"], "prompt_cache_key": "k", "safety_identifier": "s",
            "prompt_cache_retention": "in_memory", "verbosity": None, "functions": None,
            "chat_template": None, "documents": None, "media_io_kwargs": None,
        }),
    }  # fmt: skip
    for path, (name, body, extra) in cases.items():
        properties = document[name]["properties"]
        assert sorted(set(extra) - set(properties)) == [], name
        r = httpx.post(f"{colocated.base_url}{path}", json={**body, **extra})
        assert r.status_code == 200, r.text[:300]
    assert document["CompletionRequest"]["properties"]["use_beam_search"]["enum"] == [
        None,
        False,
        "",
        [],
        {},
    ]
