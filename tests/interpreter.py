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
