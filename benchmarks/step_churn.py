"""The churn scenario of `bench_step.py` (issue "Admission at server rate"): what the
executor sustains when requests keep arriving. A server's loop admits seeded requests
while a slot is free, steps and reads every output; measured are tokens/s and steps/s,
the mean batch, the gaps between a stream's consecutive tokens, the time to first token
and the time inside `add_request`, each workload against a steady reference at its mean
batch (same executor, nobody arriving) and judged on the issue's targets (TARGETS).

Churn / CHURNS: the workloads; Arrivals: the request stream; Tracker: what a loop saw;
churn_section(ex, ...): the JSON's "churn" section (bench_step.run_churn builds the
executor); churn_markdown(section): its table.
"""

from __future__ import annotations

import dataclasses
import gc
import random
import statistics
import time
from collections import Counter

import numpy as np

import graphexec as gx
from graphexec.app.workload import ANSWER_SCHEMA

P = gx.SamplingParams


@dataclasses.dataclass(frozen=True)
class Churn:
    """A churn workload: what the arriving requests look like (ranges are inclusive)."""

    name: str
    max_tokens: tuple[int, int]
    prompt_len: tuple[int, int] = (4, 64)
    grammar_frac: float = 0.1  # requests that carry the JSON-schema grammar
    abort_frac: float = 0.01  # requests aborted after a random number of their tokens


CHURNS = (Churn("short", (1, 48)), Churn("long", (1, 511)))
CHURN_KINDS = (P(temperature=0.0), P(temperature=0.8), P(temperature=0.8, top_k=50, top_p=0.9))
CHURN_VARIANTS = ("no_filter", "top_k_top_p")  # the keys CHURN_KINDS need (logprobs off)
TARGETS = dict(throughput_ratio=">= 0.5", gap_ratio="<= 3", admit_mean_us="< 50")
REF_PROMPT = 32  # prompt length of the steady reference's requests


class Arrivals:
    """The seeded stream of requests a churn run admits: (id, prompt, params, abort_at),
    abort_at the number of its tokens after which the loop aborts it (None: never)."""

    def __init__(self, churn: Churn, vocab_size: int, seed: int = 0) -> None:
        self.churn, self.rng, self.n = churn, random.Random(seed), 0
        # prompts from one numpy draw each: the client's cost stays out of the loop's
        self.tokens = np.random.default_rng(seed)
        self.vocab = min(vocab_size, 50_000)
        self.grammar = gx.Grammar.json_schema(ANSWER_SCHEMA) if churn.grammar_frac else None

    def next(self) -> tuple[str, list[int], gx.SamplingParams, int | None]:
        c, r = self.churn, self.rng
        prompt = self.tokens.integers(self.vocab, size=r.randint(*c.prompt_len)).tolist()
        limit = r.randint(*c.max_tokens)
        p = dataclasses.replace(r.choice(CHURN_KINDS), seed=self.n, max_tokens=limit)
        if r.random() < c.grammar_frac:
            p = dataclasses.replace(p, grammar=self.grammar)
        abort_at = r.randrange(1, limit) if r.random() < c.abort_frac and limit > 1 else None
        self.n += 1
        return f"c{self.n - 1}", prompt, p, abort_at


def _us(xs: list[float]) -> tuple[float | None, float | None]:
    """(mean, p99) of seconds, in microseconds; None for no samples."""
    if not xs:
        return None, None
    return statistics.fmean(xs) * 1e6, float(np.percentile(xs, 99)) * 1e6


