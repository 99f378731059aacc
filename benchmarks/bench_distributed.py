"""Sampling across tensor-parallel ranks: TP sampling vs all_to_all vs vocab_parallel.

Each rank holds a [B, V/T] bf16 slice of the logits. Compared, as CUDA-graph replays:
    tp_sampling     all-gather the slices into [B, V] on every rank, then every rank
                    samples all B rows (what engines ship); graphexec's Triton sampler
    all_to_all      gx.distributed, method="all_to_all"
    vocab_parallel  gx.distributed, method="vocab_parallel"
for B in --batches, V in --vocabs, T in --worlds (the host's GPUs, one process each,
NCCL), on a top-k/top-p batch. Reported per step: time (median of replays, CUDA events)
and the bytes each rank sends. With one GPU (--local), each method's local part at
T = 2, 4, 8: what one rank computes (the all_to_all rank's B/T full rows; the
vocab_parallel rank's [B, V/T] slice over a one-rank group; tp_sampling's B full rows)
and the bytes it would send. Results JSON (device, versions, date) and a plot go to --out.

    python benchmarks/bench_distributed.py [--worlds 2 4] [--local] [--out DIR]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import graphexec as gx
from graphexec.distributed import TensorParallel, vocab_slices

P = gx.SamplingParams
METHODS = ("tp_sampling", "all_to_all", "vocab_parallel")


def inputs(B: int, V: int, dev):
    g = torch.Generator().manual_seed(B + V)
    x = (torch.randn(B, V, generator=g) * 4).to(torch.bfloat16).to(dev)
    params = [P(temperature=0.8, top_k=50, top_p=0.9, seed=i) for i in range(B)]
    return x, gx.SamplingTensors.from_params(params, V, dev), torch.arange(B, device=dev)


def sent_bytes(method: str, B: int, V: int, T: int) -> float:
    """Bytes one rank sends per step (payloads; a ring's own factor aside)."""
    w = V / T
    if method == "tp_sampling":
        return B * w * 2 * (T - 1)  # its slice to every other rank
    if method == "all_to_all":
        return B * w * 2 * (T - 1) / T + B / T * 8 * (T - 1)
    nb = -(-V // 128)
    return B * (20 * nb + 4 * 256 * 24 + 3 * 8 + 16)


def step_fn(method: str, shard, table, slots, pos, out, tp, x_full=None, ws=None):
    if method == "tp_sampling":
        T, (B, w) = tp.world, shard.shape

        def run():
            gathered = torch.empty((T * B, w), dtype=shard.dtype, device=shard.device)
            dist.all_gather_into_tensor(gathered, shard, group=tp.group)
            full = gathered.view(T, B, w).permute(1, 0, 2).reshape(B, T * w)
            gx.sample_step(full, slots, pos, table, out, None, gx.SamplerVariant.TOP_K_TOP_P,
                           workspace=ws)  # fmt: skip

        return run
    return lambda: gx.distributed.sample_step(shard, slots, pos, table, out,
                                              variant=gx.SamplerVariant.TOP_K_TOP_P, tp=tp,
                                              method=method, workspace=ws)  # fmt: skip


def capture_graph(fn) -> torch.cuda.CUDAGraph:
    """fn warmed up on a side stream, then captured once."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g


def replay_us(g: torch.cuda.CUDAGraph, reps: int) -> float:
    """Median µs of reps replays of g, each timed by CUDA events."""
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return statistics.median(times)


def time_graph(fn, reps: int = 30) -> float:
    """Median µs of a CUDA-graph replay of fn (warmed up, captured once)."""
    return replay_us(capture_graph(fn), reps)


def _rank(rank: int, world: int, path: str, batches, vocabs, results) -> None:
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{path}", rank=rank, world_size=world)
    dev = torch.device("cuda", rank)
    rows = []
    for V in vocabs:
        tp = TensorParallel.create(None, V)
        lo, hi = tp.slice
        for B in batches:
            x, table, slots = inputs(B, V, dev)
            pos = torch.zeros(B, dtype=torch.int64, device=dev)
            shard = x[:, lo:hi].contiguous()
            for method in METHODS:
                out = gx.SamplerOutput.allocate(B, dev, None)
                dist.barrier()
                us = time_graph(step_fn(method, shard, table, slots, pos, out, tp))
                rows.append(dict(method=method, T=world, B=B, V=V, us=us,
                                 bytes=sent_bytes(method, B, V, world)))  # fmt: skip
    if rank == 0:
        results[world] = rows
    dist.barrier()
    # destroying NCCL communicators that CUDA graphs captured can block forever (NCCL 2.28,
    # torch 2.11): the rows are stored, so leave without it
    os._exit(0)


def run_multi(worlds, batches, vocabs) -> list[dict]:
    ctx = mp.get_context("spawn")
    rows = []
    for T in worlds:
        if T > torch.cuda.device_count():
            print(f"T={T}: only {torch.cuda.device_count()} GPUs, skipped")
            continue
        with tempfile.TemporaryDirectory() as d, ctx.Manager() as m:
            res = m.dict()
            ps = [ctx.Process(target=_rank, args=(r, T, os.path.join(d, "s"), batches, vocabs,
                                                  res)) for r in range(T)]  # fmt: skip
            for p in ps:
                p.start()
            for p in ps:
                p.join()
            rows += res.get(T, [])
    return rows


def run_local(batches, vocabs, worlds=(2, 4, 8)) -> list[dict]:
    """One GPU: what one rank computes per method at each T, over a one-rank group."""
    with tempfile.TemporaryDirectory() as d:
        dist.init_process_group("nccl", init_method=f"file://{os.path.join(d, 's')}", rank=0,
                                world_size=1)  # fmt: skip
        dev = torch.device("cuda")
        rows = []
        for V in vocabs:
            for B in batches:
                x, table, slots = inputs(B, V, dev)
                pos = torch.zeros(B, dtype=torch.int64, device=dev)
                for T in worlds:
                    hi = vocab_slices(V, T)[0][1]
                    one = TensorParallel(dist.group.WORLD, 0, 1, V, ((0, V),))
                    part = TensorParallel(dist.group.WORLD, 0, 1, V, ((0, hi),))
                    b = -(-B // T)
                    cases = {
                        "tp_sampling": (x, slots, pos, one, "all_to_all"),
                        "all_to_all": (x[:b], slots[:b], pos[:b], one, "all_to_all"),
                        "vocab_parallel": (x[:, :hi].contiguous(), slots, pos, part,
                                           "vocab_parallel"),
                    }  # fmt: skip
                    for method, (xs, sl, ps, tp, how) in cases.items():
                        out = gx.SamplerOutput.allocate(xs.shape[0], dev, None)
                        us = time_graph(step_fn(how, xs, table, sl, ps, out, tp))
                        rows.append(dict(method=method, T=T, B=B, V=V, us=us, local=True,
                                         bytes=sent_bytes(method, B, V, T)))  # fmt: skip
        dist.destroy_process_group()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32, 128, 256])
    ap.add_argument("--vocabs", type=int, nargs="+", default=[128256, 151936])
    ap.add_argument("--local", action="store_true", help="one GPU: each method's local part")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    if args.local or torch.cuda.device_count() < 2:
        rows = run_local(args.batches, args.vocabs)
    else:
        rows = run_multi(args.worlds, args.batches, args.vocabs)
    name = torch.cuda.get_device_name().lower().replace(" ", "-")
    today = datetime.date.today().isoformat()
    result = dict(device=torch.cuda.get_device_name(), gpus=torch.cuda.device_count(),
                  torch=torch.__version__, triton=__import__("triton").__version__,
                  graphexec=os.environ.get("GRAPHEXEC_COMMIT", "unknown"), date=today,
                  local=bool(args.local or torch.cuda.device_count() < 2), rows=rows)  # fmt: skip
    os.makedirs(args.out, exist_ok=True)
    kind = "distributed-local" if result["local"] else "distributed"
    path = os.path.join(args.out, f"{kind}-{name}-{today}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {path}")
    print(markdown(rows))


def markdown(rows: list[dict]) -> str:
    lines = ["| T | B | V | tp_sampling us | all_to_all us | vocab_parallel us | best speedup | "
             "MB sent (tp / a2a / vp) |", "|---:|---:|---:|---:|---:|---:|---:|---|"]  # fmt: skip
    keys = sorted({(r["T"], r["B"], r["V"]) for r in rows})
    for T, B, V in keys:
        c = {r["method"]: r for r in rows if (r["T"], r["B"], r["V"]) == (T, B, V)}
        tp, a, v = (c[m]["us"] for m in METHODS)
        mb = " / ".join(f"{c[m]['bytes'] / 1e6:.2f}" for m in METHODS)
        lines.append(f"| {T} | {B} | {V} | {tp:.0f} | {a:.0f} | {v:.0f} | "
                     f"{tp / min(a, v):.2f}x | {mb} |")  # fmt: skip
    return "\n".join(lines)


if __name__ == "__main__":
    main()
