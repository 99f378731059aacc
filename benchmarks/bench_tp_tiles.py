"""One tensor-parallel rank's GEMMs, per whole-weight split of K: which split serves every T.

A layer's split of K into S parts is fixed by its whole weight (so 1, 2 and 4 GPUs give
the same bits), but its cost is not: a column shard [N / T, K] keeps all S parts per
output, and a row-parallel rank [N, K / T] holds S / T of them. For each linear layer of
`--model` (q/k/v, gate/up with its SwiGLU, the LM head: column-parallel; o and down:
row-parallel, their float32 subtree sums) and each S in `--splits`, at each T in
`--worlds`, this times the rank's product at `--rows` over candidate tiles: block_n,
warps and stages, and the programs per output tile (`MatmulTile.programs`: 1 runs every
part in one program, all parts one program each, 0 the launcher's rule by M; a launch
choice, not a bit). Each candidate is
checked bit for bit against the base tile of that split (the whole weight's tile with
S), as `verify_shard_tiles` does at bind. Times are CUDA-graph replays of calls cycling
through weight copies (more bytes than L2 holds), per call; floor = the rank's weight
bytes at the read bandwidth measured in the same run (`step_floor.read_bandwidth`).

    python benchmarks/bench_tp_tiles.py [--model llama-3.1-8b] [--worlds 1 2 4] [--splits 1 2 4 8]

Prints per layer a table of S x T (best us at M = 1 and the worst --rows, and its tile),
and the split whose sum over T of the best times is least. JSON in --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import itertools
import math

import torch
import triton
from bench_common import write_json
from bench_distributed import time_graph
from bench_matmul import L2_BYTES, shapes
from step_floor import floor_us, read_bandwidth

from graphexec.kernels import matmul as mm
from graphexec.kernels.row_parallel import ROW_SPLIT

ROW_PARALLEL = ("o", "down")  # the other layers are column-parallel


def rank_operand(s: dict, T: int) -> tuple[int, int, bool]:
    """(rows of the rank's weight, its K, row-parallel) for layer `s` at T ranks."""
    if s["layer"] in ROW_PARALLEL:
        return s["N"], s["K"] // T, True
    n = s["N"] // T
    return (2 * n if s["silu"] else n), s["K"], False


def tiles_for(s: dict, T: int, base: mm.MatmulTile, args) -> list[mm.MatmulTile]:
    """Candidates of the rank's product: `base` is the rank's tile of the split (its
    parts: S, or S / T for a row-parallel rank), whose K per step every candidate keeps
    (the K loop is part of the bits)."""
    rows = rank_operand(s, T)[0]
    parts = base.split
    n = rows // 2 if s["silu"] else rows
    progs = sorted({0, 1, parts} | {p for p in args.programs if p <= parts and not parts % p})
    out = []
    for bn, ws, p in itertools.product(args.block_n, args.warps_stages, progs):
        w, st = map(int, ws.split(","))
        if n // bn < 4 or st * (64 + 2 * bn) * base.block_k * 2 > 220 << 10:
            continue
        out.append(mm.MatmulTile(64, bn, base.block_k, w, st, parts, programs=p))
    return out


def time_tile(s: dict, t: mm.MatmulTile, base: mm.MatmulTile, weights: list, row: bool,
              args) -> dict | None:  # fmt: skip
    """{M: us per call} of tile `t` on the rank's weight copies, or None where it does
    not run or differs by a bit from `base` (the split's tile) at some M."""
    gpu, times = mm.MatmulConfig.gpu(), {}
    for M in args.rows:
        x = torch.randn(M, weights[0].shape[1], device="cuda", dtype=torch.bfloat16)

        def call(w, tile=t, x=x):
            return mm._launch(x, w, None, s["silu"], gpu, tile=tile, f32_out=row)

        try:
            if not torch.equal(call(weights[0]), call(weights[0], base)):
                return None
            times[M] = time_graph(lambda call=call: [call(w) for w in weights], args.reps)
        except Exception:  # out of resources
            return None
        times[M] /= len(weights)
    return times


def sweep_layer(s: dict, args, bw: float) -> dict:
    gpu = mm.MatmulConfig.gpu()
    whole = gpu.tile(s["N"], s["K"])
    row = s["layer"] in ROW_PARALLEL
    res = dict(layer=s["layer"], N=s["N"], K=s["K"], whole_tile=vars(whole), by_split={})
    sums = {}  # S -> the sum over T of its best worst-M times, where every T ran
    for S in args.splits:
        if s["K"] % S or (row and S < ROW_SPLIT) or s["K"] // S < 64:
            continue
        bk = whole.block_k if s["K"] // S >= whole.block_k else 64
        base = dataclasses.replace(whole, block_k=bk, split=S, programs=0)
        worlds = [T for T in args.worlds if not (row and S % T)]
        per_t = {}
        for T in worlds:
            rows, K, _ = rank_operand(s, T)
            wbytes = rows * K * 2
            copies = max(2, min(32, math.ceil(L2_BYTES / wbytes)))
            weights = [torch.randn(rows, K, device="cuda", dtype=torch.bfloat16) * 0.02
                       for _ in range(copies)]  # fmt: skip
            rank_base = dataclasses.replace(base, split=S // T if row else S)
            best = None
            for t in tiles_for(s, T, rank_base, args):
                times = time_tile(s, t, rank_base, weights, row, args)
                if times is not None and (best is None or max(times.values()) < best["worst_us"]):
                    best = dict(tile=vars(t), us=times, worst_us=max(times.values()))
            del weights
            torch.cuda.empty_cache()
            if best is not None:
                best["floor_us"] = floor_us(wbytes, bw)
                per_t[T] = best
        if per_t:
            res["by_split"][S] = per_t
        if len(per_t) == len(worlds):
            sums[S] = sum(v["worst_us"] for v in per_t.values())
    res["best_split"] = min(sums, key=sums.get) if sums else None
    return res


def table(r: dict, worlds) -> str:
    lines = [f"\n{r['layer']} [{r['N']}, {r['K']}] (whole tile split {r['whole_tile']['split']}; "
             f"best split over T: {r['best_split']})",
             "| S | " + " | ".join(f"T={T}: us (floor) tile" for T in worlds) + " |",
             "|---|" + "---|" * len(worlds)]  # fmt: skip
    for S, per_t in r["by_split"].items():
        cells = []
        for T in worlds:
            b = per_t.get(T)
            if b is None:
                cells.append("-")
                continue
            t = b["tile"]
            cells.append(f"{b['worst_us']:.1f} ({b['floor_us']:.1f}) bn{t['block_n']} "
                         f"w{t['num_warps']}s{t['num_stages']} p{t['programs']}")  # fmt: skip
        lines.append(f"| {S} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--layers", nargs="+", default=["qkv", "o", "gate_up+silu", "down", "lm_head"])
    ap.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--splits", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--block-n", type=int, nargs="+", default=[16, 32, 64, 128])
    ap.add_argument("--warps-stages", nargs="+", default=["4,4"], metavar="W,S")
    ap.add_argument("--programs", type=int, nargs="+", default=[], metavar="P",
                    help="programs per tile besides 0 (the rule), 1 and all parts")  # fmt: skip
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_tp_tiles.py times CUDA kernels: it needs a GPU")
    bw = read_bandwidth("cuda")
    print(f"read bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    result = dict(device=torch.cuda.get_device_name(), date=datetime.date.today().isoformat(),
                  torch=torch.__version__, triton=triton.__version__, model=args.model,
                  read_bandwidth=bw, rows=args.rows, layers=[])  # fmt: skip
    for s in shapes(args.model):
        if s["layer"] not in args.layers:
            continue
        r = sweep_layer(s, args, bw)
        result["layers"].append(r)
        print(table(r, args.worlds), flush=True)
    print(f"wrote {write_json(args.out, f'tp-tiles-{args.model}', result)}")
    return result


if __name__ == "__main__":
    main()
