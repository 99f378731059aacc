#!/usr/bin/env python
"""Plot and tabulate a `bench_sampler.py` results JSON, each method at its worst shape.

    python benchmarks/plot_sampler.py benchmarks/results/sampler-<gpu>-<date>.json \\
        [--markdown] [--targets] [--no-png]

A method's time at (dtype, V, B) is the largest over the logits shapes measured there
(rows without a "shape" count as one shape). The plot (`<same name>.png`, one subplot per
V) shows time / floor (the time to read the logits once at the measured copy bandwidth)
against B on a log-x axis, one line per method; float32 rows solid, bfloat16 dashed,
float16 dotted. It uses graph_us (CUDA-graph replay), or eager_us for a file without
graph timings (a CPU smoke run), and says which.

`--markdown` prints, per dtype and V, a table of method x B whose cells are "time (x floor)
shape". `--targets` prints the sampler's targets, each judged on the worst shape:
`targets_table(results)` returns the same text.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

LINESTYLES = {"float32": "-", "bfloat16": "--", "float16": ":"}
BIG_V = (128256, 151936)
# (method, method subtracted or None, limit in x floor at B >= 128 and V in BIG_V, us at B = 1)
TARGETS = [
    ("graphexec.no_filter", None, 1.3, 8.0),
    ("graphexec.top_k_top_p", None, 2.0, 15.0),
    ("graphexec.top_p", None, 2.5, 15.0),
    ("graphexec.min_p", None, 2.0, 12.0),
    ("graphexec.top_k_top_p+logprobs20", "graphexec.top_k_top_p", 0.5, None),
]
# (graphexec method, the FlashInfer methods for the same filter (the fastest counts),
# speed-up asked at every (B, V, shape))
PEERS = [
    ("graphexec.no_filter", ("flashinfer.sampling_from_logits",), 1.5),
    ("graphexec.top_k_top_p", ("flashinfer.cake", "flashinfer.top_k_top_p_from_logits"), 1.5),
    ("graphexec.top_p", ("flashinfer.top_p",), 1.5),
    ("graphexec.min_p", ("flashinfer.min_p",), 1.5),
]


def load(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def _metric(results: dict) -> str:
    """graph_us when any row has it, else eager_us (CPU runs take no graph timings)."""
    return "graph_us" if any(r.get("graph_us") is not None for r in results["rows"]) else "eager_us"


def worst(rows: list[dict], metric: str) -> dict[tuple, dict]:
    """(method, dtype, V, B) -> the row of the largest time over shapes (a row that failed
    on some shape wins: it is reported as an error)."""
    out: dict[tuple, dict] = {}
    for r in rows:
        k = (r["method"], r["dtype"], r["V"], r["B"])
        old = out.get(k)
        if old is not None and old.get(metric) is None:
            continue  # an error stays
        if old is None or r.get(metric) is None or r[metric] > old[metric]:
            out[k] = r
    return out


def _fmt_us(t: float) -> str:
    return f"{t:.0f}" if t >= 100 else f"{t:.1f}" if t >= 1 else f"{t:.2g}"


def _dtype_rank(dtype: str) -> tuple[int, str]:
    order = list(LINESTYLES)
    return (order.index(dtype) if dtype in order else len(order), dtype)


def markdown_table(results: dict, V: int, dtype: str = "float32", metric: str | None = None) -> str:
    """One V: a row per method, a column per B, cells "time (x floor) worst shape"."""
    metric = metric or _metric(results)
    rows = [r for r in results["rows"] if r["V"] == V and r["dtype"] == dtype]
    w = worst(rows, metric)
    batches = sorted({r["B"] for r in rows})
    methods = list(dict.fromkeys(r["method"] for r in rows))
    floors = {r["B"]: r.get("floor_us") for r in rows if r.get("floor_us")}
    head = f"{dtype}, V = {V}, {metric}: worst over shapes, us (x floor)"
    lines = [head, "", "| method | " + " | ".join(f"B={b}" for b in batches) + " |",
             "|---|" + "---|" * len(batches),
             "| floor | " + " | ".join(_fmt_us(floors[b]) if b in floors else "-"
                                      for b in batches) + " |"]  # fmt: skip
    for m in methods:
        cells = []
        for b in batches:
            r = w.get((m, dtype, V, b))
            if r is None:
                cells.append("-")
            elif r.get(metric) is None:
                cells.append("error")
            else:
                ratio = f" ({r[metric] / r['floor_us']:.2f}x)" if r.get("floor_us") else ""
                cells.append(f"{_fmt_us(r[metric])}{ratio} {r.get('shape', '')}".strip())
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def markdown_all(results: dict, metric: str | None = None) -> str:
    keys = sorted({(r["dtype"], r["V"]) for r in results["rows"]},
                  key=lambda k: (*_dtype_rank(k[0]), k[1]))  # fmt: skip
    return "\n\n".join(markdown_table(results, V, d, metric) for d, V in keys)


def _targets_rows(rows: list[dict]) -> list[list[str]]:
    w = worst(rows, "graph_us")
    by_shape = {(r["method"], r["V"], r["B"], r.get("shape")): r for r in rows}

    def t(m: str, V: int, B: int) -> float | None:
        r = next((r for (mm, d, VV, BB), r in w.items() if (mm, VV, BB) == (m, V, B)), None)
        return None if r is None else r.get("graph_us")

    def floor(V: int, B: int) -> float | None:
        return next((r["floor_us"] for r in rows if (r["V"], r["B"]) == (V, B)
                     and r.get("floor_us")), None)  # fmt: skip

    def judge(values: dict, limit: float, fmt, higher_is_better=False) -> tuple[str, str]:
        got = {k: v for k, v in values.items() if v is not None}
        if not got:
            return "not measured", "not measured"
        bad = (min if higher_is_better else max)(got, key=got.get)
        ok = all(v >= limit if higher_is_better else v <= limit for v in got.values())
        missing = len(values) - len(got)
        note = f"; {missing} not measured" if missing else ""
        return f"{fmt(got[bad])} at {bad}{note}", "yes" if ok and not missing else "no"

    batches = sorted({r["B"] for r in rows})
    big = [(V, B) for V in BIG_V for B in batches if B >= 128]
    out = []
    for m, base, x_floor, us in TARGETS:
        name = f"`{m}`" if base is None else f"`+{m.split('+')[1]}` over `{base}`"

        def value(V: int, B: int, m=m, base=base, per_floor=True) -> float | None:
            a, b = t(m, V, B), (t(base, V, B) if base else 0.0)
            f = floor(V, B) if per_floor else 1.0
            return None if a is None or b is None or not f else (a - b) / f

        cells = judge({f"B={B}, V={V}": value(V, B) for V, B in big}, x_floor,
                      lambda v: f"{v:.2f}x floor")  # fmt: skip
        out.append([name, "B >= 128, V in {128256, 151936}", f"<= {x_floor:g}x floor", *cells])
        if us is not None:
            cells = judge({f"B=1, V={V}": value(V, 1, per_floor=False) for V in BIG_V}, us,
                          lambda v: f"{v:.1f} us")  # fmt: skip
            out.append([name, "B = 1, V in {128256, 151936}", f"<= {us:g} us", *cells])
    shapes = sorted({r.get("shape") for r in rows}, key=str)
    grid = sorted({(r["V"], r["B"]) for r in rows})
    for m, peers, factor in PEERS:
        speed = {}
        for V, B in grid:
            for s in shapes:
                a = by_shape.get((m, V, B, s))
                fast = [r["graph_us"] for p in peers
                        if (r := by_shape.get((p, V, B, s))) and r.get("graph_us")]  # fmt: skip
                if a and a.get("graph_us") and fast:
                    speed[f"B={B}, V={V}, {s}"] = min(fast) / a["graph_us"]
        cells = judge(speed, factor, lambda v: f"{v:.2f}x", higher_is_better=True) if speed \
            else ("not measured", "not measured")  # fmt: skip
        out.append([f"`{m}` vs fastest of `{'`, `'.join(peers)}`", "every (B, V, shape)",
                    f">= {factor:g}x faster", *cells])  # fmt: skip
    return out


def targets_table(results: dict) -> str:
    """The sampler's targets on graph_us, one markdown table per dtype in results."""
    parts = []
    for dtype in sorted({r["dtype"] for r in results["rows"]}, key=_dtype_rank):
        table = _targets_rows([r for r in results["rows"] if r["dtype"] == dtype])
        met = sum(r[-1] == "yes" for r in table)
        parts.append("\n".join(
            [f"Targets, {dtype} logits, CUDA-graph replay, worst shape, on "
             f"{results.get('device', '?')}, {results.get('date', '?')}: {met} of "
             f"{len(table)} met", "", "| target | where | limit | measured (worst) | met? |",
             "|---|---|---|---|---|"] + ["| " + " | ".join(r) + " |" for r in table]))  # fmt: skip
    return "\n\n".join(parts) if parts else "(no rows)"


