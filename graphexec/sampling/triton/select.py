"""Selection, pass 2 of a filtered row (top-k / top-p): a histogram of its values, then a
bracket of bins that holds the cut.

Programs (row, slice) read the row's listed blocks (ym_b >= lo, `stats`) and count the
live tokens with lo <= y <= top into NBINS bins floor((top - y) * inv_w) (`draw.bin_of`),
added atomically to the row's histogram. Counts are exact, masses estimated from the
bins' edges and middles: the kept pass (`kept`) measures them exactly and checks.

The row's last program places the bracket: bin J_k where the counts reach k; around
top-p's crossing, the bins between those where the masses' upper and lower bounds reach
p * total, or for dense bins, fine bins either side of an interpolated crossing. With both
cuts: one bracket when they touch, else bracket 1 for top-p and bracket 2 at J_k, the
middle between them summed, not gathered. It also keeps the coarse bins that surely hold
every cut (I_RA..I_RB: J_k and the bounds' span).

Round 1 bins [lo, 0] (top = 0); round 2 (`plan_round2`, why: the package docstring) the
sure bins' range alone, the tokens above its top counted with exact masses here.
"""

from __future__ import annotations

import triton
import triton.language as tl

from graphexec.kernels.dependent_launch import dependent_start
from graphexec.sampling.triton import sampler_config as cf
from graphexec.sampling.triton.draw import FINE, bin_of
from graphexec.sampling.triton.keys import mass_hi_lo, tile_mass, tile_total
from graphexec.sampling.triton.process import bias_ids, list_blocks, list_tile
from graphexec.sampling.triton.stats import arrive


@triton.jit
def load_plan(W, row):
    """(m, s, lo, top, inv_w, jhi, j1, j2, jlo): the row's max, scale, bins' low and top
    ends and scale, and bracket bounds (`stats._plan` or `plan_round2`, then `_bracket`)."""
    fr = W.rowf + row * 8
    ri = W.rowi + row * cf.NUM_I
    return (tl.load(fr + cf.F_M), tl.load(fr + cf.F_S), tl.load(fr + cf.F_LO),
            tl.load(fr + cf.F_TOP), tl.load(fr + cf.F_INVW), tl.load(ri + cf.I_JHI),
            tl.load(ri + cf.I_J1), tl.load(ri + cf.I_J2), tl.load(ri + cf.I_JLO))  # fmt: skip


@triton.jit
def _first_reaching(cum, target, j, NBINS: tl.constexpr):
    return tl.min(tl.where(cum >= target, j, NBINS), axis=0)


@triton.jit
def _at(v, j, i):
    """v[i] of a vector (0 where i is outside it)."""
    return tl.sum(tl.where(j == i, v, 0), axis=0)


@triton.jit
def _upto(v, j, i, base):
    """v[i] of a cumulative vector over the bins; base (what lies above bin 0) for i < 0."""
    return tl.where(i < 0, base, _at(v, j, i))


@triton.jit
def _top_k_mass(mass, cnt, e, j, jk, k, n_top, m_top):
    """top-k's mass estimated with per-token masses e: the bins above jk, then k minus
    their count at jk's."""
    return _upto(mass, j, jk - 1, m_top) + (k - _upto(cnt, j, jk - 1, n_top)).to(
        tl.float32) * _at(e, j, jk)  # fmt: skip


@triton.jit
def _in_fine(h, j, a, b):
    """Tokens estimated in fine bins a..b (a bin's count spread evenly over its FINE)."""
    over = tl.minimum(b, FINE * j + FINE - 1) - tl.maximum(a, FINE * j) + 1
    return tl.sum(h.to(tl.float32) * tl.maximum(over, 0).to(tl.float32), axis=0) / FINE


