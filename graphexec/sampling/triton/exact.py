"""The exact search: a filtered row's cut found by counting, when its bracket did not
resolve (more bracket tokens than the gather cap, or a histogram estimate off).

The kept set of any filtered row is {pack >= C} (`keys.pack`: distinct, larger exactly
where a token comes earlier in the row's order), with C the largest of

    C_k   top-k: the k-th largest pack, the largest P with #(pack >= P) >= k
    C_p   top-p: the largest P with H(P) >= p * total, H(P) the exact mass of pack >= P
          (a token is kept iff the mass before it, H(its pack + 1), is below p * total;
          the smallest live pack when the whole row's mass is below it)
    C_m   min-p: okey(log_min_p) << 32, i.e. y >= log_min_p

Each search narrows its range WAYS-fold per pass (one program, the blocks that can hold
a pack >= the lowest candidate): the 32 key bits, then the id bits (V <= 2**21). Worst
case, top-k and top-p: 1 + 14 + 1 + 14 passes, and one for the kept blocks' masses.
"""

from __future__ import annotations

import triton
import triton.language as tl

from graphexec.sampling.triton.keys import (
    PAD_KEY,
    mass_hi_lo,
    okey,
    okey_to_float,
    pack,
    sum_halves,
    sum_mass,
)
from graphexec.sampling.triton.process import tile_x


@triton.jit
def _pass_ge(P, W, row, slot, ids, m, s, cands, NBLK, DB: tl.constexpr, WAYS: tl.constexpr,
             SB: tl.constexpr, FL: tl.constexpr):  # fmt: skip
    """One pass: (#(pack >= c_j), exact mass of pack >= c_j) [WAYS] for ascending cands,
    SB blocks a step (a [SB * DB, WAYS] compare)."""
    cnt = tl.zeros([WAYS], dtype=tl.int64)
    tot = tl.zeros([WAYS], dtype=tl.int64)
    # a pack >= the lowest candidate has y >= its value: other blocks are not read
    y_min = okey_to_float(tl.min((cands >> 32).to(tl.int32), axis=0))
    for t in range(0, NBLK, SB):
        bid = t + tl.arange(0, SB)
        xmb = tl.load(W.xm + row * NBLK + bid, mask=bid < NBLK, other=float("-inf"))
        need = (xmb > float("-inf")) & ((xmb - m) * s >= y_min)
        if tl.max(need.to(tl.int32), axis=0) > 0:
            offs = tl.reshape(tl.where(need, bid, NBLK)[:, None] * DB + tl.arange(0, DB)[None, :],
                              [SB * DB])  # fmt: skip
            y = (tile_x(P, row, slot, ids, offs, t * DB, (t + SB) * DB, FL) - m) * s
            pk = tl.where(y > float("-inf"), pack(y, offs), PAD_KEY)
            ge = pk[:, None] >= cands[None, :]
            cnt += tl.sum(ge.to(tl.int64), axis=0)
            hi, lo = mass_hi_lo(y)  # one exp a token, summed per candidate
            tot += sum_halves(tl.where(ge, hi[:, None], 0), tl.where(ge, lo[:, None], 0), 0)
    return cnt, tot


@triton.jit
def _search(P, W, row, slot, ids, m, s, lo, hi, on_keys, target, use_mass, NBLK,
            ITERS: tl.constexpr, SB: tl.constexpr, DB: tl.constexpr, WAYS: tl.constexpr,
            FL: tl.constexpr):  # fmt: skip
    """The largest v in [lo, hi] with F(v) >= target (F(lo) >= target on entry): F the
    count, or the mass, of pack >= v << 32 (on_keys) or of pack >= v."""
    w = tl.arange(0, WAYS).to(tl.int64)
    for _it in range(ITERS):
        if lo < hi:
            step = (hi - lo) // WAYS + 1
            c = tl.minimum(lo + w * step, hi)
            cands = tl.where(on_keys != 0, c << 32, c)
            cnt, tot = _pass_ge(P, W, row, slot, ids, m, s, cands, NBLK, DB, WAYS, SB, FL)
            f = tl.where(use_mass != 0, tot.to(tl.float64), cnt.to(tl.float64))
            jb = tl.max(tl.where(f >= target, w, 0), axis=0)
            new_lo = tl.sum(tl.where(w == jb, c, 0), axis=0)
            hi = tl.where(jb < WAYS - 1, tl.sum(tl.where(w == jb + 1, c, 0), axis=0) - 1, hi)
            lo = new_lo
    return lo


