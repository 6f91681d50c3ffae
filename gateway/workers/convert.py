"""The one place where protobuf messages become plain gateway data and back."""

from __future__ import annotations

from dataclasses import fields
from typing import Any, cast

from gateway.core.events import Chunk, Embedding, EmbedWork, Histogram, Timing, WorkerLoadInfo
from protos import common_pb2, worker_pb2
from protos.logprobs import PositionLogprobs, TokenLogprob
from protos.multimodal import ImageItem
from protos.sampling_params import SamplingParams

FINISH_REASONS = {
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_ABORT: "abort",
}


class WorkerReportedError(RuntimeError):
    """A worker ended a request with FINISH_REASON_ERROR."""


def images_to_pb(images: tuple[ImageItem, ...], with_data: bool = True) -> list[common_pb2.Image]:
    """A prompt's images; ``with_data=False``: without their bytes (where they sit and what they
    hash to: a decode worker so served cannot recompute them if the request is preempted)."""
    out = []
    for im in images:
        data = im.data if with_data else b""
        out.append(common_pb2.Image(offset=im.offset, num_tokens=im.num_tokens, grid=im.grid,
                                    content_hash=im.content_hash, data=data))  # fmt: skip
    return out


def sampling_to_pb(sp: SamplingParams) -> common_pb2.SamplingParams:
    msg = common_pb2.SamplingParams(
        temperature=sp.temperature,
        top_p=sp.top_p,
        top_k=sp.top_k,
        min_p=sp.min_p,
        presence_penalty=sp.presence_penalty,
        frequency_penalty=sp.frequency_penalty,
        repetition_penalty=sp.repetition_penalty,
        max_tokens=sp.max_tokens,
        min_tokens=sp.min_tokens,
        stop=list(sp.stop),
        stop_token_ids=list(sp.stop_token_ids),
        ignore_eos=sp.ignore_eos,
        include_stop_str_in_output=sp.include_stop_str_in_output,
        skip_special_tokens=sp.skip_special_tokens,
        logit_bias=dict(sp.logit_bias),
        lora_name=sp.lora_name,
        cache_salt=sp.cache_salt,
        allowed_token_ids=list(sp.allowed_token_ids),
        bad_words=list(sp.bad_words),
    )
    if sp.seed is not None:
        msg.seed = sp.seed
    if sp.logprobs is not None:
        msg.logprobs = sp.logprobs
    if sp.prompt_logprobs is not None:
        msg.prompt_logprobs = sp.prompt_logprobs
    if sp.structured is not None:
        so = sp.structured
        msg.structured.CopyFrom(
            common_pb2.StructuredOutput(
                kind=so.kind, spec=so.spec, any_whitespace=so.any_whitespace,
                reasoning_start=so.reasoning_start, reasoning_end=so.reasoning_end,
                reasoning_open=so.reasoning_open,
            )
        )  # fmt: skip
    return msg


def embed_request_to_pb(work: EmbedWork) -> worker_pb2.EmbedRequest:
    msg = worker_pb2.EmbedRequest(
        request_id=work.request_id,
        inputs=[worker_pb2.EmbedInput(token_ids=ids) for ids in work.inputs],
        priority=work.priority,
    )
    if work.normalize is not None:
        msg.normalize = work.normalize
    return msg


def embeddings_from_pb(msg: worker_pb2.EmbedResponse) -> list[Embedding]:
    return [
        Embedding(tuple(e.values), e.num_prompt_tokens, e.num_cached_tokens) for e in msg.embeddings
    ]


def _logprob(msg: common_pb2.TokenLogprob) -> TokenLogprob:
    return TokenLogprob(
        token_id=msg.token_id, logprob=msg.logprob, token=msg.token, token_bytes=msg.token_bytes,
        rank=msg.rank,
    )  # fmt: skip


def _positions(entries: Any) -> tuple[PositionLogprobs, ...]:
    return tuple(
        PositionLogprobs(chosen=_logprob(p.chosen), top=tuple(_logprob(t) for t in p.top))
        for p in entries
    )


def timing_from_pb(msg: common_pb2.Timing) -> Timing:
    return Timing(
        queue_s=msg.queue_s,
        prefill_s=msg.prefill_s,
        transfer_s=msg.transfer_s,
        decode_s=msg.decode_s,
    )


def _stop_reason(msg: common_pb2.TokenChunk) -> str | int | None:
    which = msg.WhichOneof("stop_reason")
    return None if which is None else cast("str | int", getattr(msg, which))


def chunk_from_pb(msg: common_pb2.TokenChunk) -> Chunk:
    """Raises WorkerReportedError for an error chunk. Called for every token of every request:
    what a chunk leaves out (logprobs, timing: all but the last) is not converted."""
    if msg.finish_reason == common_pb2.FINISH_REASON_ERROR:
        raise WorkerReportedError(msg.error or "the worker failed this request")
    return Chunk(
        token_ids=tuple(msg.token_ids),
        text=msg.text,
        logprobs=_positions(msg.logprobs) if msg.logprobs else (),
        prompt_logprobs=_positions(msg.prompt_logprobs) if msg.prompt_logprobs else (),
        finish_reason=FINISH_REASONS.get(msg.finish_reason),
        stop_reason=_stop_reason(msg),
        num_prompt_tokens=msg.num_prompt_tokens,
        num_cached_tokens=msg.num_cached_tokens,
        timing=timing_from_pb(msg.timing) if msg.HasField("timing") else Timing(),
    )


def histogram_from_pb(msg: common_pb2.Histogram) -> Histogram:
    """An empty Histogram for one that is malformed (a count per bound, rising, is the rule)."""
    counts = tuple(msg.counts)
    rising = list((*counts, msg.count)) == sorted((*counts, msg.count))
    if len(counts) != len(msg.bounds) or not rising or list(msg.bounds) != sorted(msg.bounds):
        return Histogram()
    return Histogram(bounds=tuple(msg.bounds), counts=counts, sum=msg.sum, count=msg.count)


def load_from_pb(msg: common_pb2.WorkerLoad) -> WorkerLoadInfo:
    plain = {
        f.name: getattr(msg, f.name)
        for f in fields(WorkerLoadInfo)
        if f.name
        not in (
            "iteration_tokens",
            "grammar_compile_seconds",
            "spec_decode_num_accepted_tokens_per_pos",
            "lora_names",
            "lora_paths",
        )
    }
    return WorkerLoadInfo(
        **plain,
        iteration_tokens=histogram_from_pb(msg.iteration_tokens),
        grammar_compile_seconds=histogram_from_pb(msg.grammar_compile_seconds),
        spec_decode_num_accepted_tokens_per_pos=tuple(msg.spec_decode_num_accepted_tokens_per_pos),
        lora_names=tuple(msg.lora_names),
        lora_paths=tuple(msg.lora_paths),
    )


def load_lora_to_pb(name: str, path: str) -> common_pb2.LoadLoRARequest:
    return common_pb2.LoadLoRARequest(lora_name=name, lora_path=path)


def unload_lora_to_pb(name: str) -> common_pb2.UnloadLoRARequest:
    return common_pb2.UnloadLoRARequest(lora_name=name)
