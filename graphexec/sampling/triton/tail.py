"""The row tail: after the stats pass, one program a row serves it or plans its next
passes (the route map: the package docstring).

`tail_row` draws the rows that need nothing more (invalid, greedy, unfiltered, all tied)
and each filtered row's candidate, then decides it: top-k first (`topk`) for a row whose
top-k is on, at most `SamplerConfig.top_k_first`; otherwise the candidate's membership
from the blocks that reach it (`candidate.decide_in_tail`), and where that does not settle
the row, the plan of its next passes (`stats._plan`: a lower bound lo of its kept values
and the list of the blocks that reach it). Two kernels run it: `_tail_kernel` (no_filter,
default) and `_topk_kernel` (top_k_top_p: every filtered row top-k first, nothing after).
"""

from __future__ import annotations

import triton
import triton.language as tl

from graphexec.kernels.dependent_launch import dependent_start
from graphexec.sampling.triton import sampler_config as cf
from graphexec.sampling.triton.candidate import KEPT, OUT, decide_in_tail
from graphexec.sampling.triton.clock import stamp
from graphexec.sampling.triton.draw import (
    block_noise,
    candidate_draw,
    greedy_token,
    row_blocks,
    ties_draw,
)
from graphexec.sampling.triton.process import row_inputs
from graphexec.sampling.triton.stats import _plan
from graphexec.sampling.triton.topk import topk_first


