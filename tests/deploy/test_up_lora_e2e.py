"""Issue 22's multi-LoRA serving end to end: `tandem up --enable-lora --lora-modules ...` with
two random peft adapters on the embedded model, colocated and disaggregated, driven by the
official ``openai`` client. Requests of both adapters and of the base model, sent together so
the workers batch them, each get exactly the greedy tokens of peft's merged model
(transformers, float32); /v1/models lists the adapters under their parent; an unknown adapter
is a 404; runtime adapter updates work with --allow-runtime-lora-updating (the colocated
topology; a load of a bad directory is a 400 naming the worker, registering nothing) and are a
400 without it (the disaggregated one)."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from deploy.procfs import descendants
from tests.deploy.test_launcher import Up
from tests.deploy.test_up_e2e import READY, READY_COLOCATED, TANDEM_UP, kill_all
from tests.services.engine.lora_helpers import make_adapters, peft_greedy

pytestmark = pytest.mark.slow
MAX_TOKENS = 12
PROMPTS = ["Once upon a time, a dragon", "The best way to cook rice is"]
NAMES = ["attn-r8", "", "mlp-r16"]  # "" is the base model


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return make_adapters(tmp_path_factory.mktemp("adapters"))


@pytest.fixture(scope="module", params=["colocated", "disaggregated"])
def served(
    request: pytest.FixtureRequest, adapters: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, str, bool]]:  # fmt: skip
    """(base URL, base model id, runtime updates allowed) of one topology, with both adapters;
    the colocated one allows runtime adapter updates."""
    modules = [f"{name}={path}" for name, path in adapters.items()]
    flags = ["--max-model-len", "256", "--enable-lora", "--lora-modules", *modules,
             "--max-loras", "2", "--max-lora-rank", "16"]  # fmt: skip
    colocated = request.param == "colocated"
    if colocated:
        flags += ["--colocated", "1", "--allow-runtime-lora-updating"]
    up = Up(tmp_path_factory.mktemp("logs"), *flags, program=TANDEM_UP)
    started: set[int] = set()
    try:
        request.getfixturevalue("expected")  # peft's references, while the topology starts
        url, model = up.wait_for(READY_COLOCATED if colocated else READY, timeout_s=600).groups()
        started = descendants(up.proc.pid)
        yield url, model, colocated
    finally:
        kill_all(up, started)


@pytest.fixture(scope="module")
def expected(adapters: dict[str, Path]) -> dict[tuple[str, int], str]:
    """peft's merged model's greedy text for each (adapter, prompt)."""
    from services.engine.llm_engine import load_tokenizer
    from tests.services.engine.lora_helpers import base_hf_dir

    tok = load_tokenizer(str(base_hf_dir()))
    ids = [tok.encode(p) for p in PROMPTS]
    out = {}
    for name in NAMES:
        tokens = peft_greedy(adapters[name] if name else None, ids, MAX_TOKENS, tok.eos_token_id)
        for i, t in enumerate(tokens):
            out[(name, i)] = tok.decode(t, skip_special_tokens=True)
    assert out[("attn-r8", 0)] != out[("", 0)] != out[("mlp-r16", 0)]
    return out


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url, api_key="x", max_retries=0, timeout=300)


def test_a_mixed_batch_of_adapters_and_the_base_model_equals_peft(
    served: tuple[str, str, bool], expected: dict[tuple[str, int], str]
) -> None:
    url, model, _ = served
    jobs = [(name, i) for i in range(len(PROMPTS)) for name in NAMES]

    def one(job: tuple[str, int]) -> str:
        name, i = job
        out = client(url).completions.create(
            model=name or model, prompt=PROMPTS[i], max_tokens=MAX_TOKENS, temperature=0
        )
        assert out.model == (name or model)
        return out.choices[0].text

    with ThreadPoolExecutor(len(jobs)) as pool:  # together: the workers batch them
        got = dict(zip(jobs, pool.map(one, jobs), strict=True))
    assert got == {job: expected[job] for job in jobs}


def test_models_lists_the_adapters_under_the_base_model(
    served: tuple[str, str, bool], adapters: dict[str, Path]
) -> None:
    url, model, _ = served
    cards = {m.id: m for m in client(url).models.list().data}
    assert set(cards) == {model, "attn-r8", "mlp-r16"}
    assert getattr(cards["attn-r8"], "parent", None) == model
    assert getattr(cards["attn-r8"], "root", None) == str(adapters["attn-r8"])  # as vLLM's
    assert getattr(cards[model], "parent", None) is None


def test_an_unknown_adapter_is_a_404(served: tuple[str, str, bool]) -> None:
    url, _, _ = served
    with pytest.raises(openai.NotFoundError, match="`attn-r9` does not exist"):
        client(url).completions.create(model="attn-r9", prompt="hi", max_tokens=2)


def test_runtime_updates_work_only_with_the_flag(
    served: tuple[str, str, bool], adapters: dict[str, Path], expected: dict[tuple[str, int], str]
) -> None:
    url, _, allowed = served
    base = url.removesuffix("/v1")
    body = {"lora_name": "late", "lora_path": str(adapters["attn-r8"])}
    loaded = httpx.post(f"{base}/v1/load_lora_adapter", json=body, timeout=60)
    if not allowed:
        assert loaded.status_code == 400
        assert "--allow-runtime-lora-updating" in loaded.json()["error"]["message"]
        r = httpx.post(f"{base}/v1/unload_lora_adapter", json={"lora_name": "attn-r8"}, timeout=60)
        assert r.status_code == 400
        assert "late" not in {m.id for m in client(url).models.list().data}
        return
    assert loaded.status_code == 200, loaded.text
    assert "late" in {m.id for m in client(url).models.list().data}  # at once, no poll
    missing = {"lora_name": "broken", "lora_path": str(adapters["attn-r8"].parent / "missing")}
    refused = httpx.post(f"{base}/v1/load_lora_adapter", json=missing, timeout=60)
    assert refused.status_code == 400, refused.text  # the worker named, nothing registered
    message = refused.json()["error"]["message"]
    assert "colocated worker 127.0.0.1:" in message and "not a peft adapter directory" in message
    assert "broken" not in {m.id for m in client(url).models.list().data}
    out = client(url).completions.create(model="late", prompt=PROMPTS[0], max_tokens=MAX_TOKENS,
                                         temperature=0)  # fmt: skip
    assert out.choices[0].text == expected[("attn-r8", 0)]
    again = httpx.post(f"{base}/v1/load_lora_adapter", json=body, timeout=60)
    assert again.status_code == 400 and "already loaded" in again.json()["error"]["message"]
    r = httpx.post(f"{base}/v1/unload_lora_adapter", json={"lora_name": "late"}, timeout=60)
    assert r.status_code == 200, r.text
    with pytest.raises(openai.NotFoundError):
        client(url).completions.create(model="late", prompt="hi", max_tokens=2)
    gone = httpx.post(f"{base}/v1/unload_lora_adapter", json={"lora_name": "late"}, timeout=60)
    assert gone.status_code == 404
