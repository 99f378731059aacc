"""A pytest plugin (`-p compile_log`, with benchmarks/gpu on PYTHONPATH) that writes one
line per Triton compile to the file named by $COMPILE_LOG: the wall seconds the compile
took (a disk-cache hit takes milliseconds), the kernel, and the constexprs and argument
specialisations that made it a new variant. For a GPU test that spends its time compiling:
which kernels, how many variants of each, and what tells them apart."""

from __future__ import annotations

import json
import os
import re
import time

import triton

_started: dict[int, float] = {}
# a line of the log: when (or "-"), the compile's seconds, the kernel, its specialisation
LINE = re.compile(r"^\S+\s+([\d.]+)s (\S+) (\{.*\})\s*$")


def line(stamp: str, seconds: float, kernel: str, spec: str) -> str:
    """A log line (`LINE` reads it back)."""
    return f"{stamp} {seconds:8.2f}s {kernel} {spec}\n"


def _pre(*, key, fn, **_: object) -> bool:
    _started[id(key)] = time.perf_counter()
    return False  # compile as usual


def _post(*, key, fn, compile, **_: object) -> None:  # noqa: A002 (Triton's keyword)
    took = time.perf_counter() - _started.pop(id(key), time.perf_counter())
    with open(os.environ["COMPILE_LOG"], "a") as f:
        spec = _with_tuple_types(compile["specialization_data"], compile["signature"])
        f.write(line(time.strftime("%H:%M:%S"), took, fn.name, spec))


def _with_tuple_types(spec: str, signature: dict) -> str:
    """Triton's serialised specialisation, plus the class of each named-tuple argument
    (JSON keeps only its values; `precompile.py` rebuilds it from this)."""
    named = {p: f"{type(v).__module__}.{type(v).__qualname__}" for p, v in signature.items()
             if isinstance(v, tuple) and hasattr(v, "_fields")}  # fmt: skip
    if not named:
        return spec
    d = json.loads(spec)
    d["tuple_types"] = named
    return json.dumps(d)


def pytest_configure(config) -> None:
    runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
    if not os.environ.get("COMPILE_LOG"):
        return
    if runtime is None or not hasattr(runtime, "jit_post_compile_hook"):
        print(f"compile_log: Triton {triton.__version__} has no compile hooks; nothing logged")
        return
    runtime.jit_cache_hook = _pre
    runtime.jit_post_compile_hook = _post
