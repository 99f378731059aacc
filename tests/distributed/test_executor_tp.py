"""DecodeExecutor with tp_group: on every rank, each request gets the tokens it gets on
one rank (TableModel and TinyLM sharded by vocabulary; with speculation too), replayed
(emulated on the CPU) and eager."""

from __future__ import annotations

import pytest

import graphexec as gx
import graphexec.app.workload as wl
from tests.distributed.ranks import run_ranks

V = 301


def items() -> list[wl.WorkItem]:
    # seven: one request of each of the workload's kinds
    return wl.mixed_workload(7, V, seed=3, spread=4, max_tokens=(2, 10), unseeded_every=0)


def model(kind: str, shard=None):
    if kind == "table":
        return gx.models.TableModel(V, seed=1, shard=shard)
    return gx.models.TinyLM(V, seed=2, dim=32, layers=1, heads=2, max_seq_len=64, shard=shard)


def streams(ex, mode=None) -> dict:
    trace = wl.run(ex, items(), mode=mode)
    return {r: [(o.token_id, o.logprob) for o in v] for r, v in sorted(trace.outputs.items())}


def executor(m, spec: bool, **kw) -> gx.DecodeExecutor:
    s = gx.SpeculativeConfig(3, drafter="ngram") if spec else None
    ex = gx.DecodeExecutor(m, max_batch_size=4, device="cpu", buckets=(1, 2, 4), seed=0,
                           speculative=s, **kw)  # fmt: skip
    ex.capture(progress=False)
    return ex


def _worker(rank: int, world: int, worlds) -> dict[int, list[dict]]:
    """Every T of `worlds` on a group of the first T of `world` ranks (one start of the
    processes serves every T)."""
    import torch.distributed as dist

    out = {}
    for T, cases in worlds:
        group = dist.group.WORLD if T == world else dist.new_group(list(range(T)))
        if rank < T:
            out[T] = _cases(rank, T, group, cases)
    return out


def _cases(rank: int, world: int, group, cases) -> list[dict]:
    out = []
    for kind, spec, method in cases:
        # one executor replayed, then eager (the second run also starts from its state)
        ex = executor(model(kind, (rank, world)), spec, tp_group=group, tp_method=method)
        got = {mode: streams(ex, mode) for mode in (None, "eager")}
        out.append(got)
    return out


def same(got: dict, want: dict) -> None:
    """Tokens exactly; logprobs to 1e-5 (a sum over slices rounds differently)."""
    assert {r: [t for t, _ in v] for r, v in got.items()} == {
        r: [t for t, _ in v] for r, v in want.items()}  # fmt: skip
    for r, v in want.items():
        lps = [(a, b) for (_, a), (_, b) in zip(v, got[r], strict=True) if a is not None]
        assert [b for _, b in lps] == pytest.approx([a for a, _ in lps], rel=1e-5, abs=1e-6)


WORLDS = [(2, [("table", False, "all_to_all"), ("tiny", False, "vocab_parallel"),
               ("tiny", True, "all_to_all")]),
          (3, [("table", True, "vocab_parallel")])]  # fmt: skip


def test_each_rank_gets_the_one_rank_streams() -> None:
    """One start of 3 ranks serves every case: T = 2 on a group of ranks 0 and 1, then T = 3
    (spawning ranks is the cost)."""
    per_rank = run_ranks(3, _worker, WORLDS)
    for T, cases in WORLDS:
        wants = [streams(executor(model(kind), spec)) for kind, spec, _ in cases]
        for got_rank in per_rank[:T]:
            for got, want in zip(got_rank[T], wants, strict=True):
                same(got[None], want)
                same(got["eager"], want)
                assert got[None] == got["eager"]  # replay == eager, logprobs bit for bit


def test_tp_group_refuses_what_it_cannot_serve() -> None:
    with pytest.raises(ValueError, match="not initialised"):
        gx.DecodeExecutor(model("table"), device="cpu", tp_group=object())
    with pytest.raises(ValueError, match="tp_method"):
        gx.DecodeExecutor(model("table"), device="cpu", tp_group=object(), tp_method="bogus")
    with pytest.raises(ValueError, match="rank"):
        gx.models.TableModel(V, shard=(2, 2))
