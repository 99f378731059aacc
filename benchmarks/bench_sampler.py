#!/usr/bin/env python
"""Sampler benchmark: graphexec vs FlashInfer vs torch-native samplers, against the memory floor.

For every dtype x V x B it times each method eagerly and as a CUDA-graph replay and writes
`<out>/sampler-<gpu-slug>-<YYYY-MM-DD>.json`:

    {"device", "torch", "triton", "flashinfer", "date", "bandwidth_TBps",
     "rows": [{"method", "B", "V", "dtype", "eager_us", "graph_us", "floor_us"}, ...], ...}

A row whose method failed has an "error" key and null timings; one method failing never
stops the run, and the JSON is rewritten after every (dtype, V, B) block, so an interrupted
run keeps what it measured. floor_us = B * V * bytes_per_element / copy bandwidth: the time
to read the logits once, with the bandwidth (bytes read + written) of a 2 GiB
device-to-device copy measured in the same run.

Every row uses per-row parameter tensors: temperature 0.8, top-k 50, top-p 0.9 (min-p 0.05
for graphexec.min_p), a seed per row; logits are randn * 3. The graphexec methods call
`graphexec.sample_step` on preallocated static buffers (one table slot per row, slot_ids =
arange(B)), exactly what the executor captures; backend "triton" on CUDA, "torch" on CPU.

Timing (CUDA): median over reps of CUDA-event time per call, a 256 MiB buffer written
before every call so the logits are never served from L2 (the floor assumes a read from
HBM). eager_us: the GPU is idle when the call starts, so it includes the host's launch
overhead. graph_us: the call is one CUDAGraph.replay() enqueued behind the L2 flush, so it
is the GPU time of the captured kernels (no graph-launch latency). On the CPU only eager
times are taken (perf_counter, no flush) and graph_us is null.

FlashInfer JIT: the first call of a FlashInfer method builds its module (sampling about
80 s, cake_sampling about 300 s on a fresh host; see ../shared/gpu/README.md for prebuilt
modules). That time is not in any row; it is recorded in "first_call_s". `--jit-only`
builds them and exits, so the timed run can go in a separate command.

    python benchmarks/bench_sampler.py                       # default sweep, ~3-5 min on H100
    python benchmarks/bench_sampler.py --dtypes float32,bfloat16 --methods flashinfer,torch
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
import traceback
from collections.abc import Callable
from dataclasses import dataclass

import torch

TEMPERATURE, TOP_K, TOP_P, MIN_P, NUM_LOGPROBS = 0.8, 50, 0.9, 0.05, 20
LOGIT_SCALE = 3.0
FLUSH_BYTES = 256 << 20
COPY_BYTES = 1 << 30  # each way: a 2 GiB (read + write) copy
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

METHODS = {
    "graphexec.no_filter": "sample_step, temperature only (variant no_filter)",
    "graphexec.top_k_top_p": "sample_step, temperature + top-k + top-p (variant top_k_top_p)",
    "graphexec.top_p": "sample_step, temperature + top-p, no top-k (variant top_k_top_p)",
    "graphexec.min_p": "sample_step, temperature + min-p 0.05 (variant default)",
    "graphexec.top_k_top_p+logprobs20": "graphexec.top_k_top_p with logprobs=20 on every row",
    "graphexec.top_k_top_p+bitmask": "graphexec.top_k_top_p with a random int32 bitmask "
    "allowing ~50% of tokens",
    "flashinfer.sampling_from_logits": "flashinfer.sampling.sampling_from_logits (no temperature)",
    "flashinfer.top_k_top_p_from_logits": "flashinfer.sampling.top_k_top_p_sampling_from_logits, "
    "per-row k/p tensors, top_k_first (no temperature)",
    "flashinfer.cake": "flashinfer.sampling.softmax(temperature) + flashinfer.cake_sampling."
    "top_k_top_p_sampling_from_probs (top_k_max=50); 'note' gives its route",
    "torch.sort_top_k_top_p": "temperature, sort, top-k then top-p mask, scatter back, softmax, "
    "exponential race argmax(probs / Exp(1)) (vLLM forward_native)",
    "torch.no_filter": "softmax(logits / T), exponential race argmax(probs / Exp(1))",
}


@dataclass
class Case:
    logits: torch.Tensor  # [B, V] static input
    B: int
    V: int
    device: torch.device
    gx_backend: str


@dataclass
class Bench:
    fn: Callable[[], torch.Tensor]  # one sampler call; returns the sampled ids
    note: str | None = None


# ----------------------------------------------------------------------------- methods


def _gx(variant_params: dict, num_top: int | None = None, bitmask: bool = False):
    def build(c: Case) -> Bench:
        import graphexec as gx
        from graphexec.sampling.tensors import SamplerOutput, SamplingTensors

        params = [gx.SamplingParams(seed=1000 + b, **variant_params) for b in range(c.B)]
        table = SamplingTensors.from_params(params, c.V, c.device)
        out = SamplerOutput.allocate(c.B, c.device, num_top)
        slot_ids = torch.arange(c.B, device=c.device)
        positions = torch.arange(c.B, device=c.device) + 7
        bm = None
        if bitmask:  # random bits: each token allowed with probability 1/2
            g = torch.Generator().manual_seed(1)
            words = torch.randint(0, 2**32, (c.B, (c.V + 31) // 32), generator=g)
            bm = words.to(torch.int32).to(c.device)
        variant = gx.choose_variant(params)

        def fn() -> torch.Tensor:
            gx.sample_step(c.logits, slot_ids, positions, table, out, bm, variant, c.gx_backend)
            return out.token_ids

        return Bench(fn, note=None)

    return build


def _flashinfer(name: str):
    if name == "cake_sampling":
        import flashinfer.cake_sampling as mod
    else:
        import flashinfer.sampling as mod
    return mod


def _fi_rng(c: Case) -> tuple[torch.Tensor, torch.Tensor]:
    seed = torch.arange(1000, 1000 + c.B, dtype=torch.int64, device=c.device)
    return seed, torch.full((c.B,), 7 << 16, dtype=torch.int64, device=c.device)


def _fi_sampling_from_logits(c: Case) -> Bench:
    fs = _flashinfer("sampling")
    seed, offset = _fi_rng(c)
    return Bench(lambda: fs.sampling_from_logits(c.logits, seed=seed, offset=offset))


def _fi_top_k_top_p(c: Case) -> Bench:
    fs = _flashinfer("sampling")
    seed, offset = _fi_rng(c)
    k = torch.full((c.B,), TOP_K, dtype=torch.int32, device=c.device)
    p = torch.full((c.B,), TOP_P, dtype=torch.float32, device=c.device)
    return Bench(
        lambda: fs.top_k_top_p_sampling_from_logits(c.logits, k, p, seed=seed, offset=offset)
    )


def _fi_cake(c: Case) -> Bench:
    fs, cs = _flashinfer("sampling"), _flashinfer("cake_sampling")
    t = torch.full((c.B,), TEMPERATURE, dtype=torch.float32, device=c.device)
    k = torch.full((c.B,), TOP_K, dtype=torch.int32, device=c.device)
    p = torch.full((c.B,), TOP_P, dtype=torch.float32, device=c.device)

    def fn() -> torch.Tensor:
        probs = fs.softmax(c.logits, temperature=t)
        return cs.top_k_top_p_sampling_from_probs(
            probs, k, p, top_k_max=TOP_K, philox_seed=1234, philox_offset=7 << 16
        )

    try:
        route = cs.cake_sampling_route(fs.softmax(c.logits, temperature=t), k, TOP_K)
    except Exception as e:  # the route is informative only
        route = f"route unknown: {type(e).__name__}: {e}"
    return Bench(fn, note=f"cake route: {route}")


def _torch_sort_top_k_top_p(c: Case) -> Bench:
    inv_t = torch.full((c.B, 1), 1.0 / TEMPERATURE, device=c.device)
    k = torch.full((c.B, 1), TOP_K, dtype=torch.int64, device=c.device)
    p = torch.full((c.B, 1), TOP_P, device=c.device)

    def fn() -> torch.Tensor:
        x = c.logits.float() * inv_t
        sv, si = x.sort(dim=-1, descending=False)
        kth = sv.gather(1, (c.V - k).clamp(min=0))  # k-th largest value
        sv = sv.masked_fill(sv < kth, -torch.inf)
        cum = sv.softmax(dim=-1).cumsum(dim=-1)
        drop = cum <= 1 - p
        drop[:, -1] = False  # always keep the most likely token
        sv = sv.masked_fill(drop, -torch.inf)
        probs = torch.empty_like(sv).scatter_(1, si, sv).softmax(dim=-1)
        q = torch.empty_like(probs).exponential_()
        return probs.div_(q).argmax(dim=-1)

    return Bench(fn)


def _torch_no_filter(c: Case) -> Bench:
    inv_t = torch.full((c.B, 1), 1.0 / TEMPERATURE, device=c.device)

    def fn() -> torch.Tensor:
        probs = (c.logits.float() * inv_t).softmax(dim=-1)
        q = torch.empty_like(probs).exponential_()
        return probs.div_(q).argmax(dim=-1)

    return Bench(fn)


_T = dict(temperature=TEMPERATURE)
BUILDERS: dict[str, Callable[[Case], Bench]] = {
    "graphexec.no_filter": _gx(_T),
    "graphexec.top_k_top_p": _gx(dict(_T, top_k=TOP_K, top_p=TOP_P)),
    "graphexec.top_p": _gx(dict(_T, top_p=TOP_P)),
    "graphexec.min_p": _gx(dict(_T, min_p=MIN_P)),
    "graphexec.top_k_top_p+logprobs20": _gx(
        dict(_T, top_k=TOP_K, top_p=TOP_P, logprobs=NUM_LOGPROBS), num_top=NUM_LOGPROBS
    ),
    "graphexec.top_k_top_p+bitmask": _gx(dict(_T, top_k=TOP_K, top_p=TOP_P), bitmask=True),
    "flashinfer.sampling_from_logits": _fi_sampling_from_logits,
    "flashinfer.top_k_top_p_from_logits": _fi_top_k_top_p,
    "flashinfer.cake": _fi_cake,
    "torch.sort_top_k_top_p": _torch_sort_top_k_top_p,
    "torch.no_filter": _torch_no_filter,
}
assert list(BUILDERS) == list(METHODS)


def select_methods(spec: str | None) -> list[str]:
    """Comma list; a token naming a method exactly selects it, else every method containing it."""
    if not spec:
        return list(METHODS)
    chosen: set[str] = set()
    for tok in (t.strip() for t in spec.split(",")):
        if not tok:
            continue
        hits = [tok] if tok in METHODS else [m for m in METHODS if tok in m]
        if not hits:
            raise SystemExit(f"--methods: {tok!r} matches none of {list(METHODS)}")
        chosen.update(hits)
    return [m for m in METHODS if m in chosen]


# ----------------------------------------------------------------------------- timing


class Timer:
    def __init__(self, device: torch.device, quick: bool):
        self.device = device
        self.cuda = device.type == "cuda"
        self.budget_s, self.min_reps, self.max_reps = (0.03, 3, 20) if quick else (0.15, 10, 200)
        self.flush = None
        if self.cuda:
            self.flush = torch.empty(FLUSH_BYTES, dtype=torch.int8, device=device)

    def _reps(self, est_us: float) -> int:
        n = int(self.budget_s * 1e6 / max(est_us + (80.0 if self.cuda else 0.0), 1.0))
        return max(self.min_reps, min(self.max_reps, n))

    def _cuda_median(self, fn: Callable, reps: int, sync_each: bool) -> float:
        ev = [
            (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            for _ in range(reps)
        ]
        torch.cuda.synchronize(self.device)
        for start, end in ev:
            self.flush.zero_()
            if sync_each:
                torch.cuda.synchronize(self.device)
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize(self.device)
        return statistics.median(s.elapsed_time(e) * 1e3 for s, e in ev)

    def time(self, fn: Callable, sync_each: bool) -> float:
        """Median microseconds per call of fn (already warmed up)."""
        if self.cuda:
            est = self._cuda_median(fn, 3, sync_each)
            return self._cuda_median(fn, self._reps(est), sync_each)
        t0 = time.perf_counter()
        fn()
        times = []
        for _ in range(self._reps((time.perf_counter() - t0) * 1e6)):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e6)
        return statistics.median(times)

    def capture(self, fn: Callable) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                fn()
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            result = fn()
        graph.replay()
        torch.cuda.synchronize(self.device)
        return graph, result


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


def check_tokens(tok: torch.Tensor, V: int) -> str | None:
    tok = tok.reshape(-1)
    lo, hi = int(tok.min()), int(tok.max())
    return None if 0 <= lo and hi < V else f"sampled ids outside [0, {V}): min {lo}, max {hi}"


# ----------------------------------------------------------------------------- driver


def _err(e: BaseException) -> str:
    msg = f"{type(e).__name__}: {e}".strip()
    return msg if len(msg) <= 600 else msg[:600] + " ..."


def run_method(name: str, case: Case, timer: Timer, first_call: dict) -> dict:
    """One JSON row; never raises (except KeyboardInterrupt)."""
    row: dict = dict(
        method=name,
        B=case.B,
        V=case.V,
        dtype=str(case.logits.dtype)[6:],
        eager_us=None,
        graph_us=None,
        floor_us=None,
    )
    if name.startswith("flashinfer.") and not timer.cuda:
        row["error"] = "FlashInfer needs CUDA"
        return row
    if name not in first_call and name.startswith("flashinfer."):
        print(
            f"  first call of {name}: FlashInfer may JIT-build its module now "
            "(minutes on a fresh host)",
            flush=True,
        )
    try:
        t0 = time.perf_counter()
        bench = BUILDERS[name](case)
        if bench.note:
            row["note"] = bench.note
        tok = bench.fn()
        if timer.cuda:
            torch.cuda.synchronize(case.device)
        first_call.setdefault(name, round(time.perf_counter() - t0, 3))
        bad = check_tokens(tok, case.V)
        if bad:
            row["warning"] = f"eager: {bad}"
        for _ in range(2):
            bench.fn()
        row["eager_us"] = round(timer.time(bench.fn, sync_each=True), 2)
    except Exception as e:
        row["error"] = _err(e)
        traceback.print_exc(limit=3)
        return row
    if not timer.cuda:
        return row
    graph = None
    try:
        graph, result = timer.capture(bench.fn)
        bad = check_tokens(result, case.V)
        if bad:
            row["warning"] = f"{row.get('warning', '')} graph: {bad}".strip()
        row["graph_us"] = round(timer.time(graph.replay, sync_each=False), 2)
    except Exception as e:
        row["error"] = "graph capture/replay: " + _err(e)
        traceback.print_exc(limit=3)
    del graph
    try:
        torch.cuda.synchronize(case.device)
    except Exception as e:  # a sticky CUDA error: every later call will report it too
        row.setdefault("error", "synchronize after graph: " + _err(e))
    return row


def versions() -> dict:
    info = {"torch": torch.__version__, "triton": None, "flashinfer": None}
    for mod in ("triton", "flashinfer"):
        try:
            info[mod] = __import__(mod).__version__
        except Exception as e:
            info[mod] = None
            info[f"{mod}_import_error"] = _err(e)
    return info


def slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "device"


def ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def print_table(rows: list[dict]) -> None:
    head = f"{'method':36} {'dtype':8} {'V':>7} {'B':>4} {'eager_us':>10} {'graph_us':>10}"
    print("\n" + head + f" {'floor_us':>9} {'graph/floor':>11}  error")
    for r in sorted(rows, key=lambda r: (r["dtype"], r["V"], r["method"], r["B"])):

        def f(v, w):
            return f"{v:>{w}.1f}" if isinstance(v, (int, float)) else f"{'-':>{w}}"

        t = r["graph_us"] if r["graph_us"] is not None else None
        ratio = t / r["floor_us"] if t is not None and r["floor_us"] else None
        err = (r.get("error") or r.get("warning") or "")[:60]
        print(
            f"{r['method']:36} {r['dtype']:8} {r['V']:>7} {r['B']:>4} {f(r['eager_us'], 10)} "
            f"{f(r['graph_us'], 10)} {f(r['floor_us'], 9)} {f(ratio, 11)}  {err}"
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    ap.add_argument("--batch", type=ints, default=[1, 8, 32, 128, 256])
    ap.add_argument("--vocab", type=ints, default=[32000, 128256, 151936])
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
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda":
        if device.index is not None:
            torch.cuda.set_device(device)
        device = torch.device("cuda", torch.cuda.current_device())
    methods = select_methods(args.methods)
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    for d in dtypes:
        if d not in DTYPES:
            raise SystemExit(f"--dtypes: {d!r} is not one of {list(DTYPES)}")
    if args.jit_only:
        args.batch, args.vocab, dtypes, args.quick = [1], args.vocab[:1], dtypes[:1], True
    timer = Timer(device, args.quick)
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
        "timing": "median us per call; CUDA: events, 256 MiB L2 flush before each call; eager "
        "from an idle GPU (includes launch overhead); graph = GPU time of one replay; CPU: "
        "perf_counter, eager only",
        "params": dict(
            temperature=TEMPERATURE,
            top_k=TOP_K,
            top_p=TOP_P,
            min_p=MIN_P,
            logprobs=NUM_LOGPROBS,
            logits="randn * 3",
        ),
        "methods": {m: METHODS[m] for m in methods},
        "first_call_s": {},
        "argv": sys.argv[1:] if argv is None else argv,
        "rows": [],
    }
    path = os.path.join(args.out, f"sampler-{slug(name)}-{today}.json")
    gx_backend = args.gx_backend or ("triton" if device.type == "cuda" else "torch")
    result["gx_backend"] = gx_backend
    gen = torch.Generator(device).manual_seed(0)
    for dname in dtypes:
        for V in args.vocab:
            for B in args.batch:
                try:
                    logits = (torch.randn(B, V, device=device, generator=gen) * LOGIT_SCALE).to(
                        DTYPES[dname]
                    )
                except Exception as e:  # out of memory: record and go on
                    result["rows"] += [
                        dict(
                            method=m,
                            B=B,
                            V=V,
                            dtype=dname,
                            eager_us=None,
                            graph_us=None,
                            floor_us=None,
                            error=_err(e),
                        )
                        for m in methods
                    ]
                    continue
                case = Case(logits, B, V, device, gx_backend)
                floor = B * V * logits.element_size() / bw * 1e6
                for m in methods:
                    row = run_method(m, case, timer, result["first_call_s"])
                    row["floor_us"] = round(floor, 3)
                    result["rows"].append(row)
                    print(
                        f"{m:36} {dname:8} V={V:<7} B={B:<4} eager {row['eager_us']} us  "
                        f"graph {row['graph_us']} us  floor {row['floor_us']} us"
                        + (f"  ERROR {row['error']}" if "error" in row else ""),
                        flush=True,
                    )
                del case, logits
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                if not args.jit_only:
                    os.makedirs(args.out, exist_ok=True)
                    with open(path, "w") as f:
                        json.dump(result, f, indent=1)
    if args.jit_only:
        print("first-call seconds:", json.dumps(result["first_call_s"]))
        return 0
    print_table(result["rows"])
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
