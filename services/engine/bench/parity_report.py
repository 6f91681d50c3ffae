"""How closely the engine follows transformers on the embedded model's real weights, on a GPU.

Greedy continuations (32 tokens of the 8 chat prompts of the parity tests) and first-token
logits, for several variants of both sides, each compared with transformers in bf16 (what the
parity test compares with) and with transformers in float32 (the closest thing to the exact
answer). It answers which differences are bf16 rounding that transformers itself shows (the
same model at another batch size, or with reduced-precision matmul reductions), and which are
ours. Prints one JSON line per variant and writes them all to ``--json-out``.

    python -m services.engine.bench.parity_report --json-out parity.json   (needs CUDA and the embedded GGUF)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
from collections.abc import Iterator
from typing import Any

import torch

from protos.sampling_params import SamplingParams
from services.engine.bench.parity_check import Continuation, logprobs_close, summarize
from services.engine.llm import LLM
from services.model_files import embedded_gguf_path

PROMPTS = [  # the chat prompts of every parity check (the tests' conftest uses them too)
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a hash table is in two sentences.",
    "List three prime numbers.",
    "Who wrote Romeo and Juliet?",
    "Translate 'good morning' into Spanish.",
    "What is 12 times 12?",
    "Give me a tip for learning to code. Keep it short, and make sure it is practical "
    "advice that a beginner could follow today without buying anything.",
]
NEW_TOKENS = 32
TOP_N = 5  # alternatives compared where two greedy continuations part (vLLM's model tests use 5)


DEVICE = "cuda"


def hf_model(dtype: torch.dtype, attn_implementation: str | None = None) -> Any:
    """transformers' model of the embedded GGUF on DEVICE (its default attention: SDPA)."""
    from transformers import AutoModelForCausalLM

    gguf = embedded_gguf_path()
    extra = {"attn_implementation": attn_implementation} if attn_implementation else {}
    model: Any = AutoModelForCausalLM.from_pretrained(  # Any: the stubs' `to` wants a self
        str(gguf.parent), gguf_file=gguf.name, dtype=dtype, **extra
    )
    return model.to(DEVICE).eval()


def stop_ids(llm: LLM) -> list[int]:
    """The token ids our engine stops at (the model's generation config and the tokenizer's EOS:
    ``<|im_end|>`` and ``<|endoftext|>`` for SmolLM2-Instruct). transformers must stop at the
    same ones, or its continuations run on past ours (the tokenizer's ``eos_token_id`` alone is
    ``<|endoftext|>`` with some transformers versions, and the chat model ends with ``<|im_end|>``)."""
    return sorted(llm.engine.eos_token_ids)


def cut_at_stop(ids: list[int], eos: list[int]) -> list[int]:
    """ids up to and including the first stop token."""
    end = next((k + 1 for k, t in enumerate(ids) if t in eos), len(ids))
    return ids[:end]


def hf_greedy(
    model: Any, prompts: list[list[int]], eos: list[int], batched: bool
) -> list[list[int]]:
    outs = []
    groups = [prompts] if batched else [[p] for p in prompts]
    for group in groups:
        width = max(len(p) for p in group)
        ids = torch.tensor([[eos[0]] * (width - len(p)) + p for p in group], device=DEVICE)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group], device=DEVICE)
        with torch.inference_mode():
            out = model.generate(
                ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False,
                eos_token_id=eos, pad_token_id=eos[0],
            )  # fmt: skip
        outs += [cut_at_stop(row[width:].tolist(), eos) for row in out]
    return outs


def hf_logits(model: Any, prompts: list[list[int]]) -> torch.Tensor:
    rows = []
    with torch.inference_mode():
        for p in prompts:
            rows.append(model(torch.tensor([p], device=DEVICE)).logits[0, -1].float())
    return torch.stack(rows)


def hf_greedy_top(model: Any, prompts: list[list[int]], eos: list[int]) -> list[Continuation]:
    """transformers' greedy continuations, one prompt at a time, with the top-N log-probabilities
    of every position (log-softmax of the float32 copy of the logits ``generate`` keeps)."""
    outs = []
    for p in prompts:
        with torch.inference_mode():
            out = model.generate(
                torch.tensor([p], device=DEVICE), max_new_tokens=NEW_TOKENS, do_sample=False,
                eos_token_id=eos, pad_token_id=eos[0], output_logits=True,
                return_dict_in_generate=True,
            )  # fmt: skip
        ids = out.sequences[0, len(p) :].tolist()
        tops = []
        for step in out.logits[: len(ids)]:
            lp = step[0].float().log_softmax(-1)
            vals, idx = lp.topk(TOP_N)
            tops.append(dict(zip(idx.tolist(), vals.tolist(), strict=True)))
        n = len(cut_at_stop(ids, eos))
        outs.append(Continuation(ids[:n], tops[:n]))
    return outs


