"""Plots of `bench_step.py --model` and `--scenario prefill` results (the TinyLM steady
and churn plots are bench_step.plot's).

    python benchmarks/plot_step.py benchmarks/results/step-model-<name>-<device>-<date>.json
    python benchmarks/plot_step.py benchmarks/results/step-prefill-<name>-<device>-<date>.json

Each JSON gets a PNG beside it: for a model run, decode tokens/s over B (ours replayed and
eager, transformers' generate per mode) and the GPU's idle time per step; for a prefill
run, the running streams' worst, p99 and mean gap per prefill budget against the steady
step.
"""

from __future__ import annotations

import json
import sys


def plot_model(result: dict, path: str, plt) -> None:
    rows = [r for r in result["rows"] if "error" not in r]
    bs = [r["batch"] for r in rows]
    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    ax[0].plot(bs, [r["tokens_per_s"] for r in rows], "o-", label="graphexec replay")
    ax[0].plot(bs, [r["eager_tokens_per_s"] for r in rows], "x--", label="graphexec eager")
    cub = [(r["batch"], r["cublas"]["tokens_per_s"]) for r in rows if "cublas" in r]
    if cub:
        ax[0].plot(*zip(*cub, strict=True), "d-.", label="graphexec replay, cuBLAS (not invariant)")
    spec = [(r["batch"], r["spec"]["tokens_per_s"]) for r in rows if "spec" in r]
    if spec:
        ax[0].plot(*zip(*spec, strict=True), "^-", label="graphexec replay, n-gram K=3")
    modes = sorted({m for r in rows for m in r.get("transformers", {})})
    for mode in modes:
        pts = [(r["batch"], r["transformers"][mode].get("tokens_per_s")) for r in rows
               if mode in r.get("transformers", {})]  # fmt: skip
        pts = [(b, t) for b, t in pts if t]
        ax[0].plot(*zip(*pts, strict=True), "s:", label=f"transformers generate ({mode})")
    ax[0].set(xscale="log", yscale="log", xlabel="batch", ylabel="decode tokens / s",
              title=f"{result['model']['name']} ({result['model']['dtype']})")  # fmt: skip
    ax[1].plot(bs, [r["replay"]["host_us"] for r in rows], "o-", label="host us (median)")
    ax[1].plot(bs, [r["replay"]["host_p90_us"] for r in rows], "x--", label="host us (p90)")
    for k in sorted({k for r in rows for k in r["replay"].get("idle_us", {})}):
        pts = [(r["batch"], r["replay"]["idle_us"][k]) for r in rows
               if k in r["replay"].get("idle_us", {})]  # fmt: skip
        ax[1].plot(*zip(*pts, strict=True), ".:", label=f"idle us, overlap {k}")
    ax[1].axhline(100, color="grey", lw=0.8, ls=":")
    ax[1].set(xscale="log", xlabel="batch", ylabel="us / step",
              title="host time the GPU waits for (its idle time between steps)")  # fmt: skip
    _finish(fig, ax, result, path)


def plot_prefill(result: dict, path: str, plt) -> None:
    sec = result["prefill"]
    rows = sec["rows"]
    xs = [str(r["budget"]) for r in rows]
    fig, ax = plt.subplots(1, 1, figsize=(6.5, 4))
    ax = [ax]
    for key, style in (("gap_max_us", "o-"), ("gap_p99_us", "x--"), ("gap_mean_us", "s:")):
        ax[0].plot(xs, [r[key] / 1e3 for r in rows], style, label=key.replace("_us", ""))
    ax[0].plot(xs, [r["steady_step_us"] / 1e3 for r in rows], "k-", lw=0.8, label="steady step")
    ax[0].set(yscale="log", xlabel="prefill_budget (tokens a step)", ylabel="ms",
              title=f"{result['model']}: {sec['streams']} streams, a {sec['prompt_len']}-token "
              f"prompt every {sec['every']} steps")  # fmt: skip
    _finish(fig, ax, result, path)


def _finish(fig, ax, result: dict, path: str) -> None:
    for a in ax:
        a.legend(fontsize=7)
        a.grid(alpha=0.3)
    fig.suptitle(f"{result['device']}, {result['date']}, torch {result['torch']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def plot(json_path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot")
        return
    with open(json_path) as f:
        result = json.load(f)
    png = json_path[: -len(".json")] + ".png"
    (plot_prefill if result.get("scenario") == "prefill" else plot_model)(result, png, plt)


if __name__ == "__main__":
    for p in sys.argv[1:]:
        plot(p)
