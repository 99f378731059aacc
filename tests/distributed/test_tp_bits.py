"""The same bits at T = 1 and T = 2 (gloo ranks, CPU): a row-parallel layer splits K into
S = 4 parts whose float32 tree the ranks share (`models.row_parallel`), so the sharded
model's logits are the unsharded model's, bit for bit, and so are seeded token streams.
T = 4 is checked per layer (`test_row_linear_trees_agree_at_every_world`); T = 3, whose
world does not divide S, keeps the close-but-not-bitwise reduce (test_hf_tp.py)."""

from __future__ import annotations

import pytest
import torch

import graphexec as gx
import graphexec.app.workload as wl
from graphexec.distributed import vocab_slices
from graphexec.kernels.cpu_route import RowMM
from graphexec.kernels.matmul import tree_sum
from graphexec.kernels.row_parallel import RowSplit, row_linear_reference, row_split_cpu
from graphexec.models import HFTransformer
from graphexec.models.hf_random import random_state_dict
from graphexec.models.hf_shard import BIT_WORLDS, head_pieces
from tests.distributed.arrangements import same, streams
from tests.distributed.ranks import run_ranks
from tests.distributed.test_hf_tp import logits_script, numpy

V = 301  # odd: uneven vocabulary slices (151, 150)
TINY = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=V, intermediate_size=64, max_position_embeddings=128)  # fmt: skip
CASES = (("llama", torch.float32, {}), ("qwen2", torch.bfloat16, {"tie_word_embeddings": True}))


def model(kind: str, dtype: torch.dtype, extra: dict, group) -> HFTransformer:
    cfg = dict(TINY, model_type=kind, **extra)
    state = random_state_dict(cfg, seed=1, dtype=dtype)  # the same weights in every process
    return HFTransformer(cfg, state, dtype=dtype, max_seq_len=64, tp_group=group)


def work() -> list[wl.WorkItem]:
    return wl.mixed_workload(6, V, seed=5, spread=2, max_tokens=(3, 6), unseeded_every=0)


def run_streams(m: HFTransformer, group) -> dict:
    ex = gx.DecodeExecutor(m, max_batch_size=4, device="cpu", buckets=(1, 4), seed=0,
                           tp_group=group)  # fmt: skip
    ex.capture(progress=False)
    return streams(wl.run(ex, work()))


def _one_and_two(rank: int, world: int) -> dict:
    """Per case: this rank's logits and streams at T = 2, and at T = 1 (the whole model,
    in this process: the same torch thread count as the ranks)."""
    import torch.distributed as dist

    out = {}
    for kind, dtype, extra in CASES:
        two = model(kind, dtype, extra, dist.group.WORLD)
        one = model(kind, dtype, extra, None)
        res = {"slice": two.vocab_slice, "two": numpy(logits_script(two)),
               "one": numpy(logits_script(one)),
               "splits": (two.row_splits["o"].local, one.row_splits["o"].local)}  # fmt: skip
        if dtype == torch.bfloat16:  # streams: the executor's TP sampler over the slices
            res["streams"] = (run_streams(two, dist.group.WORLD), run_streams(one, None))
        out[kind] = res
    return out


def test_logits_and_streams_are_the_same_bits_at_one_and_two_ranks() -> None:
    per_rank = run_ranks(2, _one_and_two)
    for kind, _, _ in CASES:
        for got in per_rank:
            res = got[kind]
            lo, hi = res["slice"]
            assert res["splits"] == (2, 4)
            for what, x in res["two"].items():
                want = res["one"][what][..., lo:hi]
                assert x.shape == want.shape and (x == want).all(), f"{kind} {what}"
            if "streams" in res:
                two, one = res["streams"]
                assert sum(len(v) for v in one.values()) > 15
                same(two, one, f"{kind}: two ranks against one")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_linear_trees_agree_at_every_world(dtype) -> None:
    """The CPU route's row-parallel product of a whole weight (S = 4, rounded once, with a
    bias) equals, bit for bit, the tree finished over T = 2 or 4 column shards' float32
    subtree sums, then the bias and one rounding."""
    g = torch.Generator().manual_seed(0)
    N, K = 24, 64
    x, w = torch.randn(9, K, generator=g).to(dtype), torch.randn(N, K, generator=g).to(dtype)
    b = torch.randn(N, generator=g).to(dtype)
    rows = RowMM()
    kmajor = lambda t: t.float().t().contiguous().t()  # noqa: E731 (the route's row_weight)
    whole = rows.row_linear(x, kmajor(w), row_split_cpu(N, K, 1), b)
    assert whole.dtype == dtype
    for T in (2, 4):
        split = row_split_cpu(N, K, T)
        assert split == RowSplit(4, T)
        c = K // T
        subs = [rows.row_linear(x[:, r * c : (r + 1) * c], kmajor(w[:, r * c : (r + 1) * c]),
                                split, f32=True) for r in range(T)]  # fmt: skip
        assert all(s.dtype == torch.float32 for s in subs)
        assert torch.equal((tree_sum(subs) + b.float()).to(dtype), whole), T
    # the batched parts (the route's fast path) are the bits of one product per part
    ref = row_linear_reference(x, kmajor(w), row_split_cpu(N, K, 1), b, mm=rows.mm)
    assert torch.equal(ref, whole)
    assert row_split_cpu(N, K, 3) is None and row_split_cpu(N, 66, 1) is None


@pytest.mark.parametrize("V", [301, 302, 7, 49152])
def test_head_pieces_are_the_same_calls_at_every_world(V: int) -> None:
    """The CPU route's LM head pieces: every rank of every world in BIT_WORLDS cuts its
    vocabulary slice into the same global pieces, so a piece is the same call at each (V =
    302: T = 2's boundary, 151, is none of T = 4's, 76 / 152 / 227, and is cut at too)."""
    want = None
    for world in BIT_WORLDS:
        got = []
        for lo, hi in vocab_slices(V, world):
            pieces = head_pieces(V, lo, hi)
            assert pieces[0][0] == 0 and pieces[-1][1] == hi - lo
            ends = [x for p in pieces for x in p]  # a0, b0, a1, b1, ...: b_i == a_i+1
            assert ends[1:-1:2] == ends[2::2] and all(a < b for a, b in pieces)
            got += [(lo + a, lo + b) for a, b in pieces]
        want = want or got
        assert got == want, world
    assert len(want) == (5 if V % 4 == 2 else 4)
