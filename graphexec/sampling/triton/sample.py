"""The draw: filters (top-k, top-p, min-p) and Gumbel-max over scaled logits.

Two routes compute the same function (`graphexec.sampling.reference`, steps 3-6):

- `_sample_tile_kernel`, for V <= TILE_V: a program holds BLOCK_R whole rows in registers,
  scales them (y = (x - max) / T), writes y back for the logprobs writer, sorts them by
  (value desc, id asc) and filters the sorted tile.
- for larger V, `rowdraw` sorts, filters and draws the gathered candidates of a row with
  `_sorted_draw`; rows no threshold serves (k above the live blocks, more candidates than
  CAP, a flat top-p, +inf) take the exact slow path, `_exact_prefix_draw`: bisection over
  the 32-bit order key for the last element of the kept prefix, then one pass drawing
  over the prefix.

Every per-row computation runs in an order fixed by V and the block size only, never by
the batch: that is what keeps a request's token batch-invariant. On the large-V route the
rows y are already scaled and +inf-collapsed, so their max is exactly 0.
"""

from __future__ import annotations

import triton
import triton.language as tl

from graphexec.sampling.triton.philox import block_bits, gumbel, tile_bits
from graphexec.sampling.triton.select import (
    collapse_inf,
    filter_sorted_draw,
    mass,
    okey,
    okey_to_float,
    pack,
    sort_desc,
    unpack,
)

INT32_MAX = tl.constexpr(2147483647)


