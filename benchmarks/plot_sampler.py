#!/usr/bin/env python
"""Plot and tabulate a `bench_sampler.py` results JSON, each method at its worst shape,
against the measured read floor.

    python benchmarks/plot_sampler.py benchmarks/results/sampler-<gpu>-<date>.json \\
        [--markdown] [--targets] [--no-png]

The floor of a (dtype, V, B) point is `floor.read`'s time there (a kernel that reads every
logit once, timed in the same run under the same protocol), in the metric shown; a file
without floor.read rows (older runs) falls back to each row's floor_us (bytes over the
copy bandwidth), and the headings say which floor a table uses. A row's ratio divides by
the floor of its own run (its read_floor_us) where it has one: a file that several runs
appended to holds each run's floor rows only for the blocks it timed last.

A method's time at (dtype, V, B) is the largest over the logits shapes measured there
(rows without a "shape" count as one shape). The plot (`<same name>.png`, one subplot per
V) shows time / floor against B on a log-x axis, one line per method; float32 rows solid,
bfloat16 dashed, float16 dotted. It uses graph_us (CUDA-graph replay), or eager_us for a
file without graph timings (a CPU smoke run), and says which.

`--markdown` prints, per dtype and V, a table of method x B whose cells are "time (x floor)
shape", with the read floor and the copy-bandwidth floor as its first lines. `--targets`
prints the sampler issue's targets (TARGETS, PEERS), each with its measured value, where it
was measured and its verdict: `targets_table(results)` returns the same text.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

LINESTYLES = {"float32": "-", "bfloat16": "--", "float16": ":"}
FLOOR = "floor.read"
BIG_B = 128  # the ratio targets hold at B >= BIG_B
TYPICAL = ("peaked", "real")  # the shapes of the tighter ratio limits
# (method, method subtracted or None, x floor on peaked / real at B >= 128 (None: none),
#  x floor on the worst shape at B >= 128, us at B = 1 on the worst shape (None: none))
TARGETS = [
    ("graphexec.no_filter", None, None, 1.2, 8.0),
    ("graphexec.min_p", None, 2.0, 3.0, 15.0),
    ("graphexec.top_k_top_p", None, 2.0, 3.0, 15.0),
    ("graphexec.top_p", None, 2.0, 3.0, 15.0),
    ("graphexec.top_k_top_p+logprobs20", "graphexec.top_k_top_p", None, 0.5, None),
]
# (graphexec method, the FlashInfer methods for the same filter (the fastest counts),
# speed-up asked at every (B, V, shape))
PEERS = [
    ("graphexec.no_filter", ("flashinfer.sampling_from_logits",), 1.2),
    ("graphexec.top_k_top_p", ("flashinfer.cake", "flashinfer.top_k_top_p_from_logits"), 1.2),
    ("graphexec.top_p", ("flashinfer.top_p",), 1.2),
    ("graphexec.min_p", ("flashinfer.min_p",), 1.2),
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


def floors(rows: list[dict], metric: str) -> dict[tuple, float]:
    """(dtype, V, B) -> the read floor: floor.read's time in `metric` there (the least
    over its rows), else (older files) a row's read_floor_us, else its floor_us."""
    out: dict[tuple, float] = {}
    for r in rows:
        if r["method"] == FLOOR and r.get(metric):
            k = (r["dtype"], r["V"], r["B"])
            out[k] = min(out.get(k, math.inf), r[metric])
    for r in rows:
        k = (r["dtype"], r["V"], r["B"])
        if k not in out and (r.get("read_floor_us") or r.get("floor_us")):
            out[k] = r.get("read_floor_us") or r["floor_us"]
    return out


def row_floor(r: dict, fl: dict[tuple, float], metric: str) -> float | None:
    """The floor a row's time is divided by: floor.read as timed in the row's own run (its
    read_floor_us, a graph time), so that runs of different conditions in one file (an
    --append of a later run) each compare with their own; else the point's (`floors`)."""
    if metric == "graph_us" and r.get("read_floor_us"):
        return r["read_floor_us"]
    return fl.get((r["dtype"], r["V"], r["B"]))


