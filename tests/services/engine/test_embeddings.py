"""The engine with ``task="embed"`` against transformers' ``last_hidden_state`` (the base model's
output, after the final RMSNorm) of the embedded model in float32: every pooling, chunked
prefill, prefix-cache hits, blocks freed; and each task refusing the other's requests."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from protos.pooling_params import PoolingParams
from protos.sampling_params import InvalidRequestError, SamplingParams
from services.engine.llm import LLM

BUDGET = 32  # tokens per step: the long input below takes several prefill chunks
TEXTS = [
    "Hello world",
    "The lighthouse keeper climbed the stairs every night to light the lamp. " * 6,
    "a",
    "Embeddings map text to vectors; similar meanings land close together.",
]


@pytest.fixture(scope="module")
def embedder() -> LLM:
    return LLM("embedded", task="embed", max_model_len=256, max_num_batched_tokens=BUDGET,
               dtype="float32", device="cpu")  # fmt: skip


@pytest.fixture(scope="module")
def hf_hidden(hf_model: tuple, embedder: LLM) -> list[torch.Tensor]:
    model, _ = hf_model
    states = []
    with torch.no_grad():
        for text in TEXTS:
            ids = torch.tensor([embedder.encode(text)])
            states.append(model.model(input_ids=ids).last_hidden_state[0])  # [T, H]
    return states


def _expected(hidden: torch.Tensor, kind: str, normalize: bool) -> torch.Tensor:
    vec = {"last": hidden[-1], "mean": hidden.mean(0), "cls": hidden[0]}[kind]
    return F.normalize(vec, dim=-1) if normalize else vec


@pytest.mark.parametrize("kind", ["last", "mean", "cls"])
def test_pooled_vectors_equal_transformers(
    embedder: LLM, hf_hidden: list[torch.Tensor], kind: str
) -> None:
    assert len(embedder.encode(TEXTS[1])) > 2 * BUDGET
    for normalize in (True, False) if kind == "mean" else (True,):
        results = embedder.embed(TEXTS, PoolingParams(kind, normalize))
        for res, hidden in zip(results, hf_hidden, strict=True):
            got = torch.tensor(res.embedding)
            want = _expected(hidden, kind, normalize)
            assert got.shape == want.shape == (576,)
            assert F.cosine_similarity(got, want, dim=0) > 0.9999
            torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)
            if normalize:
                assert abs(got.norm().item() - 1.0) < 1e-5
    assert embedder.engine.kv.num_free_blocks == embedder.engine.kv.num_blocks
    assert len(embedder.engine.runner.pooler) == 0 and not embedder.engine.has_unfinished


def test_the_default_is_the_last_token_normalized(embedder: LLM) -> None:
    (default,) = embedder.embed(TEXTS[3])
    (last,) = embedder.embed(TEXTS[3], PoolingParams("last", True))
    torch.testing.assert_close(torch.tensor(default.embedding), torch.tensor(last.embedding))


def test_last_token_pooling_is_served_from_the_prefix_cache(embedder: LLM) -> None:
    text = "Seen once before: " + TEXTS[1]
    (first,) = embedder.embed(text)
    (again,) = embedder.embed(text)
    assert first.num_cached_tokens == 0 and again.num_cached_tokens >= 64
    torch.testing.assert_close(
        torch.tensor(again.embedding), torch.tensor(first.embedding), rtol=1e-4, atol=1e-5
    )
    (mean,) = embedder.embed(text, PoolingParams("mean"))
    assert mean.num_cached_tokens == 0  # every position is needed


def test_inputs_past_the_context_and_generation_requests_are_refused(embedder: LLM) -> None:
    engine = embedder.engine
    with pytest.raises(InvalidRequestError, match="maximum context length is 256 tokens"):
        engine.add_embedding("long", [1] * 257)
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        engine.add_embedding("bad", [1, 10**6])
    with pytest.raises(InvalidRequestError, match="served for embeddings"):
        engine.add_request("gen", [1, 2, 3], SamplingParams(max_tokens=2))
    assert not engine.has_unfinished


def test_an_aborted_embedding_leaves_nothing_behind(embedder: LLM) -> None:
    engine = embedder.engine
    engine.add_embedding("gone", embedder.encode(TEXTS[1]), PoolingParams("mean"))
    assert engine.step() == []  # its first chunk: the pooler holds a running sum
    assert len(engine.runner.pooler) == 1
    out = engine.abort("gone")
    assert out is not None and out.finish_reason == "abort" and out.embedding is None
    assert len(engine.runner.pooler) == 0
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_a_generation_engine_refuses_embeddings(llm: LLM) -> None:
    with pytest.raises(InvalidRequestError, match="start it with --task embed"):
        llm.engine.add_embedding("e", [1, 2, 3])
