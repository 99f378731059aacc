"""The one full read of the logits, the plan of a filtered row's next passes, and the
check pass (the route map: the package docstring).

`_stats_kernel`: programs (row, slice) read their slice as [R, DB] tiles, one block per
tile row, and store each block's stats from the processed x (`process.tile_x`): the
`Workspace` fields xm, xn, Q_b and, with logprobs on, the raw block max and sum of exp. A
block never straddles two programs and Q_b is an integer sum, so no split of the row
changes a stat. The row tail (`tail`) then serves a row or plans its next passes
(`_plan`: a lower bound lo of its kept values and the list of the blocks that reach it);
`_check_kernel` decides the candidates the tail left to it.
"""

from __future__ import annotations

import triton
import triton.language as tl

from graphexec.kernels.dependent_launch import dependent_start
from graphexec.sampling.triton import sampler_config as cf
from graphexec.sampling.triton.candidate import KEPT, OUT, count_above, decide
from graphexec.sampling.triton.draw import FLT_MAX, row_blocks
from graphexec.sampling.triton.keys import block_mass
from graphexec.sampling.triton.process import (
    bias_ids,
    list_blocks,
    process_raw,
    raw_load,
    row_inputs,
    widen,
)
from graphexec.sampling.triton.store import put_here


@triton.jit
def arrive(W, row, k: tl.constexpr, n):
    """True in the last of the row's n programs to finish pass k; it resets the counter
    for the next call. The barrier and the acq_rel add publish this program's stores and
    make the others' visible to the last one."""
    tl.debug_barrier()
    done = tl.atomic_add(W.arrive + row * 4 + k, 1, sem="acq_rel")
    last = done == n - 1
    if last:
        tl.store(W.arrive + row * 4 + k, 0)
    tl.debug_barrier()
    return last


@triton.jit
def grid_delta(ym, w, target, c, MODE: tl.constexpr):
    """The smallest delta on a grid (4x steps from 1/8 to 2048, refined twice in eighths)
    with f(delta) >= target; +inf when none reaches it. MODE 0: f = sum of w over blocks
    with ym >= -delta; MODE 1: f = sum of max(exp(ym), w - c * exp(-delta)) over them (a
    lower bound of a block's mass at y >= -delta when w is its mass and c its most tokens:
    its max token lies there, and the tokens below weigh less than exp(-delta) each)."""
    d = tl.arange(0, 8)
    deltas = 0.125 * tl.exp2(2.0 * d.to(tl.float32))
    lo = tl.zeros([], dtype=tl.float32)
    hi = tl.full([], float("inf"), tl.float32)
    for _level in tl.static_range(3):
        inside = ym[:, None] >= -deltas[None, :]
        if MODE == 0:
            terms = tl.where(inside, w[:, None], 0.0)
        else:
            terms = tl.where(inside, tl.maximum(w[:, None] - c * tl.exp(-deltas[None, :]),
                                                tl.exp(ym)[:, None]), 0.0)  # fmt: skip
        j = tl.min(tl.where(tl.sum(terms, axis=0) >= target, d, 8), axis=0)
        lo = tl.where((j > 0) & (j < 8), tl.sum(tl.where(d == j - 1, deltas, 0.0), axis=0), lo)
        hi = tl.where(j < 8, tl.sum(tl.where(d == j, deltas, 0.0), axis=0), hi)
        deltas = lo + (hi - lo) * (d + 1).to(tl.float32) / 8.0
    return hi


