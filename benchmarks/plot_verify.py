#!/usr/bin/env python
"""Tabulate and plot a `bench_verify.py` results JSON, each method at its worst shape.

    python benchmarks/plot_verify.py benchmarks/results/verify-<gpu>-<date>.json \\
        [--markdown] [--no-png]

`summary_table(results)` (printed by bench_verify.py at the end of a run, and here) has a
line per (variant, V, B, K): the floor (one read of the [B, K+1, V] fp32 logits), each
method's time at its worst shape, then two ratios judged shape by shape:
  strict/sample  graphexec.verify_strict / graphexec.sample_step over the same B*(K+1)
                 rows, the largest over shapes (the target: <= 1.3; "over" marks a miss);
  FI/gx          flashinfer.chain / graphexec.verify_strict, the smallest over shapes
                 (where graphexec is least ahead; > 1: graphexec faster).
The plot (`<same name>.png`) has one subplot per (variant, V): worst-shape time / floor
against B on a log-x axis, one colour per method, K = 1 solid, 3 dashed, 5 dotted.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

STRICT, SAMPLE, FI = "graphexec.verify_strict", "graphexec.sample_step", "flashinfer.chain"
TARGET = 1.3  # verify_strict <= TARGET x sample_step
SHORT = {
    STRICT: "gx.strict",
    SAMPLE: "gx.sample",
    FI: "fi.chain",
    "flashinfer.chain+onehot": "fi.chain+1hot",
    "torch.rejection": "torch.rej",
    "graphexec.verify_rejection": "gx.rejection",
}
LINESTYLES = ["-", "--", ":", "-."]


def load(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def worst(rows: list[dict]) -> dict[tuple, dict]:
    """(method, variant, V, B, K) -> the row of the largest us over shapes (a row that
    failed on some shape wins: it is reported as an error)."""
    out: dict[tuple, dict] = {}
    for r in rows:
        k = (r["method"], r["variant"], r["V"], r["B"], r["K"])
        old = out.get(k)
        if old is not None and old.get("us") is None:
            continue
        if old is None or r.get("us") is None or r["us"] > old["us"]:
            out[k] = r
    return out


def ratio(rows: list[dict], num: str, den: str, largest: bool) -> tuple[float, str] | None:
    """(num / den, shape) at the shape where it is largest (or smallest), over the shapes
    both methods measured at one (variant, V, B, K); None when none."""
    by = {(r["method"], r["shape"]): r.get("us") for r in rows}
    got = [(by[(num, s)] / by[(den, s)], s) for m, s in by
           if m == num and by.get((num, s)) and by.get((den, s))]  # fmt: skip
    if not got:
        return None
    return (max if largest else min)(got)


def _fmt(t: float | None) -> str:
    if t is None:
        return "-"
    return f"{t:.0f}" if t >= 100 else f"{t:.1f}" if t >= 1 else f"{t:.2g}"


def summary_cells(results: dict) -> tuple[list[str], list[list[str]]]:
    """The header and one row of cells per (variant, V, B, K)."""
    rows = results["rows"]
    methods = list(dict.fromkeys(r["method"] for r in rows))
    w = worst(rows)
    points = sorted({(r["variant"], r["V"], r["B"], r["K"]) for r in rows})
    head = ["variant", "V", "B", "K", "floor"] + [SHORT.get(m, m) for m in methods]
    head += ["strict/sample", "FI/gx"]
    table = []
    for v, V, B, K in points:
        here = [r for r in rows if (r["variant"], r["V"], r["B"], r["K"]) == (v, V, B, K)]
        floor = next((r["floor_us"] for r in here if r.get("floor_us")), None)
        cells = [v, str(V), str(B), str(K), _fmt(floor)]
        for m in methods:
            r = w.get((m, v, V, B, K))
            cells.append("-" if r is None else "error" if r.get("us") is None else _fmt(r["us"]))
        s = ratio(here, STRICT, SAMPLE, largest=True)
        mark = "" if s is None or s[0] <= TARGET else " over"
        cells.append("-" if s is None else f"{s[0]:.2f} {s[1]}{mark}")
        f = ratio(here, FI, STRICT, largest=False)
        cells.append("-" if f is None else f"{f[0]:.2f} {f[1]}")
        table.append(cells)
    return head, table


def verdict(results: dict) -> str:
    """One line: at how many (variant, V, B, K) verify_strict <= TARGET x sample_step."""
    rows = results["rows"]
    points = sorted({(r["variant"], r["V"], r["B"], r["K"]) for r in rows})
    got = []
    for p in points:
        here = [r for r in rows if (r["variant"], r["V"], r["B"], r["K"]) == p]
        s = ratio(here, STRICT, SAMPLE, largest=True)
        if s is not None:
            got.append((s[0], s[1], p))
    if not got:
        return f"verify_strict <= {TARGET:g}x sample_step: not measured"
    worst_r, shape, (v, V, B, K) = max(got)
    met = sum(r <= TARGET for r, _, _ in got)
    where = f"{v} V={V} B={B} K={K} {shape}"
    return (f"verify_strict <= {TARGET:g}x sample_step (worst shape): met at {met} of "
            f"{len(got)} points; worst {worst_r:.2f}x at {where}")  # fmt: skip


def summary_table(results: dict, markdown: bool = False) -> str:
    metric = results.get("metric", "graph_us")
    title = (f"verification on {results.get('device', '?')}, {results.get('date', '?')}: "
             f"us per call ({metric}), worst over shapes")  # fmt: skip
    if not results["rows"]:
        return title + "\n(no rows)"
    head, table = summary_cells(results)
    if markdown:
        lines = [title, "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        lines += ["| " + " | ".join(c) + " |" for c in table]
    else:
        width = [max(len(x) for x in col) for col in zip(head, *table, strict=True)]
        lines = [title, ""] + ["  ".join(c.rjust(n) if i > 0 else c.ljust(n)
                                         for i, (c, n) in enumerate(zip(cells, width,
                                                                        strict=True)))
                               for cells in [head, *table]]  # fmt: skip
    errors = sorted({f"{r['method']}: {r['error'][:120]}" for r in results["rows"]
                     if r.get("error")})  # fmt: skip
    lines += ["", verdict(results)] + [f"error {e}" for e in errors]
    return "\n".join(lines)


def plot(results: dict, png_path: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    w = worst(results["rows"])
    variants = sorted({r["variant"] for r in results["rows"]})
    vocabs = sorted({r["V"] for r in results["rows"]})
    ks = sorted({r["K"] for r in results["rows"]})
    methods = list(dict.fromkeys(r["method"] for r in results["rows"]))
    colors = {m: plt.get_cmap("tab10")(i % 10) for i, m in enumerate(methods)}
    ls = {k: LINESTYLES[i % len(LINESTYLES)] for i, k in enumerate(ks)}
    fig, axes = plt.subplots(len(variants), len(vocabs), squeeze=False, sharey=True,
                             figsize=(7 * len(vocabs), 5 * len(variants)))  # fmt: skip
    for row, v in enumerate(variants):
        for ax, V in zip(axes[row], vocabs, strict=True):
            for m in methods:
                for K in ks:
                    pts = sorted((B, r["us"] / r["floor_us"]) for (mm, vv, VV, B, KK), r
                                 in w.items() if (mm, vv, VV, KK) == (m, v, V, K)
                                 and r.get("us") and r.get("floor_us"))  # fmt: skip
                    if pts:
                        ax.plot(*zip(*pts, strict=True), ls[K], marker="o", markersize=3,
                                color=colors[m])  # fmt: skip
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.axhline(1.0, color="black", linewidth=0.8)
            ax.set_title(f"{v}, V = {V}")
            ax.set_xlabel("batch size B")
            ax.grid(True, which="both", alpha=0.3)
        axes[row][0].set_ylabel("time / memory floor, worst shape")
    handles = [Line2D([], [], color=colors[m], label=m) for m in methods]
    handles += [Line2D([], [], color="gray", linestyle=ls[k], label=f"K = {k}") for k in ks]
    fig.legend(handles=handles, loc="lower center", ncol=4, fontsize=8, frameon=False)
    which = "CUDA-graph replay" if results.get("metric", "graph_us") == "graph_us" else "eager"
    fig.suptitle(f"verification ({which}) / memory floor on {results.get('device', '?')}, "
                 f"{results.get('date', '?')}\n(floor: one read of the [B, K+1, V] fp32 logits "
                 f"at {results.get('bandwidth_TBps')} TB/s)", fontsize=10)  # fmt: skip
    fig.tight_layout(rect=(0, 0.03 * math.ceil(len(handles) / 4), 1, 0.93))
    fig.savefig(png_path, dpi=110)
    plt.close(fig)
    return png_path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("results", help="a verify-*.json written by bench_verify.py")
    ap.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    ap.add_argument("--no-png", action="store_true", help="do not plot (no matplotlib needed)")
    ap.add_argument("--png", default=None, help="output path (default: the JSON's, .png)")
    args = ap.parse_args(argv)
    results = load(args.results)
    if not args.no_png:
        png = plot(results, args.png or os.path.splitext(args.results)[0] + ".png")
        print(f"wrote {png}", file=sys.stderr)
    print(summary_table(results, markdown=args.markdown))
    return 0


if __name__ == "__main__":
    sys.exit(main())
