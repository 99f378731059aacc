"""The kept pass, last of a filtered row: exact masses, the bracket resolved, the draw.

Programs (row, slice) read the row's listed blocks again and sort each live token with
y >= lo into its region by bin (`draw` module docstring): above, bracket 1, middle,
bracket 2, below. Per block they store the kept mass (relative to the block max) of the
above and of the middle tokens with y >= log_min_p; per row they add up exact counts
and masses (q = trunc(exp(y) 2**32), int64) of the regions; bracket tokens are appended
to the row's gather buffer through an atomic counter. Min-p alone (`R_CUT`) is the same
pass with every token above.

The row's last program resolves the cut among the gathered tokens (`_resolve`: each
one's position in the row's order and the exact mass before it, from every pair, no
sort). A cut elsewhere (above, inside the middle, past the brackets) or a bracket past
the gather cap sends the row to the exact search (`exact`). The kept bracket tokens'
masses are added to their blocks, and the row is drawn (`draw.two_level_draw`).
"""

from __future__ import annotations

import triton
import triton.language as tl

from graphexec.sampling.triton.config import (
    F_KLO,
    I_LOMIN,
    I_MAB,
    I_MMID,
    I_NAB,
    I_NABM,
    I_NBEL,
    I_NBELM,
    I_NG,
    I_NLIST,
    I_NMID,
    I_NMIDM,
    I_ROUTE,
    NUM_I,
    R_CUT,
    R_DONE,
    R_EXACT,
    R_SELECT,
)  # fmt: skip
from graphexec.sampling.triton.draw import FLT_MAX, bin_of, block_y, two_level_draw
from graphexec.sampling.triton.exact import exact_cut
from graphexec.sampling.triton.keys import PAD_KEY, mass, mass_hi_lo, pack, sum_mass, unpack
from graphexec.sampling.triton.process import (
    LOG_MIN_P,
    SLOTS,
    TOP_K,
    TOP_P,
    bias_ids,
    row_params,
)
from graphexec.sampling.triton.select import list_tile, load_plan
from graphexec.sampling.triton.stats import GATH, KEPT, KMID, ROWF, ROWI, TOTAL, XM, XN, arrive

BIG = tl.constexpr(1 << 62)


@triton.jit
def _ranks(W, row, n_g, WCAP: tl.constexpr, GI: tl.constexpr, CH: tl.constexpr):
    """Per gathered key: the number of gathered keys above it and their exact mass, into
    the gather buffer's second and third rows (GI keys against CH at a time)."""
    base = W[GATH] + row * 3 * WCAP
    for i0 in range(0, n_g, GI):
        ci = i0 + tl.arange(0, GI)
        ki = tl.load(base + ci, mask=ci < n_g, other=PAD_KEY)
        rank = tl.zeros([GI], dtype=tl.int64)
        bef = tl.zeros([GI], dtype=tl.int64)
        for j0 in range(0, n_g, CH):
            cj = j0 + tl.arange(0, CH)
            kj = tl.load(base + cj, mask=cj < n_g, other=PAD_KEY)
            yj, idj = unpack(kj)
            hj, lj = mass_hi_lo(yj)  # once per key, then summed where above
            gt = kj[None, :] > ki[:, None]
            rank += tl.sum(gt.to(tl.int64), axis=1)
            bef += (tl.sum(tl.where(gt, hj[None, :], 0), axis=1).to(tl.int64) * 65536
                    + tl.sum(tl.where(gt, lj[None, :], 0), axis=1).to(tl.int64))  # fmt: skip
        tl.store(base + WCAP + ci, rank, mask=ci < n_g)
        tl.store(base + 2 * WCAP + ci, bef, mask=ci < n_g)
    tl.debug_barrier()


