"""Decode speed with and without speculative decoding (issue 21, acceptance 2 and 3).

One engine per process: run it once without ``--speculative-config`` and once with it, then
compare the JSON lines. Each batch of ``--batch`` requests starts together; a request's TPOT is
(time of its last token - time of its first) / (tokens - 1), taken as tokens come out of
``LLMEngine.step`` (with drafts, several tokens arrive in one step), its TTFT the time from the
batch's start to its first token. The output token ids are recorded so the two runs can be
checked equal (greedy).

Where speculation's time goes, per batch size: engine steps and verify steps (a request's step
that carried drafts), the proposer's wall time (``propose_s``: a draft model's proposal ends on
reading its drafts back, so on a GPU that is the draft's forwards) and with a draft model its
forwards and tokens (``DraftStats``: catch-ups while proposing, prompt chunks fed beside the
target's prefill, timed to a synchronize, which lands in TTFT).

Prompt sets, fixed before measuring:
- ``copy``: chat prompts whose answers copy from the prompt (editing code, extracting fields,
  repeating and quoting text), through the model's chat template (a real model's tokenizer).
- ``random``: random token ids of ``--input-len`` (random weights: nothing is ever accepted).

    python -m services.engine.bench.spec_decode --model embedded --dtype bfloat16 --prompts copy \\
        --batch 1 --max-tokens 256 [--speculative-config '{"method": "ngram", ...}']
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import time
from typing import Any

import torch

from protos.sampling_params import SamplingParams
from services.engine.llm import LLM

CODE = """def total(items):
    result = 0
    for item in items:
        if item.price > 0:
            result += item.price * item.quantity
    return result


def average(items):
    if not items:
        return 0
    return total(items) / len(items)
"""
RECORD = (
    "Customer record 4471: name Maria Lopez, email maria.lopez@example.com, phone "
    "+34 612 345 678, address Calle Mayor 12, 28013 Madrid, Spain; account opened 2019-03-14; "
    "plan premium; last order 2024-11-02, order number A-99812, total 149.90 EUR."
)
PARAGRAPH = (
    "The committee met on Tuesday to review the budget. After a long discussion, it approved "
    "the new library wing, postponed the swimming pool until next year, and asked the "
    "treasurer to publish the full accounts on the town website before the end of the month."
)
COPY_PROMPTS = [
    f"Add type hints to this Python code. Reply with the full code only.\n\n{CODE}",
    f"Rename the function `total` to `order_total` everywhere in this code and show it all:\n\n{CODE}",
    f"Extract the name, email, phone and address from this record as JSON:\n\n{RECORD}",
    f"Repeat the following paragraph exactly, word for word:\n\n{PARAGRAPH}",
    f"Summarise this paragraph, quoting its key sentences directly:\n\n{PARAGRAPH}",
    f"Copy this record, replacing the phone number with 'hidden':\n\n{RECORD}",
    f"Add a docstring to each function and return the complete code:\n\n{CODE}",
    f"List every date and number that appears in this record, one per line:\n\n{RECORD}",
]


def _prompts(llm: LLM, kind: str, n: int, input_len: int, seed: int = 0) -> list[list[int]]:
    if kind == "copy":
        chats = [{"messages": [{"role": "user", "content": p}]} for p in COPY_PROMPTS]
        ids = [llm.encode(c) for c in chats]
        return [ids[i % len(ids)] for i in range(n)]
    gen = torch.Generator().manual_seed(seed)
    vocab = min(llm.engine.vocab_size, 32000)
    return [torch.randint(100, vocab, (input_len,), generator=gen).tolist() for _ in range(n)]


class ProposerClock:
    """Wall time spent in the engine's proposer (measurement only: wraps its methods)."""

    def __init__(self, llm: LLM) -> None:
        self.propose_s = self.prefill_s = 0.0
        self.steps = 0
        proposer = llm.engine.proposer
        if proposer is None:
            return
        propose, prefill = proposer.propose_batch, proposer.prefill
        cuda = llm.engine.runner.device.type == "cuda"

        def timed_propose(wanted: Any, room: int) -> dict[str, list[int]]:
            t0 = time.perf_counter()
            try:
                return propose(wanted, room)
            finally:
                self.propose_s += time.perf_counter() - t0

        def timed_prefill(chunks: Any) -> None:
            t0 = time.perf_counter()
            try:
                prefill(chunks)
                if cuda:  # the draft's prefill launches without reading anything back
                    torch.cuda.synchronize()
            finally:
                self.prefill_s += time.perf_counter() - t0

        proposer.propose_batch = timed_propose  # type: ignore[method-assign]
        proposer.prefill = timed_prefill  # type: ignore[method-assign]

    def snapshot(self, llm: LLM) -> dict[str, Any]:
        draft = getattr(llm.engine.proposer, "stats", None)
        out = {"steps": self.steps, "propose_s": self.propose_s, "prefill_s": self.prefill_s}
        if draft is not None:
            out |= {k: (dict(v) if isinstance(v, dict) else v) for k, v in vars(draft).items()}
        return out


