"""Speculative decoding with a draft model: the same greedy and seeded text as without it (the
embedded model as its own draft, and a tiny random draft for a tiny random target), drafts all
kept when the draft is the target, the target's distribution at temperature 1, and drafts that
cannot serve the target refused."""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from protos.sampling_params import SamplingParams
from services.config import ConfigError, SpeculativeConfig
from services.engine import draft_proposer
from services.engine.kv_cache import block_bytes
from services.engine.llm import LLM
from services.engine.llm_engine import LLMEngine
from services.engine.speculative import VERIFY_ROWS, PromptChunk, ProposalRequest
from tests.services.engine.conftest import BESIDE, hand_over, save_test_tokenizer
from tests.services.engine.test_speculative import COPYING, PROMPTS


def _build(
    path: Path, layers: int, vocab: int, init: float, like: object = None, seed: int = 0
) -> object:
    """A tiny random Llama with the embedded model's tokenizer; ``like``: a model whose weights
    it takes where the names match (a draft made of the target's first layers)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        initializer_range=init, tie_word_embeddings=True, bos_token_id=None, eos_token_id=None,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_config(cfg)
    if like is not None:
        model.load_state_dict(like.state_dict(), strict=False)  # type: ignore[attr-defined]
    model.save_pretrained(path)
    save_test_tokenizer(path)
    return model.eval()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A 4-layer target and a draft of its first 2 layers: they agree on about a third of the
    greedy tokens, so drafts are kept, cut after the first, the second... or all rejected."""
    root = tmp_path_factory.mktemp("tiny")
    target = _build(root / "target", 4, 49152, 0.06)
    _build(root / "draft", 2, 49152, 0.06, like=target)
    return root / "target", root / "draft"


