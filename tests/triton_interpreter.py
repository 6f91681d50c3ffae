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

Three more costs of the interpreter's bookkeeping (not of its arithmetic) are cut without
changing what it computes (together ~28% of a kernel test module's CPU time, e.g.
tests/kernels/test_triton_quant.py 52 -> 38 s):

- **Broadcasting two blocks of one rank.** Every binary operation on two blocks works out their
  common shape by comparing ``triton.language`` tuples with lists, which rebuilds each list as a
  language tuple with a type per element. The same rule (a dimension of 1 takes the other's) is
  now worked out on plain lists of ints; blocks of equal shapes come back as they are, as the
  full check returns them. Other ranks, scalars and mismatches go to the original.
- **The numpy dtype of each value.** ``_get_np_dtype`` builds its table of twenty types on every
  call (tens of thousands a test); the answer per type is now kept.
- **Block types and tensor shapes built again for every value.** Each operation's result gets a
  new ``block_type`` (its shape made a language tuple with a type per element, checked, named)
  and a tensor whose shape is made a tuple of ``constexpr`` again; the parts that depend only on
  the element type and the shape are now built once per shape and shared (none of them is ever
  modified).

``install()`` is a no-op when Triton is not installed, not interpreting, or its interpreter no
longer has these internals (then the suite is only slower); each bookkeeping saving is applied
where its own internals are still there.
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
    # the bookkeeping savings, each where its internals are still there
    semantic: Any = getattr(interpreter, "interpreter_semantic", None)
    core = tl.core
    if hasattr(semantic, "broadcast_impl_value") and hasattr(semantic, "make_tensor"):
        semantic.broadcast_impl_value = _equal_shapes_first(semantic, core.block_type)
    if callable(getattr(interpreter, "_get_np_dtype", None)):
        interpreter._get_np_dtype = _kept_np_dtypes(interpreter._get_np_dtype, tl)
    if hasattr(core, "constexpr"):
        core.block_type.__init__ = _kept_block_types(core.block_type.__init__, core.constexpr)
        core.tensor.__init__ = _kept_tensor_shapes(core.tensor.__init__)
    return True


def _equal_shapes_first(semantic: Any, block_type: type) -> Callable[[Any, Any], Any]:
    """``semantic.broadcast_impl_value`` for two blocks of one rank worked out on plain lists of
    ints (each dimension of 1 broadcast to the other's; equal shapes returned as they are), as
    the original does; different ranks, mismatched dimensions (its error) and a scalar with a
    block go to the original."""
    broadcast = semantic.broadcast_impl_value

    def to(value: Any, ty: Any, dims: list[int], shape: list[int]) -> Any:
        if dims == shape:
            return value
        handle = semantic.builder.create_broadcast(value.handle, shape)
        return semantic.make_tensor(handle, block_type(ty.scalar, shape))

    def equal_first(lhs: Any, rhs: Any) -> Any:
        lt, rt = lhs.type, rhs.type
        if lt.is_block() and rt.is_block():
            ls, rs = list(lt.shape.values), list(rt.shape.values)
            if ls == rs:
                return lhs, rhs
            if len(ls) == len(rs):
                shape = [b if a == 1 else a for a, b in zip(ls, rs, strict=True)]
                if all(b in (1, a) for a, b in zip(shape, rs, strict=True)):
                    return to(lhs, lt, ls, shape), to(rhs, rt, rs, shape)
        return broadcast(lhs, rhs)

    return equal_first


def _int_shape(shape: Any, constexpr: type) -> tuple[int, ...] | None:
    """``shape`` (a list, a tuple or a language tuple of ints or constexprs) as a tuple of
    ints; None for anything else."""
    values = getattr(shape, "values", shape)
    if not isinstance(values, (list, tuple)):
        return None
    dims = tuple(v.value if type(v) is constexpr else v for v in values)
    return dims if all(type(d) is int for d in dims) else None


def _kept_block_types(init: Callable[..., None], constexpr: type) -> Callable[..., None]:
    """``block_type.__init__`` with the shape, element count and name it builds kept per
    (element type, shape); a shape it refuses is refused again each time (never kept)."""
    kept: dict[Any, tuple[Any, Any, str]] = {}

    def kept_init(self: Any, element_ty: Any, shape: Any) -> None:
        dims = _int_shape(shape, constexpr)
        key = (element_ty, dims)
        try:
            found = kept.get(key) if dims is not None else None
        except TypeError:  # an unhashable element type
            dims = found = None
        if found is None:
            init(self, element_ty, shape)
            if dims is not None:
                kept[key] = (self.shape, self.numel, self.name)
            return
        self.element_ty = element_ty
        self.shape, self.numel, self.name = found

    return kept_init


def _kept_tensor_shapes(init: Callable[..., None]) -> Callable[..., None]:
    """``tensor.__init__`` with a block's shape (a tuple of constexpr) and element count kept
    per shape."""
    kept: dict[Any, tuple[Any, Any]] = {}

    def kept_init(self: Any, handle: Any, type: Any) -> None:
        dims = getattr(type.shape, "values", None) if type.is_block() else None
        key = tuple(dims) if dims is not None else None
        found = kept.get(key) if key is not None else None
        if found is None:
            init(self, handle, type)
            if key is not None:
                kept[key] = (self.shape, self.numel)
            return
        self.handle = handle
        self.type = type
        self.dtype = type.scalar
        self.shape, self.numel = found

    return kept_init


def _kept_np_dtypes(np_dtype: Callable[[Any], Any], tl: Any) -> Callable[[Any], Any]:
    """``_get_np_dtype`` with each type's answer kept: a block's is its element type's."""
    kept: dict[Any, Any] = {}

    def get(tt_dtype: Any) -> Any:
        key = tt_dtype.element_ty if isinstance(tt_dtype, tl.block_type) else tt_dtype
        try:
            return kept[key]
        except KeyError:
            kept[key] = found = np_dtype(key)
            return found
        except TypeError:  # an unhashable type: asked as before
            return np_dtype(tt_dtype)

    return get


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