def floor_name(rows: list[dict]) -> str:
    if any(r["method"] == FLOOR and (r.get("graph_us") or r.get("eager_us")) for r in rows):
        return "floor.read"
    if any(r.get("read_floor_us") for r in rows):
        return "read floor"
    return "copy-bandwidth floor (no floor.read in this file)"


def markdown_table(results: dict, V: int, dtype: str = "float32", metric: str | None = None) -> str:
    """One V: a row per method, a column per B, cells "time (x floor) worst shape"."""
    metric = metric or _metric(results)
    rows = [r for r in results["rows"] if r["V"] == V and r["dtype"] == dtype]
    w = worst(rows, metric)
    fl = floors(rows, metric)
    batches = sorted({r["B"] for r in rows})
    methods = [m for m in dict.fromkeys(r["method"] for r in rows) if m != FLOOR]
    copy = {r["B"]: r.get("floor_us") for r in rows if r.get("floor_us")}
    head = f"{dtype}, V = {V}, {metric}: worst over shapes, us (x {floor_name(rows)})"

    def line(name: str, values: dict) -> str:
        return f"| {name} | " + " | ".join(_fmt_us(values[b]) if b in values else "-"
                                          for b in batches) + " |"  # fmt: skip

    lines = [head, "", "| method | " + " | ".join(f"B={b}" for b in batches) + " |",
             "|---|" + "---|" * len(batches)]  # fmt: skip
    if not floor_name(rows).startswith("copy"):  # a measured floor: its own line
        lines.append(line("floor.read", {b: f for (d, VV, b), f in fl.items()}))
    lines.append(line("bytes / copy bandwidth", copy))
    for m in methods:
        cells = []
        for b in batches:
            r = w.get((m, dtype, V, b))
            if r is None:
                cells.append("-")
            elif r.get(metric) is None:
                cells.append("error")
            else:
                f = row_floor(r, fl, metric)
                ratio = f" ({r[metric] / f:.2f}x)" if f else ""
                cells.append(f"{_fmt_us(r[metric])}{ratio} {r.get('shape', '')}".strip())
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def markdown_all(results: dict, metric: str | None = None) -> str:
    keys = sorted({(r["dtype"], r["V"]) for r in results["rows"]},
                  key=lambda k: (*_dtype_rank(k[0]), k[1]))  # fmt: skip
    return "\n\n".join(markdown_table(results, V, d, metric) for d, V in keys)


def _judge(values: dict, limit: float, fmt, higher_is_better=False) -> tuple[str, str]:
    """(the worst value and where, "yes" / "no" / "not measured") over values {where:
    value or None (not measured)}; met only when every point is measured and within."""
    got = {k: v for k, v in values.items() if v is not None}
    if not got:
        return "not measured", "not measured"
    bad = (min if higher_is_better else max)(got, key=got.get)
    ok = all(v >= limit if higher_is_better else v <= limit for v in got.values())
    missing = len(values) - len(got)
    note = f"; {missing} not measured" if missing else ""
    return f"{fmt(got[bad])} at {bad}{note}", "yes" if ok and not missing else "no"


