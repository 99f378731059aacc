"""The short route: a filtered row whose candidates (tokens with y >= lo) lie in a few
blocks is finished right after its plan (`stats._plan`) by one program, in a launch of its
own (so that the row tail's code stays small), with no selection pass.

Every kept token is a candidate (lo is proven), and so is every token ahead of one in the
row's order, so the exact counts and masses that decide the cut come from them alone.
Sorted by pack (the row's order), the candidates' inclusive mass sums F_j give every cut
(`reference`, step 5): top-k's is the k-th pack, top-p's the first pack with F_j >= p *
total (total: F at top-k's cut, or the row's mass from its block stats), min-p's the pack
of y = log_min_p. One loop over the listed blocks, R at a time (registers stay those of
a [R, DB] tile), compacts the candidates into the row's gather buffers. min-p alone needs
no cut: the loop sums its cut blocks' K_b (more go to the kept pass's programs).
"""

from __future__ import annotations

import triton
import triton.language as tl

from graphexec.kernels.dependent_launch import dependent_start
from graphexec.sampling.triton import sampler_config as cf
from graphexec.sampling.triton.draw import block_y, cut_fallback, gathered_fallback
from graphexec.sampling.triton.keys import BIG_KEY, PAD_KEY, mass, pack, sort_desc, sum_mass, unpack
from graphexec.sampling.triton.process import list_ids, list_tile, row_inputs
from graphexec.sampling.triton.select import list_append
from graphexec.sampling.triton.stats import plan_row
from graphexec.sampling.triton.store import put_here


@triton.jit
def cut_tiles(P, W, row, slot, ids, e0, e1, n_list, lnmp, NBLK, R: tl.constexpr,
               DB: tl.constexpr, FL: tl.constexpr, BIAS: tl.constexpr):  # fmt: skip
    """Min-p alone: the kept masses of list entries e0 .. e1 - 1 (the blocks it cuts)."""
    m = tl.load(W.rowf + row * 8 + cf.F_M)
    s = tl.load(W.rowf + row * 8 + cf.F_S)
    for e in range(e0, e1, R):
        x, offs, bid = list_tile(P, W, row, slot, ids, e, n_list, NBLK, R, DB, FL, BIAS)
        y = (x - m) * s
        xmb = tl.load(W.xm + row * NBLK + bid, mask=bid < NBLK, other=float("-inf"))
        z = (x - tl.where(xmb > float("-inf"), xmb, 0.0)[:, None]) * s
        kb = sum_mass((y > float("-inf")) & (y >= lnmp), z, 1)
        put_here(W.kept + row * NBLK + bid, kb, bid < NBLK)


@triton.jit
def _cut(keys, n, top_k, top_p, total, lomin, ST: tl.constexpr, INTERP: tl.constexpr):
    """(resolved, cut) from the n candidates' packs keys [ST] (PAD_KEY past n): the pack
    of the last token top-k and top-p keep, at least the lowest candidate's."""
    srt = tl.reshape(sort_desc(tl.reshape(keys, (1, ST)), INTERP), (ST,))
    rank = tl.arange(0, ST) + 1
    ok = rank <= n
    y, ids_unused = unpack(srt)
    f = tl.cumsum(tl.where(ok, mass(y), 0), axis=0)
    cut = tl.min(tl.where(ok, srt, BIG_KEY), axis=0)
    t_p = total
    # k candidates at least: the top k are among them; fewer: every live token is one
    # (lomin), or top-p is off
    resolved = (top_k <= 0) | (top_k <= n) | lomin | (top_p >= 1.0)
    if top_k > 0:
        k = tl.minimum(top_k, n)
        cut = tl.sum(tl.where(rank == k, srt, 0), axis=0)
        t_p = tl.sum(tl.where(rank == k, f, 0), axis=0).to(tl.float64)
    if top_p < 1.0:
        reach = ok & (f.to(tl.float64) >= top_p.to(tl.float64) * t_p)
        # lo bounds top-p's cut from below, so some candidate reaches p * total
        resolved = resolved & (tl.max(reach.to(tl.int32), axis=0) > 0)
        cut = tl.maximum(cut, tl.max(tl.where(reach, srt, PAD_KEY), axis=0))
    return resolved, cut


@triton.jit
def lo_bin(y, lo, inv_w, NH: tl.constexpr):
    """The bin of y >= lo among NH bins of width 1 / inv_w from the row max (y = 0) down to
    lo: monotone (non-increasing) in y, so bins 0..j hold a prefix of the row's order."""
    return tl.minimum(-y * inv_w, NH - 1.0).to(tl.int32)  # (clamped first: -inf's is the last)


