"""The runner's step inputs: decode rows first for the kernels, logits in the scheduler's order."""

from __future__ import annotations

import pytest
import torch

from protos.blocks import blocks_for
from protos.sampling_params import SamplingParams
from services.engine.cuda_graphs import DecodeGraphs
from services.engine.llm import build_config
from services.engine.llm_engine import LLMEngine
from services.engine.models.llama import Linear
from services.scheduling.outputs import ScheduledRequest, SchedulerOutput

GREEDY = SamplingParams(temperature=0.0, max_tokens=4)


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return LLMEngine(
        build_config("smollm2-135m", load_format="dummy", dtype="float32", device="cpu",
                     max_model_len=128, num_blocks=64, max_num_seqs=8)
    )  # fmt: skip


def _req(rid: str, ids: list[int], start: int, blocks: list[int], sample: bool = True) -> ScheduledRequest:  # fmt: skip
    return ScheduledRequest(rid, ids[start:], start, blocks, sample, GREEDY, [], ids)


def _prompt(n: int, seed: int) -> list[int]:
    return [(97 * i + 31 * seed) % 5000 + 10 for i in range(n)]


def test_a_cpu_models_float32_linears_run_on_onednn_s_layout(engine: LLMEngine) -> None:
    """Every projection and the lm_head (tied to the embedding: a copy of its own) in oneDNN's
    layout (kernels/cpu_linear.py); the embedding still looks rows up from the dense table."""
    model = engine.runner.model
    linears = [m for m in model.modules() if type(m) is Linear]
    assert len(linears) == 4 * model.cfg.num_layers + 1
    assert all(m.weight.is_mkldnn for m in linears)
    assert not model.model.embed_tokens.weight.is_mkldnn
    assert torch.equal(model.lm_head.weight.to_dense(), model.model.embed_tokens.weight)


def test_decode_rows_go_first_and_logits_keep_the_scheduler_order(engine: LLMEngine) -> None:
    runner = engine.runner
    a, b, c, d = _prompt(20, 1), _prompt(9, 2), _prompt(30, 3), _prompt(17, 4)
    # fill the caches of b and d (their decode tokens attend to it) with a prefill-only step
    runner.forward_logits(
        SchedulerOutput([_req("b", b[:-1], 0, [10]), _req("d", d[:-1], 0, [20, 21])])
    )
    step = SchedulerOutput([
        _req("a", a, 0, [0, 1]),  # a whole prompt
        _req("b", b, 8, [10]),  # a decode
        _req("c", c[:12], 0, [30], sample=False),  # a chunk that does not sample
        _req("d", d, 16, [20, 21]),  # a decode one past a block boundary
    ])  # fmt: skip
    inputs = runner.prepare(step)
    meta = inputs.meta
    assert meta.num_decodes == 2 and not meta.decode_only
    assert meta.block_tables[:, 0].tolist() == [10, 20, 0, 30]
    assert meta.query_start_loc.tolist() == [0, 1, 2, 22, 34]
    assert meta.prefill_start_loc is not None and meta.prefill_start_loc.tolist() == [0, 20, 32]
    assert inputs.logits_rows.tolist() == [21, 0, 1]  # a's last token, then b, then d
    assert meta.prefill_no_prefix  # a and c start at 0: whole prompts beside the decodes
    after = runner.prepare(SchedulerOutput([_req("a", a, 0, [0, 1]), _req("c", c, 12, [30])]))
    assert not after.meta.prefill_no_prefix  # c's chunk comes after 12 cached tokens
    decodes = runner.prepare(SchedulerOutput([_req("b", b, 8, [10])]))
    assert decodes.meta.decode_only and not decodes.meta.prefill_no_prefix
    with torch.inference_mode():
        mixed = runner.forward_logits(step)
        alone = [
            runner.forward_logits(SchedulerOutput([_req("a", a, 0, [0, 1])])),
            runner.forward_logits(SchedulerOutput([_req("b", b, 8, [10])])),
            runner.forward_logits(SchedulerOutput([_req("d", d, 16, [20, 21])])),
        ]
    assert mixed is not None and all(x is not None for x in alone)
    torch.testing.assert_close(mixed, torch.cat(alone), rtol=1e-4, atol=1e-4)  # type: ignore[arg-type]


