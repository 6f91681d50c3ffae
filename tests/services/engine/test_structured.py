"""Grammar-constrained decoding in the engine: outputs match their schema, regex, choice or
grammar under every sampling option; a batch mixing constrained and free requests leaves the free
ones as they were; the decode side of a hand-off continues the prefill side's grammar; bad specs
are clear errors; the bitmask kernel agrees with its torch reference."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import jsonschema
import pytest
import torch
import xgrammar as xgr

from gateway.flows.tool_parsers import get_parser
from protos.sampling_params import (
    InvalidRequestError,
    SamplingParams,
    StructuredOutput,
)
from services.engine.llm import LLM
from services.engine.structured import (
    CompiledOutput,
    GrammarBatch,
    apply_bitmask,
    apply_bitmask_reference,
)
from tests.services.engine.conftest import move_by_transfer_buffer

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["name", "age"],
}


def _so(kind: str, spec: object = "") -> StructuredOutput:
    return StructuredOutput(kind, spec if isinstance(spec, str) else json.dumps(spec))


SAMPLING_OPTIONS = [
    {"temperature": 0.0},
    {"temperature": 1.0, "seed": 3},
    {"temperature": 0.8, "top_p": 0.9, "top_k": 20, "seed": 5},
    {"temperature": 0.0, "repetition_penalty": 1.3, "logprobs": 2},
    {"temperature": 1.2, "min_p": 0.05, "presence_penalty": 1.0},
]
# (case, spec, sampling knobs) of the constrained runs below, each on the first 4 chat prompts
CASES: list[tuple[str, StructuredOutput, dict]] = [
    *((f"json-{i}", _so("json", PERSON), kw) for i, kw in enumerate(SAMPLING_OPTIONS)),
    ("regex", _so("regex", r"[0-9]{3}-[a-z]{2,4}"), {"temperature": 1.0, "seed": 1}),
    ("choice", _so("choice", ["yes", "no", 'say "maybe"']), {"temperature": 1.0}),
    ("gbnf", _so("grammar", 'root ::= "A" [0-9] [0-9]? "!"'), {}),
    ("lark", _so("grammar", 'start: "x" NUM\nNUM: /[0-9]/'), {}),
    # a JSON object may go on for long: those done within 40 tokens parse (2 of 4, this seed)
    ("json_object", _so("json_object"), {"max_tokens": 40, "temperature": 1.0, "seed": 1}),
    ("ignore_eos", _so("choice", ["yes", "no"]), {"temperature": 0.0, "ignore_eos": True}),
]


@pytest.fixture(scope="module")
def constrained(llm: LLM, chat_ids: list[list[int]]) -> dict[str, list]:
    """Every case of :data:`CASES` and the structural tag's in one generate call (48 requests:
    a decode step serves up to 32 of them at once, rather than a call per case running 4):
    each case's 4 outputs. A request's output is shaped by its own prompt, grammar and seed,
    not by the batch it is in (seeded sampling is batch-invariant: test_llm_engine.py)."""
    tag = ("structural_tag", _so("structural_tag", _tool_call_tag()),
           {"temperature": 1.0, "seed": 2, "max_tokens": 120})  # fmt: skip
    cases = [*CASES, tag]
    params = [SamplingParams(**{"max_tokens": 80, **kw}, structured=so)  # type: ignore[arg-type]
              for _, so, kw in cases for _ in range(4)]  # fmt: skip
    results = llm.generate([ids for _ in cases for ids in chat_ids[:4]], params)
    return {case: [r.outputs[0] for r in results[4 * i : 4 * i + 4]]
            for i, (case, _, _) in enumerate(cases)}  # fmt: skip


@pytest.mark.parametrize("option", range(len(SAMPLING_OPTIONS)))
def test_json_schema_outputs_validate_under_every_sampling_option(
    constrained: dict[str, list], option: int
) -> None:
    for out in constrained[f"json-{option}"]:
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), PERSON)
        if SAMPLING_OPTIONS[option].get("logprobs"):
            assert len(out.logprobs) == len(out.token_ids)


def test_regex_choice_grammar_and_json_object(constrained: dict[str, list]) -> None:
    outs = constrained["regex"]
    assert all(re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", o.text) for o in outs), outs
    assert all(o.text in ("yes", "no", 'say "maybe"') for o in constrained["choice"])
    assert all(re.fullmatch(r"A[0-9]{1,2}!", o.text) for o in constrained["gbnf"])
    assert all(re.fullmatch(r"x[0-9]", o.text) for o in constrained["lark"])
    outs = constrained["json_object"]
    done = [o for o in outs if o.finish_reason == "stop"]
    assert done and all(isinstance(json.loads(o.text), dict) for o in done), outs


def _tool_call_tag() -> dict:
    """The hermes parser's structural tag for strict tools ``add_person`` (:data:`PERSON`,
    nothing else) and ``ping`` under tool_choice "auto", made to call at once (at_least_one)."""
    tag = get_parser("hermes").structural_tag([("add_person", TOOL_SCHEMA), ("ping", None)], False)
    assert tag is not None
    tag["format"]["at_least_one"] = True
    return tag


TOOL_SCHEMA = {**PERSON, "additionalProperties": False}


def test_a_structural_tag_holds_each_call_to_its_functions_schema(
    constrained: dict[str, list],
) -> None:
    """The hermes parser's structural tag (strict tools under tool_choice "auto"), made to
    call at once (at_least_one) and once only: whatever the sampling, the output is one whole
    <tool_call> block whose arguments match the function's schema."""
    outs = constrained["structural_tag"]
    done = [o for o in outs if o.finish_reason == "stop"]
    assert done, outs
    for o in done:
        match = re.fullmatch(r'<tool_call>\n\{"name": "(\w+)", "arguments": (.*)\}\n</tool_call>',
                             o.text, re.S)  # fmt: skip
        assert match is not None, o.text
        arguments = json.loads(match.group(2))
        if match.group(1) == "add_person":
            jsonschema.validate(arguments, TOOL_SCHEMA)
        else:
            assert match.group(1) == "ping" and isinstance(arguments, dict)


