"""Load test: the OpenAI-compatible server against the executor driven directly.

The model (`--model`: a config name in benchmarks/configs/ with seeded random weights, a
checkpoint folder, or `tiny` for TinyLM) runs three phases, each a closed loop of N
streaming clients for N in `--clients`:

- direct: one executor in this process (max(clients) slots, the workload's graph keys
  captured), N asyncio clients of `gx.AsyncDecodeExecutor`;
- server: `python -m graphexec serve` as it is deployed (`--api-servers` HTTP processes,
  one engine process, the same keys captured), N streaming HTTP clients of
  /v1/completions spread over `--workers` processes (serve_clients.py says why);
- with `--dp D`: the same server with `--data-parallel D` (D GPUs) at `--dp-clients`.

Each request is `Workload`'s: a token-id prompt, `--max-tokens` tokens (ignore_eos, seeded,
temperature 0.8, top_p 0.9). A point runs `--duration` seconds; tokens arriving in its
last (duration - warm-up) seconds are measured: tokens/s, time to first token (mean,
p99) and the p99 inter-token gap, over every stream. Lost / duplicated: streams with fewer
/ more tokens than max_tokens (or whose usage disagrees). Ready: a `python -m graphexec
serve` subprocess (TinyLM) from launch to its first 200 from /health, less the capture
time it reports.

Targets (TARGETS): at every N, server tokens/s >= 0.9x direct and server p99 gap <= 1.2x
direct; no lost or duplicated tokens; D engines >= 1.8x one engine's tokens/s; ready < 10 s
plus capture.

    python benchmarks/bench_serve.py --model qwen2.5-0.5b --clients 64 256 1024 --dp 2

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
import serve_metrics  # noqa: E402
from serve_clients import Record, Workload, run_direct, run_http_worker  # noqa: E402

TARGETS = dict(
    tokens_ratio=">= 0.9 at every N",
    gap_ratio="<= 1.2 at every N",
    lost=0,
    duplicated=0,
    dp_over_one_engine=">= 1.8 at 256",
    ready_s="< 10 + capture",
)
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
        ex.capture([GraphKey(SV("default"), b, False) for b in ex.buckets], progress=False)
        info["capture_s"] = time.perf_counter() - t0
    return ex, info


def _pct(xs: list[float], q: float) -> float | None:
    return float(np.percentile(xs, q)) * 1e6 if xs else None


def summarize(records: list[Record], t0: float, t1: float) -> dict:
    """The measures of one point over the window [t0, t1] (monotonic seconds)."""
    tokens, gaps, ttft = 0, [], []
    parts: dict[str, list[float]] = {"send": [], "headers": [], "first_chunk": []}
    lost = dup = usage_bad = connects = 0
    errors = [r.error for r in records if r.error]
    for r in records:
        a = r.arrivals
        tokens += sum(t0 <= x <= t1 for x in a)
        gaps += [b - c for c, b in zip(a, a[1:], strict=False) if t0 <= b <= t1]
        if a and t0 <= r.sent <= t1:
            ttft.append(a[0] - r.sent)
            connects += r.connected
            if r.wrote is not None and r.headers is not None:
                parts["send"].append(r.wrote - r.sent)
                parts["headers"].append(r.headers - r.wrote)
                parts["first_chunk"].append(a[0] - r.headers)
        if r.error is None:
            lost += len(a) < r.expected
            dup += len(a) > r.expected
            usage_bad += r.usage is not None and r.usage != r.expected
    return dict(tokens=tokens, tokens_per_s=tokens / (t1 - t0), requests=len(records),
                ttft_mean_us=statistics.fmean(ttft) * 1e6 if ttft else None,
                ttft_p99_us=_pct(ttft, 99), gap_p99_us=_pct(gaps, 99),
                gap_mean_us=statistics.fmean(gaps) * 1e6 if gaps else None,
                lost=lost, duplicated=dup, usage_mismatch=usage_bad, errors=len(errors),
                first_errors=errors[:3], ttft_parts=_ttft_parts(parts, connects))  # fmt: skip


def _ttft_parts(parts: dict[str, list[float]], connects: int) -> dict | None:
    """Where an HTTP request's first token waited (mean / p99 us of each part): send, from
    the call to the request written (the client's pool, a new connection, the write);
    headers, to the response's headers (the server reads it, admits it, sends its first
    token); first_chunk, to the first token parsed. Plus the connections opened."""
    if not parts["send"]:
        return None
    out = {f"{k}_{q}_us": (statistics.fmean(v) * 1e6 if q == "mean" else _pct(v, 99))
           for k, v in parts.items() for q in ("mean", "p99")}  # fmt: skip
    return dict(out, connections_opened=connects)


def window(args) -> tuple[float, float, float]:
    """(start, measured from, deadline) of a point starting now."""
    t = time.monotonic()
    return t, t + args.warmup, t + args.duration


async def direct_points(ex, args, wl: Workload, out: dict, saved) -> None:
    """Each N of `args.clients` against the executor driven directly, into `out`;
    `saved()` after each point."""
    for n in args.clients:
        aex = gx.AsyncDecodeExecutor(ex)
        _, t0, t1 = window(args)
        recs = await run_direct(aex, wl, n, t1)
        await aex.close()
        out[n] = summarize(recs, t0, t1)
        print(f"direct N={n}: {out[n]['tokens_per_s']:.0f} tok/s", flush=True)
        saved()


class ServeProcess:
    """`python -m graphexec serve` on the bench's model: `api_servers` HTTP processes over
    `engines` engine processes (one per GPU), the workload's graph keys captured."""

    def __init__(self, args, engines: int, slots: int) -> None:
        import httpx

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        model = "tiny" if args.model == "tiny" else args.model
        cmd = [sys.executable, "-m", "graphexec", "serve", "--model", model, "--port",
               str(self.port), "--device", args.device, "--dtype", args.dtype,
               "--max-seq-len", str(args.max_seq_len), "--max-batch-size", str(slots),
               "--max-queue", str(4 * slots), "--seed", "0", "--served-model-name", MODEL_NAME,
               "--capture-keys", "default", "--api-servers", str(args.api_servers),
               "--data-parallel", str(engines), "--log-level", "warning",
               "--engine-nice", str(args.engine_nice)]  # fmt: skip
        self.log = Path(tempfile.mkdtemp()) / "serve.log"
        t = time.perf_counter()
        with open(self.log, "w") as f:
            self.proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, text=True)
        while True:
            if self.proc.poll() is not None or time.perf_counter() - t > 900:
                self.stop()
                raise SystemExit(f"serve did not start: {self.log.read_text()[-2000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1.0).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.ready_s = time.perf_counter() - t

    def log_since(self, offset: int) -> tuple[list[str], int]:
        """The server's log lines (warnings and errors: it runs at --log-level warning)
        written after byte `offset`, and the offset of the end."""
        with self.log.open("rb") as f:
            f.seek(offset)
            data = f.read()
        return data.decode(errors="replace").splitlines(), offset + len(data)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


async def server_points(args, wl: Workload, pool, engines: int, clients: list[int], out: dict,
                        saved) -> None:  # fmt: skip
    """Each N of `clients` against a serve process of `engines` engines, max(clients) /
    engines slots each, into `out`; `saved()` after each point."""
    srv = ServeProcess(args, engines, -(-max(clients) // engines))
    print(f"serve with {engines} engine(s) ready in {srv.ready_s:.0f} s", flush=True)
    loop = asyncio.get_running_loop()
    try:
        for n in clients:
            w = min(args.workers, n)
            m = max(args.api_servers, 1)
            before = serve_metrics.scrape(srv.url, m)  # before the point's clock starts
            log_at = srv.log.stat().st_size
            _, t0, t1 = window(args)
            jobs = [loop.run_in_executor(pool, run_http_worker,
                                         (srv.url, MODEL_NAME, wl, len(range(k, n, w)), k, w,
                                          t1))
                    for k in range(w)]  # fmt: skip
            parts = await asyncio.gather(*jobs)
            out[n] = summarize([Record(**d) for p in parts for d in p["records"]], t0, t1)
            lags = [x for p in parts for x in p["lags"]]
            after = serve_metrics.scrape(srv.url, m)
            logged, _ = srv.log_since(log_at)
            out[n].update(client_lag_p99_us=_pct(lags, 99),
                          client_lag_max_us=max(lags) * 1e6 if lags else None,
                          server_side=serve_metrics.delta(before, after),
                          server_log=dict(lines=len(logged), first=logged[:20]))  # fmt: skip
            print(f"server ({engines} engine(s)) N={n}: {out[n]['tokens_per_s']:.0f} tok/s",
                  flush=True)  # fmt: skip
            saved()
    finally:
        srv.stop()


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


def judge(direct: dict, server: dict, dp: dict, ready: dict) -> dict:
    """The targets at every N both phases ran: server tok/s >= 0.9x direct, p99 gap ratio
    <= 1.2, nothing lost or duplicated; data-parallel tok/s >= 1.8x one engine's."""
    ns = [n for n in direct if n in server]
    tr = {n: server[n]["tokens_per_s"] / direct[n]["tokens_per_s"] for n in ns}
    gr = {n: server[n]["gap_p99_us"] / direct[n]["gap_p99_us"]
          if server[n]["gap_p99_us"] and direct[n]["gap_p99_us"] else None for n in ns}  # fmt: skip
    points = (*direct.values(), *server.values(), *dp.values())
    lost = sum(p["lost"] + p["errors"] for p in points)
    dup = sum(p["duplicated"] + p["usage_mismatch"] for p in points)
    dpr = {n: dp[n]["tokens_per_s"] / server[n]["tokens_per_s"] for n in dp if n in server}
    ready_s = ready.get("ready_less_capture_s")
    return dict(tokens_ratio={str(n): v for n, v in tr.items()},
                gap_ratio={str(n): v for n, v in gr.items()},
                dp_over_one_engine={str(n): v for n, v in dpr.items()},
                lost=lost, duplicated=dup, ready_less_capture_s=ready_s,
                met=dict(tokens_ratio=all(v >= 0.9 for v in tr.values()),
                         gap_ratio=all(v is not None and v <= 1.2 for v in gr.values()),
                         dp=all(v >= 1.8 for v in dpr.values()) if dpr else None,
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
    for n, p in result.get("data_parallel", {}).items():
        one = result["server"].get(n)
        ratio = f"{p['tokens_per_s'] / one['tokens_per_s']:.2f}x one engine" if one else ""
        rows.append(f"| {n} (--data-parallel {result['dp_engines']}) | | "
                    f"{p['tokens_per_s']:.0f} | {ratio} | | {p['gap_p99_us'] or 0:.0f} | | "
                    f"{p['ttft_p99_us'] or 0:.0f} | {p['lost']} | {p['duplicated']} |")  # fmt: skip
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
    ap.add_argument("--workers", type=int, default=12, help="HTTP client processes")
    ap.add_argument("--api-servers", type=int, default=8, help="serve's --api-servers")
    ap.add_argument("--dp", type=int, default=0, metavar="N",
                    help="also serve with --data-parallel N (N GPUs) at --dp-clients")  # fmt: skip
    ap.add_argument("--dp-clients", type=int, nargs="+", default=[1024])
    ap.add_argument("--engine-nice", type=int, default=0, metavar="N",
                    help="serve's --engine-nice (default 0: the engines as started)")  # fmt: skip
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
    dev = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    direct, server, dp, ready = {}, {}, {}, {}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"serve-{dev.lower().replace(' ', '-')}-{datetime.date.today().isoformat()}"

    def saved(complete: bool = False) -> dict:
        # after every point: a run cut short (a device command's time limit) keeps the
        # points it measured, marked incomplete
        result = dict(device=dev, date=datetime.date.today().isoformat(),
                      torch=torch.__version__, triton=triton.__version__,
                      graphexec=gx.__version__, model=info, workload=dataclasses.asdict(wl),
                      duration_s=args.duration, warmup_s=args.warmup, workers=args.workers,
                      max_batch_size=max(args.clients), clients=args.clients,
                      api_servers=args.api_servers, dp_engines=args.dp,
                      engine_nice=args.engine_nice, complete=complete,
                      direct={str(k): v for k, v in direct.items()},
                      server={str(k): v for k, v in server.items()},
                      data_parallel={str(k): v for k, v in dp.items()}, ready=ready,
                      targets=TARGETS, judged=judge(direct, server, dp, ready))  # fmt: skip
        if os.environ.get("GRAPHEXEC_COMMIT"):
            result["commit"] = os.environ["GRAPHEXEC_COMMIT"]
        (out / f"{stem}.json").write_text(json.dumps(result, indent=1))
        return result

    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(args.workers, mp_context=ctx) as pool:
        list(pool.map(time.sleep, [0] * args.workers))  # start the workers before timing
        asyncio.run(direct_points(ex, args, wl, direct, saved))
        del ex  # the server's engines get the GPU to themselves
        torch.cuda.empty_cache() if args.device == "cuda" else None
        asyncio.run(server_points(args, wl, pool, 1, args.clients, server, saved))
        if args.dp:
            asyncio.run(server_points(args, wl, pool, args.dp, args.dp_clients, dp, saved))
    if args.ready:
        ready.update(ready_time(args))
    result = saved(complete=True)
    plot(result, out / f"{stem}.png")
    print(markdown(result))
    print(json.dumps(result["judged"]))
    return result


if __name__ == "__main__":
    main()
