"""Inspect captured graphs: one row per key (`tools/inspect_graphs.py`, `graphexec inspect`),
then which kernels each key runs. It first says which model it inspected; without --model
the demo's (SmolLM2 once set up, else TinyLM), in the dtype every tool defaults to.

First the variants: the rows each serves and the graph that serves it on the sampler
backend (`engine.variants`: on Triton and torch, top_k_top_p runs default's kernels, so
default's graph serves it and it has no graph of its own).
On CUDA, columns: variant, bucket, logprobs, spec_k, capture time, kernel nodes in the
graph (counted from the graph's debug DOT), reserved CUDA memory added while the key was
warmed up and captured (the shared pool and the warm-up's cache), replays so far, the
key's kernel set and the chosen variants it serves. The kernel sets list each graph's
kernel nodes by name, counted (keys with the same names and counts share one).
Without CUDA the capture is emulated (each key records its step call), so there is no
capture time, graph, memory or replay to measure: the table says so and shows what the
CPU does have: each key, its bucket, logprobs, speculative width, the chosen variants it
serves, its kernel set and (after `--steps`) how many steps ran each key. Its kernel sets
are the sampler kernels each key launches, as `engine.variants` lists them (the Triton
kernels of the same key on CUDA), not traced.
`--dot KEY` writes that graph's DOT (KEY as printed, e.g. `default/b8/lp`, or a key it
serves, e.g. `top_k_top_p/b8/lp`); CUDA only:
the CPU's emulated capture records calls and has no graph, so it says so and exits 2.
"""

from __future__ import annotations

import argparse
import sys
import textwrap
from collections import Counter

import torch

import graphexec as gx
from graphexec.engine.graphs import CapturedGraphs
from graphexec.engine.variants import triton_kernels
from graphexec.models.choice import add_model_argument
from graphexec.models.demo_model import ModelChoiceError, choose_model
from graphexec.params import TOP_K_FIRST_MAX
from graphexec.request import GraphKey
from graphexec.runtime.threads import add_threads_argument


def add_arguments(p: argparse.ArgumentParser) -> None:
    """inspect's options (`python -m graphexec inspect`, tools/inspect_graphs.py)."""
    add_model_argument(p, None, "smollm2 once `graphexec models smollm2` has set it up, else "
                       "tiny (as the demo)")  # fmt: skip
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="a real model's weights (auto: the config's dtype on CUDA, float32 on "
                   "the CPU)")  # fmt: skip
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    p.add_argument("--max-batch-size", type=int, default=None,
                   help="slots; the buckets are the powers of two up to it (default 256 GPU, "
                   "8 CPU)")  # fmt: skip
    p.add_argument("--steps", type=int, default=0, metavar="N",
                   help="run a mixed workload of N requests first, so the table counts the "
                   "replays (the steps, on the CPU) of each key (default 0: none)")  # fmt: skip
    p.add_argument("--dot", default=None, metavar="KEY",
                   help="write KEY's graph as DOT (KEY as printed, e.g. default/b8/lp; CUDA "
                   "only: exits 2 on the CPU)")  # fmt: skip
    p.add_argument("--dot-path", default="graph.dot", metavar="FILE",
                   help="where --dot writes (default graph.dot)")  # fmt: skip
    add_threads_argument(p)


def build(args: argparse.Namespace) -> gx.DecodeExecutor:
    """The executor over --model's model (`choose_model`; without --model the demo's
    default, `demo.default_model`), keeping its graphs' DOTs. Prints which model it is.
    Raises `ModelChoiceError` for a --model that names no model."""
    from graphexec.app.demo import default_model

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = getattr(args, "dtype", "auto")
    if getattr(args, "model", None) is None:
        dm, _ = default_model(device, dtype, None, 0)
    else:
        dm = choose_model(args.model, device, dtype)
    batch = args.max_batch_size or (256 if device.type == "cuda" else 8)
    model = dm.make()
    dt = str(getattr(model, "dtype", torch.float32)).removeprefix("torch.")
    print(f"Inspecting {dm.name} on {device} ({dt}), max batch size {batch}.\n", flush=True)
    ex = gx.DecodeExecutor(model, max_batch_size=batch, device=device, tokenizer=dm.tokenizer,
                           seed=0)  # fmt: skip
    ex.runner.graphs = CapturedGraphs(ex.device, debug=True)  # keep DOTs to count kernel nodes
    return ex