@pytest.fixture(scope="module")
def tiny_llm(tiny_llama: Path) -> LLM:
    """For the tests whose claim is the engine's bookkeeping, not the model's text (a free
    request beside constrained ones, matchers dropped, a duplicate id, no token left): a tiny
    random Llama with the embedded model's tokenizer (its vocabulary and chat template, so
    ``chat_ids`` are its prompts too) and the session engine's 32 seats, a step a small
    fraction of the embedded model's. Outputs checked against a schema stay on the embedded
    model: its text is what a user's model gives."""
    return LLM(str(tiny_llama), max_num_seqs=32)


def test_a_mixed_batch_leaves_free_requests_unchanged(
    tiny_llm: LLM, chat_ids: list[list[int]]
) -> None:
    free = SamplingParams(temperature=0.0, max_tokens=24)
    alone = [r.outputs[0].text for r in tiny_llm.generate(chat_ids[:3], free)]
    for i, p in enumerate(chat_ids[:3]):
        tiny_llm.engine.add_request(f"mixed-free-{i}", p, free)
        tiny_llm.engine.add_request(
            f"mixed-json-{i}", p, replace_structured(free, _so("json", PERSON))
        )
    texts: dict[str, str] = {}
    while tiny_llm.engine.has_unfinished:
        for out in tiny_llm.engine.step():
            texts[out.request_id] = texts.get(out.request_id, "") + out.text
    assert [texts[f"mixed-free-{i}"] for i in range(3)] == alone
    assert not tiny_llm.engine.grammars.states  # every matcher dropped at the end


def replace_structured(sp: SamplingParams, so: StructuredOutput) -> SamplingParams:
    return replace(sp, structured=so)


def test_decode_side_continues_the_prefill_sides_grammar(
    llm: LLM, chat_ids: list[list[int]]
) -> None:
    """Prefill samples the first token under the grammar; activate() replays it into a fresh
    matcher, and the rest equals a colocated run token for token (greedy). The prompt's KV
    moves into the reserved blocks as a hand-off moves it (one engine both sides, a request id
    each)."""
    engine, prompt = llm.engine, chat_ids[1]
    sp = SamplingParams(temperature=0.0, max_tokens=60, structured=_so("json", PERSON))
    colocated = llm.generate([prompt], sp)[0].outputs[0].token_ids
    engine.add_request("handoff-p", prompt, replace(sp, max_tokens=1), prefill_only=True)
    while not (first := [o for o in engine.step() if o.request_id == "handoff-p"]):
        pass
    blocks = engine.reserve("handoff", prompt, sp)
    assert blocks is not None
    src = torch.tensor(engine.block_ids("handoff-p"))
    move_by_transfer_buffer(engine, engine, src, torch.tensor(blocks))
    engine.scheduler.release("handoff-p")
    tokens = list(first[0].token_ids)
    assert tokens == colocated[:1]
    assert engine.activate("handoff", prompt, tokens, sp) is None
    while engine.has_unfinished:
        tokens += [t for out in engine.step() for t in out.token_ids]
    assert tokens == colocated


