"""The draw over many candidates without sorting them: top-p's cut found by value bands.

For a row with top-k off, the kept set is every candidate with exp(y) >= min_p that lies
before top-p's cut in the sorted order (value desc, id asc). The cut is the first element
at which the running mass reaches thresh = top_p * total (`reference`, step 5), so an
element is kept by top-p iff the mass sorted before it is below thresh. Terms:

    band   [a, b): values with M(y >= b) < thresh <= M(y >= a), M the exact int64 mass;
           every candidate >= b is before the cut, every candidate < a after it.
    above  the candidates with y >= b (all kept by top-p; their mass is `base`).

Steps: (1) narrow the band over the candidates, eight sub-bands per level, until it holds
at most W candidates; (2) one pass draws Gumbel-max over `above` and copies the band's
keys out; (3) the band is sorted (W wide, not the CAP-wide sort of all candidates) and
its elements are kept while base plus the mass before them is below thresh. The winner is
the larger score of (2) and (3), ties to the lower id: the same token as the sorted draw
over all candidates, since both apply the same per-element tests and noise.

A band that stays wider than W (many equal values) returns -2: the caller sorts instead.
"""

from __future__ import annotations

import triton
import triton.language as tl

from graphexec.sampling.triton.philox import gather_bits, gumbel
from graphexec.sampling.triton.select import mass, sort_desc, unpack

INT32_MAX = tl.constexpr(2147483647)
LEVELS = tl.constexpr(6)  # each divides the band's width by 8


@triton.jit
def _narrow(crow, n, a, b, thresh, CH: tl.constexpr):
    """One level: the sub-band [t_J, t_J+1) of [a, b) cut in eight that holds the cut.
    Returns (a, b, #candidates in the new band)."""
    j = tl.arange(0, 8)
    t = a + (b - a) * j.to(tl.float32) / 8.0
    m_j = tl.zeros([8], dtype=tl.int64)
    c_j = tl.zeros([8], dtype=tl.int32)
    c_b = tl.zeros([], dtype=tl.int32)
    for start in range(0, n, CH):
        c = start + tl.arange(0, CH)
        keys = tl.load(crow + c, mask=c < n, other=-9223372036854775808)
        y, ids_unused = unpack(keys)
        ge = y[:, None] >= t[None, :]
        m_j += tl.sum(tl.where(ge, mass(y, 0.0)[:, None], 0), axis=0)
        c_j += tl.sum(ge.to(tl.int32), axis=0)
        c_b += tl.sum((y >= b).to(tl.int32), axis=0)
    # M(y >= t_j) falls with j and M(y >= t_0 = a) >= thresh: J is the last j that reaches it
    J = tl.maximum(tl.sum((m_j.to(tl.float64) >= thresh).to(tl.int32), axis=0) - 1, 0)
    a_new = tl.sum(tl.where(j == J, t, 0.0), axis=0)
    b_new = tl.where(J < 7, tl.sum(tl.where(j == J + 1, t, 0.0), axis=0), b)
    c_hi = tl.where(J < 7, tl.sum(tl.where(j == J + 1, c_j, 0), axis=0), c_b)
    return a_new, b_new, tl.sum(tl.where(j == J, c_j, 0), axis=0) - c_hi


@triton.jit
def band_draw(crow, brow, n, tau, qs, top_p, min_p, total, seed, pos, W: tl.constexpr,
              CH: tl.constexpr, STREAM: tl.constexpr, INTERP: tl.constexpr):  # fmt: skip
    """Token of a row with top-k off from its n packed candidate keys at crow: a prefix of
    the row's order that holds its kept set, every candidate >= tau, their mass qs.
    brow: W keys of scratch. Returns -2 where the band stays wider than W."""
    thresh = top_p.to(tl.float64) * total
    # every candidate is >= tau (or finite) and y <= 0 < 1: [lo, 1) holds all of them
    lo = tau
    if tau == float("-inf"):
        lo = tl.full([], 0.0, tl.float32)
        for start in range(0, n, CH):
            c = start + tl.arange(0, CH)
            y, ids_unused = unpack(tl.load(crow + c, mask=c < n, other=0))
            lo = tl.minimum(lo, tl.min(y, axis=0))
    a = lo
    b = tl.full([], 1.0, tl.float32)
    width = n
    # top-p off, or min-p's bound gathered less than thresh: top-p keeps every candidate
    if (top_p >= 1.0) | (qs.to(tl.float64) < thresh):
        a = tl.full([], float("-inf"), tl.float32)
        b = a
        width = tl.zeros([], dtype=tl.int32)
    for _ in range(LEVELS):
        if width > W:
            a, b, width = _narrow(crow, n, a, b, thresh, CH)
    tok = tl.full([], -2, tl.int32)
    if width <= W:
        best = tl.full([], float("-inf"), tl.float32)
        tok = tl.full([], -1, tl.int32)
        base = tl.zeros([], dtype=tl.int64)
        nb = tl.zeros([], dtype=tl.int32)
        for start in range(0, n, CH):
            c = start + tl.arange(0, CH)
            keys = tl.load(crow + c, mask=c < n, other=-9223372036854775808)
            y, ids = unpack(keys)
            above = (y >= b) & (y > float("-inf"))
            base += tl.sum(tl.where(above, mass(y, 0.0), 0), axis=0)
            in_band = (y >= a) & (y < b)
            idx = nb + tl.cumsum(in_band.to(tl.int32), axis=0) - 1
            tl.store(brow + idx, keys, mask=in_band)
            nb += tl.sum(in_band.to(tl.int32), axis=0)
            kept = above & (tl.exp(y) >= min_p)
            s = tl.where(kept, y + gumbel(gather_bits(seed, pos, ids, STREAM)), float("-inf"))
            cs = tl.max(s, axis=0)
            ci = tl.min(tl.where(s == cs, ids, INT32_MAX), axis=0)
            tok = tl.where((cs > best) | ((cs == best) & (cs > float("-inf")) & (ci < tok)),
                           ci, tok)  # fmt: skip
            best = tl.maximum(best, cs)
        tl.debug_barrier()
        w = tl.arange(0, W)
        keys = tl.load(brow + w, mask=w < nb, other=-9223372036854775808)
        vals, ids = unpack(sort_desc(keys.reshape(1, W), INTERP).reshape(W))
        rel = tl.exp(vals)
        q = tl.where(vals > float("-inf"), (rel * 4294967296.0).to(tl.int64), 0)
        before = base + tl.cumsum(q, axis=0) - q
        kept = (vals > float("-inf")) & (before.to(tl.float64) < thresh) & (rel >= min_p)
        s = tl.where(kept, vals + gumbel(gather_bits(seed, pos, ids, STREAM)), float("-inf"))
        cs = tl.max(s, axis=0)
        ci = tl.min(tl.where(s == cs, ids, INT32_MAX), axis=0)
        tok = tl.where((cs > best) | ((cs == best) & (cs > float("-inf")) & (ci < tok)), ci, tok)
    return tok
