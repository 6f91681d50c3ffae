"""Protobuf <-> plain dataclasses at the workers' edge (``services.common.convert``)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from gateway.core.events import Embedding, EmbedWork
from gateway.workers.convert import (
    embed_request_to_pb,
    embeddings_from_pb,
    load_from_pb,
    sampling_to_pb,
)
from protos import common_pb2, worker_pb2
from protos.logprobs import PositionLogprobs, TokenLogprob
from protos.pooling_params import PoolingParams
from protos.sampling_params import (
    InvalidRequestError,
    SamplingParams,
    StructuredOutput,
)
from services.common.convert import (
    add_output,
    embedding_to_pb,
    histogram_to_pb,
    merge_output,
    output_to_chunk,
    pooling_from_pb,
    sampling_from_pb,
)
from services.config import PoolerConfig
from services.engine.outputs import RequestOutput
from services.engine.step_stats import TokenHistogram


def test_sampling_params_survive_the_wire() -> None:
    sp = SamplingParams(temperature=0.75, top_p=0.875, top_k=20, min_p=0.0625, seed=7,
                        presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=1.125,
                        max_tokens=33, min_tokens=2, stop=("\n\n", "END"), stop_token_ids=(5,),
                        ignore_eos=True, logprobs=3, include_stop_str_in_output=True,
                        skip_special_tokens=False)  # fmt: skip
    assert sampling_from_pb(sampling_to_pb(sp)) == sp  # values exact in float32


def test_prompt_logprobs_survive_the_wire() -> None:
    sp = sampling_from_pb(sampling_to_pb(SamplingParams(max_tokens=4, prompt_logprobs=0)))
    assert sp.prompt_logprobs == 0
    assert sampling_from_pb(sampling_to_pb(SamplingParams(max_tokens=4))).prompt_logprobs is None
    entry = PositionLogprobs(
        TokenLogprob(7, -1.5, "a", b"a", rank=3), (TokenLogprob(8, -0.5, "b"),)
    )
    chunk = output_to_chunk(RequestOutput("r", [1], "x", False, prompt_logprobs=[entry]))
    assert (
        chunk.prompt_logprobs[0].chosen.rank == 3 and chunk.prompt_logprobs[0].top[0].token_id == 8
    )


def test_a_structured_output_survives_the_wire() -> None:
    so = StructuredOutput("json", '{"type": "object"}', any_whitespace=True,
                          reasoning_start="<think>", reasoning_end="</think>", reasoning_open=True)  # fmt: skip
    sp = sampling_from_pb(sampling_to_pb(SamplingParams(max_tokens=4, structured=so)))
    assert sp.structured == so
    assert sampling_from_pb(sampling_to_pb(SamplingParams(max_tokens=4))).structured is None


def test_unset_optional_fields_mean_off() -> None:
    sp = sampling_from_pb(common_pb2.SamplingParams(max_tokens=4))
    assert (sp.seed, sp.logprobs, sp.top_p, sp.repetition_penalty) == (None, None, 1.0, 1.0)


@pytest.mark.parametrize(
    "msg",
    [
        common_pb2.SamplingParams(max_tokens=0),  # proto3 cannot tell 0 from unset
        common_pb2.SamplingParams(max_tokens=-3),
        common_pb2.SamplingParams(max_tokens=4, temperature=-0.5),
        common_pb2.SamplingParams(max_tokens=4, top_p=1.5),
        common_pb2.SamplingParams(max_tokens=4, min_tokens=9),
    ],
)
def test_out_of_range_values_are_refused(msg: common_pb2.SamplingParams) -> None:
    with pytest.raises(InvalidRequestError):
        sampling_from_pb(msg)


def test_a_final_output_carries_its_reason_and_logprobs() -> None:
    lp = PositionLogprobs(TokenLogprob(9, -0.1, "a"), (TokenLogprob(9, -0.1, "a"),))
    out = RequestOutput("r", [9], "a", True, "stop", "END", 5, 2, [lp])
    chunk = output_to_chunk(out)
    assert (chunk.finish_reason, chunk.stop_string) == (common_pb2.FINISH_REASON_STOP, "END")
    assert (chunk.num_prompt_tokens, chunk.num_cached_tokens) == (5, 2)
    assert chunk.logprobs[0].chosen.token_id == 9 and chunk.logprobs[0].top[0].token == "a"
    # the prefill worker reports a first token that does not end the request
    assert output_to_chunk(out, finished=False).finish_reason == 0
    assert output_to_chunk(out, finished=False).WhichOneof("stop_reason") is None


@pytest.mark.parametrize("stop_reason", ["END", "42", 42, None])
def test_a_stop_string_and_a_stop_token_id_keep_their_kind_on_the_wire(
    stop_reason: str | int | None,
) -> None:
    """A stop string of digits stays a string, a token id an int; EOS (None) sets neither."""
    out = RequestOutput("r", [9], "a", True, "stop", stop_reason, 5, 2, [])
    batch = common_pb2.ChunkBatch()
    for chunk in (output_to_chunk(out), add_output(batch.chunks, "r", out)):
        which = chunk.WhichOneof("stop_reason")
        got = None if which is None else getattr(chunk, which)
        assert got == stop_reason and type(got) is type(stop_reason)


@pytest.mark.parametrize("finished", [False, True])
def test_a_chunk_built_in_a_batch_equals_the_one_built_alone(finished: bool) -> None:
    lp = PositionLogprobs(TokenLogprob(9, -0.1, "a"), (TokenLogprob(3, -2.0, "b"),))
    reason = "stop" if finished else None
    out = RequestOutput("r", [9], "a", finished, reason, "END" if finished else None, 5, 2, [lp],
                        prompt_logprobs=[lp])  # fmt: skip
    timing = common_pb2.Timing(queue_s=0.5, decode_s=1.0) if finished else None
    batch = common_pb2.ChunkBatch()
    add_output(batch.chunks, "r", out, timing)
    assert batch.chunks[0] == output_to_chunk(out, timing=timing)


def test_outputs_merged_into_a_chunk_equal_the_merged_output() -> None:
    lp = PositionLogprobs(TokenLogprob(9, -0.1, "a"))
    first = RequestOutput("r", [9], "a", False, None, None, 5, 2, [lp])
    last = RequestOutput("r", [10, 11], "bc", True, "length", None, 0, 3, [lp, lp], error="x")
    timing = common_pb2.Timing(decode_s=2.0)
    batch = common_pb2.ChunkBatch()
    chunk = add_output(batch.chunks, "r", first)
    merge_output(chunk, last, timing)
    assert batch.chunks[0] == output_to_chunk(first.merged(last), timing=timing)


def test_a_partial_characters_bytes_reach_the_gateways_chat_logprobs() -> None:
    from gateway.http.formats import chat_logprobs
    from gateway.workers.convert import chunk_from_pb

    part = TokenLogprob(40303, -0.2, " \ufffd", b" \xf0\x9f\x98")
    whole = TokenLogprob(284, -1.5, " and")  # no bytes given: its text's UTF-8
    out = RequestOutput("r", [40303], "", False, logprobs=[PositionLogprobs(part, (part, whole))])
    chunk = chunk_from_pb(output_to_chunk(out))
    content = chat_logprobs(chunk.logprobs)["content"][0]
    assert content["bytes"] == [0x20, 0xF0, 0x9F, 0x98] and content["token"] == " \ufffd"
    assert [t["bytes"] for t in content["top_logprobs"]] == [
        [0x20, 0xF0, 0x9F, 0x98],
        list(b" and"),
    ]


def test_the_gateway_reads_a_last_chunk_whole_and_a_plain_one_with_defaults() -> None:
    from gateway.core.events import Chunk, Timing
    from gateway.workers.convert import chunk_from_pb

    lp = PositionLogprobs(TokenLogprob(9, -0.5, "a"), (TokenLogprob(3, -2.0, "b"),))  # exact
    last = RequestOutput("r", [9], "a", True, "stop", "END", 5, 2, [lp], prompt_logprobs=[lp])
    timing = common_pb2.Timing(queue_s=0.5, prefill_s=0.25, transfer_s=0.125, decode_s=1.0)
    assert chunk_from_pb(output_to_chunk(last, timing=timing)) == Chunk(
        (9,), "a", (lp,), "stop", "END", 5, 2, Timing(0.5, 0.25, 0.125, 1.0), (lp,)
    )
    plain = chunk_from_pb(output_to_chunk(RequestOutput("r", [4], "x", False)))
    assert plain == Chunk((4,), "x") and plain.timing is not Chunk().timing


def test_logit_bias_survives_the_wire() -> None:
    sp = SamplingParams(logit_bias={"7042": -100, 5: 2.5})  # type: ignore[arg-type]
    assert sampling_from_pb(sampling_to_pb(sp)).logit_bias == ((5, 2.5), (7042, -100.0))


def test_the_step_histogram_reaches_the_gateway_as_reported() -> None:
    from gateway.core.events import Histogram
    from gateway.workers.convert import load_from_pb

    h = TokenHistogram((1, 8))
    for tokens in (1, 5, 40):
        h.observe(tokens)
    wire = common_pb2.WorkerLoad(role="decode", iteration_tokens=histogram_to_pb(h.snapshot()))
    got = load_from_pb(common_pb2.WorkerLoad.FromString(wire.SerializeToString()))
    assert got.iteration_tokens == Histogram(bounds=(1.0, 8.0), counts=(1, 2), sum=46.0, count=3)
    assert got.role == "decode"
    older = load_from_pb(common_pb2.WorkerLoad(role="decode"))  # a worker without the field
    assert older.iteration_tokens == Histogram()


@pytest.mark.parametrize(
    "bad",
    [
        common_pb2.Histogram(bounds=[1, 8], counts=[1], count=1),  # a count missing
        common_pb2.Histogram(bounds=[1, 8], counts=[2, 1], count=2),  # not cumulative
        common_pb2.Histogram(bounds=[1, 8], counts=[1, 2], count=1),  # +Inf below a bucket
        common_pb2.Histogram(bounds=[8, 1], counts=[1, 2], count=2),  # bounds not ascending
    ],
)
def test_a_malformed_histogram_is_dropped(bad: common_pb2.Histogram) -> None:
    from gateway.core.events import Histogram
    from gateway.workers.convert import histogram_from_pb

    assert histogram_from_pb(bad) == Histogram()


def test_an_embed_request_and_its_vectors_survive_the_wire() -> None:
    """Gateway -> worker -> gateway: inputs in order, normalize only where the client set it,
    float32 values exact; the worker's --pooler-config fills what the request leaves out."""
    work = EmbedWork("embd-1", ((1, 2, 3), (9,)), normalize=False, priority=-2)
    msg = worker_pb2.EmbedRequest.FromString(embed_request_to_pb(work).SerializeToString())
    assert [list(x.token_ids) for x in msg.inputs] == [[1, 2, 3], [9]]
    assert (msg.request_id, msg.priority) == ("embd-1", -2)
    pooler = PoolerConfig("mean", normalize=True)
    assert pooling_from_pb(msg, pooler) == PoolingParams("mean", normalize=False)
    unset = embed_request_to_pb(replace(work, normalize=None))
    assert not unset.HasField("normalize")
    assert pooling_from_pb(unset, pooler) == PoolingParams("mean", normalize=True)
    values = [0.5, -1.25, 2.0**-30, 1234.5]  # float32-exact
    outs = [RequestOutput(f"embd-1-{i}", [], "", True, "stop", num_prompt_tokens=n,
                          num_cached_tokens=c, embedding=values[i:])
            for i, (n, c) in enumerate([(3, 0), (1, 1)])]  # fmt: skip
    reply = worker_pb2.EmbedResponse(embeddings=[embedding_to_pb(o) for o in outs])
    back = embeddings_from_pb(worker_pb2.EmbedResponse.FromString(reply.SerializeToString()))
    assert back == [Embedding(tuple(values), 3, 0), Embedding(tuple(values[1:]), 1, 1)]