@triton.jit
def tail_row(P, W, tok_ptr, valid_ptr, row, NBLK, FILTERS: tl.constexpr, EVERY: tl.constexpr,
             NB_P2: tl.constexpr, NBLK_P2: tl.constexpr, DB: tl.constexpr, NBINS: tl.constexpr,
             FL: tl.constexpr, R: tl.constexpr, CB: tl.constexpr, TKF: tl.constexpr,
             ST: tl.constexpr, MT: tl.constexpr, WCAP: tl.constexpr, INTERP: tl.constexpr,
             ITA: tl.constexpr, ITB: tl.constexpr, SB: tl.constexpr, WAYS: tl.constexpr,
             PROF: tl.constexpr, PDL: tl.constexpr, part=0, parts=1,
             MULTI: tl.constexpr = False):  # fmt: skip
    """Row `row`'s tail (module docstring); EVERY: each filtered row top-k first, whatever
    its filters (no later pass runs: a row past the route is served by the exact search),
    and R_EXACT marks the rows the exact search served (for tests). PROF: phase clocks
    (`clock`: 0 start, 1 block stats read, 2 candidate drawn, 3-8 top-k first's, 9 end).
    The row's inputs are read before the wait for the stats pass (`process.row_inputs`).
    MULTI (EVERY only): `parts` programs serve the row, this one `part`: the last part
    draws what one program draws (the candidate, a greedy or tied row's token) and the
    others gather top-k first's candidates meanwhile (`topk.topk_first`); whoever ends the
    row stores it."""
    slot, greedy, s, seed, pos, ids, top_k, top_p, lnmp = row_inputs(P, row, NB_P2)
    gb = block_noise(seed, pos, NBLK_P2)  # the candidate's, while the stats pass runs
    dependent_start(PDL)
    stamp(W, row, 0, PROF, 0)
    b = tl.arange(0, NBLK_P2)
    bm = b < NBLK
    base = row * NBLK
    xm, mx, has_inf, m, ym, q = row_blocks(W, row, s, NBLK, NBLK_P2)
    valid = mx > float("-inf")
    tok = tl.full([], -1, tl.int32)
    route = tl.zeros([], dtype=tl.int32)
    lead = part == parts - 1
    done = lead  # whether this program stores the row's outcome
    if valid:
        if greedy:
            if lead:
                tok = greedy_token(P, row, slot, ids, xm, mx, NBLK_P2, DB, FL)
        else:
            filt = tl.zeros([], dtype=tl.int1)
            if FILTERS:
                filt = (top_k > 0) | (top_p < 1.0) | (lnmp > float("-inf"))
            if filt:
                first = tl.zeros([], dtype=tl.int1)  # top-k first (`topk`): the whole row here
                if EVERY:
                    first = tl.full([], 1, tl.int1)
                elif TKF > 0:
                    first = (top_k > 0) & (top_k <= TKF)
                # the top-p total of rows with top-k off (`reference.mass_total`: fixed
                # point, so no layout of this sum changes it; a top-k row's is its top-k
                # mass: every reader takes it only at top-k 0)
                total = tl.zeros([], dtype=tl.float64)
                if (top_k <= 0) | (first == 0):
                    t = q.to(tl.float64) * tl.exp(ym.to(tl.float64)) * cf.TOTAL_FIX
                    fixed = tl.sum(tl.where(q > 0, t, 0.0).to(tl.int64), axis=0)
                    total = fixed.to(tl.float64) * cf.TOTAL_UNFIX
                tl.store(W.total + row, total)
                xn = tl.load(W.xn + base + b, mask=bm, other=float("inf"), cache_modifier=".cg")
                ties = has_inf | (tl.min(tl.where(xm > float("-inf"), xn, float("inf")), 0) == mx)
                stamp(W, row, 1, PROF)
                if ties:
                    if lead:
                        tok = ties_draw(P, row, slot, ids, mx, ym, q, top_k, top_p, total, seed,
                                        pos, NBLK, NBLK_P2, DB, FL, gb)  # fmt: skip
                else:
                    ri, fr = W.rowi + row * cf.NUM_I, W.rowf + row * 8
                    c = tl.full([], -1, tl.int32)
                    yc = tl.zeros([], dtype=tl.float32)
                    if lead:
                        c, yc = candidate_draw(P, row, slot, ids, ym, q, m, s, False, seed, pos,
                                               NBLK, NBLK_P2, DB, FL, gb)  # fmt: skip
                        tl.store(fr + cf.F_YC, yc)
                        if first:
                            tl.store(ri + cf.I_CAND, c.to(tl.int64))
                    stamp(W, row, 2, PROF)
                    if first:
                        tok, exact, done = topk_first(P, W, row, slot, ids, ym, xn, m, s, top_k,
                                                      top_p, lnmp, total, seed, pos, NBLK,
                                                      NBLK_P2, DB, R, ST, MT, WCAP, INTERP, ITA,
                                                      ITB, SB, WAYS, FL, PROF, part, parts,
                                                      MULTI)  # fmt: skip
                        if EVERY:
                            route = tl.where(exact, cf.R_EXACT, route)
                    else:
                        state = decide_in_tail(P, W, row, slot, ids, ym, c, yc, m, s, top_k,
                                               top_p, lnmp, total, NBLK, NBLK_P2, DB, R, CB,
                                               FL)  # fmt: skip
                        tl.store(ri + cf.I_CAND, tl.where(state == OUT, -1, c).to(tl.int64))
                        if state == KEPT:
                            tok = c
                        elif state == cf.R_CHECK:
                            # the check pass's row scale (`_plan` stores it for the others)
                            tl.store(fr + cf.F_M, m)
                            tl.store(fr + cf.F_S, s)
                            route = tl.full([], cf.R_CHECK, tl.int32)
                        else:
                            route = _plan(W, row, ym, xn, q, top_k, top_p, lnmp, m, s, total,
                                          NBLK, NBLK_P2, DB, NBINS)  # fmt: skip
            elif lead:
                tok, y_unused = candidate_draw(P, row, slot, ids, ym, q, m, s, has_inf, seed,
                                               pos, NBLK, NBLK_P2, DB, FL, gb)  # fmt: skip
    if done & ((route == cf.R_DONE) | (route == cf.R_EXACT)):
        tl.store(W.rowi + row * cf.NUM_I + cf.I_ROUTE, route.to(tl.int64))
        tl.store(tok_ptr + row, tok.to(tl.int64))
        tl.store(valid_ptr + row, valid)
    stamp(W, row, 9, PROF, 1)


@triton.jit
def served_first(P, row, TKF: tl.constexpr):
    """Whether the default variant serves row `row` top-k first (0 < top_k <= TKF): with
    `SamplerConfig.topk_launch`, `_topk_kernel` serves those rows and `_tail_kernel` the
    others. A function of the row's parameters alone, so both kernels agree before their
    waits."""
    k = tl.load(P.top_k + tl.load(P.slots + row))
    return (k > 0) & (k <= TKF)


