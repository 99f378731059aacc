"""Top-k first: a filtered row with top-k on served whole by one program after the stats
pass (the row tail, `tail`: every filtered row of the top_k_top_p variant, which is then
two launches in all; the default variant's up to `SamplerConfig.top_k_first`).

For a row with top-k on, lo = the k-th largest block max, less up to 1/128 of it (a radix
selection cut short), is a proven lower bound of its k-th largest value (the k blocks of
the largest maxima hold a token at or above it each), so the tokens with y >= lo, in the
blocks whose max reaches it, hold the whole top-k set and everything ahead of it in the
row's order. Those candidates are gathered (randn rows at V = 128,256: about k up to k =
50, 1.1 k at 200, 1.4 k at 512), sorted by pack, and the cut of `short._cut` read off
them: top-k's k-th pack, top-p on the top-k mass, min-p by value. Then the draw of
`reference`, step 6, as every route ends: the candidate (the unfiltered two-level draw)
where the kept set holds it, else the fallback draw over the kept set, whose block masses
K_b the gathered tokens give. No further read of the row.

Candidates past the gather cap (a flat row with a large k, or k past the row's live
blocks, where lo is the row's lowest value) are narrowed by one more read: a histogram
of them in 2 x gather_cap bins from the max down to lo, and only the bins up to the one
that holds the k-th token are gathered again (a prefix of the row's order, k tokens at
least). Where even that bin overflows (a run of ties at the k-th value), or for a row
this variant does not serve (top-k off under top-p, min-p: `SamplerVariant.TOP_K_TOP_P`),
the exact search (`exact`): slower, bounded, the same token.
"""

from __future__ import annotations

import triton
import triton.language as tl

from graphexec.sampling.triton import sampler_config as cf
from graphexec.sampling.triton.clock import stamp
from graphexec.sampling.triton.draw import FLT_MAX, cut_fallback, gathered_fallback
from graphexec.sampling.triton.exact import exact_cut
from graphexec.sampling.triton.keys import okey, okey_to_float
from graphexec.sampling.triton.process import list_blocks, list_tile
from graphexec.sampling.triton.short import gather, lo_bin, put_candidates, resolve
from graphexec.sampling.triton.stats import arrive


@triton.jit
def kth_largest(ym, live, k, STEPS: tl.constexpr = 4):
    """The k-th largest of the live values ym (k >= 1 of them at least): a radix selection
    over their order keys (as unsigned: the sign bit flipped; dead ones 0), a byte a step
    from the top, each step a 256-bin histogram of the keys that match the bytes chosen so
    far. Exact at 4 STEPS; fewer give a lower bound, the least value whose key starts with
    the k-th largest's first STEPS bytes (2: sign, exponent and 7 mantissa bits, within
    |kth| / 128 of it for a normal kth)."""
    u = (tl.where(live, okey(ym), -2147483648) ^ -2147483648).to(tl.uint32, bitcast=True)
    j = tl.arange(0, 256)
    prefix = tl.zeros([], dtype=tl.uint32)
    rem = k.to(tl.int32)  # the rank sought among the keys that match the prefix
    cnt = tl.full([], u.shape[0], tl.int32)  # those keys
    for step in tl.static_range(STEPS):
        shift = 24 - 8 * step
        match = u >= 0  # (every key, at the first byte)
        if step > 0:
            match = (u >> (shift + 8)) == (prefix >> (shift + 8))
        d = ((u >> shift) & 0xFF).to(tl.int32)
        h = tl.histogram(tl.where(match, d, 0), 256)  # the others counted into bin 0,
        h = tl.where(j == 0, h - (u.shape[0] - cnt), h)  # then taken off
        cum = tl.cumsum(h, axis=0)
        # the largest byte with at least rem matching keys at or above it
        top = tl.max(tl.where(cnt - cum + h >= rem, j, 0), axis=0)
        # its count and the keys up to it, from one sum (both below 2**31)
        both = tl.sum(tl.where(j == top, (cum.to(tl.int64) << 32) | h.to(tl.int64), 0), axis=0)
        rem -= cnt - (both >> 32).to(tl.int32)  # less the keys above byte `top`
        cnt = (both & 0xFFFFFFFF).to(tl.int32)
        prefix = prefix | (top.to(tl.uint32) << shift)
    return okey_to_float((prefix ^ 0x80000000).to(tl.int32, bitcast=True))


