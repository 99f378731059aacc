"""Triton where it is installed, else a stand-in, so that the modules defining Triton
kernels import where Triton has no wheels (macOS, Windows). The CPU route runs no Triton
kernel; a stand-in kernel that is launched raises ImportError saying so.

    from graphexec.runtime.triton_import import tl, triton

The stand-in takes what those modules do as they import: `@triton.jit` (with or without
options), `@triton.autotune(...)`, `@triton.heuristics(...)`, `triton.Config(...)`,
`tl.constexpr(value)` (the value), `tl.<anything>` in annotations and tables;
`triton.cdiv` and `triton.next_power_of_2` compute as Triton's do.
"""

from __future__ import annotations

from typing import Any

__all__ = ["HAVE_TRITON", "tl", "triton"]

MISSING = ("Triton is not installed (its wheels are for Linux): this runs a Triton "
           "kernel, which needs a CUDA device and `pip install triton`; the CPU route needs "
           "none")  # fmt: skip


class _Kernel:
    """A kernel defined without Triton: launching it raises ImportError."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn
        self.__name__ = getattr(fn, "__name__", "kernel")
        self.__doc__ = getattr(fn, "__doc__", None)

    def __getitem__(self, grid: Any):
        raise ImportError(f"{self.__name__}: {MISSING}")

    def __call__(self, *args: Any, **kwargs: Any):
        raise ImportError(f"{self.__name__}: {MISSING}")


class _Missing:
    """`triton` or `triton.language` (or any attribute of them) without Triton."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Missing(f"{self._name}.{attr}")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        leaf = self._name.rsplit(".", 1)[-1]
        if leaf == "constexpr":  # tl.constexpr(value): the value
            return args[0] if args else None
        if leaf == "jit":  # @triton.jit or @triton.jit(options)
            if len(args) == 1 and callable(args[0]) and not kwargs:
                return _Kernel(args[0])
            return _Kernel
        if leaf in ("autotune", "heuristics"):  # decorators with options: the kernel as is
            return lambda fn: fn
        return _Missing(f"{self._name}()")

    def __repr__(self) -> str:
        return f"<{self._name}: Triton is not installed>"


def _cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def _next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:
    HAVE_TRITON = False
    triton = _Missing("triton")  # type: ignore[assignment]
    tl = _Missing("triton.language")  # type: ignore[assignment]
    triton.cdiv = _cdiv  # type: ignore[attr-defined]
    triton.next_power_of_2 = _next_power_of_2  # type: ignore[attr-defined]
