"""Inspect captured graphs: one row per key (`tools/inspect_graphs.py`, `graphexec inspect`).

On CUDA, columns: variant, bucket, logprobs, capture time, kernel nodes in the graph
(counted from the graph's debug DOT), reserved CUDA memory added while the key was warmed
up and captured (the shared pool and the warm-up's cache), and replays so far.
Without CUDA the capture is emulated (each key records its step call), so there is no
capture time, graph, memory or replay to measure: the table says so and shows what the
CPU does have: each key, its bucket, logprobs, speculative width, the rows its variant
serves, and (after `--steps`) how many steps ran each key.
`--dot KEY` writes that graph's DOT (KEY as printed, e.g. `top_k_top_p/b8/lp`); CUDA only:
the CPU's emulated capture records calls and has no graph, so it says so and exits 2.
"""

from __future__ import annotations

import argparse
import sys

import torch

import graphexec as gx
from graphexec.engine.graphs import CapturedGraphs
from graphexec.threads import add_threads_argument


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", choices=("tiny", "table"), default="tiny")
    p.add_argument("--device", default=None)
    p.add_argument("--max-batch-size", type=int, default=None, help="default 256 GPU, 8 CPU")
    p.add_argument("--steps", type=int, default=0, help="replay a mixed workload first")
    p.add_argument("--dot", default=None, metavar="KEY", help="write KEY's graph as DOT")
    p.add_argument("--dot-path", default="graph.dot")
    add_threads_argument(p)


def build(args: argparse.Namespace) -> gx.DecodeExecutor:
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    tok = gx.Tokenizer.cl100k()
    batch = args.max_batch_size or (256 if device.type == "cuda" else 8)
    if args.model == "tiny":
        model = gx.models.TinyLM(tok.vocab_size, seed=0)
    else:
        model = gx.models.TableModel(tok.vocab_size, seed=0)
    ex = gx.DecodeExecutor(model, max_batch_size=batch, device=device, tokenizer=tok, seed=0)
    ex.runner.graphs = CapturedGraphs(ex.device, debug=True)  # keep DOTs to count kernel nodes
    return ex


def inspect_graphs(args: argparse.Namespace) -> int:
    from graphexec import workload as wl

    ex = build(args)
    ex.capture()
    if args.steps:
        items = wl.mixed_workload(args.steps, ex.vocab_size, grammars=True, spread=args.steps)
        wl.run(ex, items)
    if ex.device.type == "cuda":
        print_cuda_table(ex)
    else:
        print_emulated_table(ex, steps_ran=bool(args.steps))
    for key, err in ex.graphs.failed.items():
        print(f"FAILED {key}: {err} (served eagerly)")
    return write_dot(ex, args.dot, args.dot_path) if args.dot else 0


# which rows each variant serves (`SamplerVariant`): the cheapest that serves every row runs
SERVES = {
    gx.SamplerVariant.NO_FILTER: "temperature only (greedy included)",
    gx.SamplerVariant.TOP_K_TOP_P: "top-k / top-p, no min-p",
    gx.SamplerVariant.DEFAULT: "every row (min-p included)",
}


def print_cuda_table(ex: gx.DecodeExecutor) -> None:
    """One row per captured CUDA graph, with its capture time, kernels, memory, replays."""
    print(f"{'variant':12s} {'bucket':>6s} {'logprobs':>8s} {'capture s':>9s} "
          f"{'kernels':>7s} {'mem MiB':>8s} {'replays':>7s}")  # fmt: skip
    for key, s in ex.graphs.steps.items():
        nodes = "-" if s.kernel_nodes is None else str(s.kernel_nodes)
        print(
            f"{key.variant.value:12s} {key.bucket:6d} {str(key.logprobs):>8s} "
            f"{s.capture_s:9.3f} {nodes:>7s} {s.pool_bytes / 2**20:8.1f} {s.replays:7d}"
        )


def print_emulated_table(ex: gx.DecodeExecutor, steps_ran: bool) -> None:
    """Without CUDA: what the keys are and serve; no columns that only CUDA can fill."""
    ran = ", and the steps that ran each key" if steps_ran else ""
    print(f"{ex.device.type}: no CUDA, so graph capture is emulated (each key records its "
          "step call\nand runs it on the same static buffers).\n"
          "Shown: every graph key: its sampler variant and the rows it serves, its batch "
          f"bucket,\nlogprobs on/off and speculative width (spec_k){ran}.\n"
          "Not shown (CUDA only): capture time, kernel nodes, graph memory, graph replays "
          "and --dot;\nrun inspect on a CUDA device for those.\n")  # fmt: skip
    steps = f" {'steps':>6s}" if steps_ran else ""
    print(f"{'variant':12s} {'bucket':>6s} {'logprobs':>8s} {'spec_k':>6s}  {'serves':34s}"
          f"{steps}".rstrip())  # fmt: skip
    for key, s in ex.graphs.steps.items():
        n = f" {s.replays:6d}" if steps_ran else ""  # the emulated replays: steps run
        print(f"{key.variant.value:12s} {key.bucket:6d} {str(key.logprobs):>8s} "
              f"{key.spec_k:6d}  {SERVES[key.variant]:34s}{n}".rstrip())  # fmt: skip
    print(f"\n{len(ex.graphs.steps)} keys; buckets {sorted({k.bucket for k in ex.graphs.steps})}")


def write_dot(ex: gx.DecodeExecutor, name: str, path: str) -> int:
    """Write key `name`'s DOT to `path`: 0, or 2 with the reason on stderr."""
    if ex.device.type != "cuda":
        print(f"--dot {name}: no DOT on {ex.device.type}: without CUDA the capture is "
              "emulated (recorded calls, no CUDA graph); run inspect on a CUDA device",
              file=sys.stderr)  # fmt: skip
        return 2
    match = [k for k in ex.graphs.steps if str(k) == name]
    if not match:
        print(f"--dot: no captured key {name!r}; keys look like {ex.graph_keys[0]}",
              file=sys.stderr)  # fmt: skip
        return 2
    try:
        ex.graphs.write_dot(match[0], path)
    except ValueError as e:  # no DOT kept for it
        print(f"--dot: {e}", file=sys.stderr)
        return 2
    print(f"wrote {path}")
    return 0
