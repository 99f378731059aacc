"""The candidate route: draw first, filter second (`reference`, step 6).

Whether a filtered row's candidate c (the route map) is in the kept set is decided from c
alone:

    min-p    y_c >= log_min_p: nothing more to read
    top-k    the tokens ranked above c (pack > pack_c) number fewer than k
    top-p    their exact mass (q = trunc(exp(y) 2**32), int64) is below p times the total:
             with top-k off the row's mass from its block stats; with top-k on the top-k
             mass T_k, unknown here but bounded: before + q_c <= T_k <= before + (k -
             rank) q_c (the tokens after c weigh at most q_c), so c is kept when before <
             p (before + q_c), out when before >= p (before + (k - rank) q_c), and
             decided by the cut's passes in between

Only the blocks whose max reaches y_c hold tokens ranked above c. Before reading any, the
blocks whose max is above c's prove a lower bound of the count (one token each) and of
the mass (their maxima's), which rejects c at once when it already reaches the filter's
limit. The row tail counts up to check_blocks such blocks (`decide_in_tail`); more, the
check pass (`stats._check_kernel`).
"""

from __future__ import annotations

import triton
import triton.language as tl

from graphexec.sampling.triton import sampler_config as cf
from graphexec.sampling.triton.keys import mass, mass_hi_lo, tile_mass, tile_total
from graphexec.sampling.triton.process import list_blocks, list_tile

KEPT = tl.constexpr(1)
OUT = tl.constexpr(0)
UNKNOWN = tl.constexpr(2)


@triton.jit
def decide(cnt, before, yc, top_k, top_p, total):
    """KEPT / OUT / UNKNOWN from the count and exact mass of the tokens ranked above a
    candidate of value yc that min-p keeps (module docstring)."""
    state = tl.full([], KEPT, tl.int32)
    if (top_k > 0) & (cnt >= top_k):
        state = tl.full([], OUT, tl.int32)
    elif top_p < 1.0:
        p = top_p.to(tl.float64)
        bf = before.to(tl.float64)
        if top_k <= 0:
            if bf >= p * total:
                state = tl.full([], OUT, tl.int32)
        else:
            qc = mass(yc)
            if bf >= p * (before + qc).to(tl.float64):
                state = tl.full([], UNKNOWN, tl.int32)
                if bf >= p * (before + (top_k - cnt).to(tl.int64) * qc).to(tl.float64):
                    state = tl.full([], OUT, tl.int32)
    return state


@triton.jit
def count_above(P, W, row, slot, ids, e0, e1, n_list, yc, c, m, s, NBLK, R: tl.constexpr,
                DB: tl.constexpr, FL: tl.constexpr, BIAS: tl.constexpr):  # fmt: skip
    """(count, exact int64 mass) of the tokens ranked above the candidate c of value yc
    (pack order, compared as floats and ids: no 64-bit key a token) in list entries
    e0 .. e1 - 1; per-token accumulators, reduced once."""
    zero = tl.zeros([R, DB], dtype=tl.int32)
    n, hi, lo = zero, zero, zero
    for e in range(e0, e1, R):
        x, offs, bid_unused = list_tile(P, W, row, slot, ids, e, n_list, NBLK, R, DB, FL, BIAS)
        y = (x - m) * s
        above = (y > float("-inf")) & ((y > yc) | ((y == yc) & (offs < c)))
        h, lw = mass_hi_lo(tl.where(above, y, float("-inf")))
        n += above.to(tl.int32)
        hi += h
        lo += lw
    return tile_total(n), tile_mass(hi, lo)


@triton.jit
def decide_in_tail(P, W, row, slot, ids, ym, c, yc, m, s, top_k, top_p, lnmp, total, NBLK,
                   NBLK_P2: tl.constexpr, DB: tl.constexpr, R: tl.constexpr,
                   CB: tl.constexpr, FL: tl.constexpr):  # fmt: skip
    """KEPT / OUT / UNKNOWN for candidate c (value yc) of a filtered row whose values are
    not all tied; R_CHECK (with the row's block list stored) when more than CB blocks
    must be read. CB = 0: UNKNOWN (the cut decides)."""
    state = tl.full([], UNKNOWN, tl.int32)
    if CB > 0:
        state = tl.full([], OUT, tl.int32)
        if yc >= lnmp:
            state = tl.full([], KEPT, tl.int32)
            if (top_k > 0) | (top_p < 1.0):
                b = tl.arange(0, NBLK_P2)
                bc = c // DB
                live = (b < NBLK) & (ym > float("-inf"))
                # blocks surely holding a token above c: their max is (one)
                sure = live & ((ym > yc) | ((ym == yc) & (b < bc)))
                n_sure = tl.sum(sure.to(tl.int32), axis=0)
                lb = tl.sum(tl.where(sure, mass(ym), 0), axis=0)
                if (top_k > 0) & (n_sure >= top_k):
                    state = tl.full([], OUT, tl.int32)
                elif (top_k <= 0) & (lb.to(tl.float64) >= top_p.to(tl.float64) * total):
                    state = tl.full([], OUT, tl.int32)
                else:
                    n_list = list_blocks(W, row, sure | (live & (b == bc)), NBLK, NBLK_P2)
                    ri = W.rowi + row * cf.NUM_I
                    tl.store(ri + cf.I_NLIST, n_list.to(tl.int64))
                    if n_list > CB:
                        state = tl.full([], cf.R_CHECK, tl.int32)
                        tl.store(ri + cf.I_ROUTE, tl.full([], cf.R_CHECK, tl.int64))
                        tl.store(ri + cf.I_CCNT, tl.zeros([], dtype=tl.int64))
                        tl.store(ri + cf.I_CMASS, tl.zeros([], dtype=tl.int64))
                    else:
                        tl.debug_barrier()  # the list, read back by every thread
                        cnt, before = count_above(P, W, row, slot, ids, 0, n_list, n_list,
                                                  yc, c, m, s, NBLK, R, DB, FL,
                                                  True)  # fmt: skip
                        state = decide(cnt, before, yc, top_k, top_p, total)
    return state
