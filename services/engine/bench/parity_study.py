"""How often two bf16 implementations of one model give the same 32 greedy tokens, over many
prompts: our engine against transformers, and transformers against variants of itself.

The parity test's 8 prompts are too few to tell a 6/8 from a 7/8 implementation (the binomial
interval of 6/8 spans 41-93%). Here 56 chat prompts (the test's 8 and 48 more, fixed before any
measurement) run through transformers bf16 one prompt at a time (the reference, as in the test)
and through variants that change nothing but kernels or batch shape:

- transformers with its eager attention instead of SDPA, and transformers batched 8 at a time
  (left-padded): how often transformers agrees with itself when only the kernels change;
- transformers in float32: the closest thing to the exact answer, for every variant;
- our engine batched (all prompts submitted at once, up to 16 a step), one prompt at a time, without the Triton GEMV
  (cuBLAS for batch-1 steps), and with the torch references for every kernel.

Each comparison reports how many continuations are equal to the end, with a 95% Wilson interval,
and, for our engine against the reference, vLLM's near-tie check (``parity_check``). Prints one
JSON line per variant and writes the lot to ``--json-out``.

    python -m services.engine.bench.parity_study --json-out study.json   (CUDA and the embedded GGUF)

``--dtype float32 --device cpu`` runs the CPU default instead: our engine and transformers both
in float32, where rounding ties are rare and the continuations should be equal.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from typing import Any

import torch

from services.engine.bench import parity_report as pr

STUDY_PROMPTS = [  # chosen before measuring; short answers and long ones, facts, code, lists
    "What is the boiling point of water at sea level?",
    "Name the largest planet in our solar system.",
    "How many days are there in a leap year?",
    "Write a short poem about autumn leaves.",
    "What does a CPU do?",
    "Give me three tips for sleeping better.",
    "Who painted the Mona Lisa?",
    "What is photosynthesis? Answer in one sentence.",
    "Write a Python function that returns the square of a number.",
    "What is the difference between weather and climate?",
    "Suggest a name for a pet goldfish.",
    "How do I make a cup of tea?",
    "What is the tallest mountain on Earth?",
    "Explain gravity to a five-year-old.",
    "List the primary colors.",
    "What language is spoken in Brazil?",
    "Write a sentence using the word 'serendipity'.",
    "What are the benefits of regular exercise?",
    "How many continents are there? Name them.",
    "What is the chemical symbol for gold?",
    "Describe a cat in three words.",
    "Why is the sky blue?",
    "What is 15 plus 27?",
    "Write a limerick about a programmer.",
    "What is the capital of Japan?",
    "Give me a recipe idea for dinner using eggs.",
    "What is an API?",
    "Summarize the story of Cinderella in two sentences.",
    "How do airplanes stay in the air?",
    "What year did the first person walk on the Moon?",
    "Recommend a good habit for staying organized.",
    "What is the opposite of 'ancient'?",
    "Explain what a variable is in programming.",
    "Write a friendly greeting for a new coworker.",
    "What causes rain?",
    "How many legs does a spider have?",
    "What is the square root of 81?",
    "Tell me a fun fact about octopuses.",
    "What is machine learning, in simple terms?",
    "Write a to-do list for a weekend trip.",
    "Which ocean is the largest?",
    "What is the main ingredient in guacamole?",
    "How can I save money on groceries?",
    "What does DNA stand for?",
    "Write a thank-you note to a teacher.",
    "What are the three states of matter?",
    "Describe the color green to someone who cannot see.",
    "What is the speed of light, approximately?",
]
GROUP = 8  # transformers' batched variant: prompts per left-padded batch


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The 95% Wilson score interval of a binomial proportion k/n."""
    if n == 0:
        return (0.0, 1.0)
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return (max(0.0, centre - half), min(1.0, centre + half))


