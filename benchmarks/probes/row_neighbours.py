"""Why the row program of top_k_top_p takes longer when logprobs are on (H100, B = 1:
about 15 -> 23 us) although it is the same kernel: per-kernel times (torch.profiler) of
one step with the logprobs launches dropped one by one, and with a tiny kernel after the
row program. Not part of the library.

    python benchmarks/probes/row_neighbours.py [--batch 1,128]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import ctypes

import torch
import triton
import triton.language as tl
from torch.profiler import ProfilerActivity, profile

import graphexec as gx
from graphexec.sampling.tensors import SamplerOutput, SamplingTensors
from graphexec.sampling.triton import launch


class _Skip:
    def __getitem__(self, grid):
        return lambda *a, **k: None


class _Before:
    """The raw-logprobs launch with a tiny torch kernel, or a host sync, before it."""

    def __init__(self, kernel, sync: bool) -> None:
        self.kernel, self.sync = kernel, sync

    def __getitem__(self, grid):
        def launch_(*args, **kw):
            torch.cuda.synchronize() if self.sync else _GAP.add_(1)
            return self.kernel[grid](*args, **kw)

        return launch_


_GAP = torch.zeros(1, dtype=torch.int32)


@triton.jit
def _tiny_kernel(x_ptr):
    tl.store(x_ptr, tl.load(x_ptr) + 1)


@contextlib.contextmanager
def _patched(name: str):
    saved = (launch._raw_logprobs_kernel, launch.write_logprobs)
    if name in ("lp_no_raw", "lp_no_writers"):
        launch._raw_logprobs_kernel = _Skip()
    if name in ("lp_no_general", "lp_no_writers"):
        launch.write_logprobs = lambda *a, **k: None
    if name in ("lp_torch_gap", "lp_sync"):
        launch._raw_logprobs_kernel = _Before(saved[0], name == "lp_sync")
    try:
        yield
    finally:
        launch._raw_logprobs_kernel, launch.write_logprobs = saved


def _profile(args, tail, flush, reps):
    """Profile reps steps (L2 flushed before each); tail: "torch" or "triton", a tiny
    kernel after each step."""

    def step() -> None:
        gx.sample_step(*args)
        if tail == "torch":
            _GAP.add_(1)
        elif tail == "triton":
            _tiny_kernel[(1,)](_GAP)

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            flush.zero_()
            step()
        torch.cuda.synchronize()
    return prof


def _compiled(fn):
    """The compiled kernels a Triton JIT function holds (any Triton 3 cache layout)."""
    for entry in getattr(fn, "device_caches", {}).values():
        cache = entry[0] if isinstance(entry, tuple) else entry
        yield from (k for k in cache.values() if hasattr(k, "metadata"))


_KERNELS = ("_block_pass_kernel", "_row_draw_kernel", "_raw_logprobs_kernel")


def _report_and_carveout(carveout: int | None) -> None:
    """Print each compiled kernel's registers and shared memory; with carveout, set its
    preferred shared-memory carveout (percent) through the driver."""
    from graphexec.sampling.triton import logprobs

    fns = [getattr(launch, n) for n in _KERNELS] + [logprobs._logprobs_kernel]
    cuda = ctypes.CDLL("libcuda.so.1")
    for fn in fns:
        for k in _compiled(fn):
            k._init_handles()
            rc = None
            if carveout is not None:  # CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT = 9
                rc = cuda.cuFuncSetAttribute(ctypes.c_void_p(k.function), 9, carveout)
            print(f"  {fn.__name__}: regs {k.n_regs} spills {k.n_spills} shared "
                  f"{k.metadata.shared} carveout rc {rc}")  # fmt: skip


VARIANTS = ("base", "base_torch_tail", "base_triton_tail", "lp", "lp_no_raw", "lp_no_general",
            "lp_no_writers", "lp_torch_gap", "lp_sync")  # fmt: skip


def _times(name, B, inputs, flush, reps) -> str:
    """One variant at batch B: each kernel's mean microseconds."""
    lp = name.startswith("lp")
    params = [gx.SamplingParams(seed=1000 + b, temperature=0.8, top_k=50, top_p=0.9,
                                logprobs=20 if lp else None) for b in range(B)]  # fmt: skip
    table = SamplingTensors.from_params(params, inputs[0].shape[1], "cuda")
    out = SamplerOutput.allocate(B, "cuda", 20 if lp else None)
    args = (*inputs, table, out, None, gx.choose_variant(params), "triton")
    tail = name[5:-5] if name.endswith("_tail") else None
    with _patched(name):
        prof = _profile(args, tail, flush, reps)
    us = collections.defaultdict(float)
    for ev in prof.events():
        if ev.device_type.name == "CUDA" and "kernel" in ev.name and "fill" not in ev.name:
            us[ev.name.split("(")[0].split("<")[0][-24:]] += ev.device_time / reps
    return " ".join(f"{k}={v:.1f}" for k, v in us.items())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", default="1,128")
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--carveout", type=int, default=None)
    a = ap.parse_args()
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    global _GAP
    _GAP = _GAP.cuda()
    batches = [int(b) for b in a.batch.split(",")]
    inputs = {}
    for B in batches:
        torch.manual_seed(0)
        logits = torch.randn(B, a.vocab, device="cuda") * 3.0
        inputs[B] = (logits, torch.arange(B, device="cuda"), torch.arange(B, device="cuda") + 7)
        for name in VARIANTS:
            print(f"{name}@{B}: {_times(name, B, inputs[B], flush, a.reps)}", flush=True)
    if a.carveout is not None:
        _report_and_carveout(a.carveout)
        for B in batches:
            for name in ("base", "lp"):
                print(f"carveout{a.carveout} {name}@{B}: "
                      f"{_times(name, B, inputs[B], flush, a.reps)}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
