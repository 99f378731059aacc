"""The kept pass and the finish, last of a filtered row (routes: the package docstring).

`_kept_kernel`: programs (row, slice) read the row's listed blocks again and sort each
live token with y >= lo into its region by bin (`draw` module docstring). Per block they
store the kept mass (relative to the block max) of the above and the middle tokens with
y >= log_min_p; per row, the regions' exact counts and int64 masses; bracket tokens go to
the row's gather buffer by an atomic counter. Min-p alone sums its cut blocks (`short.cut_tiles`).

`_finish_kernel` resolves the cut among the gathered tokens by counting (`_resolve`), adds
the kept bracket tokens' masses to their blocks and draws the row (`draw.fallback_draw`),
or sends it to round 2 (`select.plan_round2`) or, in round 2, to the exact search.
"""

from __future__ import annotations

import triton
import triton.language as tl

from graphexec.kernels.dependent_launch import dependent_start
from graphexec.sampling.triton import sampler_config as cf
from graphexec.sampling.triton.draw import FINE, FLT_MAX, bin_of, block_y, fallback_draw
from graphexec.sampling.triton.exact import exact_cut
from graphexec.sampling.triton.keys import (
    BIG_KEY,
    PAD_KEY,
    mass,
    mass_hi_lo,
    okey,
    pack,
    sum_halves,
    tile_mass,
    tile_total,
    unpack,
)
from graphexec.sampling.triton.process import list_tile, row_inputs
from graphexec.sampling.triton.select import (
    list_entry,
    list_share,
    listed_row,
    load_plan,
    plan_round2,
)
from graphexec.sampling.triton.short import cut_tiles
from graphexec.sampling.triton.store import put_here

FEW = tl.constexpr(64)  # gathered tokens resolved pairwise


@triton.jit
def _f(keys, w, c, base, mid, max2):
    """F(c_j) = base + sum of w over the keys >= c_j + mid where c_j <= max2 ([WAYS]): the
    count (w = 1) or mass (w = q) of the row's tokens with pack >= c_j, the middle's
    (whose packs lie between the brackets) put just above bracket 2's largest."""
    ge = keys[:, None] >= c[None, :]
    return base + tl.sum(tl.where(ge, w[:, None], 0), axis=0) + tl.where(c <= max2, mid, 0)


@triton.jit
def _search(keys, w, lo, hi, on_keys, target, base, mid, max2, WAYS: tl.constexpr,
            ITERS: tl.constexpr):  # fmt: skip
    """The largest v in [lo, hi] with F(v) >= target (F(lo) >= target on entry): v a key
    (the high 32 bits of a pack, on_keys) or a pack."""
    j = tl.arange(0, WAYS).to(tl.int64)
    for _it in range(ITERS):  # 32 bits, WAYS-fold a step
        if lo < hi:
            step = (hi - lo) // WAYS + 1
            c = tl.minimum(lo + j * step, hi)
            f = _f(keys, w, tl.where(on_keys != 0, c << 32, c), base, mid, max2)
            jb = tl.max(tl.where(f.to(tl.float64) >= target, j, 0), axis=0)
            new_lo = tl.sum(tl.where(j == jb, c, 0), axis=0)
            hi = tl.where(jb < WAYS - 1, tl.sum(tl.where(j == jb + 1, c, 0), axis=0) - 1, hi)
            lo = new_lo
    return lo


@triton.jit
def _cut(keys, w, ok_g, lowest, highest, target, base, mid, max2, CAP: tl.constexpr,
         WAYS: tl.constexpr, ITERS: tl.constexpr):  # fmt: skip
    """The largest pack P with F(P) >= target, a gathered one (F steps only there). Up to
    FEW gathered (CAP == FEW): F of each from every pair at once. Else by searching: its
    key bits between the lowest and highest gathered keys, then its low bits between the
    packs gathered with that key (a bracket spans a few thousand keys: a few steps each)."""
    if CAP == FEW:
        f = base + tl.sum(tl.where(keys[None, :] >= keys[:, None], w[None, :], 0), axis=1)
        f += tl.where(keys <= max2, mid, 0)
        cut = tl.max(tl.where(ok_g & (f.to(tl.float64) >= target), keys, PAD_KEY), axis=0)
    else:
        key = _search(keys, w, lowest >> 32, highest >> 32, 1, target, base, mid, max2, WAYS,
                      ITERS)  # fmt: skip
        same = ok_g & ((keys >> 32) == key)
        lo = tl.min(tl.where(same, keys, BIG_KEY), axis=0)
        hi = tl.max(tl.where(same, keys, PAD_KEY), axis=0)
        cut = _search(keys, w, lo, hi, 0, target, base, mid, max2, WAYS, ITERS)
    return cut


