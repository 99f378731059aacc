"""The draw itself, shared by every route's last step (`reference`, step 6).

A row's kept set (terms: the package docstring; m the row max, s = 1/T) is a few
scalars, evaluated per token by `kept_mask`:

    bins      j(y) = min(floor((top - y) * inv_w * FINE), NBINS * FINE - 1) for y <=
              top, -1 above it: fine bins, FINE to a bin of the selection histogram
              (`select`; its bin is j // FINE, exactly, since scaling by a power of two
              is exact); inv_w = 0 puts every token up to top in bin 0. Round 1 has top
              = 0 (every y <= 0); round 2 bins a narrower range below a top < 0
    regions   of the live tokens with y >= lo: above (j < jhi), bracket 1 (jhi..j1),
              middle (j1 < j < j2), bracket 2 (j2..jlo), in fine bins; tokens
              below are never kept
    kept      y >= log_min_p and: above, or middle where midk, or a bracket token whose
              pack is >= cut (cut: the pack of the last kept bracket token)

Every route's kept set takes this form: no filter (all above), min-p alone (above, y >=
log_min_p), ties and the exact search (all bracket 1), the selection (`kept`).
"""

from __future__ import annotations

import triton
import triton.language as tl

from graphexec.rng import Stream
from graphexec.sampling.triton import sampler_config as cf
from graphexec.sampling.triton.keys import (
    INT32_MAX,
    PAD_KEY,
    collapse_inf,
    first_argmax,
    pack,
    unpack,
)
from graphexec.sampling.triton.philox import block_bits, gumbel, token_bits
from graphexec.sampling.triton.process import tile_x

FLT_MAX = tl.constexpr(3.4028234663852886e38)
FINE = tl.constexpr(32)  # fine bins to a histogram bin: where the bracket's bounds lie
TOKEN = tl.constexpr(int(Stream.TOKEN))
BLOCK = tl.constexpr(int(Stream.BLOCK))
FALLBACK_TOKEN = tl.constexpr(int(Stream.FALLBACK_TOKEN))
FALLBACK_BLOCK = tl.constexpr(int(Stream.FALLBACK_BLOCK))


@triton.jit
def block_y(xm, m, s, has_inf):
    """ym: the block maxes of y (-inf for dead blocks); +inf rows: 0 where a block holds
    +inf (the collapsed row), -inf elsewhere."""
    fin = tl.where(xm > float("-inf"), (xm - m) * s, float("-inf"))
    return tl.where(has_inf, tl.where(xm == float("inf"), 0.0, float("-inf")), fin)


@triton.jit
def row_blocks(W, row, s, NBLK, NBLK_P2: tl.constexpr):
    """(xm, row max, whether it is +inf, m, ym, Q_b) of a row from its block stats: m the
    max where finite (else 0), ym the block maxes of y, Q_b 0 in dead blocks."""
    b = tl.arange(0, NBLK_P2)
    xm = tl.load(W.xm + row * NBLK + b, mask=b < NBLK, other=float("-inf"), cache_modifier=".cg")
    mx = tl.max(xm, axis=0)
    has_inf = mx == float("inf")
    m = tl.where((mx > float("-inf")) & (has_inf == 0), mx, 0.0)
    ym = block_y(xm, m, s, has_inf)
    q = tl.load(W.q + row * NBLK + b, mask=b < NBLK, other=0, cache_modifier=".cg")
    return xm, mx, has_inf, m, ym, tl.where(ym > float("-inf"), q, 0)


@triton.jit
def bin_of(y, top, inv_w, NBINS: tl.constexpr):
    """j(y) in fine bins (FINE to a histogram bin): monotone (non-increasing) in y, since
    rounding is, so {j < J} is a prefix of the row's order; -1 above top; dead tokens land
    in the last (callers mask them)."""
    last: tl.constexpr = NBINS * FINE - 1.0
    f = tl.where(y > float("-inf"), ((top - y) * inv_w) * FINE, last)
    return tl.where(y > top, -1, tl.minimum(f, last).to(tl.int32))


