"""LoRA in the engine against peft's merged models (transformers, float32, greedy) on a tiny
random Llama of SmolLM2's head layout: a batch mixing two adapters and the base model, adapters
taking turns in one slot, the prefix cache kept apart per adapter, runtime load and unload,
drafts verified under adapters (n-gram drafts on SmolLM2's own first layers, whose text repeats).
(tests/deploy/test_up_lora_e2e.py serves adapters on the whole embedded SmolLM2.)"""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path

import pytest

from protos.errors import ConfigError
from protos.sampling_params import InvalidRequestError, SamplingParams
from services.config import LoRAConfig
from services.engine.llm import LLM
from tests.services.engine.conftest import BESIDE, tiny_checkpoint
from tests.services.engine.lora_helpers import (
    ADAPTERS,
    base_hf_dir,
    make_adapter,
    make_adapters,
    peft_greedy,
)

GREEDY = SamplingParams(temperature=0.0, max_tokens=12)
PROMPTS = ["Tell me a story about a dragon.", "What is the capital of France?"]
NAMES = ["attn-r8", "", "mlp-r16"]  # "" is the base model


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The adapters' base: a seeded random 2-layer Llama with the embedded SmolLM2's layout at a
    fraction of its width (9 query heads over 3 KV heads, which two ranks split unevenly, 2 + 1;
    tied embeddings) and its tokenizer (vocabulary, chat template, EOS). The claims are the
    engine's LoRA arithmetic, not the model's text: a decode step costs a small fraction of
    SmolLM2's (~90 ms at batch 1 on one CPU thread), and peft's reference likewise."""
    return tiny_checkpoint(
        tmp_path_factory.mktemp("lora-base") / "llama", "llama", num_hidden_layers=2,
        hidden_size=144, head_dim=16, num_attention_heads=9, num_key_value_heads=3,
        intermediate_size=192, tie_word_embeddings=True,
    )  # fmt: skip


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory, base: Path) -> dict[str, Path]:
    return make_adapters(tmp_path_factory.mktemp("adapters"), base)


def serving(base: Path, adapters: dict[str, Path], max_loras: int = 2, **knobs: object) -> LLM:
    modules = tuple((name, str(path)) for name, path in adapters.items())
    lora = LoRAConfig(modules=modules, max_loras=max_loras, max_lora_rank=16)
    return LLM(str(base), lora_config=lora, max_num_seqs=8, **BESIDE, **knobs)


@pytest.fixture(scope="module")
def llm(base: Path, adapters: dict[str, Path]) -> LLM:
    return serving(base, adapters)


@pytest.fixture(scope="module")
def prompts(llm: LLM) -> list[list[int]]:
    return [llm.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS]


@pytest.fixture(scope="module")
def expected(
    base: Path, adapters: dict[str, Path], prompts: list[list[int]], llm: LLM
) -> dict[str, list[list[int]]]:
    eos = llm.engine.eos_token_ids  # what the engine stops on
    refs = {name: peft_greedy(adapters[name] if name else None, prompts, GREEDY.max_tokens, eos,
                              base)
            for name in NAMES}  # fmt: skip
    assert refs["attn-r8"] != refs[""] != refs["mlp-r16"], "an adapter that changes nothing"
    return refs


def mixed(llm: LLM, prompts: list[list[int]]) -> dict[str, list[list[int]]]:
    """Every prompt under every adapter and the base model, in one generate call (one batch)."""
    jobs = [(name, ids) for ids in prompts for name in NAMES]
    params = [replace(GREEDY, lora_name=name) for name, _ in jobs]
    results = llm.generate([ids for _, ids in jobs], params)
    got: dict[str, list[list[int]]] = {name: [] for name in NAMES}
    for (name, _), res in zip(jobs, results, strict=True):
        got[name].append(res.outputs[0].token_ids)
    return got


def test_a_batch_of_two_adapters_and_the_base_model_matches_peft(
    llm: LLM, prompts: list[list[int]], expected: dict[str, list[list[int]]]
) -> None:
    assert mixed(llm, prompts) == expected


def test_two_ranks_serve_the_adapters_as_peft_does(
    base: Path, adapters: dict[str, Path], prompts: list[list[int]],
    expected: dict[str, list[list[int]]],
) -> None:  # fmt: skip
    """Tensor parallelism (two ranks, Gloo): each rank holds every adapter cut as its layers
    are (B's rows of its heads and MLP rows, A's columns of o and down's inputs, whose partial
    updates the ranks' sum adds up); each picks its own slots. One slot: the adapters take
    turns on every rank."""
    from services.engine.tp_layout import TPLayout

    llm = serving(base, adapters, max_loras=1, tensor_parallel_size=2)
    try:
        assert llm.engine.runner.ranks is not None
        # SmolLM2's layout, uneven: 2 + 1 KV heads (6 + 3 query heads), so the slices differ
        arch = llm.engine.runner.arch
        assert [TPLayout.of(arch, r, 2).kv_heads for r in (0, 1)] == [(0, 2), (2, 3)]
        assert mixed(llm, prompts) == expected
    finally:
        llm.close()


def test_one_slot_serves_both_adapters_in_turns(
    base: Path, adapters: dict[str, Path], prompts: list[list[int]],
    expected: dict[str, list[list[int]]],
) -> None:  # fmt: skip
    with serving(base, adapters, max_loras=1, max_num_batched_tokens=32) as one_slot:
        assert mixed(one_slot, prompts) == expected


def test_an_adapter_never_reads_the_base_models_cached_prefix(llm: LLM) -> None:
    # plain text: nothing in common with the chat prompts other tests ran under the adapter
    ids = llm.encode("Once upon a time, in a land far away from every city, there lived a")
    short = replace(GREEDY, max_tokens=6, logprobs=1)
    base = llm.generate([ids], short)[0]
    under = llm.generate([ids], replace(short, lora_name="attn-r8"))[0]
    again = llm.generate([ids], replace(short, lora_name="attn-r8"))[0]
    assert under.num_cached_tokens == 0, "the adapter's prompt hit the base model's KV blocks"
    assert again.num_cached_tokens > 0, "the adapter's own prefix missed"
    assert again.outputs[0].token_ids == under.outputs[0].token_ids
    # the greedy tokens may coincide on a prompt; the adapter's logprobs never do
    assert under.outputs[0].logprobs != base.outputs[0].logprobs


def test_an_unknown_adapter_is_refused(llm: LLM, prompts: list[list[int]]) -> None:
    with pytest.raises(InvalidRequestError, match="'nope' is not served here"):
        llm.engine.add_request("x", prompts[0], replace(GREEDY, lora_name="nope"))


def test_an_adapter_above_the_max_rank_is_refused_at_load(
    base: Path, adapters: dict[str, Path]
) -> None:
    lora = LoRAConfig(modules=(("mlp-r16", str(adapters["mlp-r16"])),), max_lora_rank=8)
    with pytest.raises(ConfigError, match="rank 16 exceeds --max-lora-rank 8"):
        LLM(str(base), lora_config=lora)


def test_runtime_load_and_unload(
    llm: LLM, adapters: dict[str, Path], prompts: list[list[int]],
    expected: dict[str, list[list[int]]],
) -> None:  # fmt: skip
    engine = llm.engine
    assert engine.load_lora("again", str(adapters["mlp-r16"])) == ["again", "attn-r8", "mlp-r16"]
    got = llm.generate([prompts[1]], replace(GREEDY, lora_name="again"))[0]
    assert got.outputs[0].token_ids == expected["mlp-r16"][1]
    # each adapter's directory, in lora_names' order (the workers report it: /v1/models' root)
    paths = dict(zip(engine.lora_names(), engine.lora_paths(), strict=True))
    assert paths["again"] == str(adapters["mlp-r16"])
    with pytest.raises(ConfigError, match="already loaded"):
        engine.load_lora("again", str(adapters["attn-r8"]))
    engine.add_request("busy", prompts[1], replace(GREEDY, lora_name="again"))
    with pytest.raises(ConfigError, match="requests in flight"):
        engine.unload_lora("again")
    engine.abort("busy")
    assert engine.unload_lora("again") == ["attn-r8", "mlp-r16"]
    with pytest.raises(InvalidRequestError, match="not served here"):
        engine.add_request("gone", prompts[1], replace(GREEDY, lora_name="again"))


def test_a_torn_weights_file_is_refused_and_registers_nothing(
    llm: LLM, adapters: dict[str, Path], tmp_path: Path
) -> None:
    torn = tmp_path / "torn"
    shutil.copytree(adapters["attn-r8"], torn)
    weights = torn / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])  # a copy cut short
    before = llm.engine.lora_names()
    with pytest.raises(ConfigError, match=r"'torn': cannot read adapter_model\.safetensors"):
        llm.engine.load_lora("torn", str(torn))
    assert llm.engine.lora_names() == before


def test_a_slot_copy_failing_halfway_leaves_the_slot_empty(
    llm: LLM, prompts: list[list[int]], expected: dict[str, list[list[int]]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """Out of device memory while an adapter's weights go into a slot: the adapter that held
    the slot must not keep its name over a mix of both adapters' weights."""
    lora = llm.engine.runner.lora
    assert lora is not None
    slot = lora._resident({"attn-r8"})["attn-r8"]
    *_, last = lora.layers.values()

    def out_of_memory(slot: int, shards: object) -> None:
        raise RuntimeError("CUDA out of memory")

    monkeypatch.setattr(last, "set_slot", out_of_memory)
    with pytest.raises(RuntimeError, match="out of memory"):
        lora._load(slot, lora.adapters["mlp-r16"])  # every layer but the last rewritten
    monkeypatch.undo()
    assert lora.slots[slot] is None
    got = llm.generate([prompts[0]], replace(GREEDY, lora_name="attn-r8"))[0]
    assert got.outputs[0].token_ids == expected["attn-r8"][0]


def test_decode_steps_through_the_graph_buffers_match_eager_steps(
    llm: LLM, prompts: list[list[int]], expected: dict[str, list[list[int]]]
) -> None:
    """The CUDA-graph path on the CPU: decode steps go through ``DecodeGraphs.run`` (the step's
    inputs and segments in the fixed-size buffers, padded to a bucket, then the forward a graph
    would capture), mixed with the base model and alone, and give peft's tokens."""
    from protos.blocks import blocks_for
    from services.engine.cuda_graphs import DecodeGraphs

    runner = llm.engine.runner
    assert runner.graphs is None, "the CPU captures no graphs"
    max_blocks = blocks_for(runner.max_model_len, runner.block_size)
    runner.graphs = DecodeGraphs(runner.model, runner.kv_caches, 8, max_blocks, runner.device,
                                 runner.lora)  # fmt: skip
    before = replace(runner.forwards)
    try:
        assert mixed(llm, prompts) == expected  # 6 rows in a graph of 8, then fewer
        base = [r.outputs[0].token_ids for r in llm.generate(prompts, GREEDY)]
    finally:
        runner.graphs = None
    assert base == expected[""]
    graph, graph_lora = (runner.forwards.graph - before.graph,
                         runner.forwards.graph_lora - before.graph_lora)  # fmt: skip
    assert graph_lora > 0, "no decode step with adapters went through the graph buffers"
    assert graph > graph_lora, "no base-only decode step went through the graphs without LoRA"


COPYING = [
    "Repeat this sentence exactly: The quick brown fox jumps over the lazy dog near the river.",
    "Copy the list: apples, pears, plums, cherries, grapes, figs. The list again: apples,",
    "The password is tango-seven-alpha. Say the password twice: tango-seven-alpha,",
]
SPEC_TOKENS = 12  # new tokens: drafts are still kept (see the floors)


def embedded_cut(path: Path, layers: int) -> Path:
    """The embedded SmolLM2's first ``layers`` layers (its own weights, final norm and tied
    head) with its tokenizer, saved at ``path``."""
    import torch
    from transformers import AutoModelForCausalLM

    from services.engine.llm_engine import load_tokenizer

    model = AutoModelForCausalLM.from_pretrained(base_hf_dir(), dtype=torch.float32)
    model.model.layers = model.model.layers[:layers]
    model.config.num_hidden_layers = layers
    model.save_pretrained(path)
    load_tokenizer(str(base_hf_dir())).save_pretrained(path)
    return path


@pytest.fixture(scope="module", params=["ngram", "draft-model"])
def drafting(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, dict[str, Path], dict[str, object]]:
    """(base, its adapters, the speculative config) of one kind of draft. N-gram drafts are kept
    only where the text repeats what came before, which a random model's never does: they run
    on the embedded SmolLM2 cut to its first 4 layers, whose text falls into loops (", and,
    and, ...") within a few tokens, at a fraction of the whole model's step. A draft model is
    the base model (it has no adapters, as in vLLM; the target verifies under the request's
    adapter): the tiny base, whose drafts the adapters' rows keep in part."""
    if request.param == "draft-model":
        base = request.getfixturevalue("base")
        draft = {"model": str(base), "num_speculative_tokens": 3}
        return base, request.getfixturevalue("adapters"), draft
    root = tmp_path_factory.mktemp("repeater")
    base = embedded_cut(root / "smollm2-4", 4)
    draft = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
             "prompt_lookup_max": 3}  # fmt: skip
    return base, make_adapters(root / "adapters", base), draft


