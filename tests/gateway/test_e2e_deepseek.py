"""DeepSeek end to end, disaggregated: `tandem up` serving a tiny random DeepSeek-V3 on the CPU
(1 prefill + 1 decode worker) hands the latent KV cache from the prefill worker to the decode
worker over the KV transfer: greedy tokens equal transformers' (float32), the bytes that moved
are the latent's (one plane: blocks x block_size x layers x (kv_lora_rank + rope) x 4), and
the workers' start-up line says how MLA is served (slow)."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.gateway.vision_stack import served_by_tandem
from tests.services.engine.conftest import transformers_greedy
from tests.services.engine.models.test_deepseek import CONFIGS, _build

PROMPTS = [[11, 22, 33, 44, 55, 66, 77, 88, 99], list(range(100, 160))]  # 1 and 4 blocks
NEW = 12
BLOCK_SIZE = 16  # the workers' default
ROW_BYTES = 3 * (24 + 8) * 4  # the tiny V3: layers x (kv_lora_rank + qk_rope_head_dim) x fp32

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    path = tmp_path_factory.mktemp("deepseek_v3")
    return path, _build(path, *CONFIGS["v3"])


@pytest.fixture(scope="module")
def served(
    model: tuple[Path, Any], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, str, Path]]:  # fmt: skip
    logs = tmp_path_factory.mktemp("logs")
    with served_by_tandem(logs, "--model", str(model[0]), "--max-model-len", "256") as (url, name):
        yield url, name, logs


def _transfer_bytes(url: str) -> float:
    text = httpx.get(url.removesuffix("/v1") + "/metrics", timeout=10).text
    found = re.findall(r'^tandem:kv_transfer_bytes_total\{[^}]*role="decode"[^}]*\} (\S+)$',
                       text, re.M)  # fmt: skip
    return sum(float(v) for v in found)


def test_a_disaggregated_hand_off_gives_transformers_tokens(
    served: tuple[str, str, Path], model: tuple[Path, Any]
) -> None:
    url, name, logs = served
    for prompt in PROMPTS:
        body = {"model": name, "prompt": prompt, "max_tokens": NEW, "temperature": 0,
                "ignore_eos": True, "logprobs": 1, "return_tokens_as_token_ids": True}  # fmt: skip
        resp = httpx.post(url + "/completions", json=body, timeout=120)
        assert resp.status_code == 200, resp.text
        assert "mode=disagg" in resp.headers["x-tandem-timing"]
        tokens = resp.json()["choices"][0]["logprobs"]["tokens"]
        got = [int(t.removeprefix("token_id:")) for t in tokens]
        assert got == transformers_greedy(model[1], prompt, NEW), len(prompt)
    # the workers' load is polled, so /metrics lags a request by up to one health interval
    want = sum(-(-len(p) // BLOCK_SIZE) for p in PROMPTS) * BLOCK_SIZE * ROW_BYTES
    deadline = time.monotonic() + 20
    while _transfer_bytes(url) < want and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _transfer_bytes(url) == want
    lines = "".join(p.read_text() for p in logs.rglob("*.log"))
    assert "multi-head latent attention served latent" in lines
