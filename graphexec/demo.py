"""`python -m graphexec demo [--model PATH|smollm2]`: the decode loop on a mixed workload,
replay vs eager.

TinyLM (random weights, so its text is noise) at the bundled cl100k vocabulary, or with
`--model PATH` a Llama / Qwen2 / Mistral checkpoint folder and its own tokenizer
(`graphexec.demo_model`), driven by the executor: greedy, top-k/top-p, top-p, min-p,
penalties, logit bias, logprobs, JSON-schema and regex grammars, seeded and unseeded
requests arriving over time (prompts encoded by the model's tokenizer). It
prints the captured keys, throughput, step latency eager vs replay, the determinism
check (the same workload in eager mode must give the same tokens and logprobs bit for
bit), and every request's output as it finishes, grammar outputs parsed. Then the same workload with
speculation (strict verification, K = 4): an n-gram drafter and a draft model (a TinyLM
made of the target's first layer: the same seed, one layer; TinyLM only, so a checkpoint
gets the n-gram run alone), with acceptance rate, tokens per request per step, step
latency, and whether every stream equals the one without.

A checkpoint with a chat template (`--model smollm2`: SmolLM2-135M-Instruct from the models
extra) runs chat prompts instead, rendered by its template: greedy and sampled answers and
a JSON-schema answer, the same checks after. Each request's text is printed as soon as it
finishes, and every run shows a progress line, so a slow CPU is never silent for minutes.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import re
import sys
import time
from collections.abc import Callable

import torch
from tqdm.auto import tqdm

import graphexec as gx
from graphexec import workload as wl
from graphexec.demo_model import DemoModel, ModelChoiceError, choose_model

PROMPTS = [
    "The quick brown fox", "Once upon a time", "In a distant galaxy", "The recipe calls for",
    "Answer yes or no:", "The meeting is on", "def main():", "Dear committee,",
]  # fmt: skip
PERSON_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                   "city": {"type": "string"}},
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}  # fmt: skip
# (kind, user message, parameters): the chat workload of a model with a chat template
CHATS = [
    ("greedy", "What is the capital of France? Answer in one sentence.",
     gx.SamplingParams(temperature=0.0, max_tokens=32)),
    ("greedy", "Rewrite this sentence in the past tense: The cat sits on the mat and "
     "watches the birds in the garden.", gx.SamplingParams(temperature=0.0, max_tokens=40)),
    ("top-p 0.9", "Write a haiku about the ocean.",
     gx.SamplingParams(temperature=0.7, top_p=0.9, max_tokens=40)),
    ("greedy", "Give me three tips for staying focused while studying.",
     gx.SamplingParams(temperature=0.0, max_tokens=64)),
    ("json schema", "Alice is 30 years old and lives in Paris. Give her name, age and city "
     "as JSON.", gx.SamplingParams(temperature=0.0, max_tokens=48,
                                   grammar=gx.Grammar.json_schema(PERSON_SCHEMA))),
]  # fmt: skip


def _workload(dm: DemoModel, n: int | None,
              seed: int) -> tuple[list[wl.WorkItem], dict[str, str]]:  # fmt: skip
    """The chat workload for a model with a chat template (`CHATS`, one arriving a step;
    n defaults to one each) and its questions by request id, else the mixed workload
    with `PROMPTS` (n defaults to 24) and no questions; prompts encoded by the model's
    own tokenizer."""
    if dm.chat_template is not None:
        items, questions = [], {}
        for i in range(len(CHATS) if n is None else n):
            kind, text, params = CHATS[i % len(CHATS)]
            prompt = dm.encode_chat([{"role": "user", "content": text}])
            params = dataclasses.replace(params, seed=seed + i)
            items.append(wl.WorkItem(f"r{i}", prompt, params, arrive=i, kind=kind))
            questions[f"r{i}"] = text
        return items, questions
    items = wl.mixed_workload(24 if n is None else n, dm.tokenizer.vocab_size, seed=seed,
                              grammars=True, max_tokens=(8, 24))  # fmt: skip
    items = [dataclasses.replace(it, prompt=dm.encode(PROMPTS[i % len(PROMPTS)]))
             for i, it in enumerate(items)]  # fmt: skip
    return items, {}


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
    ex.step(mode)  # first tokens
    ex.step(mode)  # warm
    sync = torch.cuda.synchronize if ex.device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        ex.step(mode)
    dt = (time.perf_counter() - t0) / steps
    for i in range(batch):
        ex.abort(f"lat{i}")
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
    try:
        dm = choose_model(args.model, device, args.dtype, args.max_seq_len, seed=args.seed)
    except ModelChoiceError as e:
        print(f"graphexec demo: {e}", file=sys.stderr)
        return 2
    tok = dm.tokenizer
    # a real model's forward is slow on the CPU: a smaller batch keeps each step short
    batch = args.max_batch_size or (64 if cuda else 16 if dm.random_weights else 8)
    ex = gx.DecodeExecutor(dm.make(), max_batch_size=batch, device=device, tokenizer=tok, seed=0)
    print(f"graphexec {gx.__version__} on {device}: {dm.name}, vocabulary {tok.vocab_size} "
          f"({tok.name}), EOS {list(tok.eos_token_ids)}, max_batch_size {batch}, "
          f"buckets {list(ex.buckets)}")  # fmt: skip
    t0 = time.perf_counter()
    ex.capture(progress=not args.quiet)
    how = "CUDA graphs" if cuda else "emulated graphs (no CUDA: recorded calls)"
    print(f"captured {len(ex.graph_keys)} keys ({how}) in {time.perf_counter() - t0:.1f} s; "
          f"failed: {len(ex.stats.failed)}")  # fmt: skip

    items, questions = _workload(dm, args.requests, args.seed)
    by_id = {it.request_id: it for it in items}
    width = 60 if dm.random_weights else None

    def show(rid: str, outs: list[gx.RequestOutput]) -> str:
        line = "  " + _show(tok, by_id[rid], outs, width)
        return f"  {rid:>4} asked: {questions[rid]!r}\n{line}" if rid in questions else line

    noise = " (random weights: the free text is noise)" if dm.random_weights else ""
    kind = "chat prompts (the model's chat template)" if questions else "mixed workload"
    print(f"\n{kind}, each request's output as it finishes{noise}:")
    replayed = _run(ex, items, "replay", args.quiet, show)
    print(f"replay: {len(items)} requests, {replayed.tokens} tokens in {replayed.steps} steps, "
          f"{replayed.tokens / replayed.seconds:.0f} tokens/s")  # fmt: skip
    eager = _run(ex, wl.with_reported_seeds(items, replayed), "eager", args.quiet, mode="eager")
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

    lat_b = min(8, batch)
    replay_ms = _step_latency(ex, lat_b, args.latency_steps, None)
    eager_ms = _step_latency(ex, lat_b, args.latency_steps, "eager")
    note = "" if cuda else " (CPU: replay is emulated)"
    print(f"\nstep latency at B={lat_b}: replay {replay_ms:.2f} ms, eager {eager_ms:.2f} ms "
          f"({eager_ms / replay_ms:.1f}x){note}")  # fmt: skip

    if args.speculative:
        del ex  # its graphs and cache: a checkpoint's model is bound again for the next runs
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
        bad += _speculative(args, device, dm, items, replayed, batch)
    return 0 if not bad else 1


def _speculative(args, device, dm: DemoModel, items, plain: wl.Trace, batch: int) -> list:
    """The workload again with speculation on; its token differences from `plain`."""
    print("\nspeculative decoding (strict: the streams must equal the ones above):")
    tok = dm.tokenizer
    runs: list[tuple[str, object]] = [("n-gram", "ngram")]
    if dm.draft is not None:
        runs.append(("draft model (1-layer TinyLM)", dm.draft()))
    else:
        print("  draft-model run skipped: its 1-layer TinyLM draft is TinyLM-specific "
              "(a checkpoint runs the n-gram drafter only)")  # fmt: skip
    bad = []
    for name, drafter in runs:
        spec = gx.SpeculativeConfig(4, drafter=drafter)
        ex = gx.DecodeExecutor(dm.make(), max_batch_size=batch, device=device, tokenizer=tok,
                               seed=0, speculative=spec)  # fmt: skip
        ex.capture(progress=not args.quiet)
        trace = _run(ex, wl.with_reported_seeds(items, plain), name, args.quiet)
        diff = [m for m in wl.compare(plain, trace) if m.what in ("token", "length", "finish")]
        bad += diff
        st = ex.stats
        first = len(trace.outputs)  # first tokens come from the prefill, not a run
        spec_runs = trace.tokens - first - st.accepted  # one run a request a step
        rate = f"{st.accepted / st.drafted:.0%}" if st.drafted else "n/a"
        lat = _step_latency(ex, min(8, batch), args.latency_steps, None)
        print(f"  {name:30s} acceptance {rate} ({st.accepted}/{st.drafted} drafts), "
              f"{(trace.tokens - first) / max(spec_runs, 1):.2f} tokens per request per step, "
              f"{trace.steps} steps (without: {plain.steps}), step at B={min(8, batch)} "
              f"{lat:.2f} ms; tokens equal the non-speculative run's: "
              f"{'FAIL' if diff else 'PASS'}")  # fmt: skip
    return bad