@triton.jit
def kept_mask(y, pk, lo, top, inv_w, jhi, j1, j2, jlo, cut, midk, lnmp, NBINS: tl.constexpr):
    """Whether each token (values y, packs pk) is in the row's kept set (module docstring)."""
    j = bin_of(y, top, inv_w, NBINS)
    inr = (y > float("-inf")) & (y >= lo)
    above = inr & (j < jhi)
    mid = inr & (j > j1) & (j < j2)
    brk = inr & (((j >= jhi) & (j <= j1)) | ((j >= j2) & (j <= jlo)))
    return (y >= lnmp) & (above | (mid & (midk != 0)) | (brk & (pk >= cut)))


@triton.jit
def two_level_draw(P, row, slot, ids, ym, kv, m, s, has_inf, seed, pos, lo, top, inv_w, jhi, j1,
                   j2, jlo, cut, midk, lnmp, NBLK, NBLK_P2: tl.constexpr, DB: tl.constexpr,
                   NBINS: tl.constexpr, FL: tl.constexpr, BS: tl.constexpr = BLOCK,
                   TS: tl.constexpr = TOKEN, gb=None):  # fmt: skip
    """Step 6's draw: a block by L_b = ym_b + log(K_b) plus block noise (stream BS; gb:
    that noise, `block_noise`, when the caller drew it already), then the kept token of
    that block with the largest y plus token noise (stream TS; ties to the lower id). ym,
    kv: [NBLK_P2] block maxes of y and K_b (0 where nothing is kept). Returns (token, its y)."""
    b = tl.arange(0, NBLK_P2)
    lm = tl.where(kv > 0, ym + tl.log(kv.to(tl.float32)), float("-inf"))
    if gb is None:
        gb = block_noise(seed, pos, NBLK_P2, BS)
    key = tl.where(b < NBLK, lm + gb, float("-inf"))
    best_key, bstar = first_argmax(key, b, NBLK_P2)
    start = bstar * DB
    offs = start + tl.arange(0, DB)
    x = collapse_inf(tile_x(P, row, slot, ids, offs, start, start + DB, FL), has_inf)
    y = (x - m) * s
    kept = kept_mask(y, pack(y, offs), lo, top, inv_w, jhi, j1, j2, jlo, cut, midk, lnmp, NBINS)
    # `token_bits`, where they are used: no interleave moves words while the load is in flight
    sc = tl.where(kept, y + gumbel(token_bits(seed, pos, offs, TS)), float("-inf"))
    best, tok = first_argmax(sc, offs, INT32_MAX)
    return tok, tl.max(tl.where(offs == tok, y, float("-inf")), axis=0)


@triton.jit
def block_noise(seed, pos, NBLK_P2: tl.constexpr, BS: tl.constexpr = BLOCK):
    """[NBLK_P2] a row's block noise on stream BS: a function of its seed and position
    alone, so a row kernel draws the candidate's before it waits for the stats pass."""
    return gumbel(block_bits(seed, pos, 0, NBLK_P2, BS))


@triton.jit
def candidate_draw(P, row, slot, ids, ym, q, m, s, has_inf, seed, pos, NBLK,
                   NBLK_P2: tl.constexpr, DB: tl.constexpr, FL: tl.constexpr,
                   gb=None):  # fmt: skip
    """A row's candidate: `two_level_draw` over every live token (K_b = Q_b, all "above":
    bin 0 < jhi = 1), streams TOKEN and BLOCK (gb: its block noise, when drawn already);
    the whole draw of a row without filters. Returns (token, its y)."""
    return two_level_draw(P, row, slot, ids, ym, q, m, s, has_inf, seed, pos, -FLT_MAX, 0.0, 0.0,
                          1, 0, 1, 0, 0, 0, float("-inf"), NBLK, NBLK_P2, DB, 1, FL, BLOCK, TOKEN,
                          gb)  # fmt: skip