@triton.jit
def _plan(W, row, ym, xn, q, top_k, top_p, lnmp, m, s, total, NBLK,
          NBLK_P2: tl.constexpr, DB: tl.constexpr, NBINS: tl.constexpr):  # fmt: skip
    """The next passes' plan of a filtered row (module docstring): route, lo, bins, the
    list of blocks with ym_b >= lo; zeroes what those passes sum into."""
    yn = tl.where(xn < float("inf"), (xn - m) * s, float("-inf"))
    b = tl.arange(0, NBLK_P2)
    live_b = ym > float("-inf")
    route = tl.where((top_k == 0) & (top_p >= 1.0), cf.R_CUT, cf.R_SELECT).to(tl.int32)
    lo = lnmp
    inv_w = tl.zeros([], dtype=tl.float32)
    lomin = tl.zeros([], dtype=tl.int64)
    if route == cf.R_SELECT:
        # a lower bound of the cut: top-k's k-th largest block max (k tokens lie at or
        # above it); top-p's point where a lower bound of the mass above it passes p; min-p
        if top_k > 0:
            lo = -grid_delta(ym, tl.full([NBLK_P2], 1.0, tl.float32), top_k.to(tl.float32), 0.0, 0)
            if top_p >= 1.0:
                lo = tl.maximum(lo, lnmp)
        else:
            mb = (q.to(tl.float32) * 2.3283064365386963e-10) * tl.exp(ym)  # Q_b e^ym / 2**32
            t_p = (top_p.to(tl.float64) * total * 2.3283064365386963e-10).to(tl.float32) * 1.001
            lo = tl.maximum(-grid_delta(ym, mb, t_p, DB * 1.0, 1), lnmp)
        ymin = tl.min(tl.where(live_b, yn, float("inf")), axis=0)
        lo = tl.maximum(tl.maximum(lo, ymin), -FLT_MAX)
        lomin = (lo <= ymin).to(tl.int64)
        inv_w = tl.where(lo < 0.0, NBINS / -lo, 0.0)
        tl.store(W.hist + row * NBINS + tl.arange(0, NBINS), tl.zeros([NBINS], dtype=tl.int32))
    sel = live_b & (ym >= lo) & (b < NBLK)
    if route == cf.R_CUT:
        # min-p alone reads again only the blocks it cuts: one whose every live token has
        # y >= log_min_p keeps its whole mass Q_b
        full = live_b & (yn >= lnmp)
        sel = sel & (full == 0)
        tl.store(W.kept + row * NBLK + b, tl.where(full, q, 0), mask=b < NBLK)
    n_list = list_blocks(W, row, sel, NBLK, NBLK_P2)
    fr = W.rowf + row * 8
    tl.store(fr + cf.F_M, m)
    tl.store(fr + cf.F_S, s)
    tl.store(fr + cf.F_LO, lo)
    tl.store(fr + cf.F_INVW, inv_w)
    tl.store(fr + cf.F_KLO, lo)
    tl.store(fr + cf.F_TOP, tl.zeros([], dtype=tl.float32))
    ri = W.rowi + row * cf.NUM_I
    c = tl.arange(0, 8)
    # min-p alone: every token is "above" (bin 0 < jhi = 1); the selection overwrites these
    vals = tl.where((c == cf.I_JHI) | (c == cf.I_J2), 1, 0)
    vals = tl.where(c == cf.I_ROUTE, route.to(tl.int64), vals)
    vals = tl.where(c == cf.I_NLIST, n_list.to(tl.int64), vals)
    tl.store(ri + c, tl.where(c == cf.I_LOMIN, lomin, vals))
    c16 = tl.arange(0, 16)
    tl.store(ri + cf.I_NAB + c16, tl.zeros([16], dtype=tl.int64))
    return route


@triton.jit
def plan_row(W, row, top_k, top_p, lnmp, NBLK, NBLK_P2: tl.constexpr, DB: tl.constexpr,
             NBINS: tl.constexpr):  # fmt: skip
    """`_plan` from the row's block stats (its 1/T from rowf; a row of the check pass holds
    no +inf, so `row_blocks`' m is the max the tail stored): the plan of a row whose
    candidate the check pass did not keep."""
    s = tl.load(W.rowf + row * 8 + cf.F_S)
    xm_unused, mx_unused, inf_unused, m, ym, q = row_blocks(W, row, s, NBLK, NBLK_P2)
    b = tl.arange(0, NBLK_P2)
    xn = tl.load(W.xn + row * NBLK + b, mask=b < NBLK, other=float("inf"), cache_modifier=".cg")
    return _plan(W, row, ym, xn, q, top_k, top_p, lnmp, m, s, tl.load(W.total + row), NBLK,
                 NBLK_P2, DB, NBINS)  # fmt: skip