def equal_rate(got: list[list[int]], want: list[list[int]]) -> dict[str, Any]:
    """How many continuations are equal to the end, as a rate with its interval, and the median
    position of the first differing token among the rest."""
    parts = pr.agreement(got, want)
    k, n = parts["equal"], len(want)
    lo, hi = wilson(k, n)
    first = sorted(p for p, g, w in zip(parts["prefix"], got, want, strict=True) if g != w)
    return {
        "equal": k,
        "of": n,
        "rate": round(k / n, 4),
        "ci95": [round(lo, 4), round(hi, 4)],
        "median_first_difference": first[len(first) // 2] if first else None,
    }


def hf_groups(model: Any, prompts: list[list[int]], eos: list[int]) -> list[list[int]]:
    """transformers' greedy continuations, GROUP prompts to a left-padded batch."""
    out: list[list[int]] = []
    for i in range(0, len(prompts), GROUP):
        out += pr.hf_greedy(model, prompts[i : i + GROUP], eos, batched=True)
    return out


def fresh_engine(
    kernels: str, eager: bool, gemv_rows: int | None = None, dtype: str = "bfloat16"
) -> Any:
    """``parity_report.engine`` with the batch-1 GEMV threshold set (None: the default)."""
    from kernels import ops

    if gemv_rows is None:
        os.environ.pop("TANDEM_GEMV_ROWS", None)
    else:
        os.environ["TANDEM_GEMV_ROWS"] = str(gemv_rows)
    ops.gemv_rows.cache_clear()
    return pr.engine(kernels, eager, dtype)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json-out")
    ap.add_argument("--device", default="cuda", help="cuda (the point), or cpu to try the script")
    ap.add_argument("--limit", type=int, default=0, help="use only the first N prompts (a dry run)")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16",
                    help="float32: both sides in float32 (the CPU default), against transformers float32")  # fmt: skip
    args = ap.parse_args(argv)
    pr.DEVICE = args.device
    texts = pr.PROMPTS + STUDY_PROMPTS
    if args.limit:
        texts = texts[: args.limit]
    rows: list[dict[str, Any]] = []
    llm = fresh_engine("triton", eager=False, dtype=args.dtype)
    prompts = [llm.apply_chat_template([{"role": "user", "content": p}]) for p in texts]
    eos = pr.stop_ids(llm)
    truth = pr.hf_greedy(pr.hf_model(torch.float32), prompts, eos, batched=False)

    def report(name: str, got: list[list[int]], reference: list[list[int]], **extra: Any) -> None:
        rows.append({"variant": name, "vs_reference": equal_rate(got, reference),
                     "vs_fp32": equal_rate(got, truth), **extra})  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)

    if args.dtype == "float32":  # transformers float32 is the reference too
        report("transformers float32, one prompt at a time (the reference)", truth, truth)
        for one in (False, True):
            how = "one prompt at a time" if one else "batched (up to 16 a step)"
            report(f"tandem float32, {how}", pr.ours_greedy(llm, prompts, one), truth)
    else:
        hf16 = pr.hf_model(torch.bfloat16)
        ref_top = pr.hf_greedy_top(hf16, prompts, eos)
        ref = [c.token_ids for c in ref_top]
        report("transformers bf16 SDPA, one prompt at a time (the reference)", ref, ref)
        report(f"transformers bf16 SDPA, {GROUP} prompts a batch (left-padded)",
               hf_groups(hf16, prompts, eos), ref)  # fmt: skip
        del hf16
        hf_eager = pr.hf_model(torch.bfloat16, attn_implementation="eager")
        report("transformers bf16 eager attention, one prompt at a time",
               pr.hf_greedy(hf_eager, prompts, eos, batched=False), ref)  # fmt: skip
        del hf_eager
        ours_top = pr.ours_greedy_top(llm, prompts)
        report("tandem bf16, CUDA graphs, batched (up to 16 a step)",
               [c.token_ids for c in ours_top], ref, near_ties=pr.close(ours_top, ref_top))  # fmt: skip
        report("tandem bf16, CUDA graphs, one prompt at a time",
               pr.ours_greedy(llm, prompts, True), ref)  # fmt: skip
        del llm
        llm = fresh_engine("triton", eager=False, gemv_rows=0)
        report("tandem bf16, CUDA graphs, cuBLAS for batch-1 steps (no Triton GEMV), one at a time",
               pr.ours_greedy(llm, prompts, True), ref)  # fmt: skip
        del llm
        llm = fresh_engine("ref", eager=True)
        report("tandem bf16, torch references for every kernel, eager, batched",
               pr.ours_greedy(llm, prompts, False), ref)  # fmt: skip
    if args.json_out:
        device = torch.cuda.get_device_name() if args.device == "cuda" else args.device
        doc = {"device": device, "torch": torch.__version__, "dtype": args.dtype,
               "new_tokens": pr.NEW_TOKENS, "prompts": texts, "variants": rows}  # fmt: skip
        with open(args.json_out, "w") as fh:
            json.dump(doc, fh, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