def ours_greedy_top(llm: LLM, prompts: list[list[int]]) -> list[Continuation]:
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, logprobs=TOP_N)
    outs = []
    for r in llm.generate(prompts, params):
        comp = r.outputs[0]
        tops = [{t.token_id: t.logprob for t in pos.top} for pos in comp.logprobs]
        outs.append(Continuation(list(comp.token_ids), tops))
    return outs


def ours_greedy(llm: LLM, prompts: list[list[int]], one_at_a_time: bool) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
    groups = [[p] for p in prompts] if one_at_a_time else [prompts]
    return [r.outputs[0].token_ids for g in groups for r in llm.generate(g, params)]


def ours_logits(llm: LLM, prompts: list[list[int]]) -> torch.Tensor:
    from services.scheduling.outputs import SchedulerOutput

    engine = llm.engine
    rows = []
    for i, p in enumerate(prompts):
        engine.add_request(f"parity-{i}", p, SamplingParams(temperature=0.0, max_tokens=1))
        step: SchedulerOutput = engine.scheduler.schedule()
        with torch.inference_mode():
            logits = engine.runner.forward_logits(step)
        engine.scheduler.abort(f"parity-{i}")
        assert logits is not None
        rows.append(logits[0].float())
    return torch.stack(rows)


def agreement(got: list[list[int]], want: list[list[int]]) -> dict[str, Any]:
    prefix = [
        next((k for k, (a, b) in enumerate(zip(g, w, strict=False)) if a != b), min(len(g), len(w)))
        for g, w in zip(got, want, strict=True)
    ]
    return {"equal": sum(g == w for g, w in zip(got, want, strict=True)), "prefix": prefix}


def close(ours: list[Continuation], ref: list[Continuation]) -> dict[str, Any]:
    return summarize([logprobs_close(a, b) for a, b in zip(ours, ref, strict=True)])


def near_ties(ours: list[Continuation], ref: list[Continuation]) -> dict[str, Any]:
    """``close``'s counts and margins, without the per-prompt detail."""
    return {k: v for k, v in close(ours, ref).items() if k != "prompts"}


def emit(doc: dict[str, Any], json_out: str | None) -> None:
    """A bench's result: one JSON line on stdout, and the same, indented, in ``json_out``."""
    print(json.dumps(doc), flush=True)
    if json_out:
        with open(json_out, "w") as fh:
            json.dump(doc, fh, indent=2)


def logit_error(got: torch.Tensor, want: torch.Tensor) -> dict[str, float]:
    rel = ((got - want).norm() / want.norm()).item()
    return {
        "rel_err": rel,
        "argmax_agree": (got.argmax(-1) == want.argmax(-1)).float().mean().item(),
    }


def engine(kernels: str, eager: bool, dtype: str = "bfloat16") -> LLM:
    """A fresh engine with Triton kernels or the torch references (``TANDEM_KERNELS=ref``);
    a fixed small pool, so several fit on one GPU."""
    from kernels import ops

    os.environ["TANDEM_KERNELS"] = "ref" if kernels == "ref" else ""
    ops.triton_available.cache_clear()
    return LLM("embedded", dtype=dtype, max_model_len=2048, max_num_seqs=16,
               num_blocks=2048, device=DEVICE, enforce_eager=eager)  # fmt: skip


REF_OPS = ("prefill_attention", "rms_norm", "silu_and_mul", "rotary_write_kv")


