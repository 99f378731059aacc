"""Per-kernel GPU times of one `sample_step` (torch.profiler, eager, logits flushed from
L2 before each step), to see which launch a change moved. Not part of the library.

    python benchmarks/probes/kernel_times.py [TAG] [--batch 1,32,256] [--cases top_p,...]

Prints one line per (case, B): each kernel's mean microseconds, then their sum.
"""

from __future__ import annotations

import argparse
import collections
import functools

import torch
from torch.profiler import ProfilerActivity, profile

import graphexec as gx
from graphexec.sampling.tensors import SamplerOutput, SamplingTensors

CASES = {
    "no_filter": dict(temperature=0.8),
    "top_k_top_p": dict(temperature=0.8, top_k=50, top_p=0.9),
    "top_p": dict(temperature=0.8, top_p=0.9),
    "min_p": dict(temperature=0.8, min_p=0.05),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("tag", nargs="?", default="")
    ap.add_argument("--batch", default="1,32,256")
    ap.add_argument("--cases", default="top_k_top_p,top_p,min_p")
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--reps", type=int, default=20)
    a = ap.parse_args()
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    for name in a.cases.split(","):
        for B in (int(b) for b in a.batch.split(",")):
            params = [gx.SamplingParams(seed=1000 + b, **CASES[name]) for b in range(B)]
            table = SamplingTensors.from_params(params, a.vocab, "cuda")
            out = SamplerOutput.allocate(B, "cuda", None)
            logits = torch.randn(B, a.vocab, device="cuda") * 3.0
            slots = torch.arange(B, device="cuda")
            pos = torch.arange(B, device="cuda") + 7
            args = (logits, slots, pos, table, out, None, gx.choose_variant(params), "triton")
            step = functools.partial(gx.sample_step, *args)
            step()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(a.reps):
                    flush.zero_()
                    step()
                torch.cuda.synchronize()
            us = collections.defaultdict(float)
            for ev in prof.events():
                if ev.device_type.name == "CUDA" and "kernel" in ev.name:
                    us[ev.name.split("(")[0]] += ev.device_time / a.reps
            parts = [f"{k.replace('_kernel', '')}={v:.1f}" for k, v in us.items()
                     if "elementwise" not in k and "fill" not in k]  # fmt: skip
            total = sum(v for k, v in us.items() if "elementwise" not in k and "fill" not in k)
            print(f"{a.tag} {name}@{B}: " + " ".join(parts) + f" | sum {total:.1f}", flush=True)


if __name__ == "__main__":
    main()
