"""Admission under churn on CUDA: requests arriving as slots free up, with grammars and
aborts, give the same streams replayed and eager, and memory stays flat."""

from __future__ import annotations

import dataclasses
import gc
import random

import pytest
import torch

import graphexec as gx
from graphexec.app import workload as wl

pytestmark = pytest.mark.gpu
P = gx.SamplingParams
KINDS = [P(temperature=0.0), P(temperature=0.8), P(temperature=0.7, top_k=50, top_p=0.9),
         P(min_p=0.05, logprobs=2)]  # fmt: skip


def record(trace: dict[str, list[tuple]], outputs) -> None:
    for o in outputs:
        trace.setdefault(o.request_id, []).append(
            (o.token_id, o.position, o.logprob, o.finish_reason)
        )


def churn(ex: gx.DecodeExecutor, steps: int, mode=None, seed: int = 0, memory_at=()):
    """Admit while slots are free, step `steps` times, abort 1% of the time; (outputs
    per request, CUDA memory allocated at the steps in `memory_at`, each measured once
    every running request has finished: an idle executor holds only what persists)."""
    rng, grammar = random.Random(seed), gx.Grammar.json_schema(wl.ANSWER_SCHEMA)
    trace: dict[str, list[tuple]] = {}
    mem, n = {}, 0
    for step in range(steps):
        while ex.free_slots:
            p = dataclasses.replace(KINDS[n % len(KINDS)], seed=n, max_tokens=rng.randint(1, 48),
                                    grammar=grammar if n % 10 == 9 else None)  # fmt: skip
            ex.add_request(f"r{n}", [rng.randrange(50_000) for _ in range(rng.randint(4, 64))], p)
            n += 1
        record(trace, ex.step(mode))
        if rng.random() < 0.01:
            live = sorted(r for r, v in trace.items() if v[-1][3] is None)
            if live:
                ex.abort(rng.choice(live))
        if step in memory_at:  # drained, so no step's transients (a prefill's logits) count
            while not ex.idle:
                record(trace, ex.step(mode))
            torch.cuda.synchronize()
            gc.collect()  # an earlier test's executor, freed late, is not this one's growth
            mem[step] = torch.cuda.memory_allocated()
    return trace, mem


@pytest.fixture(scope="module")
def tok() -> gx.Tokenizer:
    return gx.Tokenizer.cl100k()


def executor(tok, budget: int = 1024) -> gx.DecodeExecutor:
    model = gx.models.TinyLM(tok.vocab_size, seed=0, max_seq_len=128)
    ex = gx.DecodeExecutor(model, max_batch_size=64, device="cuda", tokenizer=tok, seed=0,
                           prefill_budget=budget)  # fmt: skip
    ex.capture(progress=False)
    assert ex.stats.failed == {}
    return ex


def test_replay_equals_eager_under_churn(tok) -> None:
    replay, _ = churn(executor(tok, budget=96), 400)
    eager, _ = churn(executor(tok, budget=96), 400, mode="eager")
    assert replay == eager
    assert len(replay) > 400 and sum(v[-1][3] == "abort" for v in replay.values()) > 0


def test_memory_is_flat_over_20000_churn_steps(tok) -> None:
    ex = executor(tok)
    trace, mem = churn(ex, 20_000, memory_at=(1000, 10_000, 19_999))
    assert max(mem.values()) - min(mem.values()) <= 2**20, mem  # nothing accumulates
    assert len(trace) > 20_000 and sum(ex.stats.eager_steps.values()) == 0
