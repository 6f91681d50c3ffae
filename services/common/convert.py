"""The one place where protobuf meets the workers' plain dataclasses."""

from __future__ import annotations

import math
from typing import Any

from protos import common_pb2, worker_pb2
from protos.logprobs import PositionLogprobs, TokenLogprob
from protos.multimodal import ImageItem, content_hash
from protos.pooling_params import PoolingParams
from protos.sampling_params import (
    InvalidRequestError,
    SamplingParams,
    StructuredOutput,
    logit_bias_pairs,
)
from services.config import PoolerConfig
from services.engine.llm_engine import EngineStats
from services.engine.outputs import RequestOutput
from services.engine.step_stats import HistogramSnapshot

FINISH = {
    None: common_pb2.FINISH_REASON_UNSPECIFIED,
    "stop": common_pb2.FINISH_REASON_STOP,
    "length": common_pb2.FINISH_REASON_LENGTH,
    "abort": common_pb2.FINISH_REASON_ABORT,
    "error": common_pb2.FINISH_REASON_ERROR,
}


def sampling_from_pb(msg: common_pb2.SamplingParams) -> SamplingParams:
    """Raises InvalidRequestError for values out of range. max_tokens has no default: proto3
    cannot tell 0 from unset, so 0 is refused (the gateway always settles it first)."""
    return SamplingParams(
        temperature=msg.temperature,
        top_p=msg.top_p if msg.top_p else 1.0,
        top_k=msg.top_k,
        min_p=msg.min_p,
        seed=msg.seed if msg.HasField("seed") else None,
        presence_penalty=msg.presence_penalty,
        frequency_penalty=msg.frequency_penalty,
        repetition_penalty=msg.repetition_penalty if msg.repetition_penalty else 1.0,
        max_tokens=msg.max_tokens,
        min_tokens=msg.min_tokens,
        stop=tuple(msg.stop),
        stop_token_ids=tuple(msg.stop_token_ids),
        ignore_eos=msg.ignore_eos,
        logprobs=msg.logprobs if msg.HasField("logprobs") else None,
        include_stop_str_in_output=msg.include_stop_str_in_output,
        skip_special_tokens=msg.skip_special_tokens,
        logit_bias=logit_bias_pairs(msg.logit_bias),
        structured=structured_from_pb(msg.structured) if msg.HasField("structured") else None,
        prompt_logprobs=msg.prompt_logprobs if msg.HasField("prompt_logprobs") else None,
        lora_name=msg.lora_name,
        cache_salt=msg.cache_salt,
        allowed_token_ids=tuple(msg.allowed_token_ids),
        bad_words=tuple(msg.bad_words),
    )


def seconds_from_pb(value: float, field: str, unset: str) -> float:
    """A request's duration field (a ``double`` of seconds): a finite number >= 0, else
    InvalidRequestError naming ``field``. ``unset`` says what 0 means for it (proto3 cannot tell
    0 from unset), for the refusal's message. A NaN, which compares false to everything, or an
    infinity never reaches the timers and queues that would use it."""
    if not (math.isfinite(value) and value >= 0):
        raise InvalidRequestError(
            f"{field} must be a finite number of seconds >= 0 (0 or unset: {unset}), "
            f"got {value}", field,
        )  # fmt: skip
    return float(value)


def images_from_pb(msgs: Any) -> tuple[ImageItem, ...]:
    """A request's images (``repeated Image``); InvalidRequestError for a malformed one."""
    out = []
    for m in msgs:
        if len(m.grid) != 3 or m.num_tokens < 1 or m.offset < 0 or len(m.content_hash) != 16:
            raise InvalidRequestError(
                "an image needs an offset, a token count, a (t, h, w) grid and a 16-byte "
                "content hash", "images"
            )  # fmt: skip
        if m.data and content_hash(m.data) != m.content_hash:
            raise InvalidRequestError("an image's content_hash is not its data's", "images")
        grid = (int(m.grid[0]), int(m.grid[1]), int(m.grid[2]))
        out.append(ImageItem(m.offset, m.num_tokens, grid, bytes(m.content_hash), bytes(m.data)))
    return tuple(out)


def structured_from_pb(msg: common_pb2.StructuredOutput) -> StructuredOutput:
    return StructuredOutput(
        kind=msg.kind, spec=msg.spec, any_whitespace=msg.any_whitespace,
        reasoning_start=msg.reasoning_start, reasoning_end=msg.reasoning_end,
        reasoning_open=msg.reasoning_open,
    )  # fmt: skip


def pooling_from_pb(msg: worker_pb2.EmbedRequest, pooler: PoolerConfig) -> PoolingParams:
    """The worker's ``--pooler-config``, with the request's ``normalize`` where it set one."""
    normalize = msg.normalize if msg.HasField("normalize") else pooler.normalize
    return PoolingParams(pooler.pooling_type, normalize)


def embedding_to_pb(out: RequestOutput) -> worker_pb2.Embedding:
    return worker_pb2.Embedding(
        values=out.embedding or [], num_prompt_tokens=out.num_prompt_tokens,
        num_cached_tokens=out.num_cached_tokens,
    )  # fmt: skip


def _lp(t: TokenLogprob) -> common_pb2.TokenLogprob:
    return common_pb2.TokenLogprob(
        token_id=t.token_id, logprob=t.logprob, token=t.token, token_bytes=t.token_bytes,
        rank=t.rank,
    )  # fmt: skip


def _pos(p: PositionLogprobs) -> common_pb2.PositionLogprobs:
    return common_pb2.PositionLogprobs(chosen=_lp(p.chosen), top=[_lp(t) for t in p.top])