def inspect_graphs(args: argparse.Namespace) -> int:
    """Capture, optionally run --steps, print the table; 0, or 2 for a --model that names
    no model or a --dot that cannot be written."""
    from graphexec.app import workload as wl

    try:
        ex = build(args)
    except ModelChoiceError as e:
        print(f"graphexec inspect: {e}", file=sys.stderr)
        return 2
    ex.capture(progress=sys.stderr.isatty())
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
    gx.SamplerVariant.TOP_K_TOP_P: f"top-k 1-{TOP_K_FIRST_MAX} (+ top-p), no min-p",
    gx.SamplerVariant.DEFAULT: "every row (min-p included)",
}


def backend_of(ex: gx.DecodeExecutor) -> str:
    return ex.runner.step.sampler.backend


def print_variants(ex: gx.DecodeExecutor) -> None:
    """The variants and the rows each serves."""
    print(textwrap.fill(f"Variants (choose_variant picks the cheapest that serves every row "
                        f"of a chunk; sampler backend {backend_of(ex)}):", width=92))  # fmt: skip
    for v in gx.SamplerVariant:
        print(f"  {v.value + ':':13s} {SERVES[v]}")
    print()


def kernel_sets(ex: gx.DecodeExecutor) -> tuple[dict, dict]:
    """(key -> its set's label, label -> ([(kernel name, count)], keys)). On CUDA a key's
    kernels are its graph's kernel nodes by name (from the DOT; None without debug
    capture); without CUDA, the sampler kernels its variant launches per sample_step call
    on the Triton backend (`engine.variants.triton_kernels`), not traced."""
    label: dict = {}
    sets: dict = {}
    by_kernels: dict = {}
    for key, s in ex.graphs.steps.items():
        if ex.graphs.cuda:
            if s.kernels is None:
                continue
            names = tuple(s.kernels.items())
        else:
            names = tuple(Counter(triton_kernels(key.variant, key.logprobs, key.spec_k)).items())
        if names not in by_kernels:
            by_kernels[names] = _label(len(by_kernels))
            sets[by_kernels[names]] = (list(names), [])
        label[key] = by_kernels[names]
        sets[label[key]][1].append(key)
    return label, sets


