"""Engine behaviour users notice: seeded sampling, input errors, stop strings, logprobs, n > 1."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from protos.blocks import blocks_for
from protos.sampling_params import InvalidRequestError, SamplingParams
from services.config import CacheConfig, ConfigError
from services.engine.kv_cache import CPU_DEFAULT_MAX_MODEL_LEN, plan_num_blocks
from services.engine.llm import LLM
from services.engine.llm_engine import LLMEngine
from services.engine.outputs import RequestOutput
from tests.services.engine.conftest import count_launches


@pytest.fixture(scope="module")
def tiny_llm(tiny_llama: Path) -> LLM:
    """For the tests whose claim is the engine's, not the model's text (a seed's draws, n
    samples, the prefix cache's salts, a resumed request): a tiny random Llama with the embedded
    model's tokenizer (its vocabulary and chat template, so ``chat_ids`` are its prompts too)
    and the session engine's 32 seats, a step a small fraction of the embedded model's."""
    return LLM(str(tiny_llama), max_num_seqs=32)


def test_seeded_sampling_ignores_batch_composition(
    tiny_llm: LLM, chat_ids: list[list[int]]
) -> None:
    # 12 tokens (was 20), the suite's time: the seed's noise is drawn at every one of them
    seeded = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_tokens=12)
    alone = tiny_llm.generate([chat_ids[1]], seeded)[0].outputs[0].token_ids
    noise = SamplingParams(temperature=1.0, max_tokens=12)
    batch = tiny_llm.generate([chat_ids[0], chat_ids[1], chat_ids[2]], [noise, seeded, noise])
    assert batch[1].outputs[0].token_ids == alone
    other_seed = tiny_llm.generate(
        [chat_ids[1]], SamplingParams(temperature=0.9, seed=99, max_tokens=12)
    )
    assert other_seed[0].outputs[0].token_ids != alone


def test_n_samples_share_the_prompt_and_differ(tiny_llm: LLM, chat_ids: list[list[int]]) -> None:
    res = tiny_llm.generate(
        [chat_ids[3]], SamplingParams(temperature=1.0, seed=7, n=3, max_tokens=12)
    )
    outs = [o.token_ids for o in res[0].outputs]
    assert len(outs) == 3 and len({tuple(o) for o in outs}) > 1
    assert tiny_llm.engine.stats().free_blocks == tiny_llm.engine.stats().total_blocks


def test_stop_string_is_cut_and_reported(llm: LLM) -> None:
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    out = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=30, stop=["Paris"]))[0].outputs[0]
    assert out.text == "The capital of France is "
    assert out.finish_reason == "stop" and out.stop_reason == "Paris"


def test_stop_token_ids_and_min_tokens(llm: LLM, chat_ids: list[list[int]]) -> None:
    greedy = llm.generate([chat_ids[0]], SamplingParams(temperature=0, max_tokens=10))[0].outputs[0]
    second = greedy.token_ids[1]
    stopped = llm.generate(
        [chat_ids[0]], SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[second])
    )[0].outputs[0]
    assert stopped.token_ids == greedy.token_ids[:2] and stopped.finish_reason == "stop"
    # the answer ends on its own (8 tokens): min_tokens of 12 (was 30, the suite's time) keeps
    # it going past its end
    assert greedy.finish_reason == "stop" and len(greedy.token_ids) < 12
    long = llm.generate([chat_ids[0]], SamplingParams(temperature=0, max_tokens=20, min_tokens=12))
    assert len(long[0].outputs[0].token_ids) >= 12


def test_a_stop_token_is_in_the_token_ids_not_in_the_text(
    llm: LLM, chat_ids: list[list[int]]
) -> None:
    """As vLLM: the token that ends the output (a stop_token_id, or EOS shown with
    skip_special_tokens off) stays in its token ids and out of its text, unless
    include_stop_str_in_output; stop_reason is a stop_token_id, None for EOS."""
    greedy = llm.generate([chat_ids[0]], SamplingParams(temperature=0, max_tokens=10))[0].outputs[0]
    tok = greedy.token_ids[2]
    head = llm.tokenizer.decode(greedy.token_ids[:2])
    both = llm.tokenizer.decode(greedy.token_ids[:3])
    assert both != head  # the third token has text of its own
    # max_tokens 3: the stop token is also the last one allowed, still a stop (vLLM's order)
    for include, want, most in ((False, head, 10), (True, both, 10), (False, head, 3)):
        params = SamplingParams(temperature=0, max_tokens=most, stop_token_ids=[tok],
                                include_stop_str_in_output=include)  # fmt: skip
        out = llm.generate([chat_ids[0]], params)[0].outputs[0]
        assert out.token_ids == greedy.token_ids[:3]
        assert (out.text, out.finish_reason, out.stop_reason) == (want, "stop", tok)
    full = SamplingParams(temperature=0, max_tokens=200, skip_special_tokens=False)
    out = llm.generate([chat_ids[0]], full)[0].outputs[0]
    eos = out.token_ids[-1]  # the end of sequence: no stop_reason (vLLM's None), unless listed
    assert out.finish_reason == "stop" and eos in llm.engine.eos_token_ids
    assert out.stop_reason is None
    assert out.text == llm.tokenizer.decode(out.token_ids[:-1], skip_special_tokens=False)
    at_eos = replace(full, max_tokens=len(out.token_ids))  # EOS the last token allowed
    assert llm.generate([chat_ids[0]], at_eos)[0].outputs[0] == out


def test_logprobs_are_log_probabilities(llm: LLM, chat_ids: list[list[int]]) -> None:
    out = llm.generate([chat_ids[0]], SamplingParams(temperature=0, max_tokens=4, logprobs=3))
    for pos, tok in zip(out[0].outputs[0].logprobs, out[0].outputs[0].token_ids, strict=True):
        assert pos.chosen.token_id == tok and pos.chosen.logprob <= 0.0
        assert len(pos.top) == 3 and pos.top[0].token_id == tok  # greedy picks the best
        assert pos.top[0].logprob >= pos.top[1].logprob >= pos.top[2].logprob


def test_a_cache_salt_keeps_prefix_cache_hits_within_its_salt(tiny_llm: LLM) -> None:
    """vLLM's cache_salt: a prompt's cached blocks are found by the same prompt with the same
    salt only, not by another salt or none (and unsalted blocks not by a salted request); the
    text does not depend on it."""
    prompt = [(37 * i) % 40000 + 100 for i in range(70)]  # 4 full blocks of 16, fresh
    params = SamplingParams(temperature=0.0, max_tokens=4)

    def run(salt: str) -> tuple[list[int], int]:
        out = tiny_llm.generate([prompt], replace(params, cache_salt=salt))[0]
        return out.outputs[0].token_ids, out.num_cached_tokens

    first, cached = run("tenant-a")
    assert cached == 0
    assert run("tenant-b") == (first, 0)
    assert run("") == (first, 0)
    assert run("tenant-a") == (first, 64)
    assert run("")[1] == 64  # the unsalted run above cached its own blocks


def test_bad_words_keep_a_word_out_of_the_output(llm: LLM, chat_ids: list[list[int]]) -> None:
    """vLLM's bad_words: a word the greedy output holds, banned, is gone from it (as it is
    and after a space), and the output up to the word is the same."""
    params = SamplingParams(temperature=0.0, max_tokens=24)
    text = llm.generate(chat_ids[:1], params)[0].outputs[0].text
    word = next(w for w in text.split() if w.isalpha() and len(w) > 3)
    again = llm.generate(chat_ids[:1], replace(params, bad_words=[word]))[0].outputs[0].text
    assert f" {word}" not in f" {again}" and again != text
    assert again.startswith(text[: text.index(word)].rstrip())


def test_allowed_token_ids_restrict_what_is_sampled(llm: LLM, chat_ids: list[list[int]]) -> None:
    """vLLM's allowed_token_ids: greedy and sampled outputs hold only those tokens; an id past
    the vocabulary is refused when the request is added."""
    allowed = [28, 29, 30, 216, 2]  # '=', '>', '?', a newline, the end of a turn
    for params in (SamplingParams(temperature=0.0, max_tokens=6, allowed_token_ids=allowed),
                   SamplingParams(temperature=1.0, seed=3, max_tokens=6,
                                  allowed_token_ids=allowed)):  # fmt: skip
        out = llm.generate(chat_ids[:2], params)
        for r in out:
            assert r.outputs[0].token_ids and set(r.outputs[0].token_ids) <= set(allowed)
    with pytest.raises(InvalidRequestError, match="allowed_token_ids token id 60000"):
        llm.generate([[1, 2]], SamplingParams(allowed_token_ids=[60000]))


@pytest.mark.parametrize(
    ("params", "match"),
    [
        (SamplingParams(allowed_token_ids=[45], bad_words=["="]), "bad_words bans every one"),
        (SamplingParams(allowed_token_ids=[2], min_tokens=3), "before min_tokens"),
        (
            SamplingParams(allowed_token_ids=[2, 29], stop_token_ids=[29], min_tokens=1),
            "before min_tokens",
        ),
    ],
)
def test_allowed_token_ids_that_leave_no_token_are_refused(
    llm: LLM, params: SamplingParams, match: str
) -> None:
    """Where the sampler would have nothing to pick (and would emit token 0), the request is
    refused naming allowed_token_ids; a token left over is enough."""
    assert llm.tokenizer.encode("=", add_special_tokens=False) == [45]
    with pytest.raises(InvalidRequestError, match=match) as err:
        llm.generate([[1, 2]], replace(params, max_tokens=4))
    assert err.value.param == "allowed_token_ids"
    ok = replace(params, max_tokens=4, allowed_token_ids=[*params.allowed_token_ids, 30])
    out = llm.generate([[1, 2]], ok)[0].outputs[0]
    assert out.token_ids and set(out.token_ids) <= {*ok.allowed_token_ids}


@pytest.mark.parametrize(
    ("prompt", "params", "param"),
    [
        ([], SamplingParams(), "prompt"),
        ([1, 10**9], SamplingParams(), "prompt"),
        ([-1], SamplingParams(), "prompt"),
        ([1] * 9000, SamplingParams(), "prompt"),
    ],
)
def test_bad_prompts_get_clear_errors(
    llm: LLM, prompt: list[int], params: SamplingParams, param: str
) -> None:
    with pytest.raises(InvalidRequestError) as err:
        llm.engine.add_request("bad", prompt, params)
    assert err.value.param == param and str(err.value)
    assert not llm.engine.has_unfinished


def test_a_priority_needs_the_priority_policy(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """First come, first served would quietly ignore a request's priority: refused, as vLLM
    does, with what to change; under the priority policy it is taken."""
    from dataclasses import replace

    with pytest.raises(InvalidRequestError, match="--scheduling-policy priority") as err:
        llm.engine.add_request("urgent", [1, 2], SamplingParams(max_tokens=1), priority=3)
    assert err.value.param == "priority" and not llm.engine.has_unfinished
    with pytest.raises(InvalidRequestError, match="--scheduling-policy priority"):
        llm.engine.reserve("urgent", [1, 2], SamplingParams(max_tokens=1), priority=-1)
    config = llm.engine.config
    monkeypatch.setattr(
        llm.engine,
        "config",
        replace(config, scheduler=replace(config.scheduler, policy="priority")),
    )
    llm.engine.add_request("urgent", [1, 2], SamplingParams(max_tokens=1), priority=3)
    assert llm.engine.abort("urgent") is not None and not llm.engine.has_unfinished


def test_context_overflow_message_says_the_limit(llm: LLM) -> None:
    # on the CPU, without --max-model-len, the embedded model (8192 positions) serves 2048
    assert llm.engine.max_model_len == CPU_DEFAULT_MAX_MODEL_LEN == 2048
    with pytest.raises(InvalidRequestError, match="maximum context length is 2048 tokens"):
        llm.engine.add_request("long", [1] * 2048, SamplingParams())


def test_the_cpu_default_pool_holds_one_sequence_of_max_model_len(llm: LLM) -> None:
    """Without --kv-cache-gib/--num-blocks a CPU pool is sized from --max-model-len, not 1 GiB."""
    runner = llm.engine.runner
    assert runner.num_blocks == blocks_for(runner.max_model_len, runner.block_size)
    cache = CacheConfig(block_size=16)
    cpu = torch.device("cpu")
    assert plan_num_blocks(cache, runner.arch, torch.float32, cpu, 4096) == 256
    assert plan_num_blocks(CacheConfig(block_size=16, num_blocks=9), runner.arch, torch.float32,
                           cpu, 4096) == 9  # fmt: skip


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [({"max_tokens": 0}, "max_tokens"), ({"temperature": -0.5}, "temperature"),
     ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p")],
)  # fmt: skip
def test_bad_sampling_params(kwargs: dict, param: str) -> None:
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(**kwargs)
    assert err.value.param == param and param in str(err.value)


def test_max_model_len_that_does_not_fit_is_refused_with_the_fix() -> None:
    with pytest.raises(ConfigError) as err:
        LLM("embedded", num_blocks=4, max_model_len=1024)
    msg = str(err.value)
    assert "--max-model-len 64" in msg and "--num-blocks" in msg


def test_logit_bias_bans_and_forces_tokens(llm: LLM, chat_ids: list[list[int]]) -> None:
    ids = chat_ids[0]
    plain = llm.generate([ids], SamplingParams(temperature=0, max_tokens=3))[0].outputs[0]
    first = plain.token_ids[0]
    banned = SamplingParams(temperature=0, max_tokens=3, logit_bias={str(first): -100})
    assert llm.generate([ids], banned)[0].outputs[0].token_ids[0] != first
    forced = SamplingParams(temperature=0.7, seed=1, max_tokens=3, logit_bias={"42": 100})
    assert llm.generate([ids], forced)[0].outputs[0].token_ids == [42, 42, 42]
    with pytest.raises(InvalidRequestError, match="logit_bias token id"):
        llm.engine.validate(ids, SamplingParams(logit_bias={llm.engine.vocab_size: 1}))


def test_logprob_tokens_carry_their_bytes(llm: LLM) -> None:
    text = "I love 😀 and 日本語"
    ids = llm.engine.tokenizer.encode(text, add_special_tokens=False)
    pieces = [llm.engine._token_logprob(i, -1.0) for i in ids]
    assert b"".join(p.token_bytes for p in pieces) == text.encode("utf-8")
    assert any("\ufffd" in p.token for p in pieces)  # the emoji is split over tokens


def test_every_step_counts_its_tokens_in_the_iteration_histogram(llm: LLM) -> None:
    """A 20-token prompt, 4 tokens: one step computes the prompt (and samples the first token),
    three compute one token each. Ids no other test uses, so the prefix cache holds none."""
    before = llm.engine.stats().iteration_tokens
    prompt = [7000 + i for i in range(20)]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    assert len(llm.generate([prompt], params)[0].outputs[0].token_ids) == 4
    after = llm.engine.stats().iteration_tokens
    assert after.count - before.count == 4
    assert after.sum - before.sum == 20 + 3
    grew = [a - b for a, b in zip(after.counts, before.counts, strict=True)]
    assert dict(zip(after.bounds, grew, strict=True))[1.0] == 3  # the decode steps
    assert dict(zip(after.bounds, grew, strict=True))[32.0] == 4  # and the prompt's


def test_outputs_made_during_the_next_forward_are_those_made_at_once(
    llm: LLM, chat_ids: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step's tokens become outputs (detokenized, stop strings checked) while the next step's
    forward runs; a stop string found then ends its request one computed token late, which
    nobody sees: the same results as outputs made at once, and every block free after."""
    engine = llm.engine
    monkeypatch.setattr(engine, "async_decode", False)  # launched steps emit at once
    monkeypatch.setattr(engine, "defer_outputs", True)  # a GPU's way, on the CPU
    params = [
        SamplingParams(temperature=0, max_tokens=24, stop=["the", "."]),
        SamplingParams(temperature=0, max_tokens=3),
        SamplingParams(temperature=0, max_tokens=40, stop=[" is"], include_stop_str_in_output=True),
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
    ]
    prompts = chat_ids[:4]
    deferred = 0
    take = type(engine)._take_pending

    def counting(self: object) -> list:
        nonlocal deferred
        pending = take(self)  # type: ignore[arg-type]
        deferred += bool(pending)
        return pending

    monkeypatch.setattr(type(engine), "_take_pending", counting)
    late = llm.generate(prompts, params)
    assert deferred > 5  # the outputs of most steps were made during the next one
    monkeypatch.setattr(type(engine), "_may_defer", lambda self, updates: False)
    at_once = llm.generate(prompts, params)
    for a, b in zip(late, at_once, strict=True):
        (oa,), (ob,) = a.outputs, b.outputs
        assert (oa.token_ids, oa.text, oa.finish_reason, oa.stop_reason) == (
            ob.token_ids, ob.text, ob.finish_reason, ob.stop_reason)  # fmt: skip
    assert {o.outputs[0].finish_reason for o in late} == {"stop", "length"}
    assert engine.stats().free_blocks == engine.stats().total_blocks


