"""Programmatic dependent launch: a forward kernel starts while the one before it ends.

At small batch a decode forward is ~150 short kernels, and each pays its launch and
ramp before it reads a byte. On Hopper a kernel launched with `launch_pdl=True` may be
scheduled before its predecessor on the stream has finished; it must then wait
(`griddepcontrol.wait`) before it touches anything the predecessor writes or reads.
Every forward kernel here does, in this order:

    1. (GEMMs and the norm) prefetch the first columns of its weight slab into L2, or
       load the norm's weight: weights are never written by a step, so this may overlap
       the kernel before it;
    2. `gdc_wait()`: the predecessor has completed and its writes are visible;
    3. `gdc_launch_dependents()`: the next kernel may now be scheduled and run its own
       step 1 while this one works (after the wait, so at most one kernel runs ahead).

Nothing here changes what a kernel computes: only when its programs start. Off Hopper,
under the interpreter, or where Triton cannot launch with PDL, kernels launch as usual.
"""

from __future__ import annotations

import functools

import torch

from graphexec.runtime.triton_env import interpreter_enabled
from graphexec.runtime.triton_import import tl, triton

try:  # Triton >= 3.4
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - older Triton: PDL is never enabled
    gdc_launch_dependents = gdc_wait = None


@functools.cache
def _device_supports(index: int) -> bool:
    from triton.backends.nvidia.compiler import CUDAOptions

    fields = getattr(CUDAOptions, "__dataclass_fields__", {})
    return (gdc_wait is not None and "launch_pdl" in fields
            and torch.cuda.get_device_capability(index)[0] >= 9)  # fmt: skip


def enabled(wanted: bool, device: torch.device) -> bool:
    """Whether a launch on `device` uses PDL: wanted by its config, compiled (not the
    interpreter), on a CUDA device of compute capability 9.0 or newer."""
    if not wanted or device.type != "cuda" or interpreter_enabled():
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _device_supports(index)


def launch_options(pdl: bool) -> dict:
    """The launch keywords: `launch_pdl` only when on (older launchers lack it)."""
    return {"launch_pdl": True} if pdl else {}


def kernel_options(wanted: bool, device: torch.device) -> dict:
    """A launch's `PDL` constexpr and launch keyword on `device` (`enabled`)."""
    on = enabled(wanted, device)
    return {"PDL": on, **launch_options(on)}


@triton.jit
def dependent_start(PDL: tl.constexpr):
    """Steps 2 and 3 of the module docstring; nothing without PDL."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def prefetch_l2(ptrs):
    """Ask L2 for the 128-byte line of each pointer (no registers written, no wait)."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)  # fmt: skip


@triton.jit
def prefetch_rows(base, rows, nmask, stride, k_lo, k_len,
                  LINE: tl.constexpr, LINES: tl.constexpr):  # fmt: skip
    """Prefetch columns k_lo .. k_lo + min(k_len, LINE * LINES) of `rows` ([R] indices,
    masked by nmask) of a row-major matrix: one request per line of LINE elements."""
    c = tl.arange(0, LINES) * LINE
    ok = nmask[:, None] & (c[None, :] < k_len)
    ptrs = base + rows[:, None] * stride + k_lo + c[None, :]
    prefetch_l2(tl.where(ok, ptrs, base))
