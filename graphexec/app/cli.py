"""`python -m graphexec demo|serve|inspect|determinism|bench`: the decode demo, the
OpenAI-compatible server, the graphs' table, the determinism check, benchmarks. Every
subcommand takes the same --model values (`graphexec.models.choice`).

The CLI, not the library, chooses torch's CPU thread count: `import graphexec` changes no
process-wide setting, so an embedding engine keeps its own.
"""

from __future__ import annotations

import argparse
import logging
import runpy
import sys
from pathlib import Path

from graphexec.runtime.threads import (  # noqa: F401 (the CLI's helpers, also for tools/)
    add_threads_argument,
    available_cores,
    configure_threads,
    cpu_threads,
    idle_cores,
    positive_int,
)

log = logging.getLogger("graphexec.app.cli")

BENCHES = {
    "step": "the executor's decode step (TinyLM or --model): replay vs eager, host overhead (CUDA)",
    "sampler": "one sampler call per method, side by side, against the memory floor",
    "verify": "speculative verification alone, side by side, against the memory floor",
    "serve": "the OpenAI-compatible server under load against the executor driven directly",
}


def _default_device(device: str | None) -> str:
    import torch

    return device or ("cuda" if torch.cuda.is_available() else "cpu")


def benchmarks_dir() -> Path:
    """benchmarks/ beside the package in a source checkout (the scripts are not installed)."""
    return Path(__file__).resolve().parents[2] / "benchmarks"


def _pop_option(argv: list[str], name: str) -> tuple[list[str], str | None]:
    """argv without `name VALUE` / `name=VALUE`, and its value (the last one given)."""
    rest, value, it = [], None, iter(argv)
    for a in it:
        if a == name:
            value = next(it, None)
            if value is None:
                raise SystemExit(f"graphexec bench: {name} needs a value")
        elif a.startswith(name + "="):
            value = a.split("=", 1)[1]
        else:
            rest.append(a)
    return rest, value


def bench(argv: list[str]) -> int:
    """Run benchmarks/bench_<name>.py as its own script would run, with `argv` passed on
    to its parser (its --help included); `--threads N` is taken out first."""
    usage = (
        "usage: graphexec bench [step|sampler|verify|serve] [--threads N] [ARGS...]\n\n"
        "Runs benchmarks/bench_<name>.py of a source checkout (step by default); ARGS go\n"
        "to the script's own parser: `graphexec bench sampler --help` lists them.\n"
        "Benchmarks need CUDA: CPU timings are a smoke run, not performance numbers.\n\n"
        + "\n".join(f"  {k:8s} {v}" for k, v in BENCHES.items())
        + "\n\nthe step benchmark's options follow.\n"
    )  # fmt: skip
    argv, threads = _pop_option(argv, "--threads")
    name = "step"
    if argv and not argv[0].startswith("-"):
        name, argv = argv[0], argv[1:]
        if name not in BENCHES:
            print(f"graphexec bench: no benchmark {name!r}; choose one of {list(BENCHES)}",
                  file=sys.stderr)  # fmt: skip
            return 2
    elif argv[:1] in (["-h"], ["--help"]):
        print(usage)
    script = benchmarks_dir() / f"bench_{name}.py"
    if not script.is_file():
        print(f"graphexec bench: {script} not found. The benchmark scripts are not installed "
              "with the package: they live in benchmarks/ of a source checkout; clone the "
              "repository and `pip install -e .` it to run them.", file=sys.stderr)  # fmt: skip
        return 2
    try:
        n = None if threads is None else positive_int(threads)
    except (ValueError, argparse.ArgumentTypeError) as e:
        print(f"graphexec bench: --threads: {e}", file=sys.stderr)
        return 2
    _, device = _pop_option(argv, "--device")
    configure_threads(_default_device(device), n)
    return run_script(script, [f"graphexec bench {name}", *argv])