def plot(results: dict, png_path: str, metric: str | None = None) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    metric = metric or _metric(results)
    w = worst(results["rows"], metric)
    vocabs = sorted({r["V"] for r in results["rows"]})
    methods = list(dict.fromkeys(r["method"] for r in results["rows"]))
    palette = [plt.get_cmap("tab20")(i) for i in range(20)]
    style = {m: (palette[i % 20], "os^vD<>ph*X"[i % 11]) for i, m in enumerate(methods)}
    fig, axes = plt.subplots(1, len(vocabs), figsize=(7 * len(vocabs), 6), squeeze=False,
                             sharey=True)  # fmt: skip
    for ax, V in zip(axes[0], vocabs, strict=True):
        for m in methods:
            for dtype, ls in LINESTYLES.items():
                pts = sorted((B, r[metric] / r["floor_us"]) for (mm, d, VV, B), r in w.items()
                             if (mm, d, VV) == (m, dtype, V) and r.get(metric)
                             and r.get("floor_us"))  # fmt: skip
                if pts:
                    ax.plot(*zip(*pts, strict=True), ls, marker=style[m][1], markersize=4,
                            color=style[m][0])  # fmt: skip
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_title(f"V = {V}")
        ax.set_xlabel("batch size B")
        ax.grid(True, which="both", alpha=0.3)
    which = "CUDA-graph replay" if metric == "graph_us" else "eager (no graph timings)"
    axes[0][0].set_ylabel(f"{which} time / memory floor, worst shape")
    handles = [Line2D([], [], color=style[m][0], marker=style[m][1], label=m) for m in methods]
    fig.legend(handles=handles, loc="lower center", ncol=4, fontsize=8, frameon=False)
    fig.suptitle(f"sampler time / memory floor on {results.get('device', '?')}, "
                 f"{results.get('date', '?')} (floor: one read of the logits at "
                 f"{results.get('bandwidth_TBps')} TB/s)")  # fmt: skip
    fig.tight_layout(rect=(0, 0.04 * math.ceil(len(methods) / 4), 1, 0.95))
    fig.savefig(png_path, dpi=110)
    plt.close(fig)
    return png_path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("results", help="a sampler-*.json written by bench_sampler.py")
    ap.add_argument("--markdown", action="store_true", help="also print Markdown tables")
    ap.add_argument("--targets", action="store_true", help="also print the targets table")
    ap.add_argument("--no-png", action="store_true", help="do not plot (no matplotlib needed)")
    ap.add_argument("--metric", choices=("graph_us", "eager_us"), default=None)
    ap.add_argument("--png", default=None, help="output path (default: the JSON's, .png)")
    args = ap.parse_args(argv)
    results = load(args.results)
    if not args.no_png:
        png = plot(results, args.png or os.path.splitext(args.results)[0] + ".png", args.metric)
        print(f"wrote {png}", file=sys.stderr)
    if args.markdown:
        print(markdown_all(results, args.metric))
    if args.targets:
        print(("\n" if args.markdown else "") + targets_table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