@triton.jit
def _resolve(P, W, row, slot, m, s, lo, inv_w, j2, lnmp, top_k, top_p, n_g,
             WCAP: tl.constexpr, NBINS: tl.constexpr, DB: tl.constexpr, NBLK):  # fmt: skip
    """(ok, cut, midk) of a selected row from its gathered tokens and its region sums;
    adds the kept gathered tokens' masses to their blocks."""
    ri = W[ROWI] + row * NUM_I
    nab = tl.load(ri + I_NAB)
    nabm = tl.load(ri + I_NABM)
    mab = tl.load(ri + I_MAB)
    nmid = tl.load(ri + I_NMID)
    nmidm = tl.load(ri + I_NMIDM)
    mmid = tl.load(ri + I_MMID)
    nbelm = tl.load(ri + I_NBELM)
    # every live token counted: none below lo, none below the brackets
    all_in = (tl.load(ri + I_LOMIN) != 0) & (tl.load(ri + I_NBEL) == 0)
    n_g = tl.minimum(n_g, WCAP)
    _ranks(W, row, n_g, WCAP, 64, 64)
    c = tl.arange(0, WCAP)
    ok_g = c < n_g
    base = W[GATH] + row * 3 * WCAP
    keys = tl.load(base + c, mask=ok_g, other=PAD_KEY)
    yg, idg = unpack(keys)
    qg = mass(yg)
    in2 = ok_g & (bin_of(yg, inv_w, NBINS) >= j2)
    in1 = ok_g & (in2 == 0)
    pos = nab + tl.load(base + WCAP + c, mask=ok_g, other=0) + tl.where(in2, nmid, 0)
    bef = mab + tl.load(base + 2 * WCAP + c, mask=ok_g, other=0) + tl.where(in2, mmid, 0)
    n1 = tl.sum(in1.to(tl.int64), axis=0)
    n2 = tl.sum(in2.to(tl.int64), axis=0)
    end1 = nab + n1
    end_mid = end1 + nmid
    end2 = end_mid + n2
    bad = tl.zeros([], dtype=tl.int1)
    # top-k: the k-th token, and the mass of the top k (top-p's total) where it is known:
    # a gathered token, or the last of the above, bracket 1 or the middle
    m1 = tl.sum(tl.where(in1, qg, 0), axis=0)
    m2 = tl.sum(tl.where(in2, qg, 0), axis=0)
    lk = tl.full([], BIG, tl.int64)
    t_k = tl.zeros([], dtype=tl.int64)
    if top_k > 0:
        lk = tl.where(all_in, tl.minimum(top_k.to(tl.int64), end2), top_k.to(tl.int64))
        is_k = ok_g & (pos == lk - 1)
        t_k = tl.sum(tl.where(is_k, bef + qg, 0), axis=0)
        t_k = tl.where(lk == nab, mab, tl.where(lk == end1, mab + m1, t_k))
        t_k = tl.where((lk == end_mid) & (nmid > 0), mab + m1 + mmid, t_k)
        k_known = (tl.sum(is_k.to(tl.int32), axis=0) > 0) | (lk == nab) | (lk == end1)
        k_known = k_known | (lk == end_mid) | (lk == end2)
        t_k = tl.where(lk == end2, mab + m1 + mmid + m2, t_k)
        bad = (top_p < 1.0) & (k_known == 0)
    # top-p: a token is kept while the mass before it is below p * total
    lp = tl.full([], BIG, tl.int64)
    if top_p < 1.0:
        pt = top_p.to(tl.float64) * tl.where(top_k > 0, t_k.to(tl.float64), tl.load(W[TOTAL] + row))
        kp = ok_g & (bef.to(tl.float64) < pt)
        c1 = tl.sum((kp & in1).to(tl.int64), axis=0)
        c2 = tl.sum((kp & in2).to(tl.int64), axis=0)
        mid_lo = (mab + m1).to(tl.float64)
        bad = bad | (mab.to(tl.float64) >= pt)
        mid_hi = (mab + m1 + mmid).to(tl.float64)
        bad = bad | ((c1 == n1) & (nmid > 0) & (mid_lo < pt) & (mid_hi >= pt))
        # past the last gathered token, the mass before the next one decides
        past = (mab + m1 + mmid + m2).to(tl.float64) >= pt
        lp = tl.where(c1 < n1, nab + c1, tl.where((nmid > 0) & (mid_lo >= pt), end1, tl.where(
            c2 < n2, end_mid + c2, tl.where(past, end2, BIG))))  # fmt: skip
    # min-p: y >= log_min_p, a value cut (fine wherever it falls)
    lm = tl.full([], BIG, tl.int64)
    if lnmp > float("-inf"):
        cm1 = tl.sum((in1 & (yg >= lnmp)).to(tl.int64), axis=0)
        cm2 = tl.sum((in2 & (yg >= lnmp)).to(tl.int64), axis=0)
        lm = tl.where(nabm < nab, nabm, tl.where(cm1 < n1, nab + cm1, tl.where(
            nmidm < nmid, end1 + nmidm, tl.where(cm2 < n2, end_mid + cm2, tl.where(
                (nbelm == 0) & (lnmp >= lo), end2, BIG)))))  # fmt: skip
    L = tl.minimum(tl.minimum(lk, lp), lm)
    known = (L >= nab) & ((L <= end1) | (L >= end_mid)) & (L <= end2)
    ok = (bad == 0) & (L < BIG) & ((L == lm) | known)
    kept = ok_g & (pos < L) & (pos * 0 + ok.to(tl.int64) != 0)  # vector & scalar: see tile_x
    cut = tl.min(tl.where(kept, keys, 9223372036854775807), axis=0)
    bg = idg // DB
    xmg = tl.load(W[XM] + row * NBLK + bg, mask=kept, other=0.0)
    tl.atomic_add(W[KEPT] + row * NBLK + bg, mass(yg - (xmg - m) * s), mask=kept)
    return ok, cut, (L > end1) & (nmid > 0)


