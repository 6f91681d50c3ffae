"""Runtime LoRA loads through the gateway (fake workers): all or nothing over the workers."""

from __future__ import annotations

import concurrent.futures
import time

import grpc
import httpx
import pytest

from tests.gateway.stack import Stack, wait_for

LOAD = {"lora_name": "sql", "lora_path": "/adapters/sql"}


def models(stack: Stack) -> list[str]:
    return [m["id"] for m in httpx.get(f"{stack.base_url}/v1/models").json()["data"]]


def load(stack: Stack) -> httpx.Response:
    return httpx.post(f"{stack.base_url}/v1/load_lora_adapter", json=LOAD, timeout=30)


@pytest.fixture
def updatable(disagg: Stack) -> Stack:
    """Two prefill workers and a decode worker that take runtime LoRA updates."""
    for w in disagg.workers:
        w.behavior.lora_updates = True
    return disagg


def test_a_load_reaches_every_worker_and_models_lists_it_at_once(updatable: Stack) -> None:
    r = load(updatable)
    assert r.status_code == 200, r.text
    assert [w.behavior.lora_names for w in updatable.workers] == [("sql",)] * 3
    assert models(updatable)[1:] == ["sql"]


@pytest.mark.parametrize(
    "code, status, cause",
    [
        (grpc.StatusCode.INVALID_ARGUMENT, 400, "cannot load 'sql'"),  # a bad adapter
        (grpc.StatusCode.UNAVAILABLE, 503, "is unavailable"),  # the worker is gone
    ],
)
def test_a_load_one_worker_fails_is_undone_on_the_others(
    updatable: Stack, code: grpc.StatusCode, status: int, cause: str
) -> None:
    before = models(updatable)
    (decode,) = updatable.role("decode")
    decode.behavior.lora_load_code = code
    r = load(updatable)
    assert r.status_code == status, r.text
    message = r.json()["error"]["message"]
    assert f"decode worker {decode.address}: " in message and cause in message
    assert "unloaded again from the 2 worker(s)" in message
    for w in updatable.role("prefill"):  # loaded, then unloaded: no prefill-only adapter
        assert w.records.lora_updates == ["load sql", "unload sql"]
        assert w.behavior.lora_names == ()
    assert models(updatable) == before
    r = httpx.post(f"{updatable.base_url}/v1/completions", json={"model": "sql", "prompt": "x"})
    assert r.status_code == 404, r.text


def test_a_refused_load_leaves_an_adapter_loaded_before_in_place(updatable: Stack) -> None:
    assert load(updatable).status_code == 200
    again = load(updatable)
    assert again.status_code == 400 and "already loaded" in again.json()["error"]["message"]
    for w in updatable.workers:  # no rollback: this load changed nothing
        assert w.records.lora_updates == ["load sql", "load sql"]
        assert w.behavior.lora_names == ("sql",)
    assert models(updatable)[1:] == ["sql"]


def test_a_worker_that_cannot_unload_it_again_is_named(updatable: Stack) -> None:
    first, second = updatable.role("prefill")
    updatable.role("decode")[0].behavior.lora_load_code = grpc.StatusCode.INVALID_ARGUMENT
    second.behavior.lora_unload_code = grpc.StatusCode.FAILED_PRECONDITION  # say, in flight
    r = load(updatable)
    assert r.status_code == 400
    message = r.json()["error"]["message"]
    assert "unloaded again from the 1 worker(s)" in message
    assert f"could not be unloaded from prefill worker {second.address} (" in message
    assert "POST /v1/unload_lora_adapter" in message
    assert first.behavior.lora_names == () and second.behavior.lora_names == ("sql",)


def unload(stack: Stack) -> httpx.Response:
    return httpx.post(f"{stack.base_url}/v1/unload_lora_adapter", json={"lora_name": "sql"},
                      timeout=30)  # fmt: skip


def test_an_unload_waits_for_the_gateways_requests_under_the_adapter(updatable: Stack) -> None:
    """While a request under the adapter runs (here: its first token late), the unload is a
    400 and no worker is asked (a prefill worker with nothing queued would drop it while the
    decode worker refused, failing the requests on their way); once it ended, it unloads."""
    assert load(updatable).status_code == 200
    for w in updatable.workers:
        w.behavior.first_delay_s = 1.0
    body = {"model": "sql", "prompt": "x", "max_tokens": 2}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        running = pool.submit(httpx.post, f"{updatable.base_url}/v1/completions", json=body,
                              timeout=30)  # fmt: skip
        deadline = time.monotonic() + 10
        while not updatable.state.registry.adapter_in_use("sql"):
            assert time.monotonic() < deadline and not running.done()
            time.sleep(0.01)
        r = unload(updatable)
        assert r.status_code == 400 and "requests in flight" in r.json()["error"]["message"]
        assert all(w.records.lora_updates == ["load sql"] for w in updatable.workers)
        assert running.result().status_code == 200
    assert not updatable.state.registry.adapter_in_use("sql")
    assert unload(updatable).status_code == 200
    assert all(w.behavior.lora_names == () for w in updatable.workers)


