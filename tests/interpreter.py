"""Run Triton kernels on the CPU in the tests: TRITON_INTERPRET=1 where CUDA is unavailable.

Triton decides between compiling and interpreting when a kernel is defined (at import of
the module that holds it), so the variable must be set before triton is imported. Test
files that launch kernels start with

    from tests.interpreter import ensure_interpreter; ensure_interpreter()

before importing triton or any `graphexec.sampling.triton.*` kernel module.
"""

from __future__ import annotations

import os
import sys


def interpreter_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def ensure_interpreter() -> None:
    """Set TRITON_INTERPRET=1 when CUDA is unavailable; raise if it is too late for that."""
    if not interpreter_enabled():
        import torch

        if torch.cuda.is_available():
            return
        if "triton" in sys.modules:
            raise RuntimeError(
                "triton was imported before TRITON_INTERPRET=1 was set and there is no CUDA "
                "device, so its kernels cannot run. Call tests.interpreter.ensure_interpreter() "
                "before anything imports triton (or run with TRITON_INTERPRET=1 in the "
                "environment)."
            )
        os.environ["TRITON_INTERPRET"] = "1"
    _no_repatching_inside_kernels()
    _no_dropped_work_per_op()


def _no_repatching_inside_kernels() -> None:
    """Speed the interpreter up: it patches `triton.language` for a kernel launch, then
    again (with `inspect.getmembers`, most of its time) at every device-function call
    inside it. Skip the call's patching when the modules that function sees were already
    patched during this launch. Nothing changes what a kernel computes; on a Triton
    without these internals this does nothing."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter as it

        grid_call = it.GridExecutor.__call__
        dev_call = it.InterpretedFunction.__call__
        rewrite = it.InterpretedFunction.rewrite
        error = it.InterpreterError
    except (ImportError, AttributeError):
        return
    if getattr(it, "_graphexec_no_repatch", False):
        return
    patched: list[set] = []  # per launch in progress: ids of the patched modules
    seen: dict = {}

    def langs(fn) -> frozenset:
        if fn not in seen:
            mods = [v for v in fn.__globals__.values() if v is tl or v is tl.core]
            seen[fn] = frozenset(id(m) for m in mods)
        return seen[fn]

    def kernel(self, *args, **kwargs):
        patched.append(set(langs(self.fn)))
        try:
            return grid_call(self, *args, **kwargs)
        finally:
            patched.pop()

    def device(self, *args, **kwargs):
        if not patched or not langs(self.fn) <= patched[-1]:
            if patched:
                patched[-1] |= langs(self.fn)
            return dev_call(self, *args, **kwargs)
        try:
            return rewrite(self)(*args, **kwargs)
        except Exception as e:
            raise error(repr(e)) from e

    it.GridExecutor.__call__ = kernel
    it.InterpretedFunction.__call__ = device
    it._graphexec_no_repatch = True


def _no_dropped_work_per_op() -> None:
    """Speed the interpreter up where it computes what it then throws away; every kernel
    computes, and every check checks, exactly what it did before (about half of the
    interpreter's time in the sampler's tests).

    - An integer add / sub / mul first builds its overflow check (casts to int64, the
      op again, two comparisons) and hands it to `device_assert`, which drops it unless
      the options say `debug` (the interpreter's never do: an int32 overflow wraps
      silently either way). Skip building the check when `device_assert` would drop it.
    - `_get_np_dtype` builds a 19-entry dict of numpy dtypes at every call (twice per
      op): the same answer from a cache.

    Applied only where this Triton's internals read as described; else nothing."""
    try:
        import inspect

        from triton.language.semantic import TritonSemantic
        from triton.runtime import interpreter as it

        sanitize = TritonSemantic.binary_op_sanitize_overflow_impl
        drops = "if not self.builder.options.debug:\n            return" in inspect.getsource(
            TritonSemantic.device_assert
        )
        np_dtype = it._get_np_dtype
        builder = it.interpreter_builder
    except (ImportError, AttributeError, OSError, TypeError):
        return
    if getattr(it, "_graphexec_no_dropped_work", False):
        return

    if drops:

        def overflow_check(self, lhs, rhs, binary_op):
            if self.builder is builder and not self.builder.options.debug:
                return None  # device_assert would drop the check
            return sanitize(self, lhs, rhs, binary_op)

        TritonSemantic.binary_op_sanitize_overflow_impl = overflow_check

    cache: dict = {}

    def cached_np_dtype(tt_dtype):
        try:
            return cache[tt_dtype]
        except KeyError:
            out = cache[tt_dtype] = np_dtype(tt_dtype)
            return out
        except TypeError:  # an unhashable type (pointer types): asked every time
            return np_dtype(tt_dtype)

    it._get_np_dtype = cached_np_dtype
    it._graphexec_no_dropped_work = True