@triton.jit
def _finish(P, W, tok_ptr, valid_ptr, row, route, NBLK, NBLK_P2: tl.constexpr,
            NB_P2: tl.constexpr, DB: tl.constexpr, R: tl.constexpr, NBINS: tl.constexpr,
            WCAP: tl.constexpr, WAYS: tl.constexpr, ITA: tl.constexpr, ITB: tl.constexpr,
            SB: tl.constexpr, BF16: tl.constexpr):  # fmt: skip
    slot, greedy, s_unused, seed, pos = row_params(P, row)
    ids = bias_ids(P, slot, NB_P2)
    ri = W[ROWI] + row * NUM_I
    m, s, lo, inv_w, jhi, j1, j2, jlo = load_plan(W, row)
    klo = tl.load(W[ROWF] + row * 8 + F_KLO)
    top_k = tl.load(P[TOP_K] + slot)
    top_p = tl.load(P[TOP_P] + slot)
    lnmp = tl.load(P[LOG_MIN_P] + slot)
    b = tl.arange(0, NBLK_P2)
    bm = b < NBLK
    xm = tl.load(W[XM] + row * NBLK + b, mask=bm, other=float("-inf"), cache_modifier=".cg")
    ym = block_y(xm, m, s, False)
    cut = tl.zeros([], dtype=tl.int64)
    midk = tl.zeros([], dtype=tl.int1)
    if route == R_SELECT:
        n_g = tl.load(ri + I_NG)
        ok = n_g <= WCAP
        if ok:
            ok, cut, midk = _resolve(P, W, row, slot, m, s, lo, inv_w, j2, lnmp, top_k, top_p, n_g,
                                     WCAP, NBINS, DB, NBLK)  # fmt: skip
        if ok == 0:
            route = tl.full([], R_EXACT, tl.int64)
    if route == R_EXACT:
        xn = tl.load(W[XN] + row * NBLK + b, mask=bm, other=float("inf"), cache_modifier=".cg")
        y_lo = tl.min(tl.where(xn < float("inf"), (xn - m) * s, 0.0), axis=0)
        y_lo = tl.maximum(y_lo, -FLT_MAX)
        cut = exact_cut(P, W, row, slot, ids, m, s, y_lo, top_k, top_p, lnmp,
                        tl.load(W[TOTAL] + row), NBLK, ITA, ITB, SB, DB, WAYS, BF16)  # fmt: skip
        # the kept set is pack >= cut: every live token in "bracket 1"
        lo = tl.full([], -FLT_MAX, tl.float32)
        klo = lo
        inv_w = tl.zeros([], dtype=tl.float32)
        jhi = tl.zeros([], dtype=tl.int64)
        j1 = tl.full([], NBINS * 8, tl.int64)
        j2 = j1 + 1
        jlo = j1
        midk = tl.zeros([], dtype=tl.int1)
        tl.store(ri + I_ROUTE, tl.full([], R_EXACT, tl.int64))
    tl.debug_barrier()
    kv = tl.load(W[KEPT] + row * NBLK + b, mask=bm & (ym >= klo), other=0, cache_modifier=".cg")
    if midk:
        kv += tl.load(W[KMID] + row * NBLK + b, mask=bm & (ym >= klo), other=0,
                      cache_modifier=".cg")  # fmt: skip
    tok = two_level_draw(P, row, slot, ids, ym, kv, m, s, False, seed, pos, lo, inv_w, jhi, j1,
                         j2, jlo, cut, midk, lnmp, NBLK, NBLK_P2, DB, NBINS, BF16)  # fmt: skip
    tl.store(tok_ptr + row, tok.to(tl.int64))
    tl.store(valid_ptr + row, tok >= 0)