@triton.jit
def _bracket(P, W, row, slot, WCAP: tl.constexpr, NBINS: tl.constexpr, ROUND2: tl.constexpr):
    """Place the row's bracket from its histogram (module docstring); its bounds are in
    fine bins (`draw.bin_of`)."""
    j = tl.arange(0, NBINS)
    ri = W.rowi + row * cf.NUM_I
    h = tl.load(W.hist + row * NBINS + j, cache_modifier=".cg")
    # round 2: what lies above its bins, counted exactly (round 1: nothing)
    n_top = tl.load(ri + cf.I_NTOP, cache_modifier=".cg")
    m_top = (tl.load(ri + cf.I_MTOP, cache_modifier=".cg").to(tl.float64)
             * 2.3283064365386963e-10).to(tl.float32)  # fmt: skip
    cnt = tl.cumsum(h, axis=0).to(tl.int64) + n_top
    inv_w = tl.load(W.rowf + row * 8 + cf.F_INVW)
    top = tl.load(W.rowf + row * 8 + cf.F_TOP)
    w = tl.where(inv_w > 0.0, 1.0 / inv_w, 0.0)
    jf = j.to(tl.float32)
    # a token of bin j weighs (relative to the max) between e_lo and e_hi, about e_mid
    e_mid = tl.exp(top - (jf + 0.5) * w)
    e_lo = tl.exp(top - (jf + 1.01) * w)
    e_hi = tl.exp(top - (jf - 0.01) * w)
    mass = tl.cumsum(h.to(tl.float32) * e_mid, axis=0) + m_top
    m_lo = tl.cumsum(h.to(tl.float32) * e_lo, axis=0) + m_top
    m_hi = tl.cumsum(h.to(tl.float32) * e_hi, axis=0) + m_top
    last = tl.max(tl.where(h > 0, j, 0), axis=0)
    top_k = tl.load(P.top_k + slot)
    top_p = tl.load(P.top_p + slot)
    # top-k's cut: in bin jk, exactly (the counts are exact); all of its fine bins
    jk = tl.minimum(_first_reaching(cnt, top_k, j, NBINS), last)
    jhi = FINE * jk
    j1 = FINE * jk + FINE - 1
    ra = jk
    rb = jk
    if top_p < 1.0:
        t_row = (tl.load(W.total + row) * 2.3283064365386963e-10).to(tl.float32)
        on_k = top_k > 0
        k = tl.minimum(top_k, _at(cnt, j, NBINS - 1))  # fewer live tokens than k: all
        t_mid = tl.where(on_k, _top_k_mass(mass, cnt, e_mid, j, jk, k, n_top, m_top), t_row)
        t_lo = tl.where(on_k, _top_k_mass(m_lo, cnt, e_lo, j, jk, k, n_top, m_top), t_row)
        t_hi = tl.where(on_k, _top_k_mass(m_hi, cnt, e_hi, j, jk, k, n_top, m_top), t_row)
        # the crossing lies between the bins where the highest and lowest masses reach p * total
        ja = tl.minimum(_first_reaching(m_hi, top_p * t_lo, j, NBINS), last)
        jb = tl.minimum(_first_reaching(m_lo, top_p * t_hi, j, NBINS), last)
        span = _at(cnt, j, jb) - _upto(cnt, j, ja - 1, n_top)
        ra = tl.where(on_k, tl.minimum(ja, jk), ja)
        rb = tl.where(on_k, tl.maximum(jb, jk), jb)
        # else (dense bins, whose middles average out) fine bins either side of the crossing
        # interpolated in the estimate's bin, as many as half the gather cap holds
        target = top_p * t_mid
        jp = tl.minimum(_first_reaching(mass, target, j, NBINS), last)
        f = (target - _upto(mass, j, jp - 1, m_top)) / tl.maximum(
            _at(h.to(tl.float32) * e_mid, j, jp), 1e-30)  # fmt: skip
        at = FINE * jp + tl.minimum(tl.maximum(f * FINE, 0.0), FINE - 1.0).to(tl.int32)
        d = tl.full([], 3, tl.int32)
        for _grow in tl.static_range(8):
            wider = tl.minimum(2 * d, FINE * NBINS)
            if _in_fine(h, j, tl.maximum(at - wider, FINE * ja), at + wider) <= WCAP // 2:
                d = wider
        # the span surely holds the crossing: taken whenever it fits the cap beside top-k's bin
        narrow = span + tl.where(on_k, _at(h, j, jk), 0) <= WCAP
        jhi = tl.where(narrow, FINE * ja, tl.maximum(at - d, FINE * ja))
        j1 = tl.where(narrow, FINE * jb + FINE - 1, tl.minimum(at + d, FINE * jb + FINE - 1))
        if top_k == 0:
            jk = j1 // FINE
    # bracket 2 is bin jk when apart from bracket 1; else one bracket (top-k off: bracket 1)
    apart = FINE * jk > j1 + 1
    j1 = tl.where(apart | (top_k == 0), j1, tl.maximum(j1, FINE * jk + FINE - 1))
    j2 = tl.where(apart, FINE * jk, j1 + 1)
    jlo = tl.where(apart, FINE * jk + FINE - 1, j1)
    n_est = _in_fine(h, j, jhi, j1) + _in_fine(h, j, j2, jlo)
    tl.store(ri + cf.I_JHI, jhi.to(tl.int64))
    tl.store(ri + cf.I_J1, j1.to(tl.int64))
    tl.store(ri + cf.I_J2, j2.to(tl.int64))
    tl.store(ri + cf.I_JLO, jlo.to(tl.int64))
    if not ROUND2:
        tl.store(ri + cf.I_RA, ra.to(tl.int64))
        tl.store(ri + cf.I_RB, rb.to(tl.int64))
    if n_est > WCAP:
        tl.store(ri + cf.I_ROUTE, tl.full([], cf.R_EXACT if ROUND2 else cf.R_REFINE, tl.int64))


