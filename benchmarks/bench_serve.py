"""Load test: the OpenAI-compatible server against the executor driven directly.

One executor (`--model`: a config name in benchmarks/configs/ with seeded random weights,
a checkpoint folder, or `tiny` for TinyLM; `--max-batch-size` slots, the workload's graph
keys captured) serves two phases, each a closed loop of N clients for N in `--clients`:

- direct: N asyncio clients of `gx.AsyncDecodeExecutor` in this process;
- server: the app of `graphexec.serve` on uvicorn in this process (one stepping loop),
  and N streaming HTTP clients of /v1/completions spread over `--workers` processes
  (serve_clients.py says why).

Each request is `Workload`'s: a token-id prompt, `--max-tokens` tokens (ignore_eos, seeded,
temperature 0.8, top_p 0.9). A point runs `--duration` seconds; tokens arriving in its
last (duration - warm-up) seconds are measured: tokens/s, time to first token (mean,
p99) and the p99 inter-token gap, over every stream. Lost / duplicated: streams with fewer
/ more tokens than max_tokens (or whose usage disagrees). Ready: a `python -m graphexec
serve` subprocess (TinyLM) from launch to its first 200 from /health, less the capture
time it reports.

Targets (TARGETS), at 64 streams: server tokens/s >= 0.9x direct, server p99 gap <= 1.2x
direct; no lost or duplicated tokens at any N; ready < 10 s plus capture.

    python benchmarks/bench_serve.py --model qwen2.5-0.5b --clients 1 4 16 64 256 --out DIR

Results: serve-<device>-<date>.json and .png in --out (default benchmarks/results).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import dataclasses
import datetime
import json
import multiprocessing
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import triton

import graphexec as gx
from graphexec.params import SamplerVariant as SV
from graphexec.request import GraphKey

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_clients import Record, Workload, run_direct, run_http_worker  # noqa: E402

TARGETS = dict(tokens_ratio_64=">= 0.9", gap_ratio_64="<= 1.2", lost=0, duplicated=0,
               ready_s="< 10 + capture")  # fmt: skip
MODEL_NAME = "bench"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build(args) -> tuple[gx.DecodeExecutor, dict]:
    """The executor both phases share, and what the JSON says of its model."""
    tok = gx.Tokenizer.cl100k()
    if args.model == "tiny":
        model = gx.models.TinyLM(tok.vocab_size, seed=0, max_seq_len=args.max_seq_len)
        info = dict(name="TinyLM", vocab=tok.vocab_size)
    else:
        from step_model import load, resolve

        name, cfg, folder = resolve(args.model)
        dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[args.dtype]
        model, _ = load(cfg, folder, args.device, dtype, args.max_seq_len)
        info = dict(name=name, vocab=model.vocab_size, dtype=args.dtype,
                    random_weights=folder is None)  # fmt: skip
    if model.vocab_size < tok.vocab_size:
        raise SystemExit(f"--model {args.model}: vocabulary {model.vocab_size} < cl100k's")
    n = max(args.clients)
    ex = gx.DecodeExecutor(model, max_batch_size=n, device=args.device, tokenizer=tok, seed=0,
                           cuda_graphs=args.device == "cuda")  # fmt: skip
    if ex.cuda_graphs:
        t0 = time.perf_counter()
        ex.capture([GraphKey(SV("top_k_top_p"), b, False) for b in ex.buckets], progress=False)
        info["capture_s"] = time.perf_counter() - t0
    return ex, info


def _pct(xs: list[float], q: float) -> float | None:
    return float(np.percentile(xs, q)) * 1e6 if xs else None


def summarize(records: list[Record], t0: float, t1: float) -> dict:
    """The measures of one point over the window [t0, t1] (monotonic seconds)."""
    tokens, gaps, ttft = 0, [], []
    lost = dup = usage_bad = 0
    errors = [r.error for r in records if r.error]
    for r in records:
        a = r.arrivals
        tokens += sum(t0 <= x <= t1 for x in a)
        gaps += [b - c for c, b in zip(a, a[1:], strict=False) if t0 <= b <= t1]
        if a and t0 <= r.sent <= t1:
            ttft.append(a[0] - r.sent)
        if r.error is None:
            lost += len(a) < r.expected
            dup += len(a) > r.expected
            usage_bad += r.usage is not None and r.usage != r.expected
    return dict(tokens=tokens, tokens_per_s=tokens / (t1 - t0), requests=len(records),
                ttft_mean_us=statistics.fmean(ttft) * 1e6 if ttft else None,
                ttft_p99_us=_pct(ttft, 99), gap_p99_us=_pct(gaps, 99),
                gap_mean_us=statistics.fmean(gaps) * 1e6 if gaps else None,
                lost=lost, duplicated=dup, usage_mismatch=usage_bad, errors=len(errors),
                first_errors=errors[:3])  # fmt: skip


def window(args) -> tuple[float, float, float]:
    """(start, measured from, deadline) of a point starting now."""
    t = time.monotonic()
    return t, t + args.warmup, t + args.duration


async def direct_points(ex, args, wl: Workload) -> dict[int, dict]:
    out = {}
    for n in args.clients:
        aex = gx.AsyncDecodeExecutor(ex)
        _, t0, t1 = window(args)
        recs = await run_direct(aex, wl, n, t1)
        await aex.close()
        out[n] = summarize(recs, t0, t1)
        print(f"direct N={n}: {out[n]['tokens_per_s']:.0f} tok/s", flush=True)
    return out


async def server_points(ex, args, wl: Workload, pool) -> dict[int, dict]:
    import uvicorn

    from graphexec.serve.app import build_app

    port = free_port()
    app = build_app(ex, model_name=MODEL_NAME, max_queue=4 * max(args.clients))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    task = asyncio.get_running_loop().create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.05)
    out, loop = {}, asyncio.get_running_loop()
    for n in args.clients:
        w = min(args.workers, n)
        _, t0, t1 = window(args)
        url = f"http://127.0.0.1:{port}"
        jobs = [loop.run_in_executor(pool, run_http_worker,
                                     (url, MODEL_NAME, wl, len(range(k, n, w)), k, w, t1))
                for k in range(w)]  # fmt: skip
        recs = [Record(**d) for part in await asyncio.gather(*jobs) for d in part]
        out[n] = summarize(recs, t0, t1)
        print(f"server N={n}: {out[n]['tokens_per_s']:.0f} tok/s", flush=True)
    server.should_exit = True
    await task
    return out


def ready_time(args) -> dict:
    """`python -m graphexec serve` (TinyLM) from launch to its first 200 from /health."""
    import httpx

    port = free_port()
    cmd = [sys.executable, "-m", "graphexec", "serve", "--port", str(port),
           "--max-batch-size", "64", "--device", args.device]  # fmt: skip
    log = Path(tempfile.mkdtemp()) / "serve.log"
    t = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, text=True)
    try:
        while time.perf_counter() - t < 600:
            if proc.poll() is not None:
                return dict(error=f"serve exited {proc.returncode}: {log.read_text()[-500:]}")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1.0).status_code == 200:
                    wall = time.perf_counter() - t
                    hit = re.search(r"captured \d+ graphs in ([\d.]+) s", log.read_text())
                    capture = float(hit.group(1)) if hit else 0.0
                    return dict(ready_s=wall, capture_s=capture,
                                ready_less_capture_s=wall - capture)  # fmt: skip
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        return dict(error="not ready in 600 s")
    finally:
        proc.terminate()
        proc.wait(30)


def judge(direct: dict, server: dict, ready: dict) -> dict:
    at = 64 if 64 in direct else max(direct)
    d, s = direct[at], server[at]
    tr = s["tokens_per_s"] / d["tokens_per_s"]
    gr = s["gap_p99_us"] / d["gap_p99_us"] if s["gap_p99_us"] and d["gap_p99_us"] else None
    lost = sum(p["lost"] + p["errors"] for p in (*direct.values(), *server.values()))
    dup = sum(p["duplicated"] + p["usage_mismatch"] for p in (*direct.values(), *server.values()))
    ready_s = ready.get("ready_less_capture_s")
    return dict(at_streams=at, tokens_ratio=tr, gap_ratio=gr, lost=lost, duplicated=dup,
                ready_less_capture_s=ready_s,
                met=dict(tokens_ratio=tr >= 0.9, gap_ratio=gr is not None and gr <= 1.2,
                         lost=lost == 0, duplicated=dup == 0,
                         ready=ready_s is not None and ready_s < 10))  # fmt: skip


def markdown(result: dict) -> str:
    rows = ["| streams | direct tok/s | server tok/s | server / direct | direct p99 gap us | "
            "server p99 gap us | gap ratio | server TTFT p99 us | lost | duplicated |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for n in result["clients"]:
        d, s = result["direct"][str(n)], result["server"][str(n)]
        gr = s["gap_p99_us"] / d["gap_p99_us"] if s["gap_p99_us"] and d["gap_p99_us"] else 0
        rows.append(f"| {n} | {d['tokens_per_s']:.0f} | {s['tokens_per_s']:.0f} | "
                    f"{s['tokens_per_s'] / d['tokens_per_s']:.2f} | {d['gap_p99_us'] or 0:.0f} | "
                    f"{s['gap_p99_us'] or 0:.0f} | {gr:.2f} | {s['ttft_p99_us'] or 0:.0f} | "
                    f"{d['lost'] + s['lost']} | {d['duplicated'] + s['duplicated']} |")  # fmt: skip
    return "\n".join(rows)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ns = result["clients"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for phase in ("direct", "server"):
        pts = [result[phase][str(n)] for n in ns]
        a.plot(ns, [p["tokens_per_s"] for p in pts], marker="o", label=phase)
        b.plot(ns, [(p["gap_p99_us"] or 0) / 1e3 for p in pts], marker="o", label=phase)
    for ax, y in ((a, "tokens/s"), (b, "p99 inter-token gap (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent streams")
        ax.set_ylabel(y)
        ax.legend()
    fig.suptitle(f"{result['model']['name']} on {result['device']}: server vs executor")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-0.5b",
                    help="a config in configs/, a checkpoint folder, or tiny")  # fmt: skip
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16, 64, 256])
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-seq-len", type=int, default=512)
    ap.add_argument("--duration", type=float, default=10.0, help="seconds per point")
    ap.add_argument("--warmup", type=float, default=2.0, help="seconds of a point not measured")
    ap.add_argument("--workers", type=int, default=8, help="HTTP client processes")
    ap.add_argument("--no-ready", dest="ready", action="store_false",
                    help="skip the serve start-up measure")  # fmt: skip
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    return ap.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.max_tokens + args.prompt_len > args.max_seq_len:
        raise SystemExit("--max-seq-len must hold --prompt-len + --max-tokens")
    ex, info = build(args)
    wl = Workload(args.prompt_len, args.max_tokens, min(ex.vocab_size, 50_000))
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(args.workers, mp_context=ctx) as pool:
        list(pool.map(time.sleep, [0] * args.workers))  # start the workers before timing
        direct = asyncio.run(direct_points(ex, args, wl))
        server = asyncio.run(server_points(ex, args, wl, pool))
    ready = ready_time(args) if args.ready else {}
    dev = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    result = dict(device=dev, date=datetime.date.today().isoformat(), torch=torch.__version__,
                  triton=triton.__version__, graphexec=gx.__version__, model=info,
                  workload=dataclasses.asdict(wl), duration_s=args.duration, warmup_s=args.warmup,
                  workers=args.workers, max_batch_size=ex.max_batch_size, clients=args.clients,
                  direct={str(k): v for k, v in direct.items()},
                  server={str(k): v for k, v in server.items()}, ready=ready,
                  targets=TARGETS, judged=judge(direct, server, ready))  # fmt: skip
    if os.environ.get("GRAPHEXEC_COMMIT"):
        result["commit"] = os.environ["GRAPHEXEC_COMMIT"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"serve-{dev.lower().replace(' ', '-')}-{result['date']}"
    (out / f"{stem}.json").write_text(json.dumps(result, indent=1))
    plot(result, out / f"{stem}.png")
    print(markdown(result))
    print(json.dumps(result["judged"]))
    return result


if __name__ == "__main__":
    main()