@triton.jit
def _sample_tile_kernel(
    x_ptr,  # [B, V] f32 processed logits in; the scaled rows y out (in place)
    stride_x,
    slot_ptr,  # [B] i64
    pos_ptr,  # [B] i64
    temp_ptr, inv_temp_ptr,  # [S] f32
    top_k_ptr,  # [S] i32
    top_p_ptr,  # [S] f32
    min_p_ptr,  # [S] f32
    seed_ptr,  # [S] i64
    tok_ptr,  # [B] i64 out
    valid_ptr,  # [B] bool out
    B,
    V,
    FILTERS: tl.constexpr,
    STREAM: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_V: tl.constexpr,
    INTERP: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < B
    cols = tl.arange(0, BLOCK_V)
    slot = tl.load(slot_ptr + rows, mask=rmask, other=0)
    pos1 = tl.load(pos_ptr + rows, mask=rmask, other=0)
    seed1 = tl.load(seed_ptr + slot, mask=rmask, other=0)
    pos, seed = pos1[:, None], seed1[:, None]
    greedy = (tl.load(temp_ptr + slot, mask=rmask, other=1.0) == 0.0)[:, None]
    inv_t = tl.where(greedy, 1.0, tl.load(inv_temp_ptr + slot, mask=rmask, other=1.0)[:, None])
    mask = rmask[:, None] & (cols[None, :] < V)
    ptrs = x_ptr + rows.to(tl.int64)[:, None] * stride_x + cols[None, :]
    x = tl.load(ptrs, mask=mask, other=float("-inf"))
    has_inf = tl.max(x, axis=1)[:, None] == float("inf")
    x = collapse_inf(x, has_inf)
    m = tl.max(x, axis=1)[:, None]
    valid = m > float("-inf")
    y = (x - tl.where(valid, m, 0.0)) * inv_t
    tl.store(ptrs, y, mask=mask)
    ids = cols[None, :] + tl.zeros([BLOCK_R, BLOCK_V], dtype=tl.int32)
    argmax = tl.min(tl.where(x == m, ids, INT32_MAX), axis=1)
    if FILTERS:
        top_k = tl.load(top_k_ptr + slot, mask=rmask, other=0)[:, None]
        top_p = tl.load(top_p_ptr + slot, mask=rmask, other=1.0)[:, None]
        min_p = tl.load(min_p_ptr + slot, mask=rmask, other=0.0)[:, None]
        zero = tl.zeros([BLOCK_R, 1], dtype=tl.float32)
        # one block: the block total sum_b Q_b * exp(ym_b) is this exact sum
        qtot = tl.sum(mass(y, zero), axis=1)[:, None].to(tl.float64)
        keys = sort_desc(tl.where(mask, pack(y, ids), -9223372036854775808), INTERP)
        vals, sids = unpack(keys)
        tok, best = filter_sorted_draw(
            vals, sids, zero, top_k, top_p, min_p, qtot, seed, pos, STREAM
        )
    else:
        g = gumbel(tile_bits(seed1, pos1, 0, BLOCK_R, BLOCK_V, STREAM))
        score = y + g
        best = tl.max(score, axis=1)
        tok = tl.min(tl.where(score == best[:, None], ids, INT32_MAX), axis=1)
    valid = valid.reshape(BLOCK_R)
    tok = tl.where(greedy.reshape(BLOCK_R), argmax, tok)
    tok = tl.where(valid, tok, -1)
    tl.store(tok_ptr + rows, tok.to(tl.int64), mask=rmask)
    tl.store(valid_ptr + rows, valid, mask=rmask)


@triton.jit
def _load_row(yrow, offs, V):
    return tl.load(yrow + offs, mask=offs < V, other=float("-inf"))


@triton.jit
def _count_key(yrow, V, t, BLOCK: tl.constexpr):
    """(#(okey > t), mass of okey > t, #(okey == t)) over a scaled row."""
    n_gt = tl.zeros([], dtype=tl.int32)
    q_gt = tl.zeros([], dtype=tl.int64)
    n_eq = tl.zeros([], dtype=tl.int32)
    for start in range(0, V, BLOCK):
        y = _load_row(yrow, start + tl.arange(0, BLOCK), V)
        k = okey(y)
        live = y > float("-inf")
        n_gt += tl.sum((live & (k > t)).to(tl.int32))
        q_gt += tl.sum(tl.where(live & (k > t), mass(y, 0.0), 0))
        n_eq += tl.sum((live & (k == t)).to(tl.int32))
    return n_gt, q_gt, n_eq


@triton.jit
def _key_at(yrow, V, j, lo, hi, BLOCK: tl.constexpr):
    """Order key of the element at sorted position j: the largest t with #(okey >= t) > j.

    lo / hi: int64 bounds with #(okey >= lo) > j (true for the smallest finite key)."""
    for _ in range(33):
        if lo < hi:
            mid = lo + (hi - lo + 1) // 2
            cnt = tl.zeros([], dtype=tl.int32)
            for start in range(0, V, BLOCK):
                y = _load_row(yrow, start + tl.arange(0, BLOCK), V)
                live = y > float("-inf")
                cnt += tl.sum((live & (okey(y).to(tl.int64) >= mid)).to(tl.int32))
            if cnt > j:
                lo = mid
            else:
                hi = mid - 1
    return lo.to(tl.int32)


@triton.jit
def _mass_key(yrow, V, target, lo, hi, BLOCK: tl.constexpr):
    """The largest key t with mass(okey >= t) >= target (float64 target)."""
    for _ in range(33):
        if lo < hi:
            mid = lo + (hi - lo + 1) // 2
            qs = tl.zeros([], dtype=tl.int64)
            for start in range(0, V, BLOCK):
                y = _load_row(yrow, start + tl.arange(0, BLOCK), V)
                live = y > float("-inf")
                qs += tl.sum(tl.where(live & (okey(y).to(tl.int64) >= mid), mass(y, 0.0), 0))
            if qs.to(tl.float64) >= target:
                lo = mid
            else:
                hi = mid - 1
    return lo.to(tl.int32)


@triton.jit
def _draw_pass(yrow, V, seed, pos, t_star, r_star, BLOCK: tl.constexpr, STREAM: tl.constexpr):
    """Gumbel-max over the prefix (okey > t_star) plus the first r_star ties at t_star."""
    best = tl.full([], float("-inf"), tl.float32)
    bi = tl.full([], -1, tl.int32)
    seen_eq = tl.zeros([], dtype=tl.int32)
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        y = _load_row(yrow, offs, V)
        k = okey(y)
        live = y > float("-inf")
        eq = live & (k == t_star)
        tie_rank = seen_eq + tl.cumsum(eq.to(tl.int32), axis=0) - 1
        kept = live & ((k > t_star) | (eq & (tie_rank < r_star)))
        seen_eq += tl.sum(eq.to(tl.int32))
        s = tl.where(kept, y + gumbel(block_bits(seed, pos, start, BLOCK, STREAM)), float("-inf"))
        cs = tl.max(s, axis=0)
        ci = tl.min(tl.where(s == cs, offs, INT32_MAX), axis=0)
        bi = tl.where(cs > best, ci, bi)
        best = tl.maximum(best, cs)
    return bi


@triton.jit
def _exact_prefix_draw(yrow, V, n_fin, nm, row_total, top_k, top_p, min_p, seed, pos,
                       BLOCK: tl.constexpr, STREAM: tl.constexpr):  # fmt: skip
    """The slow exact path: locate the kept prefix by bisection over order keys, then draw.

    The kept set is the shortest of three prefixes of the sorted row: top-k's (L_k), top-p's
    on the top-k mass (L_p) and min-p's (L_m, a value threshold, so ties go in or out
    together)."""
    lo = okey(tl.full([], float("-inf"), tl.float32)).to(tl.int64) + 1
    hi = okey(tl.full([], 0.0, tl.float32)).to(tl.int64)
    L_k = tl.where((top_k > 0) & (top_k < n_fin), top_k, n_fin)
    L_m = tl.where(min_p > 0.0, nm, n_fin)
    L_p = n_fin
    if top_p < 1.0:
        total = row_total  # float64 (reference step 5) when top-k is off
        if top_k > 0:
            n_all, q_all, n_eq_all = _count_key(yrow, V, lo - 1, BLOCK)
            total = q_all.to(tl.float64)
        if L_k < n_fin:
            t_k = _key_at(yrow, V, L_k - 1, lo, hi, BLOCK)
            n_gt, q_gt, n_eq = _count_key(yrow, V, t_k, BLOCK)
            total = (q_gt + (L_k - n_gt).to(tl.int64) * mass(okey_to_float(t_k), 0.0)).to(
                tl.float64
            )
        target = top_p.to(tl.float64) * total
        t_p = _mass_key(yrow, V, target, lo, hi, BLOCK)
        n_gt_p, q_gt_p, n_eq_p = _count_key(yrow, V, t_p, BLOCK)
        q_tp = mass(okey_to_float(t_p), 0.0).to(tl.float64)
        base = q_gt_p.to(tl.float64)
        # ties at t_p are kept in id order while the mass before them stays below target;
        # the estimate is exact after one correction each way (integers below 2**53)
        c = tl.where(q_tp > 0, tl.math.ceil((target - base) / tl.maximum(q_tp, 1.0)), n_eq_p)
        c = tl.minimum(tl.maximum(c, 1.0), n_eq_p.to(tl.float64))
        c = tl.where((c > 1.0) & (base + (c - 1.0) * q_tp >= target), c - 1.0, c)
        c = tl.where((c < n_eq_p) & (base + c * q_tp < target), c + 1.0, c)
        L_p = n_gt_p + c.to(tl.int32)
    L = tl.minimum(tl.minimum(L_k, L_p), L_m)
    t_star = _key_at(yrow, V, L - 1, lo, hi, BLOCK)
    n_gt_s, q_unused, n_eq_unused = _count_key(yrow, V, t_star, BLOCK)
    return _draw_pass(yrow, V, seed, pos, t_star, L - n_gt_s, BLOCK, STREAM)


@triton.jit
def _sorted_draw(crow, n, top_k, top_p, min_p, total, seed, pos, W: tl.constexpr,
                 STREAM: tl.constexpr, INTERP: tl.constexpr):  # fmt: skip
    """Sort a row's n <= W packed candidate keys, filter them and draw (total: the
    float64 top-p total of a row with top-k off)."""
    c = tl.arange(0, W)
    keys = tl.load(crow + c, mask=c < n, other=-9223372036854775808)
    keys = sort_desc(keys.reshape(1, W), INTERP)
    vals, ids = unpack(keys)
    one = tl.zeros([1, 1], dtype=tl.int32)
    tok, best = filter_sorted_draw(
        vals, ids, one * 0.0, one + top_k, one + top_p, one + min_p, one + total, one + seed,
        one + pos, STREAM,
    )  # fmt: skip
    return tl.sum(tok, axis=0)