@pytest.fixture(scope="module")
def stranger(tiny: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 1-layer draft of other random weights: it (nearly) never agrees with the target."""
    path = tmp_path_factory.mktemp("stranger") / "draft"
    _build(path, 1, 49152, 0.06, seed=1)
    return path


def _ids(results: list) -> list[list[int]]:
    return [r.outputs[0].token_ids for r in results]


def _mixed_requests(seed: int, n: int, vocab: int) -> tuple[list[list[int]], list[SamplingParams]]:
    """Prompts of 3 to 300 tokens (up to 19 blocks, past a step's budget of 128) and outputs of
    4 to 64 tokens, so requests start and finish at different steps."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(3, 300))] for _ in range(n)]
    params = [SamplingParams(max_tokens=rng.randint(4, 64), temperature=0, ignore_eos=True)
              for _ in range(n)]  # fmt: skip
    return prompts, params


Mixed = tuple[list[list[int]], list[SamplingParams], list[list[int]]]


@pytest.fixture(scope="module")
def mixed(tiny: tuple[Path, Path]) -> Mixed:
    """24 mixed requests and the tiny target's greedy tokens for them without a draft, computed
    once: the reference of every test here that gives a drafting engine all of them or the
    first 16 (a request's greedy tokens are the same in whatever batch it runs)."""
    target, _ = tiny
    prompts, params = _mixed_requests(0, 24, 49152)
    return prompts, params, _ids(LLM(str(target), max_num_seqs=32).generate(prompts, params))


@pytest.fixture(scope="module")
def self_draft() -> LLM:
    config = {"model": "embedded", "num_speculative_tokens": 3}
    return LLM("embedded", max_num_seqs=32, speculative_config=config)


def test_the_embedded_model_as_its_own_draft_gives_the_same_text_and_keeps_its_drafts(
    llm: LLM, self_draft: LLM
) -> None:
    params = SamplingParams(max_tokens=16, temperature=0)  # 16: 136 drafts, the suite's time
    stats = self_draft.engine.spec_stats
    before = (stats.num_draft_tokens, stats.num_accepted_tokens)
    assert _ids(self_draft.generate(PROMPTS, params)) == _ids(llm.generate(PROMPTS, params))
    proposed, kept = stats.num_draft_tokens - before[0], stats.num_accepted_tokens - before[1]
    # the draft's KV matches the target's position for position, so its argmax is the target's
    assert proposed > 100 and kept >= 0.97 * proposed, (proposed, kept)
    tables = self_draft.engine.proposer.tables  # type: ignore[union-attr]
    tables.check_invariants()
    assert tables.pool.num_free_blocks == tables.pool.num_blocks  # finished requests freed


def test_the_draft_pool_holds_the_targets_tokens_and_the_drafts(self_draft: LLM) -> None:
    """The CPU's default target pool is one sequence of 2048 tokens (128 blocks); the draft's
    holds as many tokens plus a block of drafts for each of the 32 requests that may propose,
    and on a GPU no more than half the memory left after the target."""
    engine = self_draft.engine
    proposer = engine.proposer
    assert isinstance(proposer, draft_proposer.DraftProposer)
    assert engine.runner.num_blocks == 128 and proposer.runner.num_blocks == 128 + 32
    arch = proposer.runner.arch
    per_block = block_bytes(arch, 16, torch.float32)
    sized = draft_proposer.draft_num_blocks
    assert sized(engine.config, engine.runner, arch, 100 * per_block) == 50
    assert sized(engine.config, engine.runner, arch, 10**12) == 160


def test_seeded_sampling_gives_the_same_text_with_the_draft(llm: LLM, self_draft: LLM) -> None:
    # 12 tokens (was 24), the suite's time: several verify steps of 3 drafts each still
    params = [
        SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=7, logprobs=2),
        SamplingParams(max_tokens=12, temperature=1.0, seed=3, presence_penalty=0.5),
        SamplingParams(max_tokens=12, temperature=0.7, top_k=20, seed=11, stop=["."]),
    ]
    prompts = COPYING[:3]
    stats = self_draft.engine.spec_stats
    before = stats.num_accepted_tokens
    want, got = llm.generate(prompts, params), self_draft.generate(prompts, params)
    assert stats.num_accepted_tokens > before  # drafts were verified and kept, not skipped
    assert [(r.outputs[0].token_ids, r.outputs[0].text) for r in got] == [
        (r.outputs[0].token_ids, r.outputs[0].text) for r in want
    ]


def test_a_tiny_random_draft_gives_the_target_greedy_text(
    tiny: tuple[Path, Path], mixed: Mixed
) -> None:
    target, draft = tiny
    prompts, params, want = mixed
    spec = LLM(str(target), max_num_seqs=32,
               speculative_config={"model": str(draft), "num_speculative_tokens": 4})  # fmt: skip
    assert _ids(spec.generate(prompts, params)) == want
    stats = spec.engine.spec_stats
    # drafts kept in part: some steps keep all four, others cut the run early
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert stats.accepted_per_position[3] > 0
    assert stats.accepted_per_position[0] > stats.accepted_per_position[3]
    tables = spec.engine.proposer.tables  # type: ignore[union-attr]
    tables.check_invariants()
    assert tables.pool.num_free_blocks == tables.pool.num_blocks


def test_a_tensor_parallel_target_takes_drafts_from_a_draft_on_rank_zero(
    tiny: tuple[Path, Path],
) -> None:
    """The target on two ranks (Gloo on the CPU), the draft whole on rank 0: its drafts reach
    the other rank as the verify step's tokens, and the greedy text is the one-rank target's
    without drafts."""
    target, draft = tiny
    prompts, params = _mixed_requests(3, 8, 49152)
    want = _ids(LLM(str(target), max_num_seqs=32, **BESIDE).generate(prompts, params))
    spec = LLM(str(target), max_num_seqs=32, tensor_parallel_size=2, **BESIDE,
               speculative_config={"model": str(draft), "num_speculative_tokens": 3})  # fmt: skip
    try:
        proposer = spec.engine.proposer
        assert isinstance(proposer, draft_proposer.DraftProposer)
        assert spec.engine.runner.ranks is not None and proposer.runner.ranks is None
        assert _ids(spec.generate(prompts, params)) == want
        assert spec.engine.spec_stats.num_accepted_tokens > 0
    finally:
        spec.close()


def test_preemption_and_a_small_draft_pool_keep_the_greedy_text(
    tiny: tuple[Path, Path], mixed: Mixed, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A target pool of 48 blocks for 16 requests of up to 364 tokens preempts; a draft pool of
    33 blocks (one sequence of max_model_len, and a bit) cannot hold every proposing request:
    entries are evicted and feed their tokens again, requests go without drafts for a step.
    The greedy text is the target's without drafts, computed where nothing was preempted."""
    target, draft = tiny
    monkeypatch.setattr(draft_proposer, "draft_num_blocks", lambda *args: 33)
    prompts, params, want = mixed[0][:16], mixed[1][:16], mixed[2][:16]
    knobs = {"max_num_seqs": 16, "num_blocks": 48, "max_model_len": 512}
    spec = LLM(str(target), **knobs,
               speculative_config={"model": str(draft), "num_speculative_tokens": 3})  # fmt: skip
    assert _ids(spec.generate(prompts, params)) == want
    assert spec.engine.scheduler.num_preemptions > 0
    assert spec.engine.spec_stats.num_accepted_tokens > 0
    tables = spec.engine.proposer.tables  # type: ignore[union-attr]
    assert tables.pool.num_blocks == 33 and tables.evictions > 0
    tables.check_invariants()


def _critical_chi2(dof: int) -> float:
    """The chi-square value exceeded with probability 0.001 (Wilson-Hilferty)."""
    z = 3.09
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


def _chi2(counts: Counter, probs: dict, n: int) -> tuple[float, int]:
    """Chi-square statistic and degrees of freedom, outcomes expected < 5 times pooled."""
    stat, rest_obs, rest_exp, bins = 0.0, 0, 0.0, 0
    for outcome, p in probs.items():
        if p * n >= 5:
            stat += (counts[outcome] - p * n) ** 2 / (p * n)
            bins += 1
        else:
            rest_obs, rest_exp = rest_obs + counts[outcome], rest_exp + p * n
    if rest_exp > 0:
        stat += (rest_obs - rest_exp) ** 2 / rest_exp
        bins += 1
    return stat, bins - 1


def test_temperature_one_keeps_the_target_distribution(tmp_path: Path) -> None:
    """A 12-token vocabulary: the first token comes from the prefill, the second is drafted
    (greedy; one draft, as a request drafts one token short of its max_tokens) and verified,
    the third is the bonus token or sampled in the next step. The joint law of (token 2,
    token 3) and the law of token 3 match the target's exact probabilities (transformers,
    enumerating prefixes)."""
    V, N = 12, 3000
    target = _build(tmp_path / "target", 3, V, 0.5)
    _build(tmp_path / "draft", 1, V, 0.5, like=target)
    prompt = [3, 7, 1, 9]
    with torch.no_grad():
        first = target(torch.tensor([prompt])).logits[0, -1].softmax(-1)  # type: ignore[operator]
        two = torch.tensor([[*prompt, a] for a in range(V)])
        second = target(two).logits[:, -1].softmax(-1)  # type: ignore[operator]  # [V, V]
        three = torch.tensor([[*prompt, a, b] for a in range(V) for b in range(V)])
        third = target(three).logits[:, -1].softmax(-1).view(V, V, V)  # type: ignore[operator]
    p12 = first[:, None] * second  # [V, V]: P(token 1, token 2)
    p123 = p12[:, :, None] * third  # [V, V, V]
    p23 = p123.sum(0).double()
    p3 = p123.sum((0, 1)).double()
    # 32 requests a step: half the steps of 16 for the same N samples, and each request still
    # gets its draft (a batch below VERIFY_ROWS, 64, has a row to spare for each)
    spec = LLM(str(tmp_path / "target"), max_num_seqs=32,
               speculative_config={"model": str(tmp_path / "draft"),
                                   "num_speculative_tokens": 2})  # fmt: skip
    params = SamplingParams(max_tokens=3, temperature=1.0, ignore_eos=True)
    outs = _ids(spec.generate([prompt] * N, params))
    stats = spec.engine.spec_stats
    assert stats.num_draft_tokens >= N and stats.num_accepted_tokens > N // 4  # really verified
    joint = Counter((o[1], o[2]) for o in outs)
    stat, dof = _chi2(joint, {(a, b): float(p23[a, b]) for a in range(V) for b in range(V)}, N)
    assert stat < _critical_chi2(dof), (stat, dof)
    stat, dof = _chi2(Counter(o[2] for o in outs), {c: float(p3[c]) for c in range(V)}, N)
    assert stat < _critical_chi2(dof), (stat, dof)


def test_drafts_that_cannot_serve_the_target_are_refused(
    tiny: tuple[Path, Path], tmp_path: Path
) -> None:
    target, _ = tiny
    _build(tmp_path / "small-vocab", 1, 1000, 0.06)
    with pytest.raises(ConfigError, match="vocabulary of 1000 tokens"):
        LLM(str(target), speculative_config={"model": str(tmp_path / "small-vocab")})
    short = tmp_path / "short-context"  # the target serves 1024 positions, this draft 512
    _build(short, 1, 49152, 0.06)
    config = json.loads((short / "config.json").read_text())
    (short / "config.json").write_text(json.dumps(config | {"max_position_embeddings": 512}))
    with pytest.raises(ConfigError, match="fewer than the target's max_model_len"):
        LLM(str(target), speculative_config={"model": str(short)})
    other = tmp_path / "other-tokenizer"
    _build(other, 1, 49152, 0.06)
    data = json.loads((other / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]  # token -> id: two tokens trade ids, the size stays
    vocab["hello"], vocab["world"] = vocab["world"], vocab["hello"]
    (other / "tokenizer.json").write_text(json.dumps(data))
    with pytest.raises(ConfigError, match="another tokenizer than the target"):
        LLM(str(target), speculative_config={"model": str(other)})


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ('{"method": "draft_model"}', 'needs "model"'),
        ('{"method": "draft_model", "model": 3}', 'needs "model"'),
        ('{"model": "x", "prompt_lookup_max": 3}', 'prompt_lookup_max is for method "ngram"'),
        ('{"method": "ngram", "model": "x"}', 'is for method "draft_model"'),
        ('{"model": "x", "draft_tensor_parallel_size": 1}', "not supported"),
    ],
)
def test_bad_draft_model_configs_are_refused(text: str, error: str) -> None:
    with pytest.raises(ConfigError, match=error):
        SpeculativeConfig.parse(text)


def test_a_model_alone_means_a_draft_model() -> None:
    config = SpeculativeConfig.parse('{"model": "embedded", "num_speculative_tokens": 5}')
    assert config == SpeculativeConfig("draft_model", 5, model="embedded")


def test_tandem_generate_takes_a_draft_and_exits_2_on_one_it_refuses(
    tiny: tuple[Path, Path], tmp_path: Path
) -> None:
    target, draft = tiny

    def generate(spec: str) -> subprocess.CompletedProcess[str]:
        cmd = [sys.executable, "-m", "services.cli", "generate", "--model", str(target),
               "--speculative-config", spec, "--prompt", "hello", "--max-tokens", "8", "--json"]  # fmt: skip
        return subprocess.run(cmd, capture_output=True, text=True, timeout=240)

    res = generate(json.dumps({"model": str(draft), "num_speculative_tokens": 2}))
    assert res.returncode == 0, res.stderr[-2000:]
    assert len(json.loads(res.stdout.splitlines()[-1])["token_ids"]) == 8
    _build(tmp_path / "small-vocab", 1, 1000, 0.06)
    res = generate(json.dumps({"model": str(tmp_path / "small-vocab")}))
    assert res.returncode == 2 and "vocabulary of 1000 tokens" in res.stderr


def test_on_a_decode_worker_the_draft_feeds_the_prompt_itself(
    tiny: tuple[Path, Path], mixed: Mixed
) -> None:
    """Disaggregated in one process: a prefill engine computes each prompt and its first token,
    its KV blocks are copied into the blocks the speculating decode engine reserved, and the
    decode engine gives the colocated engine's greedy text. The target is its own draft there:
    nearly every draft is kept only if the draft computed the prompt's KV itself."""
    target, _ = tiny
    prompts, params, want = mixed[0][:16], mixed[1][:16], mixed[2][:16]
    prefill = LLM(str(target), max_num_seqs=16).engine
    decode = LLM(str(target), max_num_seqs=16, num_blocks=400,  # every prompt reserved at once
                 speculative_config={"model": str(target), "num_speculative_tokens": 3}).engine  # fmt: skip

    def copy(prefill: LLMEngine, decode: LLMEngine, src: torch.Tensor, dst: torch.Tensor) -> None:
        for theirs, ours in zip(prefill.runner.kv_caches, decode.runner.kv_caches, strict=True):
            ours[:, dst] = theirs[:, src]

    # every prompt handed over first, then decoded together
    got = {f"r{i}": hand_over(prefill, decode, f"r{i}", prompt, sp, copy)
           for i, (prompt, sp) in enumerate(zip(prompts, params, strict=True))}  # fmt: skip
    while decode.has_unfinished:
        for out in decode.step():
            got[out.request_id] += out.token_ids
    assert [got[f"r{i}"] for i in range(len(prompts))] == want
    stats = decode.spec_stats
    assert stats.num_draft_tokens > 100
    assert stats.num_accepted_tokens >= 0.97 * stats.num_draft_tokens, stats


def _proposer(engine: LLMEngine) -> draft_proposer.DraftProposer:
    proposer = engine.proposer
    assert isinstance(proposer, draft_proposer.DraftProposer)
    return proposer


def test_a_draft_that_always_fails_costs_few_probes_and_keeps_the_text(
    tiny: tuple[Path, Path], stranger: Path
) -> None:
    """Batch 1, 128 tokens, nothing kept: 5 verify steps (tokens 0, 9, 26, 59, 123), the first
    with 4 drafts and the rest with one; the prompt was fed beside the target's prefill, so the
    first proposal catches up on one token, and no later one on more than VERIFY_ROWS."""
    target, _ = tiny
    prompt = [random.Random(5).randrange(49152) for _ in range(200)]
    params = SamplingParams(max_tokens=128, temperature=0, ignore_eos=True)
    want = _ids(LLM(str(target), max_num_seqs=4).generate([prompt], params))
    spec = LLM(str(target), max_num_seqs=4,
               speculative_config={"model": str(stranger), "num_speculative_tokens": 4})  # fmt: skip
    assert _ids(spec.generate([prompt], params)) == want
    stats, draft = spec.engine.spec_stats, _proposer(spec.engine).stats
    assert stats.num_accepted_tokens == 0
    assert (stats.num_drafts, stats.num_draft_tokens) == (5, 4 + 4)
    assert draft.prefill_tokens == 200 and draft.proposals == 5
    assert draft.forwards == 4 + 4  # K forwards for the first proposal, one for each other
    assert draft.catchup_tokens == 1 + 9 + 17 + 33 + 64  # a pause's tokens and the bonus token
    assert draft.graph_forwards == draft.forwards  # every proposal's forward fits a graph


def _hf_model(path: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _hf_greedy(model: Any, tokens: list[int], n: int) -> list[int]:
    """transformers' greedy continuation of ``tokens``: the draft run from scratch."""
    ids = torch.tensor([tokens])
    with torch.no_grad():
        for _ in range(n):
            ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids[0, len(tokens) :].tolist()


def test_the_drafts_after_a_catch_up_are_the_drafts_from_scratch(tiny: tuple[Path, Path]) -> None:
    """One request fed in prompt chunks, then proposing after kept, rejected and paused-over
    tokens (catch-ups of 1, 2, 9 and 99 tokens: the last past VERIFY_ROWS, not graphed); at
    each point its drafts equal those of a fresh request given the same tokens in one go, and
    the greedy tokens of the draft in transformers."""
    target, draft = tiny
    engine = LLM(str(target), max_num_seqs=4,
                 speculative_config={"model": str(draft), "num_speculative_tokens": 4}).engine  # fmt: skip
    proposer, rng = _proposer(engine), random.Random(3)
    reference = _hf_model(draft)
    prompt = [rng.randrange(49152) for _ in range(10)]  # all of it within a budget of 128
    for end in (4, 8, 10):  # the target's chunks, as the engine hands them over
        proposer.prefill([PromptChunk("a", prompt, [], end)])
    output, drafts = [rng.randrange(49152)], list[int]()
    for step, grow in enumerate([None, 2, 9, 99]):
        if grow is not None:  # keep the first draft, reject the rest, then more tokens
            output += [drafts[0], *(rng.randrange(49152) for _ in range(grow))]
        before = proposer.stats.catchup_tokens
        drafts = proposer.propose_batch([ProposalRequest("a", prompt, output, 4)], 4)["a"]
        assert proposer.stats.catchup_tokens - before == (1, 2, 9, 99)[step]
        scratch = ProposalRequest(f"scratch-{step}", prompt, output, 4)
        assert proposer.propose_batch([scratch], 4)[scratch.request_id] == drafts, step
        proposer.drop(scratch.request_id)
        assert _hf_greedy(reference, prompt + output, 4) == drafts, step
    assert VERIFY_ROWS < 99
    proposer.tables.check_invariants()
    proposer.drop("a")
    assert proposer.tables.pool.num_free_blocks == proposer.tables.pool.num_blocks


def test_aborts_mid_stream_and_finished_requests_leave_no_draft_kv(
    tiny: tuple[Path, Path],
) -> None:
    """Requests aborted while their prompt is being fed (chunked past the budget of 128) and
    while decoding with drafts, beside others that finish: the draft's pool is whole again and
    no adaptivity record is left."""
    target, draft = tiny
    engine = LLM(str(target), max_num_seqs=8,
                 speculative_config={"model": str(draft), "num_speculative_tokens": 3}).engine  # fmt: skip
    prompts, params = _mixed_requests(4, 8, 49152)
    for i, (prompt, sp) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(f"r{i}", prompt, replace(sp, max_tokens=40))
    tables = _proposer(engine).tables
    aborted: set[str] = set()
    while engine.has_unfinished:
        engine.step()
        running = {r.request_id: r for r in engine.scheduler.running}
        for rid, req in running.items():
            mid_prompt = 0 < req.num_computed_tokens < req.num_prompt_tokens
            decoding = req.num_output_tokens >= 3
            if rid in tables and len(aborted) < 4 and (mid_prompt or decoding):
                engine.abort(rid)
                aborted.add(rid)
        tables.check_invariants()
    assert len(aborted) == 4 and engine.spec_stats.num_drafts > 0
    assert tables.pool.num_free_blocks == tables.pool.num_blocks
    assert not tables._entries and not engine._acceptance


def test_a_batch_too_large_for_drafts_gets_no_draft_work(tiny: tuple[Path, Path]) -> None:
    """VERIFY_ROWS requests at once: the batch leaves no rows to spare once it decodes, so the
    draft neither prefills nor proposes while it fills (the first requests decode while the
    last prompts wait), up to the first request that finishes."""
    target, draft = tiny
    spec = LLM(str(target), max_num_seqs=VERIFY_ROWS,
               speculative_config={"model": str(draft), "num_speculative_tokens": 3}).engine  # fmt: skip
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    for i in range(VERIFY_ROWS):
        spec.add_request(f"r{i}", [random.Random(i).randrange(49152) for _ in range(40)], params)
    decoded = 0
    while not any(out.finished for out in spec.step()):
        decoded = max(decoded, *(r.num_output_tokens for r in spec.scheduler.running))
    stats = _proposer(spec).stats
    assert decoded > 10  # the first requests decoded for a while beside the filling batch
    assert spec.spec_stats.num_drafts == 0
    assert stats.prefill_tokens == 0 and stats.proposals == 0


def test_one_catch_up_past_a_graph_per_call(tiny: tuple[Path, Path]) -> None:
    """Three requests whose prompts the draft never saw (a decode worker's, or a big batch
    draining): each call feeds one whole context and drafts for it, the others wait; requests
    already caught up are not held back by them; one near its end is never caught up."""
    target, draft = tiny
    engine = LLM(str(target), max_num_seqs=8,
                 speculative_config={"model": str(draft), "num_speculative_tokens": 2}).engine  # fmt: skip
    proposer, rng = _proposer(engine), random.Random(5)
    asks = [
        ProposalRequest(f"r{i}", [rng.randrange(49152) for _ in range(VERIFY_ROWS + 20)], [7], 2)
        for i in range(3)
    ]
    short = ProposalRequest("short", [rng.randrange(49152) for _ in range(5)], [9], 2)
    proposer.prefill([PromptChunk("short", short.prompt, [], len(short.prompt))])
    ending = ProposalRequest("ending", asks[0].prompt[::-1], [7], 2, remaining=10)
    got, fed = [], []
    for _ in range(3):
        before = proposer.stats.catchup_tokens
        got.append(set(proposer.propose_batch([ending, *asks, short], 8)))
        fed.append(proposer.stats.catchup_tokens - before)
    # "ending" is 10 tokens from its end: a whole context fed for it would not pay back
    assert got == [{"r0", "short"}, {"r0", "r1", "short"}, {"r0", "r1", "r2", "short"}]
    whole = VERIFY_ROWS + 21  # one request's prompt and output
    assert all(whole <= n < whole + VERIFY_ROWS for n in fed), fed  # one whole context a call
    for rid in ("r0", "r1", "r2", "short"):
        proposer.drop(rid)
    assert proposer.tables.pool.num_free_blocks == proposer.tables.pool.num_blocks
