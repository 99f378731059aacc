#!/usr/bin/env python
"""Verification benchmark: graphexec's strict verify_step vs its own sample_step over the
same rows, FlashInfer's chain speculative sampling and a torch rejection sampler.

For every V x B x K x parameter table x logits shape it times each method of
`verify_methods.py` as a CUDA-graph replay and writes
`<out>/verify-<gpu-slug>-<YYYY-MM-DD>.json`:

    {"device", "torch", "triton", "flashinfer", "date", "bandwidth_TBps", "runs",
     "rows": [{"method", "variant", "B", "K", "V", "shape", "us", "floor_us", "emitted"},
              ...], ...}

Every method gets the same fp32 target logits [B, K+1, V] (a `sampler_methods.SHAPES`
shape over the B*(K+1) rows) and the same drafts: the argmax of the target logits at each
draft offset (a drafter that is often right; with one-hot q, strict and rejection accept a
draft with the same probability p(d), so "emitted", the mean tokens per row of the graph's
output, should agree between the verify methods). Parameter tables (`--variants`,
`verify_methods.TABLES`): "top_k_top_p" (temperature 0.7..1.0 with top-k 50 + top-p 0.9 /
top-k 200 + top-p 0.9 / top-k 50 by row) and "no_filter" (temperature only); a seed per row.

    graphexec.verify_strict    verify_step(method="strict"), static buffers, persistent
                               workspace of B*(K+1) rows (backend triton on CUDA)
    graphexec.sample_step      sample_step over the same B*(K+1) rows: the target is
                               verify_strict <= 1.3x this
    flashinfer.chain           softmax(logits / T) [+ top_k_renorm_probs + top_p_renorm_probs
                               for top_k_top_p] + chain_speculative_sampling with one-hot
                               draft_probs [B, K, V] given (as a draft model's; not timed)
    flashinfer.chain+onehot    the same, the one-hot draft_probs built in the call
    torch.rejection            vLLM-style torch rejection sampler (one-hot q implicit)

Timing (CUDA): each call is captured once in a CUDA graph over static buffers and replayed;
us is the median of CUDA-event times per replay, each after (unless --warm-icache) an
instruction-cache eviction and a 256 MiB L2 flush by reading (no dirty lines left for the
call to write back), as in bench_sampler.py (`sampler_timing.Timer`). floor_us = B * (K+1)
* V * 4 / copy bandwidth measured in the same run: one read of the logits. On the CPU
(a smoke run) us is the median eager perf_counter time and FlashInfer rows are errors.

A method that fails gets a row with "error" and null us; the run goes on, and the JSON is
rewritten after every (V, B, K) block. A sticky CUDA error (an illegal memory access ends
the process's context) is noticed after its block: the script then replaces itself by a
fresh process with --resume (at most 5 times), which skips the blocks already in the file.

The table printed last (`plot_verify.summary_table`, over every row in the file) gives, per
(variant, V, B, K), each method's worst-shape time, verify_strict / sample_step (the
largest over shapes; target <= 1.3) and FlashInfer / graphexec (flashinfer.chain /
verify_strict, the smallest over shapes). The plot (`<same name>.png`) needs matplotlib;
without it the run says so and goes on.

    python benchmarks/bench_verify.py                      # full grid; peaked, randn3, flat
    python benchmarks/bench_verify.py --quick              # B 1,256, K 3, V 151936
    python benchmarks/bench_verify.py --time-budget 420     # then again with --resume
    python benchmarks/bench_verify.py --device cpu --batch 1,2 --k 1,3 --vocab 1000 \\
        --shapes randn3 --methods torch,graphexec --out /tmp/benchout   # CPU smoke run
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time

import torch
from bench_common import (
    CPU_NOTE,
    ints,
    load_previous,
    measure_bandwidth,
    resolve_device,
    slug,
    versions,
    write_results,
)
from plot_verify import summary_table
from sampler_methods import SHAPES, Timer, error_text, make_logits
from sampler_timing import FLUSH_DESCRIPTION
from verify_methods import (
    METHODS,
    TABLES,
    VerifyCase,
    blank_row,
    run_method,
    select_methods,
)

FULL = dict(batch=[1, 32, 128, 256], k=[1, 3, 5], vocab=[128256, 151936],
            shapes=["peaked", "randn3", "flat"])  # fmt: skip
QUICK = dict(batch=[1, 256], k=[3], vocab=[151936], shapes=["peaked", "randn3"])
RESTARTS_ENV, T0_ENV, MAX_RESTARTS = "BENCH_VERIFY_RESTARTS", "BENCH_VERIFY_T0", 5


def row_key(r: dict) -> tuple:
    return (r["method"], r["variant"], r["B"], r["K"], r["V"], r["shape"])


def results_path(out: str, device_name: str, date: str) -> str:
    return os.path.join(out, f"verify-{slug(device_name)}-{date}.json")


def make_case(shape: str, B: int, K: int, V: int, table: str, device, backend) -> VerifyCase:
    """Static [B, K+1, V] fp32 logits of one shape; drafts = argmax at each draft offset."""
    T = K + 1
    logits = make_logits(shape, B * T, V, torch.float32, device, seed=B * 7 + V + K).view(B, T, V)
    drafts = logits[:, :K].argmax(dim=-1).contiguous()
    return VerifyCase(logits, drafts, table, device, backend)


def time_block(methods, tables, shapes, B, K, V, device, bw, timer, first_call, backend):
    floor = round(B * (K + 1) * V * 4 / bw * 1e6, 3)
    block = []
    for shape in shapes:
        try:
            cases = {t: make_case(shape, B, K, V, t, device, backend) for t in tables}
        except Exception as e:  # out of memory: record and go on
            block += [dict(blank_row(m, t, B, K, V, shape), error=error_text(e))
                      for t in tables for m in methods]  # fmt: skip
            continue
        for t in tables:
            for m in methods:
                row = run_method(m, cases[t], timer, first_call, shape)
                row["floor_us"] = floor
                block.append(row)
                print(
                    f"{m:26} {t:11} {shape:7} V={V:<7} B={B:<4} K={K}  {row['us']} us  "
                    f"floor {floor} us  emitted {row['emitted']}"
                    + (f"  ERROR {row['error']}" if "error" in row else "")
                    + (f"  WARNING {row['warning']}" if "warning" in row else ""),
                    flush=True,
                )
        del cases
        if device.type == "cuda":
            try:
                torch.cuda.empty_cache()
            except Exception:  # a sticky CUDA error: main() notices it after the block
                pass
    return block


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    ap.add_argument("--batch", type=ints, default=None, help=f"default {FULL['batch']}")
    ap.add_argument("--k", type=ints, default=None, help=f"drafts per row, default {FULL['k']}")
    ap.add_argument("--vocab", type=ints, default=None, help=f"default {FULL['vocab']}")
    ap.add_argument("--shapes", default=None,
                    help=f"comma list of {list(SHAPES)}; default {FULL['shapes']}")  # fmt: skip
    ap.add_argument("--variants", default=",".join(TABLES), help=f"comma list of {list(TABLES)}")
    ap.add_argument("--methods", default=None, help="comma list of names or substrings")
    ap.add_argument("--quick", action="store_true",
                    help=f"a small grid ({QUICK}) and fewer repetitions; explicit --batch / "
                    "--k / --vocab / --shapes still win")  # fmt: skip
    ap.add_argument("--reps", type=int, default=None,
                    help="timed replays per row (default: as many as fit in 0.15 s, "
                    "10..200)")  # fmt: skip
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--gx-backend", default=None,
                    help="graphexec backend (default: triton on CUDA, torch on CPU; triton on "
                    "CPU needs TRITON_INTERPRET=1)")  # fmt: skip
    ap.add_argument("--warm-icache", action="store_true",
                    help="do not evict the instruction caches before each timed call")  # fmt: skip
    ap.add_argument("--append", action="store_true",
                    help="keep the rows of an existing output JSON of the same name; replace "
                    "those of the same (method, variant, B, K, V, shape)")  # fmt: skip
    ap.add_argument("--resume", action="store_true",
                    help="--append, and skip (V, B, K) blocks that already have a row for "
                    "every selected method, variant and shape (failed rows count)")  # fmt: skip
    ap.add_argument("--time-budget", type=float, default=None, metavar="SECONDS",
                    help="start no new (V, B, K) block after this many seconds (counted from "
                    "the first start when the run restarts itself)")  # fmt: skip
    ap.add_argument("--no-png", action="store_true", help="do not plot")
    args = ap.parse_args(argv)
    grid = QUICK if args.quick else FULL
    for key in ("batch", "k", "vocab"):
        if getattr(args, key) is None:
            setattr(args, key, list(grid[key]))
    args.shapes = [s.strip() for s in args.shapes.split(",") if s.strip()] if args.shapes \
        else list(grid["shapes"])  # fmt: skip
    for s in args.shapes:
        if s not in SHAPES:
            raise SystemExit(f"--shapes: {s!r} is not one of {list(SHAPES)}")
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    for v in args.variants:
        if v not in TABLES:
            raise SystemExit(f"--variants: {v!r} is not one of {list(TABLES)}")
    if any(k < 1 for k in args.k):
        raise SystemExit("--k: every K must be >= 1")
    args.append = args.append or args.resume
    return args


def cuda_poisoned(device: torch.device) -> bool:
    """Whether the CUDA context has a sticky error (every later call would fail)."""
    try:
        torch.cuda.synchronize(device)
        return False
    except Exception:
        return True


def restart(argv: list[str], t0: float) -> None:
    """Replace this process by a fresh one that resumes the sweep (a sticky CUDA error
    ends a context, not a run): at most MAX_RESTARTS times per run."""
    n = int(os.environ.get(RESTARTS_ENV, "0"))
    if n >= MAX_RESTARTS:
        print(f"CUDA context lost again after {n} restarts: stopping", flush=True)
        return
    os.environ[RESTARTS_ENV], os.environ[T0_ENV] = str(n + 1), repr(t0)
    args = [sys.executable, os.path.abspath(__file__), *argv]
    args += [] if "--resume" in argv else ["--resume"]
    print(f"CUDA context lost (a sticky error): restarting with --resume ({n + 1} of "
          f"{MAX_RESTARTS})", flush=True)  # fmt: skip
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, args)


def main(argv: list[str] | None = None) -> int:
    t_start = float(os.environ.get(T0_ENV, time.time()))
    args = parse_args(argv)
    device = resolve_device(args.device)
    if device.type != "cuda":
        print(CPU_NOTE, flush=True)
    methods = select_methods(args.methods)
    timer = Timer(device, args.quick, evict_icache=not args.warm_icache)
    if args.reps is not None:
        timer.min_reps = timer.max_reps = max(1, args.reps)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    bw = measure_bandwidth(device)
    print(f"{name}: copy bandwidth {bw / 1e12:.3f} TB/s (read + write)", flush=True)
    info = versions()
    if info.get("flashinfer") is None and any(m.startswith("flashinfer.") for m in methods):
        print("note: FlashInfer is not importable; its rows will record the error", flush=True)
    today = datetime.date.today().isoformat()
    backend = args.gx_backend or ("triton" if device.type == "cuda" else "torch")
    timing = "median us per eager call (perf_counter; no graphs on the CPU)"
    if timer.cuda:
        evict = ", the SMs' instruction caches evicted before it" if timer.evict else ""
        timing = f"median us per CUDA-graph replay (CUDA events), {FLUSH_DESCRIPTION}{evict}"
    result = {
        "device": name,
        **info,
        "date": today,
        "bandwidth_TBps": round(bw / 1e12, 4),
        "cuda": torch.version.cuda,
        "timing": timing,
        "metric": "graph_us" if timer.cuda else "eager_us",
        "logits": "float32 [B, K+1, V]; drafts = argmax at each draft offset",
        "variants": {t: TABLES[t] for t in args.variants},
        "shapes": {s: SHAPES[s] for s in args.shapes},
        "methods": {m: METHODS[m] for m in methods},
        "first_call_s": {},
        "argv": sys.argv[1:] if argv is None else list(argv),
        "gx_backend": backend,
        "runs": [],
        "rows": [],
    }
    path = results_path(args.out, name, today)
    run = {k: result[k] for k in ("argv", "date", "bandwidth_TBps", "torch", "triton",
                                  "flashinfer", "gx_backend")}  # fmt: skip
    run["skipped"] = skipped = []
    rows: dict[tuple, dict] = {}
    first_call: dict[str, float] = {}
    old = load_previous(path) if args.append else None
    if old is not None:
        rows = {row_key(r): r for r in old["rows"]}
        for key in ("methods", "variants", "shapes"):
            result[key] = {**old.get(key, {}), **result[key]}
        result["runs"] = old.get("runs", [])
    result["runs"].append(run)

    def write() -> None:
        write_results(path, result, rows, first_call, old)

    new_rows, done = [], []
    for V in args.vocab:
        for B in args.batch:
            for K in args.k:
                if args.resume and all((m, t, B, K, V, s) in rows for m in methods
                                       for t in args.variants for s in args.shapes):  # fmt: skip
                    done.append((V, B, K))
                    continue
                if args.time_budget is not None and time.time() - t_start > args.time_budget:
                    skipped.append((V, B, K))
                    continue
                block = time_block(methods, args.variants, args.shapes, B, K, V, device, bw,
                                   timer, first_call, backend)  # fmt: skip
                new_rows += block
                rows.update((row_key(r), r) for r in block)
                write()
                if device.type == "cuda" and cuda_poisoned(device):
                    run["lost_context_at"] = (V, B, K)
                    write()
                    if argv is None:  # a script run: go on in a fresh process
                        restart(sys.argv[1:], t_start)
                    print(f"CUDA context lost at V={V} B={B} K={K}: stopping", flush=True)
                    return 3
    write()
    print("\n" + summary_table(result))  # every row in the file (--append keeps older ones)
    if done:
        print(f"\n--resume: {len(done)} (V, B, K) blocks already in the file")
    if skipped:
        print(f"\ntime budget ({args.time_budget:g} s) spent: skipped {len(skipped)} (V, B, K) "
              f"blocks: {' '.join(f'{V}/{B}/{K}' for V, B, K in skipped)}")  # fmt: skip
    print(f"\nwrote {path} ({len(new_rows)} rows measured now, {len(rows)} in the file)")
    if not args.no_png:
        try:
            from plot_verify import plot

            print(f"wrote {plot(result, os.path.splitext(path)[0] + '.png')}")
        except ImportError as e:
            print(f"no plot ({e}); plot_verify.py plots a results JSON where matplotlib is")
        except Exception as e:  # a plot never fails the run
            print(f"no plot: {error_text(e)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