def test_drafts_verified_under_adapters_give_the_tokens_without_drafts(
    drafting: tuple[Path, dict[str, Path], dict[str, object]],
) -> None:
    """Speculative decoding with adapters: each verify step's rows (a request's token and its
    drafts) under the request's adapter, eagerly and through the graph buffers (the CPU runs
    the forward a captured graph would), the same greedy tokens as the engine without drafts
    but at a float32 near-tie (a verify step sums in another order), drafts kept and drafts
    refused in each run. Every copying prompt under every adapter and the base model."""
    from protos.blocks import blocks_for
    from services.engine.cuda_graphs import DecodeGraphs
    from tests.services.engine.test_speculative import assert_same_but_near_ties

    base, adapters, draft = drafting
    with serving(base, adapters) as plain:
        ids = [plain.encode(p) for p in COPYING]
        jobs = [(name, p) for p in ids for name in NAMES]
        params = [SamplingParams(temperature=0.0, max_tokens=SPEC_TOKENS, logprobs=5,
                                 lora_name=name) for name, _ in jobs]  # fmt: skip
        prompts = [p for _, p in jobs]
        want = plain.generate(prompts, params)
    with serving(base, adapters, speculative_config=draft) as spec:
        stats = spec.engine.spec_stats
        eager = spec.generate(prompts, params)
        kept, proposed = stats.num_accepted_tokens, stats.num_draft_tokens
        runner = spec.engine.runner
        max_blocks = blocks_for(runner.max_model_len, runner.block_size)
        runner.graphs = DecodeGraphs(runner.model, runner.kv_caches, 32, max_blocks,
                                     runner.device, runner.lora)  # fmt: skip
        before = runner.forwards.graph_lora
        try:
            graphed = spec.generate(prompts, params)
        finally:
            runner.graphs = None
        replayed = runner.forwards.graph_lora - before
        kept_graphed = stats.num_accepted_tokens - kept
        proposed_graphed = stats.num_draft_tokens - proposed
    floor = 15 if "model" in draft else 20  # about half of what each run kept (29, 39)
    assert kept > floor and kept_graphed > floor, "drafts were proposed but hardly kept"
    assert proposed > kept and proposed_graphed > kept_graphed, "no draft was ever refused"
    assert replayed > 0, "no verify step with adapters went through the graph buffers"
    adapted = [i for i, (name, _) in enumerate(jobs) if name]
    assert any(want[i].outputs[0].token_ids != want[i + 1].outputs[0].token_ids
               for i in adapted if jobs[i][0] == "attn-r8"), "the adapter changes nothing"  # fmt: skip
    assert_same_but_near_ties(eager, want, 5)
    assert_same_but_near_ties(graphed, want, 5)