@triton.jit
def candidate_kept(W, row, lo, top, inv_w, jhi, j1, j2, jlo, cut, midk, lnmp,
                   NBINS: tl.constexpr):  # fmt: skip
    """(candidate, whether the row's kept set holds it) of a filtered row: W.rowi's I_CAND
    (-1 once the candidate was known to be out: never kept) tested by `kept_mask`."""
    cand = tl.load(W.rowi + row * cf.NUM_I + cf.I_CAND).to(tl.int32)
    yc = tl.load(W.rowf + row * 8 + cf.F_YC)
    keep = kept_mask(yc, pack(yc, tl.maximum(cand, 0)), lo, top, inv_w, jhi, j1, j2, jlo, cut,
                     midk, lnmp, NBINS)  # fmt: skip
    return cand, (cand >= 0) & keep


@triton.jit
def fallback_draw(P, W, row, slot, ids, ym, kv, m, s, seed, pos, lo, top, inv_w, jhi, j1, j2,
                  jlo, cut, midk, lnmp, NBLK, NBLK_P2: tl.constexpr, DB: tl.constexpr,
                  NBINS: tl.constexpr, FL: tl.constexpr):  # fmt: skip
    """The token of a filtered row once its kept set is known (the arguments of
    `two_level_draw`): its candidate where the set holds it, else the fallback draw over it."""
    tok, keep = candidate_kept(W, row, lo, top, inv_w, jhi, j1, j2, jlo, cut, midk, lnmp, NBINS)
    if keep == 0:
        tok, y_unused = two_level_draw(P, row, slot, ids, ym, kv, m, s, False, seed, pos, lo, top,
                                       inv_w, jhi, j1, j2, jlo, cut, midk, lnmp, NBLK, NBLK_P2,
                                       DB, NBINS, FL, FALLBACK_BLOCK, FALLBACK_TOKEN)  # fmt: skip
    return tok


@triton.jit
def cut_fallback(P, W, row, slot, ids, ym, rd, m, s, seed, pos, cut, lnmp, NBLK,
                 NBLK_P2: tl.constexpr, DB: tl.constexpr, FL: tl.constexpr):  # fmt: skip
    """`fallback_draw` of a kept set given by its cut alone (pack >= cut, y >= lnmp: every
    live token in bracket 1), its K_b in W.kept over the blocks rd ([NBLK_P2] bool)."""
    b = tl.arange(0, NBLK_P2)
    kv = tl.load(W.kept + row * NBLK + b, mask=rd, other=0, cache_modifier=".cg")
    return fallback_draw(P, W, row, slot, ids, ym, kv, m, s, seed, pos, -FLT_MAX, 0.0, 0.0, 0,
                         1 << 30, (1 << 30) + 1, 1 << 30, cut, 0, lnmp, NBLK, NBLK_P2, DB, 1,
                         FL)  # fmt: skip


@triton.jit
def gathered_fallback(W, row, n, cut, lnmp, m, s, seed, pos, NBLK, DB: tl.constexpr,
                      ST: tl.constexpr, WCAP: tl.constexpr):  # fmt: skip
    """`fallback_draw` of a row whose n <= ST gathered candidates (W.gath) hold its whole
    kept set (packs >= cut, y >= lnmp; their K_b in W.kept): the same two-level draw, each
    block's key and each token's noise taken at the gathered tokens themselves, so no
    block of the row is read again and only ST tokens' noise is drawn."""
    tok, keep = candidate_kept(W, row, -FLT_MAX, 0.0, 0.0, 0, 1 << 30, (1 << 30) + 1, 1 << 30,
                               cut, 0, lnmp, 1)  # fmt: skip
    if keep == 0:
        c = tl.arange(0, ST)
        keys = tl.load(W.gath + row * WCAP + c, mask=c < n, other=PAD_KEY)
        y, ids = unpack(keys)
        kept = (c < n) & (keys >= cut) & (y >= lnmp)
        b = ids // DB
        kv = tl.load(W.kept + row * NBLK + b, mask=kept, other=0, cache_modifier=".cg")
        xm = tl.load(W.xm + row * NBLK + b, mask=kept, other=float("-inf"))
        lm = tl.where(kv > 0, block_y(xm, m, s, False) + tl.log(kv.to(tl.float32)),
                      float("-inf"))  # fmt: skip
        key = tl.where(kept, lm + gumbel(token_bits(seed, pos, b, FALLBACK_BLOCK)),
                       float("-inf"))  # fmt: skip
        best_unused, bstar = first_argmax(key, tl.where(kept, b, INT32_MAX), INT32_MAX)
        sc = tl.where(kept & (b == bstar), y + gumbel(token_bits(seed, pos, ids, FALLBACK_TOKEN)),
                      float("-inf"))  # fmt: skip
        top_unused, tok = first_argmax(sc, ids, INT32_MAX)
    return tok


