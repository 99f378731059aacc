"""Triton cache keys that do not depend on which kernel a process hashed first.

A JIT function's cache key (Triton 3.x) holds the constexpr globals it reads and those
its callees read, but a callee's are merged only if the callee's own key was already
computed when the caller is hashed. So a kernel's key, and with it the disk-cache entry
it looks up, depends on the order in which the process first hashed kernels: a process
that launches the sampler's kernels in the launcher's order and one that compiles them
ahead in another (`benchmarks/gpu/precompile.py`) got different keys for the same code,
and the first recompiled what the second had compiled.

`settle` hashes the JIT functions of some modules callees first, so that every key holds
all the globals it depends on, whatever launches first. It changes no kernel and no result
(the key only names a cache entry); under TRITON_INTERPRET=1 there is nothing to settle.
"""

from __future__ import annotations

import ast
import textwrap
from types import ModuleType

__all__ = ["settle"]


def settle(*modules: ModuleType) -> int:
    """Compute the cache keys of every JIT function defined in `modules`, each after those
    of the JIT functions it references (any module's). Returns how many were hashed."""
    try:
        from triton.runtime import jit
    except ImportError:  # the stand-in (`triton_import`): no keys
        return 0
    kind = getattr(jit, "JITCallable", jit.JITFunction)  # (3.6: JITFunction's base)
    done: set[int] = set()

    def visit(fn) -> None:
        if id(fn) in done:
            return
        done.add(id(fn))
        for callee in _references(fn, kind):
            visit(callee)
        fn.cache_key  # noqa: B018 (computed and kept by Triton)

    for mod in modules:
        for value in vars(mod).values():
            if isinstance(value, kind) and value.__module__ == mod.__name__:
                visit(value)
    return len(done)


def _references(fn, kind) -> list:
    """The JIT functions (instances of `kind`) that fn's source names: `f` or `mod.f`."""
    found = []
    for node in ast.walk(ast.parse(textwrap.dedent(fn.src))):
        value = None
        if isinstance(node, ast.Name):
            value = fn.__globals__.get(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            base = fn.__globals__.get(node.value.id)
            if isinstance(base, ModuleType):
                value = getattr(base, node.attr, None)
        if isinstance(value, kind) and value is not fn:
            found.append(value)
    return found
