"""The request forms that ask for structured output (response_format, structured_outputs, the
guided_* fields) read into one StructuredOutput; malformed or doubled ones are 400s."""

from __future__ import annotations

import json
from typing import Any

import pytest

from gateway.core.errors import APIError
from gateway.flows.fields import Fields
from gateway.flows.structured import parse_structured
from protos.sampling_params import StructuredOutput

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}


def _parse(**body: Any) -> StructuredOutput | None:
    return parse_structured(Fields(body))


@pytest.mark.parametrize(
    ("body", "kind", "spec"),
    [
        ({"response_format": {"type": "json_object"}}, "json_object", ""),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}}},
         "json", json.dumps(SCHEMA)),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "n"}}}, "json_object", ""),
        ({"structured_outputs": {"json": SCHEMA}}, "json", json.dumps(SCHEMA)),
        ({"structured_outputs": {"json": json.dumps(SCHEMA)}}, "json", json.dumps(SCHEMA)),
        ({"structured_outputs": {"regex": "[a-z]+"}}, "regex", "[a-z]+"),
        ({"structured_outputs": {"choice": ["a", "b"]}}, "choice", '["a", "b"]'),
        ({"structured_outputs": {"grammar": "root ::= 'x'"}}, "grammar", "root ::= 'x'"),
        ({"structured_outputs": {"json_object": True}}, "json_object", ""),
        ({"guided_json": SCHEMA}, "json", json.dumps(SCHEMA)),
        ({"guided_regex": "x+", "guided_decoding_backend": "xgrammar"}, "regex", "x+"),
        ({"guided_choice": ["é"]}, "choice", '["é"]'),
        ({"guided_grammar": "start: 'x'"}, "grammar", "start: 'x'"),
    ],
)  # fmt: skip
def test_every_form_reads_into_one_structured_output(body: dict, kind: str, spec: str) -> None:
    so = _parse(**body)
    assert so is not None and (so.kind, so.spec) == (kind, spec)
    assert not so.any_whitespace  # compact JSON unless asked otherwise
    # the field it came from, for a worker's refusal (gateway.flows.generation._attribute)
    field = next(k for k in body if k != "guided_decoding_backend")
    assert so.source == field


def test_a_workers_refusal_of_the_constraint_names_the_clients_field() -> None:
    """A worker names ``structured_outputs`` when it cannot compile a constraint (all it gets
    is the constraint); the gateway's 400 names the field the client sent instead."""
    from gateway.flows.generation import _attribute
    from gateway.workers.rpc_errors import UpstreamError
    from gateway.workers.work import WorkItem
    from protos.sampling_params import SamplingParams

    def refusal(param: str | None, **body: Any) -> str | None:
        item = WorkItem("r", (1,), SamplingParams(structured=_parse(**body)))
        err = UpstreamError(APIError(400, "invalid regex", param=param), retryable=False)
        _attribute(err, item)
        return err.api_error.param

    assert refusal("structured_outputs", guided_regex="(ab") == "guided_regex"
    assert refusal("structured_outputs", response_format={"type": "json_object"}) == (
        "response_format"
    )
    assert refusal("structured_outputs", structured_outputs={"regex": "("}) == "structured_outputs"
    assert refusal("max_tokens", guided_regex="(ab") == "max_tokens"  # another field: as named
    assert refusal("structured_outputs") == "structured_outputs"  # no constraint: as named


def test_nothing_asked_is_none_and_free_whitespace_is_opt_in() -> None:
    assert _parse() is None and _parse(response_format={"type": "text"}) is None
    assert _parse(guided_json=None, guided_regex=None, structured_outputs={}) is None
    so = _parse(structured_outputs={"json": SCHEMA, "disable_any_whitespace": False})
    assert so is not None and so.any_whitespace


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"response_format": {"type": "xml"}}, "response_format", "got 'xml'"),
        ({"response_format": {"type": "json_schema", "json_schema": "x"}}, "response_format", "needs a json_schema object"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}}, "response_format.json_schema.name", "needs a name"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "a b", "schema": SCHEMA}}}, "response_format.json_schema.name", "needs a name"),
        ({"guided_json": "{bad"}, "guided_json", "not valid JSON"),
        ({"guided_json": [1]}, "guided_json", "must be a JSON schema"),
        ({"guided_regex": 5}, "guided_regex", "non-empty string"),
        ({"guided_choice": [1]}, "guided_choice", "non-empty list of strings"),
        ({"guided_choice": []}, "guided_choice", "non-empty list of strings"),
        ({"guided_regex": ""}, "guided_regex", "non-empty string"),
        ({"guided_grammar": ""}, "guided_grammar", "non-empty string"),
        ({"guided_choice": ["a", ""]}, "guided_choice", "empty strings"),
        ({"guided_decoding_backend": "lm-format-enforcer", "guided_regex": "a"}, "guided_decoding_backend", "xgrammar"),
        ({"guided_regex": "a", "guided_grammar": "b"}, "guided_grammar", "give one of"),
        ({"structured_outputs": {}, "guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_*", "one way"),
        ({"structured_outputs": {"regex": "a", "grammar": "b"}}, "structured_outputs", "exactly one"),
        ({"structured_outputs": {"disable_any_whitespace": True}}, "structured_outputs", "exactly one"),
        ({"structured_outputs": {"regex": "a", "backend": "x"}}, "structured_outputs", "backend is not supported"),
        ({"structured_outputs": {"regex": "a", "disable_fallback": "no"}}, "disable_fallback", "true or false"),
        ({"structured_outputs": 3}, "structured_outputs", "must be an object"),
    ],
)  # fmt: skip
def test_malformed_forms_are_400s_that_say_what_to_fix(body: dict, param: str, words: str) -> None:
    with pytest.raises(APIError) as err:
        _parse(**body)
    assert err.value.status == 400 and err.value.param == param, err.value.message
    assert words in err.value.message


def test_disable_additional_properties_closes_every_object() -> None:
    schema = {"type": "object", "properties": {"properties": {"type": "object"},
              "x": {"type": "integer"}}, "additionalProperties": True}  # fmt: skip
    so = _parse(structured_outputs={"json": schema, "disable_additional_properties": True})
    assert so is not None
    closed = json.loads(so.spec)
    assert closed["additionalProperties"] is False
    assert closed["properties"]["properties"]["additionalProperties"] is False
    assert set(closed["properties"]) == {"properties", "x"}  # a property's name is not a keyword