@triton.jit(do_not_specialize=["NBLK"])
def _tail_kernel(
    P, W,
    tok_ptr, valid_ptr,  # [B] i64 / bool out: rows the tail serves
    NBLK, FILTERS: tl.constexpr, NB_P2: tl.constexpr, NBLK_P2: tl.constexpr,
    DB: tl.constexpr, NBINS: tl.constexpr, FL: tl.constexpr, R: tl.constexpr,
    CB: tl.constexpr, TKF: tl.constexpr, ST: tl.constexpr, MT: tl.constexpr, WCAP: tl.constexpr,
    INTERP: tl.constexpr, ITA: tl.constexpr, ITB: tl.constexpr, SB: tl.constexpr,
    WAYS: tl.constexpr, PROF: tl.constexpr = False, PDL: tl.constexpr = False,
    SKIP: tl.constexpr = 0, QUEUE: tl.constexpr = False,
):  # fmt: skip
    """Grid (B,) (no_filter, default): the row tail of row b serves it, or decides its
    candidate and plans its next passes (module docstring). SKIP > 0: rows that
    `_topk_kernel` served before it (`served_first` at SKIP) are left alone, and TKF is 0,
    so this kernel holds no top-k-first code. FILTERS: program 0 empties the row lists of
    round 1 and round 2, which the short kernel and round 1's finish fill. QUEUE: rows
    planned here count in the late queue's gate (`late`)."""
    row = tl.program_id(0)
    skip = tl.zeros([], dtype=tl.int1)
    if SKIP > 0:
        skip = served_first(P, row, SKIP)
    if skip:
        dependent_start(PDL)  # every program waits for the stats pass before it ends
    else:
        tail_row(P, W, tok_ptr, valid_ptr, row, NBLK, FILTERS, False, NB_P2, NBLK_P2, DB, NBINS,
                 FL, R, CB, TKF, ST, MT, WCAP, INTERP, ITA, ITB, SB, WAYS, PROF, PDL)  # fmt: skip
        if QUEUE:
            tl.debug_barrier()  # the route tail_row stored
            route = tl.load(W.rowi + row * cf.NUM_I + cf.I_ROUTE)
            if (route == cf.R_SELECT) | (route == cf.R_CUT):
                tl.atomic_add(W.queue + cf.Q_NEED, 1, sem="relaxed")
    if FILTERS:
        if row == 0:
            tl.store(W.listed, 0)
            tl.store(W.refine, 0)


@triton.jit(do_not_specialize=["NBLK"])
def _topk_kernel(
    P, W,
    tok_ptr, valid_ptr,  # [B] i64 / bool out: every row's token and validity
    NBLK, NB_P2: tl.constexpr, NBLK_P2: tl.constexpr, DB: tl.constexpr, NBINS: tl.constexpr,
    FL: tl.constexpr, R: tl.constexpr, ST: tl.constexpr, MT: tl.constexpr, WCAP: tl.constexpr,
    INTERP: tl.constexpr, ITA: tl.constexpr, ITB: tl.constexpr, SB: tl.constexpr,
    WAYS: tl.constexpr, PROF: tl.constexpr = False, PDL: tl.constexpr = False, PARTS=1,
    MULTI: tl.constexpr = False, TKF: tl.constexpr = 0, CB: tl.constexpr = 0,
):  # fmt: skip
    """Grid (B * PARTS,) (top_k_top_p: the last launch): the row tail with every filtered
    row top-k first, so that row b is served whole, by PARTS programs (MULTI: more than
    one; `tail_row`). TKF > 0 (the default variant with `SamplerConfig.topk_launch`), grid
    (B,): only the rows `served_first` picks, as the default tail serves them; the
    others are `_tail_kernel`'s."""
    if TKF > 0:
        row = tl.program_id(0)
        if served_first(P, row, TKF):
            tail_row(P, W, tok_ptr, valid_ptr, row, NBLK, True, False, NB_P2, NBLK_P2, DB, NBINS,
                     FL, R, CB, TKF, ST, MT, WCAP, INTERP, ITA, ITB, SB, WAYS, PROF,
                     PDL)  # fmt: skip
        else:
            dependent_start(PDL)
    else:
        tail_row(P, W, tok_ptr, valid_ptr, tl.program_id(0) // PARTS, NBLK, True, True, NB_P2,
                 NBLK_P2, DB, NBINS, FL, R, 0, 0, ST, MT, WCAP, INTERP, ITA, ITB, SB, WAYS, PROF,
                 PDL, tl.program_id(0) % PARTS, PARTS, MULTI)  # fmt: skip
