"""The KV transfer benchmark: its simulated prefill, and a whole smoke run on CPU (Gloo)."""

from __future__ import annotations

import json
import time

import pytest
import torch

from kvtransfer import LayerReady
from kvtransfer.bench.sim_prefill import SimPrefill, slots_of
from kvtransfer.bench.transfer import main

CPU = torch.device("cpu")


class Snapshots(LayerReady):
    """Copies the caches whenever a layer is recorded."""

    def __init__(self, caches: list[torch.Tensor]) -> None:
        super().__init__(len(caches))
        self.caches = caches
        self.seen: list[list[torch.Tensor]] = []

    def record(self, layer: int, stream: torch.cuda.Stream | None = None) -> None:
        self.seen.append([c.clone() for c in self.caches])
        super().record(layer, stream)


def test_the_simulated_prefill_writes_each_layers_kv_before_recording_it():
    model = SimPrefill(CPU, 64, q_heads=4, kv_heads=2, head_dim=16, intermediate=64,
                       dtype=torch.float32)  # fmt: skip
    caches = [torch.zeros(2, 6, 4, 2, 16, dtype=torch.bfloat16) for _ in range(3)]
    ready = Snapshots(caches)
    model.run(caches, slots_of([4, 1], 4, 7, CPU), model.tokens(7, seed=1), ready)
    assert len(ready.seen) == 3 and ready.wait(2, time.monotonic()) is None
    for layer, snapshot in enumerate(ready.seen):
        assert snapshot[layer][:, [4, 1]].flatten(1, 2)[:, :7].abs().sum() > 0  # written
        assert not snapshot[layer][:, [4, 1]].flatten(1, 2)[:, 7:].any()  # past the tokens
        assert all(not c.any() for c in snapshot[layer + 1 :])  # later layers not yet
        assert not snapshot[layer][:, [0, 2, 3, 5]].any()  # other blocks never


@pytest.mark.timeout(240)
def test_cpu_smoke_run_reports_every_section(tmp_path):
    out = tmp_path / "kv.json"
    main(["--cpu", "--tokens", "16", "--iters", "1", "--warmup", "0", "--chunk-mb", "4096",
          "--json-out", str(out)])  # fmt: skip
    doc = json.loads(out.read_text())
    paths = [row["path"] for row in doc["rows"]]
    assert paths == ["cpu gloo raw send/recv", "cpu gloo gather", "cpu gloo scatter",
                     "cpu gloo e2e 4096MB", "ttft"]  # fmt: skip
    assert all(row["ok"] for row in doc["rows"] if "ok" in row)
    assert doc["meta"]["errors"] == []
    e2e = doc["rows"][3]  # to the ack, and to the decode side having the KV: both in ms
    assert 0 < e2e["landed_ms"] <= e2e["median_ms"]  # the ack comes after the KV landed
    assert 0 < e2e["pair_ms"] <= e2e["median_ms"]  # the call holds the pair thread's part
