#!/usr/bin/env python
"""Tune the Triton sampler's launch knobs on a GPU: CUDA-graph replay time of
`sample_step` per (knobs, variant, B), logits flushed from L2 and the SMs' instruction
caches evicted (`icache_evict.py`) before each replay, as in bench_sampler (results made
before 2026-11-25's last runs kept the instruction caches warm: `--warm-icache`).

    python benchmarks/tune_sampler.py [--vocab 128256] [--batch 1,32,256] [--out FILE]
    python benchmarks/tune_sampler.py --markdown FILE   # a table of a saved run

Knobs are module attributes of `graphexec.sampling.triton.launch` (the table KNOBS);
each line prints one configuration's times in microseconds. Knobs a launcher lacks (an
older tree, to time it side by side) are left out.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics

import torch

import graphexec as gx
from graphexec.sampling.tensors import SamplerOutput, SamplingTensors
from graphexec.sampling.triton import launch

# (result key, `launch` attribute, default list; None: the launcher's own value). Each is
# a --key option (dashes for underscores) taking a comma-separated list; a launcher
# without the attribute (an older tree, timed side by side) gets none of it.
KNOBS = [
    ("rows", "ROWS", "4,8,16"),
    ("pass_warps", "PASS_WARPS", "4,8"),
    ("row_warps", "ROW_WARPS", "8"),
    ("programs", "TARGET_PROGRAMS", "2048"),
    ("gather_rows", "GATHER_ROWS", None),
    ("dense_div", "DENSE_DIV", None),  # 0: packed lists only
    ("row_maxnreg", "ROW_MAXNREG", None),  # register cap when B exceeds the SMs; 0: never
    ("top_p_step", "TOP_P_STEP", None),
    ("split_rows", "SPLIT_ROWS", None),
    ("split_programs", "SPLIT_PROGRAMS", None),
    ("split_warps", "SPLIT_WARPS", None),
    ("split_slice", "SPLIT_SLICE", None),
    ("split_max_b", "SPLIT_MAX_B", None),
    ("gather_mult", "GATHER_MULT", None),
]

CASES = {
    "no_filter": dict(temperature=0.8),
    "top_k_top_p": dict(temperature=0.8, top_k=50, top_p=0.9),
    "top_p": dict(temperature=0.8, top_p=0.9),
    "min_p": dict(temperature=0.8, min_p=0.05),
}


def replay_us(fn, evict=None, reps: int = 30) -> float:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    t = []
    for _ in range(reps):
        flush.zero_()
        if evict is not None:
            evict()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        t.append(a.elapsed_time(b) * 1e3)
    return statistics.median(t)


def case_fn(name: str, B: int, V: int, dtype: torch.dtype, scale: float = 3.0):
    params = [gx.SamplingParams(seed=1000 + b, **CASES[name]) for b in range(B)]
    table = SamplingTensors.from_params(params, V, "cuda")
    out = SamplerOutput.allocate(B, "cuda", None)
    logits = (torch.randn(B, V, device="cuda") * scale).to(dtype)
    slots = torch.arange(B, device="cuda")
    pos = torch.arange(B, device="cuda") + 7
    variant = gx.choose_variant(params)
    ref = gx.sample_logits(logits, params, (pos).tolist(), backend="torch")

    def fn():
        gx.sample_step(logits, slots, pos, table, out, None, variant, "triton")

    fn()
    bad = int((out.token_ids != ref.token_ids).sum())
    return fn, bad


def markdown(path: str) -> str:
    """Rows: knob settings; columns: case@B; cells: microseconds (mismatches vs torch)."""
    with open(path) as f:
        data = json.load(f)
    res = data["results"]
    # every key but the measurement's: knobs of older runs (or of patches) keep their rows apart
    skip = ("case", "B", "V", "dtype", "us", "mismatches_vs_torch", "what")
    knobs = tuple(dict.fromkeys(k for r in res for k in r if k not in skip))
    cols = list(dict.fromkeys((r["case"], r["B"]) for r in res))
    head = "| " + " | ".join(knobs) + " | " + " | ".join(f"{c}@B={b}" for c, b in cols) + " |"
    lines = [f"{data['device']}, V = {res[0]['V']}, {res[0]['dtype']}, CUDA-graph replay, us",
             "", head, "|" + "---|" * (len(knobs) + len(cols))]  # fmt: skip
    for k in dict.fromkeys(tuple(r.get(n) for n in knobs) for r in res):
        cell = {(r["case"], r["B"]): r for r in res if tuple(r.get(n) for n in knobs) == k}
        vals = [
            f"{cell[c]['us']:.1f}" + (f" ({cell[c]['mismatches_vs_torch']}!)"
                                      if cell[c]["mismatches_vs_torch"] else "")
            if c in cell else "-"
            for c in cols
        ]  # fmt: skip
        lines.append("| " + " | ".join(str(v) for v in k) + " | " + " | ".join(vals) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--batch", default="1,32,256")
    ap.add_argument("--cases", default=",".join(CASES))
    for key, attr, default in KNOBS:
        own = str(int(getattr(launch, attr, 0)))
        ap.add_argument("--" + key.replace("_", "-"), default=default or own)
    ap.add_argument("--tag", default="", help="a label stored with every result")
    ap.add_argument("--scale", default="3", help="logits are randn * scale; a list")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--out", default=None)
    ap.add_argument("--append", action="store_true", help="add to the results in --out")
    ap.add_argument("--markdown", default=None, help="print the table of a saved run and exit")
    ap.add_argument("--warm-icache", action="store_true", help="do not evict the instruction "
                    "caches before each replay")  # fmt: skip
    a = ap.parse_args()
    if a.markdown:
        print(markdown(a.markdown))
        return
    evict = None
    if not a.warm_icache:
        from icache_evict import ICacheEvictor

        evict = ICacheEvictor(torch.device("cuda"))
    icache = "warm" if a.warm_icache else "evicted"
    dtype = getattr(torch, a.dtype)
    ints = lambda s: [int(v) for v in s.split(",")]
    results = []
    for values in itertools.product(*(ints(getattr(a, key)) for key, _, _ in KNOBS)):
        knobs = {key: v for (key, _, _), v in zip(KNOBS, values, strict=True)}
        for (_, attr, _), v in zip(KNOBS, values, strict=True):
            if hasattr(launch, attr):
                setattr(launch, attr, v)
        line = []
        for name, scale in itertools.product(a.cases.split(","), a.scale.split(",")):
            case = name if scale == "3" else f"{name}*{scale}"
            for B in ints(a.batch):
                fn, bad = case_fn(name, B, a.vocab, dtype, float(scale))
                us = replay_us(fn, evict)
                results.append(dict(tag=a.tag, **knobs, case=case, B=B, V=a.vocab,
                                    dtype=a.dtype, us=us, mismatches_vs_torch=bad,
                                    icache=icache))  # fmt: skip
                line.append(f"{case}@{B}={us:.1f}" + (f"(!{bad})" if bad else ""))
        setting = " ".join(f"{k}={v}" for k, v in knobs.items())
        print(f"{a.tag} {setting}: " + " ".join(line), flush=True)
    if a.out:
        if a.append and os.path.exists(a.out):
            with open(a.out) as f:
                results = json.load(f)["results"] + results
        with open(a.out, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), results=results), f, indent=1)


if __name__ == "__main__":
    main()
