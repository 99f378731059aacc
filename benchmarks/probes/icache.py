"""Is the row program slower after other large kernels because its instructions were
evicted? Per-kernel times (torch.profiler) of one step, L2 flushed before each as in
bench_sampler, with and without a code-heavy kernel (about 330 KB of straight-line code on
every SM, touching none of the sampler's memory: `benchmarks/icache_evict.py`) run
between the flush and the step; with launch.SPLIT_MAX_B off and on. Not part of the
library. H100 results: benchmarks/sampler_notes.md.

    python benchmarks/probes/icache.py [--batch 1,32,128] [--cases top_k_top_p,top_p,...]
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

import graphexec as gx
from graphexec.sampling.tensors import SamplerOutput, SamplingTensors
from graphexec.sampling.triton import launch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from icache_evict import ICacheEvictor  # noqa: E402

_KP = dict(temperature=0.8, top_k=50, top_p=0.9)
CASES = {  # (params, top-N width or None)
    "top_k_top_p": (_KP, None),
    "top_p": (dict(temperature=0.8, top_p=0.9), None),
    "min_p": (dict(temperature=0.8, min_p=0.05), None),
    "lp20": (dict(_KP, logprobs=20), 20),
}


def _times(case, B, vocab, flush, evict, reps):
    kw, num_top = CASES[case]
    params = [gx.SamplingParams(seed=1000 + b, **kw) for b in range(B)]
    table = SamplingTensors.from_params(params, vocab, "cuda")
    out = SamplerOutput.allocate(B, "cuda", num_top)
    torch.manual_seed(0)
    logits = torch.randn(B, vocab, device="cuda") * 3.0
    slots = torch.arange(B, device="cuda")
    pos = torch.arange(B, device="cuda") + 7
    args = (logits, slots, pos, table, out, None, gx.choose_variant(params), "triton")
    gx.sample_step(*args)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            flush.zero_()
            if evict is not None:
                evict()
            gx.sample_step(*args)
        torch.cuda.synchronize()
    us = collections.defaultdict(float)
    for ev in prof.events():
        name = ev.name.split("(")[0]
        if ev.device_type.name == "CUDA" and name.startswith("_") and "evict" not in name:
            us[name.replace("_kernel", "")] += ev.device_time / reps
    return us


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", default="1,32,128")
    ap.add_argument("--cases", default="top_k_top_p,top_p,min_p,lp20")
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--reps", type=int, default=30)
    a = ap.parse_args()
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    evict = ICacheEvictor(torch.device("cuda"))
    for case in a.cases.split(","):
        for B in (int(b) for b in a.batch.split(",")):
            for split in (0, 128):
                launch.SPLIT_MAX_B = split
                for ev_name, ev in (("warm", None), ("evicted", evict)):
                    us = _times(case, B, a.vocab, flush, ev, a.reps)
                    parts = " ".join(f"{n}={v:.1f}" for n, v in us.items())
                    print(f"{case}@{B} split={split} {ev_name}: {parts} | sum "
                          f"{sum(us.values()):.1f}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
