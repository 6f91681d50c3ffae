"""Sampling parameters of one request: plain data, validated where it is built."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

MAX_STOP_STRINGS = 16
MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 300  # entries, as OpenAI allows; each value in [-100, 100]
MAX_BAD_WORDS = 256
MAX_ALLOWED_TOKEN_IDS = 1 << 18  # ids in allowed_token_ids (beyond any vocabulary's size)
# vLLM's floor for a non-zero temperature: logits divided by less overflow float32 to inf, and
# the softmax of inf is NaN (every token then read as token 0); a lower one is raised to it
MIN_TEMPERATURE = 0.01


class InvalidRequestError(ValueError):
    """A request the user must fix; ``param`` names the offending field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def logit_bias_pairs(bias: Mapping[Any, Any] | Iterable[tuple[Any, Any]]) -> tuple[tuple[int, float], ...]:  # fmt: skip
    """OpenAI's ``logit_bias`` (a mapping whose keys are token ids, strings in JSON) as sorted
    ``(token id, bias)`` pairs, the form SamplingParams keeps."""
    try:
        # "5" and "05" are one token; " 5" or "+5" are not token ids (int() would take them)
        by_id = {_token_id(t): float(v) for t, v in dict(bias).items()}
        return tuple(sorted(by_id.items()))
    except (TypeError, ValueError):
        raise InvalidRequestError(
            "logit_bias must map token ids (integers, as strings in JSON) to numbers", "logit_bias"
        ) from None


def _token_id(key: Any) -> int:
    if isinstance(key, str) and not (key.isascii() and key.isdigit()):
        raise ValueError(key)
    if isinstance(key, bool):
        raise TypeError(key)
    return int(key)


# structural_tag: xgrammar's structural tag (JSON): free text in which each trigger opens a tag
# whose content is held to its schema (strict function tools under tool_choice "auto")
STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")


@dataclass(frozen=True)
class StructuredOutput:
    """What the output must match: the workers compile it into a grammar (xgrammar).

    ``spec`` is the JSON schema text (json), the regex, the EBNF or Lark grammar, or a JSON list of
    strings (choice); json_object needs none. A reasoning model's thinking is left free: with
    ``reasoning_end`` set the grammar starts after that text, and with ``reasoning_start`` set
    the model may first open a thinking block (``reasoning_open``: the prompt already opened it).
    """

    kind: str
    spec: str = ""
    # JSON: False (the default) is compact, one space after ':' and ',': with free whitespace
    # models may pad the output with newlines until max_tokens (a known xgrammar pitfall)
    any_whitespace: bool = False
    reasoning_start: str = ""
    reasoning_end: str = ""
    reasoning_open: bool = False
    # the request field that asked for it (response_format, structured_outputs, a guided_*
    # field, tools): the gateway's, to name in a worker's refusal; never sent to a worker
    source: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        if self.kind not in STRUCTURED_KINDS:
            raise InvalidRequestError(
                f"structured output kind must be one of {', '.join(STRUCTURED_KINDS)}, "
                f"got {self.kind!r}",
                "structured_outputs",
            )
        if self.kind != "json_object" and not self.spec:
            raise InvalidRequestError(
                f"a {self.kind} constraint needs a value", "structured_outputs"
            )


