"""Our top-level package ``kernels`` shares its name with a PyPI project transformers probes for.

transformers asks ``is_kernels_available()`` (hub kernels) and, when it says yes, imports things
like ``kernels.LayerRepository`` from it. From the repository root our package is the one found,
so the probe must say no (it finds no version in range) and a Llama model must still load and run.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

PROBE = """
import importlib, torch, kernels, transformers
from pathlib import Path
assert Path(kernels.__file__).resolve().parent == Path.cwd() / "kernels", kernels.__file__
utils = importlib.import_module("transformers.utils")
probe = getattr(utils, "is_kernels_available", None)
print("available", None if probe is None else bool(probe()))
importlib.import_module("transformers.integrations.hub_kernels")
from transformers import LlamaConfig, LlamaForCausalLM
config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                     max_position_embeddings=64)
model = LlamaForCausalLM(config).eval()
with torch.no_grad():
    logits = model(torch.randint(0, 128, (2, 7))).logits
assert logits.shape == (2, 7, 128) and torch.isfinite(logits).all()
print("forward ok")
"""


def test_transformers_is_not_fooled_by_our_kernels_package() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(REPO)
    proc = subprocess.run(
        [sys.executable, "-c", PROBE], cwd=REPO, env=env, capture_output=True, text=True, timeout=180
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.split()
    assert "forward" in lines and "ok" in lines
    assert "True" not in proc.stdout.splitlines()[0], (
        "transformers thinks our package is hub `kernels`"
    )
