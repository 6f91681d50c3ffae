"""Work Triton's CPU interpreter does and throws away, skipped for the suite (tests/conftest.py).

Every kernel test runs under ``TRITON_INTERPRET=1``, where the interpreter (triton 3.9) spends
more than half of its time on two things whose results nothing reads:

- **Integer overflow checks.** ``a + b``, ``a - b`` and ``a * b`` on int32 tensors also compute
  the operation in int64, compare it with int32's range and hand the result to
  ``device_assert``, which drops it unless the interpreter's ``debug`` option is on (it is off:
  compiled kernels outside debug mode skip the check too). Turning ``sanitize_overflow`` off
  removes only that dead computation: no result changes.
- **Re-patching ``triton.language`` on every device-function call.** A launch patches the
  language modules the kernel sees (each builtin replaced by its interpreted form, undone when
  the launch ends); each call of a ``@triton.jit`` helper inside the kernel then walks every
  member of those modules again (``inspect.getmembers``, ~4 ms a call) and finds nothing left
  to patch. The call now skips that walk when each language module it sees is already patched;
  a helper that sees a module the launch did not patch is patched as before.

``install()`` is a no-op when Triton is not installed, not interpreting, or its interpreter no
longer has these internals (then the suite is only slower).
"""

from __future__ import annotations

import dataclasses
import inspect
import os
from collections.abc import Callable
from typing import Any


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


class _NothingToRestore:
    def restore(self) -> None:
        pass


def install() -> bool:
    """Apply both savings to this process's interpreter; True when they were applied."""
    if not interpreting():
        return False
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return False
    builder: Any = getattr(interpreter, "interpreter_builder", None)
    patch_lang = getattr(interpreter, "_patch_lang", None)
    options: Any = getattr(builder, "options", None)
    if (
        patch_lang is None
        or getattr(patch_lang, "skips_patched_modules", False)
        or not hasattr(options, "__dataclass_fields__")
        or getattr(options, "debug", True)  # in debug mode the checks do assert
        or not hasattr(options, "sanitize_overflow")
    ):
        return False
    builder.options = dataclasses.replace(options, sanitize_overflow=False)
    interpreter._patch_lang = _skipping_patched_modules(patch_lang, tl)
    return True


def _skipping_patched_modules(patch_lang: Callable[[Any], Any], tl: Any) -> Callable[[Any], Any]:
    languages = (tl, tl.core)
    is_builtin = tl.core.is_builtin

    def patched(lang: Any) -> bool:
        # a launch's patch replaces every builtin of the module, program_id among them
        marker = getattr(lang, "program_id", None)
        return marker is not None and not is_builtin(marker)

    seen: dict[Any, list[Any]] = {}  # the language modules each jit function's globals hold

    def skipping(fn: Any) -> Any:
        langs = seen.get(fn)
        if langs is None:
            langs = [v for v in fn.__globals__.values() if inspect.ismodule(v) and v in languages]
            seen[fn] = langs
        if langs and all(patched(lang) for lang in langs):
            return _NothingToRestore()
        return patch_lang(fn)

    skipping.skips_patched_modules = True  # type: ignore[attr-defined]
    return skipping
