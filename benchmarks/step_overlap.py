"""The pipelined step against the synchronous one on CUDA (issue 52), TinyLM, greedy.

For each batch size B and overlap off / on, B requests decode in the steady state (no
request ends while timed) and we record per step:
  wall_us     `ex.step()` from the call to its return (median)
  host_us     `ex.last_step_timing.host`: the executor's host work around its wait
  device_us   device time per step: CUDA events around the timed steps / steps
  graph_us    the captured step graph alone, replayed back to back (CUDA events)
  idle_us     device_us - graph_us: the GPU's idle time per step, waiting for the host
With `--cpu-load N` every point is measured again while N busy Python processes run
beside it (a busy serving host). Results JSON under `--out` (step_overlap.json).

    python benchmarks/step_overlap.py [--batches 1 32] [--steps 200] [--cpu-load 16]
"""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing as mp
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import graphexec as gx  # noqa: E402
from graphexec.models.demo_model import choose_model  # noqa: E402
from graphexec.params import SamplerVariant as SV  # noqa: E402


def busy() -> None:
    while True:
        pass


def event() -> torch.cuda.Event:
    e = torch.cuda.Event(enable_timing=True)
    e.record()
    return e


def measure(model, vocab: int, B: int, overlap: bool, steps: int) -> dict:
    ex = gx.DecodeExecutor(model, max_batch_size=B, device="cuda", buckets=[B], seed=0,
                           overlap=overlap, vocab_size=vocab)  # fmt: skip
    key = gx.GraphKey(SV.NO_FILTER, B, False)
    ex.capture([key], progress=False)
    p = gx.SamplingParams(temperature=0.0, seed=0, max_tokens=steps + 64, ignore_eos=True)
    for i in range(B):
        ex.add_request(f"r{i}", [1 + i % 100, 2, 3], p)
    for _ in range(32):  # until every request decodes and reports
        if len(ex.step()) == B:
            break
    else:
        raise RuntimeError(f"{B} requests did not all report in 32 steps")
    for _ in range(5):
        ex.step()
    torch.cuda.synchronize()
    walls, host = [], []
    e0 = event()
    for _ in range(steps):
        t0 = time.perf_counter()
        n = len(ex.step())
        walls.append(time.perf_counter() - t0)
        host.append(ex.last_step_timing.host)
        assert n == B, n
    e1 = event()
    torch.cuda.synchronize()
    device = e0.elapsed_time(e1) * 1e3 / steps
    graph = ex.graphs.steps[key].graph  # back to back: the graph alone
    for _ in range(3):
        graph.replay()
    g0 = event()
    for _ in range(steps):
        graph.replay()
    g1 = event()
    torch.cuda.synchronize()
    graph_us = g0.elapsed_time(g1) * 1e3 / steps
    for i in range(B):
        ex.abort(f"r{i}")
    while not ex.idle:
        ex.step()
    med = statistics.median
    return dict(batch=B, overlap=overlap, wall_us=med(walls) * 1e6, host_us=med(host) * 1e6,
                device_us=device, graph_us=graph_us, idle_us=device - graph_us)  # fmt: skip


def run(args, load: int) -> list[dict]:
    procs = [mp.Process(target=busy, daemon=True) for _ in range(load)]
    for q in procs:
        q.start()
    rows = []
    try:
        for B in args.batches:
            for overlap in (False, True):
                # room for the timed steps and as many graph replays after them
                n = 2 * args.steps + 160
                if args.model:
                    model = choose_model(args.model, torch.device("cuda"), args.dtype, n).make()
                else:
                    model = gx.models.TinyLM(args.vocab, seed=0, max_seq_len=n)
                r = measure(model, model.vocab_size, B, overlap, args.steps)
                r["model"] = args.model or "tiny"
                del model  # one model's weights on the device at a time (8B: 16 GB each)
                gc.collect()
                torch.cuda.empty_cache()
                r["cpu_load"] = load
                rows.append(r)
                print(f"load {load:3d} B={B:4d} overlap={overlap!s:5s} wall "
                      f"{r['wall_us']:8.1f} us host {r['host_us']:7.1f} device "
                      f"{r['device_us']:8.1f} graph {r['graph_us']:8.1f} idle "
                      f"{r['idle_us']:7.1f}", flush=True)  # fmt: skip
    finally:
        for q in procs:
            q.kill()
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--steps", type=int, default=200, help="timed steps per point")
    ap.add_argument("--vocab", type=int, default=100_277, help="TinyLM's vocabulary")
    ap.add_argument("--model", default=None, help="a --model value instead of TinyLM")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--cpu-load", type=int, default=0,
                    help="also measure beside this many busy processes (0: not)")  # fmt: skip
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("step_overlap.py needs CUDA")
    rows = run(args, 0)
    if args.cpu_load:
        rows += run(args, args.cpu_load)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"step_overlap-{args.model or 'tiny'}.json")
    with open(path, "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                       steps=args.steps, rows=rows), f, indent=1)  # fmt: skip
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
