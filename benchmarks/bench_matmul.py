"""The batch-invariant GEMM (`graphexec.kernels.matmul`) against cuBLAS, per weight shape
of the model configs, at the row counts of decode, verify and prefill.

For every linear layer of each `--models` config (q/k/v with its bias, o, gate/up with
its SwiGLU, down, the LM head) and each M in `--rows`: the invariant kernel with the
tile `MatmulConfig.gpu().tile(N, K)` gives, and the cuBLAS path HFTransformer takes with
batch_invariant=False (F.linear; for gate/up, F.linear then `fused.silu_mul`). Each time
is a CUDA-graph replay of calls cycling through copies of the weight (more bytes than L2
holds, as a model's layers are: the weights come from HBM), the median of `--reps`
replays, per call.

`--sweep` also times candidate tiles per shape, each with the splits of K that suit it
(`--splits`; compiled side by side in worker processes first), and reports the best by
its worst ratio to cuBLAS over the rows the decode tile serves: M <= 256, or M below
`large_m` where the shape has a large-M tile (that tile serves the rest), with prefill's
M = 1024 for information; the best are printed last as `GPU_TILES` lines. `--keep-split`
sweeps only the split the model runs the shape with (that of its large-M tile, which
then stays valid), `--layers` a subset of the layers.

    python benchmarks/bench_matmul.py [--models qwen2.5-0.5b llama-3.2-1b llama-3.1-8b] [--sweep]

Results: matmul-<device>-<date>.json in --out, and a markdown table printed last.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import itertools
import json
import math
import os
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from bench_common import write_json
from bench_distributed import time_graph

from graphexec.kernels import fused
from graphexec.kernels import matmul as mm
from graphexec.kernels.row_parallel import ROW_SPLIT

CONFIGS = Path(__file__).resolve().parent / "configs"
L2_BYTES = 160 << 20  # cycle through more weight bytes than any L2 holds


def shapes(name: str) -> list[dict]:
    """The linear layers of a config: name, N (output columns), K, bias, silu."""
    c = json.loads((CONFIGS / f"{name}.json").read_text())
    D, H = c["hidden_size"], c["num_attention_heads"]
    KV = c.get("num_key_value_heads") or H
    hd = c.get("head_dim") or D // H
    bias = c.get("attention_bias", c["model_type"] == "qwen2")
    inter = c["intermediate_size"]
    return [dict(model=name, layer="qkv", N=(H + 2 * KV) * hd, K=D, bias=bias, silu=False),
            dict(model=name, layer="o", N=D, K=H * hd, bias=False, silu=False),
            dict(model=name, layer="gate_up+silu", N=inter, K=D, bias=False, silu=True),
            dict(model=name, layer="down", N=D, K=inter, bias=False, silu=False),
            dict(model=name, layer="lm_head", N=c["vocab_size"], K=D, bias=False,
                 silu=False)]  # fmt: skip


def operands(s: dict, M: int, copies: int):
    wn = 2 * s["N"] if s["silu"] else s["N"]
    x = torch.randn(M, s["K"], device="cuda", dtype=torch.bfloat16)
    ws = [torch.randn(wn, s["K"], device="cuda", dtype=torch.bfloat16) * 0.02
          for _ in range(copies)]  # fmt: skip
    b = torch.randn(wn, device="cuda", dtype=torch.bfloat16) if s["bias"] else None
    return x, ws, b


def calls(s: dict, x, ws, b, tile_cfg: mm.MatmulConfig | None, tile: mm.MatmulTile | None = None):
    """One callable per weight copy: the invariant kernel (tile_cfg; `tile` forces one)
    or cuBLAS (None)."""
    if tile_cfg is None:
        if s["silu"]:
            return [lambda w=w: fused.silu_mul(F.linear(x, w)) for w in ws]
        return [lambda w=w: F.linear(x, w, b) for w in ws]
    if tile is not None:
        return [lambda w=w: mm._launch(x, w, b, s["silu"], tile_cfg, tile=tile) for w in ws]
    if s["silu"]:
        return [lambda w=w: mm.linear_silu_mul(x, w, config=tile_cfg) for w in ws]
    return [lambda w=w: mm.linear(x, w, b, config=tile_cfg) for w in ws]


def graph_time_us(fns, reps: int) -> float:
    """Per-call time of the calls `fns` captured in one CUDA graph, median of reps."""
    return time_graph(lambda: [f() for f in fns], reps) / len(fns)


def candidates(args) -> list[mm.MatmulTile]:
    out = []
    ws = [tuple(map(int, x.split(","))) for x in args.warps_stages]
    for bm, bn, bk, (w, st), sp in itertools.product(args.block_m, args.block_n, args.block_k,
                                                     ws, args.splits):  # fmt: skip
        if st * (bm + 2 * bn) * bk * 2 > 220 << 10:  # shared memory (silu: two w tiles)
            continue
        out.append(mm.MatmulTile(bm, bn, bk, w, st, sp))
    return out


def suits(s: dict, t: mm.MatmulTile, min_programs: int) -> bool:
    """A split that divides K into parts of at least block_k, and is not more than
    needed: the M = 1 grid without it is below 2 x min_programs."""
    if s["K"] % t.split or s["K"] // t.split < t.block_k:
        return False
    return t.split == 1 or triton.cdiv(s["N"], t.block_n) * t.split // 2 < 2 * min_programs


def _compile(job: list[tuple[dict, mm.MatmulTile, tuple[int, ...]]]) -> int:
    """Worker: run every (shape, tile) once at the least and most rows swept (a split
    spread over programs, and summed in registers) so Triton's disk cache holds both."""
    done = 0
    for s, t, rows in job:
        for M in rows:
            x, ws, b = operands(s, M, 1)
            try:
                calls(s, x, ws, b, mm.MatmulConfig(tiles=((s["N"], s["K"], t),)))[0]()
                done += 1
            except Exception:  # out of resources: the sweep skips it too
                pass
    torch.cuda.synchronize()
    return done


