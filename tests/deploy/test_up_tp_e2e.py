"""`tandem up` with tensor-parallel workers on the CPU (Gloo): prefill TP 2 -> decode TP 1,
prefill TP 1 -> decode TP 2 (the KV heads regrouped in the hand-off) and one colocated TP 2
worker give the offline engine's greedy tokens; a follower rank killed under load fails its
worker's requests with an error, and `tandem up` starts the worker again (slow)."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from deploy.procfs import alive, descendants
from protos.sampling_params import SamplingParams
from services.engine.llm import LLM
from tests.deploy.test_launcher import Up
from tests.deploy.test_up_e2e import TANDEM_UP, kill_all
from tests.services.engine.conftest import tiny_checkpoint

pytestmark = pytest.mark.slow
READY = re.compile(r"^Tandem is ready: (http://\S+/v1) \(gateway \+ (.+), model (.+)\)$")
# 8 query heads over 2 KV heads: two ranks hold one KV head each
TINY = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 8,
        "num_key_value_heads": 2, "intermediate_size": 96}  # fmt: skip
# first-token prompts of several lengths: 150 tokens are two prefill chunks on the CPU
PROMPTS = [[(7 * i + 3) % 49000 + 17 for i in range(n)] for n in (3, 24, 150)]
MAX_TOKENS = 8
# flags, and the worker whose follower rank (its one child process) each topology has
TOPOLOGIES = {
    "prefill-tp2-decode-tp1": (("--prefill-tensor-parallel-size", "2"), "prefill"),
    "prefill-tp1-decode-tp2": (("--decode-tensor-parallel-size", "2"), "decode"),
    "colocated-tp2": (("--colocated", "1", "--tensor-parallel-size", "2"), "worker"),
}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tiny_checkpoint(tmp_path_factory.mktemp("tiny-llama"), "llama", **TINY))


@pytest.fixture(scope="module")
def expected(model: str) -> list[str]:
    """The offline engine's greedy text, one rank (8 random tokens: equal text, equal tokens)."""
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    with LLM(model, dtype="float32") as llm:
        return [r.outputs[0].text for r in llm.generate(PROMPTS, params)]


def _argv(pid: int) -> list[bytes]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return []


def workers_and_followers(root: int) -> tuple[dict[str, int], dict[int, int]]:
    """The `tandem ROLE` processes under ``root`` (role -> pid) and the tensor-parallel
    followers (pid -> their worker's pid)."""
    roles, followers = {}, {}
    for pid in descendants(root):
        argv = _argv(pid)
        if b"services.cli" in argv:
            roles[argv[argv.index(b"services.cli") + 1].decode()] = pid
        elif b"services.engine.tp_follower" in argv:
            with contextlib.suppress(OSError, IndexError, ValueError):
                stat = Path(f"/proc/{pid}/stat").read_text()
                followers[pid] = int(stat.rsplit(")", 1)[1].split()[1])
    return roles, followers


class Stack:
    def __init__(self, up: Up, url: str, served: str, tp_role: str) -> None:
        self.up, self.url, self.served, self.tp_role = up, url, served, tp_role

    def complete(self, prompt: list[int], timeout_s: float = 60) -> httpx.Response:
        body = {"model": self.served, "prompt": prompt, "max_tokens": MAX_TOKENS,
                "temperature": 0, "ignore_eos": True}  # fmt: skip
        return httpx.post(f"{self.url}/completions", json=body, timeout=timeout_s)


@pytest.fixture(scope="module", params=list(TOPOLOGIES))
def stack(request: pytest.FixtureRequest, model: str, tmp_path_factory: pytest.TempPathFactory
          ) -> Iterator[Stack]:  # fmt: skip
    """One topology at a time (pytest ends one parameter's before the next starts)."""
    logs = tmp_path_factory.mktemp(f"logs-{request.param}")
    flags, tp_role = TOPOLOGIES[request.param]
    up = Up(logs, "--model", model, "--dtype", "float32", "--max-model-len", "256", *flags,
            program=TANDEM_UP)  # fmt: skip
    started: set[int] = set()
    try:
        url, _, served = up.wait_for(READY, timeout_s=300).groups()
        started = descendants(up.proc.pid)
        roles, followers = workers_and_followers(up.proc.pid)
        assert list(followers.values()) == [roles[tp_role]], (roles, followers)
        yield Stack(up, url, served, tp_role)
        up.proc.send_signal(signal.SIGTERM)
        assert up.finish(timeout_s=90) == 0
    finally:
        kill_all(up, started)


def _text(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    return str(response.json()["choices"][0]["text"])


def test_greedy_output_equals_the_offline_engine(stack: Stack, expected: list[str]) -> None:
    got = [_text(stack.complete(p)) for p in PROMPTS]
    assert got == expected
