"""`python -m graphexec demo [--model ...]`: the decode loop on a real workload, replay vs
eager, then with speculation.

The model (`--model`, `graphexec.models.choice`): by default SmolLM2-135M-Instruct once
`python -m graphexec models smollm2` has set it up (`graphexec.checkpoints.smollm2.checkpoint()`),
else TinyLM (random weights, so its text is noise; one line says so and how to get the real
model). A model with a chat template (SmolLM2, a chat checkpoint) answers chat prompts
rendered by its template: greedy and sampled answers and a JSON-schema answer. Other models
run the mixed workload: greedy, top-k/top-p, top-p, min-p, penalties, logit bias, logprobs,
JSON-schema and regex grammars, seeded and unseeded requests arriving over time.

It prints the captured keys, throughput, step latency eager vs replay, the determinism
check (the same workload in eager mode must give the same tokens and logprobs bit for
bit) and every request's output as it finishes, grammar outputs parsed. Then the same
workload with speculation (strict verification, K = 4): an n-gram drafter and a draft
model (`DemoModel.draft`: a 1-layer TinyLM, or a checkpoint's own first layers and head),
with acceptance rate, tokens per request per step, step latency, and whether every
stream equals the one without.

On the CPU the workload is proportionate (`demo_workload.plan_for`: fewer requests and
tokens, a smaller batch, fewer latency steps), so the whole demo takes a minute or two
on two cores. Progress bars show on a terminal only; a log file gets the lines alone.
"""

from __future__ import annotations

import argparse
import gc
import json
import re
import sys
import time
from collections.abc import Callable

import torch
from tqdm.auto import tqdm

import graphexec as gx
from graphexec.app import workload as wl
from graphexec.app.demo_workload import PERSON_SCHEMA, DemoPlan, build_workload, plan_for
from graphexec.models.demo_model import DemoModel, ModelChoiceError, choose_model

__all__ = ["PERSON_SCHEMA", "demo", "default_model", "on_terminal"]


def on_terminal() -> bool:
    """Progress bars only on a terminal: a log file gets the lines alone."""
    return sys.stderr.isatty()


def default_model(device: torch.device, dtype: str, max_seq_len: int | None,
                  seed: int) -> tuple[DemoModel, str | None]:  # fmt: skip
    """The demo's model without --model: SmolLM2-135M-Instruct when it is set up, else
    TinyLM and the one line that says its text is noise and how to get SmolLM2."""
    from graphexec.checkpoints import smollm2

    try:
        smollm2.checkpoint()
    except smollm2.MissingExtraError as e:
        note = (f"TinyLM has random weights, so its text is noise; for real text "
                f"(SmolLM2-135M-Instruct): {e}")  # fmt: skip
        return choose_model("tiny", device, dtype, max_seq_len, seed=seed), note
    return choose_model("smollm2", device, dtype, max_seq_len, seed=seed), None


# a finished request's line from its id and outputs
Show = Callable[[str, list[gx.RequestOutput]], str]


class _Progress:
    """An executor as `wl.run` drives it (every attribute is the executor's), reporting
    while the run goes: a progress line (requests finished, tokens) and, with `show`,
    each request's line the moment it finishes."""

    def __init__(self, ex: gx.DecodeExecutor, total: int, desc: str, quiet: bool,
                 show: Show | None = None) -> None:  # fmt: skip
        self._ex, self._show = ex, show
        self._outs: dict[str, list[gx.RequestOutput]] = {}
        self._tokens = 0
        self._bar = tqdm(total=total, desc=f"  {desc}", unit="req", disable=quiet,
                         file=sys.stderr, leave=False, mininterval=0.5)  # fmt: skip

    def __getattr__(self, name: str):
        return getattr(self._ex, name)

    def step(self, mode: str | None = None) -> list[gx.RequestOutput]:
        outs = self._ex.step(mode)
        for o in outs:
            self._tokens += o.token_id is not None
            if self._show is not None:
                self._outs.setdefault(o.request_id, []).append(o)
            if o.finished:
                self._bar.update()
                if self._show is not None:
                    tqdm.write(self._show(o.request_id, self._outs.pop(o.request_id)),
                               file=sys.stdout)  # fmt: skip
        self._bar.set_postfix_str(f"{self._tokens} tokens", refresh=False)
        return outs

    def close(self) -> None:
        self._bar.close()


