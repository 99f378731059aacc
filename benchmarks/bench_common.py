"""Helpers the kernel benchmarks share (bench_sampler.py, bench_verify.py, bench_matmul.py,
bench_tp_tiles.py): the copy bandwidth, versions, the device, and the results JSON
(--append / --resume)."""

from __future__ import annotations

import json
import os
import re
import statistics
import time

import torch
from sampler_timing import error_text

COPY_BYTES = 1 << 30  # each way: a 2 GiB (read + write) copy
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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


def write_json(out: str, name: str, result: dict) -> str:
    """`result` as <out>/<name>-<device>-<date>.json (its "device" and "date"); the path."""
    path = os.path.join(out, f"{name}-{slug(result['device'])}-{result['date']}.json")
    os.makedirs(out, exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    return path


def ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


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