def test_an_unload_a_worker_refuses_is_undone_on_the_others(updatable: Stack) -> None:
    """All or nothing, as a load: the decode worker refuses (requests of another gateway),
    so the prefill workers that unloaded it load it again from the directory they reported."""
    assert load(updatable).status_code == 200
    (decode,) = updatable.role("decode")
    decode.behavior.lora_unload_code = grpc.StatusCode.FAILED_PRECONDITION
    r = unload(updatable)
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert f"decode worker {decode.address}: " in message
    assert "loaded again on the 2 worker(s)" in message
    for w in updatable.role("prefill"):
        assert w.records.lora_updates == ["load sql", "unload sql", "load sql"]
        assert (
            w.behavior.lora_names == ("sql",) and w.behavior.lora_paths["sql"] == LOAD["lora_path"]
        )
    assert models(updatable)[1:] == ["sql"]


def test_an_unload_undone_where_a_worker_cannot_load_again_names_it(updatable: Stack) -> None:
    """A worker that unloaded but then fails the load again no longer serves the adapter: the
    answer says which, and does not count it among those that loaded it again."""
    assert load(updatable).status_code == 200
    (decode,) = updatable.role("decode")
    first, second = updatable.role("prefill")
    decode.behavior.lora_unload_code = grpc.StatusCode.FAILED_PRECONDITION
    first.behavior.lora_load_code = grpc.StatusCode.UNAVAILABLE
    r = unload(updatable)
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert "loaded again on the 1 worker(s)" in message
    assert f"could not be loaded again on prefill worker {first.address} (" in message
    assert first.behavior.lora_names == () and second.behavior.lora_names == ("sql",)


def test_an_adapter_loaded_nowhere_is_a_404(updatable: Stack) -> None:
    r = unload(updatable)
    assert r.status_code == 404 and "not loaded" in r.json()["error"]["message"]


def test_an_adapters_card_has_its_directory_as_root(updatable: Stack) -> None:
    """vLLM's card of an adapter: root its lora_path, parent the base model."""
    assert load(updatable).status_code == 200
    base, card = httpx.get(f"{updatable.base_url}/v1/models").json()["data"]
    assert (card["id"], card["root"], card["parent"]) == ("sql", "/adapters/sql", base["id"])
    assert httpx.get(f"{updatable.base_url}/v1/models/sql").json() == card
    updatable.run(updatable.state.registry.poll_all())  # the workers' load reports say so too
    assert httpx.get(f"{updatable.base_url}/v1/models").json()["data"][1] == card


def test_an_adapter_is_not_loaded_under_the_base_models_path(tokenizer_dir: str) -> None:
    """With --served-model-name the gateway still takes --model's name for the base model: an
    adapter loaded under it could never be asked for."""
    stack = Stack(
        tokenizer_dir, ["colocated"], served_model_name="smol", served_model_aliases=("tiny",)
    ).start()
    try:
        stack.workers[0].behavior.lora_updates = True
        for name in ("smol", "tiny", stack.state.config.model):
            body = {"lora_name": name, "lora_path": "/adapters/sql"}
            r = httpx.post(f"{stack.base_url}/v1/load_lora_adapter", json=body, timeout=30)
            assert r.status_code == 400 and "is the base model's name" in r.text, r.text
        assert stack.workers[0].records.lora_updates == []
    finally:
        stack.stop()


def _started_again(worker: object) -> None:
    """A fake worker as its process started again: a new run, only its startup adapters."""
    behavior = worker.behavior  # type: ignore[attr-defined]
    behavior.instance, behavior.lora_names = "run-2", ()


def test_a_worker_started_again_gets_the_adapters_loaded_at_run_time_back(
    updatable: Stack,
) -> None:
    """tandem up starts a dead worker again on its address: its new run lacks the adapters the
    last one had loaded at run time, which the other workers still serve (listed, yet every
    request under one a 503). The gateway loads them into it again, from the directory the
    last run reported."""
    assert load(updatable).status_code == 200
    (decode,) = updatable.role("decode")
    _started_again(decode)
    assert wait_for(lambda: decode.behavior.lora_names == ("sql",))
    assert decode.records.lora_updates == ["load sql", "load sql"]
    assert decode.behavior.lora_paths["sql"] == LOAD["lora_path"]
    body = {"model": "sql", "prompt": "x", "max_tokens": 2}
    assert wait_for(lambda: httpx.post(f"{updatable.base_url}/v1/completions", json=body,
                                       timeout=30).status_code == 200)  # fmt: skip
    for w in updatable.role("prefill"):
        assert w.records.lora_updates == ["load sql"]


def test_an_adapter_unloaded_while_a_worker_was_down_stays_unloaded(updatable: Stack) -> None:
    """What the other workers no longer serve is not loaded into a worker started again."""
    assert load(updatable).status_code == 200
    (decode,) = updatable.role("decode")
    for w in updatable.role("prefill"):
        w.behavior.lora_names = ()  # unloaded from them while the decode worker was down
    _started_again(decode)
    client = next(c for c in updatable.state.registry.clients if c.address == decode.address)
    assert wait_for(lambda: client.load is not None and client.load.instance == "run-2")
    updatable.run(updatable.state.registry.poll_all())
    updatable.run(updatable.state.registry.settle())
    assert decode.records.lora_updates == ["load sql"] and decode.behavior.lora_names == ()
