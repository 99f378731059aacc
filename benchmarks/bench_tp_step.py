"""The tensor-parallel decode step: HFTransformer sharded over T GPUs against one GPU.

For each T in --worlds (1: one GPU, no group), T processes (NCCL, one GPU each) build the
--model config's seeded random weights (bf16; every rank makes the whole state dict from
the same seed and keeps its shard) as `HFTransformer(..., tp_group=WORLD)`, and a
`DecodeExecutor(tp_group=WORLD)` whose buckets are --batches, the greedy `no_filter` key
captured per bucket. Every rank runs the same requests (B of --prompt-len tokens); rank 0
times `ex.step()` replayed (`bench_step.measure`: the median wall over --steps), and
the model's own reductions alone on every rank (`reduce_time`: its 2 L row-parallel
reductions of B rows in one CUDA graph), with each rank's host time. speedup(T) =
step(T = 1) / step(T) at the same B. --per-shard: each rank draws only its part of the
weights (Llama-3.1-70B, which does not fit one GPU; --worlds without 1). --profile (CUDA):
each rank's decode forward over B rows captured alone, its kernels summed by name under
torch.profiler (rank 0's in the JSON and printed last): what a sharded step spends.

Targets (TARGETS) on llama-3.1-8b at B = 32: 1.7x at T = 2, 2.5x at T = 4.

    python benchmarks/bench_tp_step.py --model llama-3.2-1b --worlds 1 2 4 --out DIR
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))

TARGETS = {2: 1.7, 4: 2.5}  # speedup over T = 1 at B = 32


def _rank(rank: int, world: int, args: argparse.Namespace, init: str, out: str) -> None:
    import bench_step
    from step_model import resolve

    import graphexec as gx
    from graphexec.models.hf_random import random_state_dict
    from graphexec.models.hf_shard import TPShard
    from graphexec.params import SamplerVariant as SV
    from graphexec.request import GraphKey

    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank) if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    group = None
    if world > 1:
        dist.init_process_group("nccl" if cuda else "gloo", init_method=init, rank=rank,
                                world_size=world)  # fmt: skip
        group = dist.group.WORLD
    try:
        _, cfg, _ = resolve(args.model)
        # --per-shard: each rank draws only its part (a model too big for one device)
        shard = TPShard.of(cfg, rank, world) if args.per_shard else None
        state = random_state_dict(cfg, seed=0, device=dev, dtype=dtype, shard=shard)
        model = gx.models.HFTransformer(cfg, state, device=dev, dtype=dtype,
                                        max_seq_len=args.max_seq_len, tp_group=group)  # fmt: skip
        del state
        if cuda:
            torch.cuda.empty_cache()
        ex = gx.DecodeExecutor(model, max_batch_size=max(args.batches), device=dev, seed=0,
                               buckets=sorted(args.batches), tp_group=group,
                               tp_method=args.tp_method)  # fmt: skip
        ex.capture([GraphKey(SV("no_filter"), b, False) for b in sorted(args.batches)],
                   progress=False)  # fmt: skip
        rows = []
        for B in args.batches:
            prompts = [[(7 * i + j) % 1000 + 1 for j in range(args.prompt_len)] for i in range(B)]
            r = bench_step.measure(ex, B, lambda i: gx.SamplingParams(temperature=0.0, seed=i,
                                                                      ignore_eos=True),
                                   args.steps, None, prompts)  # fmt: skip
            rows.append(
                dict(
                    world=world,
                    batch=B,
                    rank=rank,
                    **r,
                    reduce_us=reduce_time(model, B, dev) if world > 1 else 0.0,
                    reduce_path=reduce_path(model, B),
                    failed={str(k): v for k, v in ex.stats.failed.items()},
                )
            )
            if args.profile and cuda:
                rows[-1]["profile"] = profile_forward(model, B, args.prompt_len, args.steps)
        Path(f"{out}.{rank}").write_text(json.dumps(rows))
        if world > 1 and cuda:
            dist.barrier()
            # destroying NCCL communicators that CUDA graphs captured can block forever
            # (NCCL 2.28, torch 2.11): the rows are written, so leave without it
            os._exit(0)
    finally:
        if world > 1:
            dist.destroy_process_group()


def profile_forward(model, B: int, pos: int, reps: int, top: int = 15) -> dict:
    """This rank's decode forward over B rows (at position `pos`), captured alone: its
    replay (median us of `reps`) and its kernels under torch.profiler summed by name,
    largest own time first (`step_profile.kernel_spans`: with dependent launches a
    kernel's span includes its wait for the kernel before; its own time does not).
    Every rank calls it at once: the forward's reductions meet the other ranks'."""
    from collections import defaultdict

    from bench_distributed import capture_graph, replay_us
    from step_profile import kernel_spans

    dev = model.device
    ids = torch.ones(B, dtype=torch.long, device=dev)
    positions = torch.full((B,), pos, dtype=torch.long, device=dev)
    slots = torch.arange(B, device=dev)
    if model.tp.world > 1:
        dist.barrier()
    g = capture_graph(lambda: model._forward(ids, positions, slots))
    us = replay_us(g, reps)
    by: dict[str, list] = defaultdict(lambda: [0, 0.0, 0.0])
    gaps = 0.0
    for name, t, own, gap in kernel_spans(g):
        by[name][0] += 1
        by[name][1] += t
        by[name][2] += own
        gaps += gap
    ranked = sorted(by.items(), key=lambda kv: -kv[1][2])
    return dict(forward_us=us, kernels_us=sum(v[1] for v in by.values()),
                own_us=sum(v[2] for v in by.values()), gaps_us=gaps,
                kernels=[dict(name=n[:100], count=c, us=t, own_us=o)
                         for n, (c, t, o) in ranked[:top]])  # fmt: skip


def reduce_path(model, B: int) -> str:
    """Which path the model's row-parallel reductions of B rows take."""
    if model.tp.world == 1:
        return "none"
    return "symmetric tree" if model.tp.partial_out(0, B) is not None else "nccl"


def reduce_time(model, B: int, dev: torch.device, reps: int = 20) -> float:
    """Median us of one decode step's reductions alone, on this rank: a CUDA graph of the
    model's own 2 L row-parallel reductions of B rows (`TPShard.reduce_tree` of float32
    subtree sums, o and down alternating: the one-kernel tree over symmetric memory
    within its row cap, else the NCCL path); on the CPU, wall time of the same calls."""
    tp, D = model.tp, model.dim
    parts = [tp.partial_out(i, B) for i in range(2)]
    parts = [torch.empty(B, D, device=dev) if p is None else p for p in parts]
    for p in parts:
        p.normal_()

    def run() -> None:
        for i in range(2 * model.num_layers):
            tp.reduce_tree(parts[i % 2], model.dtype)

    run()
    if dev.type != "cuda":
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            run()
            times.append((time.perf_counter() - t0) * 1e6)
        return sorted(times)[reps // 2]
    from bench_distributed import time_graph

    dist.barrier()
    return time_graph(run, reps)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama-3.2-1b")
    ap.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32, 128])
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-seq-len", type=int, default=512)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--tp-method", default="auto")
    ap.add_argument("--profile", action="store_true",
                    help="CUDA: each rank's decode forward alone, kernel by kernel")
    ap.add_argument("--per-shard", action="store_true",
                    help="each rank draws only its part of the random weights")
    ap.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default="cuda",
        help="cpu: gloo and float32, a smoke test (its times are not performance)",
    )
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    args = ap.parse_args(argv)
    worlds = args.worlds
    if args.device == "cuda":
        worlds = [w for w in worlds if w <= torch.cuda.device_count()]
    rows = []
    with tempfile.TemporaryDirectory() as d:
        for w in worlds:
            out, init = os.path.join(d, f"w{w}.json"), f"file://{os.path.join(d, f'init{w}')}"
            mp.spawn(_rank, args=(w, args, init, out), nprocs=w, join=True)
            ranks = [json.loads(Path(f"{out}.{r}").read_text()) for r in range(w)]
            for i, row in enumerate(ranks[0]):  # rank 0's step; every rank's host and reduce
                row["host_us_per_rank"] = [rr[i]["host_us"] for rr in ranks]
                row["reduce_us_per_rank"] = [rr[i]["reduce_us"] for rr in ranks]
                rows.append(row)
            print(f"T={w}: " + ", ".join(f"B={r['batch']} {r['wall_us']:.0f} us"
                                         for r in rows if r["world"] == w), flush=True)  # fmt: skip
    one = {r["batch"]: r["wall_us"] for r in rows if r["world"] == 1}
    for r in rows:
        r["speedup"] = one[r["batch"]] / r["wall_us"] if r["batch"] in one else None
    import triton
    from step_model import resolve

    import graphexec as gx

    cuda = args.device == "cuda"
    dev = torch.cuda.get_device_name() if cuda else "cpu"
    result = dict(
        device=dev,
        devices=torch.cuda.device_count() if cuda else 0,
        date=datetime.date.today().isoformat(),
        torch=torch.__version__,
        triton=triton.__version__,
        graphexec=gx.__version__,
        model=args.model,
        dtype="bfloat16" if cuda else "float32",
        prompt_len=args.prompt_len,
        steps=args.steps,
        tp_method=args.tp_method,
        per_shard=args.per_shard,
        rows=rows,
        targets={f"speedup_t{t}_b32": f">= {v}" for t, v in TARGETS.items()},
    )
    if os.environ.get("GRAPHEXEC_COMMIT"):
        result["commit"] = os.environ["GRAPHEXEC_COMMIT"]
    Path(args.out).mkdir(parents=True, exist_ok=True)
    path = (
        Path(args.out)
        / f"tp-step-{resolve(args.model)[0]}-{dev.lower().replace(' ', '-')}-{result['date']}.json"
    )
    path.write_text(json.dumps(result, indent=1))
    print(
        "| T | B | step us | host us (max rank) | reductions us (max rank) | path | "
        "speedup over T = 1 |\n|---:|---:|---:|---:|---:|---|---:|"
    )
    for r in rows:
        sp = f"{r['speedup']:.2f}x" if r["speedup"] else ""
        print(
            f"| {r['world']} | {r['batch']} | {r['wall_us']:.0f} | "
            f"{max(r['host_us_per_rank']):.0f} | {max(r['reduce_us_per_rank']):.0f} | "
            f"{r['reduce_path']} | {sp} |"
        )
    for r in rows:  # --profile: rank 0's forward, its largest kernels
        if "profile" in r:
            p = r["profile"]
            print(f"\nT = {r['world']}, B = {r['batch']}: forward {p['forward_us']:.0f} us; "
                  f"kernels' own {p['own_us']:.0f} us + gaps {p['gaps_us']:.0f} us "
                  f"(spans {p['kernels_us']:.0f} us)\n    own us    span us")  # fmt: skip
            for k in p["kernels"][:8]:
                print(f"  {k['own_us']:8.1f} {k['us']:10.1f}  {k['count']:4d} x  {k['name'][:60]}")
    return result


if __name__ == "__main__":
    main()