def _compile_large(job: list[tuple[dict, mm.MatmulTile, tuple[int, ...]]]) -> int:
    """Worker: each large tile once at each of the sweep's M (its programs per tile, so
    its compiled variant, follow M) so Triton's disk cache holds them."""
    done, gpu = 0, mm.MatmulConfig.gpu()
    for s, t, rows in job:
        for M in rows:
            x, ws, b = operands(s, M, 1)
            try:
                mm._launch(x, ws[0], b, s["silu"], gpu, tile=t)
                done += 1
            except Exception:  # out of resources: the sweep reports it
                pass
    torch.cuda.synchronize()
    return done


def swept(s: dict, t: mm.MatmulTile, gpu: mm.MatmulConfig, keep_split: bool) -> bool:
    """Whether the sweep times tile t on shape s: it suits the shape, and with
    `keep_split` splits K as the model runs the shape."""
    return suits(s, t, gpu.min_programs) and (not keep_split or t.split == large_split(s, gpu))


def precompile(shape_list: list[dict], tiles: list[mm.MatmulTile], workers: int,
               rows: tuple[int, ...], keep_split: bool) -> None:  # fmt: skip
    gpu = mm.MatmulConfig.gpu()
    pairs = [(s, t, rows) for s in shape_list for t in tiles if swept(s, t, gpu, keep_split)]
    jobs = [pairs[i::workers] for i in range(workers)]
    with ProcessPoolExecutor(workers, mp_context=get_context("spawn")) as pool:
        n = sum(pool.map(_compile, jobs))
    print(f"precompiled {n} kernels in {workers} processes", flush=True)


def decode_rows(s: dict, rows: list[int], gpu: mm.MatmulConfig) -> list[int]:
    """The swept rows the decode tile serves: below `large_m` where the shape has a
    large-M tile (assumed verified on the device), else every M <= 256."""
    has_large = any((n, k) == (s["N"], s["K"]) for n, k, _ in gpu.large_tiles)
    return [M for M in rows if M < (gpu.large_m if has_large else 257)] or rows[:1]