@triton.jit
def greedy_token(P, row, slot, ids, xm, mx, NBLK_P2: tl.constexpr, DB: tl.constexpr,
                 FL: tl.constexpr):  # fmt: skip
    """The first token with x == mx (the row max): the first block whose max it is,
    read again (+inf rows: the first +inf)."""
    b = tl.arange(0, NBLK_P2)
    gb = tl.min(tl.where(xm == mx, b, NBLK_P2), axis=0)
    offs = gb * DB + tl.arange(0, DB)
    x = tile_x(P, row, slot, ids, offs, gb * DB, gb * DB + DB, FL)
    return tl.min(tl.where(x == mx, offs, INT32_MAX), axis=0)


@triton.jit
def ties_draw(P, row, slot, ids, mx, ym, q, top_k, top_p, total, seed, pos, NBLK,
              NBLK_P2: tl.constexpr, DB: tl.constexpr, FL: tl.constexpr,
              gb=None):  # fmt: skip
    """A filtered row whose live tokens all share one value (+inf rows included): each
    weighs 2**32, so the kept set is the first L live ids, L from integer arithmetic
    (`reference`, step 5, with every q equal); its candidate where it is one of them, else
    the fallback draw over them."""
    b = tl.arange(0, NBLK_P2)
    n_b = q >> 32
    n_live = tl.sum(n_b, axis=0)
    L = tl.where((top_k > 0) & (top_k < n_live), top_k.to(tl.int64), n_live)
    if top_p < 1.0:
        t = tl.where(top_k > 0, L.to(tl.float64) * 4294967296.0, total)
        L = tl.minimum(L, tl.math.ceil(top_p.to(tl.float64) * t / 4294967296.0).to(tl.int64))
    cum = tl.cumsum(n_b, axis=0)
    bl = tl.min(tl.where(cum >= L, b, NBLK_P2), axis=0)
    need = L - tl.sum(tl.where(b == bl - 1, cum, 0), axis=0)
    offs = bl * DB + tl.arange(0, DB)
    live = tile_x(P, row, slot, ids, offs, bl * DB, bl * DB + DB, FL) == mx
    rank = tl.cumsum(live.to(tl.int64), axis=0)
    last = tl.min(tl.where(live & (rank == need), offs, DB * NBLK_P2), axis=0)
    kv = tl.where(b < bl, q, tl.where(b == bl, need << 32, 0))
    cut = pack(tl.zeros([], dtype=tl.float32), last)
    m = tl.where(mx == float("inf"), 0.0, mx)
    # the candidate (every live token), kept when it is one of the first L live ids
    tok, y_unused = candidate_draw(P, row, slot, ids, ym, q, m, 1.0, mx == float("inf"), seed,
                                   pos, NBLK, NBLK_P2, DB, FL, gb)  # fmt: skip
    if tok > last:
        tok, y_unused = two_level_draw(P, row, slot, ids, ym, kv, m, 1.0, mx == float("inf"),
                                       seed, pos, -FLT_MAX, 0.0, 0.0, 0, 1 << 30, (1 << 30) + 1,
                                       1 << 30, cut, 0, float("-inf"), NBLK, NBLK_P2, DB, 1, FL,
                                       FALLBACK_BLOCK, FALLBACK_TOKEN)  # fmt: skip
    return tok
