#!/usr/bin/env python
"""Sampler benchmark: graphexec vs FlashInfer vs torch-native samplers, against the memory floor.

For every dtype x V x B x logits shape it times each method of `sampler_methods.py`
eagerly and as a CUDA-graph replay and writes `<out>/sampler-<gpu-slug>-<YYYY-MM-DD>.json`:

    {"device", "torch", "triton", "flashinfer", "date", "bandwidth_TBps", "runs",
     "rows": [{"method", "B", "V", "dtype", "shape", "eager_us", "graph_us", "floor_us"},
              ...], ...}

Shapes (`--shapes`, `sampler_methods.SHAPES`): "peaked" (-2 ln rank, as a real model's),
"randn3" (randn * 3), "flat" (randn * 0.25: top-p 0.9 and min-p 0.05 keep more than half
the vocabulary), "ties" (all equal). `--sweep` adds randn * s at temperature t for s in
0.3, 1, 3, 10 and t in 0.5, 1, 1.5, their rows' top-p mixed (0.5 to 0.99, per row) in
every method that takes one (`sampler_methods.SWEEP`). A sampler's time may depend on the
shape; the README's tables report each method's worst.

A row whose method failed has an "error" key and null timings; one method failing never
stops the run, and the JSON is rewritten after every (dtype, V, B) block, so an interrupted
run keeps what it measured. floor_us = B * V * bytes_per_element / copy bandwidth: the time
to read the logits once (bf16 logits: 2 bytes per element), with the bandwidth (bytes read +
written) of a 2 GiB device-to-device copy measured in the same run.

Every row uses per-row parameter tensors: temperature 0.8, top-k 50, top-p 0.9, min-p
0.05, a seed per row. The graphexec methods call `graphexec.sample_step` on preallocated
static buffers and a persistent workspace (one table slot per row, slot_ids = arange(B)),
exactly what the executor captures; backend "triton" on CUDA, "torch" on CPU.
FlashInfer's logits entry points cast bf16 logits to fp32 inside the call (timed).

Timing (CUDA): median over reps of CUDA-event time per call, a 256 MiB buffer written
before every call so the logits are never served from L2 (the floor assumes a read from
HBM), then a code-heavy kernel on every SM (`icache_evict.py`) so each call starts with
cold instruction caches, as it does after a model forward (`--warm-icache`: without it,
as runs before the last of 2026-11-25 were made; a large kernel timed back to back then
keeps its code warm and looks faster than it is in an engine). eager_us: the GPU is idle
when the call starts, so it includes the host's launch overhead. graph_us: the call is one
CUDAGraph.replay() enqueued behind the flush, so it is the GPU time of the captured
kernels (no graph-launch latency). On the CPU only eager
times are taken (perf_counter, no flush) and graph_us is null.

Splitting a sweep (each GPU command has a time limit): `--time-budget S` starts no new
(dtype, V, B) block after S seconds (it prints the skipped blocks; the JSON is still
written). `--append` loads the output JSON of the same name (same device, same date) and
keeps its rows, replacing those of the same (method, B, V, dtype); "runs" lists each
invocation (argv, bandwidth, versions, skipped blocks): a row's floor_us is from its own
run. `--resume` (implies --append) also skips blocks that already have a row for every
selected method (a failed row counts too).

FlashInfer JIT: the first call of a FlashInfer method builds its module (sampling about
80 s, cake_sampling about 300 s on a fresh host; see ../shared/gpu/README.md for prebuilt
modules). That time is not in any row; it is recorded in "first_call_s". `--jit-only`
builds them and exits, so the timed run can go in a separate command.

    python benchmarks/bench_sampler.py                       # default sweep (fp32)
    python benchmarks/bench_sampler.py --time-budget 420 --resume   # continue a sweep
    python benchmarks/bench_sampler.py --dtypes bfloat16 --methods flashinfer,torch
    python benchmarks/bench_sampler.py --device cpu --batch 1,8 --vocab 1000 --quick \\
        --methods torch,graphexec --out /tmp/benchout        # CPU smoke run
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import statistics
import sys
import time

import torch
from sampler_methods import (
    METHODS,
    MIN_P,
    NUM_LOGPROBS,
    SHAPES,
    SWEEP,
    TEMPERATURE,
    TOP_K,
    TOP_P,
    Case,
    Timer,
    blank_row,
    error_text,
    make_logits,
    run_method,
    select_methods,
)

COPY_BYTES = 1 << 30  # each way: a 2 GiB (read + write) copy
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# ----------------------------------------------------------------------------- driver


def measure_bandwidth(device: torch.device) -> float:
    """Copy bandwidth in bytes/s, counting bytes read + written."""
    n = COPY_BYTES if device.type == "cuda" else 64 << 20
    src = torch.empty(n, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(10):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize(device)
            start.record()
            dst.copy_(src)
            end.record()
            torch.cuda.synchronize(device)
            times.append(start.elapsed_time(end) * 1e-3)
        else:
            t0 = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t0)
    return 2 * n / statistics.median(times)


def versions() -> dict:
    info = {"torch": torch.__version__, "triton": None, "flashinfer": None}
    # the GPU host gets a copy of the tree without .git: the caller names the commit
    if os.environ.get("GRAPHEXEC_COMMIT"):
        info["commit"] = os.environ["GRAPHEXEC_COMMIT"]
    for mod in ("triton", "flashinfer"):
        try:
            info[mod] = __import__(mod).__version__
        except Exception as e:
            info[mod] = None
            info[f"{mod}_import_error"] = error_text(e)
    return info


def slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "device"


def ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def print_table(rows: list[dict]) -> None:
    head = f"{'method':36} {'dtype':8} {'shape':7} {'V':>7} {'B':>4} {'eager_us':>10}"
    print("\n" + head + f" {'graph_us':>10} {'floor_us':>9} {'graph/floor':>11}  error")
    for r in sorted(rows, key=lambda r: (r["dtype"], r["V"], r["method"], r.get("shape", ""),
                                         r["B"])):  # fmt: skip

        def f(v, w):
            return f"{v:>{w}.1f}" if isinstance(v, (int, float)) else f"{'-':>{w}}"

        t = r["graph_us"] if r["graph_us"] is not None else None
        ratio = t / r["floor_us"] if t is not None and r["floor_us"] else None
        err = (r.get("error") or r.get("warning") or "")[:60]
        print(
            f"{r['method']:36} {r['dtype']:8} {r.get('shape', '-'):7} {r['V']:>7} {r['B']:>4} "
            f"{f(r['eager_us'], 10)} {f(r['graph_us'], 10)} {f(r['floor_us'], 9)} "
            f"{f(ratio, 11)}  {err}"
        )


def results_path(out: str, device_name: str, date: str) -> str:
    return os.path.join(out, f"sampler-{slug(device_name)}-{date}.json")


def row_key(r: dict) -> tuple:
    return (r["method"], r["B"], r["V"], r["dtype"], r.get("shape"))


def load_previous(path: str) -> dict | None:
    """The results JSON at path for --append, or None (with a note) when there is none."""
    if os.path.exists(path):
        with open(path) as f:
            old = json.load(f)
        print(f"--append: extending {path} ({len(old['rows'])} rows)", flush=True)
        return old
    folder = os.path.dirname(path) or "."
    names = os.listdir(folder) if os.path.isdir(folder) else []
    kind = os.path.basename(path).split("-", 1)[0] + "-"  # sampler- / verify-
    others = sorted(f for f in names if f.startswith(kind) and f.endswith(".json"))
    print(
        f"--append: no {path}; starting a new file"
        + (f" (not merged, another device or date: {', '.join(others)})" if others else ""),
        flush=True,
    )
    return None


def resolve_device(name: str) -> torch.device:
    """--device as a device with its index (a bare "cuda" is the current one, made so)."""
    device = torch.device(name)
    if device.type == "cuda":
        if device.index is not None:
            torch.cuda.set_device(device)
        device = torch.device("cuda", torch.cuda.current_device())
    return device


CPU_NOTE = ("note: CPU timings are not performance numbers (eager calls of the torch backend "
            "or the Triton interpreter: a smoke run of the script); benchmark on CUDA")  # fmt: skip


def write_results(path: str, result: dict, rows: dict, first_call: dict, old: dict | None):
    """The results JSON: `result` with `rows` (by row key, in file order) and the first
    calls' times (an --append run keeps the earlier run's for methods it did not time)."""
    result["first_call_s"] = {**(old or {}).get("first_call_s", {}), **first_call}
    result["rows"] = list(rows.values())
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)


def run_summary(r: dict) -> dict:
    keys = ("argv", "date", "bandwidth_TBps", "torch", "triton", "flashinfer", "gx_backend",
            "icache")  # fmt: skip
    return {k: r.get(k) for k in keys}


def describe_blocks(blocks: list[tuple[str, int, int]]) -> str:
    """(dtype, V, B) blocks as "float32 V=151936 B=128,256; ..."."""
    by: dict[tuple[str, int], list[int]] = {}
    for d, V, B in blocks:
        by.setdefault((d, V), [])
        if B not in by[(d, V)]:
            by[(d, V)].append(B)
    return "; ".join(f"{d} V={V} B={','.join(map(str, bs))}" for (d, V), bs in by.items())


def time_block(methods, dname, shape, B, V, device, bw, timer, first_call, backend) -> list:
    """One row per method on [B, V] logits of one shape and dtype."""
    try:
        logits = make_logits(shape, B, V, DTYPES[dname], device, seed=B * 7 + V)
    except Exception as e:  # out of memory: record and go on
        return [dict(blank_row(m, B, V, dname), shape=shape, error=error_text(e)) for m in methods]
    case = Case(logits, B, V, device, backend, shape)
    floor = round(B * V * logits.element_size() / bw * 1e6, 3)
    block = []
    for m in methods:
        row = run_method(m, case, timer, first_call)
        row["shape"] = shape
        row["floor_us"] = floor
        block.append(row)
        print(
            f"{m:36} {dname:8} {shape:7} V={V:<7} B={B:<4} eager {row['eager_us']} us  "
            f"graph {row['graph_us']} us  floor {row['floor_us']} us"
            + (f"  ERROR {row['error']}" if "error" in row else ""),
            flush=True,
        )
    return block


def main(argv: list[str] | None = None) -> int:
    t_start = time.monotonic()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    ap.add_argument("--batch", type=ints, default=[1, 8, 32, 128, 256])
    ap.add_argument("--vocab", type=ints, default=[128256, 151936])
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"comma list of {list(SHAPES)}")
    ap.add_argument(
        "--sweep", action="store_true", help=f"also time the sweep shapes: {', '.join(SWEEP)}"
    )
    ap.add_argument("--methods", default=None, help="comma list of names or substrings")
    ap.add_argument("--dtypes", default="float32", help=f"comma list of {list(DTYPES)}")
    ap.add_argument("--quick", action="store_true", help="fewer repetitions")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument(
        "--gx-backend",
        default=None,
        help="sample_step backend of the graphexec.* methods (default: triton on CUDA, torch on "
        "CPU; triton on CPU needs TRITON_INTERPRET=1)",
    )
    ap.add_argument(
        "--jit-only",
        action="store_true",
        help="call each selected method once at B=1 (builds FlashInfer JIT modules)",
    )
    ap.add_argument(
        "--append",
        action="store_true",
        help="keep the rows of an existing output JSON of the same name; replace those of the "
        "same (method, B, V, dtype)",
    )
    ap.add_argument(
        "--resume",
        action="store_true",
        help="--append, and skip (dtype, V, B) blocks that already have a row for every "
        "selected method (failed rows count: rerun them without --resume)",
    )
    ap.add_argument(
        "--warm-icache",
        action="store_true",
        help="do not evict the instruction caches before each timed call (runs before "
        "2026-11-25's last one did not)",
    )
    ap.add_argument(
        "--time-budget",
        type=float,
        default=None,
        metavar="SECONDS",
        help="start no new (dtype, V, B) block after this many seconds (from the start)",
    )
    args = ap.parse_args(argv)
    device = resolve_device(args.device)
    if device.type != "cuda":
        print(CPU_NOTE, flush=True)
    methods = select_methods(args.methods)
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    for d in dtypes:
        if d not in DTYPES:
            raise SystemExit(f"--dtypes: {d!r} is not one of {list(DTYPES)}")
    shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    for s in shapes:
        if s not in SHAPES and s not in SWEEP:
            raise SystemExit(f"--shapes: {s!r} is not one of {list(SHAPES) + list(SWEEP)}")
    if args.sweep:
        shapes += [s for s in SWEEP if s not in shapes]
    if args.jit_only:
        args.batch, args.vocab, dtypes, args.quick = [1], args.vocab[:1], dtypes[:1], True
        shapes = shapes[:1]
        args.append = args.resume = False
    timer = Timer(device, args.quick, evict_icache=not args.warm_icache)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    bw = measure_bandwidth(device)
    print(f"{name}: copy bandwidth {bw / 1e12:.3f} TB/s (read + write)", flush=True)
    today = datetime.date.today().isoformat()
    result = {
        "device": name,
        **versions(),
        "date": today,
        "bandwidth_TBps": round(bw / 1e12, 4),
        "cuda": torch.version.cuda,
        "timing": "median us per call; CUDA: events, 256 MiB L2 flush before each call"
        + (" and the SMs' instruction caches evicted" if timer.evict is not None else "")
        + "; eager from an idle GPU (includes launch overhead); graph = GPU time of one "
        "replay; CPU: perf_counter, eager only",
        "icache": None if not timer.cuda else "evicted" if timer.evict is not None else "warm",
        "params": dict(
            temperature=TEMPERATURE,
            top_k=TOP_K,
            top_p=TOP_P,
            min_p=MIN_P,
            logprobs=NUM_LOGPROBS,
            shapes={s: SHAPES.get(s) or SWEEP[s] for s in shapes},
        ),
        "methods": {m: METHODS[m] for m in methods},
        "first_call_s": {},
        "argv": sys.argv[1:] if argv is None else list(argv),
        "gx_backend": args.gx_backend or ("triton" if device.type == "cuda" else "torch"),
        "runs": [],
        "rows": [],
    }
    path = results_path(args.out, name, today)
    this_run = dict(run_summary(result), started=datetime.datetime.now().isoformat("T", "seconds"))
    this_run["skipped"] = skipped = []
    rows: dict[tuple, dict] = {}  # by row_key, in file order; new rows replace old in place
    first_call: dict[str, float] = {}
    old = load_previous(path) if args.append or args.resume else None
    if old is not None:
        rows = {row_key(r): r for r in old["rows"]}
        result["methods"] = {**old.get("methods", {}), **result["methods"]}
        result["runs"] = old.get("runs") or [run_summary(old)]
    result["runs"].append(this_run)

    def write() -> None:
        write_results(path, result, rows, first_call, old)

    new_rows, done = [], []
    for dname in dtypes:
        for V in args.vocab:
            for B in args.batch:
                if args.resume and all((m, B, V, dname, s) in rows for m in methods
                                       for s in shapes):  # fmt: skip
                    done.append((dname, V, B))
                    continue
                if args.time_budget is not None and time.monotonic() - t_start > args.time_budget:
                    skipped.append((dname, V, B))
                    continue
                block = []
                for shape in shapes:
                    block += time_block(methods, dname, shape, B, V, device, bw, timer,
                                        first_call, result["gx_backend"])  # fmt: skip
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                new_rows += block
                rows.update((row_key(r), r) for r in block)
                if not args.jit_only:
                    write()
    if args.jit_only:
        print("first-call seconds:", json.dumps(first_call))
        return 0
    write()
    print_table(new_rows)
    if done:
        print(f"\n--resume: {len(done)} blocks already in the file: {describe_blocks(done)}")
    if skipped:
        print(
            f"\ntime budget ({args.time_budget:g} s) spent: skipped {len(skipped)} blocks: "
            f"{describe_blocks(skipped)}"
        )
    print(f"\nwrote {path} ({len(new_rows)} rows measured now, {len(rows)} in the file)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