def test_a_mixed_step_with_the_new_kv_path_computes_what_the_paged_path_does(
    engine: LLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Decode rows first, then whole prompts: the rows of k_new/v_new handed to prefill
    attention (sliced past the decodes) line up with the queries. On a GPU this path runs from
    ops.NEW_KV_MIN_TOKENS prefill tokens; here it is forced, and the reference takes it."""
    from kernels import ops

    runner = engine.runner
    a, b, c = _prompt(20, 7), _prompt(9, 8), _prompt(30, 9)
    runner.forward_logits(SchedulerOutput([_req("b", b[:-1], 0, [50])]))
    step = SchedulerOutput([
        _req("a", a, 0, [51, 52]), _req("b", b, 8, [50]), _req("c", c[:12], 0, [53], sample=False),
    ])  # fmt: skip
    assert runner.prepare(step).meta.prefill_no_prefix
    with torch.inference_mode():
        paged = runner.forward_logits(step)
        calls = []
        real = ops.prefill_attention

        def spy(*args, **kw):
            calls.append(kw.get("k_new") is not None and kw.get("no_prefix"))
            return real(*args, **kw)

        monkeypatch.setattr(ops, "reads_new_kv", lambda device: True)
        monkeypatch.setattr(ops, "NEW_KV_MIN_TOKENS", 1)
        monkeypatch.setattr(ops, "prefill_attention", spy)
        contiguous = runner.forward_logits(step)
    assert calls and all(calls)  # every layer took the new-K/V path
    assert paged is not None and contiguous is not None
    assert torch.equal(paged, contiguous)


def test_decode_graph_rows_compute_what_the_eager_step_does(engine: LLMEngine) -> None:
    """The graph path lays its inputs out on its own (one row per token, padded to a bucket):
    on the CPU an uncaptured DecodeGraphs runs the same forward over them."""
    runner = engine.runner
    b, d = _prompt(9, 5), _prompt(17, 6)
    runner.forward_logits(
        SchedulerOutput([_req("b", b[:-1], 0, [40]), _req("d", d[:-1], 0, [41, 42])])
    )
    step = SchedulerOutput([_req("b", b, 8, [40]), _req("d", d, 16, [41, 42])])
    max_blocks = blocks_for(runner.max_model_len, runner.block_size)
    runner.graphs = DecodeGraphs(runner.model, runner.kv_caches, 8, max_blocks, runner.device)
    try:
        with torch.inference_mode():
            graph = runner.forward_logits(step)
            forwards = runner.forwards.graph
            eager = runner.forward_logits(step, eager=True)
    finally:
        runner.graphs = None
    assert forwards > 0 and graph is not None and eager is not None
    torch.testing.assert_close(graph, eager, rtol=1e-4, atol=1e-4)


def test_device_memory_is_empty_on_the_cpu_and_counts_the_context_on_a_gpu(
    engine: LLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    from types import SimpleNamespace

    from services.engine import model_runner

    assert engine.device_memory() == {}  # what a CPU worker's ready file gets: nothing
    props = SimpleNamespace(total_memory=144 * 2**30)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 30 * 2**30)
    gpu = SimpleNamespace(device=torch.device("cuda", 0))
    assert model_runner.ModelRunner.device_memory(gpu) == {  # type: ignore[arg-type]
        "gpu_bytes": 30 * 2**30 + model_runner.CUDA_CONTEXT_BYTES,
        "gpu_total_bytes": 144 * 2**30,
    }


def test_max_total_tokens_reaches_the_cache_config_from_the_cli() -> None:
    from services.cli import build_parser
    from services.engine.llm import config_from_args

    args = build_parser().parse_args(["decode", "--port", "0", "--max-total-tokens", "40960"])
    assert config_from_args(args).cache.max_total_tokens == 40960
    plain = build_parser().parse_args(["decode", "--port", "0"])
    assert config_from_args(plain).cache.max_total_tokens is None


def _smollm2(max_model_len: int) -> LLMEngine:  # max_position_embeddings 8192
    return LLMEngine(
        build_config("smollm2-135m", load_format="dummy", dtype="float32", device="cpu",
                     max_model_len=max_model_len, max_num_seqs=2)
    )  # fmt: skip


def test_max_model_len_beyond_the_models_positions_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from services.config import ConfigError

    for name in ("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "TANDEM_ALLOW_LONG_MAX_MODEL_LEN"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ConfigError, match=r"--max-model-len 100000 .* maximum of 8192 .*"):
        _smollm2(100000)


def test_a_length_past_every_limit_names_the_models_maximum_first(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """--max-model-len 999999 said only "exceeds 131072 positions" (Tandem's own cap), not the
    model's 8192 nor what to pass; with the variable set it names the cap and what to pass."""
    from services.config import ConfigError

    for name in ("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "TANDEM_ALLOW_LONG_MAX_MODEL_LEN"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ConfigError, match=r"maximum of 8192 .*pass --max-model-len 8192 or less"):
        _smollm2(999999)
    monkeypatch.setenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")
    with pytest.raises(
        ConfigError,
        match=r"999999 is longer than the 131072 positions Tandem serves: pass --max-model-len "
        r"131072 or less",
    ):
        _smollm2(999999)


def test_allow_long_max_model_len_lets_it_through(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")
    assert _smollm2(8192 + 64).runner.max_model_len == 8192 + 64