@pytest.mark.parametrize("bounded", [False, True])
def test_json_strings_take_no_raw_control_characters(llm: LLM, bounded: bool) -> None:
    """JSON forbids raw U+0000-U+001F inside a string; xgrammar's strings with a minLength or
    maxLength let them through (a random model sampled a backspace, and json.loads refused
    the output). Tested on the matcher: every such character refused inside a string, in a
    function's arguments too; printable and non-ASCII characters and escapes still taken."""
    spec = {"type": "string", "maxLength": 12} if bounded else {"type": "string"}
    schema = {"type": "object", "properties": {"name": spec}, "required": ["name"]}
    tag = get_parser("hermes").structural_tag([("f", schema)], False)
    assert tag is not None
    tag["format"]["at_least_one"] = True
    compiler = llm.engine.grammar_compiler
    for so, head in (
        (_so("json", schema), '{"name": "a'),
        (_so("structural_tag", tag), '<tool_call>\n{"name": "f", "arguments": {"name": "a'),
    ):
        grammar = compiler.compile(so).grammar
        for code in range(0x20):
            matcher = xgr.GrammarMatcher(grammar)
            assert matcher.accept_string(head), (so.kind, head)
            assert not matcher.accept_string(chr(code)), (so.kind, hex(code))
        matcher = xgr.GrammarMatcher(grammar)
        assert matcher.accept_string(head + (' é"' if bounded else ' é\\t"')), so.kind


def test_replayed_tokens_outside_the_grammar_are_refused(
    llm: LLM, chat_ids: list[list[int]]
) -> None:
    engine, prompt = llm.engine, chat_ids[0]
    sp = SamplingParams(temperature=0.0, max_tokens=8, structured=_so("regex", "[0-9]+"))
    letter = llm.tokenizer.encode("x", add_special_tokens=False)
    assert engine.reserve("replay-bad", prompt, sp) is not None
    with pytest.raises(InvalidRequestError, match="does not match the request's grammar"):
        engine.activate("replay-bad", prompt, letter, sp)
    assert engine.cancel_reservation("replay-bad")
    assert not engine.grammars.states


@pytest.mark.parametrize(
    ("so", "words"),
    [
        (_so("json", {"type": "nope"}), "invalid JSON schema: Unsupported type"),
        (_so("json", "{not json"), "invalid JSON schema"),
        (_so("regex", "(ab"), "invalid regex: Regex parsing error"),
        (_so("grammar", 'root ::= "a" |'), "invalid grammar"),
        (_so("choice", "[1, 2]"), "choice must be a non-empty list of strings"),
        (
            _so("structural_tag", {"type": "structural_tag", "format": {"type": "nope"}}),
            "invalid structural tag",
        ),
    ],
)
def test_bad_specs_are_clear_errors(llm: LLM, so: StructuredOutput, words: str) -> None:
    with pytest.raises(InvalidRequestError) as err:
        llm.engine.compile_grammar(SamplingParams(structured=so))
    assert words in str(err.value) and "/project/" not in str(err.value)
    assert err.value.param == "structured_outputs"


def test_structured_output_needs_a_kind_and_a_value() -> None:
    with pytest.raises(InvalidRequestError, match="must be one of"):
        StructuredOutput("yaml", "x")
    with pytest.raises(InvalidRequestError, match="needs a value"):
        StructuredOutput("regex")