@triton.jit
def _resolve(W, row, s, lo, top, inv_w, j2, lnmp, top_k, top_p, n_g,
             CAP: tl.constexpr, WCAP: tl.constexpr, NBINS: tl.constexpr, DB: tl.constexpr,
             WAYS: tl.constexpr, ITERS: tl.constexpr, NBLK):  # fmt: skip
    """(ok, cut, midk): the cut C of a selected row's kept set {pack >= C} (with y >=
    log_min_p), found among its gathered packs by counting (`_cut`: no sort), and whether
    its middle is kept; adds the kept gathered tokens' masses to their blocks. A cut that
    falls inside the above region or the middle, or below the brackets with tokens there
    left uncounted, is not resolved here (ok False). CAP >= n_g: the vectors' width."""
    ri = W.rowi + row * cf.NUM_I
    nab = tl.load(ri + cf.I_NAB)
    nabm = tl.load(ri + cf.I_NABM)
    mab = tl.load(ri + cf.I_MAB)
    nmid = tl.load(ri + cf.I_NMID)
    mmid = tl.load(ri + cf.I_MMID)
    nbelm = tl.load(ri + cf.I_NBELM)
    all_in = (tl.load(ri + cf.I_LOMIN) != 0) & (tl.load(ri + cf.I_NBEL) == 0)  # every live token
    c = tl.arange(0, CAP)
    ok_g = c < n_g
    keys = tl.load(W.gath + row * WCAP + c, mask=ok_g, other=PAD_KEY)
    yg, idg = unpack(keys)
    qg = mass(yg)
    in2 = ok_g & (bin_of(yg, top, inv_w, NBINS) >= j2)
    in1 = ok_g & (in2 == 0)
    n1 = tl.sum(in1.to(tl.int64), axis=0)
    m1 = tl.sum(tl.where(in1, qg, 0), axis=0)
    max2 = tl.max(tl.where(in2, keys, PAD_KEY), axis=0)
    min1 = tl.min(tl.where(in1, keys, BIG_KEY), axis=0)
    lowest = tl.min(tl.where(ok_g, keys, BIG_KEY), axis=0)
    highest = tl.max(keys, axis=0)
    n_known = nab + n_g + nmid
    m_known = mab + tl.sum(qg, axis=0) + mmid
    none = tl.full([], PAD_KEY, tl.int64)
    bad = tl.zeros([], dtype=tl.int1)
    # top-k: its k-th token's pack, and the top k's mass (top-p's total)
    c_k = none
    t_k = m_known
    k = top_k.to(tl.int64)
    if top_k > 0:
        every = all_in & (k >= n_known)  # fewer live tokens than k: all of them
        found = (k > nab) & (k <= n_known) & ((k <= nab + n1) | (k > nab + n1 + nmid))
        if found & (every == 0):
            c_k = _cut(keys, ok_g.to(tl.int64), ok_g, lowest, highest, k.to(tl.float64), nab,
                       nmid, max2, CAP, WAYS, ITERS)  # fmt: skip
            w = tl.zeros([WAYS], tl.int64)
            t_k = tl.max(_f(keys, qg, w + c_k, mab, mmid, max2), axis=0)
        # exactly the above tokens: a cut just above every gathered one
        c_k = tl.where(k == nab, highest + 1, c_k)
        # inside the above region: only a min-p cut at or above it (and no top-p) resolves
        inside = (k < nab) & (every == 0)
        bad = bad | (inside & ((lnmp == float("-inf")) | (nabm > k) | (top_p < 1.0)))
        c_k = tl.where(inside, none, c_k)
        # inside the middle, or past the brackets with top-p needing its mass
        past = (k > n_known) & (every == 0)
        bad = bad | ((k > nab + n1) & (k <= nab + n1 + nmid)) | (past & (top_p < 1.0))
    # top-p: kept while the mass before a token is below p * total, i.e. pack >= the
    # largest P with mass(pack >= P) >= p * total
    c_p = none
    if top_p < 1.0:
        t_row = tl.load(W.total + row)
        pt = top_p.to(tl.float64) * tl.where(top_k > 0, t_k.to(tl.float64), t_row)
        bad = bad | (mab.to(tl.float64) >= pt)
        mid_lo = (mab + m1).to(tl.float64)
        bad = bad | ((nmid > 0) & (mid_lo < pt) & ((mab + m1 + mmid).to(tl.float64) >= pt))
        if m_known.to(tl.float64) >= pt:
            c_p = _cut(keys, qg, ok_g, lowest, highest, pt, mab, mmid, max2, CAP, WAYS, ITERS)
    # min-p: y >= log_min_p, a value cut
    c_m = none
    if lnmp > float("-inf"):
        c_m = okey(lnmp).to(tl.int64) << 32
    cut = tl.maximum(tl.maximum(c_k, c_p), c_m)
    # the kept set must end where every token was counted: at or above the lowest gathered
    # one; or a min-p cut with no token of y >= log_min_p uncounted below the brackets; or
    # no cut at all with every live token counted
    counted = (n_g > 0) & (cut >= lowest)
    counted = counted | ((cut == c_m) & (c_m > PAD_KEY) & (nbelm == 0) & (lnmp >= lo))
    counted = counted | ((cut == PAD_KEY) & all_in) | (cut > highest)
    ok = (bad == 0) & counted
    kept = ok_g & (keys >= cut) & ((keys * 0 + ok.to(tl.int64)) != 0)  # (vector & scalar)
    bg = idg // DB
    xmg = tl.load(W.xm + row * NBLK + bg, mask=kept, other=0.0)
    xg = tl.load(W.gath_x + row * WCAP + c, mask=kept, other=0.0)
    tl.atomic_add(W.kept + row * NBLK + bg, mass((xg - xmg) * s), mask=kept)
    return ok, cut, (nmid > 0) & (cut < min1)


