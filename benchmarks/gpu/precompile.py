"""Compile ahead, side by side, every Triton kernel variant that compile logs list, so
that the tests or benchmarks run after it find them in Triton's disk cache.

A fresh GPU host starts with an empty cache, and a test compiles its kernels one after
another: each variant of the sampler's row kernels takes 60-100 s there, so a test that
captures several of them ran past a device command's limit. The logs are
`compile_log.py`'s (one line per compile: time, seconds, kernel, the specialisation as
Triton serialises it; plain or gzipped). Each distinct specialisation is compiled once, as
`JITFunction.preload` does it, longest first, in `--jobs` processes. A specialisation that no
longer fits its kernel (its parameters changed) is reported and skipped.

    python benchmarks/gpu/precompile.py [--jobs N] LOG [LOG ...]
    python benchmarks/gpu/precompile.py --write OUT.log.gz LOG [LOG ...]

`benchmarks/gpu/compiles.log.gz` holds the GPU suite's variants as last recorded; `gpu/run.sh
test` writes the run's own log ($OUT/compiles.log). `--write` compiles nothing: it writes
the distinct variants of the logs (the longest recorded time of each) to one log, e.g.
the committed one merged with a run's.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import gzip
import importlib
import json
import multiprocessing
import os
import time
from pathlib import Path

import compile_log  # beside this file: the log's line format

from graphexec.runtime.triton_keys import settle


def _open(path: Path, mode: str):
    return gzip.open(path, mode) if path.suffix == ".gz" else open(path, mode)


def read_specs(paths) -> list[tuple[float, str]]:
    """(seconds, specialisation JSON) of each distinct variant in the logs `paths`, the
    longest recorded compile first (so that the long ones start first)."""
    seen: dict[str, float] = {}
    for p in map(Path, paths):
        with _open(p, "rt") as f:
            for line in f:
                m = compile_log.LINE.match(line)
                if m is None:
                    continue
                secs, spec = float(m.group(1)), m.group(3)
                seen[spec] = max(secs, seen.get(spec, 0.0))
    return sorted(((s, spec) for spec, s in seen.items()), key=lambda t: -t[0])


def write_specs(path, specs: list[tuple[float, str]]) -> None:
    """`specs` as a compile log (`read_specs` reads it back the same)."""
    with _open(Path(path), "wt") as f:
        for secs, spec in specs:
            f.write(compile_log.line("-", secs, json.loads(spec)["name"].rpartition(".")[2], spec))


def compile_one(spec: str) -> tuple[str, float, str | None]:
    """(kernel, seconds, error or None): the variant `spec` compiled into the disk cache."""
    name = json.loads(spec)["name"]
    t = time.perf_counter()
    try:
        module, _, attr = name.rpartition(".")
        mod = importlib.import_module(module)
        # its key as the launchers have it: callees hashed first (`runtime.triton_keys`)
        settle(mod)
        kernel = getattr(mod, attr)
        if not hasattr(kernel, "_do_compile"):  # an autotuned kernel: its JITFunction
            kernel = kernel.fn
        _preload(kernel, json.loads(spec))
    except Exception as e:  # noqa: BLE001 (reported: the tests compile it themselves)
        return name, time.perf_counter() - t, f"{type(e).__name__}: {e}"[:200]
    return name, time.perf_counter() - t, None


def _class(path: str):
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def _preload(kernel, d: dict) -> None:
    """`JITFunction.preload` (Triton 3.6's steps) with two changes: each named-tuple
    argument is rebuilt as its class (`compile_log`'s `tuple_types`: the kernel reads its
    fields by name, and Triton's cache key holds its repr), and the recording host's
    libdevice path is dropped (this install's own is used, whose contents the key holds)."""
    import triton.language as tl
    from triton.runtime.driver import driver
    from triton.runtime.jit import convert_to_tuple_if_list

    sig = {k: convert_to_tuple_if_list(v) for k, v in d["signature"].items()}
    for param, path in d.get("tuple_types", {}).items():
        sig[param] = _class(path)(*sig[param])

    def const(v):
        if tl.dtype.is_dtype(v):
            return tl.dtype(v)
        return tl.constexpr(v["constexpr"]) if isinstance(v, dict) and "constexpr" in v else v

    constexprs = {tuple(k): const(v) for k, v in zip(d["constant_keys"], d["constant_vals"],
                                                      strict=True)}  # fmt: skip
    attrs = {tuple(k): v for k, v in zip(d["attrs_keys"], d["attrs_vals"], strict=True)}
    options = {k: tuple(v) if isinstance(v, list) else v for k, v in d["options"].items()
               if k != "extern_libs"}  # fmt: skip
    device = driver.active.get_current_device()
    backend = kernel.device_caches[device][3]
    kernel._do_compile(d["key"], sig, device, constexprs, backend.parse_options(options), attrs,
                       warmup=True)  # fmt: skip


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("logs", nargs="+")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--write", metavar="OUT", help="write the logs' variants to OUT; no compile")
    args = ap.parse_args(argv)
    specs = read_specs(args.logs)
    if args.write:
        write_specs(args.write, specs)
        print(f"wrote {len(specs)} kernel variants to {args.write}")
        return 0
    t = time.perf_counter()
    failed: collections.Counter = collections.Counter()
    ctx = multiprocessing.get_context("spawn")  # a fresh CUDA context in each
    with concurrent.futures.ProcessPoolExecutor(args.jobs, mp_context=ctx) as pool:
        for name, _, err in pool.map(compile_one, [s for _, s in specs]):
            if err is not None:
                failed[f"{name.rpartition('.')[2]}: {err}"] += 1
    done = len(specs) - sum(failed.values())
    print(f"precompiled {done} of {len(specs)} kernel variants in "
          f"{time.perf_counter() - t:.0f} s with {args.jobs} processes")  # fmt: skip
    for why, n in failed.most_common():
        print(f"  not compiled ({n}): {why}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