def test_the_thinking_block_is_free_and_the_grammar_starts_after_it(llm: LLM) -> None:
    """A reasoning model: "<think>" (one token here: '<|im_start|>' stands in) may open a free
    block, the end tag closes it, and only then does the grammar constrain."""
    tok = llm.tokenizer
    start, end = tok.convert_tokens_to_ids("<|im_start|>"), tok.encode("</think>")
    grammar = llm.engine.grammar_compiler.compile(_so("regex", "[0-9]+")).grammar
    batch = GrammarBatch(llm.engine.vocab_size, 4, torch.device("cpu"), [2])
    batch.add("r", CompiledOutput(grammar, start, tuple(end), reasoning_open=False))
    digit, letter = tok.encode("7")[0], tok.encode("x")[0]
    assert _allowed(batch.fill(["r"]), start)  # may open the block...
    assert not _allowed(batch.fill(["r"]), letter)  # ...or answer within the grammar
    batch.push("r", start)
    assert batch.fill(["r"]) is None  # thinking: unconstrained
    for t in [*tok.encode("free text, then"), *end]:
        batch.push("r", t)
    mask = batch.fill(["r"])
    assert _allowed(mask, digit) and not _allowed(mask, letter) and not _allowed(mask, start)
    batch.add("answered", CompiledOutput(grammar, start, tuple(end)))
    batch.push("answered", digit)
    assert batch.states["answered"].phase == "grammar"
    batch.add("opened", CompiledOutput(grammar, start, tuple(end), reasoning_open=True))
    assert batch.fill(["opened"]) is None


def test_a_grammar_refusing_a_token_leaves_only_its_end(llm: LLM) -> None:
    grammar = llm.engine.grammar_compiler.compile(_so("regex", "[0-9]+")).grammar
    batch = GrammarBatch(llm.engine.vocab_size, 2, torch.device("cpu"), [2])
    batch.add("r", CompiledOutput(grammar))
    batch.push("r", llm.tokenizer.encode("x")[0])  # never sampled under the mask: a bug
    mask = batch.fill(["r"])
    allowed = [t for t in range(llm.engine.vocab_size) if _allowed(mask, t)]
    assert allowed == [2] and batch.ends_with("r", 2)


def test_ignore_eos_still_ends_where_the_grammar_does(constrained: dict[str, list]) -> None:
    outs = constrained["ignore_eos"]
    assert all(o.text in ("yes", "no") and o.finish_reason == "stop" for o in outs)


