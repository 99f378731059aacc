"""Where the row tail's time goes: the Triton sampler's tail kernel run with phase clocks
(`SamplerConfig.phase_clock`, `graphexec/sampling/triton/clock.py`), one program a row at
every B (`topk_programs` 1): the clocks are per SM, so a row that several programs serve
(top_k_top_p's launch at small B) cannot be clocked, and here is not.

    python benchmarks/sampler_phases.py [--batch 1,128] [--vocab 128256,151936]
        [--shapes peaked,randn3,flat,ties] [--variant top_k_top_p] [--top-k 50] [--reps 20]
        [--icache cold|warm|hot|both|all] [--out DIR]

Each call runs as `bench_sampler.py` times it (fp32 logits, T 0.8, top-k 50, top-p 0.9, a
seed per row; the L2 flushed by reading before the call: `sampler_timing.Timer`), with the
SMs' instruction caches evicted first (`--icache cold`, as after a model forward), kept
(`warm`), or both, one row each; `hot` keeps the L2 too (no flush: the code and the data
stay cached), `all` runs the three. Their differences are the phase's fetches. For each
(V, B, shape) it prints the median over rows and calls of each phase, in µs (cycles
converted by the row's own clock/globaltimer ratio): stats (1: the block stats read and
the top-p total), cand (2: the candidate's two-level draw), kth (3: top-k first's lower
bound lo), list (4: the block list), gather (5), narrow (6: past the gather cap), cut (7:
the sort and cut, or the exact search), draw (8: kept masses and the fallback draw), end
(9: the stores), and the tail in all. A row that skips a phase (ties, greedy) counts its
time in the next phase it reaches. CUDA only; the clocks' barriers add a little to each.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import ints, versions  # noqa: E402
from sampler_shapes import TEMPERATURE, TOP_K, TOP_P, make_logits  # noqa: E402
from sampler_timing import Timer  # noqa: E402

PHASES = ["stats", "cand", "kth", "list", "gather", "narrow", "cut", "draw", "end"]


def phase_us(clock: torch.Tensor) -> tuple[list[list[float]], list[float]]:
    """Per row: each phase's µs (PHASES order; 0 where skipped) and the tail's µs, from W.clock
    rows [B, 16] (stamps 0..9, globaltimer at 14, 15)."""
    phases, totals = [], []
    for c in clock.tolist():
        if c[0] == 0 or c[9] <= c[0]:
            continue
        ns_per_cycle = (c[15] - c[14]) / (c[9] - c[0])
        row, last = [0.0] * len(PHASES), c[0]
        for i in range(1, 10):
            if c[i] > 0:
                row[i - 1] = (c[i] - last) * ns_per_cycle / 1e3
                last = c[i]
        phases.append(row)
        totals.append((c[15] - c[14]) / 1e3)
    return phases, totals


def run_case(shape: str, B: int, V: int, variant, reps: int, timer: Timer,
             top_k: int = TOP_K) -> dict:
    from graphexec.params import SamplingParams
    from graphexec.sampling.tensors import SamplerOutput, SamplingTensors
    from graphexec.sampling.triton import launch
    from graphexec.sampling.triton.sampler_config import SamplerConfig, Workspace

    dev = timer.device
    cfg = SamplerConfig.gpu().replace(phase_clock=True, topk_programs=1)
    logits = make_logits(shape, B, V, torch.float32, dev, seed=1)
    params = [SamplingParams(temperature=TEMPERATURE, top_k=top_k, top_p=TOP_P, seed=i)
              for i in range(B)]  # fmt: skip
    table = SamplingTensors.from_params(params, V, dev)
    out = SamplerOutput.allocate(B, dev, None)
    ws = Workspace.allocate(B, V, dev, cfg)
    slots, pos = torch.arange(B, device=dev), torch.arange(B, device=dev)

    def call():
        launch.sample(logits, slots, pos, table, out, None, variant, config=cfg, workspace=ws)

    for _ in range(3):
        call()
    rows, totals = [], []
    for _ in range(reps):
        ws.clock.zero_()
        timer.prepare()
        call()
        torch.cuda.synchronize(dev)
        r, t = phase_us(ws.clock.cpu())
        rows += r
        totals += t
    med = [statistics.median(r[i] for r in rows) for i in range(len(PHASES))] if rows else []
    return {"shape": shape, "B": B, "V": V, "variant": variant.value, "top_k": top_k,
            "rows": len(rows),
            "phase_us": dict(zip(PHASES, med, strict=False)),
            "tail_us": statistics.median(totals) if totals else None}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--batch", type=ints, default=[1, 128])
    ap.add_argument("--vocab", type=ints, default=[128256, 151936])
    ap.add_argument("--shapes", default="peaked,randn3,flat,ties")
    ap.add_argument("--variant", default="top_k_top_p", choices=("top_k_top_p", "default"))
    ap.add_argument("--top-k", type=int, default=TOP_K, help="0: top-p rows (default: %(default)s)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--icache", default="both", choices=("cold", "warm", "hot", "both", "all"))
    ap.add_argument("--out", default=None, help="folder for sampler-phases-*.json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("sampler_phases.py needs CUDA (the clocks are PTX registers)")
    from graphexec.params import SamplerVariant

    dev = torch.device("cuda")
    modes = {"both": ("cold", "warm"), "all": ("cold", "warm", "hot")}.get(args.icache,
                                                                         (args.icache,))
    timers = {c: Timer(dev, quick=True, evict_icache=c == "cold", flush=c != "hot")
              for c in modes}  # fmt: skip
    results = []
    head = "| V | B | shape | icache | " + " | ".join(PHASES) + " | tail |"
    print(head + "\n" + "|---" * (head.count("|") - 1) + "|")
    for V in args.vocab:
        for B in args.batch:
            for shape in args.shapes.split(","):
                for icache, timer in timers.items():
                    r = run_case(shape, B, V, SamplerVariant(args.variant), args.reps, timer,
                                 args.top_k)
                    r["icache"] = icache
                    results.append(r)
                    cells = " | ".join(f"{r['phase_us'].get(p, 0.0):.1f}" for p in PHASES)
                    tail, row = r["tail_us"], f"| {V} | {B} | {shape} | {icache} |"
                    print(f"{row} {cells} | {tail:.1f} |" if tail else f"{row} no clocks |",
                          flush=True)  # fmt: skip
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        meta = versions()
        path = os.path.join(args.out, f"sampler-phases-{args.variant}.json")
        with open(path, "w") as f:
            json.dump({**meta, "device": torch.cuda.get_device_name(), "cases": results}, f,
                      indent=1)  # fmt: skip
        print("wrote", path)


if __name__ == "__main__":
    main()