@dataclasses.dataclass
class Tracker:
    """What a loop saw. Always: each live request's token count, its ends (a second end,
    or an output of a request never added, goes to `bad`; so do more tokens than
    max_tokens and a "length" end short of it). While `measuring`: tokens, decode rows
    per step, finish reasons, inter-token gaps, times to first token, add_request times."""

    measuring: bool = False
    live: dict = dataclasses.field(default_factory=dict)  # id -> tokens so far
    limit: dict = dataclasses.field(default_factory=dict)  # id -> max_tokens
    last: dict = dataclasses.field(default_factory=dict)  # id -> its last token's (add's) time
    abort_at: dict = dataclasses.field(default_factory=dict)
    ended: set = dataclasses.field(default_factory=set)
    bad: list = dataclasses.field(default_factory=list)
    reasons: Counter = dataclasses.field(default_factory=Counter)
    rows: list = dataclasses.field(default_factory=list)
    gaps: list = dataclasses.field(default_factory=list)
    ttft: list = dataclasses.field(default_factory=list)
    admit: list = dataclasses.field(default_factory=list)
    tokens: int = 0

    def add(self, ex, rid: str, prompt, params, abort_at: int | None = None) -> None:
        t0 = time.perf_counter()
        ex.add_request(rid, prompt, params)
        t1 = time.perf_counter()
        if self.measuring:
            self.admit.append(t1 - t0)
        self.live[rid], self.limit[rid], self.last[rid] = 0, params.max_tokens, t1
        if abort_at is not None:
            self.abort_at[rid] = abort_at

    def observe(self, outs, now: float) -> None:
        """Account one step's outputs, all read at `now` (when the step returned)."""
        rows = 0
        for o in outs:
            rid, n = o.request_id, self.live.get(o.request_id)
            if n is None:
                self.bad.append(f"{rid}: output {o.finish_reason} after its end or never added")
                continue
            if o.token_id is not None:
                self.live[rid] = n = n + 1
                if self.measuring:
                    self.tokens += 1
                    rows += o.position > 0
                    (self.gaps if n > 1 else self.ttft).append(now - self.last[rid])
                self.last[rid] = now
                if n > self.limit[rid]:
                    self.bad.append(f"{rid}: {n} tokens, max_tokens {self.limit[rid]}")
            if o.finished:
                self._end(rid, o.finish_reason, n)
        if self.measuring:
            self.rows.append(rows)

    def _end(self, rid: str, reason: str, n: int) -> None:
        if reason == "length" and n != self.limit[rid]:
            self.bad.append(f"{rid}: 'length' after {n} tokens, max_tokens {self.limit[rid]}")
        for d in (self.live, self.limit, self.last, self.abort_at):
            d.pop(rid, None)
        self.ended.add(rid)
        if self.measuring:
            self.reasons[reason] += 1

    def abort_due(self, ex) -> None:
        for rid in [r for r, k in self.abort_at.items() if self.live[r] >= k]:
            del self.abort_at[rid]
            ex.abort(rid)

    def summary(self, wall: float) -> dict:
        (gap, gap99), (ttft, ttft99), (adm, adm99) = map(_us, (self.gaps, self.ttft, self.admit))
        steps = len(self.rows)
        return dict(steps=steps, wall_s=wall, tokens=self.tokens, tokens_per_s=self.tokens / wall,
                    steps_per_s=steps / wall, mean_batch=statistics.fmean(self.rows or [0]),
                    gap_mean_us=gap, gap_p99_us=gap99, gaps=len(self.gaps),
                    first_tokens=len(self.ttft), ttft_mean_us=ttft,
                    ttft_p99_us=ttft99, admit_mean_us=adm, admit_p99_us=adm99,
                    admitted=len(self.admit), finished=dict(self.reasons))  # fmt: skip


def drain(ex, tr: Tracker, limit: int = 10_000) -> None:
    """Abort every live request and step until the executor is idle."""
    for rid in list(tr.live):
        ex.abort(rid)
    tr.abort_at.clear()
    for _ in range(limit):
        if ex.idle:
            return
        tr.observe(ex.step(), time.perf_counter())
    raise RuntimeError(f"the executor was not idle {limit} steps after aborting everything")


