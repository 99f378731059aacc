"""The model scenario of `bench_step.py --model`: the decode step of a real model shape,
replay vs eager, the batch-invariant forward against the cuBLAS one, the speculative
step against the plain one, and transformers' own `generate` (static cache) on the same
weights and batch.

`--model` names a checkpoint folder (config.json + safetensors: `HFTransformer.
from_pretrained`), a config .json, or a config in benchmarks/configs/ by name
(`qwen2.5-0.5b`, `llama-3.2-1b`: the public config.json of each); a config gets seeded
random weights (`graphexec.models.hf_random`) made on the device, in `--dtype`.

Ours: `DecodeExecutor` over `HFTransformer`, buckets = the batches, the greedy
`no_filter` key captured per bucket; B requests of `--prompt-len` seeded random tokens
(temperature 0, no EOS); `bench_step.measure` times `ex.step()` replayed and eager (wall,
and `host_us`: the host time the device waits for, its idle time between steps by CUDA
events). Decode tokens/s = B / replayed step wall. Ours is
the default, batch-invariant HFTransformer; the same executor over
HFTransformer(batch_invariant=False) (cuBLAS GEMMs) is timed replayed beside it, the
two executors' steps interleaved (`run_paired`): invariant_cost = invariant step /
cuBLAS step, both from that paired run.

On the device (CUDA; step_replay.py), per B: `replay.graph_us`, the captured step graph
of the batch's key alone, and `replay.forward_us`, the model's forward alone (its decode
on the same inputs, captured in its own graph), each the median of `--replays` replays
queued back to back and timed by CUDA events; `floor_us`, the bytes the step must read
(GEMM weights, LM head, the rows' live keys and values: step_floor.py) at the read
bandwidth measured at the start of the run (`read_gb_s`: its fastest read), and
`forward_over_floor` = forward_us / floor_us; `replay.idle` (means in `replay.idle_us`):
the GPU's idle time between steps (`step_events.StepEvents`), mean, median and p90, and
the wall per step, with EngineConfig.overlap on and off (`on`, `off`) and on with the
other blocking_wait (`on_spin` or `on_block`), then again beside `--cpu-load` busy
Python processes (`on_loaded`, `off_loaded`, `on_loaded_spin`; default: one per core of
the host), and once more with this process at nice `--engine-nice` (`on_loaded_nice`;
where the OS allows it); each loaded pass `--idle-repeats` loops of `--steps`, since a
few multi-ms stalls make its mean.

Speculative (B <= `--spec-max-batch`, 32): the invariant model with n-gram speculation,
K = 3; each request repeats one token (a prompt of that token, a +100 logit bias on it,
greedy), so the drafter proposes at every step (one draft: in a constant history the
latest earlier match has one successor, which is accepted) and every timed step replays
the spec_k = 3 key: one forward over K + 1 = 4 tokens a row, then verification (the
rows' pads cost what drafts cost). spec_vs_plain = that step's replayed wall / the plain
step's at the same B; `spec_key_steps` counts the timed steps that ran the spec_k = 3 key;
on CUDA `events` (as `replay.idle`): the GPU's idle time between launches (the drafts are
made on the device, so a speculative step launches before the one before it is
collected, as a plain step does). `spec.masked`: the same with a bad word on every row
(token 0 twice): rows whose token mask the host rewrites per offset from their last
tokens and drafts, as a grammar's: split steps (the forward launched before the step
before is collected, the masks written while it runs, then the draw).

transformers: `AutoModelForCausalLM.from_config` on the device, `load_state_dict` of the
same weights (or `from_pretrained` of the same folder); per B, the same prompts,
`generate(..., do_sample=False, max_new_tokens=N, min_new_tokens=N,
cache_implementation="static", max_cache_len=--max-seq-len, pad_token_id=0)` timed at
N1 and N2 new tokens (`--hf-tokens`), so prefill and per-call work cancel: tokens/s =
B * (N2 - N1) / (t(N2) - t(N1)), medians of `--hf-reps` calls each, after warm-up calls.
Mode `default` is generate as it runs by default: on CUDA transformers then compiles the
decoding forward (`torch.compile`, its CompileConfig: mode "reduce-overhead", CUDA
graphs) when the static cache allows (`_valid_auto_compile_criteria`); each row records
whether it did and with which config. Mode `eager` passes `disable_compile=True`.

Targets (TARGETS): the invariant step within 1.10x of the cuBLAS step at every B; the
speculative step (4 tokens a row) within 1.5x of the plain step at every B <= 32; at B=32
our tokens/s >= 2x transformers' `default` generate; replayed step at B=1 >= 3x faster
than eager; host time the device waits for < 100 us a step at B=128.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import os
import statistics
import time
from pathlib import Path

import step_events
import step_replay
import torch
from step_floor import read_bandwidth
from step_transformers import MODES, run_transformers

import graphexec as gx
from graphexec.engine.graphs import GraphKey
from graphexec.models.hf_random import random_state_dict
from graphexec.params import SamplerVariant as SV

CONFIGS = Path(__file__).resolve().parent / "configs"
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
TARGETS = dict(invariant_cost=1.10, spec_vs_plain=1.5, vs_transformers_b32=2.0,
               replay_speedup_b1=3.0, host_us_b128=100.0)  # fmt: skip
AT_MOST = ("invariant_cost", "spec_vs_plain", "host_us_b128")


def resolve(spec: str) -> tuple[str, dict, Path | None]:
    """(name, config dict, checkpoint folder or None) for --model."""
    p = Path(spec)
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise SystemExit(f"--model {spec!r}: a folder without config.json")
        return p.resolve().name, json.loads((p / "config.json").read_text()), p
    if p.suffix == ".json" and p.is_file():
        return p.stem, json.loads(p.read_text()), None
    named = CONFIGS / f"{spec}.json"
    if named.is_file():
        return spec, json.loads(named.read_text()), None
    names = sorted(f.stem for f in CONFIGS.glob("*.json"))
    raise SystemExit(f"--model {spec!r}: not a checkpoint folder, a config .json or one of "
                     f"{names}")  # fmt: skip


def free(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


# ------------------------------------------------------------------------------ ours


def steady_executor(args, model, prompt_len: int) -> tuple[gx.DecodeExecutor, dict]:
    """An executor over `model` with the greedy no_filter key captured per batch."""
    mb = max(args.batches)
    ex = gx.DecodeExecutor(model, max_batch_size=mb, device=args.device, seed=0,
                           buckets=sorted(set(args.batches)),
                           prefill_budget=max(1024, mb * prompt_len))  # fmt: skip
    keys = [GraphKey(SV("no_filter"), b, False) for b in sorted(set(args.batches))]
    t0 = time.perf_counter()
    ex.capture(keys, progress=False)
    info = dict(capture_s=time.perf_counter() - t0, keys=[str(k) for k in keys],
                capture_failed={str(k): e for k, e in ex.stats.failed.items()})  # fmt: skip
    return ex, info


def greedy(i: int) -> gx.SamplingParams:
    return gx.SamplingParams(temperature=0.0, seed=i, ignore_eos=True)


def run_ours(args, measure, model, prompts: torch.Tensor,
             bandwidth: float | None = None) -> tuple[list[dict], dict]:  # fmt: skip
    """Replay and eager rows per batch (bench_step.measure) on an executor over `model`;
    on CUDA the device measures too (`step_replay.device_section`, the floor at
    `bandwidth` bytes/s)."""
    ex, info = steady_executor(args, model, prompts.shape[1])
    info["overlap"] = ex.overlap  # the replay and eager rows' setting
    listed = prompts.tolist()
    rows = []
    for B in args.batches:
        r = dict(batch=B)
        try:
            r["replay"] = measure(ex, B, greedy, args.steps, None, prompts=listed)
            r["eager"] = measure(ex, B, greedy, args.steps, "eager", prompts=listed)
        except Exception as e:  # one batch failing (out of memory) keeps the others
            rows.append(dict(batch=B, error=f"{type(e).__name__}: {str(e)[:400]}"))
            print(f"ours B={B:4d} failed: {rows[-1]['error']}", flush=True)
            with contextlib.suppress(Exception):  # end what was admitted
                step_replay.end_batch(ex, B)
            continue
        r["speedup"] = r["eager"]["wall_us"] / r["replay"]["wall_us"]
        r["tokens_per_s"] = B / r["replay"]["wall_us"] * 1e6
        r["eager_tokens_per_s"] = B / r["eager"]["wall_us"] * 1e6
        rows.append(r)
        rp = r["replay"]
        print(f"ours B={B:4d} replay {rp['wall_us']:9.1f} us (host {rp['host_us']:6.1f}) eager "
              f"{r['eager']['wall_us']:9.1f} us x{r['speedup']:.2f}  {r['tokens_per_s']:9.0f} "
              "tok/s", flush=True)  # fmt: skip
        if bandwidth is not None:
            step_replay.device_section(r, args, measure, ex, model, greedy, listed, bandwidth)
            print(f"device B={B:4d} {step_replay.summary(r)}", flush=True)
    info["replays"] = {str(k): n for k, n in ex.stats.replays.items()}
    info["eager_steps"] = {str(k): n for k, n in ex.stats.eager_steps.items()}
    return rows, info


def run_paired(args, models: dict, prompts: torch.Tensor) -> dict[int, dict[str, float]]:
    """Replayed step wall per B of each model in `models` (name: model), their steps
    interleaved (one of each in turn, the same requests) so that drift of the host or
    the GPU's clocks lands on both alike; medians of --steps steps each."""
    exs = {name: steady_executor(args, m, prompts.shape[1])[0] for name, m in models.items()}
    listed, out = prompts.tolist(), {}
    for B in args.batches:
        try:
            for ex in exs.values():
                for i in range(B):
                    ex.add_request(f"p{i}", listed[i], dataclasses.replace(
                        greedy(i), max_tokens=args.steps + 8))  # fmt: skip
            for _ in range(3):
                for ex in exs.values():
                    ex.step()
            walls: dict[str, list[float]] = {name: [] for name in exs}
            for _ in range(args.steps):
                for name, ex in exs.items():
                    t0 = time.perf_counter()
                    ex.step()
                    walls[name].append(time.perf_counter() - t0)
        except Exception as e:  # out of memory at one B keeps the others
            print(f"paired B={B:4d} failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
            walls = {}
        for ex in exs.values():
            with contextlib.suppress(Exception):
                for i in range(B):
                    ex.abort(f"p{i}")
                ex.step()
        if walls:
            out[B] = {name: statistics.median(w) * 1e6 for name, w in walls.items()}
            print(f"paired B={B:4d} " + "  ".join(f"{n} {us:9.1f} us" for n, us in
                                                  out[B].items()), flush=True)  # fmt: skip
    return out


def run_spec(args, model, batches: list[int], masked: bool = False) -> list[dict]:
    """The speculative step (module docstring): replayed wall per step and tokens per
    step, at each B of `batches`. `masked`: every row also has a bad word (token 0
    twice), a token mask the host rewrites per offset from the row's last tokens and
    drafts (the split step of rows with a grammar or bad words)."""
    k, steps = 3, min(args.steps, 40)
    mb = max(batches)
    ex = gx.DecodeExecutor(model, max_batch_size=mb, device=args.device, seed=0,
                           buckets=sorted(set(batches)),
                           speculative=gx.SpeculativeConfig(k, drafter="ngram"))  # fmt: skip
    ex.capture([GraphKey(SV("no_filter"), b, False, s) for b in sorted(set(batches))
                for s in (0, k)], progress=False)  # fmt: skip
    rows = []
    bad = [[0, 0]] if masked else []
    for B in batches:
        for i in range(B):
            t = 1 + 37 * i % (model.vocab_size - 1)
            p = gx.SamplingParams(temperature=0.0, seed=i, ignore_eos=True, logit_bias={t: 100.0},
                                  max_tokens=(steps + 8) * (k + 1), bad_words=bad)  # fmt: skip
            ex.add_request(f"s{i}", [t] * args.prompt_len, p)
        for _ in range(3):
            ex.step()
        before = sum(n for key, n in ex.stats.replays.items() if key.spec_k == k)
        walls, emitted = [], []
        # on CUDA the device's idle time between the launches too
        stamps = (step_events.StepEvents(ex, steps) if args.device == "cuda"
                  else contextlib.nullcontext())  # fmt: skip
        with stamps:
            for _ in range(steps):
                t0 = time.perf_counter()
                outs = ex.step()
                walls.append(time.perf_counter() - t0)
                emitted.append(len(outs))
        for i in range(B):
            ex.abort(f"s{i}")
        ex.step()
        spec_steps = sum(n for key, n in ex.stats.replays.items() if key.spec_k == k) - before
        wall = statistics.median(walls) * 1e6
        r = dict(batch=B, k=k, wall_us=wall, tokens_per_step=statistics.median(emitted),
                 tokens_per_s=statistics.median(emitted) / wall * 1e6, steps=steps,
                 spec_key_steps=spec_steps)  # fmt: skip
        if isinstance(stamps, step_events.StepEvents):
            with contextlib.suppress(ValueError):  # fewer than 2 launches stamped
                r["events"] = stamps.stats()
        rows.append(r)
        idle = f"; GPU idle {r['events']['idle_us']:.0f} us a launch" if "events" in r else ""
        if r.get("events", {}).get("split_gap_us") is not None:
            idle += f" ({r['events']['split_gap_us']:.0f} between a split step's parts)"
        what = "spec+mask" if masked else "spec  "
        print(f"{what} B={B:4d} K={k} step {wall:9.1f} us, {r['tokens_per_step']:.0f} tokens a "
              f"step, {(k + 1) * B} rows verified; {spec_steps}/{steps} steps on the spec_k={k} "
              f"key{idle}", flush=True)  # fmt: skip
    info = dict(drafted=ex.stats.drafted, accepted=ex.stats.accepted)
    print(f"spec drafts accepted: {info['accepted']}/{info['drafted']}", flush=True)
    return rows


# ---------------------------------------------------------------------------- entry


def load(cfg: dict, folder: Path | None, device: str, dtype: torch.dtype, max_seq_len: int,
         seed: int = 0, state: dict | None = None,
         **options) -> tuple[gx.models.HFTransformer, dict | None]:  # fmt: skip
    """Our model from the checkpoint folder, else random weights of `cfg` (`state` when
    given); and the random state dict (None for a checkpoint), for transformers' copy.
    `options`: HFTransformer's keyword arguments (batch_invariant)."""
    if folder is not None:
        model = gx.models.HFTransformer.from_pretrained(
            folder, device=device, dtype=dtype, max_seq_len=max_seq_len, **options)  # fmt: skip
        return model, None
    if state is None:
        state = random_state_dict(cfg, seed=seed, device=device, dtype=dtype)
    model = gx.models.HFTransformer(cfg, state, device=device, dtype=dtype,
                                    max_seq_len=max_seq_len, **options)  # fmt: skip
    return model, state


def run_spec_only(args) -> list[dict]:
    """The speculative step alone (`run_spec`) at the --batches up to --spec-max-batch, its
    rows printed: the same measure as the model scenario's spec rows, for A/B runs."""
    name, cfg, folder = resolve(args.model)
    model, _ = load(cfg, folder, args.device, DTYPES[args.dtype], args.max_seq_len, args.seed)
    batches = [b for b in args.batches if b <= args.spec_max_batch]
    print(f"{name}: the speculative step (K = 3, n-gram) at B = {batches}", flush=True)
    return run_spec(args, model, batches)


def run(args, measure, header: dict) -> tuple[str, dict]:
    """The model scenario: our rows, then transformers' (written after each), the targets.
    Returns the JSON's path and the result."""
    args.t_start = time.perf_counter()
    name, cfg, folder = resolve(args.model)
    dtype = DTYPES[args.dtype]
    need = args.prompt_len + args.steps + 32  # measure: steps + 30 tokens a request
    if args.device == "cuda":  # the step graph alone advances the rows 2 * replays + 1
        need = max(need, args.prompt_len + 2 * args.replays + 16)
    if args.max_seq_len < max(need, args.prompt_len + max(args.hf_tokens)):
        raise SystemExit(f"--max-seq-len {args.max_seq_len} is too short: the prompt and "
                         f"{args.steps} steps need {need}")  # fmt: skip
    bandwidth = read_bandwidth(args.device) if args.device == "cuda" else None
    t0 = time.perf_counter()
    model, state = load(cfg, folder, args.device, dtype, args.max_seq_len, args.seed)
    load_s = time.perf_counter() - t0
    gen = torch.Generator().manual_seed(args.seed)
    prompts = torch.randint(1, model.vocab_size, (max(args.batches), args.prompt_len),
                            generator=gen)  # fmt: skip
    params = sum(t.numel() for t in state.values()) if state is not None else None
    try:
        import transformers

        versions = dict(transformers_version=transformers.__version__)
    except ImportError:
        versions = dict(transformers_version=None)
    result = dict(header, **versions, scenario="model", model=dict(
        name=name, source=str(folder) if folder else "random weights", config=cfg,
        dtype=args.dtype, max_seq_len=args.max_seq_len, params=params, load_s=load_s,
        seed=args.seed), prompt_len=args.prompt_len, steps=args.steps, targets=TARGETS,
        read_gb_s=bandwidth / 1e9 if bandwidth else None, replays=args.replays,
        cpu_load=args.cpu_load)  # fmt: skip
    rows, info = run_ours(args, measure, model, prompts, bandwidth)
    spec_batches = [b for b in args.batches if b <= args.spec_max_batch]
    spec = run_spec(args, model, spec_batches) if spec_batches else []
    spec_masked = run_spec(args, model, spec_batches, masked=True) if spec_batches else []
    free(args.device)
    cublas, _ = load(cfg, folder, args.device, dtype, args.max_seq_len, args.seed, state,
                     batch_invariant=False)  # fmt: skip
    paired = run_paired(args, dict(invariant=model, cublas=cublas), prompts)
    del model, cublas
    free(args.device)
    for r in rows:
        p = paired.get(r["batch"])
        sp = next((x for x in spec if x["batch"] == r["batch"]), None)
        sm = next((x for x in spec_masked if x["batch"] == r["batch"]), None)
        if p is not None and "replay" in r:
            r["cublas"] = dict(wall_us=p["cublas"], tokens_per_s=r["batch"] / p["cublas"] * 1e6,
                               invariant_wall_us=p["invariant"])  # fmt: skip
            r["invariant_cost"] = p["invariant"] / p["cublas"]
        if sp is not None and "replay" in r:
            r["spec"] = dict(sp, vs_plain=sp["wall_us"] / r["replay"]["wall_us"])
            if sm is not None:
                r["spec"]["masked"] = dict(sm, vs_plain=sm["wall_us"] / r["replay"]["wall_us"])
    result.update(rows=rows, ours=info)
    os.makedirs(args.out, exist_ok=True)
    dev = header["device"].lower().replace(" ", "-")
    path = os.path.join(args.out, f"step-model-{name}-{dev}-{header['date']}.json")

    def save() -> None:
        result["met"] = judge(result)
        with open(path, "w") as f:
            json.dump(result, f, indent=1)

    save()
    if args.hf_modes:
        run_transformers(result, cfg, state, folder, dtype, prompts, args, save)
    save()
    return path, result


def _at(result: dict, B: int) -> dict | None:
    return next((r for r in result.get("rows", []) if r["batch"] == B), None)


def judge(result: dict) -> dict:
    """Each target's measured value and whether it is met (None: not measured)."""
    b1, b32, b128 = _at(result, 1), _at(result, 32), _at(result, 128)
    ratio = (b32 or {}).get("vs_transformers", {}).get("default")
    costs = [r["invariant_cost"] for r in result.get("rows", []) if "invariant_cost" in r]
    specs = [r["spec"]["vs_plain"] for r in result.get("rows", []) if "spec" in r]
    vals = dict(invariant_cost=max(costs, default=None), spec_vs_plain=max(specs, default=None),
                vs_transformers_b32=ratio, replay_speedup_b1=(b1 or {}).get("speedup"),
                host_us_b128=(b128 or {}).get("replay", {}).get("host_us"))  # fmt: skip
    met = {k: None if v is None else (v <= TARGETS[k] if k in AT_MOST else v >= TARGETS[k])
           for k, v in vals.items()}  # fmt: skip
    return dict(values=vals, met=met)


def _cell(hf: dict, mode: str) -> str:
    """transformers' tokens/s of one mode in a row, or why there is none."""
    if hf.get(mode, {}).get("tokens_per_s"):
        return f"{hf[mode]['tokens_per_s']:.0f}"
    return "-" if mode not in hf else hf[mode].get("skipped", "error")


def markdown(result: dict) -> str:
    m = result["model"]
    modes = [k for k in MODES if any(k in r.get("transformers", {}) for r in result["rows"])]
    extra = [k for k in modes if k != "default"]
    head = ["B", "replay us", "cuBLAS replay us", "invariant/cuBLAS", "spec K=3 step us",
            "spec/plain", "eager us", "host us", *step_replay.HEAD, "our tok/s",
            "transformers tok/s",
            "ours/transformers"] + [f"transformers {k} tok/s" for k in extra]  # fmt: skip
    lines = [f"{m['name']} ({m['source']}, {m['dtype']}) on {result['device']}, "
             f"{result['date']}; transformers "
             f"{result.get('transformers', {}).get('version', 'missing')}",
             "", "| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]  # fmt: skip
    for r in result["rows"]:
        hf = r.get("transformers", {})
        ratio = r.get("vs_transformers", {}).get("default")
        if "error" in r:
            lines.append(f"| {r['batch']} | error: {r['error'][:60]} |" + " |" * (len(head) - 2))
            continue
        cub, sp = r.get("cublas"), r.get("spec")
        cells = [str(r["batch"]), f"{r['replay']['wall_us']:.0f}",
                 f"{cub['wall_us']:.0f}" if cub else "-",
                 f"{r['invariant_cost']:.3f}x" if cub else "-",
                 f"{sp['wall_us']:.0f}" if sp else "-", f"{sp['vs_plain']:.2f}x" if sp else "-",
                 f"{r['eager']['wall_us']:.0f}", f"{r['replay']['host_us']:.0f}",
                 *step_replay.cells(r), f"{r['tokens_per_s']:.0f}", _cell(hf, "default"),
                 f"{ratio:.2f}x" if ratio else "-", *(_cell(hf, k) for k in extra)]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    comp = [r["transformers"]["default"] for r in result["rows"]
            if "compiled" in r.get("transformers", {}).get("default", {})]  # fmt: skip
    if comp:
        cc = comp[0].get("compile_config", {})
        how = f", mode={cc.get('mode')}, fullgraph={cc.get('fullgraph')}" if cc else ""
        lines.append(f"\ntransformers generate (default): compiled={comp[0]['compiled']}{how}")
    j = judge(result)
    names = dict(invariant_cost="invariant step <= 1.10x the cuBLAS step at every B (worst)",
                 spec_vs_plain="speculative step (4 tokens a row) <= 1.5x the plain step at "
                               "B <= 32 (worst)",
                 vs_transformers_b32="B=32 tokens/s >= 2x transformers generate (static cache)",
                 replay_speedup_b1="replayed decode at B=1 >= 3x faster than eager",
                 host_us_b128="host time the GPU waits for < 100 us a step at B=128")  # fmt: skip
    lines.append("")
    for k, text in names.items():
        v, ok = j["values"][k], j["met"][k]
        if v is None:
            shown = "not measured"
        else:
            shown = f"{v:.1f} us" if k == "host_us_b128" else f"{v:.2f}x"
        verdict = "" if ok is None else ("met" if ok else "NOT met")
        lines.append(f"- {text}: {shown} {verdict}".rstrip())
    return "\n".join(lines)
