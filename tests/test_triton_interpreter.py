"""tests/triton_interpreter.py: the interpreter's skipped work changes no result and leaves
``triton.language`` as it found it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests import triton_interpreter

if not triton_interpreter.interpreting():
    pytest.skip("the savings apply under TRITON_INTERPRET=1", allow_module_level=True)

import triton
import triton.language as tl
from triton.language import core as tl_core
from triton.runtime import interpreter


@triton.jit
def _scaled(x, k):
    return x * k + 7


@triton.jit
def _wraps_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask)
    # two helper calls a program (each used to walk triton.language again), int32 products
    # that overflow (their check used to be computed and dropped)
    y = _scaled(_scaled(x, 65537), 3)
    tl.store(out_ptr + offs, y - tl_core.full([BLOCK], 1, tl.int32), mask=mask)


def test_installed_for_the_suite() -> None:
    assert interpreter.interpreter_builder.options.debug is False
    assert interpreter.interpreter_builder.options.sanitize_overflow is False
    assert getattr(interpreter._patch_lang, "skips_patched_modules", False)
    assert triton_interpreter.install() is False  # once is enough


def test_helpers_and_wrapping_int32_give_numpy_s_results_and_the_language_is_restored() -> None:
    langs = (tl, tl_core)
    before = [(lang.program_id, lang.arange, lang.load) for lang in langs]
    x = torch.arange(-50_000, 50_000, 997, dtype=torch.int32) * 4099
    out = torch.empty_like(x)
    _wraps_kernel[(triton.cdiv(x.numel(), 16),)](x, out, x.numel(), BLOCK=16)
    with np.errstate(over="ignore"):
        a = x.numpy()
        want = ((a * np.int32(65537) + np.int32(7)) * np.int32(3) + np.int32(7)) - np.int32(1)
    assert (want != (a.astype(np.int64) * 65537 + 7) * 3 + 6).any()  # the products do wrap
    np.testing.assert_array_equal(out.numpy(), want)
    # the launch's patch was undone (a module another kernel's helper patched and Triton never
    # restored stays so: the same objects as before either way)
    assert [(lang.program_id, lang.arange, lang.load) for lang in langs] == before