def _run(ex: gx.DecodeExecutor, items: list[wl.WorkItem], desc: str, quiet: bool,
         show: Show | None = None,
         mode: str | None = None) -> wl.Trace:  # fmt: skip
    """`wl.run` with a progress line (and `show` for each request as it finishes)."""
    watched = _Progress(ex, len(items), desc, quiet, show)
    try:
        return wl.run(watched, items, mode=mode)
    finally:
        watched.close()


def _step_latency(ex: gx.DecodeExecutor, batch: int, steps: int, mode: str | None) -> float:
    """Mean wall time of one decode step (ms) with `batch` plain requests running (long
    enough for speculative runs of several tokens a step)."""
    room = ex.model.max_seq_len - 1
    for i in range(batch):
        p = gx.SamplingParams(seed=i, max_tokens=room, ignore_eos=True)  # batch stays full
        ex.add_request(f"lat{i}", [i + 1], p)
    ex.step(mode)  # first tokens (with overlap, reported by the next call)
    ex.step(mode)  # warm
    sync = torch.cuda.synchronize if ex.device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        ex.step(mode)
    dt = (time.perf_counter() - t0) / steps
    for i in range(batch):
        ex.abort(f"lat{i}")
    while not ex.idle:  # the aborts, and with overlap the step in flight
        ex.step(mode)
    return dt * 1e3


def _show(tok: gx.Tokenizer, it: wl.WorkItem, outs: list[gx.RequestOutput],
          width: int | None = 60) -> str:  # fmt: skip
    """One request's line: its kind, seed, finish and text (at most `width` characters;
    all of it when None), grammar outputs parsed or matched."""
    eos = set(tok.eos_token_ids)
    ids = [o.token_id for o in outs if o.token_id is not None and o.token_id not in eos]
    text = tok.decode(ids)
    last = outs[-1]
    head = f"{it.request_id:>4} {it.kind:12s} seed {outs[0].seed:<20d} {last.finish_reason:6s}"
    if it.params.grammar is not None and it.params.grammar.kind == "json_schema":
        try:
            return f"{head} parsed JSON: {json.loads(text)}"
        except ValueError:
            return f"{head} NOT JSON: {text!r}"
    if it.params.grammar is not None:
        ok = re.fullmatch(it.params.grammar.text, text) is not None
        return f"{head} regex {'matches' if ok else 'DOES NOT MATCH'}: {text!r}"
    lp = ""
    if it.params.logprobs is not None and outs[0].logprob is not None:
        lp = f"  (first logprob {outs[0].logprob:.3f}, rank {outs[0].rank})"
    return f"{head} {text[:width]!r}{lp}"