def run_script(script: Path, argv: list[str]) -> int:
    """Run `script` as __main__ with sys.argv = argv; its exit status (its siblings import)."""
    saved_argv, saved_path = sys.argv, list(sys.path)
    sys.argv = argv
    sys.path.insert(0, str(script.parent))
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)
        return 1
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if argv[:1] == ["bench"]:  # before argparse: everything after it is the script's
        return bench(argv[1:])
    from graphexec.app import determinism
    from graphexec.models.choice import add_model_argument

    parser = argparse.ArgumentParser(prog="graphexec")
    sub = parser.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="the decode loop on a mixed workload, replay vs eager")
    add_model_argument(d, None, "smollm2 once `graphexec models smollm2` has set it up, else tiny")
    d.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="weights and activations (auto: the checkpoint config's dtype on "
                   "CUDA, float32 on the CPU)")  # fmt: skip
    d.add_argument("--max-seq-len", type=positive_int, default=None, metavar="N",
                   help="positions per request, prompt + output (default: TinyLM 256; a "
                   "checkpoint or config min(max_position_embeddings, 4096 GPU, 1024 "
                   "CPU))")  # fmt: skip
    d.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    d.add_argument("--max-batch-size", type=int, default=None,
                   help="default 64 GPU; CPU: 8, a checkpoint 2")  # fmt: skip
    d.add_argument("--requests", type=int, default=None,
                   help="default: GPU 24 mixed requests or one per chat prompt (a chat model); "
                   "CPU 8 mixed requests or 2 chat prompts")  # fmt: skip
    d.add_argument("--latency-steps", type=int, default=None,
                   help="steps timed for the step latency (default 10 GPU, 3 CPU)")  # fmt: skip
    d.add_argument("--seed", type=int, default=0, help="weights (random models) and requests")
    d.add_argument(
        "--quiet",
        action="store_true",
        help="no progress bars (there are none unless stderr is a terminal)",
    )
    d.add_argument("--speculative", dest="speculative_runs", default=None,
                   choices=["all", "ngram", "draft", "none"],
                   help="the speculative runs (default all; on the CPU a checkpoint's is "
                   "ngram)")  # fmt: skip
    d.add_argument("--no-speculative", dest="speculative", action="store_false",
                   help="skip the speculative-decoding runs (= --speculative none)")  # fmt: skip
    add_threads_argument(d)
    c = sub.add_parser("determinism", help="replay vs eager per graph key, and a real model's "
                       "batch invariance, bit for bit; exit 1 on a mismatch",
                       description=determinism.__doc__.split("\n\n")[0],
                       epilog=determinism.__doc__.split("\n\n", 1)[1],
                       formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    determinism.add_arguments(c)
    i = sub.add_parser("inspect", help="capture and print one row per graph key")
    from graphexec.app.inspection import add_arguments

    add_arguments(i)
    sub.add_parser("bench", add_help=False,
                   help="run a benchmark: bench [step|sampler|verify|serve] [ARGS...]")  # fmt: skip
    s = sub.add_parser("serve", help="an OpenAI-compatible server (/v1/completions, "
                       "/v1/chat/completions) over the executor")  # fmt: skip
    from graphexec.serve.server import add_arguments as add_serve_arguments

    add_serve_arguments(s)
    m = sub.add_parser("models", help="download and convert a real model into the cache: "
                       "models smollm2 (10-15 s)")  # fmt: skip
    from graphexec.checkpoints.smollm2 import add_arguments as add_models_arguments

    add_models_arguments(m)
    args = parser.parse_args(argv)
    if args.cmd == "models":  # sets no threads: the conversion is numpy
        from graphexec.checkpoints.smollm2 import models_command

        return models_command(args)
    if args.cmd == "determinism":  # it sets the threads itself (also as its own script)
        return determinism.check(determinism.fill_defaults(args))
    if args.cmd == "serve":  # serve fixes the engines' threads and logs them (one line)
        from graphexec.serve.server import serve

        return serve(args)
    configure_threads(_default_device(args.device), args.threads)
    if args.cmd == "demo":
        from graphexec.app.demo import demo

        return demo(args)
    from graphexec.app.inspection import inspect_graphs

    return inspect_graphs(args)