@triton.jit
def finish_row(P, W, tok_ptr, valid_ptr, row, inputs, route, NBLK, NBLK_P2: tl.constexpr,
               DB: tl.constexpr, NBINS: tl.constexpr, WCAP: tl.constexpr, WAYS: tl.constexpr,
               ITA: tl.constexpr, ITB: tl.constexpr, SB: tl.constexpr, FL: tl.constexpr,
               ROUND2: tl.constexpr):  # fmt: skip
    """Row `row`'s finish (module docstring); inputs: its `process.row_inputs`."""
    slot, greedy, s_unused, seed, pos, ids, top_k, top_p, lnmp = inputs
    ri = W.rowi + row * cf.NUM_I
    m, s, lo, top, inv_w, jhi, j1, j2, jlo = load_plan(W, row)
    klo = tl.load(W.rowf + row * 8 + cf.F_KLO)
    b = tl.arange(0, NBLK_P2)
    bm = b < NBLK
    xm = tl.load(W.xm + row * NBLK + b, mask=bm, other=float("-inf"), cache_modifier=".cg")
    ym = block_y(xm, m, s, False)
    cut = tl.zeros([], dtype=tl.int64)
    midk = tl.zeros([], dtype=tl.int1)
    if (route == cf.R_SELECT) | (route == cf.R_ROUND2):
        n_g = tl.load(ri + cf.I_NG)
        ok = n_g <= WCAP
        if ok & (n_g <= FEW):  # narrow vectors: the tail's latency
            ok, cut, midk = _resolve(W, row, s, lo, top, inv_w, j2, lnmp, top_k, top_p, n_g, FEW,
                                     WCAP, NBINS, DB, WAYS, ITA, NBLK)  # fmt: skip
        elif ok:
            ok, cut, midk = _resolve(W, row, s, lo, top, inv_w, j2, lnmp, top_k, top_p, n_g, WCAP,
                                     WCAP, NBINS, DB, WAYS, ITA, NBLK)  # fmt: skip
        if ok == 0:
            route = tl.full([], cf.R_EXACT if ROUND2 else cf.R_REFINE, tl.int64)
    if route == cf.R_REFINE:  # round 1 only: the draw waits for round 2
        xn = tl.load(W.xn + row * NBLK + b, mask=bm, other=float("inf"), cache_modifier=".cg")
        plan_round2(W, row, ym, xn, m, s, lo, inv_w, NBLK, NBLK_P2, NBINS)
    else:
        if route == cf.R_EXACT:
            xn = tl.load(W.xn + row * NBLK + b, mask=bm, other=float("inf"), cache_modifier=".cg")
            y_lo = tl.min(tl.where(xn < float("inf"), (xn - m) * s, 0.0), axis=0)
            y_lo = tl.maximum(y_lo, -FLT_MAX)
            cut = exact_cut(P, W, row, slot, ids, m, s, y_lo, top_k, top_p, lnmp,
                            tl.load(W.total + row), NBLK, ITA, ITB, SB, DB, WAYS,
                            FL)  # fmt: skip
            # the kept set is pack >= cut: every live token in "bracket 1"
            lo = tl.full([], -FLT_MAX, tl.float32)
            klo = lo
            top = tl.zeros([], dtype=tl.float32)
            inv_w = tl.zeros([], dtype=tl.float32)
            jhi = tl.zeros([], dtype=tl.int64)
            j1 = tl.full([], NBINS * FINE, tl.int64)
            j2 = j1 + 1
            jlo = j1
            midk = tl.zeros([], dtype=tl.int1)
            tl.store(ri + cf.I_ROUTE, tl.full([], cf.R_EXACT, tl.int64))
        tl.debug_barrier()
        kv = tl.load(W.kept + row * NBLK + b, mask=bm & (ym >= klo), other=0, cache_modifier=".cg")
        if midk:
            kv += tl.load(W.kept_mid + row * NBLK + b, mask=bm & (ym >= klo), other=0,
                          cache_modifier=".cg")  # fmt: skip
        tok = fallback_draw(P, W, row, slot, ids, ym, kv, m, s, seed, pos, lo, top, inv_w, jhi, j1,
                            j2, jlo, cut, midk, lnmp, NBLK, NBLK_P2, DB, NBINS, FL)  # fmt: skip
        tl.store(tok_ptr + row, tok.to(tl.int64))
        tl.store(valid_ptr + row, tok >= 0)


