"""Speculative decoding with a draft model (method "draft_model"): a smaller model with the
target's tokenizer, in the same worker, proposes its greedy tokens.

Greedy drafting makes each draft a deterministic function of its prefix (a one-hot q), so the
target's verifier (``sample_with_drafts``: keep a draft while it equals the target's sample at
its position, then emit the target's sample) is exact rejection sampling, unchanged: the output
follows the target's distribution at any temperature, and seeded requests give the text they
give without speculation.

The draft keeps its KV current where that costs least (see docs/architecture.md, "Speculative
decoding with a draft model"):
- The prompt: ``prefill`` feeds the draft each prompt chunk the target computes, in the same
  engine step and before the target's forward, so the draft's prefill lands in the time to the
  first token, not between tokens. It takes free blocks only (never evicts); a request it misses
  (a decode worker gets the target's prompt KV from the prefill worker, the draft's it does not;
  a full pool) catches up when it proposes.
- After that, lazily: ``propose_batch`` (in ``LLMEngine._propose``, before the step is
  scheduled) makes one forward that feeds each proposing request the tokens the draft has not
  seen (the kept drafts and the bonus token; after a pause, the tokens of the pause) and reads
  the first drafts from its last rows, then K - 1 decode forwards batched over the requests, one
  draft each. A request that sits out (adaptivity) costs the draft nothing until it proposes
  again, and its catch-up then rides in the forward that makes its first draft. Feeding is
  capped per call at the step's token budget: a request whose tokens do not fit gets the rest in
  later calls and no drafts until it has caught up. A catch-up longer than one graph (the
  draft missed the prompt: a decode worker's requests, a big batch draining to where drafting
  starts again) is an eager forward over a whole context that stalls the whole batch (29 ms
  for the 135M-shaped draft on an H100, whatever its length): it is made only for a request
  with at least ``LONG_CATCHUP_MIN_REMAINING`` tokens still to produce, at most one per call.
  As a 64-request batch drained, catch-ups for requests a few tokens from their end cost 9-15%
  of TPOT for drafts that could not win it back.
- On a GPU each forward of at most VERIFY_ROWS tokens replays the draft's decode graphs, one
  row per token (as the target's verify step does); a catch-up after the longest pause
  (``DRAFT_ADAPTIVITY``) fits one.

The pool: at most VERIFY_ROWS // 2 requests get drafts in a step (each draft rides next to its
own decode row), so the draft keeps KV for that many sequences of max_model_len (plus their K
drafts), never more tokens than the target's own pool holds, and on a GPU at most half the
memory still free once the target's pool and graphs are in place. Requests past that evict the
least recently used entries, which re-feed their tokens when they propose again.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch

from protos.blocks import blocks_for
from protos.sampling_params import SamplingParams
from services.config import ConfigError, EngineConfig, ModelConfig
from services.engine.draft_tables import DraftTables, tokens_between
from services.engine.kv_cache import block_bytes
from services.engine.model_config import ArchConfig
from services.engine.model_runner import ModelRunner
from services.engine.speculative import (
    DRAFT_ADAPTIVITY,
    VERIFY_ROWS,
    PromptChunk,
    ProposalRequest,
)
from services.model_files import ModelFiles, prepare_model
from services.scheduling.outputs import ScheduledRequest, SchedulerOutput

GREEDY = SamplingParams(temperature=0, max_tokens=1)
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


LONG_CATCHUPS_PER_CALL = 1  # catch-ups longer than one graph (whole contexts) per forward
LONG_CATCHUP_MIN_REMAINING = 16  # tokens a request must still produce to get one


@dataclass
class _Plan:
    request_id: str
    start: int  # position of chunk[0]: the tokens before it are in the draft's KV
    chunk: list[int]  # the request's tokens the draft feeds in this call
    k: int  # drafts to propose (0: the chunk stops short of the last token)


@dataclass
class DraftStats:
    """What the draft ran: forwards and tokens, while proposing and beside the target's
    prefill (benchmarks read these)."""

    proposals: int = 0  # propose_batch calls that ran a forward
    forwards: int = 0  # forwards while proposing (catch-up + first draft, then one per draft)
    catchup_tokens: int = 0  # known tokens fed while proposing (not drafts)
    prefill_forwards: int = 0
    prefill_tokens: int = 0
    graph_forwards: int = 0  # forwards short enough for the draft's decode graphs
    drafts_by_k: dict[int, int] = field(default_factory=dict)  # proposals of each length


def _arch_of(files: ModelFiles) -> ArchConfig:
    path = files.path if files.kind == "named" else (files.hf_dir or files.path) / "config.json"
    return ArchConfig.from_file(path)


def draft_num_blocks(
    config: EngineConfig, target: ModelRunner, arch: ArchConfig, free_bytes: int | None
) -> int:
    """The draft pool's size in blocks (see the module docstring)."""
    assert config.speculative is not None
    bs, k = target.block_size, config.speculative.num_speculative_tokens
    seqs = min(config.scheduler.max_num_seqs, VERIFY_ROWS // 2)
    per_seq = blocks_for(target.max_model_len + k, bs)
    n = min(seqs * per_seq, target.num_blocks + seqs * blocks_for(k, bs))
    if free_bytes is not None:
        n = min(n, free_bytes // 2 // block_bytes(arch, bs, target.dtype))
    return max(n, 0)


def check_compatible(
    draft: ArchConfig, files: ModelFiles, target: ModelRunner, tokenizer: Any
) -> None:
    """Refuse a draft that cannot propose for this target: another vocabulary or tokenizer, or
    a shorter context."""
    name = f"the draft model {files.name!r}"
    if draft.vocab_size != target.arch.vocab_size:
        raise ConfigError(
            f"{name} has a vocabulary of {draft.vocab_size} tokens, the target "
            f"{target.arch.vocab_size}: a draft model must share the target's tokenizer"
        )
    if draft.max_position_embeddings < target.max_model_len:
        raise ConfigError(
            f"{name} handles {draft.max_position_embeddings} positions, fewer than the target's "
            f"max_model_len {target.max_model_len}: set --max-model-len "
            f"{draft.max_position_embeddings} or less, or use a draft with a longer context"
        )
    if tokenizer is None or files.kind == "named":  # random weights: token ids only
        return
    from services.engine.llm_engine import load_tokenizer  # the engine imports this module

    if load_tokenizer(str(files.hf_dir)).get_vocab() != tokenizer.get_vocab():
        raise ConfigError(
            f"{name} has another tokenizer than the target (same size, different tokens): a "
            "draft model must share the target's tokenizer"
        )


class DraftProposer:
    adaptivity = DRAFT_ADAPTIVITY

    def __init__(self, config: EngineConfig, target: ModelRunner, tokenizer: Any) -> None:
        spec = config.speculative
        assert spec is not None and spec.model is not None
        self.k = spec.num_speculative_tokens
        self.budget = config.scheduler.token_budget  # tokens fed per call
        files = prepare_model(spec.model)
        arch = _arch_of(files)
        check_compatible(arch, files, target, tokenizer)
        free = None
        if target.device.type == "cuda":
            torch.cuda.synchronize(target.device)
            free = torch.cuda.mem_get_info(target.device)[0]
        num_blocks = draft_num_blocks(config, target, arch, free)
        # random weights for the draft too when the target has them (measuring the method)
        dummy = config.model.load_format == "dummy"
        model = ModelConfig(
            model=spec.model, load_format="dummy" if dummy else "auto", seed=config.model.seed,
            dummy_weight_seed=config.model.dummy_weight_seed,
            dtype=DTYPE_NAMES[target.dtype], max_model_len=target.max_model_len,
        )  # fmt: skip
        cache = replace(config.cache, num_blocks=num_blocks, enable_prefix_caching=False,
                        kv_offloading_gib=0.0)  # fmt: skip
        # graphs (on a GPU) for forwards of up to VERIFY_ROWS tokens: catch-ups, one row a token
        sched = replace(config.scheduler,
                        max_num_seqs=max(config.scheduler.max_num_seqs, VERIFY_ROWS))  # fmt: skip
        # the draft is whole on rank 0 (one rank, the target's first GPU) under a
        # tensor-parallel target: its drafts reach the other ranks as the step's tokens
        self.runner = ModelRunner(
            replace(config, model=model, cache=cache, scheduler=sched, speculative=None,
                    device=str(target.device), tensor_parallel_size=1)
        )  # fmt: skip
        self.tables = DraftTables(self.runner.num_blocks, target.block_size)
        self.stats = DraftStats()

    # ---- the proposer ------------------------------------------------------------------------
    @torch.inference_mode()
    def propose_batch(self, wanted: list[ProposalRequest], room: int) -> dict[str, list[int]]:
        plans = self._plan(wanted, room)
        if not plans:
            return {}
        self.stats.proposals += 1
        self.stats.catchup_tokens += sum(len(p.chunk) for p in plans)
        first = self._greedy([(p.request_id, p.chunk, p.start, p.k > 0) for p in plans])
        proposing = [p for p in plans if p.k > 0]
        drafts = {p.request_id: [t] for p, t in zip(proposing, first, strict=True)}
        for j in range(1, self.k):  # draft j + 1 from draft j, one decode row per request
            proposing = [p for p in proposing if p.k > j]
            if not proposing:
                break
            rows = [
                (p.request_id, drafts[p.request_id][-1:], p.start + len(p.chunk) + j - 1, True)
                for p in proposing
            ]
            for p, t in zip(proposing, self._greedy(rows), strict=True):
                drafts[p.request_id].append(t)
        for p in plans:  # the last draft is never fed: its KV is not needed for proposing
            fed = drafts.get(p.request_id, [])[:-1]
            self.tables.record(p.request_id, p.chunk + fed, p.start + len(p.chunk))
        for d in drafts.values():
            self.stats.drafts_by_k[len(d)] = self.stats.drafts_by_k.get(len(d), 0) + 1
        return drafts

    @torch.inference_mode()
    def prefill(self, chunks: list[PromptChunk]) -> None:
        """Feed the draft the target's prompt chunks of this step (from where its KV stops, up
        to each chunk's end, within the token budget and the pool's free blocks); no logits."""
        rows: list[tuple[str, list[int], int, bool]] = []
        budget, tables = self.budget, self.tables
        for c in chunks:
            if budget <= 0:
                break
            rid = c.request_id
            valid = tables.valid_prefix(rid, c.prompt, c.output)
            end = min(c.end, valid + budget)
            if end <= valid:
                continue
            tables.rewind(rid, valid)
            if not tables.reserve(rid, end, (), evict=False):
                continue  # the pool is full: it catches up when it proposes
            rows.append((rid, tokens_between(c.prompt, c.output, valid, end), valid, False))
            budget -= end - valid
        if not rows:
            return
        self._forward(rows)
        for rid, tokens, start, _ in rows:
            tables.record(rid, tokens, start + len(tokens))
        self.stats.prefill_forwards += 1
        self.stats.prefill_tokens += sum(len(r[1]) for r in rows)

    def drop(self, request_id: str) -> None:
        self.tables.drop(request_id)

    def _plan(self, wanted: list[ProposalRequest], room: int) -> list[_Plan]:
        """Cut each request's draft KV back to what it still agrees with, pick what to feed
        (within the token budget) and how many drafts (within ``room``), and hold the blocks."""
        plans: list[_Plan] = []
        budget, keep = self.budget, {w.request_id for w in wanted}
        long_catchups = 0
        for w in wanted:
            k = min(self.k, w.limit, room)
            if room <= 0 or budget <= 0:
                break
            if k <= 0:
                continue
            rid, total = w.request_id, len(w.prompt) + len(w.output)
            valid = self.tables.valid_prefix(rid, w.prompt, w.output)
            if total - valid > VERIFY_ROWS:  # see the module's docstring
                if long_catchups >= LONG_CATCHUPS_PER_CALL:
                    continue  # a later call
                if w.remaining < LONG_CATCHUP_MIN_REMAINING:
                    continue  # too close to its end to win the stall back
                long_catchups += 1
            self.tables.rewind(rid, valid)
            n = min(total - valid, budget)
            k = k if valid + n == total else 0
            if not self.tables.reserve(rid, valid + n + max(k - 1, 0), keep):
                continue
            plans.append(_Plan(rid, valid, tokens_between(w.prompt, w.output, valid, valid + n), k))
            budget -= n
            room -= k
        return plans

    def _greedy(self, rows: list[tuple[str, list[int], int, bool]]) -> list[int]:
        """One forward of the draft over (request, tokens, start position, wants a draft)
        rows; the argmax after the last token of each row that wants one."""
        self.stats.forwards += 1
        logits = self._forward(rows)  # [the rows' logits rows, V]
        if logits is None or logits.shape[0] == 0:
            return []
        ends, at = [], 0
        for _, tokens, _, sample in rows:
            if sample:
                at += len(tokens) if self._graphed(rows) else 1
                ends.append(at - 1)
        if len(ends) < logits.shape[0]:
            logits = logits[torch.tensor(ends, device=logits.device)]
        (ids,) = self.runner.reader.read(logits.argmax(-1))
        return ids

    @staticmethod
    def _graphed(rows: list[tuple[str, list[int], int, bool]]) -> bool:
        """A forward of at most VERIFY_ROWS tokens goes as one row per token, every row with
        logits: the shape the decode graphs take (a verify step's), not an eager prefill's."""
        return sum(len(r[1]) for r in rows) <= VERIFY_ROWS

    def _forward(self, rows: list[tuple[str, list[int], int, bool]]) -> torch.Tensor | None:
        """The draft's forward over the rows: fp32 logits of every token of the rows that want
        one when ``_graphed``, else of their last token (None: no row wants one)."""
        graphed, tables = self._graphed(rows), self.tables
        if graphed:
            self.stats.graph_forwards += 1
        out = SchedulerOutput()
        for rid, tokens, start, sample in rows:
            spec = len(tokens) - 1 if graphed else 0
            ids = tables.block_ids(rid)
            sr = ScheduledRequest(rid, tokens, start, ids, sample, GREEDY, [], [], num_spec=spec)
            out.requests.append(sr)
        return self.runner.forward_logits(out)