@triton.jit
def _largest_pack(P, W, row, slot, ids, m, s, key_lo, target, use_mass, NBLK,
                  ITA: tl.constexpr, ITB: tl.constexpr, SB: tl.constexpr, DB: tl.constexpr,
                  WAYS: tl.constexpr, FL: tl.constexpr):  # fmt: skip
    """The largest pack v with F(v) >= target: its key bits, then its id bits (ids < V,
    so the low word of a live pack is at least 2**32 - V)."""
    key = _search(P, W, row, slot, ids, m, s, key_lo, tl.zeros([], tl.int64), 1, target,
                  use_mass, NBLK, ITA, SB, DB, WAYS, FL)  # fmt: skip
    lo = (key << 32) | (tl.full([], 4294967296, tl.int64) - P.vocab)
    return _search(P, W, row, slot, ids, m, s, lo, (key << 32) | 4294967295, 0, target,
                   use_mass, NBLK, ITB, SB, DB, WAYS, FL)  # fmt: skip


@triton.jit
def exact_cut(P, W, row, slot, ids, m, s, y_lo, top_k, top_p, lnmp, total, NBLK,
              ITA: tl.constexpr, ITB: tl.constexpr, SB: tl.constexpr, DB: tl.constexpr,
              WAYS: tl.constexpr, FL: tl.constexpr):  # fmt: skip
    """C of the module docstring for a filtered row without +inf (y_lo <= every live y);
    writes the kept blocks' masses K_b of every block."""
    key_lo = okey(y_lo).to(tl.int64)
    lowest = tl.zeros([WAYS], tl.int64) + (key_lo << 32)
    cnt, tot = _pass_ge(P, W, row, slot, ids, m, s, lowest, NBLK, DB, WAYS, SB, FL)
    n_live = tl.max(cnt, axis=0)
    all_mass = tl.max(tot, axis=0).to(tl.float64)
    cut = key_lo << 32
    t_p = total
    if top_k > 0:
        k = tl.minimum(top_k.to(tl.int64), n_live).to(tl.float64)
        cut = _largest_pack(P, W, row, slot, ids, m, s, key_lo, k, 0, NBLK, ITA, ITB, SB, DB,
                            WAYS, FL)  # fmt: skip
        cnt, tot = _pass_ge(P, W, row, slot, ids, m, s, tl.zeros([WAYS], tl.int64) + cut, NBLK,
                            DB, WAYS, SB, FL)  # fmt: skip
        t_p = tl.max(tot, axis=0).to(tl.float64)
    if top_p < 1.0:
        target = top_p.to(tl.float64) * t_p
        if all_mass >= target:
            cut_p = _largest_pack(P, W, row, slot, ids, m, s, key_lo, target, 1, NBLK, ITA,
                                  ITB, SB, DB, WAYS, FL)  # fmt: skip
            cut = tl.maximum(cut, cut_p)
    if lnmp > float("-inf"):
        cut = tl.maximum(cut, okey(lnmp).to(tl.int64) << 32)
    # the kept blocks' masses, every block (those below the cut's value hold none)
    y_cut = okey_to_float((cut >> 32).to(tl.int32))
    for b in range(0, NBLK):
        xmb = tl.load(W.xm + row * NBLK + b)
        ymb = tl.where(xmb > float("-inf"), (xmb - m) * s, float("-inf"))
        kb = tl.zeros([], dtype=tl.int64)
        if ymb >= y_cut:
            offs = b * DB + tl.arange(0, DB)
            x = tile_x(P, row, slot, ids, offs, b * DB, b * DB + DB, FL)
            y = (x - m) * s
            kept = (y > float("-inf")) & (pack(y, offs) >= cut) & (y >= lnmp)
            kb = sum_mass(kept, (x - xmb) * s, 0)
        tl.store(W.kept + row * NBLK + b, kb)
    return cut