@triton.jit
def finish_refined(P, W, tok_ptr, valid_ptr, e, NBLK, NB_P2: tl.constexpr,
                   NBLK_P2: tl.constexpr, DB: tl.constexpr, NBINS: tl.constexpr,
                   WCAP: tl.constexpr, WAYS: tl.constexpr, ITA: tl.constexpr,
                   ITB: tl.constexpr, SB: tl.constexpr, FL: tl.constexpr):  # fmt: skip
    """Round 2's finish of entry e of its row list (`W.refine`)."""
    row = tl.load(W.refine + 1 + e, cache_modifier=".cg").to(tl.int64)
    route = tl.load(W.rowi + row * cf.NUM_I + cf.I_ROUTE, cache_modifier=".cg")
    finish_row(P, W, tok_ptr, valid_ptr, row, row_inputs(P, row, NB_P2), route, NBLK, NBLK_P2,
               DB, NBINS, WCAP, WAYS, ITA, ITB, SB, FL, True)  # fmt: skip


@triton.jit
def _kept_tiles(P, W, row, slot, ids, e0, e1, n_list, lnmp, NBLK, R: tl.constexpr,
                DB: tl.constexpr, NBINS: tl.constexpr, WCAP: tl.constexpr, FL: tl.constexpr,
                BIAS: tl.constexpr):  # fmt: skip
    """List entries e0 .. e1 - 1: store the kept blocks' masses, gather the bracket, and
    return the cf.I_NAB .. cf.I_NBEL sums ([8] i64). Per-token accumulators, reduced once."""
    m, s, lo, top, inv_w, jhi, j1, j2, jlo = load_plan(W, row)
    zero = tl.zeros([R, DB], dtype=tl.int32)
    n_ab, n_abm, hi_ab, lo_ab, n_mid, n_midm, hi_mid, lo_mid, n_belm, n_bel = (
        zero, zero, zero, zero, zero, zero, zero, zero, zero, zero)  # fmt: skip
    ng_ptr = W.rowi + row * cf.NUM_I + cf.I_NG + zero
    for e in range(e0, e1, R):
        x, offs, bid = list_tile(P, W, row, slot, ids, e, n_list, NBLK, R, DB, FL, BIAS)
        y = (x - m) * s
        xmb = tl.load(W.xm + row * NBLK + bid, mask=bid < NBLK, other=float("-inf"))
        zr = (x - tl.where(xmb > float("-inf"), xmb, 0.0)[:, None]) * s  # Q_b's terms
        inr = (y > float("-inf")) & (y >= lo)
        j = bin_of(y, top, inv_w, NBINS)
        above = inr & (j < jhi)
        mid = inr & (j > j1) & (j < j2)
        brk = inr & (((j >= jhi) & (j <= j1)) | ((j >= j2) & (j <= jlo)))
        below = inr & (j > jlo)
        okm = y >= lnmp
        # one exp of the block-relative z and one of y a token, shared by both regions
        hz, lz = mass_hi_lo(tl.where((above | mid) & okm, zr, float("-inf")))
        ka = sum_halves(tl.where(above, hz, 0), tl.where(above, lz, 0), 1)
        km = sum_halves(tl.where(mid, hz, 0), tl.where(mid, lz, 0), 1)
        put_here(W.kept + row * NBLK + bid, ka, bid < NBLK)  # (`store`: no layout moves)
        put_here(W.kept_mid + row * NBLK + bid, km, bid < NBLK)
        hy, ly = mass_hi_lo(tl.where(above | mid, y, float("-inf")))
        n_ab += above.to(tl.int32)
        n_abm += (above & okm).to(tl.int32)
        hi_ab += tl.where(above, hy, 0)
        lo_ab += tl.where(above, ly, 0)
        n_mid += mid.to(tl.int32)
        n_midm += (mid & okm).to(tl.int32)
        hi_mid += tl.where(mid, hy, 0)
        lo_mid += tl.where(mid, ly, 0)
        n_belm += (below & okm).to(tl.int32)
        n_bel += below.to(tl.int32)
        slots = tl.atomic_add(ng_ptr, 1, mask=brk, sem="relaxed")
        put_here(W.gath + row * WCAP + slots, pack(y, offs), brk & (slots < WCAP))
        put_here(W.gath_x + row * WCAP + slots, x, brk & (slots < WCAP))
    k = tl.arange(0, 8)
    n = tl.where(k == 0, tile_total(n_ab), tl.where(k == 1, tile_total(n_abm), 0))
    n += tl.where(k == 2, tile_mass(hi_ab, lo_ab), 0)
    n += tl.where(k == 3, tile_total(n_mid), tl.where(k == 4, tile_total(n_midm), 0))
    n += tl.where(k == 5, tile_mass(hi_mid, lo_mid), 0)
    return n + tl.where(k == 6, tile_total(n_belm), tl.where(k == 7, tile_total(n_bel), 0))