def _targets_rows(rows: list[dict], metric: str = "graph_us") -> list[list[str]]:
    """[target, where, limit, measured (worst) and where, met] for rows of one dtype."""
    by = {(r["method"], r["V"], r["B"], r.get("shape")): r for r in rows}
    t = {k: r.get(metric) for k, r in by.items()}
    fl = floors(rows, metric)
    order = {s: i for i, s in enumerate(dict.fromkeys(r.get("shape") for r in rows))}
    points = sorted({(r["V"], r["B"], r.get("shape")) for r in rows if r["method"] != FLOOR},
                    key=lambda p: (p[1], p[0], order[p[2]]))  # fmt: skip
    big = [p for p in points if p[1] >= BIG_B]

    def where(V: int, B: int, s) -> str:
        return f"B={B}, V={V}, {s}"

    def ratio(m: str, base: str | None, V: int, B: int, s) -> float | None:
        a, b = t.get((m, V, B, s)), (t.get((base, V, B, s)) if base else 0.0)
        f = row_floor(by[m, V, B, s], fl, metric) if a is not None else None
        return None if a is None or b is None or not f else (a - b) / f

    def x(v: float) -> str:
        return f"{v:.2f}x floor"

    out = []
    for m, base, typical, worst_x, us in TARGETS:
        name = f"`{m}`" if base is None else f"`+{m.split('+')[1]}` over `{base}`"
        if typical is not None:
            vals = {where(*p): ratio(m, base, *p) for p in big if p[2] in TYPICAL}
            out.append([name, f"B >= {BIG_B}, {' / '.join(TYPICAL)}", f"<= {typical:g}x floor",
                        *_judge(vals, typical, x)])  # fmt: skip
        vals = {where(*p): ratio(m, base, *p) for p in big}
        out.append([name, f"B >= {BIG_B}, every shape", f"<= {worst_x:g}x floor",
                    *_judge(vals, worst_x, x)])  # fmt: skip
        if us is not None:
            vals = {where(*p): t.get((m, *p)) for p in points if p[1] == 1}
            out.append([name, "B = 1, every shape", f"<= {us:g} us",
                        *_judge(vals, us, lambda v: f"{v:.1f} us")])  # fmt: skip
    for m, peers, factor in PEERS:
        speed = {}
        for p in points:
            fast = [v for q in peers if (v := t.get((q, *p)))]
            if fast or t.get((m, *p)):  # a point where either side ran
                a = t.get((m, *p))
                speed[where(*p)] = min(fast) / a if fast and a else None
        verdict = _judge(speed, factor, lambda v: f"{v:.2f}x", higher_is_better=True)
        out.append([f"`{m}` vs fastest of `{'`, `'.join(peers)}`", "every (B, V, shape)",
                    f">= {factor:g}x faster", *verdict])  # fmt: skip
    return out


def targets_table(results: dict) -> str:
    """The sampler's targets on graph_us, one markdown table per dtype in results: each
    target's limit, its measured value at the worst point (and where) and its verdict."""
    parts = []
    for dtype in sorted({r["dtype"] for r in results["rows"]}, key=_dtype_rank):
        rows = [r for r in results["rows"] if r["dtype"] == dtype]
        table = _targets_rows(rows)
        met = sum(r[-1] == "yes" for r in table)
        parts.append("\n".join(
            [f"Targets, {dtype} logits, CUDA-graph replay, floor = {floor_name(rows)}, on "
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
    fl = floors(results["rows"], metric)
    vocabs = sorted({r["V"] for r in results["rows"]})
    methods = [m for m in dict.fromkeys(r["method"] for r in results["rows"]) if m != FLOOR]
    palette = [plt.get_cmap("tab20")(i) for i in range(20)]
    style = {m: (palette[i % 20], "os^vD<>ph*X"[i % 11]) for i, m in enumerate(methods)}
    fig, axes = plt.subplots(1, len(vocabs), figsize=(7 * len(vocabs), 6), squeeze=False,
                             sharey=True)  # fmt: skip
    for ax, V in zip(axes[0], vocabs, strict=True):
        for m in methods:
            for dtype, ls in LINESTYLES.items():
                pts = sorted((B, r[metric] / f) for (mm, d, VV, B), r in w.items()
                             if (mm, d, VV) == (m, dtype, V) and r.get(metric)
                             and (f := row_floor(r, fl, metric)))  # fmt: skip
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
    name = floor_name(results["rows"])
    axes[0][0].set_ylabel(f"{which} time / {name.split(' (')[0]}, worst shape")
    handles = [Line2D([], [], color=style[m][0], marker=style[m][1], label=m) for m in methods]
    fig.legend(handles=handles, loc="lower center", ncol=4, fontsize=8, frameon=False)
    fig.suptitle(f"sampler time / {name} on {results.get('device', '?')}, "
                 f"{results.get('date', '?')} (floor.read: one measured read of the logits)",
                 fontsize=10)  # fmt: skip
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
