"""Kernel tests run on the CPU through Triton's interpreter unless told otherwise.

``TRITON_INTERPRET`` is read when a ``@triton.jit`` function is defined, so it must be set here,
before any test module imports the kernels. To run the compiled kernels (and the ``gpu`` tests)
on a GPU: ``TRITON_INTERPRET=0 pytest tests/kernels`` (every test then runs on the GPU).
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from tests import triton_interpreter

# again here: a run of these tests alone sets TRITON_INTERPRET above, after the root conftest
triton_interpreter.install()


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("gpu") is None:
        return
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if triton_interpreter.interpreting():
        pytest.skip("GPU tests run compiled kernels: set TRITON_INTERPRET=0")


@pytest.fixture
def device() -> torch.device:
    """CPU under the interpreter; the GPU when the kernels are compiled (the same edge cases)."""
    if torch.cuda.is_available() and not triton_interpreter.interpreting():
        return torch.device("cuda")
    return torch.device("cpu")


@pytest.fixture
def gen() -> torch.Generator:
    """A fresh, seeded generator per test, so failures reproduce."""
    return torch.Generator().manual_seed(1234)


@pytest.fixture
def poison_empty(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make ``torch.empty`` return NaN-filled float tensors, so unwritten outputs show up."""
    real_empty = torch.empty

    def empty(*args: object, **kwargs: object) -> torch.Tensor:
        t = real_empty(*args, **kwargs)  # type: ignore[call-overload]
        if t.is_floating_point():
            t.fill_(float("nan"))
        return t

    monkeypatch.setattr(torch, "empty", empty)