@pytest.mark.parametrize("async_scheduling", [None, False])
def test_on_the_cpu_each_step_returns_its_own_tokens(
    tiny_llama: Path, chat_ids: list[list[int]], async_scheduling: bool | None
) -> None:
    """On the CPU nothing runs while the host works: a step's tokens held for the next step's
    forward (or a step launched ahead of reading them) would reach the client a whole forward
    late (the first token after two steps). Each call returns the token its own forward made."""
    engine = LLM(str(tiny_llama), async_scheduling=async_scheduling).engine
    assert not engine.async_decode and not engine.defer_outputs
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    engine.add_request("r", chat_ids[0], params)
    for n in range(1, 7):
        (out,) = engine.step()  # the prompt's step gives the first token, each next one more
        assert out.request_id == "r" and len(out.token_ids) == 1
        assert out.finished == (n == 6)
    assert not engine.has_unfinished


def test_max_tokens_none_generates_until_the_context_is_full(
    tiny_llama: Path, chat_ids: list[list[int]]
) -> None:
    """vLLM's offline max_tokens=None: the request runs until the context is full."""
    llm = LLM(str(tiny_llama), max_model_len=64)
    prompt = (chat_ids[0] * 4)[:50]
    params = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)  # type: ignore[arg-type]
    (out,) = llm.generate([prompt], params)
    assert len(out.outputs[0].token_ids) == 14 and out.outputs[0].finish_reason == "length"
    assert llm.engine.stats().free_blocks == llm.engine.stats().total_blocks