def run(args) -> dict:
    shape_list = [s for m in args.models for s in shapes(m)
                  if not args.layers or s["layer"] in args.layers]  # fmt: skip
    tiles = candidates(args) if args.sweep else []
    if tiles:
        t0 = time.perf_counter()
        precompile(shape_list, tiles, args.workers, (min(args.rows), max(args.rows)),
                   args.keep_split)  # fmt: skip
        print(f"  ({time.perf_counter() - t0:.0f} s)", flush=True)
    gpu = mm.MatmulConfig.gpu()
    rows, t_start = [], time.perf_counter()
    per_shape = args.time_budget / len(shape_list) if args.time_budget else None
    for s in shape_list:
        t_start = time.perf_counter()
        wbytes = (2 if s["silu"] else 1) * s["N"] * s["K"] * 2
        copies = max(2, min(48, math.ceil(L2_BYTES / wbytes)))
        tile = gpu.tile(s["N"], s["K"])
        r = dict(s, tile=vars(tile), copies=copies, by_m={}, sweep={})
        for M in args.rows:
            x, ws, b = operands(s, M, copies)
            cub = graph_time_us(calls(s, x, ws, b, None), args.reps)
            ours = graph_time_us(calls(s, x, ws, b, gpu), args.reps)
            r["by_m"][M] = dict(cublas_us=cub, invariant_us=ours, ratio=ours / cub)
            for t in tiles:
                if not swept(s, t, gpu, args.keep_split):
                    continue
                if per_shape and time.perf_counter() - t_start > per_shape:
                    break
                try:
                    cfg = mm.MatmulConfig(tiles=((s["N"], s["K"], t),))
                    us = graph_time_us(calls(s, x, ws, b, cfg), args.reps)
                except Exception:
                    continue
                key = (f"{t.block_m}x{t.block_n}x{t.block_k}/w{t.num_warps}s{t.num_stages}"
                       f"/k{t.split}")  # fmt: skip
                r["sweep"].setdefault(key, {})[M] = us / cub
            del x, ws, b
        served = decode_rows(s, args.rows, gpu)
        if r["sweep"]:
            full = {k: v for k, v in r["sweep"].items() if all(M in v for M in args.rows)}
            best = min(full or r["sweep"], key=lambda k: max(r["sweep"][k].get(M, 9e9)
                                                             for M in served))  # fmt: skip
            r["best"] = dict(tile=best, ratios=r["sweep"][best], rows=served)
        rows.append(r)
        worst = max(v["ratio"] for M, v in r["by_m"].items() if M in served)
        best = ""
        if "best" in r:
            b_worst = max(r["best"]["ratios"].get(M, 0.0) for M in served)
            best = f"; best swept {r['best']['tile']} {b_worst:.2f}"
        print(f"{s['model']:14s} {s['layer']:13s} N={s['N']:6d} K={s['K']:5d} worst decode "
              f"ratio {worst:.2f}{best}", flush=True)  # fmt: skip
        torch.cuda.empty_cache()
    return dict(rows=rows)


def large_candidates(split: int, tma: bool, K: int = 0, ws: bool = False) -> list[mm.MatmulTile]:
    """Pointer-load tiles, or with `tma` the Hopper TMA kernel's (`matmul_tma`): its tile
    shapes whose K step divides a part (K / split), each with every programs-per-tile
    count (0: the launcher's rule by M), and with `ws` each 8-warp one also
    warp-specialised (Triton 3.6's warp specialisation aborts on this kernel's 4-warp
    tiles: 50 of 50 such candidates failed to compile on an H200)."""
    if tma:
        shapes_ = ((64, 64, 64, 4, 6), (64, 64, 64, 4, 8), (128, 64, 64, 4, 6),
                   (64, 128, 64, 4, 6), (128, 128, 64, 8, 5), (64, 64, 64, 4, 4),
                   (128, 64, 64, 4, 4), (128, 128, 64, 8, 4), (64, 128, 64, 4, 4),
                   (128, 128, 64, 8, 3), (128, 256, 64, 8, 3), (64, 256, 64, 8, 3),
                   (64, 64, 128, 4, 4), (64, 128, 128, 4, 3), (128, 64, 32, 4, 4),
                   (64, 64, 32, 4, 4), (128, 128, 32, 8, 4))  # fmt: skip
        part = K // split if K else 0
        ps = [0] + [p for p in (1, 2, 4) if p <= split and split > 1]
        return [mm.MatmulTile(*t, split, tma=True, programs=p, ws=w) for t in shapes_
                for p in ps for w in ((False, True) if ws and t[3] == 8 else (False,))
                if not part or (part % t[2] == 0 and (t[2] == 64 or part % 64))]  # fmt: skip
    out = []
    for bm, bn, bk, (w, st) in itertools.product((64, 128), (64, 128, 256), (64, 128),
                                                 ((4, 4), (8, 3))):  # fmt: skip
        if st * (bm + 2 * bn) * bk * 2 <= 220 << 10:
            out.append(mm.MatmulTile(bm, bn, bk, w, st, split))
    return out


def tile_fields(key: str) -> str:
    """A large sweep's tile key (block_m x block_n x block_k x warps x stages x split, then
    for TMA x programs t, w if warp-specialised) as a MatmulTile's fields."""
    ws = key.endswith("tw")
    vals = key.rstrip("w").rstrip("t").replace("x", ", ")
    if key.rstrip("w").endswith("t"):  # ..., split, programs: tma, programs (, ws)
        head, programs = vals.rsplit(", ", 1)
        vals = f"{head}, True, {programs}" + (", True" if ws else "")
    return vals