def _delta(after: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in after.items():
        if isinstance(value, dict):
            out[key] = {k: v - before[key].get(k, 0) for k, v in value.items()}
        else:
            out[key] = value - before[key]
    return out


def _run_batch(
    llm: LLM, prompts: list[list[int]], params: SamplingParams, tag: str, clock: ProposerClock
) -> list[dict[str, Any]]:
    engine = llm.engine
    times: dict[str, list[float]] = {}
    tokens: dict[str, list[int]] = {}
    start = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", p, params)
    while engine.has_unfinished:
        outs = engine.step()
        clock.steps += 1
        now = time.perf_counter()
        for o in outs:
            for t in o.token_ids:
                times.setdefault(o.request_id, []).append(now)
                tokens.setdefault(o.request_id, []).append(t)
    rows = []
    for i in range(len(prompts)):
        rid = f"{tag}-{i}"
        ts, ids = times.get(rid, []), tokens.get(rid, [])
        tpot = (ts[-1] - ts[0]) / (len(ts) - 1) if len(ts) > 1 else None
        ttft = (ts[0] - start) * 1e3 if ts else None
        rows.append({"request": i, "tokens": len(ids), "tpot_ms": tpot and tpot * 1e3,
                     "ttft_ms": ttft, "token_ids": ids})  # fmt: skip
    return rows


def run(args: argparse.Namespace) -> dict[str, Any]:
    knobs: dict[str, Any] = {"max_num_seqs": max(args.batch), "max_model_len": args.max_model_len}
    if args.load_format != "auto":
        knobs["load_format"] = args.load_format
    if args.dtype != "auto":
        knobs["dtype"] = args.dtype
    if args.speculative_config:
        knobs["speculative_config"] = args.speculative_config
    llm = LLM(args.model, **knobs)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens,
                            ignore_eos=args.prompts == "random")  # fmt: skip
    n_max = max(args.batch) * args.rounds
    prompts = _prompts(llm, args.prompts, max(n_max, len(COPY_PROMPTS)), args.input_len)
    clock = ProposerClock(llm)
    # the warm-up's prompts share no block with the measured ones: its KV (computed two requests
    # at a time) would otherwise be reused from the prefix cache by the measured requests, and
    # with and without drafts those blocks hold different bf16 bits (cuBLAS at batch 2 against
    # the row-invariant GEMV), which parts outputs on a near-tie for reasons not speculation's
    warm = _prompts(llm, "random", 2, 48, seed=1)
    _run_batch(llm, warm, SamplingParams(temperature=0.0, max_tokens=16), "warm", clock)
    results = []
    for batch in args.batch:
        spent0 = clock.snapshot(llm)
        stats0 = llm.engine.spec_stats
        drafts0, accepted0 = stats0.num_draft_tokens, stats0.num_accepted_tokens
        steps0 = stats0.num_drafts
        rows: list[dict[str, Any]] = []
        t0 = time.perf_counter()
        rounds = (
            max(args.rounds, -(-len(COPY_PROMPTS) // batch))
            if args.prompts == "copy"
            else args.rounds
        )
        for r in range(rounds):
            chunk = [prompts[(r * batch + i) % len(prompts)] for i in range(batch)]
            rows += _run_batch(llm, chunk, params, f"b{batch}-r{r}", clock)
        wall = time.perf_counter() - t0
        stats = llm.engine.spec_stats
        tpots = [row["tpot_ms"] for row in rows if row["tpot_ms"] is not None]
        ttfts = [row["ttft_ms"] for row in rows if row["ttft_ms"] is not None]
        spent = _delta(clock.snapshot(llm), spent0)
        drafts = stats.num_draft_tokens - drafts0
        accepted = stats.num_accepted_tokens - accepted0
        verify_steps = stats.num_drafts - steps0
        out_tokens = sum(row["tokens"] for row in rows)
        digest = hashlib.sha256(json.dumps([row["token_ids"] for row in rows]).encode()).hexdigest()
        results.append({
            "batch": batch,
            "requests": len(rows),
            "output_tokens": out_tokens,
            "tpot_ms_mean": statistics.fmean(tpots) if tpots else None,
            "tpot_ms_median": statistics.median(tpots) if tpots else None,
            "ttft_ms_mean": statistics.fmean(ttfts) if ttfts else None,
            "wall_s": wall,
            "output_tok_s": out_tokens / wall,
            "draft_tokens": drafts,
            "accepted_tokens": accepted,
            "verify_steps": verify_steps,
            "acceptance_rate": accepted / drafts if drafts else None,
            # tokens per verify step: the kept drafts plus the step's own token
            "acceptance_length": 1 + accepted / verify_steps if verify_steps else None,
            # where speculation's time went: engine steps, the proposer's time, the draft's work
            "speculation": spent | {
                "propose_ms_per_step": 1e3 * spent["propose_s"] / max(spent["steps"], 1),
                "propose_ms_per_verify_step": (
                    1e3 * spent["propose_s"] / verify_steps if verify_steps else None
                ),
            },
            "outputs_sha256": digest,
            "token_ids": [row["token_ids"] for row in rows],
        })  # fmt: skip
    return {
        "model": args.model,
        "load_format": args.load_format,
        "dtype": str(llm.engine.runner.dtype),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "prompts": args.prompts,
        "max_tokens": args.max_tokens,
        "speculative_config": args.speculative_config,
        "results": results,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m services.engine.bench.spec_decode", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--model", default="embedded")
    p.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    p.add_argument("--dtype", default="auto")
    p.add_argument("--prompts", default="copy", choices=["copy", "random"])
    p.add_argument("--input-len", type=int, default=1024, help="random prompts' length")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--batch", type=lambda s: [int(x) for x in s.split(",")], default=[1])
    p.add_argument("--rounds", type=int, default=1, help="batches per batch size")
    p.add_argument("--speculative-config", default=None)
    args = p.parse_args(argv)
    print(json.dumps(run(args)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