@triton.jit
def plan_round2(W, row, ym, xn, m, s, lo, inv_w, NBLK, NBLK_P2: tl.constexpr,
                NBINS: tl.constexpr):  # fmt: skip
    """Round 2 of a row that round 1 did not resolve: the coarse bins I_RA..I_RB, which
    surely hold every cut, and a bin either side become its range [lo, top], binned anew;
    the blocks reaching lo are listed again, the sums zeroed, the row put on the list."""
    ri = W.rowi + row * cf.NUM_I
    fr = W.rowf + row * 8
    ra = tl.load(ri + cf.I_RA).to(tl.float32)
    rb = tl.load(ri + cf.I_RB).to(tl.float32)
    w = tl.where(inv_w > 0.0, 1.0 / inv_w, 0.0)
    top = tl.where(inv_w > 0.0, -tl.maximum(ra - 1.0, 0.0) * w, 0.0)
    lo2 = tl.where(inv_w > 0.0, tl.maximum(lo, -(rb + 2.0) * w), lo)
    b = tl.arange(0, NBLK_P2)
    live_b = ym > float("-inf")
    sel = live_b & (ym >= lo2) & (b < NBLK)
    n_list = list_blocks(W, row, sel, NBLK, NBLK_P2)
    yn = tl.where(xn < float("inf"), (xn - m) * s, float("-inf"))
    lomin = lo2 <= tl.min(tl.where(live_b, yn, float("inf")), axis=0)
    tl.store(fr + cf.F_LO, lo2)
    tl.store(fr + cf.F_KLO, lo2)
    tl.store(fr + cf.F_TOP, top)
    tl.store(fr + cf.F_INVW, tl.where(lo2 < top, NBINS / (top - lo2), 0.0))
    tl.store(W.hist + row * NBINS + tl.arange(0, NBINS), tl.zeros([NBINS], dtype=tl.int32))
    c = tl.arange(0, 16)
    tl.store(ri + cf.I_NAB + c, tl.zeros([16], dtype=tl.int64), mask=c <= cf.I_MTOP - cf.I_NAB)
    tl.store(ri + cf.I_NLIST, n_list.to(tl.int64))
    tl.store(ri + cf.I_LOMIN, lomin.to(tl.int64))
    tl.store(ri + cf.I_ROUTE, tl.full([], cf.R_ROUND2, tl.int64))
    list_append(W.refine, row, True)


