"""lm-eval's ``local-completions`` model (the official harness, in its own venv: `make test`
builds ``.lm-eval-venv``) scores a multiple-choice task of a few local lines against real workers
behind the gateway (prefill + decode, the embedded model on the CPU). Each choice's loglikelihood
equals transformers' on the same tokens: lm-eval asks for ``echo`` with ``logprobs``, the
prompt's own logprobs."""

from __future__ import annotations

import functools
import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.gateway.test_e2e_real import wait_healthy
from tests.services.procs import REPO, Fleet, Proc, fleet
from tests.services.reference import transformers_logprobs

__all__ = ["fleet"]
pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct"
TASK = Path(__file__).parent / "lm_eval_task"
LM_EVAL = Path(os.environ.get("TANDEM_LM_EVAL_VENV", REPO / ".lm-eval-venv")) / "bin" / "lm_eval"


@pytest.fixture(scope="module")
def lm_eval() -> Path:
    """lm_eval in its own venv. `make test` builds it in the background beside the suite: unless
    ``$TANDEM_LM_EVAL_VENV`` names one, ``make lm-eval-venv`` waits for that build (its lock)
    or makes the venv itself."""
    if "TANDEM_LM_EVAL_VENV" not in os.environ:
        done = subprocess.run(["make", "-s", "lm-eval-venv"], cwd=REPO, capture_output=True,
                              text=True, timeout=900)  # fmt: skip
        if done.returncode != 0:
            pytest.fail(f"make lm-eval-venv failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    if not LM_EVAL.exists():
        pytest.fail(f"{LM_EVAL} is missing: `make lm-eval-venv` builds it")
    return LM_EVAL


@pytest.fixture(scope="module")
def gateway(fleet: Fleet) -> Iterator[Proc]:
    prefill, decode = fleet.shared("prefill", "decode")
    proc = fleet.gateway(prefill=[prefill], decode=[decode])
    wait_healthy(proc, 2)
    yield proc
    proc.kill()


def _tokenizer_dir() -> str:
    from services.model_files import prepare_model

    return str(prepare_model("embedded").hf_dir)


def _run_lm_eval(gateway: Proc, tmp: Path) -> list[dict]:
    task = tmp / "task"
    task.mkdir()
    text = (TASK / "tandem_mc.yaml").read_text()
    (task / "tandem_mc.yaml").write_text(text.replace("PLACEHOLDER", str(TASK / "data.jsonl")))
    args = (f"model={MODEL},base_url={gateway.url}/v1/completions,tokenizer={_tokenizer_dir()},"
            "tokenizer_backend=huggingface,num_concurrent=4,max_retries=1")  # fmt: skip
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_CACHE": str(tmp / "datasets"), "OPENAI_API_KEY": "none"}  # fmt: skip
    run = subprocess.run(
        [str(LM_EVAL), "--model", "local-completions", "--model_args", args, "--tasks",
         "tandem_mc", "--include_path", str(task), "--output_path", str(tmp / "out"),
         "--log_samples"],
        env=env, capture_output=True, text=True, timeout=420,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    (samples,) = list((tmp / "out").rglob("samples_tandem_mc_*.jsonl"))
    return [json.loads(line) for line in samples.read_text().splitlines()]


@functools.cache
def _hf_tokenizer() -> Any:
    """transformers' tokenizer of the embedded model, loaded once (not once per choice)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(_tokenizer_dir())


def _reference(context: str, continuation: str) -> float:
    """transformers' loglikelihood of the continuation, tokenized as lm-eval's _encode_pair."""
    tok = _hf_tokenizer()
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tok(context + continuation, add_special_tokens=False).input_ids
    n = len(tok(context, add_special_tokens=False).input_ids)
    logp = transformers_logprobs(whole)
    return sum(logp[q - 1, whole[q]].item() for q in range(n, len(whole)))


def test_lm_eval_scores_equal_transformers(lm_eval: Path, gateway: Proc, tmp_path: Path) -> None:
    samples = _run_lm_eval(gateway, tmp_path)
    assert len(samples) == 4
    for sample in samples:
        pairs = [(a["arg_0"], a["arg_1"]) for a in sample["arguments"].values()]
        assert len(pairs) == len(sample["doc"]["choices"]) == len(sample["resps"])
        for (context, continuation), resp in zip(pairs, sample["resps"], strict=True):
            loglik = float(resp[0][0])
            assert abs(loglik - _reference(context, continuation)) < 1e-3, (context, continuation)
    assert sum(s["acc"] for s in samples) >= 3  # a real model: it knows most of these
