"""What the scheduler hands the engine each step, and what it gets back: plain data."""

from __future__ import annotations

from dataclasses import dataclass, field

from protos.multimodal import ImageItem
from protos.pooling_params import PoolingParams
from protos.sampling_params import SamplingParams


# not frozen: ScheduledRequest, SampledToken and StepUpdate are made per request per step, and a
# frozen dataclass's __init__ (object.__setattr__ per field) costs ~3x a plain one's; nothing
# changes them after they are made
@dataclass(slots=True)
class ScheduledRequest:
    request_id: str
    token_ids: list[int]  # the tokens to compute this step
    start_pos: int  # position of token_ids[0] == tokens already in the cache
    block_ids: list[int]  # the request's whole block table
    sample: bool  # True when this step reaches the end of the known tokens
    sampling_params: SamplingParams
    output_token_ids: list[int]  # generated so far (penalties, seeded sampling)
    prompt_token_ids: list[int]
    # speculative decoding: the last num_spec of token_ids are draft tokens; every one of them
    # (and the token before them) gets logits, and the runner keeps the drafts it samples
    num_spec: int = 0
    # an embedding: its chunks feed the pooler, and the one with ``sample`` set finishes it
    # with a vector instead of a token (no logits, no sampling)
    pooling: PoolingParams | None = None
    # the prompt's images: the runner encodes those this step's tokens reach into
    images: tuple[ImageItem, ...] = ()
    position_offset: int = 0  # added to the index of a token past the images (M-RoPE)

    @property
    def before_image_end(self) -> bool:
        """The step's tokens start before the end of the prompt's last image: it may reach
        into images (encoded, 3-D positions), so it needs them."""
        return bool(self.images) and self.start_pos < max(im.end for im in self.images)

    @property
    def samples_token(self) -> bool:
        """This step ends with a token to sample for it (not an embedding's last chunk)."""
        return self.sample and self.pooling is None

    @property
    def draft_token_ids(self) -> list[int]:
        return self.token_ids[len(self.token_ids) - self.num_spec :] if self.num_spec else []

    @property
    def num_new_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def context_len(self) -> int:
        return self.start_pos + len(self.token_ids)


@dataclass
class SchedulerOutput:
    requests: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    # host tier copies to do before the forward: (device block, host slot), then (slot, block)
    kv_offloads: list[tuple[int, int]] = field(default_factory=list)
    kv_restores: list[tuple[int, int]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(r.num_new_tokens for r in self.requests)

    @property
    def empty(self) -> bool:
        return not self.requests


# the token id of a row the sampler found no token for: every logit was masked (a grammar's
# bitmask, allowed_token_ids, bad_words, min_tokens' stop tokens, together). The request ends
# with an error there (``Scheduler.update``): it is never an input id, nor an output token
NO_TOKEN = -1


@dataclass(slots=True)
class SampledToken:
    token_id: int  # NO_TOKEN: nothing was left to sample
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()  # (token id, logprob), best first
    # NO_TOKEN's: the request fields whose masks together left no token, of
    # "structured_outputs" (its grammar), "allowed_token_ids", "bad_words", "min_tokens"
    masked_by: tuple[str, ...] = ()


@dataclass(frozen=True)
class PromptTokenScore:
    """A prompt token's logprob under the model, from the logits of the position before it."""

    position: int  # of the token in the prompt (>= 1)
    token_id: int
    logprob: float
    rank: int  # 1: the likeliest token at its position
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), best first


@dataclass(slots=True)
class StepUpdate:
    """One request's news after a step: a token (if it sampled), finished or not. A request
    whose drafts were kept gets one update per token, in order. An embedding's last chunk is
    an update without a token, finished (its vector is the runner's). A ``NO_TOKEN`` token is
    no output: the request finished there with finish_reason "error"."""

    request_id: str
    token: SampledToken | None
    finished: bool
    finish_reason: str | None
    stop_reason: str | int | None
    num_prompt_tokens: int
    num_cached_tokens: int
    queue_s: float = 0.0  # arrival to first scheduled (0 until it is)
