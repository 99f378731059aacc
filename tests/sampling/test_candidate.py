"""Draw first, filter second (`reference`, step 6): a filtered row's token is its
unfiltered candidate when the kept set holds it, else an independent fallback draw from
the kept set. Tested here: the route is taken exactly as the definition says, each route
and their mixture follow the filtered distribution (chi-square), and the Triton kernels'
early decisions (the row tail, the check pass) and late ones (against the cut) give the
reference's tokens and routes."""

from __future__ import annotations

from tests.interpreter import ensure_interpreter

ensure_interpreter()

import numpy as np  # noqa: E402
import pytest
import scipy.stats
import torch

import graphexec as gx
from graphexec.rng import Stream
from graphexec.sampling import processing
from graphexec.sampling import reference as ref
from graphexec.sampling.tensors import SamplingTensors
from graphexec.sampling.triton.sampler_config import I_CAND, SamplerConfig
from tests.sampling.test_reference_stats import (
    ALPHA,
    FLAT,
    ROW,
    Case,
    V,
    exact_distribution,
    merged_bins,
)
from tests.sampling.triton_cases import GPU_LATE, assert_same, logits_of, run_both

P = gx.SamplingParams


def draw_many(row: torch.Tensor, case: Case, seed: int, n: int, draw_block: int = 8):
    """`reference.draw_rows` of one row at positions 0..n-1, with its kept mask."""
    params = P(seed=seed, **case.params)
    table = SamplingTensors.from_params([params], V, "cpu")
    slots = torch.zeros(n, dtype=torch.int64)
    xc = processing.collapse_inf(
        processing.process_logits(row.expand(n, -1).contiguous(), slots, table)
    )
    y = processing.scale(xc, slots, table)
    inv_t = ref.effective_inv_t(slots, table)
    stats = ref.block_stats(xc, inv_t, draw_block)
    kept = ref.filter_mask(y, slots, table, ref.row_mass(xc, inv_t, draw_block, stats))
    d = ref.draw_rows(xc, y, slots, torch.arange(n), table, kept, draw_block, stats)
    return d, kept, (xc, y, stats, table, slots)


ROUTE_CASES = [
    Case("top_p", {"top_p": 0.55}),
    Case("top_k", {"top_k": 4, "temperature": 1.4}),
    Case("top_k_top_p", {"top_k": 9, "top_p": 0.6}),
    Case("min_p", {"min_p": 0.3}),
]


@pytest.mark.parametrize("case", ROUTE_CASES, ids=[c.name for c in ROUTE_CASES])
def test_fallback_exactly_when_the_candidate_is_out(case: Case) -> None:
    n = 4000
    d, kept, (xc, y, stats, table, slots) = draw_many(ROW, case, 11, n)
    live = y > -torch.inf
    inv_t = ref.effective_inv_t(slots, table)
    ym = ref.block_ymax(xc, stats[0], inv_t)
    # the candidate is the unfiltered draw: the same as the no-filter row's token
    plain = ref.two_level(y, ym, stats[1], live, table.seed[slots], torch.arange(n),
                          ref.CANDIDATE, 8)  # fmt: skip
    assert torch.equal(d.candidate, plain)
    in_kept = kept.gather(1, d.candidate.unsqueeze(1)).squeeze(1)
    assert torch.equal(d.kept, in_kept)
    assert torch.equal(d.token_ids[in_kept], d.candidate[in_kept])
    out = ~in_kept
    assert 0.05 < out.float().mean() < 0.95, "both routes must be taken"
    # the others take the fallback draw (its own streams) over the kept set
    kb = ref.block_stats(xc, inv_t, 8, kept)[1]
    fb = ref.two_level(y, ym, kb, kept, table.seed[slots], torch.arange(n), ref.FALLBACK, 8)
    assert torch.equal(d.token_ids[out], fb[out])
    assert kept.gather(1, d.token_ids.unsqueeze(1)).all()
    assert ref.FALLBACK == (Stream.FALLBACK_TOKEN, Stream.FALLBACK_BLOCK)


def chi2(probs: np.ndarray, tokens: np.ndarray) -> float:
    support = probs > 0
    counts = np.bincount(tokens, minlength=V)
    assert not (counts * ~support).any(), "a token outside the kept set"
    obs, exp = merged_bins(counts[support], probs[support] * len(tokens))
    return scipy.stats.chisquare(obs, exp).pvalue