@triton.jit
def put_candidates(W, row, x, y, offs, bid, c, cnt, first, CAP, NBLK, R: tl.constexpr,
                   WCAP: tl.constexpr):  # fmt: skip
    """A tile's candidates (c [R, DB]: 1 where one; cnt [R]: their number a block) into
    the row's gather buffers (packs and x) at slots first, first + 1, ... in list order,
    the slots below CAP only; the tile's blocks' K_b zeroed, for the kept candidates to add
    to. The slots come from a scan along each block, then over the blocks' counts, in the
    tile's [R, DB] layout: a scan of the tile as one vector would move its values, masks
    and pointers between layouts through shared memory, a barrier each."""
    at = first + (tl.cumsum(cnt, axis=0) - cnt)[:, None] + tl.cumsum(c, axis=1) - 1
    put = (c != 0) & (at < CAP)
    # from the tile's layout (`store`): a scatter of a few would move the whole tile
    put_here(W.gath + row * WCAP + at, pack(y, offs), put)
    put_here(W.gath_x + row * WCAP + at, x, put)
    tl.store(W.kept + row * NBLK + bid, tl.zeros([R], tl.int64), mask=bid < NBLK)


@triton.jit
def gather(P, W, row, slot, ids, n_list, lo, m, s, CAP, NBLK, R: tl.constexpr, DB: tl.constexpr,
           WCAP: tl.constexpr, FL: tl.constexpr, inv_w=0.0, J=0, NH: tl.constexpr = 0,
           BIAS: tl.constexpr = True):  # fmt: skip
    """The number of candidates (y >= lo; with NH, in `lo_bin`s up to J only) in the row's
    n_list listed blocks, the first CAP of them (packs and x) compacted into its gather
    buffers by a running count (no atomics: the selection passes count their own gather
    from 0); the listed blocks' K_b zeroed, for the kept candidates to add to. A row past
    CAP stops reading at once. Each tile's loads are issued a step ahead of its use, and its
    block ids two (one program reads every listed block: its latency is the row's). BIAS
    False: a row without a logit bias (no lookup of its entries per tile)."""
    n = tl.zeros([], dtype=tl.int32)
    e0 = tl.zeros([], dtype=tl.int32)
    nxt, nxt_offs, nxt_bid = list_tile(P, W, row, slot, ids, e0, n_list, NBLK, R, DB, FL, BIAS)
    far = list_ids(W, row, e0 + R, n_list, NBLK, R)
    while (e0 < n_list) & (n <= CAP):
        x, offs, bid = nxt, nxt_offs, nxt_bid
        nxt, nxt_offs, nxt_bid = list_tile(P, W, row, slot, ids, e0 + R, n_list, NBLK, R, DB, FL,
                                           BIAS, far)  # fmt: skip
        far = list_ids(W, row, e0 + 2 * R, n_list, NBLK, R)
        y = (x - m) * s
        inr = (y > float("-inf")) & (y >= lo)
        if NH > 0:
            inr = inr & (lo_bin(y, lo, inv_w, NH) <= J)
        c = inr.to(tl.int32)
        cnt = tl.sum(c, axis=1)
        put_candidates(W, row, x, y, offs, bid, c, cnt, n, CAP, NBLK, R, WCAP)
        n += tl.sum(cnt, axis=0)
        e0 += R
    tl.debug_barrier()  # the gather, read back by every thread
    return n


@triton.jit
def resolve(W, row, n, top_k, top_p, total, lomin, lnmp, s, NBLK, DB: tl.constexpr,
            ST: tl.constexpr, WCAP: tl.constexpr, INTERP: tl.constexpr):  # fmt: skip
    """(resolved, cut) of a row's n <= ST gathered candidates (`_cut`); when resolved,
    their kept masses added to their blocks' K_b."""
    c = tl.arange(0, ST)
    ok = c < n
    keys = tl.load(W.gath + row * WCAP + c, mask=ok, other=PAD_KEY)
    resolved, cut = _cut(keys, n, top_k, top_p, total, lomin, ST, INTERP)
    if resolved:
        yg, idg = unpack(keys)
        kept = ok & (keys >= cut) & (yg >= lnmp)
        bg = idg // DB
        xmg = tl.load(W.xm + row * NBLK + bg, mask=kept, other=0.0)
        xg = tl.load(W.gath_x + row * WCAP + c, mask=kept, other=0.0)
        tl.atomic_add(W.kept + row * NBLK + bg, mass((xg - xmg) * s), mask=kept)
    return resolved, cut


