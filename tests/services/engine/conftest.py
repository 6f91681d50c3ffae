"""Shared fixtures: the embedded model in our engine and in transformers (the reference)."""

from __future__ import annotations

import functools
import os
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from kernels import ops
from protos.sampling_params import SamplingParams
from services.engine.bench.parity_report import PROMPTS
from services.engine.llm import LLM
from services.engine.llm_engine import LLMEngine

CHAT_PROMPTS = PROMPTS  # the 8 chat prompts every parity check uses


@pytest.fixture(scope="session")
def llm() -> LLM:
    # async scheduling, a GPU's default, asked for here: the engine's tests run its path
    return LLM("embedded", max_num_seqs=32, async_scheduling=True)


@pytest.fixture(scope="session")
def chat_ids(llm: LLM) -> list[list[int]]:
    return [llm.apply_chat_template([{"role": "user", "content": p}]) for p in CHAT_PROMPTS]


@pytest.fixture(scope="session")
def hf_model() -> tuple[object, object]:
    """transformers' model and tokenizer of the embedded GGUF, float32 on the CPU, loaded from
    its converted folder (test_gguf_convert: the same tensors and tokenizer as transformers
    reads from the GGUF itself, which takes ~20 s more)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from services.model_files import prepare_model

    d = prepare_model("embedded").hf_dir
    tok = AutoTokenizer.from_pretrained(d)
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    return model.eval(), tok


@pytest.fixture(scope="session")
def hf_greedy(hf_model: tuple) -> Callable[[list[int], int], list[int]]:
    model, tok = hf_model
    cache: dict[tuple[tuple[int, ...], int], list[int]] = {}

    def run(ids: list[int], n: int) -> list[int]:
        key = (tuple(ids), n)
        if key not in cache:
            with torch.no_grad():
                out = model.generate(
                    torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                    eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id,
                )  # fmt: skip
            cache[key] = out[0, len(ids) :].tolist()
        return cache[key]

    return run


def token_prompts(seed: int, lens: Sequence[int], vocab: int = 49152) -> list[list[int]]:
    """Seeded prompts of random token ids (of the embedded tokenizer's vocabulary), one of
    each length in ``lens``."""
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in lens]


def transformers_greedy(model: Any, prompt: list[int], new_tokens: int) -> list[int]:
    """transformers' greedy continuation of ``prompt``: exactly ``new_tokens`` ids."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
            do_sample=False, pad_token_id=0,
        )  # fmt: skip
    return out[0, len(prompt) :].tolist()


def tiny_checkpoint(path: Path, model_type: str, **config: Any) -> Path:
    """A seeded random float32 HF checkpoint (with the tokenizer of :func:`tokenizer_dir`) at
    ``path``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = AutoConfig.for_model(
        model_type, vocab_size=49152, max_position_embeddings=1024, initializer_range=0.2,
        bos_token_id=None, eos_token_id=None, **config,
    )  # fmt: skip
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(path)
    save_test_tokenizer(path)
    return path


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A seeded random 2-layer Llama of width 64 with the embedded model's tokenizer (and so its
    vocabulary and chat template), for tests whose claim is the engine's, not the model's text
    (the same tokens with a knob as without, blocks freed, requests scheduled): a decode step
    costs a small fraction of the embedded model's (~90 ms at batch 1 on one CPU thread)."""
    return tiny_checkpoint(
        tmp_path_factory.mktemp("tiny-llama") / "llama", "llama", num_hidden_layers=2,
        hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
    )  # fmt: skip


def tiny_mistral3(path: Path, text: dict[str, Any], **config: Any) -> Any:
    """A seeded random float32 Mistral 3 checkpoint (``Mistral3ForConditionalGeneration``: a
    Mistral decoder of ``text`` beside a one-layer Pixtral tower and its projector) at ``path``,
    its norms off their initial ones, saved as transformers saves it; returns the model."""
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    torch.manual_seed(0)
    cfg = Mistral3Config(
        text_config={"model_type": "mistral", "vocab_size": 49152, "max_position_embeddings": 1024,
                     "initializer_range": 0.2, "bos_token_id": None, "eos_token_id": None,
                     "sliding_window": None, **text},
        vision_config={"model_type": "pixtral", "hidden_size": 32, "intermediate_size": 64,
                       "num_hidden_layers": 1, "num_attention_heads": 2, "head_dim": 16,
                       "image_size": 56, "patch_size": 14},
        image_token_index=49151, **config,
    )  # fmt: skip
    model = Mistral3ForConditionalGeneration(cfg).to(torch.float32)
    with torch.no_grad():  # transformers starts norm weights at 1: one read wrong would go unseen
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.add_(torch.randn_like(param) * 0.2)
    model.save_pretrained(path)
    save_test_tokenizer(path)
    return model.eval()


