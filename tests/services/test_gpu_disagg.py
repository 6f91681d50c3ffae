"""Disaggregation on GPUs: prefill and decode processes on two GPUs (KV over NCCL) and both on one
GPU (the host-staged path), the KV streamed layer by layer (the default) or shipped whole after
the first token, token-for-token against the offline engine on the same weights.

Random weights from a named config (seeded, so every process builds the same model): the GPU image
has no embedded model. Greedy, one request at a time, so every process runs the same kernels on
the same shapes and the outputs must be identical.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path

import pytest
import torch

from tests.services.clients import Conn, disagg, wait_pool_free
from tests.services.procs import Fleet

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
MODEL = ("--model", "smollm2-135m", "--load-format", "dummy")


def _reference(prompts: list[list[int]], max_tokens: int, device: str) -> list[list[int]]:
    from protos.sampling_params import SamplingParams
    from services.engine.llm import build_config
    from services.engine.llm_engine import LLMEngine

    engine = LLMEngine(build_config("smollm2-135m", load_format="dummy", max_model_len=1024,
                                    num_blocks=256, device=device))  # fmt: skip
    outs = []
    for i, p in enumerate(prompts):
        engine.add_request(
            f"ref-{i}", p, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        )
        toks: list[int] = []
        while engine.has_unfinished:
            for o in engine.step():
                toks.extend(o.token_ids)
        outs.append(toks)
    engine.runner.release_kv_cache()
    return outs


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(5)
    lengths = [5, 16, 17, 40, 100, 250, 33, 64]  # block boundaries and several blocks
    shared = torch.randint(100, 40000, (48,), generator=gen).tolist()
    out = [torch.randint(100, 40000, (n,), generator=gen).tolist() for n in lengths]
    # a repeated "system prompt"; the last prompt is cached but for its last token, whose
    # one-token forward looks like a decode step (which a CUDA graph would replay)
    return [*out, shared + out[0], shared + out[1], shared + out[0][:1]]


@pytest.mark.parametrize("kv_streaming", ["on", "off"])
@pytest.mark.parametrize(
    "devices", [("cuda:0", "cuda:1"), ("cuda:0", "cuda:0")], ids=["nccl-2gpu", "shared-gpu"]
)
def test_disaggregated_parity_on_gpus(
    devices: tuple[str, str], kv_streaming: str, tmp_path: Path
) -> None:
    if devices[1] == "cuda:1" and torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    prompts = _prompts()
    want = _reference(prompts, 24, devices[0])
    fleet = Fleet(tmp_path)
    try:
        pre = fleet.spawn("prefill", *MODEL, "--device", devices[0], "--kv-streaming", kv_streaming)
        dec = fleet.spawn("decode", *MODEL, "--device", devices[1])
        pre.wait_ready(240), dec.wait_ready(240)

        async def run() -> tuple[list[list[int]], list[float]]:
            async with Conn(pre.address, "prefill") as p, Conn(dec.address, "decode") as d:
                got, secs = [], []
                for i, ids in enumerate(prompts):
                    t0 = time.monotonic()
                    # whole KV: its blocks granted with the reservation, as the gateway asks
                    res = await disagg(p, d, f"g{i}", ids, 24, grant=kv_streaming == "off",
                                       ignore_eos=True)  # fmt: skip
                    secs.append(time.monotonic() - t0)
                    got.append(res.token_ids)
                await wait_pool_free([p, d], 3.0)
                loads = [await p.load(), await d.load()]
                assert loads[0].prefix_cache_hits > 0  # the repeated prefix hit the prefill cache
                assert loads[1].kv_transfer_bytes > 0 and loads[1].kv_transfer_failures == 0
                # whole KV on one GPU: every transfer into blocks granted with its reservation
                granted = len(prompts) if kv_streaming == "off" and devices[0] == devices[1] else 0
                assert loads[1].kv_transfer_granted == granted
                return got, secs

        got, secs = asyncio.run(run())
        same = sum(g == w for g, w in zip(got, want, strict=True))
        report = {"devices": devices, "kv_streaming": kv_streaming, "identical": same,
                  "of": len(prompts)}  # fmt: skip
        print(json.dumps({**report, "seconds": secs}))
        if os.environ.get("OUT"):
            name = "-".join(d.replace(":", "") for d in devices) + f"-streaming-{kv_streaming}"
            with open(Path(os.environ["OUT"]) / f"disagg-{name}.json", "w") as fh:
                json.dump(report, fh)
        assert got == want
    finally:
        fleet.close()