@triton.jit
def _block_stats(W, dst, raw_mode, x, v, ok, s, RAW_LP: tl.constexpr, XN: tl.constexpr):
    """Stores the stats of one tile's blocks at dst [R] (row * NBLK + block id) from their
    processed x and raw v ([R, DB], -inf past V); ok: block id < NBLK (None: a full tile)."""
    xm = tl.max(x, axis=1)
    # z = (x - xm_b) * s is -inf at x = -inf, and at the finite x of a block holding +inf;
    # NaN at x = xm_b = +inf, which `block_mass` weighs 2**32 (the collapsed row's mass),
    # and at x = xm_b = -inf (a dead block: q = 0)
    q = tl.where(xm > float("-inf"), block_mass(x - xm[:, None], s), 0)
    put_here(W.xm + dst, xm, ok)
    if XN:  # (a +inf entry cannot be below a finite one: no test for it)
        put_here(W.xn + dst, tl.min(tl.where(x > float("-inf"), x, float("inf")), axis=1), ok)
    put_here(W.q + dst, q, ok)
    if RAW_LP:  # the raw logits' block max and sum of exp, for raw-mode rows
        v = tl.where(v == v, v, float("-inf"))
        vm = tl.max(v, axis=1)
        vf = (vm > float("-inf")) & (vm < float("inf"))
        e = tl.exp(tl.where(vf[:, None] & (v > float("-inf")),
                            v - tl.where(vf, vm, 0.0)[:, None], float("-inf")))  # fmt: skip
        if ok is None:
            if raw_mode:  # (uniform: one branch, no mask for `put_here`)
                put_here(W.raw_max + dst, vm, None)
                put_here(W.raw_sum + dst, tl.sum(e, axis=1), None)
        else:
            okr = tl.where(raw_mode, ok, False)
            tl.store(W.raw_max + dst, vm, mask=okr)
            tl.store(W.raw_sum + dst, tl.sum(e, axis=1), mask=okr)