@triton.jit
def list_append(lst, row, on):
    """Put the row on a row list (lst: i32 [B + 1], their number, then the rows) where on,
    by one masked lane: with the scalar form of this atomic and store, Triton 3.6's sm_90
    build of the short kernel faulted on an H200 (peaked top_p rows)."""
    k = tl.arange(0, 2)
    put = k == tl.where(on, 0, 2)  # lane 0 or none (the interpreter takes no scalar mask)
    e = tl.atomic_add(lst + k * 0, put.to(tl.int32), mask=put, sem="relaxed")
    tl.store(lst + 1 + e, (row + k * 0).to(tl.int32), mask=put)


@triton.jit
def listed_row(W, lst, e, ROUND2: tl.constexpr, CUT: tl.constexpr):
    """(row, route, whether the route still asks for the pass) of entry e of a row list:
    round 2's rows on R_ROUND2; round 1's on R_SELECT, or R_CUT too (CUT: the kept pass)."""
    row = tl.load(lst + 1 + e).to(tl.int64)
    route = tl.load(W.rowi + row * cf.NUM_I + cf.I_ROUTE)
    if ROUND2:
        ok = route == cf.R_ROUND2
    elif CUT:
        ok = (route == cf.R_SELECT) | (route == cf.R_CUT)
    else:
        ok = route == cf.R_SELECT
    return row, route, ok


@triton.jit
def list_entry(lst, p, G):
    """`list_share` for program p of G where the rows never outnumber the programs (round
    1's grid is at least B; a loop over entries would raise its registers), or one item p
    of a pass's max(rows, G) in the late queue (`late`: past G rows, item p is entry p,
    whole): (entry, slice, slices), entry -1 when the list is empty."""
    n = tl.load(lst, cache_modifier=".cg")
    nn = tl.maximum(n, 1)
    e = tl.where(n <= G, p % nn, p)
    return tl.where(n > 0, e, -1), tl.where(n <= G, p // nn, 0), tl.where(
        n <= G, tl.cdiv(G - e, nn), 1)  # fmt: skip


@triton.jit
def list_share(lst, G):
    """How the rows of a row list (lst: i32 [B + 1], their number, then the rows) share G
    programs: (first entry, end, step, slice, slices). n <= G rows: program p serves entry
    p % n as slice p // n of cdiv(G - entry, n); more rows: entries p, p + G, ..., each
    whole. A block never straddles two slices and the passes' sums are integers, so no
    sharing changes a result."""
    n = tl.load(lst)
    p = tl.program_id(0)
    few = n <= G
    nn = tl.maximum(n, 1)
    e0 = tl.where(few, p % nn, p)
    e1 = tl.where(few, tl.where(n > 0, e0 + 1, 0), n)
    return e0, e1, tl.where(few, 1, G), tl.where(few, p // nn, 0), tl.where(
        few, tl.cdiv(G - e0, nn), 1)  # fmt: skip


