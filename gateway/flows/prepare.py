"""From a parsed request to the choices to run: ids checked against the vocabulary and the
context length, max_tokens settled, n fanned out with per-choice seeds."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

from gateway.core.errors import APIError, invalid
from gateway.flows.generation import Choice
from gateway.flows.protocol import CommonOptions
from gateway.workers.work import WorkItem
from protos.multimodal import ImageItem
from protos.sampling_params import InvalidRequestError

# the fields a context-length error names: the prompt's, the one max_tokens came in
CHAT_FIELDS = ("messages", "max_tokens")


@dataclass(frozen=True)
class PromptIds:
    ids: tuple[int, ...]
    text: str  # what echo shows
    images: tuple[ImageItem, ...] = ()  # placed: their placeholders expanded in ids


def check_vocab(ids: Sequence[int], vocab_size: int, param: str = "prompt") -> None:
    for pos, token in enumerate(ids):
        if not 0 <= token < vocab_size:
            raise invalid(
                f"token id {token} at {param} position {pos} is outside the vocabulary "
                f"(valid ids are 0..{vocab_size - 1})",
                param,
                code="token_out_of_vocabulary",
            )


def keep_last(ids: Sequence[int], keep: int | None, max_model_len: int | None) -> tuple[int, ...]:
    """The prompt as ``truncate_prompt_tokens`` (``keep``) leaves it: its last ``keep`` tokens
    (-1: the model's context length); a 400 where ``keep`` exceeds that length."""
    if keep is None:
        return tuple(ids)
    if keep == -1:
        if max_model_len is None:
            return tuple(ids)
        keep = max_model_len
    elif max_model_len is not None and keep > max_model_len:
        raise invalid(
            f"truncate_prompt_tokens ({keep}) is larger than the model's maximum context length "
            f"({max_model_len})",
            "truncate_prompt_tokens",
        )
    return tuple(ids[-keep:])


def context_error(
    max_model_len: int,
    prompt_len: int,
    max_tokens: int | None,
    fields: tuple[str, str] = CHAT_FIELDS,
    which: str | None = None,
) -> APIError:
    """The 400 of a request past the context: the prompt alone (``max_tokens`` None), or the
    prompt and the tokens asked for; ``fields`` name what the client sent (``fields[0]`` the
    prompt, ``fields[1]`` its max_tokens field); ``which``, the prompt of a batch that is too
    long (``prompt[1]``), as embeddings name their input."""
    if max_tokens is None:
        return invalid(
            f"This model's maximum context length is {max_model_len} tokens. However, "
            f"{which or 'your request'} has {prompt_len} input tokens. Please reduce the length "
            f"of the {fields[0]}.",
            fields[0],
            code="context_length_exceeded",
        )
    for_which = f" for {which}" if which else ""
    return invalid(
        f"This model's maximum context length is {max_model_len} tokens. However, you requested "
        f"{prompt_len + max_tokens} tokens{for_which} ({prompt_len} in the messages, {max_tokens} "
        f"in the completion). Please reduce the length of the {fields[0]} or {fields[1]}.",
        fields[1],
        code="context_length_exceeded",
    )


def settle_max_tokens(
    prompt_len: int,
    requested: int | None,
    default: int | None,
    max_model_len: int | None,
    fit_default: bool = False,
    fields: tuple[str, str] = CHAT_FIELDS,
    which: str | None = None,
) -> int:
    """The request's max_tokens (or the endpoint default; None: all the context left).
    ``fit_default``: a default longer than the context left shrinks to it (vLLM's treatment of
    the model's max_new_tokens) rather than fail the request. A prompt that leaves no room for
    one token is the prompt's error (as vLLM checks it first), whatever max_tokens says.
    ``which``: the prompt's place in a batch (``prompt[1]``), for the error to name it."""
    if max_model_len is None:  # no worker has reported yet: the request will get a 503
        return requested or default or 1
    if prompt_len >= max_model_len:
        raise context_error(max_model_len, prompt_len, None, fields, which)
    max_tokens = requested if requested is not None else default
    if requested is None and default is not None and fit_default:
        max_tokens = min(default, max_model_len - prompt_len)
    if max_tokens is None:
        max_tokens = max_model_len - prompt_len
    if prompt_len + max_tokens > max_model_len:
        raise context_error(max_model_len, prompt_len, max_tokens, fields, which)
    return max_tokens


def build_choices(
    response_id: str,
    prompts: Sequence[PromptIds],
    common: CommonOptions,
    max_tokens: Sequence[int],
    timeout_s: float,
) -> list[Choice]:
    """``n`` choices per prompt; with a seed, choice j of a prompt samples with seed + j."""
    deadline = time.monotonic() + timeout_s
    base = common.sampling
    choices = []
    for p, prompt in enumerate(prompts):
        for j in range(common.n):
            # wraps within int64 (the wire type) for seeds near the top of the range
            seed = None if base.seed is None else (base.seed + j + 2**63) % 2**64 - 2**63
            try:
                sampling = replace(base, max_tokens=max_tokens[p], n=1, seed=seed)
            except InvalidRequestError as e:
                raise invalid(str(e), e.param) from e
            index = p * common.n + j
            item = WorkItem(
                request_id=f"{response_id}-{index}",
                prompt_ids=prompt.ids,
                sampling=sampling,
                priority=common.priority,
                deadline=deadline,
                images=prompt.images,
            )
            choices.append(
                Choice(index, item, prompt_text=prompt.text, counts_prompt=j == 0, n=common.n)
            )
    return choices
