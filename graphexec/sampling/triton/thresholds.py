"""A filtered row's candidate thresholds, from its block stats alone (`rowdraw`, step 4).

Terms as in `rowdraw`: yb the block maxes of y = (x - m) * s, Q_b the exact block masses
relative to the block max. Two numbers per row:

    cert   a threshold that provably holds the kept set: top-k's k-th largest block max
           (at least k tokens lie at or above it), min-p's ln(min_p) less a margin (unless
           top-p needs the mass of the whole top-k prefix, which min-p may cut); -inf when
           no filter gives one (top-p alone, or k above the live blocks)
    guess  top-p without top-k: a point below which the block masses reach p * total;
           checked afterwards against the exact mass of what was gathered (-inf otherwise)

The row program computes them (`rowdraw`), except for the rows `split_gather` served
(top-p without top-k, when it runs): for those, `split_gather` computed them once per row
and stored them, and the row program reads them, so every round uses the same numbers.
"""

from __future__ import annotations

import triton
import triton.language as tl

MIN_P_MARGIN = tl.constexpr(1e-3)  # fp32 exp / log error is far below this


@triton.jit
def _grid_delta(yb, w, target):
    """The smallest delta (a 4x grid from 1/8 to 2048, refined twice in eighths) with
    sum(w where yb >= -delta) >= target; +inf when none reaches it. A delta returned
    always reaches it (refinements keep the last delta that did). Each level is one
    [NBLK_P2, 8] reduction: the latency is a chain of reductions."""
    d = tl.arange(0, 8)
    deltas = 0.125 * tl.exp2(2.0 * d.to(tl.float32))
    lo = tl.zeros([], dtype=tl.float32)
    hi = tl.full([], float("inf"), tl.float32)
    for _level in tl.static_range(3):
        sums = tl.sum(tl.where(yb[:, None] >= -deltas[None, :], w[:, None], 0.0), axis=0)
        j = tl.min(tl.where(sums >= target, d, 8), axis=0)
        lo = tl.where((j > 0) & (j < 8), tl.sum(tl.where(d == j - 1, deltas, 0.0), axis=0), lo)
        hi = tl.where(j < 8, tl.sum(tl.where(d == j, deltas, 0.0), axis=0), hi)
        deltas = lo + (hi - lo) * (d + 1).to(tl.float32) / 8.0
    return hi


@triton.jit
def block_y(xm, m, inv_t, NBLK, NBLK_P2: tl.constexpr):
    """yb [NBLK_P2]: the block maxes of y (-inf for dead blocks and the padding)."""
    b = tl.arange(0, NBLK_P2)
    return tl.where((b < NBLK) & (xm > float("-inf")), (xm - m) * inv_t, float("-inf"))


@triton.jit
def top_p_total(yb, q):
    """sum_b Q_b * exp(yb_b) in float64: the row's mass relative to its max."""
    return tl.sum(tl.where(q > 0, q.to(tl.float64) * tl.exp(yb.to(tl.float64)), 0.0), axis=0)


@triton.jit
def min_p_bound(top_k, top_p, min_p):
    """(use_m, tau_m): whether min-p's bound may cut the candidates, and the bound."""
    use_m = (min_p > 0.0) & ((top_k == 0) | (top_p >= 1.0))
    return use_m, tl.log(min_p) - MIN_P_MARGIN


@triton.jit
def candidate_thresholds(yb, q, top_k, top_p, min_p, NBLK_P2: tl.constexpr):
    """(cert, guess) of the module docstring for a row without +inf."""
    cert = tl.full([], float("-inf"), tl.float32)
    if top_k > 0:
        cert = -_grid_delta(yb, tl.full([NBLK_P2], 1.0, tl.float32), top_k.to(tl.float32))
    use_m, tau_m = min_p_bound(top_k, top_p, min_p)
    if use_m:
        cert = tl.maximum(cert, tau_m)
    guess = tl.full([], float("-inf"), tl.float32)
    if (top_k == 0) & (top_p < 1.0):
        p_total = top_p.to(tl.float64) * top_p_total(yb, q)
        guess = -_grid_delta(yb, q.to(tl.float32) * tl.exp(yb), p_total.to(tl.float32))
    return cert, guess
