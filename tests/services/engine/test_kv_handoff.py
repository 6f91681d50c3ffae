"""The engine tells a prefill worker's hook about each prefill-only request's last prompt chunk
before its forward, and that forward records every layer in order right after the layer's KV
write (or fails the recorder when it raises)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import torch

from kvtransfer import LayerReady, LayerReadyError
from protos.sampling_params import SamplingParams
from services.engine.kv_handoff import FinalChunk, LayerSink
from services.engine.llm import build_config
from services.engine.llm_engine import LLMEngine

FIRST = SamplingParams(temperature=0.0, max_tokens=1)


@pytest.fixture(scope="module")
def engine() -> Iterator[LLMEngine]:
    config = build_config("smollm2-135m", load_format="dummy", dtype="float32", device="cpu",
                          max_model_len=256, num_blocks=64, max_num_seqs=4,
                          max_num_batched_tokens=32)  # fmt: skip
    engine = LLMEngine(config)
    yield engine
    engine.on_final_chunks = None


def _prompt(n: int, seed: int) -> list[int]:
    return [(97 * i + 31 * seed) % 5000 + 10 for i in range(n)]


def _blocks(engine: LLMEngine, layer: int, ids: list[int]) -> torch.Tensor:
    return engine.runner.kv_caches[layer][:, ids].clone()  # [2, n, bs, Hkv, D]


class Recorder:
    """A LayerSink that snapshots, as each layer is recorded, that layer of the watched blocks
    (on the CPU the write is done when ``record`` is called)."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.calls: list[list[FinalChunk]] = []
        self.layers: list[int] = []
        self.failed = ""
        self.seen: dict[int, torch.Tensor] = {}

    def __call__(self, finals: list[FinalChunk]) -> LayerSink:
        self.calls.append(finals)
        return self

    def record(self, layer: int) -> None:
        self.layers.append(layer)
        ids = [b for f in self.calls[-1] for b in f.block_ids]
        self.seen[layer] = _blocks(self.engine, layer, ids)

    def fail(self, reason: str) -> None:
        self.failed = reason


def _run(engine: LLMEngine) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished:
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.token_ids)
    return tokens


def test_the_last_chunk_of_a_prefill_only_request_records_every_layer_in_order(
    engine: LLMEngine,
) -> None:
    rec = Recorder(engine)
    engine.on_final_chunks = rec
    prompt = _prompt(70, 1)  # three chunks of at most 32 tokens; five blocks of 16
    engine.add_request("streamed", prompt, FIRST, prefill_only=True)
    engine.add_request("plain", _prompt(20, 2), FIRST)  # not prefill-only: never handed over
    tokens = _run(engine)
    assert len(tokens["streamed"]) == 1
    (finals,) = rec.calls  # once, for the last chunk only
    ids = engine.block_ids("streamed")
    assert finals == [FinalChunk("streamed", ids, 70)] and len(ids) == 5
    assert rec.layers == list(range(engine.runner.arch.num_layers)) and not rec.failed
    # recording layer i means layer i of every block of the prompt holds its final KV
    for layer, seen in rec.seen.items():
        assert torch.equal(seen, _blocks(engine, layer, ids)), layer
    engine.abort("streamed")


def test_a_step_finishing_several_prompts_hands_them_over_together(engine: LLMEngine) -> None:
    rec = Recorder(engine)
    engine.on_final_chunks = rec
    for i in range(2):
        engine.add_request(f"pair-{i}", _prompt(12, 10 + i), FIRST, prefill_only=True)
    _run(engine)
    (finals,) = rec.calls
    assert [f.request_id for f in finals] == ["pair-0", "pair-1"]
    assert rec.layers == list(range(engine.runner.arch.num_layers))
    for i in range(2):
        engine.abort(f"pair-{i}")


def test_a_prompt_cached_up_to_its_last_token_still_streams_its_whole_kv(
    engine: LLMEngine,
) -> None:
    """A prefix-cache hit leaves at least the last token to compute: the hook comes with that
    one-token forward (kept out of CUDA graphs), and the blocks are the whole prompt's."""
    prompt = _prompt(49, 3)  # three full blocks and one token
    engine.add_request("warm", prompt, FIRST)
    _run(engine)
    rec = Recorder(engine)
    engine.on_final_chunks = rec
    hits = engine.kv.pool.hits
    engine.add_request("cached", prompt, FIRST, prefill_only=True)
    assert _run(engine)["cached"]
    assert engine.kv.pool.hits - hits == 48
    (finals,) = rec.calls
    assert finals[0].block_ids == engine.block_ids("cached") and len(finals[0].block_ids) == 4
    assert rec.layers == list(range(engine.runner.arch.num_layers))
    engine.abort("cached")


def test_a_forward_that_raises_fails_the_layer_ready(
    engine: LLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real LayerReady: the layers recorded before the failure stay usable, a send waiting
    for a later one raises at once instead of at its deadline."""
    ready = LayerReady(engine.runner.arch.num_layers)
    engine.on_final_chunks = lambda finals: ready
    mlp = engine.runner.model.model.layers[3].mlp

    def broken(x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("device fell off the bus")

    monkeypatch.setattr(mlp, "forward", broken)
    engine.add_request("doomed", _prompt(20, 4), FIRST, prefill_only=True)
    with pytest.raises(RuntimeError, match="bus"):
        engine.step()
    assert ready.wait(3, time.monotonic()) is None  # layer 3's KV was written before its MLP
    with pytest.raises(LayerReadyError, match="bus"):
        ready.wait(4, time.monotonic() + 30)
    monkeypatch.undo()
    engine.abort("doomed")
    assert not engine.has_unfinished


def test_without_a_hook_nothing_is_recorded(engine: LLMEngine) -> None:
    engine.on_final_chunks = None
    seen: list[object] = []
    original = engine.runner.forward_logits

    def spy(out: object, eager: bool = False, layers: object = None, **dev: object) -> object:
        seen.append(layers)
        return original(out, eager, layers, **dev)  # type: ignore[arg-type]

    engine.runner.forward_logits = spy  # type: ignore[method-assign,assignment]
    try:
        engine.add_request("quiet", _prompt(20, 5), FIRST, prefill_only=True)
        _run(engine)
    finally:
        del engine.runner.forward_logits
    assert seen == [None]
    engine.abort("quiet")