@triton.jit
def _kept_row(P, W, row, inputs, route, sp, S, NBLK, R: tl.constexpr, DB: tl.constexpr,
              NBINS: tl.constexpr, WCAP: tl.constexpr, FL: tl.constexpr):  # fmt: skip
    """Slice sp of S of the row's listed blocks; inputs: the row's `process.row_inputs`."""
    (slot, greedy_unused, s_unused, seed_unused, pos_unused, ids, top_k_unused, top_p_unused,
     lnmp) = inputs
    ri = W.rowi + row * cf.NUM_I
    n_list = tl.load(ri + cf.I_NLIST).to(tl.int32)
    per = tl.cdiv(tl.cdiv(n_list, R), S) * R
    e0 = sp * per
    e1 = tl.minimum(e0 + per, n_list)
    if (e0 < e1) & (route == cf.R_CUT):
        if tl.max(ids, axis=0) >= 0:
            cut_tiles(P, W, row, slot, ids, e0, e1, n_list, lnmp, NBLK, R, DB, FL, True)
        else:
            cut_tiles(P, W, row, slot, ids, e0, e1, n_list, lnmp, NBLK, R, DB, FL, False)
    if (e0 < e1) & (route != cf.R_CUT):
        if tl.max(ids, axis=0) >= 0:
            n = _kept_tiles(P, W, row, slot, ids, e0, e1, n_list, lnmp, NBLK, R, DB, NBINS,
                            WCAP, FL, True)  # fmt: skip
        else:
            n = _kept_tiles(P, W, row, slot, ids, e0, e1, n_list, lnmp, NBLK, R, DB, NBINS,
                            WCAP, FL, False)  # fmt: skip
        k = tl.arange(0, 8)
        tl.atomic_add(ri + cf.I_NAB + k, n, mask=n != 0, sem="relaxed")