def test_a_gemma3_adapter_matches_peft(tmp_path: Path) -> None:
    """Gemma 3's layers are Llama's projections behind its own norms and GELU: an adapter on
    every projection gives peft's merged model's tokens (a sliding layer and a global one)."""
    base = tiny_checkpoint(tmp_path / "gemma3", "gemma3_text", num_hidden_layers=2,
                           hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                           head_dim=16, intermediate_size=96, query_pre_attn_scalar=16,
                           sliding_window=8, layer_types=["sliding_attention", "full_attention"],
                           tie_word_embeddings=False)  # fmt: skip
    adapter = make_adapter(tmp_path / "a", 3, base, **ADAPTERS["mlp-r16"])
    lora = LoRAConfig(modules=(("g", str(adapter)),), max_loras=1, max_lora_rank=16)
    llm = LLM(str(base), lora_config=lora)
    prompts = [[5, 6, 7, 8, 9], list(range(100, 140))]  # the second passes the window
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, lora_name="g")
    got = [r.outputs[0].token_ids for r in llm.generate(prompts, params)]
    assert got == peft_greedy(adapter, prompts, 12, None, base)
    base_only = [
        r.outputs[0].token_ids for r in llm.generate(prompts, replace(params, lora_name=""))
    ]
    assert base_only == peft_greedy(None, prompts, 12, None, base) != got
    llm.close()


def test_a_glm4_adapter_matches_peft(tmp_path: Path) -> None:
    """GLM-4's q and k rows are reordered as they load (its rotary pairs dims (0, 1), ...):
    an adapter's q and k updates are reordered alike, and give peft's merged model's tokens."""
    base = tiny_checkpoint(tmp_path / "glm4", "glm4", num_hidden_layers=2, hidden_size=64,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                           intermediate_size=96, pad_token_id=None)  # fmt: skip
    adapter = make_adapter(tmp_path / "a", 5, base, **ADAPTERS["attn-r8"])
    lora = LoRAConfig(modules=(("g", str(adapter)),), max_loras=1, max_lora_rank=8)
    prompts = [[5, 6, 7, 8, 9], list(range(100, 140))]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, lora_name="g")
    with LLM(str(base), lora_config=lora) as llm:
        got = [r.outputs[0].token_ids for r in llm.generate(prompts, params)]
    assert (
        got
        == peft_greedy(adapter, prompts, 12, None, base)
        != peft_greedy(None, prompts, 12, None, base)
    )
