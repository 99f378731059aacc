"""The GPU sampler tests' inputs and their comparison with the torch reference: mixed
parameters, the benchmark's shapes, and equality up to near ties (`test_sampler_gpu`,
`test_routes_gpu`, the speculative GPU tests)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

import graphexec as gx
from graphexec.rng import Stream
from graphexec.sampling import processing, reference
from graphexec.sampling.tensors import SamplingTensors

P = gx.SamplingParams
NEAR_TIE = 1e-5
# bench_sampler's filters: none, top-k 50 + top-p 0.9, top-p 0.9, min-p 0.05
BENCH_PARAMS = [dict(), dict(top_k=50, top_p=0.9), dict(top_p=0.9), dict(min_p=0.05)]


def mixed_params(B: int, V: int, seed: int = 0) -> list[gx.SamplingParams]:
    g = torch.Generator().manual_seed(seed)
    kinds = [
        lambda i: P(temperature=0.8, top_k=50, top_p=0.9, seed=i, logprobs=5),
        lambda i: P(temperature=0.0, seed=i, logprobs=0),
        lambda i: P(temperature=1.0, seed=i),
        lambda i: P(temperature=0.7, top_p=0.95, seed=i, logprobs=20, logprobs_mode="processed"),
        lambda i: P(temperature=1.3, min_p=0.05, seed=i),
        lambda i: P(
            temperature=0.9,
            top_k=1000,
            seed=i,
            presence_penalty=0.5,
            frequency_penalty=0.3,
            repetition_penalty=1.2,
        ),
        lambda i: P(
            temperature=1.0,
            top_k=5,
            min_p=0.1,
            top_p=0.8,
            seed=i,
            logit_bias={int(torch.randint(V, (1,), generator=g)): 5.0, 3: -100.0},
        ),
        lambda i: P(temperature=0.5, top_k=2000, top_p=0.99, seed=i),
    ]
    return [kinds[i % len(kinds)](1000 + i) for i in range(B)]


def make_inputs(B: int, V: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    logits = (torch.randn(B, V, device="cuda", generator=g) * 4).to(dtype)
    counts = torch.randint(0, 3, (B, V), device="cuda", generator=g, dtype=torch.int32)
    counts = counts * (torch.rand(B, V, device="cuda", generator=g) < 0.001)
    prompt = torch.rand(B, V, device="cuda", generator=g) < 0.001
    bitmask = torch.randint(
        -(2**31), 2**31 - 1, (B, (V + 31) // 32), device="cuda", generator=g, dtype=torch.int32
    )
    bitmask[::3] = -1  # every third row unconstrained
    return logits, counts.to(torch.int32), prompt, bitmask


def near_tie_ok(logits, params, pos, counts, prompt, bitmask, row, tok_ref, tok_tri) -> bool:
    """Whether two backends' tokens for a row may differ by rounding alone (exp and log
    differ in their last bits between torch and Triton): the reference scores of the two
    blocks (two-level draw) or tokens lie within NEAR_TIE relative, or the row's top-p cut
    lies within NEAR_TIE of a token's boundary (the kept sets may differ by that token)."""
    V = logits.shape[1]
    table = SamplingTensors.from_params(
        [params[row]], V, "cuda", counts[row : row + 1], prompt[row : row + 1]
    )
    slots = torch.zeros(1, dtype=torch.int64, device="cuda")
    x = processing.collapse_inf(
        processing.process_logits(logits[row : row + 1], slots, table, bitmask[row : row + 1])
    )
    posr = torch.tensor([pos[row]], device="cuda")

    def close(a: float, b: float) -> bool:
        return abs(a - b) <= NEAR_TIE * max(1.0, abs(a))

    if params[row].temperature == 0:
        return close(x[0, tok_ref].item(), x[0, tok_tri].item())
    y = processing.scale(x, slots, table)
    s = reference.effective_inv_t(slots, table)
    kept = reference.filter_mask(y, slots, table, reference.row_mass(x, s, reference.DRAW_BLOCK))
    p = float(table.top_p[0])
    if p < 1.0:  # the boundary of the top-p cut: the mass before some token near p * total
        sv = torch.sort(y[0], descending=True, stable=True).values
        q = (torch.exp(sv) * 2.0**32).to(torch.int64).double()
        before = torch.cumsum(q, 0) - q
        k = int(table.top_k[0])
        total = q[:k].sum() if k > 0 else reference.row_mass(x, s, reference.DRAW_BLOCK)[0]
        if ((before - p * total).abs() <= NEAR_TIE * p * total).any():
            return True
    db = reference.DRAW_BLOCK
    xm, qb = reference.block_stats(x, s, db)
    ym = torch.where(xm > -torch.inf, (xm - processing.row_max(x)) * s, -torch.inf)
    plain = bool(reference.plain_rows(slots, table)[0])
    mass = qb if plain else reference.block_stats(x, s, db, kept)[1]
    lb = ym + torch.log(mass.float()) + reference.row_gumbel_stream(
        table.seed, posr, ym.shape[1], Stream.BLOCK)  # fmt: skip
    if tok_ref // db != tok_tri // db:
        return close(lb[0, tok_ref // db].item(), lb[0, tok_tri // db].item())
    sc = y[0] + reference.row_gumbel_stream(table.seed, posr, V, Stream.TOKEN)[0]
    return close(sc[tok_ref].item(), sc[tok_tri].item())


def assert_equal_up_to_near_ties(logits, params, pos, ref, got) -> None:
    """Token ids ref and got [B] are equal but at near-ties (rows without penalties or a
    bitmask)."""
    B, V = logits.shape
    counts = torch.zeros(B, V, dtype=torch.int32, device=logits.device)
    prompt = torch.zeros(B, V, dtype=torch.bool, device=logits.device)
    ones = torch.full((B, (V + 31) // 32), -1, dtype=torch.int32, device=logits.device)
    for r in (ref != got).nonzero().flatten().tolist():
        tie = near_tie_ok(logits, params, pos, counts, prompt, ones, r, ref[r].item(),
                          got[r].item())  # fmt: skip
        assert tie, f"row {r} differs from the torch reference beyond a near-tie"


def shape_logits(shape: str, B: int, V: int, seed: int) -> torch.Tensor:
    """The benchmark's shapes (`benchmarks/bench_sampler.py`)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from sampler_methods import make_logits

    return make_logits(shape, B, V, torch.float32, torch.device("cuda"), seed)