@triton.jit
def prefix_bins(P, W, row, slot, ids, n_list, lo, m, s, k, NBLK, R: tl.constexpr,
                DB: tl.constexpr, NH: tl.constexpr, FL: tl.constexpr):  # fmt: skip
    """(inv_w, j) for a row whose candidates (y >= lo, lo < 0) overflow the gather: a
    histogram of them over NH `lo_bin`s, j the first bin by which k have been counted (the
    last bin if they are fewer). One more read of the listed blocks."""
    inv_w = tl.minimum(NH / -lo, FLT_MAX)
    h = tl.zeros([NH], dtype=tl.int32)
    out = tl.zeros([], dtype=tl.int32)  # the others: counted into the last bin, then taken
    nxt, offs_unused, bid_unused = list_tile(P, W, row, slot, ids, 0, n_list, NBLK, R, DB, FL,
                                             True)  # fmt: skip
    for e in range(0, n_list, R):  # off (not every Triton's histogram takes a mask)
        x = nxt  # (the next tile's loads issued before this one's use)
        nxt, offs_unused, bid_unused = list_tile(P, W, row, slot, ids, e + R, n_list, NBLK, R, DB,
                                                 FL, True)  # fmt: skip
        y = (x - m) * s
        inr = (y > float("-inf")) & (y >= lo)
        h += tl.histogram(tl.reshape(tl.where(inr, lo_bin(y, lo, inv_w, NH), NH - 1), [R * DB]),
                          NH)  # fmt: skip
        out += tl.sum(tl.sum((inr == 0).to(tl.int32), axis=1), axis=0)
    b = tl.arange(0, NH)
    h = tl.where(b == NH - 1, h - out, h)
    return inv_w, tl.min(tl.where(tl.cumsum(h, axis=0) >= k, b, NH - 1), axis=0)


@triton.jit
def topk_bound(W, row, ym, xn, m, s, top_k, lnmp, top_p, NBLK, NBLK_P2: tl.constexpr):
    """(lo, ymin, n_list) of a filtered row: the lower bound of its candidates (module
    docstring), its least live y, and its block list (the blocks that reach lo, stored)."""
    b = tl.arange(0, NBLK_P2)
    live = (b < NBLK) & (ym > float("-inf"))
    yn = tl.where(xn < float("inf"), (xn - m) * s, float("-inf"))
    ymin = tl.min(tl.where(live, yn, float("inf")), axis=0)
    lo = tl.full([], -FLT_MAX, tl.float32)
    if (top_k > 0) & (top_k <= tl.sum(live.to(tl.int32), axis=0)):
        lo = kth_largest(ym, live, top_k, 2)  # a bound 2 bytes fine: a few more candidates
        if top_p >= 1.0:  # top-p's total is the top-k mass: every top-k token is needed
            lo = tl.maximum(lo, lnmp)
    lo = tl.maximum(lo, ymin)
    n_list = list_blocks(W, row, live & (ym >= lo), NBLK, NBLK_P2)
    tl.debug_barrier()  # the list, read back by every thread
    return lo, ymin, n_list