def churn_loop(ex, arrivals: Arrivals, tr: Tracker, steps: int) -> None:
    """A server's loop: admit while a slot is free, step, read every output, abort."""
    for _ in range(steps):
        while ex.free_slots > 0:
            tr.add(ex, *arrivals.next())
        tr.observe(ex.step(), time.perf_counter())
        tr.abort_due(ex)


def _timed(ex, tr: Tracker, run) -> tuple[float, int]:
    """run() with `tr` measuring: (its wall seconds, eager steps the executor took in it)."""
    gc.collect()
    eager0 = sum(ex.stats.eager_steps.values())
    tr.measuring = True
    t0 = time.perf_counter()
    run()
    wall = time.perf_counter() - t0
    tr.measuring = False
    return wall, sum(ex.stats.eager_steps.values()) - eager0


def measure_churn(ex, churn: Churn, steps: int, warmup: int, seed: int = 0) -> dict:
    """`warmup` steps of the churn loop, then `steps` measured ones; then every request
    left is aborted and the executor drained. `requests` / `ended`: how many were added /
    ended (each exactly once unless `problems` says otherwise)."""
    arrivals, tr = Arrivals(churn, ex.vocab_size, seed), Tracker()
    churn_loop(ex, arrivals, tr, warmup)
    wall, eager = _timed(ex, tr, lambda: churn_loop(ex, arrivals, tr, steps))
    drain(ex, tr)
    return dict(workload=churn.name, max_tokens=list(churn.max_tokens),
                prompt_len=list(churn.prompt_len), grammar_frac=churn.grammar_frac,
                abort_frac=churn.abort_frac, warmup=warmup, **tr.summary(wall),
                eager_steps=eager, requests=arrivals.n, ended=len(tr.ended),
                unended=len(tr.live), problems=tr.bad[:10])  # fmt: skip


def measure_steady(ex, batch: int, steps: int) -> dict:
    """The reference: `batch` requests of the churn kinds that outlive the run, nobody
    arriving; steps until each has its first token, 2 more, then `steps` timed steps of
    the same loop (outputs read)."""
    tr, room = Tracker(), ex.model.max_seq_len - REF_PROMPT
    for i in range(batch):
        p = dataclasses.replace(CHURN_KINDS[i % len(CHURN_KINDS)], seed=i, ignore_eos=True,
                                max_tokens=room)  # fmt: skip
        tr.add(ex, f"s{i}", [1 + (7 * i + j) % 1000 for j in range(REF_PROMPT)], p)
    for _ in range(room):
        tr.observe(ex.step(), time.perf_counter())
        if min(tr.live.values(), default=1) > 2:
            break

    def run():
        for _ in range(steps):
            tr.observe(ex.step(), time.perf_counter())

    wall, eager = _timed(ex, tr, run)
    drain(ex, tr)
    s = tr.summary(wall)
    keep = ("steps", "tokens", "tokens_per_s", "mean_batch", "gap_mean_us", "gap_p99_us")
    return dict(batch=batch, step_us=wall / steps * 1e6, **{k: s[k] for k in keep},
                min_batch=min(tr.rows), eager_steps=eager, problems=tr.bad[:10])  # fmt: skip


def judge(churn: dict, steady: dict) -> dict:
    """The issue's ratios and whether each target is met."""
    tp = churn["tokens_per_s"] / steady["tokens_per_s"]
    gap = None if churn["gap_p99_us"] is None else churn["gap_p99_us"] / steady["step_us"]
    adm = churn["admit_mean_us"]
    met = dict(throughput_ratio=tp >= 0.5, gap_ratio=gap is not None and gap <= 3,
               admit_mean_us=adm is not None and adm < 50)  # fmt: skip
    return dict(throughput_ratio=tp, gap_ratio=gap, admit_mean_us=adm, met=met)


