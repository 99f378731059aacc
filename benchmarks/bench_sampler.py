#!/usr/bin/env python
"""Sampler benchmark: graphexec vs FlashInfer vs torch-native samplers, against a measured
read floor.

For every dtype x V x B x logits shape it times each method of `sampler_methods.py`
eagerly and as a CUDA-graph replay and writes `<out>/sampler-<gpu-slug>-<YYYY-MM-DD>.json`:

    {"device", "torch", "triton", "flashinfer", "date", "bandwidth_TBps", "runs",
     "rows": [{"method", "B", "V", "dtype", "shape", "eager_us", "graph_us", "read_floor_us",
               "floor_us"}, ...], ...}

The default grid is the sampler issue's: fp32 and bf16 logits, V in {128256, 151936}, B in
{1, 32, 128, 256}, the SHAPES below, and the real rows at V = 49152; `--sweep` adds the
sweep shapes. Shapes (`--shapes`, `sampler_shapes.py`): "peaked" (-2 ln rank, as a real
model's), "randn3" (randn * 3), "flat" (randn * 0.25: top-p 0.9 and min-p 0.05 keep more
than half the vocabulary), "ties" (all equal). `--sweep` adds randn * s at temperature t for
s in 0.3, 1, 3, 10 and t in 0.5, 1, 1.5, their rows' top-p mixed (0.5 to 0.99, per row) in
every method that takes one. `--real` adds blocks at V = 49152 of shape "real": rows of
SmolLM2-135M-Instruct's logits (`data/smollm2-logits.pt`, `real_logits.py`); it is on by
default when neither --vocab nor --shapes is given (and whenever --shapes names "real"),
`--no-real` turns it off. A sampler's time may depend on the shape; the tables report
each method's worst.

The floor. `floor.read` (always timed, first in each (dtype, V, B) block, on the block's
first shape) is a kernel that reads every logit once and writes each row's max
(`floor_kernel.py`), timed exactly as the samplers are. Every row of the block gets
read_floor_us: its graph_us (a CPU run: its eager_us). floor_us = B * V * bytes per
element / copy bandwidth (the bandwidth, bytes read + written, of a 2 GiB device-to-device
copy measured in the same run) stays as a column: the estimate the read floor replaces.

Every sampler uses per-row parameter tensors: temperature 0.8, top-k 50, top-p 0.9, min-p
0.05, a seed per row. The graphexec methods call `graphexec.sample_step` on preallocated
static buffers and a persistent workspace (one table slot per row, slot_ids = arange(B)),
exactly what the executor captures; backend "triton" on CUDA, "torch" on CPU.
FlashInfer's logits entry points cast bf16 logits to fp32 inside the call (timed).

Timing (CUDA, every method, floor.read included; `sampler_timing.Timer`): median over reps
of CUDA-event time per call. Before every call a code-heavy kernel runs on every SM
(`icache_evict.py`; `--warm-icache` skips it), so each call starts with cold instruction
caches as after a model forward; then the L2 is flushed by reading a 256 MiB buffer (no
writes: the call starts with its logits out of L2 and no dirty lines for it to write back;
runs before this change wrote the buffer, so each call first paid that write-back).
eager_us: the GPU is idle when the call starts, so it includes the host's launch overhead.
graph_us: one CUDAGraph.replay() enqueued behind the flush, the GPU time of the captured
kernels (no graph-launch latency). On the CPU only eager times are taken (perf_counter, no
flush) and graph_us is null.

A row whose method failed has an "error" key and null timings; one method failing never
stops the run, and the JSON is rewritten after every (dtype, V, B) block, so an interrupted
run keeps what it measured. Splitting a sweep (each GPU command has a time limit):
`--time-budget S` starts no new block after S seconds (it prints the skipped blocks; the
JSON is still written). `--append` loads the output JSON of the same name (same device,
same date) and keeps its rows, replacing those of the same (method, B, V, dtype, shape);
"runs" lists each invocation (argv, bandwidth, versions, skipped blocks): a row's floors are
from its own run. `--resume` (implies --append) also skips blocks that already have a row
for every selected method and shape (a failed row counts too).

`--profile` (CUDA): each graphexec row also gets `kernels`, its sampler kernels' times
in one replay (name, us, own us: what each adds to the timeline; medians of 5 replays,
each prepared as a timed call), from torch.profiler (`step_profile.kernel_spans`).

`--sampler-config K=V,...` (Triton): the graphexec rows run with those SamplerConfig
fields instead of the GPU preset's (tile_blocks, programs, num_warps, ...: knobs that
never change a token; draw_block is refused), recorded as "sampler_config"; one file per
setting (`--out`), to tune a knob before the preset takes it.

FlashInfer JIT: the first call of a FlashInfer method builds its module (sampling about
80 s, cake_sampling about 300 s on a fresh host; see ../shared/gpu/README.md for prebuilt
modules). That time is not in any row; it is recorded in "first_call_s". `--jit-only`
builds them and exits, so the timed run can go in a separate command.

    python benchmarks/bench_sampler.py --sweep                  # the issue's grid (+ real)
    python benchmarks/bench_sampler.py --sweep --time-budget 420 --resume   # continue it
    python benchmarks/bench_sampler.py --quick --batch 1,256 --dtypes float32   # quick look
    python benchmarks/bench_sampler.py --dtypes bfloat16 --methods flashinfer,torch
    python benchmarks/bench_sampler.py --device cpu --batch 1,8 --vocab 1000 --quick \\
        --methods torch,graphexec --out /tmp/benchout        # CPU smoke run
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

import torch
from bench_common import (
    CPU_NOTE,
    DTYPES,
    ints,
    load_previous,
    measure_bandwidth,
    resolve_device,
    slug,
    versions,
    write_results,
)
from sampler_methods import (
    FLOOR,
    METHODS,
    MIN_P,
    NUM_LOGPROBS,
    REAL,
    REAL_V,
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
from sampler_timing import FLUSH_DESCRIPTION

DEFAULT_BATCH, DEFAULT_VOCAB = [1, 32, 128, 256], [128256, 151936]
DEFAULT_DTYPES = "float32,bfloat16"
ALL_SHAPES = {**SHAPES, **SWEEP, **REAL}


def print_table(rows: list[dict]) -> None:
    head = f"{'method':36} {'dtype':8} {'shape':10} {'V':>7} {'B':>4} {'eager_us':>10}"
    print("\n" + head + f" {'graph_us':>10} {'read_floor':>10} {'x floor':>7} {'floor_us':>9}"
          "  error")  # fmt: skip
    for r in sorted(rows, key=lambda r: (r["dtype"], r["V"], r["method"], r.get("shape", ""),
                                         r["B"])):  # fmt: skip

        def f(v, w):
            return f"{v:>{w}.1f}" if isinstance(v, (int, float)) else f"{'-':>{w}}"

        t = r["graph_us"] if r["graph_us"] is not None else r["eager_us"]
        fl = r.get("read_floor_us")
        ratio = t / fl if t is not None and fl else None
        err = (r.get("error") or r.get("warning") or "")[:60]
        print(
            f"{r['method']:36} {r['dtype']:8} {r.get('shape', '-'):10} {r['V']:>7} {r['B']:>4} "
            f"{f(r['eager_us'], 10)} {f(r['graph_us'], 10)} {f(fl, 10)} {f(ratio, 7)} "
            f"{f(r['floor_us'], 9)}  {err}"
        )


def results_path(out: str, device_name: str, date: str) -> str:
    return os.path.join(out, f"sampler-{slug(device_name)}-{date}.json")


def row_key(r: dict) -> tuple:
    return (r["method"], r["B"], r["V"], r["dtype"], r.get("shape"))


def sampler_config(text: str) -> dict:
    """--sampler-config "k=v,k=v": SamplerConfig field overrides (ints, or true / false),
    checked by building the config, so a bad name or value is an error naming it."""
    from graphexec.sampling.triton.sampler_config import SamplerConfig

    out: dict = {}
    for item in filter(None, (x.strip() for x in text.split(","))):
        k, eq, v = item.partition("=")
        if not eq:
            raise argparse.ArgumentTypeError(f"{item!r} is not K=V")
        low = v.strip().lower()
        try:
            out[k.strip()] = low == "true" if low in ("true", "false") else int(v)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{k}: {v!r} is not an int or true/false") from None
    if "draw_block" in out:
        raise argparse.ArgumentTypeError("draw_block is part of the tokens' definition, not a "
                                         "knob")  # fmt: skip
    try:
        SamplerConfig.gpu().replace(**out)
    except (TypeError, ValueError) as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return out


def run_summary(r: dict) -> dict:
    keys = ("argv", "date", "bandwidth_TBps", "torch", "triton", "flashinfer", "gx_backend",
            "icache", "sampler_config")  # fmt: skip
    return {k: r.get(k) for k in keys}


def describe_blocks(blocks: list[tuple[str, int, int]]) -> str:
    """(dtype, V, B) blocks as "float32 V=151936 B=128,256; ..."."""
    by: dict[tuple[str, int], list[int]] = {}
    for d, V, B in blocks:
        by.setdefault((d, V), [])
        if B not in by[(d, V)]:
            by[(d, V)].append(B)
    return "; ".join(f"{d} V={V} B={','.join(map(str, bs))}" for (d, V), bs in by.items())


def plan_blocks(dtypes, vocab, batches, shapes, real: bool) -> list[tuple[str, int, int, list]]:
    """(dtype, V, B, shapes) per block: the synthetic shapes at every V of `vocab`, and
    with `real` the real rows at REAL_V (beside them when REAL_V is in `vocab`)."""
    per_v = {V: [s for s in shapes if s not in REAL] for V in vocab}
    if real:
        per_v.setdefault(REAL_V, []).extend(REAL)
    return [(d, V, B, ss) for d in dtypes for V, ss in per_v.items() if ss for B in batches]


def block_done(rows: dict, methods: list[str], d: str, V: int, B: int, shapes: list) -> bool:
    """--resume: every method has a row for every shape (floor.read: for one shape)."""
    floor = FLOOR not in methods or any(k[:4] == (FLOOR, B, V, d) for k in rows)
    return floor and all((m, B, V, d, s) in rows for m in methods if m != FLOOR for s in shapes)


def _report(row: dict, dname: str, shape: str, V: int, B: int) -> None:
    print(
        f"{row['method']:36} {dname:8} {shape:10} V={V:<7} B={B:<4} eager {row['eager_us']} us"
        f"  graph {row['graph_us']} us  read floor {row.get('read_floor_us')} us"
        + (f"  ERROR {row['error']}" if "error" in row else ""),
        flush=True,
    )
    if row.get("kernels"):
        print("    own us: " + ", ".join(f"{k['name']} {k['own_us']}" for k in row["kernels"]),
              flush=True)  # fmt: skip


def time_block(methods, dname, shapes, B, V, device, bw, timer, first_call, backend,
               profile: bool = False, sampler_config: dict | None = None) -> list:  # fmt: skip
    """One row per method and shape on [B, V] logits of one dtype; floor.read once, first,
    on the first shape whose logits could be made: its time is each row's read_floor_us.
    `profile`: the graphexec rows' kernels too (`sampler_methods.profile_kernels`);
    `sampler_config`: SamplerConfig fields the Triton rows take instead of the preset's."""
    block, read_floor, floor_done = [], None, FLOOR not in methods
    for i, shape in enumerate(shapes):
        try:
            logits = make_logits(shape, B, V, DTYPES[dname], device, seed=B * 7 + V)
        except Exception as e:  # out of memory, no real rows: record and go on
            last = i == len(shapes) - 1
            block += [dict(blank_row(m, B, V, dname), shape=shape, error=error_text(e))
                      for m in methods if m != FLOOR or (last and not floor_done)]  # fmt: skip
            continue
        case = Case(logits, B, V, device, backend, shape, dict(sampler_config or {}))
        floor = round(B * V * logits.element_size() / bw * 1e6, 3)
        for m in methods:
            if m == FLOOR and floor_done:
                continue  # once per block: reading does not depend on the values
            row = run_method(m, case, timer, first_call, profile)
            row["shape"] = shape
            if m == FLOOR:
                read_floor = row["graph_us"] if timer.cuda else row["eager_us"]
                floor_done = True
            row["read_floor_us"] = read_floor
            row["floor_us"] = floor
            block.append(row)
            _report(row, dname, shape, V, B)
        del case, logits
    return block


