"""Turn a step's logits into tokens: penalties, temperature, min-p/top-k/top-p, seeded sampling.

Seeded requests draw their noise from a generator seeded by (seed, output position), so the
same seed gives the same text whatever else shares the batch and whichever worker samples.
The others draw from torch's default generators, which the engine's --seed seeds at start-up
(:func:`seed_engine`).
Logprobs are those of the model's raw distribution (before penalties, logit_bias and
temperature).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from itertools import chain

import numpy as np
import torch

from protos.sampling_params import SamplingParams
from services.engine.input_staging import list_to_device
from services.engine.structured import apply_bitmask
from services.scheduling.outputs import NO_TOKEN, SampledToken, ScheduledRequest

_NEG_INF = float("-inf")


def seed_engine(seed: int) -> None:
    """The engine's --seed: torch's default generators (the CPU's and every CUDA device's),
    whose draws are the noise of requests without a seed of their own, and Python's and
    NumPy's, as vLLM seeds them."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # every CUDA device's too


def _position_seed(seed: int, position: int) -> int:
    return (seed * 0x9E3779B1 + position * 0x85EBCA77 + 0x2545F491) % (2**63 - 1)


def _flat_index(
    lists: Sequence[Sequence[int]], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Ragged rows of ids as (row, id) index tensors on ``device`` (each list's position
    repeated, its ids in order), uploaded without a sync; None when every list is empty."""
    lengths = [len(values) for values in lists]
    total = sum(lengths)
    if total == 0:
        return None
    ids = list_to_device(list(chain.from_iterable(lists)), torch.long, device)
    rows = torch.repeat_interleave(
        torch.arange(len(lists), device=device),
        list_to_device(lengths, torch.long, device),
        output_size=total,  # known here: no sync for the device to count it
    )
    return rows, ids


# rows per batched penalty launch: bounds the [rows, vocab] fp32 temporaries (a few at a time:
# 32 rows of a 152k vocabulary are ~19 MB each) while keeping the launches few
PENALTY_ROWS = 32


def apply_penalties(
    logits: torch.Tensor,  # [B, V] float32, changed in place
    params: list[SamplingParams],
    outputs: list[list[int]],
    prompts: list[list[int]],
) -> None:
    """Each row as vLLM's sampler applies them: ``logit_bias`` first, then the repetition
    penalty on every token of the prompt and the output so far (divided if positive, multiplied
    if not: a biased logit is penalized as biased), then the presence and frequency penalties on
    the output's tokens; the masks (the last token of each bad word whose other tokens end the
    output, the tokens ``allowed_token_ids`` leaves out) set -inf, which no penalty changes, so
    their place in the order does not matter. Batched over the rows that ask for
    each (``PENALTY_ROWS`` at a time): one index upload per kind through pinned memory, no
    stream sync (one row at a time, each row's ``torch.tensor(..., device=...)`` waited for the
    device). The same operations per element as one row at a time, so the same bits on the CPU;
    on CUDA the repetition penalty's division is a true division by a float32 tensor (as vLLM's),
    where torch divides by a Python float as a multiply by its reciprocal (1 ulp apart at times)."""
    dev, vocab = logits.device, logits.shape[1]
    biased = [(i, tok, val) for i, sp in enumerate(params) for tok, val in sp.logit_bias]
    if biased:
        b_rows, b_ids, b_vals = zip(*biased, strict=True)
        logits.index_put_(
            (list_to_device(b_rows, torch.long, dev), list_to_device(b_ids, torch.long, dev)),
            list_to_device(b_vals, logits.dtype, dev),
            accumulate=True,  # the ids of one row are distinct (a dict's keys): a plain +=
        )
    rep = [i for i, sp in enumerate(params) if sp.repetition_penalty != 1.0]
    for at in range(0, len(rep), PENALTY_ROWS):
        part = rep[at : at + PENALTY_ROWS]
        seen = torch.zeros((len(part), vocab), dtype=torch.bool, device=dev)
        index = _flat_index([[*prompts[i], *outputs[i]] for i in part], dev)
        if index is not None:
            seen[index] = True
        pen = list_to_device([params[i].repetition_penalty for i in part], logits.dtype, dev)
        pen = pen[:, None]
        rows = list_to_device(part, torch.long, dev)
        sub = logits[rows]
        logits[rows] = torch.where(seen, torch.where(sub > 0, sub / pen, sub * pen), sub)
    banned = [[w[-1] for w in sp.bad_word_ids if _ends_with(outputs[i], w[:-1])]
              for i, sp in enumerate(params)]  # fmt: skip
    mask_ids(logits, banned)
    only = [i for i, sp in enumerate(params) if sp.allowed_token_ids]
    if only:  # allowed_token_ids: every other token of those rows to -inf
        keep = torch.zeros((len(only), vocab), dtype=torch.bool, device=dev)
        index = _flat_index([list(params[i].allowed_token_ids) for i in only], dev)
        assert index is not None  # each row's list is non-empty
        keep[index] = True
        rows = list_to_device(only, torch.long, dev)
        logits[rows] = logits[rows].masked_fill(~keep, _NEG_INF)
    counted = [
        i
        for i, sp in enumerate(params)
        if (sp.presence_penalty or sp.frequency_penalty) and outputs[i]
    ]
    for at in range(0, len(counted), PENALTY_ROWS):
        part = counted[at : at + PENALTY_ROWS]
        index = _flat_index([outputs[i] for i in part], dev)  # each output non-empty
        assert index is not None
        counts = torch.zeros((len(part), vocab), dtype=logits.dtype, device=dev)
        counts.index_put_(index, torch.ones_like(index[1], dtype=logits.dtype), accumulate=True)
        freq = list_to_device([params[i].frequency_penalty for i in part], logits.dtype, dev)
        pres = list_to_device([params[i].presence_penalty for i in part], logits.dtype, dev)
        rows = list_to_device(part, torch.long, dev)
        logits[rows] -= freq[:, None] * counts + pres[:, None] * (counts > 0).to(logits.dtype)


def _ends_with(tokens: list[int], tail: tuple[int, ...]) -> bool:
    return not tail or (len(tokens) >= len(tail) and tuple(tokens[-len(tail) :]) == tail)


def mask_ids(logits: torch.Tensor, ids_by_row: list[list[int]]) -> None:
    """Each row's ids to -inf (min_tokens' stop tokens), in one indexed write."""
    index = _flat_index(ids_by_row, logits.device)
    if index is not None:
        logits[index] = _NEG_INF


def _mask_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    sorted_logits, idx = logits.sort(dim=-1, descending=True)
    V = logits.shape[-1]
    ranks = torch.arange(V, device=logits.device)[None, :]
    k = torch.where(top_k > 0, top_k, V)[:, None]
    sorted_logits = sorted_logits.masked_fill(ranks >= k, _NEG_INF)
    probs = sorted_logits.softmax(dim=-1)
    cum = probs.cumsum(dim=-1) - probs  # mass strictly before each token
    sorted_logits = sorted_logits.masked_fill(cum >= top_p[:, None], _NEG_INF)
    return torch.empty_like(logits).scatter_(-1, idx, sorted_logits)


def _noise(probs: torch.Tensor, params: list[SamplingParams], positions: list[int]) -> torch.Tensor:
    seeded = [i for i, sp in enumerate(params) if sp.seed is not None]
    if not seeded:  # the same draws as the rows gathered below, without the gather
        return torch.empty_like(probs).exponential_()
    q = torch.empty_like(probs)
    unseeded = [i for i, sp in enumerate(params) if sp.seed is None]
    if unseeded:  # the index from pinned memory: a list index would sync the stream
        rows = list_to_device(unseeded, torch.long, probs.device)
        q[rows] = torch.empty_like(probs[rows]).exponential_()
    for i in seeded:
        seed = params[i].seed
        assert seed is not None
        gen = torch.Generator(device=probs.device).manual_seed(_position_seed(seed, positions[i]))
        q[i].exponential_(generator=gen)
    return q


def sample(
    logits: torch.Tensor,  # [B, V] float32
    params: list[SamplingParams],
    outputs: list[list[int]],
    prompts: list[list[int]],
    stop_ids_for_min_tokens: list[list[int]],
    read: Callable[..., list[list]] | None = None,
    allowed: tuple[torch.Tensor, list[int]] | None = None,
) -> list[SampledToken]:
    """One token per row. ``read(*tensors)`` brings the results to the host once all the GPU
    work is queued (the runner's reader waits with the GIL released); default ``tolist``.
    ``allowed``: a grammar bitmask and the rows it constrains (``services.engine.structured``).

    A row whose masks (the grammar's, allowed_token_ids, bad_words, min_tokens' stop tokens)
    together leave no token gets ``NO_TOKEN``, with the fields that masked it: found on the
    device and read back with the tokens (no sync of its own), where argmax would say 0."""
    want_logprobs = [sp.logprobs for sp in params]
    raw = logits.log_softmax(dim=-1) if any(k is not None for k in want_logprobs) else None
    if any(sp.adjusts_logits for sp in params):
        logits = logits.clone()
        apply_penalties(logits, params, outputs, prompts)
    if allowed is not None:
        apply_bitmask(logits, *allowed)
    mask_ids(logits, stop_ids_for_min_tokens)
    tokens = sample_tokens(logits, params, [len(o) for o in outputs])
    masked = (
        allowed is not None
        or any(stop_ids_for_min_tokens)
        or any(sp.allowed_token_ids or sp.bad_word_ids for sp in params)
    )
    none_left = logits.amax(dim=-1) == _NEG_INF if masked else None
    sampled = _package(tokens, raw, want_logprobs, read or _tolist, none_left)
    if none_left is None:
        return sampled
    for i, tok in enumerate(sampled):
        if tok.token_id == NO_TOKEN:
            grammar = allowed is not None and i in allowed[1]
            why = _masks(params[i], outputs[i], grammar, bool(stop_ids_for_min_tokens[i]))
            sampled[i] = SampledToken(NO_TOKEN, masked_by=why)
    return sampled


def _masks(
    sp: SamplingParams, output: list[int], grammar: bool, min_tokens: bool
) -> tuple[str, ...]:
    """The request fields whose masks applied to a row at this output position."""
    banned = any(_ends_with(output, w[:-1]) for w in sp.bad_word_ids)
    named = (("structured_outputs", grammar), ("allowed_token_ids", bool(sp.allowed_token_ids)),
             ("bad_words", banned), ("min_tokens", min_tokens))  # fmt: skip
    return tuple(name for name, applied in named if applied)


def sample_tokens(
    logits: torch.Tensor,  # [B, V] float32, penalties and masks already applied
    params: list[SamplingParams],
    positions: list[int],  # each row's output index (the seeded noise's position)
) -> torch.Tensor:  # [B] int64, on the logits' device
    """Each row's token, left on the device: the argmax for greedy rows, a draw for the others.
    Nothing here waits for the device (a launched step's tokens are sampled this way before the
    step before it is read)."""
    random_rows = [i for i, sp in enumerate(params) if not sp.greedy]
    if len(random_rows) == len(params):  # every row sampled: no argmax, gather nor scatter
        return _sample_rows(logits, params, positions)
    tokens = logits.argmax(dim=-1)
    if random_rows:
        rows = list_to_device(random_rows, torch.long, logits.device)
        tokens[rows] = _sample_rows(
            logits[rows], [params[i] for i in random_rows], [positions[i] for i in random_rows]
        )
    return tokens


def sample_with_drafts(
    logits: torch.Tensor,  # [sum(1 + num_spec), V] float32: each request's rows in order
    sampling: list[ScheduledRequest],
    min_token_stop_ids: dict[str, list[int]],
    allowed: tuple[torch.Tensor, list[int]] | None = None,
    read: Callable[..., list[list]] | None = None,
) -> dict[str, list[SampledToken]]:
    """A step where some requests carry draft tokens (``services.engine.speculative``).

    Every row is sampled as the next token after its own prefix (the drafts before it count as
    output, for penalties and seeded noise), then each request keeps its drafts up to the first
    that differs from its row's sample, plus that sample (or the last row's, when every draft
    was kept). For one-hot drafts this is rejection sampling: a draft survives with its target
    probability and a rejected position emits the target conditioned on not the draft.
    ``allowed``: the grammar bitmask by request (constrained requests carry no drafts)."""
    params, outputs, prompts, stops, owner = [], [], [], [], []
    for i, r in enumerate(sampling):
        sp, drafts = r.sampling_params, r.draft_token_ids
        exact = sp.adjusts_logits or sp.seed is not None  # else only the length is read
        for j in range(r.num_spec + 1):
            params.append(sp)
            outputs.append(r.output_token_ids + drafts[:j] if j and exact else r.output_token_ids)
            prompts.append(r.prompt_token_ids)
            stops.append(min_token_stop_ids.get(r.request_id, []))
            owner.append(i)
    if allowed is not None:  # a grammar's row moves to its request's (only) row
        first = {i: row for row, i in reversed(list(enumerate(owner)))}
        mask, rows = allowed
        allowed = (mask.index_select(0, torch.tensor(owner)), [first[i] for i in rows])
    return keep_drafts(sampling, sample(logits, params, outputs, prompts, stops, read=read,
                                        allowed=allowed))  # fmt: skip


def keep_drafts(
    sampling: list[ScheduledRequest], tokens: list[SampledToken]
) -> dict[str, list[SampledToken]]:
    """``tokens``: a sample for every row (each request's 1 + num_spec rows in order). Each
    request keeps its drafts while they equal the sample before them, then that sample."""
    result: dict[str, list[SampledToken]] = {}
    at = 0
    for r in sampling:
        drafts, row = r.draft_token_ids, tokens[at : at + r.num_spec + 1]
        kept = 0
        while kept < r.num_spec and row[kept].token_id == drafts[kept]:
            kept += 1
        result[r.request_id] = row[: kept + 1]
        at += r.num_spec + 1
    return result


def _sample_rows(
    logits: torch.Tensor, params: list[SamplingParams], positions: list[int]
) -> torch.Tensor:
    dev = logits.device
    temp = list_to_device([sp.temperature for sp in params], torch.float32, dev)
    logits = logits / temp[:, None]
    # vLLM's order: min_p on the tempered distribution, then top-k and top-p on what it left
    if any(sp.min_p > 0 for sp in params):  # decided on the host: no sync
        min_p = list_to_device([sp.min_p for sp in params], torch.float32, dev)
        probs = logits.softmax(dim=-1)
        cutoff = probs.max(dim=-1, keepdim=True).values * min_p[:, None]
        logits = logits.masked_fill(probs < cutoff, _NEG_INF)
    if any(sp.top_k > 0 or sp.top_p < 1.0 for sp in params):
        top_k = list_to_device([max(sp.top_k, 0) for sp in params], torch.long, dev)
        top_p = list_to_device([sp.top_p for sp in params], torch.float32, dev)
        logits = _mask_top_k_top_p(logits, top_k, top_p)
    probs = logits.softmax(dim=-1)
    return (probs / _noise(probs, params, positions)).argmax(dim=-1)


def _tolist(*tensors: torch.Tensor) -> list[list]:
    return [t.tolist() for t in tensors]


def _package(
    tokens: torch.Tensor,
    raw: torch.Tensor | None,
    want: list[int | None],
    read: Callable[..., list[list]],
    none_left: torch.Tensor | None = None,  # [B] bool: rows with every logit masked
) -> list[SampledToken]:
    ids = tokens if none_left is None else tokens.masked_fill(none_left, NO_TOKEN)
    if raw is None:
        (token_list,) = read(ids)
        return [SampledToken(t) for t in token_list]
    k = max((w or 0) for w in want)
    chosen = raw.gather(-1, tokens[:, None]).squeeze(-1)
    if k > 0:
        top_vals, top_ids = raw.topk(k, dim=-1)
        token_list, chosen_list, ids_list, vals_list = read(ids, chosen, top_ids, top_vals)
    else:
        (token_list, chosen_list), ids_list, vals_list = read(ids, chosen), [], []
    out = []
    for i, t in enumerate(token_list):
        if want[i] is None or t == NO_TOKEN:
            out.append(SampledToken(t))
            continue
        n = want[i] or 0
        alts = tuple(zip(ids_list[i][:n], vals_list[i][:n], strict=True)) if n else ()
        out.append(SampledToken(t, chosen_list[i], alts))
    return out