@triton.jit
def gather_part(P, W, row, slot, ids, e0, e1, lo, m, s, CAP, NBLK, R: tl.constexpr,
                DB: tl.constexpr, WCAP: tl.constexpr, FL: tl.constexpr):  # fmt: skip
    """`short.gather` of list entries e0 .. e1 - 1 by one of several programs of a row:
    each tile's candidates take their slots from the row's count (W.arrive column 0) by
    one atomic add, so the buffer holds the same candidates in some order (the cut sorts
    them); a program stops once the count passes CAP. Zeroes its blocks' K_b."""
    e = e0
    full = tl.zeros([], dtype=tl.int1)
    while (e < e1) & (full == 0):
        x, offs, bid = list_tile(P, W, row, slot, ids, e, e1, NBLK, R, DB, FL, True)
        y = (x - m) * s
        c = ((y > float("-inf")) & (y >= lo)).to(tl.int32)
        cnt = tl.sum(c, axis=1)
        base = tl.atomic_add(W.arrive + row * 4, tl.sum(cnt, axis=0), sem="relaxed")
        put_candidates(W, row, x, y, offs, bid, c, cnt, base, CAP, NBLK, R, WCAP)
        full = base + tl.sum(cnt, axis=0) > CAP
        e += R


@triton.jit
def topk_first(P, W, row, slot, ids, ym, xn, m, s, top_k, top_p, lnmp, total, seed, pos, NBLK,
               NBLK_P2: tl.constexpr, DB: tl.constexpr, R: tl.constexpr, ST: tl.constexpr,
               MT: tl.constexpr, WCAP: tl.constexpr, INTERP: tl.constexpr, ITA: tl.constexpr,
               ITB: tl.constexpr, SB: tl.constexpr, WAYS: tl.constexpr,
               FL: tl.constexpr, PROF: tl.constexpr = False, part=0, parts=1,
               MULTI: tl.constexpr = False):  # fmt: skip
    """(token, whether the exact search served it, whether this program has the token) of
    a filtered row whose live values are not all tied, its candidate already stored
    (W.rowi's I_CAND, W.rowf's F_YC) by the last part: module docstring. MULTI: the row's
    `parts` programs (this one `part`) share the work: the last part drew the candidate,
    the others find lo and the list and gather its slices (part 0 stores lo for the last
    part), and the last to arrive cuts and draws. (The interpreter runs programs in
    order: the candidate's part arrives last there.)"""
    stamp(W, row, 3, PROF)
    ri = W.rowi + row * cf.NUM_I
    lo = tl.zeros([], dtype=tl.float32)
    lomin = tl.zeros([], dtype=tl.int1)
    n_list = tl.zeros([], dtype=tl.int32)
    if (MULTI == 0) | (part < parts - 1):
        lo, ymin, n_list = topk_bound(W, row, ym, xn, m, s, top_k, lnmp, top_p, NBLK, NBLK_P2)
        lomin = lo <= ymin
    stamp(W, row, 4, PROF)
    last = tl.full([], 1, tl.int1)
    if MULTI:
        if part < parts - 1:
            if part == 0:
                tl.store(W.rowf + row * 8 + cf.F_LO, lo)
                tl.store(ri + cf.I_LOMIN, lomin.to(tl.int64))
                tl.store(ri + cf.I_NLIST, n_list.to(tl.int64))
            per = tl.cdiv(tl.cdiv(n_list, R), parts - 1) * R
            e0 = part * per
            gather_part(P, W, row, slot, ids, e0, tl.minimum(e0 + per, n_list), lo, m, s, WCAP,
                        NBLK, R, DB, WCAP, FL)  # fmt: skip
        last = arrive(W, row, 3, parts)
        n = tl.zeros([], dtype=tl.int32)
        if last:
            n = tl.atomic_xchg(W.arrive + row * 4, 0, sem="acq_rel")  # read and reset
            if part == parts - 1:
                lo = tl.load(W.rowf + row * 8 + cf.F_LO, cache_modifier=".cg")
                lomin = tl.load(ri + cf.I_LOMIN, cache_modifier=".cg") != 0
                n_list = tl.load(ri + cf.I_NLIST, cache_modifier=".cg").to(tl.int32)
    else:
        # a row without a logit bias gathers without looking its entries up per tile (which
        # costs each tile several cross-warp reductions)
        if tl.max(ids, axis=0) >= 0:
            n = gather(P, W, row, slot, ids, n_list, lo, m, s, WCAP, NBLK, R, DB, WCAP, FL)
        else:
            n = gather(P, W, row, slot, ids, n_list, lo, m, s, WCAP, NBLK, R, DB, WCAP, FL,
                       BIAS=False)  # fmt: skip
    stamp(W, row, 5, PROF)
    tok = tl.full([], -1, tl.int32)
    resolved = tl.zeros([], dtype=tl.int1)
    if last:
        tok, resolved = _cut_and_draw(P, W, row, slot, ids, ym, m, s, top_k, top_p, lnmp, total,
                                      seed, pos, lo, lomin, n_list, n, NBLK, NBLK_P2, DB, R, ST,
                                      MT, WCAP, INTERP, ITA, ITB, SB, WAYS, FL, PROF)  # fmt: skip
    return tok, resolved == 0, last