@triton.jit
def _hist_tiles(P, W, row, slot, ids, e0, e1, n_list, NBLK, R: tl.constexpr, DB: tl.constexpr,
                NBINS: tl.constexpr, FL: tl.constexpr, BIAS: tl.constexpr,
                ROUND2: tl.constexpr):  # fmt: skip
    """The histogram of list entries e0 .. e1 - 1 (no branch in the loop body); round 2
    also the count and exact mass (hi, lo halves) of the tokens above top."""
    m, s, lo, top, inv_w, jhi_unused, j1_unused, j2_unused, jlo_unused = load_plan(W, row)
    h = tl.zeros([NBINS], dtype=tl.int32)
    zero = tl.zeros([R, DB], dtype=tl.int32)
    dropped, n_ab, hi_ab, lo_ab = zero, zero, zero, zero
    for e in range(e0, e1, R):
        x, offs, bid = list_tile(P, W, row, slot, ids, e, n_list, NBLK, R, DB, FL, BIAS)
        y = (x - m) * s
        sel = (y > float("-inf")) & (y >= lo)
        if ROUND2:
            ab = sel & (y > top)
            sel = sel & (ab == 0)
            hz, lz = mass_hi_lo(tl.where(ab, y, float("-inf")))
            n_ab += ab.to(tl.int32)
            hi_ab += hz
            lo_ab += lz
        # a masked histogram: every dropped token goes to bin 0, counted off at the end
        h += tl.histogram(tl.reshape(tl.where(sel, bin_of(y, top, inv_w, NBINS) // FINE, 0),
                                     [R * DB]), NBINS)  # fmt: skip
        dropped += (sel == 0).to(tl.int32)
    h = h - tl.where(tl.arange(0, NBINS) == 0, tl.sum(tl.sum(dropped, 1), 0), 0)
    return h, tile_total(n_ab), tile_mass(hi_ab, lo_ab)


@triton.jit
def _select_row(P, W, row, slot, ids, sp, S, NBLK, R: tl.constexpr, DB: tl.constexpr,
                NBINS: tl.constexpr, WCAP: tl.constexpr, FL: tl.constexpr,
                ROUND2: tl.constexpr):  # fmt: skip
    """Slice sp of S of the row's listed blocks (slot, ids: its table slot and bias ids)."""
    ri = W.rowi + row * cf.NUM_I
    n_list = tl.load(ri + cf.I_NLIST).to(tl.int32)
    per = tl.cdiv(tl.cdiv(n_list, R), S) * R
    e0 = sp * per
    e1 = tl.minimum(e0 + per, n_list)
    if e0 < e1:  # the programs with blocks to read; the last of them places the bracket
        if tl.max(ids, axis=0) >= 0:
            h, n_ab, m_ab = _hist_tiles(P, W, row, slot, ids, e0, e1, n_list, NBLK, R, DB, NBINS,
                                        FL, True, ROUND2)  # fmt: skip
        else:
            h, n_ab, m_ab = _hist_tiles(P, W, row, slot, ids, e0, e1, n_list, NBLK, R, DB, NBINS,
                                        FL, False, ROUND2)  # fmt: skip
        tl.atomic_add(W.hist + row * NBINS + tl.arange(0, NBINS), h, mask=h != 0, sem="relaxed")
        if ROUND2:
            tl.atomic_add(ri + cf.I_NTOP, n_ab, sem="relaxed")
            tl.atomic_add(ri + cf.I_MTOP, m_ab, sem="relaxed")
        if arrive(W, row, 1, tl.cdiv(n_list, per)):
            _bracket(P, W, row, slot, WCAP, NBINS, ROUND2)


@triton.jit(do_not_specialize=["S", "NBLK"])
def _select_kernel(
    P, W,
    S,  # programs in all, shared by the list's rows
    NBLK, NB_P2: tl.constexpr, R: tl.constexpr, DB: tl.constexpr, NBINS: tl.constexpr,
    WCAP: tl.constexpr, FL: tl.constexpr, ROUND2: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    """Grid (S,) over a row list (`list_share`): round 1's (`W.listed`: the rows the short
    kernel left on the select or cut route) or round 2's (`W.refine`). A batch's few rows
    that need the pass then get all of its programs, not S / B each."""
    dependent_start(PDL)
    if ROUND2:
        e0, e1, step, sp, n_sp = list_share(W.refine, S)
        for e in range(e0, e1, step):
            select_entry(P, W, W.refine, e, sp, n_sp, NBLK, NB_P2, R, DB, NBINS, WCAP, FL, True)
    else:
        e, sp, n_sp = list_entry(W.listed, tl.program_id(0), S)
        if e >= 0:
            select_entry(P, W, W.listed, e, sp, n_sp, NBLK, NB_P2, R, DB, NBINS, WCAP, FL, False)


@triton.jit
def select_entry(P, W, lst, e, sp, n_sp, NBLK, NB_P2: tl.constexpr, R: tl.constexpr,
                 DB: tl.constexpr, NBINS: tl.constexpr, WCAP: tl.constexpr, FL: tl.constexpr,
                 ROUND2: tl.constexpr):  # fmt: skip
    """Slice sp of n_sp of entry e's row, when its route still asks for this pass."""
    row, route_unused, ok = listed_row(W, lst, e, ROUND2, False)
    if ok:
        slot = tl.load(P.slots + row).to(tl.int64)
        _select_row(P, W, row, slot, bias_ids(P, slot, NB_P2), sp, n_sp, NBLK, R, DB, NBINS,
                    WCAP, FL, ROUND2)  # fmt: skip
