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

`--targets` prints, for every dtype, issue 4's targets evaluated on graph_us (CUDA-graph
replay): one row per target with its limit, the worst measured value and where it occurs,
and "yes" / "no" / "not measured" (a target is met only when every (B, V) it names was
measured); `targets_table(results)` returns the same text. `--no-png` skips the plot.
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


def _dtype_rank(dtype: str) -> tuple[int, str]:
    """float32, bfloat16, float16 first, in that order; then any other by name."""
    order = list(LINESTYLES)
    return (order.index(dtype) if dtype in order else len(order), dtype)


def markdown_all(results: dict, metric: str | None = None) -> str:
    keys = sorted(
        {(r["dtype"], r["V"]) for r in results["rows"]}, key=lambda k: (*_dtype_rank(k[0]), k[1])
    )
    return "\n\n".join(markdown_table(results, V, d, metric) for d, V in keys)


# ----------------------------------------------------------------------------- issue 4 targets

BIG_V = (128256, 151936)
BASE = "graphexec.top_k_top_p"
# (method, subtracted method or None, limit in x floor at B >= 128 and V in BIG_V, us at B = 1)
TARGETS = [
    ("graphexec.no_filter", None, 1.5, 10.0),
    (BASE, None, 2.0, 12.0),
    ("graphexec.top_p", None, 2.5, 15.0),
    ("graphexec.min_p", None, 2.0, 12.0),
    (BASE + "+logprobs20", BASE, 0.5, 3.0),
    (BASE + "+bitmask", BASE, 0.2, 2.0),
]
SPEEDUPS = [("flashinfer.cake", 2.0), ("flashinfer.top_k_top_p_from_logits", 5.0)]


def _at(p: tuple[int, int]) -> str:
    return f"B={p[0]}, V={p[1]}"


def _judge(points, value, limit: float, fmt, higher_is_better: bool = False) -> tuple[str, str]:
    """("measured (worst)" cell, "met?" cell) of value(B, V) against limit over points."""
    got = {p: v for p in points if (v := value(*p)) is not None}
    missing = [p for p in points if p not in got]
    if not got:
        return "not measured", "not measured"
    worst = (min if higher_is_better else max)(got, key=got.get)
    ok = all(v >= limit if higher_is_better else v <= limit for v in got.values())
    text = f"{fmt(got[worst])} at {_at(worst)}"
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        text += f"; not measured at {'; '.join(map(_at, missing[:3]))}{more}"
    return text, "no" if not ok else "not measured" if missing else "yes"


def _targets_rows(rows: list[dict]) -> list[list[str]]:
    row = {(r["method"], r["B"], r["V"]): r for r in rows}

    def t(m: str, B: int, V: int) -> float | None:
        return row.get((m, B, V), {}).get("graph_us")

    def over(m: str, base: str | None, per_floor: bool):
        def value(B: int, V: int) -> float | None:
            a, b = t(m, B, V), (t(base, B, V) if base else 0.0)
            if a is None or b is None:
                return None
            if not per_floor:
                return a - b
            floor = row[(m, B, V)].get("floor_us")
            return (a - b) / floor if floor else None

        return value

    big = [(B, V) for V in BIG_V for B in sorted({r["B"] for r in rows}) if B >= 128]
    out = []
    for m, base, x_floor, us in TARGETS:
        name = f"`{m}`" if base is None else f"`+{m.split('+')[1]}` (`{m}` - `{base}`)"
        out.append(
            [name, "B >= 128, V in {128256, 151936}", f"<= {x_floor:g}x floor"]
            + list(_judge(big, over(m, base, True), x_floor, lambda v: f"{v:.2f}x floor"))
        )
        out.append(
            [name, "B = 1, V = 128256", f"<= {us:g} us"]
            + list(_judge([(1, 128256)], over(m, base, False), us, lambda v: f"{v:.1f} us"))
        )
    grid = sorted({(r["B"], r["V"]) for r in rows}, key=lambda p: (p[1], p[0]))
    for peer, factor in SPEEDUPS:

        def speedup(B: int, V: int, peer: str = peer) -> float | None:
            a, b = t(BASE, B, V), t(peer, B, V)
            return b / a if a and b is not None else None

        cells = ("not measured", "not measured")
        if any(t(peer, B, V) is not None for B, V in grid):
            cells = _judge(grid, speedup, factor, lambda v: f"{v:.2f}x", higher_is_better=True)
        out.append([f"`{BASE}` vs `{peer}`", "every (B, V)", f">= {factor:g}x faster", *cells])
    return out


def targets_table(results: dict) -> str:
    """Issue 4's targets on graph_us, one markdown table per dtype present in results."""
    parts = []
    for dtype in sorted({r["dtype"] for r in results["rows"]}, key=_dtype_rank):
        table = _targets_rows([r for r in results["rows"] if r["dtype"] == dtype])
        met = sum(r[-1] == "yes" for r in table)
        parts.append(
            "\n".join(
                [
                    f"Issue 4 targets, {dtype} logits, CUDA-graph replay (graph_us) on "
                    f"{results.get('device', '?')}, {results.get('date', '?')}: "
                    f"{met} of {len(table)} met",
                    "",
                    "| target | where | limit | measured (worst) | met? |",
                    "|---|---|---|---|---|",
                ]
                + ["| " + " | ".join(r) + " |" for r in table]
            )
        )
    return "\n\n".join(parts) if parts else "(no rows)"


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
    ap.add_argument("--targets", action="store_true", help="also print issue 4's targets table")
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
