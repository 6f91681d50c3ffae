"""Contract test: schemathesis generates requests from the served OpenAPI document. For valid
requests the gateway never answers 5xx and every response matches the document (status, content
type, body); for invalid ones (negative mode) it never answers 5xx and uses documented codes."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from typing import Any

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
