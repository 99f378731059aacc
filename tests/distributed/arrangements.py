"""The streams of one seeded workload in every arrangement that must not change them, for
the tensor-parallel model tests (gloo on the CPU, NCCL on GPUs)."""

from __future__ import annotations

import dataclasses

import pytest

import graphexec as gx
from graphexec.app import workload as wl


def streams(trace: wl.Trace) -> dict[str, list[tuple[int, float | None]]]:
    return {r: [(o.token_id, o.logprob) for o in v] for r, v in sorted(trace.outputs.items())}


def arrangements(make, work: list[wl.WorkItem], waves: int) -> dict[str, dict]:
    """The streams of `work` on executors from `make(spec)`, by arrangement: one batch,
    alone, in `waves` waves, reversed, eager and a second executor (another admission
    order), n-gram speculation replayed and eager."""
    ex: gx.DecodeExecutor = make(False)
    traces = wl.compositions(ex, work, waves=waves)  # one batch, alone, waves, reversed
    together = sorted(work, key=lambda it: it.request_id)  # another admission order
    together = [dataclasses.replace(it, arrive=0) for it in together]
    traces["eager"] = wl.run(ex, together, mode="eager")
    traces["second run"] = wl.run(make(False), together)
    spec = make(True)
    traces["ngram"] = wl.run(spec, together)
    traces["ngram, eager"] = wl.run(spec, together, mode="eager")
    # replayed (captured, or emulated on the CPU), and drafts verified
    assert sum(ex.stats.replays.values()) > 0 and sum(spec.stats.replays.values()) > 0
    assert any(k.spec_k for k in wl.outputs_per_key(traces["ngram"]))
    return {name: streams(t) for name, t in traces.items()}


def same(got: dict, want: dict, what: str, rel: float = 1e-5) -> None:
    """Tokens exactly; logprobs to `rel` (the TP sampler's sums over slices)."""
    assert {r: [t for t, _ in v] for r, v in got.items()} == {
        r: [t for t, _ in v] for r, v in want.items()}, what  # fmt: skip
    for r, v in want.items():
        lps = [(a, b) for (_, a), (_, b) in zip(v, got[r], strict=True) if a is not None]
        assert [b for _, b in lps] == pytest.approx([a for a, _ in lps], rel=rel, abs=rel / 10)
