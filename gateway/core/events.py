"""Plain data the gateway passes around once protobuf is left behind (see convert.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from protos.logprobs import PositionLogprobs


@dataclass
class Timing:
    """Seconds per phase, as the workers report them; merged field by field (max)."""

    queue_s: float = 0.0
    prefill_s: float = 0.0
    transfer_s: float = 0.0
    decode_s: float = 0.0
    # how the prompt was prefilled: "disagg" (a prefill worker, KV shipped), "local" (the decode
    # worker itself: conditional disaggregation), "colocated"; "" until a flow says
    mode: str = ""
    # why a prompt was prefilled "local": "short" or "queue" (gateway.workers.prefill_choice)
    local_reason: str = ""

    def merge(self, other: Timing) -> None:
        self.mode = self.mode or other.mode
        self.local_reason = self.local_reason or other.local_reason
        self.queue_s = max(self.queue_s, other.queue_s)
        self.prefill_s = max(self.prefill_s, other.prefill_s)
        self.transfer_s = max(self.transfer_s, other.transfer_s)
        self.decode_s = max(self.decode_s, other.decode_s)


@dataclass(frozen=True)
class Chunk:
    """New tokens of one request (one choice); ``finish_reason`` set on the last one."""

    token_ids: tuple[int, ...] = ()
    text: str = ""
    logprobs: tuple[PositionLogprobs, ...] = ()
    finish_reason: str | None = None  # stop | length | abort
    stop_reason: str | int | None = None  # vLLM's: the stop string or token id; null for EOS
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    timing: Timing = field(default_factory=Timing)
    prompt_logprobs: tuple[PositionLogprobs, ...] = ()  # prompt positions 1..; first chunk only


@dataclass(frozen=True)
class Embedding:
    """One input's pooled vector, as a worker's Embed returned it."""

    values: tuple[float, ...]
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0


@dataclass(frozen=True)
class EmbedWork:
    """The inputs of one embeddings request, tokenized: one Embed call on one worker."""

    request_id: str
    inputs: tuple[tuple[int, ...], ...]
    normalize: bool | None = None  # None: the worker's --pooler-config
    priority: int = 0
    deadline: float = float("inf")  # time.monotonic() by which it must be done


@dataclass(frozen=True)
class Histogram:
    """A cumulative histogram a worker reported: counts[i] observations <= bounds[i], count all."""

    bounds: tuple[float, ...] = ()  # empty: the worker reports none
    counts: tuple[int, ...] = ()
    sum: float = 0.0
    count: int = 0


@dataclass(frozen=True)
class WorkerLoadInfo:
    """What a worker's GetLoad said, as plain data."""

    worker_id: str = ""
    role: str = ""
    model: str = ""
    max_model_len: int = 0
    block_size: int = 16
    num_running: int = 0
    num_waiting: int = 0
    free_blocks: int = 0
    total_blocks: int = 0
    kv_cache_usage: float = 0.0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    num_preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    kv_transfer_bytes: int = 0
    kv_transfer_seconds: float = 0.0
    kv_transfer_failures: int = 0
    kv_transfer_granted: int = 0  # of those received, copied into blocks granted ahead
    kv_offload_stored_blocks: int = 0  # the prefix cache's host tier (--kv-offloading-size)
    kv_offload_restored_blocks: int = 0
    kv_offload_evicted_blocks: int = 0
    prefix_cache_host_hits: int = 0
    spec_decode_num_drafts: int = 0  # speculative decoding (--speculative-config)
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: tuple[int, ...] = ()
    vocab_size: int = 0
    draining: bool = False
    num_reserved: int = 0
    task: str = ""  # generate | embed ("" from workers older than --task: generate)
    lora_names: tuple[str, ...] = ()  # the LoRA adapters it serves (--enable-lora)
    lora_paths: tuple[str, ...] = ()  # lora_names[i]'s directory on the worker (() if unknown)
    lora_runtime_updating: bool = False  # it takes runtime adapter loads and unloads
    instance: str = ""  # the worker process's run: a new one after a restart ("" older workers)
    kv_whole: bool = False  # a prefill worker shipping whole KV (--kv-streaming off)
    scheduling_policy: str = ""  # fcfs | priority (--scheduling-policy); "": not reported
    engine_stalled_s: float = 0.0  # in one step past its --engine-stall-timeout (0: not stalled)
    iteration_tokens: Histogram = field(default_factory=Histogram)  # tokens per engine step
    grammar_compile_seconds: Histogram = field(default_factory=Histogram)  # per grammar compiled