def output_to_chunk(
    out: RequestOutput, finished: bool | None = None, timing: common_pb2.Timing | None = None
) -> common_pb2.TokenChunk:
    done = out.finished if finished is None else finished
    chunk = common_pb2.TokenChunk(
        request_id=out.request_id,
        token_ids=out.token_ids,
        text=out.text,
        logprobs=[_pos(p) for p in out.logprobs],
        prompt_logprobs=[_pos(p) for p in out.prompt_logprobs],
        finish_reason=FINISH[out.finish_reason if done else None],
        num_prompt_tokens=out.num_prompt_tokens,
        num_cached_tokens=out.num_cached_tokens,
        timing=timing,
        error=out.error or "",
    )
    if done:
        _set_stop_reason(chunk, out.stop_reason)
    return chunk


def _set_stop_reason(chunk: common_pb2.TokenChunk, stop_reason: str | int | None) -> None:
    """vLLM's stop_reason on the wire: a stop string and a stop token id each in a field of its
    own (a stop string of digits is not a token id)."""
    if isinstance(stop_reason, str):
        chunk.stop_string = stop_reason
    elif stop_reason is not None:
        chunk.stop_token_id = stop_reason


def add_output(
    chunks: Any, request_id: str, out: RequestOutput, timing: common_pb2.Timing | None = None
) -> common_pb2.TokenChunk:
    """``out`` as a new TokenChunk at the end of ``chunks`` (a ChunkBatch's repeated field),
    built in place from the fields it sets: a multiplexed stream's per-token path, where
    building a chunk and copying it into the batch cost ~5x as much."""
    chunk = chunks.add(
        request_id=request_id, token_ids=out.token_ids, text=out.text,
        num_prompt_tokens=out.num_prompt_tokens, num_cached_tokens=out.num_cached_tokens,
    )  # fmt: skip
    if out.finished or out.logprobs or out.prompt_logprobs or out.error:
        _add_rest(chunk, out, timing)
    return chunk


def merge_output(
    chunk: common_pb2.TokenChunk, out: RequestOutput, timing: common_pb2.Timing | None = None
) -> None:
    """A later output of the same request appended to its chunk not yet sent (what
    ``RequestOutput.merged`` does to the outputs a stream fell behind on)."""
    chunk.token_ids.extend(out.token_ids)
    chunk.text += out.text
    chunk.num_prompt_tokens = out.num_prompt_tokens or chunk.num_prompt_tokens
    chunk.num_cached_tokens = max(chunk.num_cached_tokens, out.num_cached_tokens)
    _add_rest(chunk, out, timing)


def _add_rest(
    chunk: common_pb2.TokenChunk, out: RequestOutput, timing: common_pb2.Timing | None
) -> None:
    chunk.logprobs.extend(_pos(p) for p in out.logprobs)
    chunk.prompt_logprobs.extend(_pos(p) for p in out.prompt_logprobs)
    chunk.error = out.error or chunk.error
    if out.finished:
        chunk.finish_reason = FINISH[out.finish_reason]
        _set_stop_reason(chunk, out.stop_reason)
        if timing is not None:
            chunk.timing.CopyFrom(timing)


def error_chunk(request_id: str, message: str) -> common_pb2.TokenChunk:
    return common_pb2.TokenChunk(
        request_id=request_id, finish_reason=common_pb2.FINISH_REASON_ERROR, error=message
    )


def stats_to_load(stats: EngineStats, **extra: object) -> common_pb2.WorkerLoad:
    return common_pb2.WorkerLoad(
        num_running=stats.num_running,
        num_waiting=stats.num_waiting,
        num_reserved=stats.num_reserved,
        free_blocks=stats.free_blocks,
        total_blocks=stats.total_blocks,
        kv_cache_usage=stats.kv_cache_usage,
        prompt_tokens=stats.prompt_tokens,
        generation_tokens=stats.generation_tokens,
        num_preemptions=stats.num_preemptions,
        prefix_cache_queries=stats.prefix_cache_queries,
        prefix_cache_hits=stats.prefix_cache_hits,
        iteration_tokens=histogram_to_pb(stats.iteration_tokens),
        grammar_compile_seconds=histogram_to_pb(stats.grammar_compile_s),
        kv_offload_stored_blocks=stats.kv_offload_stored,
        kv_offload_restored_blocks=stats.kv_offload_restored,
        kv_offload_evicted_blocks=stats.kv_offload_evicted,
        prefix_cache_host_hits=stats.prefix_cache_host_hits,
        spec_decode_num_drafts=stats.spec.num_drafts,
        spec_decode_num_draft_tokens=stats.spec.num_draft_tokens,
        spec_decode_num_accepted_tokens=stats.spec.num_accepted_tokens,
        spec_decode_num_accepted_tokens_per_pos=stats.spec.accepted_per_position,
        **extra,  # type: ignore[arg-type]
    )


def histogram_to_pb(h: HistogramSnapshot) -> common_pb2.Histogram:
    return common_pb2.Histogram(bounds=h.bounds, counts=h.counts, sum=h.sum, count=h.count)


def transfer_fields(counters: Any) -> dict[str, object]:
    """WorkerLoad's KV-transfer fields from a kvtransfer.TransferCounters."""
    return {"kv_transfer_bytes": counters.bytes, "kv_transfer_seconds": counters.seconds,
            "kv_transfer_failures": counters.failures,
            "kv_transfer_granted": counters.granted}  # fmt: skip