# max_tokens=None: as many tokens as the context holds (the engine ends the request there,
# finish_reason "length"); the largest max_tokens a request's protobuf carries
UNTIL_CONTEXT = 2**31 - 1


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # None (vLLM's offline SamplingParams take it): up to the context, UNTIL_CONTEXT
    max_tokens: int = 16
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # top alternatives per position; None = no logprobs
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    n: int = 1
    # token id -> added to its logit before sampling (OpenAI's logit_bias); a mapping is accepted
    logit_bias: tuple[tuple[int, float], ...] = ()
    structured: StructuredOutput | None = None  # grammar-constrained output
    # logprobs of the prompt's own tokens with this many alternatives (vLLM's prompt_logprobs);
    # such a request computes its whole prompt (no prefix-cache hits)
    prompt_logprobs: int | None = None
    # the LoRA adapter the request runs under ("" = the base model): the gateway sets it from
    # the request's model; it travels with the other per-request options to every worker
    lora_name: str = ""
    # vLLM's cache_salt: the request's prefix-cache blocks are found only by requests with the
    # same salt (one tenant cannot learn from cache hits what another's prompts were); "" = none
    cache_salt: str = ""
    # vLLM's allowed_token_ids: only these tokens may be sampled (the others' logits -inf after
    # the penalties and logit_bias); empty: any token
    allowed_token_ids: tuple[int, ...] = ()
    # vLLM's bad_words: words the output must not contain. The engine tokenizes each (as it is
    # and after a space) into bad_word_ids; a word's last token is banned wherever the output
    # ends with the ones before it (a one-token word: everywhere)
    bad_words: tuple[str, ...] = ()
    bad_word_ids: tuple[tuple[int, ...], ...] = ()
    extra: dict[str, object] = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        if self.max_tokens is None:  # type: ignore[comparison-overlap]
            object.__setattr__(self, "max_tokens", UNTIL_CONTEXT)
        if 0.0 < self.temperature < MIN_TEMPERATURE:
            object.__setattr__(self, "temperature", MIN_TEMPERATURE)
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        object.__setattr__(self, "allowed_token_ids", tuple(int(t) for t in self.allowed_token_ids))
        object.__setattr__(self, "bad_words", tuple(self.bad_words))
        object.__setattr__(
            self, "bad_word_ids", tuple(tuple(int(t) for t in w) for w in self.bad_word_ids)
        )
        object.__setattr__(self, "logit_bias", logit_bias_pairs(self.logit_bias))
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def adjusts_logits(self) -> bool:
        """Penalties or logit_bias change the logits before sampling (the sampler's
        ``apply_penalties``); without them greedy is a plain argmax."""
        return bool(
            self.repetition_penalty != 1.0
            or self.presence_penalty
            or self.frequency_penalty
            or self.logit_bias
            or self.allowed_token_ids
            or self.bad_word_ids
        )

    def validate(self) -> None:
        checks: list[tuple[bool, str, str]] = [
            (  # OpenAI's range, which vLLM (0.24 on) holds requests to as well
                0.0 <= self.temperature <= 2.0,
                "temperature must be in [0, 2], got {}",
                "temperature",
            ),
            (0.0 < self.top_p <= 1.0, "top_p must be in (0, 1], got {}", "top_p"),
            (self.top_k >= -1, "top_k must be -1, 0 (off) or a positive integer, got {}", "top_k"),
            (0.0 <= self.min_p <= 1.0, "min_p must be in [0, 1], got {}", "min_p"),
            (self.max_tokens >= 1, "max_tokens must be at least 1, got {}", "max_tokens"),
            (self.min_tokens >= 0, "min_tokens must be >= 0, got {}", "min_tokens"),
            (
                -2.0 <= self.presence_penalty <= 2.0,
                "presence_penalty must be in [-2, 2], got {}",
                "presence_penalty",
            ),
            (
                -2.0 <= self.frequency_penalty <= 2.0,
                "frequency_penalty must be in [-2, 2], got {}",
                "frequency_penalty",
            ),
            (
                0.0 < self.repetition_penalty < math.inf,
                "repetition_penalty must be a finite number greater than 0, got {}",
                "repetition_penalty",
            ),
            (self.n >= 1, "n must be at least 1, got {}", "n"),
            (
                len(self.stop) <= MAX_STOP_STRINGS,
                f"at most {MAX_STOP_STRINGS} stop strings, got {{}}",
                "stop",
            ),
        ]
        values = {
            "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
            "min_p": self.min_p, "max_tokens": self.max_tokens, "min_tokens": self.min_tokens,
            "presence_penalty": self.presence_penalty, "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty, "n": self.n, "stop": len(self.stop),
        }  # fmt: skip
        for ok, message, param in checks:
            if not ok:
                raise InvalidRequestError(message.format(values[param]), param)
        if self.min_tokens > self.max_tokens:
            raise InvalidRequestError(
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})",
                "min_tokens",
            )
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise InvalidRequestError(
                f"logprobs must be between 0 and {MAX_LOGPROBS}, got {self.logprobs}", "logprobs"
            )
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            raise InvalidRequestError(
                f"prompt_logprobs must be between 0 and {MAX_LOGPROBS}, got {self.prompt_logprobs}",
                "prompt_logprobs",
            )
        if any(s == "" for s in self.stop):
            raise InvalidRequestError("stop strings must not be empty", "stop")
        if any(t < 0 for t in self.stop_token_ids):
            raise InvalidRequestError("stop_token_ids must be non-negative", "stop_token_ids")
        if any(t < 0 for t in self.allowed_token_ids):
            raise InvalidRequestError("allowed_token_ids must be non-negative", "allowed_token_ids")
        if len(self.bad_words) > MAX_BAD_WORDS or any(
            not w.strip() or len(w) > 256 for w in self.bad_words
        ):
            raise InvalidRequestError(
                f"bad_words takes at most {MAX_BAD_WORDS} words, each with text and at most 256 "
                "characters", "bad_words",
            )  # fmt: skip
        if len(self.allowed_token_ids) > MAX_ALLOWED_TOKEN_IDS:
            raise InvalidRequestError(
                f"allowed_token_ids takes at most {MAX_ALLOWED_TOKEN_IDS} ids, got "
                f"{len(self.allowed_token_ids)}", "allowed_token_ids",
            )  # fmt: skip
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise InvalidRequestError(
                f"logit_bias takes at most {MAX_LOGIT_BIAS} tokens, got {len(self.logit_bias)}",
                "logit_bias",
            )
        for token, bias in self.logit_bias:
            if token < 0 or not -100.0 <= bias <= 100.0:
                raise InvalidRequestError(
                    f"logit_bias maps token ids (>= 0) to values in [-100, 100], got {token}: {bias}",
                    "logit_bias",
                )
