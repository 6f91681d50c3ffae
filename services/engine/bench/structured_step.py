"""What grammar-constrained decoding costs a decode step (issue 17, acceptance 3).

Batch B decode-only steps of one engine, timed one by one (each ends by reading its tokens, so
its wall time covers its GPU work), in four variants of the same batch: free greedy (the CUDA
graph's own argmax), free sampled (the sampler), every request under a JSON schema (greedy and
sampled: the bitmask filled on the host during the forward, applied with xgrammar's kernel).
The schema is an unbounded array of objects, so random weights keep every request in the
grammar for the whole run. Prints one JSON object.

    python -m services.engine.bench.structured_step --model llama-3.1-8b --load-format dummy \\
        --tokenizer DIR --batch 64 --steps 60
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import replace
from typing import Any

import torch

from protos.sampling_params import SamplingParams, StructuredOutput
from services.engine.llm import build_config
from services.engine.llm_engine import LLMEngine
from services.engine.structured import GrammarCompiler

SCHEMA = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "score": {"type": "number"},
            "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}},
        },
        "required": ["name", "score", "tags"],
    },
}


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def decode_steps(engine: LLMEngine, params: SamplingParams, batch: int, prompt_len: int,
                 steps: int) -> list[float]:  # fmt: skip
    """Milliseconds of each decode-only step with all ``batch`` requests running; a request
    whose grammar ends is replaced (its successor's prefill step is not counted)."""
    gen = torch.Generator().manual_seed(0)
    vocab = min(engine.vocab_size, 32000)
    times: list[float] = []
    while len(times) < steps:
        for i in range(batch - len(engine.scheduler.requests)):
            prompt = torch.randint(100, vocab, (prompt_len,), generator=gen).tolist()
            engine.add_request(f"so-{time.monotonic_ns()}-{i}", prompt, params)
        _sync()
        t0 = time.perf_counter()
        engine.step()
        elapsed = time.perf_counter() - t0
        tokens, seqs = engine.last_step_shape
        if tokens == seqs == batch:
            times.append(1e3 * elapsed)
    for rid in list(engine.scheduler.requests):
        engine.abort(rid)
    return times[5:]  # the first steps warm caches (xgrammar's masks per state among them)


class _Timed:
    """Wraps the grammar path's parts (bench only) to say where a constrained step's time goes."""

    def __init__(self, engine: LLMEngine) -> None:
        import services.engine.sampler as sampler

        self.ms: dict[str, float] = {"accept_and_fill": 0.0, "push": 0.0, "apply": 0.0}
        grammars = engine.grammars
        self._wrap(grammars, "fill", "accept_and_fill", grammars.fill)
        self._wrap(grammars, "push", "push", grammars.push)
        self._wrap(sampler, "apply_bitmask", "apply", sampler.apply_bitmask, sync=True)

    def _wrap(self, owner: Any, attr: str, key: str, fn: Any, sync: bool = False) -> None:
        def timed(*a: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            result = fn(*a, **kw)
            if sync:
                _sync()
            self.ms[key] += 1e3 * (time.perf_counter() - t0)
            return result

        setattr(owner, attr, timed)


def _summary(times: list[float]) -> dict[str, Any]:
    times = sorted(times)
    return {"steps": len(times), "median_ms": statistics.median(times),
            "mean_ms": statistics.fmean(times), "p90_ms": times[int(0.9 * (len(times) - 1))]}  # fmt: skip


def run(args: argparse.Namespace) -> dict[str, Any]:
    config = build_config(args.model, load_format=args.load_format, max_model_len=args.max_model_len,
                          max_num_seqs=max(args.batch, 8), device=args.device)  # fmt: skip
    engine = LLMEngine(config)
    if args.tokenizer:  # a random-weight named config: measure with this tokenizer's grammar
        from transformers import AutoTokenizer

        engine.grammar_compiler = GrammarCompiler(
            AutoTokenizer.from_pretrained(args.tokenizer), engine.vocab_size, engine.eos_token_ids
        )
    so = StructuredOutput("json", json.dumps(SCHEMA))
    base = SamplingParams(max_tokens=args.steps + 20, ignore_eos=True)
    variants = {
        "free_greedy": replace(base, temperature=0.0),
        "free_sampled": replace(base, temperature=1.0, top_p=0.95),
        "json_greedy": replace(base, temperature=0.0, structured=so),
        "json_sampled": replace(base, temperature=1.0, top_p=0.95, structured=so),
    }
    rows: dict[str, list[float]] = {}
    for _ in range(args.repeats):  # interleaved, so drift hits every variant alike
        for name, params in variants.items():
            rows.setdefault(name, []).extend(
                decode_steps(engine, params, args.batch, args.prompt_len, args.steps)
            )
    out: dict[str, Any] = {name: _summary(t) for name, t in rows.items()}
    for kind in ("greedy", "sampled"):
        free, constrained = out[f"free_{kind}"]["median_ms"], out[f"json_{kind}"]["median_ms"]
        out[f"overhead_{kind}_pct"] = 100.0 * (constrained / free - 1.0)
    out["overhead_vs_free_greedy_pct"] = 100.0 * (
        out["json_sampled"]["median_ms"] / out["free_greedy"]["median_ms"] - 1.0
    )
    if args.profile:  # one more constrained run, its parts timed (the apply synchronizes)
        timed = _Timed(engine)
        n = len(decode_steps(engine, variants["json_sampled"], args.batch, args.prompt_len,
                             args.steps))  # fmt: skip
        out["profile_ms_per_step"] = {k: v / max(n + 5, 1) for k, v in timed.ms.items()}
    out["config"] = {"model": args.model, "batch": args.batch, "prompt_len": args.prompt_len,
                     "steps": args.steps, "repeats": args.repeats,
                     "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                     "torch": torch.__version__}  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--model", default="llama-3.1-8b")
    p.add_argument("--load-format", default="dummy")
    p.add_argument("--tokenizer", default=None, help="a tokenizer directory for the grammar")
    p.add_argument("--device", default="auto")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--profile", action="store_true", help="time the grammar path's parts too")
    args = p.parse_args(argv)
    print(json.dumps(run(args), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
