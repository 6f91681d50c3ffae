"""``kernels/`` shares its import name with Hugging Face's ``kernels`` package, which transformers
>= 5.25 depends on (``transformers.integrations.hub_kernels`` does ``from kernels import ...`` as
soon as that package is installed). Ours is therefore a namespace package (no ``__init__.py``):

- run from the repository root (``python -m pytest``, ``python -c``, the root on ``sys.path``), a
  regular ``kernels/`` package would shadow theirs and every transformers model would fail to
  import; a namespace portion never shadows a regular package;
- installed from a wheel, our modules land in the same ``site-packages/kernels/`` directory as
  theirs, so their ``__init__.py`` must stay theirs and no module name may be in both.
"""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_kernels_is_a_namespace_package() -> None:
    assert not (ROOT / "kernels" / "__init__.py").exists(), (
        "kernels/__init__.py would shadow Hugging Face's `kernels` (a transformers dependency): "
        "see this module's docstring"
    )


def test_transformers_and_our_kernels_import_together_from_the_repository_root() -> None:
    code = (
        "import importlib, torch, transformers.modeling_utils, kernels.cpu_blocks, "
        "kernels.triton_decode, kernels.bench.cpu_blocks\n"
        # what transformers imports from Hugging Face's kernels when that is installed
        "importlib.import_module('transformers.integrations.hub_kernels')\n"
        "from transformers import LlamaConfig, LlamaForCausalLM\n"
        "m = LlamaForCausalLM(LlamaConfig(hidden_size=16, intermediate_size=32,"
        " num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, vocab_size=32))\n"
        "with torch.no_grad():\n"
        "    logits = m.eval()(torch.randint(0, 32, (2, 5))).logits\n"
        "assert logits.shape == (2, 5, 32) and torch.isfinite(logits).all()\n"
        "print('imported')\n"
    )
    # `python -c` puts the working directory first on sys.path, as `python -m pytest` does
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "imported"


def test_no_module_name_is_also_one_of_hugging_face_kernels() -> None:
    try:
        files = importlib.metadata.distribution("kernels").files or []
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("Hugging Face's kernels is not installed here")
    theirs = {
        Path(str(f)).parts[1].split(".")[0]
        for f in files
        if Path(str(f)).parts[0] == "kernels" and len(Path(str(f)).parts) > 1
    }
    ours = {p.name.split(".")[0] for p in (ROOT / "kernels").iterdir() if p.name != "__pycache__"}
    assert theirs, "Hugging Face's kernels lists no module: cannot check"
    assert not (ours & theirs), f"modules in both packages: {sorted(ours & theirs)}"
