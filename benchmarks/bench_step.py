"""Decode-step latency with TinyLM, eager vs CUDA-graph replay, and the host overhead.

For each batch size B, B requests run decode steps (none finishes while timed, so the
batch plan is reused: the steady state); we time `ex.step()` (wall, from the call to its
return) in replay and in eager mode, and split the replayed step's wall time into host
work around the replay (flush, keyed inputs, launch, output copies, stop checks) and the
wait for the device (`ex.last_step_timing`); those steps do not read their outputs.
`outputs_us` is measured on 20 more steps: what the caller then pays to read all B
outputs as `RequestOutput` objects (they are built lazily, outside the step).
Results JSON (device, versions, date) and a plot go to benchmarks/results/.

    python benchmarks/bench_step.py [--batches 1 8 32 128 256] [--steps 50] [--out DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import os
import statistics
import time

import torch
import triton

import graphexec as gx
from graphexec.graphs import GraphKey
from graphexec.params import SamplerVariant as SV

P = gx.SamplingParams
WORKLOADS = {
    "no_filter": lambda i: P(temperature=0.8, seed=i),
    "top_k_top_p": lambda i: P(temperature=0.8, top_k=50, top_p=0.9, seed=i),
}


def measure(ex: gx.DecodeExecutor, B: int, make, steps: int, mode: str | None) -> dict:
    for i in range(B):
        ex.add_request(
            f"b{i}", [1 + i % 100, 2, 3], dataclasses.replace(make(i), max_tokens=steps + 30)
        )
    for _ in range(3):  # first tokens, then warm steps
        ex.step(mode)
    gc.collect()
    walls, host, wait, before = [], [], [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        outs = ex.step(mode)
        walls.append(time.perf_counter() - t0)
        host.append(ex.last_step_timing.host)
        wait.append(ex.last_step_timing.wait)
        before.append(ex.last_step_timing.before)
        assert len(outs) == B
    built = []
    for _ in range(20):  # then what a caller pays to read every output as an object
        outs = ex.step(mode)
        t1 = time.perf_counter()
        assert len(list(outs)) == B
        built.append(time.perf_counter() - t1)
    for i in range(B):
        ex.abort(f"b{i}")
    ex.step(mode)
    med = statistics.median
    return dict(wall_us=med(walls) * 1e6, host_us=med(host) * 1e6, wait_us=med(wait) * 1e6,
                outputs_us=med(built) * 1e6, before_us=med(before) * 1e6,
                host_p90_us=statistics.quantiles(host, n=10)[-1] * 1e6)  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 128, 256])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_step.py measures CUDA graphs: it needs a GPU")
    tok = gx.Tokenizer.cl100k()
    model = gx.models.TinyLM(tok.vocab_size, seed=0, max_seq_len=args.steps + 96)
    mb = max(args.batches)
    ex = gx.DecodeExecutor(model, max_batch_size=mb, device="cuda", tokenizer=tok, seed=0,
                           buckets=sorted(set(args.batches)))  # fmt: skip
    keys = [GraphKey(SV(v), b, False) for v in WORKLOADS for b in args.batches]
    t0 = time.perf_counter()
    ex.capture(keys)
    capture_s = time.perf_counter() - t0
    rows = []
    for name, make in WORKLOADS.items():
        for B in args.batches:
            r = dict(workload=name, batch=B)
            r["replay"] = measure(ex, B, make, args.steps, None)
            r["eager"] = measure(ex, B, make, args.steps, "eager")
            r["speedup"] = r["eager"]["wall_us"] / r["replay"]["wall_us"]
            rows.append(r)
            rp = r["replay"]
            print(f"{name:12s} B={B:4d} replay {rp['wall_us']:8.1f} us (host "
                  f"{rp['host_us']:6.1f}, outputs {rp['outputs_us']:6.1f}) eager "
                  f"{r['eager']['wall_us']:8.1f} us x{r['speedup']:.2f}", flush=True)  # fmt: skip
    dev = torch.cuda.get_device_name()
    result = dict(
        device=dev, date=datetime.date.today().isoformat(), torch=torch.__version__,
        triton=triton.__version__, graphexec=gx.__version__, capture_s=capture_s,
        keys=[str(k) for k in keys], model=dict(name="TinyLM", vocab=tok.vocab_size,
        dim=model.dim, layers=model.num_layers, max_seq_len=model.max_seq_len),
        steps=args.steps, rows=rows,
    )  # fmt: skip
    os.makedirs(args.out, exist_ok=True)
    stem = f"step-{dev.lower().replace(' ', '-')}-{result['date']}"
    path = os.path.join(args.out, stem + ".json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {path}")
    plot(result, os.path.join(args.out, stem + ".png"))
    print(markdown(result))


def plot(result: dict, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot")
        return
    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    for name in WORKLOADS:
        rs = [r for r in result["rows"] if r["workload"] == name]
        bs = [r["batch"] for r in rs]
        ax[0].plot(bs, [r["replay"]["wall_us"] for r in rs], "o-", label=f"{name} replay")
        ax[0].plot(bs, [r["eager"]["wall_us"] for r in rs], "x--", label=f"{name} eager")
        ax[1].plot(bs, [r["replay"]["host_us"] for r in rs], "o-", label=name)
    ax[0].set(xscale="log", yscale="log", xlabel="batch", ylabel="us / step",
              title="decode step (TinyLM), wall")  # fmt: skip
    ax[1].set(xscale="log", xlabel="batch", ylabel="us / step",
              title="host overhead around the replay")  # fmt: skip
    ax[1].axhline(100, color="grey", lw=0.8, ls=":")
    for a in ax:
        a.legend(fontsize=7)
        a.grid(alpha=0.3)
    fig.suptitle(f"{result['device']}, {result['date']}, torch {result['torch']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def markdown(result: dict) -> str:
    lines = ["| workload | B | replay us | eager us | eager / replay | host us (replay) "
             "| reading outputs us |", "|---|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for r in result["rows"]:
        rp = r["replay"]
        lines.append(f"| {r['workload']} | {r['batch']} | {rp['wall_us']:.0f} | "
                     f"{r['eager']['wall_us']:.0f} | {r['speedup']:.1f}x | "
                     f"{rp['host_us']:.0f} | {rp['outputs_us']:.0f} |")  # fmt: skip
    return "\n".join(lines)


if __name__ == "__main__":
    main()