@triton.jit
def _stats_tiles(P, W, row, slot, ids, s, raw_mode, t0, t1, NBLK, R: tl.constexpr,
                 DB: tl.constexpr, RAW_LP: tl.constexpr, FL: tl.constexpr,
                 BIAS: tl.constexpr, XN: tl.constexpr):  # fmt: skip
    """The stats of blocks t0 .. t1 - 1, R a tile: the read floor's loop. Full tiles (every
    token inside V) are read unmasked, each one's loads issued an iteration ahead of their
    use, one ex2 a logit (`keys`), their stats stored without a barrier (`put_here`); the loop
    body has no branch (with logprobs: one, on the row's raw mode). Then the program's last
    tiles, masked."""
    rr = tl.arange(0, R)
    col = tl.arange(0, DB)
    offs = (t0 + rr)[:, None] * DB + col[None, :]
    n_full = tl.maximum(tl.minimum(t1, P.vocab // DB) - t0, 0) // R
    # full tiles load at in-tile int64 offsets, formed once, from a pointer moved a tile at
    # a time (no per-tile index arithmetic; the last prefetch reads its own tile again,
    # unmasked: no predicate, no zero fill)
    inner = (rr[:, None] * DB + col[None, :]).to(tl.int64) * P.logits_sv
    step = tl.full([], R * DB, tl.int64) * P.logits_sv
    tile = P.logits + row.to(tl.int64) * P.logits_sb + (t0 * DB).to(tl.int64) * P.logits_sv
    dst = row * NBLK + t0 + rr
    # (a uniform mask as a vector: the interpreter takes no scalar bool mask)
    every = tl.full(offs.shape, 1, tl.int1)
    raw = tl.load(tile + inner, mask=tl.where(n_full > 0, every, False), other=0)
    for i in range(0, n_full):
        t = t0 + i * R
        tile += tl.where(i + 1 < n_full, step, 0)
        nxt = tl.load(tile + inner)
        v = widen(raw, FL, True)
        x = process_raw(P, row, slot, ids, offs, v, None, t * DB, (t + R) * DB, FL, BIAS)
        _block_stats(W, dst, raw_mode, x, v, None, s, RAW_LP, XN)
        raw = nxt
        offs += R * DB
        dst += R
    for t in range(t0 + n_full * R, t1, R):
        bid = t + rr
        offs = bid[:, None] * DB + col[None, :]
        ok = offs < P.vocab
        v = widen(raw_load(P, row, offs, ok), FL, True)
        x = process_raw(P, row, slot, ids, offs, v, ok, t * DB, (t + R) * DB, FL, BIAS)
        x = tl.where(ok, x, float("-inf"))
        _block_stats(W, row * NBLK + bid, raw_mode, x, tl.where(ok, v, float("-inf")),
                     bid < NBLK, s, RAW_LP, XN)  # fmt: skip


@triton.jit(do_not_specialize=["B", "S", "PER", "NBLK"])
def _stats_kernel(
    P, W,
    B, S, PER,  # rows, programs per row, blocks per program (a multiple of R)
    NBLK, XN: tl.constexpr, RAW_LP: tl.constexpr, NB_P2: tl.constexpr, R: tl.constexpr,
    DB: tl.constexpr, FL: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    """Grid (B * S,): program (row, sp) = divmod(pid, S) writes the stats of blocks
    [sp * PER, ...) (XN: the block minima too, which only the filtered variants read)."""
    dependent_start(PDL)
    row = tl.program_id(0) // S
    sp = tl.program_id(0) % S
    slot = tl.load(P.slots + row).to(tl.int64)
    s = tl.where(tl.load(P.temperature + slot) == 0.0, 1.0, tl.load(P.inv_temperature + slot))
    ids = bias_ids(P, slot, NB_P2)
    raw_mode = tl.zeros([], dtype=tl.int1)
    if RAW_LP:
        raw_mode = tl.load(P.lp_processed + slot) == 0
    # a row with a logit bias looks its entries up per tile; the others never do
    if tl.max(ids, axis=0) >= 0:
        _stats_tiles(P, W, row, slot, ids, s, raw_mode, sp * PER, sp * PER + PER, NBLK, R, DB,
                     RAW_LP, FL, True, XN)  # fmt: skip
    else:
        _stats_tiles(P, W, row, slot, ids, s, raw_mode, sp * PER, sp * PER + PER, NBLK, R, DB,
                     RAW_LP, FL, False, XN)  # fmt: skip


@triton.jit(do_not_specialize=["S", "NBLK"])
def _check_kernel(
    P, W,
    tok_ptr, valid_ptr,  # [B] i64 / bool out: the rows whose candidate is kept
    S,  # programs per row
    NBLK, NB_P2: tl.constexpr, NBLK_P2: tl.constexpr, R: tl.constexpr, DB: tl.constexpr,
    NBINS: tl.constexpr, FL: tl.constexpr, PDL: tl.constexpr = False,
    QUEUE: tl.constexpr = False,
):  # fmt: skip
    """The check pass of R_CHECK rows (more than check_blocks blocks to count). Grid (B * S,):
    program (row, sp) sums slice sp of the row's listed blocks into its I_CCNT / I_CMASS
    (int64 atomics: exact in any order); the row's last program decides (QUEUE: a row it
    leaves to plan counts in the late queue's gate, `late`). The row's inputs are read
    before the wait (`process.row_inputs`)."""
    row = tl.program_id(0) // S
    sp = tl.program_id(0) % S
    (slot, greedy_unused, s_unused, seed_unused, pos_unused, ids, top_k, top_p,
     lnmp_unused) = row_inputs(P, row, NB_P2)
    dependent_start(PDL)
    ri = W.rowi + row * cf.NUM_I
    if tl.load(ri + cf.I_ROUTE) == cf.R_CHECK:
        n_list = tl.load(ri + cf.I_NLIST).to(tl.int32)
        per = tl.cdiv(tl.cdiv(n_list, R), S) * R
        e0 = sp * per
        e1 = tl.minimum(e0 + per, n_list)
        if e0 < e1:
            m = tl.load(W.rowf + row * 8 + cf.F_M)
            s = tl.load(W.rowf + row * 8 + cf.F_S)
            yc = tl.load(W.rowf + row * 8 + cf.F_YC)
            c = tl.load(ri + cf.I_CAND).to(tl.int32)
            if tl.max(ids, axis=0) >= 0:
                cnt, before = count_above(P, W, row, slot, ids, e0, e1, n_list, yc, c, m, s,
                                          NBLK, R, DB, FL, True)  # fmt: skip
            else:
                cnt, before = count_above(P, W, row, slot, ids, e0, e1, n_list, yc, c, m, s,
                                          NBLK, R, DB, FL, False)  # fmt: skip
            tl.atomic_add(ri + cf.I_CCNT, cnt, sem="relaxed")
            tl.atomic_add(ri + cf.I_CMASS, before, sem="relaxed")
        if arrive(W, row, 2, S):  # the row's last program decides
            yc = tl.load(W.rowf + row * 8 + cf.F_YC)
            cnt = tl.load(ri + cf.I_CCNT, cache_modifier=".cg")
            before = tl.load(ri + cf.I_CMASS, cache_modifier=".cg")
            state = decide(cnt, before, yc, top_k, top_p, tl.load(W.total + row))
            if state == KEPT:
                tok = tl.load(ri + cf.I_CAND)
                tl.store(ri + cf.I_ROUTE, tl.zeros([], dtype=tl.int64))
                tl.store(tok_ptr + row, tok)
                tl.store(valid_ptr + row, tok >= 0)
            else:  # planned by `_short_kernel`: its vectors would raise these registers
                if state == OUT:
                    tl.store(ri + cf.I_CAND, tl.full([], -1, tl.int64))
                tl.store(ri + cf.I_ROUTE, tl.full([], cf.R_REPLAN, tl.int64))
                if QUEUE:
                    tl.atomic_add(W.queue + cf.Q_NEED, 1, sem="relaxed")