def large_split(s: dict, gpu: mm.MatmulConfig) -> int:
    """The split a model runs the shape with on one GPU: o and down are row-parallel
    layers (`row_parallel.row_split_gpu`), the others take their decode tile's."""
    split = gpu.tile(s["N"], s["K"]).split
    return max(ROW_SPLIT, split) if s["layer"] in ("o", "down") else split


def large_sweep(args) -> dict:
    """Per shape: large-M tiles with the split the model runs it with, timed at
    --large-rows against cuBLAS, each checked bit for bit against the decode tile of
    that split at M = 256; the best bit-identical one by its worst ratio over M <= 256."""
    gpu, rows = mm.MatmulConfig.gpu(), []
    shape_list = [s for m in args.models for s in shapes(m)]
    rows_ = tuple(args.large_rows) + (256,)
    jobs = []
    for s in shape_list:
        dec = dataclasses.replace(gpu.tile(s["N"], s["K"]), split=large_split(s, gpu))
        cands = large_candidates(dec.split, args.tma, s["K"], args.ws)
        jobs += [(s, t, rows_) for t in cands + [dec]]
    with ProcessPoolExecutor(args.workers, mp_context=get_context("spawn")) as pool:
        n = sum(pool.map(_compile_large, [jobs[i :: args.workers] for i in range(args.workers)]))
    print(f"precompiled {n} kernels", flush=True)
    per_shape = args.time_budget / len(shape_list) if args.time_budget else None
    for s in shape_list:
        split = large_split(s, gpu)
        t_start = time.perf_counter()
        dec = dataclasses.replace(gpu.tile(s["N"], s["K"]), split=split)
        wbytes = (2 if s["silu"] else 1) * s["N"] * s["K"] * 2
        copies = max(2, min(16, math.ceil(L2_BYTES / wbytes)))
        r = dict(s, decode_tile=vars(dec), cublas={}, decode={}, sweep={})
        ops = {M: operands(s, M, copies) for M in args.large_rows}
        for M, (x, ws, b) in ops.items():
            r["cublas"][M] = graph_time_us(calls(s, x, ws, b, None), args.reps)
            r["decode"][M] = graph_time_us(calls(s, x, ws, b, gpu, dec), args.reps) / r["cublas"][M]
        x256 = torch.randn(256, s["K"], device="cuda", dtype=torch.bfloat16)
        w0 = ops[args.large_rows[0]][1][0]
        want = mm._launch(x256, w0, None, s["silu"], gpu, tile=dec)
        for t in large_candidates(split, args.tma, s["K"], args.ws):
            if per_shape and time.perf_counter() - t_start > per_shape:
                break
            try:
                same = torch.equal(mm._launch(x256, w0, None, s["silu"], gpu, tile=t), want)
                ratios = {M: graph_time_us(calls(s, x, ws, b, gpu, t), args.reps) / r["cublas"][M]
                          for M, (x, ws, b) in ops.items()}  # fmt: skip
            except Exception as e:  # out of resources, or a Triton without TMA
                print(f"  {t}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                continue
            key = f"{t.block_m}x{t.block_n}x{t.block_k}x{t.num_warps}x{t.num_stages}x{t.split}"
            key += (f"x{t.programs}t" + ("w" if t.ws else "")) if t.tma else ""
            r["sweep"][key] = dict(same_bits=same, ratios=ratios)
        good = {k: v for k, v in r["sweep"].items() if v["same_bits"]}
        # the large tile serves large_m .. wide_m - 1 rows, the wide tile wide_m .. long_m - 1
        for key, lo, hi in (("best", gpu.large_m, gpu.wide_m), ("best_wide", gpu.wide_m,
                                                                   gpu.long_m)):  # fmt: skip
            served = [M for M in args.large_rows if lo <= M < hi]
            if good and served:
                best = min(good, key=lambda k: max(good[k]["ratios"][M] for M in served))
                r[key] = dict(tile=best, rows=served, **good[best])
        print(f"{s['model']:14s} {s['layer']:13s} {len(good)}/{len(r['sweep'])} bit-identical; "
              f"decode tile {r['decode']}; best {r.get('best')}; wide {r.get('best_wide')}",
              flush=True)  # fmt: skip
        rows.append(r)
        del ops
        torch.cuda.empty_cache()
    for title, key in (("GPU_LARGE_TILES", "best"), ("GPU_WIDE_TILES", "best_wide")):
        print(f"\n{title}:")
        for r in rows:
            if key in r and (key == "best" or r[key]["tile"] != r.get("best", {}).get("tile")):
                print(f"    ({r['N']}, {r['K']}, ({tile_fields(r[key]['tile'])})),  "
                      f"# {r['model']} {r['layer']}")  # fmt: skip
    return dict(large_rows=rows)


def _at(by_m: dict, M: int):
    """by_m's entry for M rows: int keys in a live result, str keys in one read from JSON."""
    return by_m.get(M, by_m.get(str(M)))


def markdown(result: dict) -> str:
    Ms = sorted({int(M) for r in result["rows"] for M in r["by_m"]})
    head = ["model", "layer", "N", "K", "tile"] + [f"M={M}" for M in Ms]
    lines = [f"invariant GEMM / cuBLAS time on {result['device']}, {result['date']} "
             f"(bf16; cuBLAS us in brackets)", "", "| " + " | ".join(head) + " |",
             "|" + "---|" * len(head)]  # fmt: skip
    for r in result["rows"]:
        t = r["tile"]
        cells = [r["model"], r["layer"], str(r["N"]), str(r["K"]),
                 f"{t['block_m']}x{t['block_n']}x{t['block_k']}/k{t.get('split', 1)}"]  # fmt: skip
        for M in Ms:
            v = _at(r["by_m"], M)
            cells.append(f"{v['ratio']:.2f} ({v['cublas_us']:.1f})" if v else "-")
        lines.append("| " + " | ".join(cells) + " |")
        if "best" in r:
            lines.append(f"|  | best swept: {r['best']['tile']} | | | | "
                         + " | ".join(f"{_at(r['best']['ratios'], M) or float('nan'):.2f}"
                                      for M in Ms) + " |")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["qwen2.5-0.5b", "llama-3.2-1b",
                                                    "llama-3.1-8b"])  # fmt: skip
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 128, 256, 1024])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--sweep", action="store_true", help="also time candidate tiles")
    ap.add_argument("--workers", type=int, default=min(16, os.cpu_count() or 1))
    ap.add_argument("--block-m", type=int, nargs="+", default=[64])
    ap.add_argument("--block-n", type=int, nargs="+", default=[16, 32, 64, 128])
    ap.add_argument("--block-k", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--layers", nargs="+", default=None,
                    choices=("qkv", "o", "gate_up+silu", "down", "lm_head"))  # fmt: skip
    ap.add_argument("--keep-split", action="store_true", help="sweep only the split the "
                    "model runs each shape with")  # fmt: skip
    ap.add_argument("--warps-stages", nargs="+", default=["4,4", "8,3"],
                    metavar="W,S", help="the sweep's (num_warps, num_stages) pairs")  # fmt: skip
    ap.add_argument("--splits", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--large-sweep", action="store_true", help="sweep the large-M tiles "
                    "(the decode tile's split; bit-identical ones only) instead")  # fmt: skip
    ap.add_argument("--large-rows", type=int, nargs="+", default=[128, 256, 1024])
    ap.add_argument("--tma", action="store_true", help="the large sweep's candidates are "
                    "TMA tiles (Hopper) instead of pointer-load tiles")  # fmt: skip
    ap.add_argument("--ws", action="store_true", help="with --tma: each TMA candidate also "
                    "with its K loop warp-specialised")  # fmt: skip
    ap.add_argument("--time-budget", type=float, default=None, metavar="S",
                    help="sweep each shape for at most S / shapes seconds")  # fmt: skip
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_matmul.py times CUDA kernels: it needs a GPU")
    result = dict(device=torch.cuda.get_device_name(), date=datetime.date.today().isoformat(),
                  torch=torch.__version__, triton=triton.__version__, dtype="bfloat16")  # fmt: skip
    os.makedirs(args.out, exist_ok=True)
    if args.large_sweep:
        result.update(large_sweep(args))
        with open(os.path.join(args.out, "matmul-large-sweep.json"), "w") as f:
            json.dump(result, f, indent=1)
        return
    result.update(run(args))
    path = write_json(args.out, "matmul", result)
    print(f"wrote {path}\n\n{markdown(result)}")
    if args.sweep:
        print("\nGPU_TILES (best swept):")
        for r in result["rows"]:
            if "best" in r:
                t = r["best"]["tile"].replace("/w", "x").replace("s", "x").replace("/k", "x")
                vals = ", ".join(t.split("x"))
                print(f"    ({r['N']}, {r['K']}, ({vals})),  # {r['model']} {r['layer']}")


if __name__ == "__main__":
    main()
