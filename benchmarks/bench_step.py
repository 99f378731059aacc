"""Decode-step latency with TinyLM, eager vs CUDA-graph replay, the host overhead, and a
server loop under churn (issue "Admission at server rate").

Steady (`--scenario steady`, the default): for each batch size B, B requests run decode
steps (none finishes while timed, so the batch plan is reused: the steady state); we time
`ex.step()` (wall, from the call to its return) in replay and in eager mode; `host_us` is
the host time the device waits for (on CUDA its idle time between steps, by CUDA events;
`measure` says exactly what counts), and the executor's own split of the step into host
work and its wait for the device (`ex.last_step_timing`) is kept beside it; those steps
do not read their outputs. `outputs_us` is measured on 20 more steps: what the caller
then pays to read all B outputs as `RequestOutput` objects (they are built lazily,
outside the step).

Churn (`--scenario churn`, or `all` for both; the loop and its measures are in
step_churn.py): an executor of `--churn-batch` slots runs a server's loop: before each
step it admits new requests while a slot is free (prompts of 4..64 seeded random tokens;
greedy, temperature and top-k/top-p rows; about 10% carry a small JSON-schema grammar; 1%
are aborted after a random number of their tokens), then steps and reads every output.
After `--churn-warmup` steps, `--churn-steps` are measured: tokens/s and steps/s (over the
loop's wall time), mean batch (decode rows per step), the gaps between a stream's
consecutive tokens (host time between the returns of the steps that carried them), the
time spent inside `add_request`. Workloads `short` (max_tokens uniform in 1..48) and
`long` (1..511, mean 256); each is compared with a steady reference on the same executor
at its mean batch, rounded (that many requests, nobody arriving, `--steps` timed steps of
the same loop). Targets: churn tokens/s >= 0.5x steady, p99 gap <= 3x the steady step,
admission mean < 50 us.

Results JSON (device, versions, date; the churn results under "churn") and a plot go to
benchmarks/results/; a markdown table is printed last.

    python benchmarks/bench_step.py [--batches 1 8 32 128 256] [--steps 50] [--out DIR]
    python benchmarks/bench_step.py --scenario churn [--churn-steps 2000] [--prefill-budget N]

Model (`--model PATH|CONFIG`; step_model.py): the steady scenario on a real model shape
(a checkpoint folder, or a config with seeded random weights: `qwen2.5-0.5b`,
`llama-3.2-1b` in benchmarks/configs/) instead of TinyLM, greedy, at B in 1 8 32 128 256:
replay vs eager, the batch-invariant step against the cuBLAS one, the speculative step
(n-gram, K = 3, every draft accepted) against the plain one, decode tokens/s, host time
the device waits for, and transformers' own `generate` with its static cache on the same
weights and batch; on CUDA also the step graph alone, the forward alone against the
memory floor, and the GPU's idle time per step, overlap on and off, quiet and beside
`--cpu-load` busy processes (step_replay.py); step-model-<name>-<device>-<date>.json.

    python benchmarks/bench_step.py --model qwen2.5-0.5b [--dtype bfloat16] [--max-seq-len 512]

Profile (`--scenario profile --model CONFIG [--cublas] [--prefetch-k K ...]`;
step_profile.py): the replayed decode forward at each B (default 1 32), kernel by kernel
(time, bytes, GB/s, the op and layer that launched it), against the weight-read floor
measured in the same run, once per GEMM L2-prefetch depth given;
step-profile-<model>-<device>-<date>.json.

    python benchmarks/bench_step.py --scenario profile --model llama-3.2-1b

CPU (`--scenario cpu --model smollm2|PATH`; step_cpu.py): graphexec's CPU route against
transformers, float32, one thread count: decode tokens/s, a 1,000-token prefill, and 16
concurrent 20-token prompts to their first tokens; step-cpu-<model>-<date>.json.

    python benchmarks/bench_step.py --scenario cpu --model smollm2 [--threads 2] [--reps 3]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import inspect
import json
import os
import statistics
import time

import plot_step
import step_cpu
import step_model
import step_profile
import torch
import triton
from step_churn import CHURN_VARIANTS, CHURNS, REF_PROMPT, churn_markdown, churn_section
from step_events import StepEvents, p90
from step_prefill import prefill_markdown, prefill_section
from step_replay import admit_batch, end_batch

import graphexec as gx
from graphexec.engine.graphs import GraphKey
from graphexec.params import SamplerVariant as SV

P = gx.SamplingParams
WORKLOADS = {
    "no_filter": lambda i: P(temperature=0.8, seed=i),
    "top_k_top_p": lambda i: P(temperature=0.8, top_k=50, top_p=0.9, seed=i),
}


def measure(ex: gx.DecodeExecutor, B: int, make, steps: int, mode: str | None,
            prompts: list[list[int]] | None = None) -> dict:  # fmt: skip
    """B requests in the steady state, `steps` timed steps of `ex.step(mode)`, then 20
    steps whose outputs are read. Per step (medians, host_us a mean; us):

    wall_us (wall_p90_us): `ex.step()` from the call to its return.
    host_us (host_p90_us): on CUDA, the host time the device waits for: the device's idle
        time between consecutive timed steps, from the end of step N's device work (its
        graph replay and output copies) to the start of step N + 1's graph replay, by
        CUDA events (step_events.StepEvents; `events` holds their stats). Host work that
        runs while the device is busy (with `overlap`, finishing N while N + 1 runs)
        counts nothing; the caller's loop, the executor's host work before the replay and
        any other host delay count when the device has run dry. Eager steps: the gaps
        between steps only. Without CUDA (a smoke run) nothing runs beside the host:
        host_us is host_work_us.
    host_work_us (host_work_p90_us), before_us, wait_us: the executor's own split of the
        step (`ex.last_step_timing`): its host work before and after its wait for the
        device, the part before, and the wait.
    outputs_us: what the caller pays to read all B outputs as `RequestOutput` objects.
    """
    admit_batch(ex, B, make, prompts, steps, mode)
    gc.collect()
    cuda = ex.device.type == "cuda"
    stamps = StepEvents(ex, steps) if cuda else contextlib.nullcontext()
    walls, host, wait, before = [], [], [], []
    with stamps:
        for _ in range(steps):
            t0 = time.perf_counter()
            outs = ex.step(mode)
            walls.append(time.perf_counter() - t0)
            host.append(ex.last_step_timing.host)
            wait.append(ex.last_step_timing.wait)
            before.append(ex.last_step_timing.before)
            assert len(outs) == B
    built = []
    for _ in range(20):  # then what a caller pays to read every output as an object
        outs = ex.step(mode)
        t1 = time.perf_counter()
        assert len(list(outs)) == B
        built.append(time.perf_counter() - t1)
    end_batch(ex, B, ("b",), mode)
    med = statistics.median
    out = dict(wall_us=med(walls) * 1e6, wall_p90_us=p90(walls) * 1e6,
               host_work_us=med(host) * 1e6, host_work_p90_us=p90(host) * 1e6,
               wait_us=med(wait) * 1e6, outputs_us=med(built) * 1e6,
               before_us=med(before) * 1e6)  # fmt: skip
    if cuda:
        ev = out["events"] = stamps.stats()
        out.update(host_us=ev["idle_us"], host_p90_us=ev["idle_p90_us"])
    else:
        out.update(host_us=out["host_work_us"], host_p90_us=out["host_work_p90_us"])
    return out


# ------------------------------------------------------- churn (the loop: step_churn.py)


def prefill_budget(given: int | None) -> tuple[dict, int | None]:
    """DecodeExecutor's keyword for --prefill-budget (none when not given), and the budget
    the executor runs with (its default when not given; None where it has no such argument)."""
    param = inspect.signature(gx.DecodeExecutor).parameters.get("prefill_budget")
    if given is None:
        return {}, None if param is None or param.default is param.empty else param.default
    if param is None:
        raise SystemExit("--prefill-budget: this checkout's DecodeExecutor has no prefill_budget")
    return dict(prefill_budget=given), given


def run_churn(args) -> dict:
    """The churn executor (TinyLM at cl100k, --churn-batch slots, the churn keys captured;
    positions for the longest churn request and for the reference), then its section."""
    opts, budget = prefill_budget(args.prefill_budget)
    tok = gx.Tokenizer.cl100k()
    longest = max(c.prompt_len[1] + c.max_tokens[1] for c in CHURNS)
    model = gx.models.TinyLM(tok.vocab_size, seed=0,
                             max_seq_len=max(longest, REF_PROMPT + args.steps + 64))  # fmt: skip
    ex = gx.DecodeExecutor(model, max_batch_size=args.churn_batch, device=args.device,
                           tokenizer=tok, seed=0, **opts)  # fmt: skip
    keys = [GraphKey(SV(v), b, False) for v in CHURN_VARIANTS for b in ex.buckets]
    t0 = time.perf_counter()
    ex.capture(keys, progress=False)
    capture_s = time.perf_counter() - t0
    section = churn_section(ex, CHURNS, args.churn_steps, args.churn_warmup, args.steps, args.seed,
                            args.churn_repeats)  # fmt: skip
    model_info = dict(name="TinyLM", vocab=tok.vocab_size, dim=model.dim,
                      layers=model.num_layers, max_seq_len=model.max_seq_len)  # fmt: skip
    return dict(section, prefill_budget=budget, capture_s=capture_s,
                keys=[str(k) for k in keys], model=model_info)  # fmt: skip


def run_prefill(args) -> tuple[str, dict]:
    """The long-prompt scenario (step_prefill.py) on TinyLM, or on --model's model; its
    own JSON, step-prefill-<model>-<device>-<date>.json."""
    streams, plen = args.prefill_streams, args.prefill_prompt_len
    need = max(plen + 8, 2 * args.steps + 16)
    if args.model is not None:
        name, cfg, folder = step_model.resolve(args.model)
        model, _ = step_model.load(cfg, folder, args.device, step_model.DTYPES[args.dtype],
                                   need, args.seed, batch_invariant=not args.cublas)  # fmt: skip
        name += "-cublas" if args.cublas else ""
        tok = None
    else:
        name, tok = "tinylm", gx.Tokenizer.cl100k()
        model = gx.models.TinyLM(tok.vocab_size, seed=0, max_seq_len=need)
    ex = gx.DecodeExecutor(model, max_batch_size=streams + 8, device=args.device,
                           tokenizer=tok, seed=0)  # fmt: skip
    ex.capture([GraphKey(SV("no_filter"), b, False) for b in ex.buckets], progress=False)
    section = prefill_section(ex, args.prefill_budgets, streams, plen, args.prefill_every,
                              args.steps, args.seed)  # fmt: skip
    result = dict(header(args.device), scenario="prefill", model=name,
                  max_seq_len=model.max_seq_len, prefill=section)  # fmt: skip
    os.makedirs(args.out, exist_ok=True)
    dev = result["device"].lower().replace(" ", "-")
    path = os.path.join(args.out, f"step-prefill-{name}-{dev}-{result['date']}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    return path, result


# ----------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scenario", choices=("steady", "churn", "all", "prefill", "cpu",
                                           "profile", "spec"),
                    default="steady", help="steady: the step at fixed batches (default); "
                    "churn: the server loop with arrivals (added to the day's JSON); all: "
                    "both; prefill: running streams' worst gap while long prompts arrive "
                    "(TinyLM or --model); cpu: the CPU route against transformers "
                    "(--model smollm2|PATH); profile: the replayed forward of --model "
                    "kernel by kernel against the weight-read floor; spec: --model's "
                    "speculative step alone, printed (for A/B runs: nothing is "
                    "written)")  # fmt: skip
    ap.add_argument("--prefill-budgets", type=int, nargs="+", default=[256, 1024, 4096],
                    help="prefill scenario: the budgets compared")  # fmt: skip
    ap.add_argument("--prefill-streams", type=int, default=32,
                    help="prefill scenario: running streams")  # fmt: skip
    ap.add_argument("--prefill-prompt-len", type=int, default=3000,
                    help="prefill scenario: tokens per arriving prompt")  # fmt: skip
    ap.add_argument("--prefill-every", type=int, default=8,
                    help="prefill scenario: steps between arrivals")  # fmt: skip
    ap.add_argument("--batches", type=int, nargs="+", default=None,
                    help="default 1 8 32 128 256 (with --model: 1 8 32 128)")  # fmt: skip
    ap.add_argument("--steps", type=int, default=200,
                    help="timed steps per steady row and per churn reference")  # fmt: skip
    ap.add_argument("--churn-steps", type=int, default=2000, help="measured churn steps")
    ap.add_argument("--churn-warmup", type=int, default=256, help="churn steps before those")
    ap.add_argument("--churn-batch", type=int, default=64, help="the churn executor's slots")
    ap.add_argument("--churn-repeats", type=int, default=1,
                    help="runs of each churn workload and its reference; the JSON's row is "
                    "the median run, judged on the median ratios")  # fmt: skip
    ap.add_argument("--prefill-budget", type=int, default=None,
                    help="DecodeExecutor(prefill_budget=) for the churn executor; default: "
                    "not passed (the executor's default)")  # fmt: skip
    ap.add_argument("--seed", type=int, default=0,
                    help="the churn arrivals' seed (--model: weights' and prompts')")  # fmt: skip
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                    help="cpu: a smoke run (its timings are not performance; --scenario cpu "
                    "is the CPU benchmark)")  # fmt: skip
    ap.add_argument("--out", default="benchmarks/results")
    m = ap.add_argument_group("model (--model: step_model.py)")
    m.add_argument("--model", default=None, metavar="PATH|CONFIG",
                   help="a checkpoint folder (config.json + safetensors), a config .json, "
                   "or a name in benchmarks/configs (qwen2.5-0.5b, llama-3.2-1b: random "
                   "weights)")  # fmt: skip
    m.add_argument("--dtype", choices=sorted(step_model.DTYPES), default="bfloat16")
    m.add_argument("--max-seq-len", type=int, default=512,
                   help="positions per slot (ours), transformers' static cache length")  # fmt: skip
    m.add_argument("--prompt-len", type=int, default=16, help="tokens per prompt")
    m.add_argument("--hf-modes", type=lambda s: [x for x in s.split(",") if x and x != "off"],
                   default=list(step_model.MODES),
                   help="transformers generate modes, comma-separated: default (as it runs: "
                   "auto-compiled on CUDA), eager (disable_compile); 'off': none")  # fmt: skip
    m.add_argument("--hf-tokens", type=int, nargs=2, default=[32, 160], metavar=("N1", "N2"),
                   help="new tokens of the two timed generate calls (prefill cancels)")  # fmt: skip
    m.add_argument("--hf-reps", type=int, default=3, help="timed generate calls per length")
    m.add_argument("--hf-batches", type=int, nargs="+", default=None,
                   help="time transformers at these batches only (default: every one)")  # fmt: skip
    m.add_argument("--prefetch-k", type=int, nargs="+", default=None, metavar="K",
                   help="profile scenario: one profile per MatmulConfig.prefetch_k value")
    m.add_argument("--cublas", action="store_true", help="prefill and profile scenarios: "
                   "HFTransformer(batch_invariant=False), cuBLAS GEMMs")  # fmt: skip
    m.add_argument("--spec-max-batch", type=int, default=32,
                   help="the speculative step is timed at the batches up to this")  # fmt: skip
    m.add_argument("--replays", type=int, default=30,
                   help="CUDA: replays timed of the step graph alone and of the forward "
                   "alone, per B")  # fmt: skip
    m.add_argument("--cpu-load", type=int, default=os.cpu_count() or 1, metavar="N",
                   help="CUDA: the idle passes again beside N busy processes (default: "
                   "the host's cores; 0: no loaded pass)")  # fmt: skip
    m.add_argument("--idle-repeats", type=int, default=5, metavar="N",
                   help="CUDA: each loaded idle pass runs N loops of --steps (default 5)")
    m.add_argument("--engine-nice", type=int, default=-10, metavar="N",
                   help="CUDA: one more loaded pass with this process at nice N (needs "
                   "CAP_SYS_NICE below 0; refused: no row; 0: no pass)")  # fmt: skip
    c = ap.add_argument_group("--scenario cpu --model smollm2|PATH (step_cpu.py)")
    c.add_argument("--threads", type=int, default=torch.get_num_threads(),
                   help="torch threads, the same for both sides")  # fmt: skip
    c.add_argument("--decode-tokens", type=int, default=32, help="timed greedy tokens")
    c.add_argument("--prefill-len", type=int, default=1000, help="prompt tokens prefilled")
    c.add_argument("--reps", type=int, default=3, help="repetitions of each measure")
    c.add_argument("--label", default=None, help="the model's name in the results file "
                   "(default: smollm2, or the checkpoint folder's name)")  # fmt: skip
    m.add_argument("--time-budget", type=float, default=None, metavar="S",
                   help="skip transformers rows that would start after S seconds")  # fmt: skip
    args = ap.parse_args(argv)
    bad = [x for x in args.hf_modes if x not in step_model.MODES]
    if bad:
        ap.error(f"--hf-modes: unknown {bad}; choose from {list(step_model.MODES)} or off")
    if args.hf_tokens[0] >= args.hf_tokens[1] or args.hf_tokens[0] < 1:
        ap.error("--hf-tokens N1 N2 needs 1 <= N1 < N2")
    if args.steps < 2 or args.replays < 2 or args.cpu_load < 0 or args.idle_repeats < 1:
        ap.error("--steps and --replays need >= 2 (idle is between steps), --cpu-load >= 0, "
                 "--idle-repeats >= 1")
    if args.batches is None:
        args.batches = [1, 8, 32, 128, 256]
    return args


def run_steady(args) -> dict:
    tok = gx.Tokenizer.cl100k()
    model = gx.models.TinyLM(tok.vocab_size, seed=0, max_seq_len=args.steps + 96)
    mb = max(args.batches)
    ex = gx.DecodeExecutor(model, max_batch_size=mb, device=args.device, tokenizer=tok, seed=0,
                           buckets=sorted(set(args.batches)))  # fmt: skip
    keys = [GraphKey(SV(v), b, False) for v in WORKLOADS for b in args.batches]
    t0 = time.perf_counter()
    ex.capture(keys)
    capture_s = time.perf_counter() - t0
    rows = []
    for name, make in WORKLOADS.items():
        for B in args.batches:
            r = dict(workload=name, batch=B)
            r["replay"] = measure(ex, B, make, args.steps, None)
            r["eager"] = measure(ex, B, make, args.steps, "eager")
            r["speedup"] = r["eager"]["wall_us"] / r["replay"]["wall_us"]
            rows.append(r)
            rp = r["replay"]
            print(f"{name:12s} B={B:4d} replay {rp['wall_us']:8.1f} us (host "
                  f"{rp['host_us']:6.1f}, outputs {rp['outputs_us']:6.1f}) eager "
                  f"{r['eager']['wall_us']:8.1f} us x{r['speedup']:.2f}", flush=True)  # fmt: skip
    return dict(capture_s=capture_s, keys=[str(k) for k in keys], model=dict(name="TinyLM",
                vocab=tok.vocab_size, dim=model.dim, layers=model.num_layers,
                max_seq_len=model.max_seq_len), steps=args.steps, rows=rows)  # fmt: skip


def header(device: str) -> dict:
    dev = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    out = dict(device=dev, date=datetime.date.today().isoformat(), torch=torch.__version__,
               triton=triton.__version__, graphexec=gx.__version__)  # fmt: skip
    if os.environ.get("GRAPHEXEC_COMMIT"):  # set by benchmarks/gpu/run.sh
        out["commit"] = os.environ["GRAPHEXEC_COMMIT"]
    return out


def write(result: dict, out: str, keep_rows: bool) -> tuple[str, dict]:
    """Write step-<device>-<date>.json; with keep_rows (a churn-only run) the steady rows of
    an existing file of that name stay (header and churn are this run's)."""
    os.makedirs(out, exist_ok=True)
    stem = f"step-{result['device'].lower().replace(' ', '-')}-{result['date']}"
    path = os.path.join(out, stem + ".json")
    if keep_rows and os.path.exists(path):
        with open(path) as f:
            result = {**json.load(f), **result}
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    return path, result


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.scenario == "cpu":  # the CPU route against transformers, whatever --device says
        if args.model is None:
            raise SystemExit("--scenario cpu needs --model smollm2|PATH")
        result = step_cpu.run(args)
        print(f"wrote {step_cpu.write(result, args.out)}")
        print(step_cpu.markdown(result))
        return
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench_step.py measures CUDA graphs: it needs a GPU "
                         "(--device cpu runs a smoke test)")  # fmt: skip
    result = header(args.device)
    if args.scenario == "profile":
        if args.model is None:
            raise SystemExit("--scenario profile needs --model CONFIG|PATH")
        path, result = step_profile.run(args, result, step_model.resolve, step_model.load,
                                        step_model.DTYPES)  # fmt: skip
        print(f"wrote {path}")
        print(step_profile.markdown(result))
        return
    if args.scenario == "spec":
        if args.model is None:
            raise SystemExit("--scenario spec needs --model CONFIG|PATH")
        step_model.run_spec_only(args)
        return
    if args.scenario == "prefill":
        path, result = run_prefill(args)
        print(f"wrote {path}")
        plot_step.plot(path)
        print(prefill_markdown(result["prefill"]))
        return
    if args.model is not None:
        if args.scenario != "steady":
            raise SystemExit("--model runs the steady or the prefill scenario only")
        path, result = step_model.run(args, measure, result)
        print(f"wrote {path}")
        plot_step.plot(path)
        print(step_model.markdown(result))
        return
    if args.scenario != "churn":
        result.update(run_steady(args))
    if args.scenario != "steady":
        result["churn"] = run_churn(args)
    path, result = write(result, args.out, keep_rows=args.scenario == "churn")
    print(f"wrote {path}")
    if "rows" in result:
        plot(result, path[: -len(".json")] + ".png")
    print(markdown(result))


