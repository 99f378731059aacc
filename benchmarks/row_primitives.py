"""What the row kernels' block-level primitives cost, in SM cycles, inside one program of
`tail_warps` warps (the row tail's shape: one CTA a row, vectors over a row's blocks):

    python benchmarks/row_primitives.py [--sizes 256,1024,2048] [--warps 8] [--reps 64]
        [--out DIR]

Each primitive runs REPS times in a loop inside one program, each repetition fed by the
last (so none is hoisted or overlapped), between two reads of %clock64; the table gives
cycles and ns per repetition (the program's own clock against %globaltimer): a vector's
cumsum, sum and max, `tl.histogram` into 256 bins (the radix steps of `topk.kth_largest`),
the gather's scan (a [R, 128] tile reshaped to a vector, as `short.gather` counts its
candidates), a scan along the tile's rows instead, `keys.sort_desc` of int64 keys (the
short sort), and the store + barrier + reload of a vector (`process.list_blocks`, then
`list_tile`). The row tail's phase clocks (`sampler_phases.py`) say which phase is slow;
this says which primitive inside it is. CUDA only.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import ints, versions  # noqa: E402

from graphexec.sampling.triton.clock import read  # noqa: E402
from graphexec.sampling.triton.keys import sort_desc  # noqa: E402

OPS = ["cumsum", "sum", "max", "histogram256", "gather_scan", "row_scan", "sort_int64",
       "store_reload"]  # fmt: skip


@triton.jit
def _prim_kernel(x_ptr, scratch_ptr, out_ptr, N: tl.constexpr, OP: tl.constexpr,
                 REPS: tl.constexpr):  # fmt: skip
    """out[0:4]: cycles, ns, a checksum (keeps the work alive), 0. x: [N] int32."""
    i = tl.arange(0, N)
    v = tl.load(x_ptr + i)
    chk = tl.zeros([], dtype=tl.int64)
    tl.debug_barrier()
    c0 = read("mov.u64 $0, %clock64;")
    t0 = read("mov.u64 $0, %globaltimer;")
    for _ in range(REPS):
        if OP == 0:
            r = tl.cumsum(v, axis=0)
            s = tl.max(r, axis=0)
        elif OP == 1:
            s = tl.sum(v, axis=0)
        elif OP == 2:
            s = tl.max(v, axis=0)
        elif OP == 3:
            h = tl.histogram(v & 255, 256)
            s = tl.max(h, axis=0)
        elif OP == 4:
            t = tl.reshape(v, [N // 128, 128])  # the gather's [R, DB] tile, counted as a vector
            r = tl.cumsum(tl.reshape(t > 0, [N]).to(tl.int32), axis=0)
            s = tl.max(r, axis=0)
        elif OP == 5:
            t = tl.reshape(v, [N // 128, 128])
            r = tl.cumsum((t > 0).to(tl.int32), axis=1)  # within each block, then the blocks'
            c = tl.sum((t > 0).to(tl.int32), axis=1)
            base = tl.cumsum(c, axis=0) - c
            s = tl.max(tl.max(r + base[:, None], axis=1), axis=0)
        elif OP == 6:
            k = tl.reshape((v.to(tl.int64) << 32) | i, [1, N])
            srt = sort_desc(k, False)
            s = tl.max(tl.reshape(srt, [N]), axis=0).to(tl.int32)
        else:
            tl.store(scratch_ptr + i, v)
            tl.debug_barrier()
            s = tl.max(tl.load(scratch_ptr + (N - 1 - i)), axis=0)
        chk += s.to(tl.int64)
        v = v ^ (s & 1)  # the next repetition waits for this one
    tl.debug_barrier()
    c1 = read("mov.u64 $0, %clock64;")
    t1 = read("mov.u64 $0, %globaltimer;")
    tl.store(out_ptr + 0, c1 - c0)
    tl.store(out_ptr + 1, t1 - t0)
    tl.store(out_ptr + 2, chk)


def run(op: str, x: torch.Tensor, warps: int, reps: int) -> torch.Tensor:
    """One program's out [4] (cycles, ns, checksum, 0) for x [N] int32."""
    n = x.shape[0]
    scratch = torch.empty(n, dtype=torch.int32, device=x.device)
    out = torch.zeros(4, dtype=torch.int64, device=x.device)
    _prim_kernel[(1,)](x, scratch, out, N=n, OP=OPS.index(op), REPS=reps, num_warps=warps)
    return out


def measure(op: str, n: int, warps: int, reps: int, dev: torch.device) -> dict:
    x = torch.randint(-1000, 1000, (n,), dtype=torch.int32, device=dev)
    best = None
    for _ in range(5):  # the first call compiles and warms the instruction cache
        cyc, ns = run(op, x, warps, reps)[:2].tolist()
        best = (cyc, ns) if best is None or cyc < best[0] else best
    cyc, ns = best
    return {"op": op, "n": n, "warps": warps, "cycles": cyc / reps, "ns": ns / reps}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--sizes", type=ints, default=[256, 1024, 2048])
    ap.add_argument("--warps", type=int, default=8)
    ap.add_argument("--reps", type=int, default=64)
    ap.add_argument("--ops", default=",".join(OPS))
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("row_primitives.py needs CUDA (the clocks are PTX registers)")
    dev = torch.device("cuda")
    rows = []
    print(f"| op | N | cycles / rep | ns / rep |  ({args.warps} warps, one program)")
    print("|---|---|---|---|")
    for op in args.ops.split(","):
        for n in args.sizes:
            r = measure(op, n, args.warps, args.reps, dev)
            rows.append(r)
            print(f"| {op} | {n} | {r['cycles']:.0f} | {r['ns']:.0f} |", flush=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "row-primitives.json"), "w") as f:
            json.dump({**versions(), "device": torch.cuda.get_device_name(), "rows": rows}, f,
                      indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