@triton.jit
def _kept_tiles(P, W, row, slot, ids, e0, e1, n_list, lnmp, NBLK, R: tl.constexpr,
                DB: tl.constexpr, NBINS: tl.constexpr, WCAP: tl.constexpr, BF16: tl.constexpr,
                BIAS: tl.constexpr):  # fmt: skip
    """List entries e0 .. e1 - 1: store the kept blocks' masses, gather the bracket, and
    return the I_NAB .. I_NBEL sums ([8] i64). Per-token accumulators, reduced once."""
    m, s, lo, inv_w, jhi, j1, j2, jlo = load_plan(W, row)
    zero = tl.zeros([R, DB], dtype=tl.int32)
    n_ab, n_abm, hi_ab, lo_ab, n_mid, n_midm, hi_mid, lo_mid, n_belm, n_bel = (
        zero, zero, zero, zero, zero, zero, zero, zero, zero, zero)  # fmt: skip
    ng_ptr = W[ROWI] + row * NUM_I + I_NG + zero
    for e in range(e0, e1, R):
        x, offs, bid = list_tile(P, W, row, slot, ids, e, n_list, NBLK, R, DB, BF16, BIAS)
        y = (x - m) * s
        xmb = tl.load(W[XM] + row * NBLK + bid, mask=bid < NBLK, other=float("-inf"))
        zr = y - tl.where(xmb > float("-inf"), (xmb - m) * s, 0.0)[:, None]
        inr = (y > float("-inf")) & (y >= lo)
        j = bin_of(y, inv_w, NBINS)
        above = inr & (j < jhi)
        mid = inr & (j > j1) & (j < j2)
        brk = inr & (((j >= jhi) & (j <= j1)) | ((j >= j2) & (j <= jlo)))
        below = inr & (j > jlo)
        okm = y >= lnmp
        tl.store(W[KEPT] + row * NBLK + bid, sum_mass(above & okm, zr, 1), mask=bid < NBLK)
        tl.store(W[KMID] + row * NBLK + bid, sum_mass(mid & okm, zr, 1), mask=bid < NBLK)
        h_ab, l_ab = mass_hi_lo(tl.where(above, y, float("-inf")))
        h_mid, l_mid = mass_hi_lo(tl.where(mid, y, float("-inf")))
        n_ab += above.to(tl.int32)
        n_abm += (above & okm).to(tl.int32)
        hi_ab += h_ab
        lo_ab += l_ab
        n_mid += mid.to(tl.int32)
        n_midm += (mid & okm).to(tl.int32)
        hi_mid += h_mid
        lo_mid += l_mid
        n_belm += (below & okm).to(tl.int32)
        n_bel += below.to(tl.int32)
        slots = tl.atomic_add(ng_ptr, 1, mask=brk, sem="relaxed")
        tl.store(W[GATH] + row * 3 * WCAP + slots, pack(y, offs), mask=brk & (slots < WCAP))
    k = tl.arange(0, 8)
    n = tl.where(k == 0, _total(n_ab), tl.where(k == 1, _total(n_abm), 0))
    n += tl.where(k == 2, _total(hi_ab) * 65536 + _total(lo_ab), 0)
    n += tl.where(k == 3, _total(n_mid), tl.where(k == 4, _total(n_midm), 0))
    n += tl.where(k == 5, _total(hi_mid) * 65536 + _total(lo_mid), 0)
    return n + tl.where(k == 6, _total(n_belm), tl.where(k == 7, _total(n_bel), 0))


@triton.jit
def _total(acc):
    return tl.sum(tl.sum(acc.to(tl.int64), axis=1), axis=0)


@triton.jit(do_not_specialize=["B", "S", "NBLK"])
def _kept_kernel(
    P, W,
    tok_ptr, valid_ptr,  # [B] i64 / bool out: the filtered rows' tokens
    B, S,  # rows, programs per row
    NBLK, NBLK_P2: tl.constexpr, NB_P2: tl.constexpr, R: tl.constexpr, DB: tl.constexpr,
    NBINS: tl.constexpr, WCAP: tl.constexpr, WAYS: tl.constexpr, ITA: tl.constexpr,
    ITB: tl.constexpr, SB: tl.constexpr, BF16: tl.constexpr,
):  # fmt: skip
    """Grid (B * S,), rows in order."""
    row = tl.program_id(0) // S
    sp = tl.program_id(0) % S
    ri = W[ROWI] + row * NUM_I
    route = tl.load(ri + I_ROUTE)
    if (route == R_SELECT) | (route == R_CUT):
        slot = tl.load(P[SLOTS] + row).to(tl.int64)
        n_list = tl.load(ri + I_NLIST).to(tl.int32)
        per = tl.cdiv(tl.cdiv(n_list, R), S) * R
        e0 = sp * per
        e1 = tl.minimum(e0 + per, n_list)
        if e0 < e1:
            ids = bias_ids(P, slot, NB_P2)
            lnmp = tl.load(P[LOG_MIN_P] + slot)
            if tl.max(ids, axis=0) >= 0:
                n = _kept_tiles(P, W, row, slot, ids, e0, e1, n_list, lnmp, NBLK, R, DB, NBINS,
                                WCAP, BF16, True)  # fmt: skip
            else:
                n = _kept_tiles(P, W, row, slot, ids, e0, e1, n_list, lnmp, NBLK, R, DB, NBINS,
                                WCAP, BF16, False)  # fmt: skip
            k = tl.arange(0, 8)
            tl.atomic_add(ri + I_NAB + k, n, mask=n != 0, sem="relaxed")
    if arrive(W, row, 2, S):
        if route != R_DONE:
            _finish(P, W, tok_ptr, valid_ptr, row, route, NBLK, NBLK_P2, NB_P2, DB, R, NBINS,
                    WCAP, WAYS, ITA, ITB, SB, BF16)  # fmt: skip