@triton.jit
def _cut_and_draw(P, W, row, slot, ids, ym, m, s, top_k, top_p, lnmp, total, seed, pos, lo,
                  lomin, n_list, n, NBLK, NBLK_P2: tl.constexpr, DB: tl.constexpr, R: tl.constexpr,
                  ST: tl.constexpr, MT: tl.constexpr, WCAP: tl.constexpr, INTERP: tl.constexpr,
                  ITA: tl.constexpr, ITB: tl.constexpr, SB: tl.constexpr, WAYS: tl.constexpr,
                  FL: tl.constexpr, PROF: tl.constexpr):  # fmt: skip
    """(token, resolved) of a top-k-first row from its n gathered candidates (lomin: no
    live token lies below lo): narrowed past the gather cap, cut (`short.resolve`) or found
    by the exact search, then drawn."""
    b = tl.arange(0, NBLK_P2)
    if (n > WCAP) & (top_k > 0) & (lo < 0.0):
        # too many: narrow them to the prefix of bins that holds the k-th (one more read)
        inv_w, j = prefix_bins(P, W, row, slot, ids, n_list, lo, m, s, top_k, NBLK, R, DB,
                               2 * WCAP, FL)  # fmt: skip
        n = gather(P, W, row, slot, ids, n_list, lo, m, s, WCAP, NBLK, R, DB, WCAP, FL, inv_w, j,
                   2 * WCAP)  # fmt: skip
        lomin = lomin & (j == 2 * WCAP - 1)
    stamp(W, row, 6, PROF)
    resolved = tl.zeros([], dtype=tl.int1)
    cut = tl.zeros([], dtype=tl.int64)
    if n <= ST:  # the usual row: a short sort
        resolved, cut = resolve(W, row, n, top_k, top_p, total, lomin, lnmp, s, NBLK, DB, ST,
                                WCAP, INTERP)  # fmt: skip
    elif n <= WCAP:
        if MT > ST and n <= MT:  # (a middle width: `SamplerConfig.mid_tokens`)
            resolved, cut = resolve(W, row, n, top_k, top_p, total, lomin, lnmp, s, NBLK, DB, MT,
                                    WCAP, INTERP)  # fmt: skip
        else:
            resolved, cut = resolve(W, row, n, top_k, top_p, total, lomin, lnmp, s, NBLK, DB,
                                    WCAP, WCAP, INTERP)  # fmt: skip
    if resolved:
        rd = (b < NBLK) & (ym >= lo)  # every kept token lies in a listed block
    else:
        cut = exact_cut(P, W, row, slot, ids, m, s, lo, top_k, top_p, lnmp, total, NBLK, ITA, ITB,
                        SB, DB, WAYS, FL)  # fmt: skip
        rd = b < NBLK
    stamp(W, row, 7, PROF)
    tl.debug_barrier()  # the kept masses, read back by every thread
    if resolved & (n <= ST):
        tok = gathered_fallback(W, row, n, cut, lnmp, m, s, seed, pos, NBLK, DB, ST, WCAP)
    else:
        tok = cut_fallback(P, W, row, slot, ids, ym, rd, m, s, seed, pos, cut, lnmp, NBLK, NBLK_P2,
                           DB, FL)  # fmt: skip
    stamp(W, row, 8, PROF)
    return tok, resolved
