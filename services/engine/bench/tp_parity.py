"""Tensor parallelism against one rank: the same greedy continuations, up to rounding.

One engine at ``--tensor-parallel-size 1``, then one at each size of ``--sizes`` (each closed, its
ranks stopped and its memory freed, before the next starts), over the same seeded prompts of
token ids (lengths spread from a few tokens to several KV blocks, so prefill chunks and decode
both run): how many continuations are equal to the end, vLLM's near-tie check where they part
(each side's token in the other's top 5; ``parity_report.close``), and the largest difference of
the first position's top-5 log-probabilities (the same prompt, no sampled token yet: the plain
size of the all-reduce's rounding). A model with random weights (``--load-format dummy``, the
same ``--dummy-weight-seed`` at every size: a rank draws each tensor whole and keeps its part)
tests the sharding of every layer at real shapes; a checkpoint in float32 should give equality.

    python -m services.engine.bench.tp_parity --model llama-3.1-8b --load-format dummy \\
        --sizes 2 --json-out tp_parity.json          (a GPU per rank; --device cpu: Gloo)
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import time
from collections.abc import Callable
from typing import Any

import torch

from services.engine.bench import parity_report as pr
from services.engine.bench.parity_check import Continuation
from services.engine.bench.parity_study import STUDY_PROMPTS, equal_rate
from services.engine.llm import LLM


def prompts(count: int, vocab: int, seed: int, longest: int) -> list[list[int]]:
    """``count`` prompts of random ids below ``vocab`` (avoiding the first 256, where special
    tokens live), lengths spread evenly from 4 to ``longest``."""
    rng = random.Random(seed)
    lengths = [4 + (longest - 4) * i // max(1, count - 1) for i in range(count)]
    return [[rng.randrange(256, vocab) for _ in range(n)] for n in lengths]


def first_step_diff(a: list[Continuation], b: list[Continuation]) -> float:
    """The largest |logprob difference| over the tokens both sides rank in their first top-N."""
    worst = 0.0
    for x, y in zip(a, b, strict=True):
        if not x.top or not y.top:
            continue
        for tok in x.top[0].keys() & y.top[0].keys():
            worst = max(worst, abs(x.top[0][tok] - y.top[0][tok]))
    return worst


def run(
    size: int, model: str, batch: list[list[int]], make: Callable[[LLM], list[list[int]]],
    knobs: dict[str, Any],
) -> dict[str, Any]:  # fmt: skip
    """One engine of ``size`` ranks: its continuations of ``batch`` (when empty, first filled
    with ``make(the engine)``)."""
    t0 = time.monotonic()
    with LLM(model, tensor_parallel_size=size, **knobs) as llm:
        started = time.monotonic() - t0
        if not batch:
            batch.extend(make(llm))
        t1 = time.monotonic()
        outs = pr.ours_greedy_top(llm, batch)
        took = time.monotonic() - t1
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return {"outs": outs, "start_s": round(started, 2), "generate_s": round(took, 3)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--load-format", default="dummy")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--dummy-weight-seed", type=int, default=0)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--sizes", default="2", help="comma-separated TP sizes compared with 1")
    ap.add_argument(
        "--prompts", type=int, default=24, help="how many prompts (at most 56 with --chat-prompts)"
    )
    ap.add_argument("--longest", type=int, default=700, help="the longest prompt, in tokens")
    ap.add_argument("--prompt-seed", type=int, default=0)
    ap.add_argument("--chat-prompts", action="store_true",
                    help="the 56 chat prompts of parity_study (a model with a chat template) "
                    "instead of random ids; --prompts still caps their number")  # fmt: skip
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--json-out")
    args = ap.parse_args(argv)
    pr.DEVICE = args.device
    knobs: dict[str, Any] = {
        "load_format": args.load_format, "dtype": args.dtype,
        "dummy_weight_seed": args.dummy_weight_seed,
        "device": args.device, "max_model_len": args.max_model_len, "max_num_seqs": 32,
        "enforce_eager": args.enforce_eager,
    }  # fmt: skip
    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    ref = None
    doc: dict[str, Any] = {"model": args.model, "dtype": args.dtype, "new_tokens": pr.NEW_TOKENS,
                           "prompts": args.prompts, "runs": {}}  # fmt: skip
    batch: list[list[int]] = []

    def make(llm: LLM) -> list[list[int]]:
        if args.chat_prompts:
            texts = (pr.PROMPTS + STUDY_PROMPTS)[: args.prompts]
            return [llm.apply_chat_template([{"role": "user", "content": t}]) for t in texts]
        return prompts(args.prompts, llm.engine.vocab_size, args.prompt_seed, args.longest)

    for size in [1, *sizes]:
        got = run(size, args.model, batch, make, knobs)
        outs = got.pop("outs")
        if ref is None:
            ref = outs
            doc["runs"]["1"] = got
            continue
        doc["runs"][str(size)] = {
            **got,
            "vs_tp1": equal_rate([c.token_ids for c in outs], [c.token_ids for c in ref]),
            "near_ties": pr.near_ties(outs, ref),
            "first_step_max_logprob_diff": round(first_step_diff(outs, ref), 5),
        }
        print(f"TP {size} vs TP 1: {json.dumps(doc['runs'][str(size)])}", flush=True)
    pr.emit(doc, args.json_out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