@pytest.mark.parametrize(
    "row,case",
    [(ROW, ROUTE_CASES[0]), (ROW, ROUTE_CASES[2]), (FLAT, Case("flat_top_p", {"top_p": 0.7}))],
    ids=["top_p", "top_k_top_p", "flat_top_p"],
)
def test_each_route_and_their_mixture_are_exact(row: torch.Tensor, case: Case) -> None:
    """Chi-square (alpha 1e-6, 120,000 draws) of the tokens of the rows whose candidate was
    kept, of those that took the fallback, and of all: each follows the filtered
    distribution (the fallback's streams are independent of the candidate's)."""
    d, _, _ = draw_many(row, case, 21, 120_000)
    probs = exact_distribution(row, case)
    tokens = d.token_ids.numpy()
    took = d.kept.numpy()
    assert took.sum() > 20_000 and (~took).sum() > 20_000
    for name, sel in (("candidate", took), ("fallback", ~took), ("mixture", took | ~took)):
        p = chi2(probs, tokens[sel])
        assert p > ALPHA, f"{case.name}, {name} route: chi-square p = {p:.3g}"


# check_blocks: 0 = every candidate decided by the cut; 1 = the check pass for almost
# every row (with the short route, or without: the short kernel then only plans the rows
# the check pass did not keep); the presets' (the row tail for few blocks, the check pass
# past them). Top-k first off: top-k rows take the candidate's routes too
_NO_TKF = dict(draw_block=16, top_k_first=0)
CHECKS = {
    "cut_only": SamplerConfig.interpreter().replace(check_blocks=0, **_NO_TKF),
    "check_pass": SamplerConfig.interpreter().replace(check_blocks=1, **_NO_TKF),
    "check_no_short": SamplerConfig.interpreter().replace(check_blocks=1, short_blocks=0,
                                                          **_NO_TKF),  # fmt: skip
    "tail": SamplerConfig.interpreter().replace(check_blocks=1 << 12, **_NO_TKF),
    "gpu_preset": SamplerConfig.gpu().replace(check_programs=GPU_LATE, late_programs=GPU_LATE,
                                              **_NO_TKF),  # fmt: skip
}
EXACT = [P(top_p=0.8, temperature=0.9), P(top_k=7), P(min_p=0.15, temperature=1.2),
         P(top_p=0.95, temperature=1.5)]  # fmt: skip
MIXED = [P(top_k=40, top_p=0.7), P(top_k=3, min_p=0.1, top_p=0.9, temperature=1.5),
         P(top_k=300, top_p=0.97, temperature=0.9)]  # fmt: skip


def _params(B: int) -> list[gx.SamplingParams]:
    kinds = EXACT + MIXED
    return [P(seed=300 + i, **{f: getattr(kinds[i % len(kinds)], f)
                               for f in ("temperature", "top_k", "top_p", "min_p")})
            for i in range(B)]  # fmt: skip


# every config on peaked rows (the richest: rows of every route under cut_only, and single
# rows whose candidate is kept and one that takes the fallback); flat rows (most tokens
# kept: many candidates for the short route and the check pass) under cut_only and
# check_pass; randn3 rows under the GPU preset. The other shape x config pairs ran the
# same lines and branches of the kernels (measured with coverage) and were dropped.
ROUTE_POINTS = [("peaked", c) for c in CHECKS] + [("flat", "cut_only"), ("flat", "check_pass"),
                                                   ("randn3", "gpu_preset")]  # fmt: skip


@pytest.mark.parametrize("shape,config", ROUTE_POINTS, ids=[f"{s}-{c}" for s, c in ROUTE_POINTS])
def test_triton_routes_and_tokens_equal_the_reference(shape: str, config: str) -> None:
    B, Vt = 14, 700
    params = _params(B)
    both = run_both(params, logits_of(shape, B, Vt, seed=9), CHECKS[config])
    assert_same(both.ref, both.tri)
    if config == "cut_only":
        return
    # rows with one filter (top-k, top-p or min-p alone) are decided exactly before the
    # cut: I_CAND is the candidate where the reference kept it, -1 where it took the
    # fallback
    d, _ = ref.draw_batch(logits_of(shape, B, Vt, seed=9), torch.arange(B), torch.arange(B) * 7 + 3,
                          both.table, draw_block=16)  # fmt: skip
    single = [i for i in range(B) if i % len(EXACT + MIXED) < len(EXACT)]
    cand = both.ws.rowi[:, int(I_CAND)]
    for i in single:
        want = int(d.candidate[i]) if bool(d.kept[i]) else -1
        assert int(cand[i]) == want, f"row {i}: I_CAND {int(cand[i])}, reference {want}"