# Knobs of a test engine compared token for token with another engine or transformers in the
# same process, for a lent GPU machine too (scripts/device/two_gpus.sh): float32 (there "auto"
# picks bf16, whose rounding parts greedy runs at near ties) and a few KV blocks each (the
# default, 90% of the GPU, would leave the second engine none).
BESIDE: dict[str, Any] = {"dtype": "float32", "num_blocks": 512}


def tokenizer_dir() -> str:
    """The folder the tiny test checkpoints take their tokenizer from: the embedded model's, or
    ``$TANDEM_TEST_TOKENIZER`` (a lent GPU machine without the embedded model's GGUF)."""
    from services.model_files import prepare_model

    return os.environ.get("TANDEM_TEST_TOKENIZER") or str(prepare_model("embedded").hf_dir)


def save_test_tokenizer(path: Path) -> None:
    """The tokenizer of :func:`tokenizer_dir` saved into ``path`` (a tiny checkpoint's), loaded
    once per process: a load takes half a second, a save a few milliseconds."""
    _test_tokenizer().save_pretrained(path)


@functools.cache
def _test_tokenizer() -> Any:
    from services.engine.llm_engine import load_tokenizer

    return load_tokenizer(tokenizer_dir())


def rank_processes() -> list[int]:
    """Pids of this process's tensor-parallel rank children still alive (zombies included)."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            state, ppid = stat.read_text().rsplit(")", 1)[1].split()[:2]
            cmdline = (stat.parent / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue
        # a zombie (exited, never waited for) has no command line left
        if int(ppid) == os.getpid() and (b"tp_follower" in cmdline or state == "Z"):
            pids.append(int(stat.parent.name))
    return pids


def count_launches(engine: LLMEngine, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counters of steps launched behind a step whose tokens were not read yet: [all of them,
    those with drawn (non-greedy) rows]."""
    counter = [0, 0]
    launch = type(engine.runner).launch

    def counted(self, out, after=None, rows=None):  # type: ignore[no-untyped-def]
        if after is not None:
            counter[0] += 1
            counter[1] += any(not r.sampling_params.greedy for r in out.requests)
        return launch(self, out, after, rows)

    monkeypatch.setattr(type(engine.runner), "launch", counted)
    return counter


def move_by_transfer_buffer(
    prefill: LLMEngine, decode: LLMEngine, src: torch.Tensor, dst: torch.Tensor
) -> None:
    """Blocks ``src`` of ``prefill``'s pool into blocks ``dst`` of ``decode``'s, as the KV
    transfer moves them: gathered into one buffer, scattered on the other side."""
    buffer = ops.gather_blocks(prefill.runner.kv_caches, src)
    ops.scatter_blocks(buffer, decode.runner.kv_caches, dst)


Move = Callable[[LLMEngine, LLMEngine, torch.Tensor, torch.Tensor], None]


def hand_over(
    prefill: LLMEngine, decode: LLMEngine, rid: str, prompt: list[int], params: SamplingParams,
    move: Move = move_by_transfer_buffer,
) -> list[int]:  # fmt: skip
    """One prompt handed over: ``prefill`` computes it and its first token,
    ``move(prefill, decode, src, dst)`` copies its KV blocks into the blocks ``decode``
    reserves for it, and ``decode`` takes the request on (activated, not stepped). Its first
    tokens."""
    prefill.add_request(rid, prompt, replace(params, max_tokens=1), prefill_only=True)
    while not (first := [o for o in prefill.step() if o.request_id == rid]):
        pass
    blocks = decode.reserve(rid, prompt, params)
    assert blocks is not None
    move(prefill, decode, torch.tensor(prefill.block_ids(rid)), torch.tensor(blocks))
    prefill.scheduler.release(rid)
    tokens = list(first[0].token_ids)
    assert decode.activate(rid, prompt, tokens) is None
    return tokens


def hand_off(
    prefill: LLMEngine,
    decode: LLMEngine,
    prompts: Sequence[list[int]],
    params: SamplingParams,
    move: Move = move_by_transfer_buffer,
) -> list[list[int]]:
    """Disaggregated serving between two engines, one prompt at a time (:func:`hand_over`),
    ``decode`` generating each one's rest before the next. Each prompt's tokens; both pools
    free afterwards."""
    got = []
    for i, prompt in enumerate(prompts):
        rid = f"handoff-{i}"
        tokens = hand_over(prefill, decode, rid, prompt, params, move)
        while decode.has_unfinished:
            for out in decode.step():
                tokens += out.token_ids
        got.append(tokens)
    assert decode.kv.all_free() and prefill.kv.all_free()
    return got


@pytest.fixture(scope="module")
def tokenizers_loaded_once() -> Iterator[None]:
    """For a module that starts many engines on tiny checkpoints with the test tokenizer: each
    set of tokenizer files loaded once (:func:`tests.services.engine._tp_tokenizers.
    tokenizers_loaded_once`)."""
    from tests.services.engine._tp_tokenizers import tokenizers_loaded_once as loaded_once

    with loaded_once():
        yield
