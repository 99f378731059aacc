#!/usr/bin/env python
"""Plot and tabulate a `bench_sampler.py` results JSON.

    python benchmarks/plot_sampler.py benchmarks/results/sampler-<gpu>-<date>.json [--markdown]

writes `<same name>.png` next to the JSON: one subplot per vocabulary size V, time / floor
(the time to read the logits once at the measured copy bandwidth) against the batch size B
on a log-x axis, one line per method; float32 rows solid, bfloat16 dashed, float16 dotted.
It plots graph_us (CUDA-graph replay); a results file without graph timings (a CPU smoke
run) is plotted from eager_us instead, and the axis label says so.

`--markdown` also prints, for every dtype and V, a table of method x B whose cells are
"graph_us (ratio to floor)"; `markdown_table(results, V)` returns one such table for a
README.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

LINESTYLES = {"float32": "-", "bfloat16": "--", "float16": ":"}


def load(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def _metric(results: dict) -> str:
    """graph_us when any row has it, else eager_us (CPU runs take no graph timings)."""
    return "graph_us" if any(r.get("graph_us") is not None for r in results["rows"]) else "eager_us"


def _methods(rows: list[dict]) -> list[str]:
    seen: dict[str, None] = {}
    for r in rows:
        seen.setdefault(r["method"], None)
    return list(seen)


def _fmt_us(t: float) -> str:
    return f"{t:.0f}" if t >= 100 else f"{t:.1f}" if t >= 1 else f"{t:.2g}"


def markdown_table(results: dict, V: int, dtype: str = "float32", metric: str | None = None) -> str:
    """Markdown table for one V: a row per method, a column per B; cells "time (x floor)".

    metric: "graph_us" or "eager_us"; None = graph_us unless the file has no graph timings.
    Failed cells read "error"; the first line is the floor (one read of the logits).
    """
    metric = metric or _metric(results)
    rows = [r for r in results["rows"] if r["V"] == V and r["dtype"] == dtype]
    if not rows:
        return f"(no {dtype} rows for V={V})"
    batches = sorted({r["B"] for r in rows})
    cell = {(r["method"], r["B"]): r for r in rows}
    label = "CUDA-graph replay" if metric == "graph_us" else "eager"
    out = [
        f"V = {V}, {dtype}, {label}, microseconds (x the memory floor) on "
        f"{results.get('device', '?')}, {results.get('date', '?')}",
        "",
        "| method | " + " | ".join(f"B={b}" for b in batches) + " |",
        "|---|" + "---:|" * len(batches),
    ]
    floors = [
        next((r["floor_us"] for r in rows if r["B"] == b and r.get("floor_us")), None)
        for b in batches
    ]
    out.append(
        "| floor: one read of the logits | "
        + " | ".join("-" if f is None else _fmt_us(f) for f in floors)
        + " |"
    )
    for m in _methods(rows):
        cells = []
        for b in batches:
            r = cell.get((m, b))
            if r is None:
                cells.append("")
            elif r.get(metric) is None:
                cells.append("error" if r.get("error") else "-")
            else:
                t, f = r[metric], r.get("floor_us")
                cells.append(_fmt_us(t) + (f" ({t / f:.1f}x)" if f else ""))
        out.append(f"| {m} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def markdown_all(results: dict, metric: str | None = None) -> str:
    order = list(LINESTYLES)
    keys = sorted(
        {(r["dtype"], r["V"]) for r in results["rows"]},
        key=lambda k: (order.index(k[0]) if k[0] in order else len(order), k[0], k[1]),
    )
    return "\n\n".join(markdown_table(results, V, d, metric) for d, V in keys)


def plot(results: dict, png_path: str, metric: str | None = None) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metric = metric or _metric(results)
    rows = [r for r in results["rows"] if r.get(metric) is not None and r.get("floor_us")]
    vocabs = sorted({r["V"] for r in results["rows"]})
    methods = _methods(results["rows"])
    palette = [plt.get_cmap("tab10")(i) for i in range(10)] + ["black"]
    markers = "os^vD<>ph*X"
    style = {
        m: (palette[i % len(palette)], markers[i % len(markers)]) for i, m in enumerate(methods)
    }
    n = max(1, len(vocabs))
    legend_rows = math.ceil((len(methods) + 2) / 4)
    fig, axes = plt.subplots(
        1, n, figsize=(max(6 * n, 11), 4.6 + 0.25 * legend_rows), squeeze=False, sharey=True
    )
    for ax, V in zip(axes[0], vocabs, strict=True):
        batches = set()
        for m in methods:
            color, marker = style[m]
            for dtype, ls in LINESTYLES.items():
                pts = sorted(
                    (r["B"], r[metric] / r["floor_us"])
                    for r in rows
                    if r["V"] == V and r["method"] == m and r["dtype"] == dtype
                )
                if pts:
                    batches.update(p[0] for p in pts)
                    ax.plot(
                        [p[0] for p in pts],
                        [p[1] for p in pts],
                        ls,
                        marker=marker,
                        markersize=4,
                        color=color,
                    )
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        if batches:
            ax.set_xticks(sorted(batches), [str(b) for b in sorted(batches)])
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_title(f"V = {V}")
        ax.set_xlabel("batch size B")
        ax.grid(True, which="both", alpha=0.3)
    which = "CUDA-graph replay" if metric == "graph_us" else "eager (no graph timings)"
    axes[0][0].set_ylabel(f"{which} time / memory floor")
    from matplotlib.lines import Line2D

    plotted = [m for m in methods if any(r["method"] == m for r in rows)]
    handles = [Line2D([], [], color=style[m][0], marker=style[m][1], label=m) for m in plotted]
    dtypes = [d for d in LINESTYLES if any(r["dtype"] == d for r in rows)]
    handles += [Line2D([], [], color="gray", linestyle=LINESTYLES[d], label=d) for d in dtypes]
    if handles:
        fig.legend(
            handles=handles,
            loc="lower center",
            ncol=min(4, len(handles)),
            fontsize=8,
            frameon=False,
        )
    bw = results.get("bandwidth_TBps")
    fig.suptitle(
        f"sampler time / memory floor on {results.get('device', '?')}, "
        f"{results.get('date', '?')}\nfloor = one read of the logits at {bw} TB/s"
    )
    fig.tight_layout(rect=(0, min(0.4, (0.25 * legend_rows + 0.1) / fig.get_figheight()), 1, 0.93))
    fig.savefig(png_path, dpi=120)
    plt.close(fig)
    return png_path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("results", help="a sampler-*.json written by bench_sampler.py")
    ap.add_argument("--markdown", action="store_true", help="also print Markdown tables")
    ap.add_argument("--metric", choices=("graph_us", "eager_us"), default=None)
    ap.add_argument("--png", default=None, help="output path (default: the JSON's, .png)")
    args = ap.parse_args(argv)
    results = load(args.results)
    png = plot(results, args.png or os.path.splitext(args.results)[0] + ".png", args.metric)
    print(f"wrote {png}", file=sys.stderr)
    if args.markdown:
        print(markdown_all(results, args.metric))
    return 0


if __name__ == "__main__":
    sys.exit(main())
