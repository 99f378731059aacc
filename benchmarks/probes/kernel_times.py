"""Per-kernel GPU times of one `sample_step` (torch.profiler, eager, logits flushed from
L2 before each step), to see which launch a change moved. Not part of the library.

    python benchmarks/probes/kernel_times.py [TAG] [--batch 1,32,256] [--cases top_p,...]

cases: no_filter top_k_top_p top_p min_p lp20 (top_k_top_p, logprobs 20) bitmask.

Prints one line per (case, B): each kernel's mean microseconds, then their sum. The SMs'
instruction caches stay warm from step to step here, unlike in an engine: a large kernel
looks faster here than it runs there (`probes/icache.py` evicts them).
"""

from __future__ import annotations

import argparse
import collections
import functools

import torch
from torch.profiler import ProfilerActivity, profile

import graphexec as gx
from graphexec.sampling.tensors import SamplerOutput, SamplingTensors

_KP = dict(temperature=0.8, top_k=50, top_p=0.9)
# case: (params, top-N width or None, random bitmask)
CASES = {
    "no_filter": (dict(temperature=0.8), None, False),
    "top_k_top_p": (_KP, None, False),
    "top_p": (dict(temperature=0.8, top_p=0.9), None, False),
    "min_p": (dict(temperature=0.8, min_p=0.05), None, False),
    "lp20": (dict(_KP, logprobs=20), 20, False),
    "bitmask": (_KP, None, True),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("tag", nargs="?", default="")
    ap.add_argument("--batch", default="1,32,256")
    ap.add_argument("--cases", default="top_k_top_p,top_p,min_p")
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    a = ap.parse_args()
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    for name in a.cases.split(","):
        for B in (int(b) for b in a.batch.split(",")):
            kw, num_top, with_mask = CASES[name]
            params = [gx.SamplingParams(seed=1000 + b, **kw) for b in range(B)]
            table = SamplingTensors.from_params(params, a.vocab, "cuda")
            out = SamplerOutput.allocate(B, "cuda", num_top)
            bm = None
            if with_mask:  # each token allowed with probability 1/2, as in bench_sampler
                words = torch.randint(0, 2**32, (B, (a.vocab + 31) // 32))
                bm = words.to(torch.int32).cuda()
            logits = (torch.randn(B, a.vocab, device="cuda") * 3.0).to(getattr(torch, a.dtype))
            slots = torch.arange(B, device="cuda")
            pos = torch.arange(B, device="cuda") + 7
            args = (logits, slots, pos, table, out, bm, gx.choose_variant(params), "triton")
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
            print(
                f"{a.tag} {a.dtype} {name}@{B}: " + " ".join(parts) + f" | sum {total:.1f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