def _label(i: int) -> str:
    """A, B, ..., Z, AA, AB, ..."""
    return (_label(i // 26 - 1) if i >= 26 else "") + chr(ord("A") + i % 26)


def describe_keys(keys: list[GraphKey]) -> str:
    """Keys grouped by variant / logprobs / spec_k, with their buckets."""
    groups: dict = {}
    for k in keys:
        lp = "lp" if k.logprobs else "nolp"
        spec = f"/k{k.spec_k}" if k.spec_k else ""
        groups.setdefault(f"{k.variant.value}/{lp}{spec}", []).append(k.bucket)
    return "; ".join(f"{g} (buckets {','.join(map(str, sorted(b)))})" for g, b in groups.items())


# the kernels of a batch-invariant model layer on CUDA (`models.ops` route map)
LAYER_KERNELS = ("_linear_kernel", "_linear_tma_kernel", "_residual_rms_norm_kernel",
                 "_rope_kv_write_kernel", "_decode_attention_kernel")  # fmt: skip


def kernels_per_layer(kernels: list[tuple[str, int]], num_layers: int | None) -> float | None:
    """The layer kernels of a graph (`LAYER_KERNELS` by name, counted) per model layer,
    less the two outside the layers (the final norm and the LM head's GEMM); None when
    the model has no layers to count or the graph holds none of those kernels."""
    n = sum(c for name, c in kernels if any(p in name for p in LAYER_KERNELS))
    if not num_layers or n <= 2:
        return None
    return (n - 2) / num_layers


def print_kernel_sets(sets: dict, cuda: bool, num_layers: int | None = None) -> None:
    if cuda:
        what = ("every kernel node of each key's graph, by name (from its DOT), counted; keys "
                "whose graphs hold the same names and counts share a set.")  # fmt: skip
    else:
        what = ("the sampler kernels each key launches per sample_step call, as "
                "graphexec/engine/variants.py lists them (not traced): the Triton kernels the "
                "same key launches on CUDA. Here the torch backend runs the same steps as torch "
                "ops (sampling/reference.py) and the emulated capture records no kernels; the "
                "model's and the step's own kernels are not listed.")  # fmt: skip
    print("\n" + textwrap.fill("Kernel sets: " + what, width=92))
    for name, (kernels, keys) in sets.items():
        total = sum(n for _, n in kernels)
        unit = "kernel nodes" if cuda else "launch" + "es" * (total != 1)
        print(f"  {name:3s} {total} {unit}: {describe_keys(keys)}")
        if cuda:
            per = kernels_per_layer(kernels, num_layers)
            if per is not None and all(k.spec_k == 0 for k in keys):
                print(f"      {per:.1f} kernels a model layer ({num_layers} layers)")
            for k, n in kernels:
                print(f"      {n:4d}  {k}")
        else:
            items = [k if n == 1 else f"{k} x{n}" for k, n in kernels]
            print(textwrap.fill(", ".join(items), width=92, initial_indent=" " * 6,
                                subsequent_indent=" " * 6))  # fmt: skip


def print_cuda_table(ex: gx.DecodeExecutor) -> None:
    """One row per captured CUDA graph, with its capture time, kernels, memory, replays,
    kernel set; then the kernel sets."""
    print_variants(ex)
    label, sets = kernel_sets(ex)
    print(f"{'variant':12s} {'bucket':>6s} {'logprobs':>8s} {'spec_k':>6s} {'capture s':>9s} "
          f"{'kernels':>7s} {'mem MiB':>8s} {'replays':>7s}  set")  # fmt: skip
    for key, s in ex.graphs.steps.items():
        nodes = "-" if s.kernel_nodes is None else str(s.kernel_nodes)
        print(
            f"{key.variant.value:12s} {key.bucket:6d} {str(key.logprobs):>8s} {key.spec_k:6d} "
            f"{s.capture_s:9.3f} {nodes:>7s} {s.pool_bytes / 2**20:8.1f} {s.replays:7d}  "
            f"{label.get(key, '-')}"
        )
    print_kernel_sets(sets, cuda=True, num_layers=getattr(ex.model, "num_layers", None))


def print_emulated_table(ex: gx.DecodeExecutor, steps_ran: bool) -> None:
    """Without CUDA: what the keys are, serve and launch; no columns that only CUDA can
    fill."""
    ran = ", and the steps that ran each key" if steps_ran else ""
    print(f"{ex.device.type}: no CUDA, so graph capture is emulated (each key records its "
          "step call\nand runs it on the same static buffers).")  # fmt: skip
    print(textwrap.fill("Shown: every graph key: its sampler variant, its batch bucket, "
                        "logprobs on/off, speculative width (spec_k), its kernel "
                        f"set{ran}.", width=92))  # fmt: skip
    print("Not shown (CUDA only): capture time, kernel nodes, graph memory, graph replays "
          "and --dot;\nrun inspect on a CUDA device for those.\n")  # fmt: skip
    print_variants(ex)
    label, sets = kernel_sets(ex)
    steps = f" {'steps':>6s}" if steps_ran else ""
    print(f"{'variant':12s} {'bucket':>6s} {'logprobs':>8s} {'spec_k':>6s}  "
          f"{'set':4s}{steps}".rstrip())  # fmt: skip
    for key, s in ex.graphs.steps.items():
        n = f" {s.replays:6d}" if steps_ran else ""  # the emulated replays: steps run
        print(f"{key.variant.value:12s} {key.bucket:6d} {str(key.logprobs):>8s} "
              f"{key.spec_k:6d}  {label[key]:4s}{n}".rstrip())  # fmt: skip
    print(f"\n{len(ex.graphs.steps)} keys; buckets {sorted({k.bucket for k in ex.graphs.steps})}")
    print_kernel_sets(sets, cuda=False)


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