def demo(args: argparse.Namespace) -> int:
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cuda = device.type == "cuda"
    quiet = args.quiet or not on_terminal()
    try:
        if args.model is None:
            dm, note = default_model(device, args.dtype, args.max_seq_len, args.seed)
        else:
            dm, note = choose_model(args.model, device, args.dtype, args.max_seq_len,
                                    seed=args.seed), None  # fmt: skip
    except ModelChoiceError as e:
        print(f"graphexec demo: {e}", file=sys.stderr)
        return 2
    spec = "none" if not args.speculative else args.speculative_runs
    plan = plan_for(dm, cuda, args.requests, args.max_batch_size, args.latency_steps, spec)
    tok = dm.tokenizer
    ex = gx.DecodeExecutor(dm.make(), max_batch_size=plan.batch, device=device, tokenizer=tok,
                           seed=0)  # fmt: skip
    if note:
        print(note)
    print(f"graphexec {gx.__version__} on {device}: {dm.name}, vocabulary {tok.vocab_size} "
          f"({tok.name}), EOS {list(tok.eos_token_ids)}, max_batch_size {plan.batch}, "
          f"buckets {list(ex.buckets)}")  # fmt: skip
    t0 = time.perf_counter()
    ex.capture(progress=not quiet)
    how = "CUDA graphs" if cuda else "emulated graphs (no CUDA: recorded calls)"
    print(f"captured {len(ex.graph_keys)} keys ({how}) in {time.perf_counter() - t0:.1f} s; "
          f"failed: {len(ex.stats.failed)}")  # fmt: skip

    items, questions = build_workload(dm, plan, args.seed)
    by_id = {it.request_id: it for it in items}
    width = 60 if dm.random_weights else None

    def show(rid: str, outs: list[gx.RequestOutput]) -> str:
        line = "  " + _show(tok, by_id[rid], outs, width)
        return f"  {rid:>4} asked: {questions[rid]!r}\n{line}" if rid in questions else line

    noise = " (random weights: the free text is noise)" if dm.random_weights else ""
    kind = "chat prompts (the model's chat template)" if questions else "mixed workload"
    print(f"\n{kind}, each request's output as it finishes{noise}:", flush=True)
    replayed = _run(ex, items, "replay", quiet, show)
    print(f"replay: {len(items)} requests, {replayed.tokens} tokens in {replayed.steps} steps, "
          f"{replayed.tokens / replayed.seconds:.0f} tokens/s", flush=True)  # fmt: skip
    eager = _run(ex, wl.with_reported_seeds(items, replayed), "eager", quiet, mode="eager")
    print(f"eager:  {eager.tokens} tokens in {eager.steps} steps, "
          f"{eager.tokens / eager.seconds:.0f} tokens/s")  # fmt: skip
    bad = wl.compare(replayed, eager)
    print(f"determinism check (replay vs eager, tokens and logprobs bit for bit): "
          f"{'PASS' if not bad else f'FAIL, {len(bad)} mismatches'}")  # fmt: skip
    for m in bad[:10]:
        print(f"  mismatch {m.request_id} position {m.position} {m.what} key {m.key}")

    print("\ngraph keys that drew tokens (variant/bucket/logprobs: tokens):")
    for key, n in sorted(wl.outputs_per_key(replayed).items(), key=lambda kv: str(kv[0])):
        print(f"  {key or 'first token (admission, eager)'}: {n}")

    lat_b = plan.latency_batch
    replay_ms = _step_latency(ex, lat_b, plan.latency_steps, None)
    eager_ms = _step_latency(ex, lat_b, plan.latency_steps, "eager")
    note = "" if cuda else " (CPU: replay is emulated)"
    print(f"\nstep latency at B={lat_b}: replay {replay_ms:.2f} ms, eager {eager_ms:.2f} ms "
          f"({eager_ms / replay_ms:.1f}x){note}", flush=True)  # fmt: skip

    if plan.speculative:
        del ex  # its graphs and cache: a checkpoint's model is bound again for the next runs
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
        bad += _speculative(device, dm, plan, items, replayed, quiet)
    return 0 if not bad else 1


def _speculative(device: torch.device, dm: DemoModel, plan: DemoPlan, items: list[wl.WorkItem],
                 plain: wl.Trace, quiet: bool) -> list[wl.Mismatch]:  # fmt: skip
    """The workload again with each of the plan's speculative runs; their token
    differences from `plain`."""
    print("\nspeculative decoding (strict: the streams must equal the ones above):")
    tok = dm.tokenizer
    runs: list[tuple[str, object]] = []
    for run in plan.speculative:
        runs.append(("n-gram", "ngram") if run == "ngram" else
                    (f"draft model ({dm.draft_name})", dm.draft()))  # fmt: skip
    bad = []
    lat_b = plan.latency_batch
    for name, drafter in runs:
        spec = gx.SpeculativeConfig(4, drafter=drafter)
        ex = gx.DecodeExecutor(dm.make(), max_batch_size=plan.batch, device=device,
                               tokenizer=tok, seed=0, speculative=spec)  # fmt: skip
        ex.capture(progress=not quiet)
        trace = _run(ex, wl.with_reported_seeds(items, plain), name, quiet)
        diff = [m for m in wl.compare(plain, trace) if m.what in ("token", "length", "finish")]
        bad += diff
        st = ex.stats
        first = len(trace.outputs)  # first tokens come from the prefill, not a run
        spec_runs = trace.tokens - first - st.accepted  # one run a request a step
        rate = f"{st.accepted / st.drafted:.0%}" if st.drafted else "n/a"
        lat = _step_latency(ex, lat_b, plan.latency_steps, None)
        print(f"  {name}: acceptance {rate} ({st.accepted}/{st.drafted} drafts), "
              f"{(trace.tokens - first) / max(spec_runs, 1):.2f} tokens per request per step, "
              f"{trace.steps} steps (without: {plain.steps}), step at B={lat_b} "
              f"{lat:.2f} ms; tokens equal the non-speculative run's: "
              f"{'FAIL' if diff else 'PASS'}", flush=True)  # fmt: skip
        del ex
    return bad