def _until_last_output_waits(
    engine: LLMEngine, short: str, short_ids: list[int], long: str, long_ids: list[int]
) -> list[RequestOutput]:
    """Run ``short`` (2 tokens) beside ``long`` (50) until ``short``'s last output waits for the
    next step's forward; the outputs returned meanwhile."""
    engine.add_request(short, short_ids, SamplingParams(temperature=0, max_tokens=2))
    engine.add_request(long, long_ids, SamplingParams(temperature=0, max_tokens=50))
    seen: list[RequestOutput] = []
    while not any(u.request_id == short and u.finished for u in engine._pending):
        seen += engine.step()
    return seen


def test_an_abort_while_the_last_output_waits_ends_the_request_as_aborted(
    llm: LLM, chat_ids: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = llm.engine
    monkeypatch.setattr(engine, "async_decode", False)  # outputs wait only without launches
    monkeypatch.setattr(engine, "defer_outputs", True)
    seen = _until_last_output_waits(engine, "short", chat_ids[0], "long", chat_ids[1])
    assert not any(o.request_id == "short" and o.finished for o in seen)
    out = engine.abort("short")
    assert out is not None and out.finished and out.finish_reason == "abort"
    assert out.num_prompt_tokens == len(chat_ids[0])
    assert engine.abort("long") is not None
    while engine.has_unfinished:
        assert all(o.request_id not in ("short", "long") for o in engine.step())
    assert engine.stats().free_blocks == engine.stats().total_blocks


def test_a_last_output_still_waiting_is_delivered_when_nothing_else_runs(
    llm: LLM, chat_ids: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = llm.engine
    monkeypatch.setattr(engine, "async_decode", False)
    monkeypatch.setattr(engine, "defer_outputs", True)
    _until_last_output_waits(engine, "done", chat_ids[2], "other", chat_ids[3])
    assert engine.abort("other") is not None  # nothing is left to run...
    assert engine.has_unfinished  # ...but an output is still to be made
    (last,) = engine.step()
    assert last.request_id == "done" and last.finished and last.finish_reason == "length"
    assert not engine.has_unfinished
    assert engine.stats().free_blocks == engine.stats().total_blocks


def test_two_hundred_aborts_mid_stream_leave_every_block_free(
    tiny_llama: Path, chat_ids: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Aborts land between steps at every point of a request's life (waiting, prefilling,
    decoding, its last output still to be made, a decode step queued ahead of it): each
    request ends exactly once, nothing streams after its abort, and the pool is whole again.
    The lives are the scheduler's: a tiny random Llama with the session engine's 32 seats and
    128 blocks serves them."""
    import random

    engine = LLM(str(tiny_llama), max_num_seqs=32, num_blocks=128, async_scheduling=True).engine
    rng = random.Random(7)
    launches = count_launches(engine, monkeypatch)
    live: set[str] = set()
    ended: dict[str, str] = {}
    for i in range(200):
        stop = ["."] if i % 3 == 0 else []
        engine.add_request(f"a{i}", chat_ids[i % len(chat_ids)],
                           SamplingParams(temperature=0, max_tokens=4 + i % 9, stop=stop))  # fmt: skip
        live.add(f"a{i}")
    while engine.has_unfinished:
        for out in engine.step():
            assert out.request_id in live, f"{out.request_id} streamed after it ended"
            if out.finished:
                live.discard(out.request_id)
                ended[out.request_id] = out.finish_reason or ""
        for rid in rng.sample(sorted(live), min(len(live), rng.randint(0, 12))):
            out = engine.abort(rid)
            assert out is not None and out.finished and out.finish_reason == "abort"
            live.discard(rid)
            ended[rid] = "abort"
    assert not live and len(ended) == 200
    assert 20 < list(ended.values()).count("abort") < 200  # aborts and natural ends both
    assert launches[0] > 0  # async scheduling (a GPU's default) launched steps ahead
    assert engine.stats().free_blocks == engine.stats().total_blocks


def _deltas(engine: LLMEngine, rid: str) -> list[RequestOutput]:
    outs: list[RequestOutput] = []
    while engine.has_unfinished:
        outs.extend(o for o in engine.step() if o.request_id == rid)
    return outs


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0, max_tokens=24, stop=["ZZZ"]),  # holds back text
        SamplingParams(temperature=0.9, top_p=0.95, seed=11, max_tokens=24),
    ],
    ids=["greedy-stop-strings", "seeded"],
)
def test_a_request_resumed_with_its_sent_tokens_goes_on_as_if_never_moved(
    tiny_llm: LLM, chat_ids: list[list[int]], params: SamplingParams
) -> None:
    """A request whose decode worker died mid-stream is added again with the tokens the client
    got (``output_token_ids``): it generates the tokens the first run went on with (greedy, and
    seeded by output position), the text already sent is not sent again and none is lost (a
    stop string holds some back), and max_tokens counts the earlier tokens."""
    engine = tiny_llm.engine
    engine.add_request("whole", chat_ids[2], params)
    whole = _deltas(engine, "whole")
    tokens = [t for o in whole for t in o.token_ids]
    assert len(tokens) == 24
    k = 0
    sent_text = ""
    for o in whole:  # the client got the deltas up to some step
        if k >= 7:
            break
        k += len(o.token_ids)
        sent_text += o.text
    engine.add_request("resumed", chat_ids[2], params, output_token_ids=tokens[:k])
    rest = _deltas(engine, "resumed")
    assert [t for o in rest for t in o.token_ids] == tokens[k:]
    assert sent_text + "".join(o.text for o in rest) == "".join(o.text for o in whole)
    assert rest[-1].finish_reason == "length"
    assert engine.stats().free_blocks == engine.stats().total_blocks


def test_a_resumed_request_must_have_something_left_to_generate(llm: LLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=3)
    with pytest.raises(InvalidRequestError, match="nothing to generate") as e:
        llm.engine.add_request("done", [1, 2, 3], params, output_token_ids=[5, 6, 7])
    assert e.value.param == "output_token_ids"
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        llm.engine.add_request("bad", [1, 2, 3], params, output_token_ids=[10**7])
    assert not llm.engine.has_unfinished


def test_a_closed_llm_gives_its_pool_back_and_refuses_to_generate() -> None:
    """close() frees the KV pool at once (an engine made next in the process sizes its pool from
    the memory left), whatever still refers to the old LLM; using it then is a clear error."""
    llm = LLM("embedded", num_blocks=8, max_model_len=128)
    assert llm.engine.runner.kv_caches
    with llm:
        pass
    assert llm.engine.runner.kv_caches == [] and llm.engine.runner.graphs is None
    with pytest.raises(RuntimeError, match="closed"):
        llm.generate("hello", SamplingParams(max_tokens=2))


def _unseeded_sample(model: str, **seeds: int) -> list[int]:
    llm = LLM(model, load_format="dummy", dtype="float32", device="cpu",
              max_model_len=128, num_blocks=16, max_num_seqs=2, dummy_weight_seed=0, **seeds)  # fmt: skip
    try:
        params = SamplingParams(temperature=1.0, max_tokens=12)  # no seed of its own
        return list(llm.generate([[11, 22, 33, 44, 55]], params)[0].outputs[0].token_ids)
    finally:
        llm.close()


def test_the_engine_seed_makes_unseeded_sampling_reproducible(tmp_path: Path) -> None:
    """Three engines of dummy weights: SmolLM2's config shrunk to 2 layers of 64 (its
    tokenizer, its vocabulary), the suite's time; the size plays no part in the seeding."""
    import json
    import shutil

    from services.model_files import resolve_model
    from tests.services.engine.conftest import tokenizer_dir

    config = json.loads(resolve_model("smollm2-135m").path.read_text())
    config |= {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
               "num_attention_heads": 4, "num_key_value_heads": 2}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    for file in Path(tokenizer_dir()).glob("tokenizer*"):
        shutil.copy(file, tmp_path / file.name)
    first = _unseeded_sample(str(tmp_path), seed=1234)
    assert _unseeded_sample(str(tmp_path), seed=1234) == first
    assert _unseeded_sample(str(tmp_path), seed=4321) != first


def test_seed_sets_the_dummy_weights_unless_dummy_weight_seed_does() -> None:
    from services.config import ModelConfig

    assert ModelConfig(load_format="dummy").weights_seed == 0
    assert ModelConfig(load_format="dummy", seed=5).weights_seed == 5
    assert ModelConfig(load_format="dummy", seed=5, dummy_weight_seed=9).weights_seed == 9
