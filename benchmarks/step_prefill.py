"""The long-prompt scenario of `bench_step.py` (issue "Real models", item 3): how long
running streams wait while long prompts arrive, at several prefill budgets.

`streams` requests decode without end; after one long prompt has gone through (the
warm-up: kernels compile, prefill graphs are captured) and a steady stretch (`steps`
timed steps, nobody arriving), a prompt of `prompt_len` tokens arrives every `every`
steps (it asks for 2 tokens, so it leaves soon) for another `steps` steps. A running
stream's gap is the time between the returns of the steps that carried two of its
consecutive tokens. The
executor prefills admitted prompts behind the step's decode, cut to `prefill_budget`
tokens a step, so the worst gap should grow with the budget, not with the prompt: that
is what the rows show, one per budget (the same executor, its Prefiller's budget set).

prefill_section(ex, ...): the JSON's "prefill" section; prefill_markdown(section): its
table.
"""

from __future__ import annotations

import gc
import random
import statistics
import time

import numpy as np

import graphexec as gx

P = gx.SamplingParams


def _gaps(ex, streams: list[str], steps: int, arrive, every: int) -> tuple[list, list, int]:
    """`steps` steps; `arrive(i)` before step i when every > 0 and i % every == 0. Returns
    the running streams' inter-token gaps (s), each step's wall time (s) and the prompt
    tokens admitted."""
    gc.collect()  # before the clock starts: a collection is no gap of the executor's
    last = dict.fromkeys(streams, time.perf_counter())
    gaps, walls, admitted = [], [], 0
    for i in range(steps):
        if every and i % every == 0:
            admitted += arrive(i)
        t0 = time.perf_counter()
        outs = ex.step()
        now = time.perf_counter()
        walls.append(now - t0)
        for o in outs:
            if o.request_id in last and o.token_id is not None:
                gaps.append(now - last[o.request_id])
                last[o.request_id] = now
    return gaps, walls, admitted


def measure_budget(ex, budget: int, streams: int, prompt_len: int, every: int, steps: int,
                   seed: int = 0) -> dict:  # fmt: skip
    """One row: the steady gaps, then the gaps while long prompts arrive, at `budget`."""
    ex.prefiller.budget = budget
    rng = random.Random(seed)
    vocab = min(ex.vocab_size, 50_000)
    room = ex.model.max_seq_len - 8
    ids = [f"run{i}" for i in range(streams)]
    for i, rid in enumerate(ids):
        ex.add_request(rid, [1 + i, 2, 3], P(temperature=0.8, seed=i, ignore_eos=True,
                                                max_tokens=room))  # fmt: skip
    for _ in range(3):
        ex.step()
    n = 0

    def arrive(i: int) -> int:
        nonlocal n
        if ex.free_slots == 0:  # prompts arriving faster than the budget prefills them
            return 0
        prompt = [rng.randrange(vocab) for _ in range(prompt_len)]
        ex.add_request(f"long{n}", prompt, P(temperature=0.0, seed=n, max_tokens=2))
        n += 1
        return prompt_len

    # warm-up: one long prompt through all its chunks (what a server does once at start:
    # kernels compile, a model's prefill graphs are captured), then the measured runs
    warm = f"long{n}"
    arrive(-1)
    for _ in range(4 * (prompt_len // budget + 2)):
        if any(o.request_id == warm and o.finished for o in ex.step()):
            break
    steady, _, _ = _gaps(ex, ids, steps, arrive, 0)
    busy, walls, admitted = _gaps(ex, ids, steps, arrive, every)
    for rid in ids:
        ex.abort(rid)
    while not ex.idle:
        ex.step()
    step = statistics.median(steady)
    slowest = np.argsort(walls)[-5:][::-1].tolist()  # step indices (arrivals at i % every == 0)
    return dict(budget=budget, steady_step_us=step * 1e6,
                gap_max_us=max(busy) * 1e6, gap_p99_us=float(np.percentile(busy, 99)) * 1e6,
                gap_mean_us=statistics.fmean(busy) * 1e6, worst_over_step=max(busy) / step,
                prompts=n, prompt_tokens=admitted,
                slowest_steps=[(i, round(walls[i] * 1e6)) for i in slowest])  # fmt: skip


def prefill_section(ex, budgets=(256, 1024, 4096), streams: int = 32, prompt_len: int = 3000,
                    every: int = 8, steps: int = 200, seed: int = 0) -> dict:  # fmt: skip
    """Rows per budget on `ex` (its keys captured; max_seq_len > prompt_len + 2)."""
    if ex.model.max_seq_len < prompt_len + 3:
        raise ValueError(f"the model's max_seq_len ({ex.model.max_seq_len}) must exceed "
                         f"prompt_len + 2 ({prompt_len + 2})")  # fmt: skip
    rows = []
    for b in budgets:
        r = measure_budget(ex, b, streams, prompt_len, every, steps, seed)
        rows.append(r)
        print(f"prefill budget {b:5d}: worst gap {r['gap_max_us']:9.0f} us, p99 "
              f"{r['gap_p99_us']:9.0f} us, steady step {r['steady_step_us']:7.0f} us "
              f"({r['worst_over_step']:.1f}x); slowest steps (index, us) "
              f"{r['slowest_steps']}", flush=True)  # fmt: skip
    return dict(streams=streams, prompt_len=prompt_len, every=every, steps=steps, rows=rows)


def prefill_markdown(section: dict) -> str:
    lines = [f"Long prompts: {section['streams']} running streams; a {section['prompt_len']}-"
             f"token prompt arrives every {section['every']} steps ({section['steps']} steps).",
             "| prefill_budget | steady step us | worst gap us | worst / step | p99 gap us "
             "| mean gap us |", "|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for r in section["rows"]:
        lines.append(f"| {r['budget']} | {r['steady_step_us']:.0f} | {r['gap_max_us']:.0f} | "
                     f"{r['worst_over_step']:.1f}x | {r['gap_p99_us']:.0f} | "
                     f"{r['gap_mean_us']:.0f} |")  # fmt: skip
    return "\n".join(lines)