@contextlib.contextmanager
def reference_op(name: str) -> Iterator[None]:
    """Route one of ``kernels.ops``'s entry points to its torch reference (eager steps only)."""
    from kernels import attention, layers, ops

    refs = {
        "prefill_attention": attention.ref_prefill_attention,
        "rms_norm": layers.ref_rms_norm,
        "silu_and_mul": layers.ref_silu_and_mul,
        "rotary_write_kv": attention.ref_rotary_write_kv,
    }
    real = getattr(ops, name)
    setattr(ops, name, refs[name])
    try:
        yield
    finally:
        setattr(ops, name, real)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json-out")
    ap.add_argument("--device", default="cuda", help="cuda (the point), or cpu to try the script")
    args = ap.parse_args(argv)
    global DEVICE
    DEVICE = args.device
    rows: list[dict[str, Any]] = []

    def report(name: str, **fields: Any) -> None:
        rows.append({"variant": name, **fields})
        print(json.dumps(rows[-1]), flush=True)

    llm = engine("triton", eager=False)
    prompts = [llm.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS]
    eos = stop_ids(llm)
    hf32 = hf_model(torch.float32)
    truth_top = hf_greedy_top(hf32, prompts, eos)
    truth, truth_logits = [c.token_ids for c in truth_top], hf_logits(hf32, prompts)
    del hf32
    hf16 = hf_model(torch.bfloat16)
    ref_top = hf_greedy_top(hf16, prompts, eos)
    reference, ref_logits = [c.token_ids for c in ref_top], hf_logits(hf16, prompts)
    report("transformers bf16, one prompt at a time (the parity test's reference)",
           vs_fp32=agreement(reference, truth), logits_vs_fp32=logit_error(ref_logits, truth_logits),
           close_to_fp32=close(ref_top, truth_top))  # fmt: skip
    ours_top = ours_greedy_top(llm, prompts)
    report(f"tandem bf16, CUDA graphs, batched: top-{TOP_N} where greedy parts (vLLM's check)",
           vs_reference=close(ours_top, ref_top), vs_fp32=close(ours_top, truth_top))  # fmt: skip
    batched = hf_greedy(hf16, prompts, eos, True)
    report("transformers bf16, 8 prompts batched (left-padded)",
           vs_reference=agreement(batched, reference), vs_fp32=agreement(batched, truth))  # fmt: skip
    for one in (False, True):
        got = ours_greedy(llm, prompts, one)
        report(f"tandem bf16, CUDA graphs, {'one prompt at a time' if one else 'batched'}",
               vs_reference=agreement(got, reference), vs_fp32=agreement(got, truth))  # fmt: skip
    ours = ours_logits(llm, prompts)  # prefill steps run eagerly: the op swaps below apply
    report("tandem bf16 first-token logits", vs_fp32=logit_error(ours, truth_logits),
           vs_reference=logit_error(ours, ref_logits))  # fmt: skip
    for name in REF_OPS:
        with reference_op(name):
            ours = ours_logits(llm, prompts)
        report(f"tandem bf16 first-token logits, {name} by its torch reference",
               vs_fp32=logit_error(ours, truth_logits), vs_reference=logit_error(ours, ref_logits))  # fmt: skip
    with contextlib.ExitStack() as stack:
        for name in REF_OPS:
            stack.enter_context(reference_op(name))
        ours = ours_logits(llm, prompts)
    report("tandem bf16 first-token logits, all four by their references",
           vs_fp32=logit_error(ours, truth_logits), vs_reference=logit_error(ours, ref_logits))  # fmt: skip
    if DEVICE == "cuda":
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
        ref2, ref2_logits = hf_greedy(hf16, prompts, eos, False), hf_logits(hf16, prompts)
        ours = ours_logits(llm, prompts)
        report("no bf16 reduced-precision matmul reductions: transformers",
               vs_fp32=agreement(ref2, truth), logits_vs_fp32=logit_error(ref2_logits, truth_logits))  # fmt: skip
        report("no bf16 reduced-precision matmul reductions: tandem logits",
               vs_fp32=logit_error(ours, truth_logits), vs_reference=logit_error(ours, ref2_logits))  # fmt: skip
        del llm
        llm = engine("triton", eager=False)  # graphs captured under the setting
        got = ours_greedy(llm, prompts, False)
        report("no bf16 reduced-precision matmul reductions: tandem greedy (graphs, batched)",
               vs_reference=agreement(got, ref2), vs_fp32=agreement(got, truth))  # fmt: skip
    del llm
    llm = engine("ref", eager=True)
    got = ours_greedy(llm, prompts, False)
    report("tandem bf16, reference kernels everywhere, eager, batched",
           vs_reference=agreement(got, reference), vs_fp32=agreement(got, truth))  # fmt: skip
    if args.json_out:
        device = torch.cuda.get_device_name() if DEVICE == "cuda" else DEVICE
        doc = {"device": device, "torch": torch.__version__, "new_tokens": NEW_TOKENS,
               "prompts": PROMPTS, "variants": rows}  # fmt: skip
        with open(args.json_out, "w") as fh:
            json.dump(doc, fh, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