def _allowed(allowed: tuple[torch.Tensor, list[int]] | None, token: int) -> bool:
    assert allowed is not None
    bitmask, rows = allowed
    return bool((int(bitmask[rows[0], token // 32]) >> (token % 32)) & 1)


@pytest.mark.parametrize(("rows", "vocab"), [(1, 1), (3, 31), (4, 32), (5, 33), (8, 49152)])
def test_bitmask_kernel_matches_the_reference(rows: int, vocab: int) -> None:
    gen = torch.Generator().manual_seed(rows * vocab)
    logits = torch.randn(rows, vocab, generator=gen)
    words = -(-vocab // 32)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (rows, words), dtype=torch.int32, generator=gen)
    constrained = list(range(0, rows, 2))
    ours, ref = logits.clone(), logits.clone()
    apply_bitmask(ours, bitmask, constrained)
    apply_bitmask_reference(ref, bitmask, constrained)
    assert torch.equal(ours, ref)
    assert torch.equal(ours[1::2], logits[1::2])  # rows not listed are untouched


def test_a_duplicate_request_id_keeps_the_live_requests_grammar(
    tiny_llm: LLM, chat_ids: list[list[int]]
) -> None:
    engine = tiny_llm.engine
    sp = SamplingParams(temperature=0.0, max_tokens=8, structured=_so("regex", "[0-9]+"))
    engine.add_request("dup", chat_ids[0], sp)
    state = engine.grammars.states["dup"]
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("dup", chat_ids[1], sp)
    assert engine.grammars.states["dup"] is state
    texts = ""
    while engine.has_unfinished:
        texts += "".join(o.text for o in engine.step() if o.request_id == "dup")
    assert re.fullmatch("[0-9]+", texts)


def _drain(engine: object) -> dict[str, list]:
    """Step until nothing is left; each request's outputs in order."""
    outs: dict[str, list] = {}
    while engine.has_unfinished:  # type: ignore[attr-defined]
        for out in engine.step():  # type: ignore[attr-defined]
            outs.setdefault(out.request_id, []).append(out)
    return outs


FREE = SamplingParams(temperature=0.0, max_tokens=12)


@pytest.fixture(scope="module")
def alone(tiny_llm: LLM, chat_ids: list[list[int]]) -> list[int]:
    """The second chat prompt's greedy tokens run alone (computed once for both cases below)."""
    return tiny_llm.generate([chat_ids[1]], FREE)[0].outputs[0].token_ids


@pytest.mark.parametrize(
    ("so", "sampled"),
    [
        (_so("choice", ["yes", "no"]), 0),  # "x" starts neither: nothing at the first token
        (_so("json", PERSON), 1),  # "{" may start it, and then nothing is left
    ],
)
def test_a_grammar_and_allowed_token_ids_that_leave_no_token_end_the_request_with_an_error(
    tiny_llm: LLM, chat_ids: list[list[int]], so: StructuredOutput, sampled: int, alone: list[int]
) -> None:
    """The grammar's next tokens and allowed_token_ids meet nowhere (no static check can see
    it): the request ends there, finish_reason "error", an error naming the fields (token 0
    was sampled before); its blocks and matcher are freed, and a request beside it runs as
    it would alone."""
    engine = tiny_llm.engine
    brace, x = tiny_llm.tokenizer.encode("{")[0], tiny_llm.tokenizer.encode("x")[0]
    sp = SamplingParams(temperature=0.0, max_tokens=12, structured=so, allowed_token_ids=[brace, x])
    engine.add_request("none-left", chat_ids[0], sp)
    engine.add_request("beside", chat_ids[1], FREE)
    outs = _drain(engine)
    last = outs["none-left"][-1]
    assert [t for o in outs["none-left"] for t in o.token_ids] == [brace] * sampled
    assert last.finished and last.finish_reason == "error"
    assert last.error_param == "allowed_token_ids"  # the gateway's 400 names it
    assert last.error == (
        "no token is allowed at this point of the output: the structured output's grammar (from "
        "response_format, structured_outputs, a guided_* field or tool_choice) and "
        "allowed_token_ids together leave none; loosen the grammar or allow more tokens"
    )
    assert [t for o in outs["beside"] for t in o.token_ids] == alone
    assert outs["beside"][-1].error is None
    (offline,) = tiny_llm.generate([chat_ids[0]], sp)[0].outputs  # the offline API says why too
    assert offline.finish_reason == "error" and offline.error == last.error
    assert engine.kv.all_free() and not engine.grammars.states and not engine._detok
    assert not engine.scheduler.requests


def test_no_token_left_on_either_side_of_a_hand_off(
    tiny_llm: LLM, chat_ids: list[list[int]]
) -> None:
    """Disaggregated: the prefill side's first token finds nothing left (it keeps its blocks
    for the transfer until released, as after any first token), or the decode side's next
    one does: either ends with the same error, never a token 0 for the decode side to
    refuse as output_token_ids outside the grammar."""
    engine, prompt = tiny_llm.engine, chat_ids[0]
    brace, x = tiny_llm.tokenizer.encode("{")[0], tiny_llm.tokenizer.encode("x")[0]
    choice = SamplingParams(temperature=0.0, max_tokens=1, allowed_token_ids=[x],
                            structured=_so("choice", ["yes", "no"]))  # fmt: skip
    engine.add_request("prefill-side", prompt, choice, prefill_only=True)
    (first,) = _drain(engine)["prefill-side"]
    assert first.token_ids == [] and first.finish_reason == "error"
    assert first.error_param == "allowed_token_ids" and "grammar" in (first.error or "")
    assert list(engine.scheduler.held) == ["prefill-side"]
    engine.abort("prefill-side")  # the prefill worker's release, once no transfer reads them
    assert engine.kv.all_free()
    sp = SamplingParams(temperature=0.0, max_tokens=12, allowed_token_ids=[brace],
                        structured=_so("json", PERSON))  # fmt: skip
    assert engine.reserve("decode-side", prompt, sp) is not None
    assert engine.activate("decode-side", prompt, [brace], sp) is None  # "{" was the first
    (out,) = _drain(engine)["decode-side"]
    assert out.token_ids == [] and out.finish_reason == "error"
    assert out.error_param == "allowed_token_ids" and out.error == first.error
    assert engine.kv.all_free() and not engine.grammars.states