@triton.jit(do_not_specialize=["S", "NBLK"])
def _kept_kernel(
    P, W,
    S,  # programs in all, shared by the list's rows
    NBLK, NB_P2: tl.constexpr, R: tl.constexpr, DB: tl.constexpr, NBINS: tl.constexpr,
    WCAP: tl.constexpr, FL: tl.constexpr, ROUND2: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    """Grid (S,) over a row list (`select.list_share`): round 1's (`W.listed`) or round
    2's (`W.refine`)."""
    dependent_start(PDL)
    if ROUND2:
        e0, e1, step, sp, n_sp = list_share(W.refine, S)
        for e in range(e0, e1, step):
            kept_entry(P, W, W.refine, e, sp, n_sp, NBLK, NB_P2, R, DB, NBINS, WCAP, FL, True)
    else:
        e, sp, n_sp = list_entry(W.listed, tl.program_id(0), S)
        if e >= 0:
            kept_entry(P, W, W.listed, e, sp, n_sp, NBLK, NB_P2, R, DB, NBINS, WCAP, FL, False)


@triton.jit
def kept_entry(P, W, lst, e, sp, n_sp, NBLK, NB_P2: tl.constexpr, R: tl.constexpr,
               DB: tl.constexpr, NBINS: tl.constexpr, WCAP: tl.constexpr, FL: tl.constexpr,
               ROUND2: tl.constexpr):  # fmt: skip
    """Slice sp of n_sp of entry e's row, when its route still asks for this pass."""
    row, route, ok = listed_row(W, lst, e, ROUND2, True)
    if ok:
        _kept_row(P, W, row, row_inputs(P, row, NB_P2), route, sp, n_sp, NBLK, R, DB, NBINS,
                  WCAP, FL)  # fmt: skip


@triton.jit(do_not_specialize=["NBLK"])
def _finish_kernel(
    P, W,
    tok_ptr, valid_ptr,  # [B] i64 / bool out: the filtered rows' tokens
    NBLK, NBLK_P2: tl.constexpr, NB_P2: tl.constexpr, R: tl.constexpr, DB: tl.constexpr,
    NBINS: tl.constexpr, WCAP: tl.constexpr, WAYS: tl.constexpr, ITA: tl.constexpr,
    ITB: tl.constexpr, SB: tl.constexpr, FL: tl.constexpr, ROUND2: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    """Grid (B,), a launch of its own (the kept pass keeps a streaming loop's registers):
    round 1, the rows the kept pass summed (their inputs read before the wait:
    `process.row_inputs`); round 2, entry i of the refine list."""
    if ROUND2:
        dependent_start(PDL)
        if tl.program_id(0) < tl.load(W.refine):
            finish_refined(P, W, tok_ptr, valid_ptr, tl.program_id(0), NBLK, NB_P2, NBLK_P2, DB,
                           NBINS, WCAP, WAYS, ITA, ITB, SB, FL)  # fmt: skip
    else:
        row = tl.program_id(0)
        inputs = row_inputs(P, row, NB_P2)
        dependent_start(PDL)
        route = tl.load(W.rowi + row * cf.NUM_I + cf.I_ROUTE)
        if route != cf.R_DONE:
            finish_row(P, W, tok_ptr, valid_ptr, row, inputs, route, NBLK, NBLK_P2, DB, NBINS,
                       WCAP, WAYS, ITA, ITB, SB, FL, False)  # fmt: skip
