"""gx.distributed.sample_logits on T gloo ranks equals gx.sample_logits on the full rows:
tokens, validity, ranks and top-N ids exactly, logprobs to 1e-5 relative, for both
methods, uneven slices, B < T, ties across a slice boundary, NaN and all-masked rows."""

from __future__ import annotations

import pytest
import torch

import graphexec as gx
from tests.distributed.ranks import run_ranks

P = gx.SamplingParams
V = 1003  # no T in {2, 3, 4} divides it


def batch(kind: str, B: int, seed: int):
    """(logits [B, V], params, positions, token_counts, prompt_mask, bitmask)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, V, generator=g) * 3
    mixed = [P(temperature=0.0, logprobs=3), P(temperature=0.8, top_k=7, logprobs=0),
             P(top_p=0.6, temperature=1.3), P(min_p=0.2, logprobs=5),
             P(top_k=40, top_p=0.9, repetition_penalty=1.4, presence_penalty=0.7,
               frequency_penalty=0.3, logit_bias={250: 4.0, 251: -9.0, 501: 6.0}),
             P(temperature=2.0), P(top_k=3, temperature=0.0),
             P(top_p=0.3, logprobs_mode="processed", logprobs=2)]  # fmt: skip
    plain = [P(temperature=0.0, logprobs=1), P(temperature=0.9), P(temperature=1.5, logprobs=4)]
    pool = mixed if kind == "mixed" else plain
    params = [pool[i % len(pool)].with_seed(seed * 100 + i) for i in range(B)]
    counts = torch.randint(0, 3, (B, V), generator=g, dtype=torch.int32)
    counts *= torch.rand(B, V, generator=g) < 0.02
    prompt = torch.rand(B, V, generator=g) < 0.01
    words = (V + 31) // 32
    bits = torch.randint(-(2**31), 2**31, (B, words), generator=g, dtype=torch.int64)
    bitmask = torch.where(torch.rand(B, 1, generator=g) < 0.3, bits, -1).to(torch.int32)
    if B > 2:
        # row 0: exact ties across every slice boundary (the lower id wins)
        x[0] = -5.0
        for lo in (250, 251, 334, 335, 501, 502, 668, 669, 751, 752):
            x[0, lo] = 7.0
        bitmask[0] = -1
        x[1] = float("nan")  # nothing samplable
        bitmask[2] = 0  # the grammar allows nothing
    pos = torch.randint(0, 1000, (B,), generator=g)
    return x, params, pos, counts, prompt, bitmask


def _compare(want, got, tag: str) -> list[str]:
    bad = []
    if not torch.equal(want.token_ids, got.token_ids):
        bad.append(f"{tag}: tokens {want.token_ids.tolist()} != {got.token_ids.tolist()}")
    if not torch.equal(want.valid, got.valid):
        bad.append(f"{tag}: valid")
    if want.logprobs is not None:
        ok = want.valid
        if not torch.allclose(want.logprobs[ok], got.logprobs[ok], rtol=1e-5, atol=1e-6):
            bad.append(f"{tag}: logprobs {want.logprobs[ok]} != {got.logprobs[ok]}")
        if not torch.equal(want.ranks[ok], got.ranks[ok]):
            bad.append(f"{tag}: ranks")
        if want.top_token_ids is not None:
            if not torch.equal(want.top_token_ids[ok], got.top_token_ids[ok]):
                bad.append(f"{tag}: top ids")
            lp, lp2 = want.top_logprobs[ok], got.top_logprobs[ok]
            if not torch.allclose(lp, lp2, rtol=1e-5, atol=1e-6):
                bad.append(f"{tag}: top logprobs")
    return bad


def _worker(rank: int, world: int, worlds) -> dict[str, list[str]]:
    """Every T of `worlds` on the first T of `world` ranks (one group each: one start of
    the processes serves every T), then `_wire` on the group of T = 2."""
    import torch.distributed as dist

    bad, groups = [], {}
    for T, cases in worlds:
        group = groups[T] = dist.group.WORLD if T == world else dist.new_group(list(range(T)))
        if rank < T:
            bad += _sample(rank, T, group, cases)
    return {"sample": bad, "wire": _wire(rank, groups[2]) if rank < 2 else []}


def _sample(rank: int, world: int, group, cases) -> list[str]:
    lo, hi = gx.distributed.vocab_slices(V, world)[rank]
    bad = []
    for kind, B, seed in cases:
        x, params, pos, counts, prompt, bitmask = batch(kind, B, seed)
        want = gx.sample_logits(x, params, pos, counts, prompt, bitmask, backend="torch")
        for method in ("all_to_all", "vocab_parallel") + (("auto",) if world == 2 else ()):
            got = gx.distributed.sample_logits(x[:, lo:hi].contiguous(), params, pos,
                                               group=group, token_counts=counts,
                                               prompt_mask=prompt, bitmask=bitmask,
                                               backend="torch", method=method)  # fmt: skip
            bad += _compare(want, got, f"T={world} rank {rank} {method} {kind} B={B} seed {seed}")
    return bad


@pytest.fixture(scope="module")
def per_rank() -> list[dict[str, list[str]]]:
    """One start of 4 ranks for both tests that need ranks (a start of 2 more cost ~5 s)."""
    worlds = [(T, [("mixed", 16, T), ("plain", 9, 10 + T), ("mixed", T - 1, 20 + T)])
              for T in (2, 3, 4)]  # fmt: skip
    return run_ranks(4, _worker, worlds)


def test_every_rank_gets_the_full_row_tokens(per_rank) -> None:
    """T = 2, 3 and 4 (groups of the first T of 4 ranks)."""
    for got in per_rank:
        assert got["sample"] == []


def test_vocab_slices_are_contiguous_and_near_even() -> None:
    s = gx.distributed.vocab_slices(10, 4)
    assert s == ((0, 3), (3, 6), (6, 8), (8, 10))
    with pytest.raises(ValueError, match="slices"):
        gx.distributed.vocab_slices(3, 4)


def _wire(rank: int, group) -> list[str]:
    """A bf16 model's float32 logits sent as bf16 (`TensorParallel.wire`) and as float32:
    the same outputs, bit for bit (the executor sets wire from a model's `logits_dtype`
    only, so only logits exact in it travel that way)."""
    import dataclasses

    x, params, pos, counts, prompt, bitmask = batch("mixed", 12, 7)
    x = x.to(torch.bfloat16).float()  # what a bf16 model's logits are
    table = gx.SamplingTensors.from_params(params, V, "cpu", counts, prompt)
    tp = gx.distributed.TensorParallel.create(group, V)
    lo, hi = tp.slice
    slots = torch.arange(12)
    outs = []
    for wire in (None, torch.bfloat16):
        out = gx.SamplerOutput.allocate(12, "cpu", 5)
        gx.distributed.sample_step(x[:, lo:hi].contiguous(), slots, pos, table, out, bitmask,
                                   backend="torch", tp=dataclasses.replace(tp, wire=wire),
                                   method="all_to_all")  # fmt: skip
        outs.append(out)
    a, b = outs

    def bits(t):  # NaN (rows with nothing samplable) equals NaN
        return t.view(torch.int32) if t.dtype == torch.float32 else t

    same = all(torch.equal(bits(getattr(a, f)), bits(getattr(b, f))) for f in
               ("token_ids", "valid", "logprobs", "ranks", "top_logprobs", "top_token_ids"))
    return [] if same else [f"rank {rank}: bf16 on the wire changed the outputs"]


def test_bf16_logits_on_the_wire_give_the_float32_outputs(per_rank) -> None:
    """On the group of ranks 0 and 1 of the fixture's 4."""
    for got in per_rank:
        assert got["wire"] == []
