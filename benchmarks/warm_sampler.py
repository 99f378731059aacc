#!/usr/bin/env python
"""Compile the Triton sampler's kernels for a benchmark grid in parallel processes, so the
timed runs that follow (`bench_sampler.py`, `tune_sampler.py`) load them from the Triton
cache instead of compiling them one after another (the row-draw kernel takes 20-40 s).

One process per (dtype, V, graphexec method, B); each calls the method once (the batch
size is not a specialisation, but the row programs' register cap applies only when B
exceeds the SMs: warm a large B too for those compiles).

    python benchmarks/warm_sampler.py --vocab 128256,151936 --dtypes float32,bfloat16 \
        [--batch 8,256] [--jobs 16] [--set GATHER_ROWS=8 --set DENSE_DIV=0]
"""

from __future__ import annotations

import argparse
import itertools
import multiprocessing as mp
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))


def warm_one(job: tuple[str, int, str, int, list[str], str]) -> str:
    dtype_name, V, method, B, knobs, device = job
    import sampler_methods as sm
    import torch

    from graphexec.sampling.triton import launch

    for k in knobs:
        name, val = k.split("=")
        setattr(launch, name, int(val))
    t0 = time.time()
    try:
        logits = (torch.randn(B, V, device=device) * 3).to(getattr(torch, dtype_name))
        backend = "triton" if device == "cuda" else "torch"  # cpu: a smoke run
        sm.BUILDERS[method](sm.Case(logits, B, V, torch.device(device), backend)).fn()
        if device == "cuda":
            torch.cuda.synchronize()
        status = "ok"
    except Exception as e:  # a failed compile is reported, the others go on
        status = f"ERROR {type(e).__name__}: {str(e)[:200]}"
    took = time.time() - t0
    head = f"{method:36s} {dtype_name:9s} V={V:<7d} B={B:<4d}"
    return f"{head} {' '.join(knobs)} {took:6.1f} s {status}"


def main() -> None:
    import sampler_methods as sm

    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", default="128256,151936")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--methods", default="graphexec")
    ap.add_argument("--batch", default="8")
    ap.add_argument("--jobs", type=int, default=16)
    ap.add_argument("--set", action="append", default=[], help="launch knob NAME=INT")
    ap.add_argument("--device", default="cuda")
    a = ap.parse_args()
    methods = [m for m in sm.METHODS if any(s in m for s in a.methods.split(","))]
    jobs = [
        (d, int(v), m, int(b), a.set, a.device)
        for d, v, m, b in itertools.product(
            a.dtypes.split(","), a.vocab.split(","), methods, a.batch.split(",")
        )  # fmt: skip
    ]
    t0 = time.time()
    with mp.get_context("spawn").Pool(min(a.jobs, len(jobs))) as pool:
        for line in pool.imap_unordered(warm_one, jobs):
            print(line, flush=True)
    print(f"warmed {len(jobs)} (dtype, V, method, B) in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