def churn_section(ex, churns=CHURNS, steps: int = 2000, warmup: int = 256,
                  ref_steps: int = 200, seed: int = 0, repeats: int = 1) -> dict:  # fmt: skip
    """Each churn workload, its steady reference at its mean batch, and the ratios.

    repeats > 1: the workload and its reference run that many times, one after the
    other (a host's noise moves one run's ratios by tens of percent); the row is the run
    of median throughput ratio, judged on the medians, and `repeats` lists every run's
    ratios."""
    rows = []
    for c in churns:
        runs = []
        for _ in range(repeats):
            churn = measure_churn(ex, c, steps, warmup, seed)
            steady = measure_steady(ex, max(1, round(churn["mean_batch"])), ref_steps)
            runs.append(dict(workload=c.name, churn=churn, steady=steady, **judge(churn, steady)))
        r = sorted(runs, key=lambda x: x["throughput_ratio"])[(len(runs) - 1) // 2]
        if repeats > 1:
            r = dict(r, repeats=[{k: x[k] for k in ("throughput_ratio", "gap_ratio",
                                                     "admit_mean_us")} for x in runs])  # fmt: skip
            gaps = [x["gap_ratio"] for x in runs if x["gap_ratio"] is not None]
            r["gap_ratio"] = statistics.median(gaps) if gaps else None
            r["met"] = dict(r["met"], gap_ratio=r["gap_ratio"] is not None and r["gap_ratio"] <= 3)
        rows.append(r)
        churn, steady = r["churn"], r["steady"]
        print(f"churn {c.name:5s} batch {churn['mean_batch']:5.1f} "
              f"{churn['tokens_per_s']:9.0f} tok/s (steady {steady['tokens_per_s']:9.0f}) "
              f"p99 gap {churn['gap_p99_us'] or 0:8.0f} us (steady step "
              f"{steady['step_us']:7.0f}) admission {churn['admit_mean_us'] or 0:6.1f} us"
              + (f" (median of {repeats})" if repeats > 1 else ""), flush=True)  # fmt: skip
        for x in runs:
            for p in x["churn"]["problems"] + x["steady"]["problems"]:
                print(f"  PROBLEM {p}")
    return dict(max_batch_size=ex.max_batch_size, buckets=list(ex.buckets), steps=steps,
                warmup=warmup, ref_steps=ref_steps, seed=seed, repeats=repeats,
                targets=TARGETS, workloads=rows)  # fmt: skip


def _cell(x: float | None, fmt: str, met: bool | None = None) -> str:
    text = "-" if x is None else format(x, fmt)
    return text if met is None else f"{text} ({'yes' if met else 'no'})"


def churn_markdown(section: dict) -> str:
    pb = section.get("prefill_budget", "-")
    lines = [f"Churn: {section['max_batch_size']} slots, {section['steps']} steps after "
             f"{section['warmup']}, prefill_budget {pb}; "
             f"steady reference: {section['ref_steps']} steps at the churn's mean batch.",
             "| workload | max_tokens | mean batch | tok/s | steady tok/s | churn / steady "
             "(>= 0.5) | p99 gap us | steady step us | p99 gap / step (<= 3) | admission us "
             "mean (< 50) | admission p99 us | steps/s |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for w in section["workloads"]:
        c, s, met = w["churn"], w["steady"], w["met"]
        lo, hi = c["max_tokens"]
        lines.append(" | ".join([
            f"| {w['workload']}", f"{lo}..{hi}", f"{c['mean_batch']:.1f}",
            f"{c['tokens_per_s']:.0f}", f"{s['tokens_per_s']:.0f}",
            _cell(w["throughput_ratio"], ".2f", met["throughput_ratio"]),
            _cell(c["gap_p99_us"], ".0f"), f"{s['step_us']:.0f}",
            _cell(w["gap_ratio"], ".2f", met["gap_ratio"]),
            _cell(c["admit_mean_us"], ".1f", met["admit_mean_us"]),
            _cell(c["admit_p99_us"], ".1f"), f"{c['steps_per_s']:.0f} |"]))  # fmt: skip
    return "\n".join(lines)