@triton.jit(do_not_specialize=["NBLK"])
def _short_kernel(
    P, W,
    tok_ptr, valid_ptr,  # [B] i64 / bool out: the rows served here
    NBLK, NB_P2: tl.constexpr, NBLK_P2: tl.constexpr, DB: tl.constexpr, R: tl.constexpr,
    SB: tl.constexpr, ST: tl.constexpr, WCAP: tl.constexpr, FL: tl.constexpr,
    INTERP: tl.constexpr, NBINS: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    """Grid (B,): program b serves row b (`short_row`)."""
    row = tl.program_id(0)
    inputs = row_inputs(P, row, NB_P2)  # before the wait (`process.row_inputs`)
    dependent_start(PDL)
    short_row(P, W, tok_ptr, valid_ptr, row, inputs, NBLK, NBLK_P2, DB, R, SB, ST, WCAP, FL,
              INTERP, NBINS)  # fmt: skip


@triton.jit
def short_row(P, W, tok_ptr, valid_ptr, row, inputs, NBLK, NBLK_P2: tl.constexpr,
              DB: tl.constexpr, R: tl.constexpr, SB: tl.constexpr, ST: tl.constexpr,
              WCAP: tl.constexpr, FL: tl.constexpr, INTERP: tl.constexpr,
              NBINS: tl.constexpr):  # fmt: skip
    """Plan the row when the check pass left it R_REPLAN (`plan_row`); then draw it (and
    mark it R_DONE) when its plan (R_SELECT or R_CUT) fits SB blocks and ST candidates (SB
    = 0: plans only); else put it on round 1's row list (`W.listed`), which the selection
    and kept passes share out. inputs: the row's `process.row_inputs`."""
    slot, greedy_unused, s_unused, seed, pos, ids, top_k, top_p, lnmp = inputs
    ri = W.rowi + row * cf.NUM_I
    route = tl.load(ri + cf.I_ROUTE).to(tl.int32)
    if route == cf.R_REPLAN:
        route = plan_row(W, row, top_k, top_p, lnmp, NBLK, NBLK_P2, DB, NBINS)
        tl.debug_barrier()  # the plan's stores, read back below
    if (SB > 0) & ((route == cf.R_SELECT) | (route == cf.R_CUT)) & (
            tl.load(ri + cf.I_NLIST) <= SB):  # fmt: skip
        m = tl.load(W.rowf + row * 8 + cf.F_M)
        s = tl.load(W.rowf + row * 8 + cf.F_S)
        b = tl.arange(0, NBLK_P2)
        xm = tl.load(W.xm + row * NBLK + b, mask=b < NBLK, other=float("-inf"))
        ym = block_y(xm, m, s, False)
        total = tl.load(W.total + row)
        tok = tl.full([], -1, tl.int32)
        tl.debug_barrier()  # the plan's stores, read back by every thread
        n_list = tl.load(ri + cf.I_NLIST).to(tl.int32)
        lo = tl.load(W.rowf + row * 8 + cf.F_LO)
        cut = tl.full([], PAD_KEY, tl.int64)
        # min-p alone: K_b of the cut blocks over y >= log_min_p, when they are few (one
        # program reads them here; the kept pass spreads more over several)
        n = tl.zeros([], dtype=tl.int32)
        resolved = (route == cf.R_CUT) & (n_list <= SB // 4)
        if resolved:
            cut_tiles(P, W, row, slot, ids, 0, n_list, n_list, lnmp, NBLK, R, DB, FL, True)
        if (route == cf.R_SELECT) & (n_list <= SB):
            n = gather(P, W, row, slot, ids, n_list, lo, m, s, ST, NBLK, R, DB, WCAP, FL)
            if n <= ST:
                lomin = tl.load(ri + cf.I_LOMIN) != 0
                resolved, cut = resolve(W, row, n, top_k, top_p, total, lomin, lnmp, s, NBLK,
                                        DB, ST, WCAP, INTERP)  # fmt: skip
        if resolved:
            tl.debug_barrier()  # the kept masses, read back by every thread
            if route == cf.R_CUT:
                # its plan stored every block's K_b (Q_b where kept whole)
                tok = cut_fallback(P, W, row, slot, ids, ym, b < NBLK, m, s, seed, pos, cut, lnmp,
                                   NBLK, NBLK_P2, DB, FL)  # fmt: skip
            else:
                tok = gathered_fallback(W, row, n, cut, lnmp, m, s, seed, pos, NBLK, DB, ST, WCAP)
            route = route * 0  # R_DONE
        if route == cf.R_DONE:
            tl.store(ri + cf.I_ROUTE, tl.zeros([], dtype=tl.int64))
            tl.store(tok_ptr + row, tok.to(tl.int64))
            tl.store(valid_ptr + row, tok >= 0)
    list_append(W.listed, row, (route == cf.R_SELECT) | (route == cf.R_CUT))  # round 1's rows