def plot(result: dict, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot")
        return
    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    for name in WORKLOADS:
        rs = [r for r in result["rows"] if r["workload"] == name]
        bs = [r["batch"] for r in rs]
        ax[0].plot(bs, [r["replay"]["wall_us"] for r in rs], "o-", label=f"{name} replay")
        ax[0].plot(bs, [r["eager"]["wall_us"] for r in rs], "x--", label=f"{name} eager")
        ax[1].plot(bs, [r["replay"]["host_us"] for r in rs], "o-", label=name)
    ax[0].set(xscale="log", yscale="log", xlabel="batch", ylabel="us / step",
              title="decode step (TinyLM), wall")  # fmt: skip
    ax[1].set(xscale="log", xlabel="batch", ylabel="us / step",
              title="host overhead around the replay")  # fmt: skip
    ax[1].axhline(100, color="grey", lw=0.8, ls=":")
    for a in ax:
        a.legend(fontsize=7)
        a.grid(alpha=0.3)
    fig.suptitle(f"{result['device']}, {result['date']}, torch {result['torch']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def markdown(result: dict) -> str:
    """The steady table (when the result has rows), then the churn table (when it has one)."""
    parts = []
    if result.get("rows"):
        lines = ["| workload | B | replay us | eager us | eager / replay | host us (replay) "
                 "| reading outputs us |", "|---|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
        for r in result["rows"]:
            rp = r["replay"]
            lines.append(f"| {r['workload']} | {r['batch']} | {rp['wall_us']:.0f} | "
                         f"{r['eager']['wall_us']:.0f} | {r['speedup']:.1f}x | "
                         f"{rp['host_us']:.0f} | {rp['outputs_us']:.0f} |")  # fmt: skip
        parts.append("\n".join(lines))
    if result.get("churn"):
        parts.append(churn_markdown(result["churn"]))
    return "\n\n".join(parts)


if __name__ == "__main__":
    main()