def test_the_worker_task_reaches_the_gateway() -> None:
    assert load_from_pb(common_pb2.WorkerLoad(task="embed")).task == "embed"
    assert load_from_pb(common_pb2.WorkerLoad()).task == ""  # an older worker: generate


def test_images_survive_the_wire_and_a_decode_worker_gets_no_bytes() -> None:
    from gateway.workers.convert import images_to_pb
    from protos.multimodal import ImageItem, content_hash
    from services.common.convert import images_from_pb

    data = b"\x89PNG pretend"
    items = (ImageItem(3, 16, (1, 8, 8), content_hash(data), data),)
    assert images_from_pb(images_to_pb(items)) == items
    placed = images_from_pb(images_to_pb(items, with_data=False))
    assert placed == (ImageItem(3, 16, (1, 8, 8), content_hash(data), b""),)


def test_a_malformed_image_is_refused() -> None:
    from protos.multimodal import content_hash
    from services.common.convert import images_from_pb

    good = {"offset": 0, "num_tokens": 4, "grid": [1, 4, 4], "content_hash": content_hash(b"x")}
    for bad in ({"grid": [4, 4]}, {"content_hash": b"short"}, {"num_tokens": 0},
                {"data": b"not x"}):  # fmt: skip
        with pytest.raises(InvalidRequestError, match="image"):
            images_from_pb([common_pb2.Image(**{**good, **bad})])


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, -1.0, -1e-9])
def test_a_duration_that_is_not_a_finite_number_of_seconds_at_least_0_is_refused(
    value: float,
) -> None:
    from services.common.convert import seconds_from_pb

    with pytest.raises(InvalidRequestError) as caught:
        seconds_from_pb(value, "wait_s", "no wait")
    assert caught.value.param == "wait_s"
    message = str(caught.value)
    assert message.startswith("wait_s must be a finite number of seconds >= 0")
    assert "(0 or unset: no wait)" in message and message.endswith(f"got {value}")


@pytest.mark.parametrize("value", [0.0, 1e-9, 2.5, 1e9])
def test_a_finite_duration_at_least_0_passes_as_is(value: float) -> None:
    from services.common.convert import seconds_from_pb

    assert seconds_from_pb(value, "ttl_s", "10 s") == value