def main(argv: list[str] | None = None) -> int:
    t_start = time.monotonic()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    ap.add_argument("--batch", type=ints, default=DEFAULT_BATCH, help="default: %(default)s")
    ap.add_argument("--vocab", type=ints, default=None, help=f"default: {DEFAULT_VOCAB}")
    ap.add_argument("--shapes", default=None, help=f"comma list of {[*SHAPES, *SWEEP, *REAL]} "
                    f"(default: {','.join(SHAPES)})")  # fmt: skip
    ap.add_argument(
        "--sweep", action="store_true", help=f"also time the sweep shapes: {', '.join(SWEEP)}"
    )
    ap.add_argument(
        "--real",
        action=argparse.BooleanOptionalAction,
        default=None,
        help=f"also time the real rows (shape 'real') at V = {REAL_V} (default: on when "
        "neither --vocab nor --shapes is given, or --shapes names 'real')",
    )
    ap.add_argument("--methods", default=None, help="comma list of names or substrings "
                    f"({FLOOR} is always timed)")  # fmt: skip
    ap.add_argument("--dtypes", default=DEFAULT_DTYPES, help=f"comma list of {list(DTYPES)}")
    ap.add_argument("--quick", action="store_true", help="fewer repetitions")
    ap.add_argument("--profile", action="store_true",
                    help="CUDA: each graphexec row also lists its kernels' times (`kernels`: "
                    "name, us, own us; each replay prepared as a timed call)")  # fmt: skip
    ap.add_argument("--sampler-config", type=sampler_config, default={}, metavar="K=V,...",
                    help="SamplerConfig fields for the graphexec rows on the Triton backend, "
                    "e.g. tile_blocks=4,num_warps=8 (knobs: never a token); recorded")  # fmt: skip
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
        "same (method, B, V, dtype, shape)",
    )
    ap.add_argument(
        "--resume",
        action="store_true",
        help="--append, and skip (dtype, V, B) blocks that already have a row for every "
        "selected method and shape (failed rows count: rerun them without --resume)",
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
    methods = [FLOOR, *(m for m in select_methods(args.methods) if m != FLOOR)]
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    for d in dtypes:
        if d not in DTYPES:
            raise SystemExit(f"--dtypes: {d!r} is not one of {list(DTYPES)}")
    shapes = [s.strip() for s in (args.shapes or ",".join(SHAPES)).split(",") if s.strip()]
    for s in shapes:
        if s not in SHAPES and s not in SWEEP and s not in REAL:
            raise SystemExit(f"--shapes: {s!r} is not one of {[*SHAPES, *SWEEP, *REAL]}")
    if args.sweep:
        shapes += [s for s in SWEEP if s not in shapes]
    real = args.real if args.real is not None else (
        "real" in shapes or (args.vocab is None and args.shapes is None))  # fmt: skip
    shapes = [s for s in shapes if s not in REAL]
    vocab = args.vocab if args.vocab is not None else DEFAULT_VOCAB
    if args.jit_only:
        args.batch, vocab, dtypes, args.quick = [1], vocab[:1], dtypes[:1], True
        shapes, real = (shapes or list(SHAPES))[:1], False
        args.append = args.resume = False
    blocks = plan_blocks(dtypes, vocab, args.batch, shapes, real)
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
        "timing": f"median us per call; CUDA: events, {FLUSH_DESCRIPTION}"
        + (", the SMs' instruction caches evicted before it" if timer.evict is not None else "")
        + "; eager from an idle GPU (includes launch overhead); graph = GPU time of one "
        f"replay; read_floor_us = {FLOOR} timed the same way (graph_us; CPU: eager_us); "
        "floor_us = bytes / copy bandwidth; CPU: perf_counter, eager only",
        "flush": FLUSH_DESCRIPTION if timer.cuda else None,
        "icache": None if not timer.cuda else "evicted" if timer.evict is not None else "warm",
        "params": dict(
            temperature=TEMPERATURE,
            top_k=TOP_K,
            top_p=TOP_P,
            min_p=MIN_P,
            logprobs=NUM_LOGPROBS,
            shapes={s: ALL_SHAPES[s] for s in dict.fromkeys(s for b in blocks for s in b[3])},
        ),
        "methods": {m: METHODS[m] for m in methods},
        "first_call_s": {},
        "argv": sys.argv[1:] if argv is None else list(argv),
        "gx_backend": args.gx_backend or ("triton" if device.type == "cuda" else "torch"),
        "sampler_config": args.sampler_config,
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
    for dname, V, B, block_shapes in blocks:
        if args.resume and block_done(rows, methods, dname, V, B, block_shapes):
            done.append((dname, V, B))
            continue
        if args.time_budget is not None and time.monotonic() - t_start > args.time_budget:
            skipped.append((dname, V, B))
            continue
        block = time_block(methods, dname, block_shapes, B, V, device, bw, timer, first_call,
                           result["gx_backend"], args.profile, args.sampler_config)  # fmt: skip
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
