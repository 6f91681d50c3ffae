"""A request as the scheduler sees it: counters, not phases.

``num_computed_tokens`` counts tokens whose KV is in the cache. Whatever lies between it and
``num_tokens`` is still to be computed: a whole prompt, the rest of a chunked prompt, the one
token sampled last step, or everything again after a preemption. Prefill and decode fall out
of that arithmetic.
"""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field

from protos.multimodal import ImageItem
from protos.pooling_params import PoolingParams
from protos.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


class FinishReason(enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


_arrival_order = itertools.count()


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    priority: int = 0  # lower runs first under the priority policy
    arrival_time: float = field(default_factory=time.monotonic)
    max_model_len: int | None = None
    # prefill-only (disaggregation): keep the blocks after the first token until released
    hold_blocks_on_finish: bool = False
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    num_preemptions: int = 0
    # draft tokens proposed to follow the last token (speculative decoding), for the next step
    spec_token_ids: list[int] = field(default_factory=list)
    first_scheduled_time: float | None = None
    queued_time: float = field(default_factory=time.monotonic)  # joined this engine's queue
    seq: int = field(default_factory=lambda: next(_arrival_order))
    # an embedding (--task embed): prefill only, finished by its last prompt chunk, which
    # yields a pooled vector instead of a token
    pooling: PoolingParams | None = None
    # keys the prefix cache beside the tokens: equal prompts under different LoRA adapters (or
    # two loads of one adapter name) compute different KV, so they never share blocks
    cache_salt: str = ""
    # a vision-language prompt's images (their tokens' KV is keyed by the image content too)
    images: tuple[ImageItem, ...] = ()
    # position minus index of the tokens after the prompt's images (M-RoPE: <= 0)
    position_offset: int = 0
    # each image's tokens computed in one prefill chunk (Gemma 3: they attend to each other
    # both ways, so a chunk may end before an image or after it, never inside)
    whole_images: bool = False

    @property
    def reads_prefix_cache(self) -> bool:
        """Prompt logprobs and mean or first-token pooling need every position computed."""
        if self.sampling_params.prompt_logprobs is not None:
            return False
        return self.pooling is None or self.pooling.reads_prefix_cache

    @property
    def lora_name(self) -> str:
        """The adapter the request runs under ("" = the base model)."""
        return self.sampling_params.lora_name

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def queue_s(self) -> float:
        """Seconds from joining the queue to first being scheduled (0 until then)."""
        if self.first_scheduled_time is None:
            return 0.0
        return max(self.first_scheduled_time - self.queued_time, 0.0)

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens ``start:end`` of prompt + output without building the whole list."""
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p : end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - p]

    def ends_by_length(self, num_output: int) -> bool:
        """Whether ``num_output`` generated tokens reach max_tokens or the model's length: known
        before the last of them is (async scheduling leaves such a request out of a step ahead)."""
        if num_output >= self.sampling_params.max_tokens:
            return True
        return self.max_model_len is not None and (
            len(self.prompt_token_ids) + num_output >= self.max_model_len
        )

    def check_stop(self, new_token: int) -> FinishReason | None:
        """Stop conditions known from token ids alone (stop strings are the detokenizer's). A
        stop token that is also the last one max_tokens or the model's length allows ends the
        output as a stop (vLLM's order): its text is left out as any stop token's is, and a
        prefill worker's first token that ends the output ends it there as it would colocated."""
        sp, num_output = self.sampling_params, len(self.output_token_ids)
        if num_output >= sp.min_tokens:
            if not sp.ignore_eos and new_token in self.eos_token_ids:
                return FinishReason.STOP  # stop_reason stays None: vLLM's for the end of sequence
            if new_token in sp.stop_token_ids:
                self.stop_reason = new_token
                return FinishReason.STOP
        if self.ends_by_length(num_output):
            return FinishReason.LENGTH
        return None
