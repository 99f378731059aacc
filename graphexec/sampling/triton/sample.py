"""The draw: filters (top-k, top-p, min-p) and Gumbel-max over processed logits.

Two kernels compute the same function (`graphexec.sampling.reference`, steps 3-5):

- `_sample_tile_kernel`, for V <= TILE_V: a program holds BLOCK_R whole rows in registers,
  sorts them by (value desc, id asc) and filters the sorted tile.
- `_sample_row_kernel`, for larger V: one program per row, in passes over the row:
    1. max, first argmax (greedy) and, for rows without filters, the Gumbel-max draw;
       if the row holds +inf, the draw is redone over the collapsed row;
    2. filtered rows: find a threshold tau = max - delta whose candidates {x >= tau}
       contain the kept set and number at most CAP (delta bisected, a pass per try);
       gather them, sort, filter and draw (noise only for the candidates);
    3. a row no delta serves (k > CAP, flat top-p, huge ties) takes the exact slow path:
       bisection over the 32-bit order key for the kept prefix's last element, then one
       pass drawing over the prefix.
Every per-row computation runs in a fixed order that depends on V and the block size only,
never on the batch: that is what keeps a request's token batch-invariant.
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
    unpack,
)

INT32_MAX = tl.constexpr(2147483647)


@triton.jit
def _sample_tile_kernel(
    x_ptr,  # [B, V] f32 processed logits
    stride_x,
    slot_ptr,  # [B] i64
    pos_ptr,  # [B] i64
    temp_ptr,  # [S] f32
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
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < B
    cols = tl.arange(0, BLOCK_V)
    slot = tl.load(slot_ptr + rows, mask=rmask, other=0)
    pos1 = tl.load(pos_ptr + rows, mask=rmask, other=0)
    seed1 = tl.load(seed_ptr + slot, mask=rmask, other=0)
    pos, seed = pos1[:, None], seed1[:, None]
    greedy = (tl.load(temp_ptr + slot, mask=rmask, other=1.0) == 0.0)[:, None]
    mask = rmask[:, None] & (cols[None, :] < V)
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=float("-inf"))
    has_inf = tl.max(x, axis=1)[:, None] == float("inf")
    x = collapse_inf(x, has_inf)
    m = tl.max(x, axis=1)[:, None]
    ids = cols[None, :] + tl.zeros([BLOCK_R, BLOCK_V], dtype=tl.int32)
    argmax = tl.min(tl.where(x == m, ids, INT32_MAX), axis=1)
    if FILTERS:
        top_k = tl.load(top_k_ptr + slot, mask=rmask, other=0)[:, None]
        top_p = tl.load(top_p_ptr + slot, mask=rmask, other=1.0)[:, None]
        min_p = tl.load(min_p_ptr + slot, mask=rmask, other=0.0)[:, None]
        qtot = tl.sum(mass(x, m), axis=1)[:, None]
        keys = tl.sort(tl.where(mask, pack(x, ids), -9223372036854775808), dim=1, descending=True)
        vals, sids = unpack(keys)
        tok, best = filter_sorted_draw(vals, sids, m, top_k, top_p, min_p, qtot, seed, pos, STREAM)
    else:
        g = gumbel(tile_bits(seed1, pos1, 0, BLOCK_R, BLOCK_V, STREAM))
        score = x + g
        best = tl.max(score, axis=1)
        tok = tl.min(tl.where(score == best[:, None], ids, INT32_MAX), axis=1)
    valid = m.reshape(BLOCK_R) > float("-inf")
    tok = tl.where(greedy.reshape(BLOCK_R), argmax, tok)
    tok = tl.where(valid, tok, -1)
    tl.store(tok_ptr + rows, tok.to(tl.int64), mask=rmask)
    tl.store(valid_ptr + rows, valid, mask=rmask)


@triton.jit
def _count_key(xrow, V, has_inf, t, m, BLOCK: tl.constexpr):
    """(#(okey > t), mass of okey > t, #(okey == t), the fp32 value of key t's entries)."""
    n_gt = tl.zeros([], dtype=tl.int32)
    q_gt = tl.zeros([], dtype=tl.int64)
    n_eq = tl.zeros([], dtype=tl.int32)
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = collapse_inf(tl.load(xrow + offs, mask=offs < V, other=float("-inf")), has_inf)
        k = okey(x)
        live = (x > float("-inf")) & (offs < V)
        n_gt += tl.sum((live & (k > t)).to(tl.int32))
        q_gt += tl.sum(tl.where(live & (k > t), mass(x, m), 0))
        n_eq += tl.sum((live & (k == t)).to(tl.int32))
    return n_gt, q_gt, n_eq


@triton.jit
def _key_at(xrow, V, has_inf, j, lo, hi, BLOCK: tl.constexpr):
    """Order key of the element at sorted position j: the largest t with #(okey >= t) > j.

    lo / hi: int64 bounds with #(okey >= lo) > j (holds for the smallest finite key)."""
    for _ in range(33):
        if lo < hi:
            mid = lo + (hi - lo + 1) // 2
            cnt = tl.zeros([], dtype=tl.int32)
            for start in range(0, V, BLOCK):
                offs = start + tl.arange(0, BLOCK)
                x = collapse_inf(tl.load(xrow + offs, mask=offs < V, other=float("-inf")), has_inf)
                live = x > float("-inf")
                cnt += tl.sum((live & (okey(x).to(tl.int64) >= mid)).to(tl.int32))
            if cnt > j:
                lo = mid
            else:
                hi = mid - 1
    return lo.to(tl.int32)


@triton.jit
def _mass_key(xrow, V, has_inf, m, target, lo, hi, BLOCK: tl.constexpr):
    """The largest key t with mass(okey >= t) >= target (float64 target)."""
    for _ in range(33):
        if lo < hi:
            mid = lo + (hi - lo + 1) // 2
            qs = tl.zeros([], dtype=tl.int64)
            for start in range(0, V, BLOCK):
                offs = start + tl.arange(0, BLOCK)
                x = collapse_inf(tl.load(xrow + offs, mask=offs < V, other=float("-inf")), has_inf)
                live = x > float("-inf")
                qs += tl.sum(tl.where(live & (okey(x).to(tl.int64) >= mid), mass(x, m), 0))
            if qs.to(tl.float64) >= target:
                lo = mid
            else:
                hi = mid - 1
    return lo.to(tl.int32)


@triton.jit
def _draw_pass(xrow, V, has_inf, seed, pos, t_star, r_star, BLOCK: tl.constexpr, STREAM: tl.constexpr):
    """Gumbel-max over the prefix (okey > t_star) plus the first r_star ties at t_star."""
    best = tl.full([], float("-inf"), tl.float32)
    bi = tl.full([], -1, tl.int32)
    seen_eq = tl.zeros([], dtype=tl.int32)
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = collapse_inf(tl.load(xrow + offs, mask=offs < V, other=float("-inf")), has_inf)
        k = okey(x)
        live = x > float("-inf")
        eq = live & (k == t_star)
        tie_rank = seen_eq + tl.cumsum(eq.to(tl.int32), axis=0) - 1
        kept = live & ((k > t_star) | (eq & (tie_rank < r_star)))
        seen_eq += tl.sum(eq.to(tl.int32))
        s = tl.where(kept, x + gumbel(block_bits(seed, pos, start, BLOCK, STREAM)), float("-inf"))
        cs = tl.max(s, axis=0)
        ci = tl.min(tl.where(s == cs, offs, INT32_MAX), axis=0)
        bi = tl.where(cs > best, ci, bi)
        best = tl.maximum(best, cs)
    return bi


@triton.jit
def _exact_prefix_draw(xrow, V, has_inf, m, n_fin, nm, qt, top_k, top_p, min_p, seed, pos,
                       BLOCK: tl.constexpr, STREAM: tl.constexpr):
    """The slow exact path: locate the kept prefix by bisection over order keys, then draw."""
    lo = okey(tl.full([], float("-inf"), tl.float32)).to(tl.int64) + 1
    hi = okey(m).to(tl.int64)
    L_k = tl.where((top_k > 0) & (top_k < n_fin), top_k, n_fin)
    L_m = tl.where(min_p > 0.0, nm, n_fin)
    L_p = n_fin
    if top_p < 1.0:
        total = qt
        if L_k < n_fin:
            t_k = _key_at(xrow, V, has_inf, L_k - 1, lo, hi, BLOCK)
            n_gt, q_gt, n_eq = _count_key(xrow, V, has_inf, t_k, m, BLOCK)
            q_tk = mass(okey_to_float(t_k), m)
            total = q_gt + (L_k - n_gt).to(tl.int64) * q_tk
        target = top_p.to(tl.float64) * total.to(tl.float64)
        t_p = _mass_key(xrow, V, has_inf, m, target, lo, hi, BLOCK)
        n_gt_p, q_gt_p, n_eq_p = _count_key(xrow, V, has_inf, t_p, m, BLOCK)
        q_tp = mass(okey_to_float(t_p), m).to(tl.float64)
        base = q_gt_p.to(tl.float64)
        # ties at t_p are kept in id order while the mass before them stays below target
        c = tl.where(q_tp > 0, tl.math.ceil((target - base) / tl.maximum(q_tp, 1.0)), n_eq_p)
        c = tl.minimum(tl.maximum(c, 1.0), n_eq_p.to(tl.float64))
        c = tl.where((c > 1.0) & (base + (c - 1.0) * q_tp >= target), c - 1.0, c)
        c = tl.where((c < n_eq_p) & (base + c * q_tp < target), c + 1.0, c)
        L_p = n_gt_p + c.to(tl.int32)
    L = tl.minimum(tl.minimum(L_k, L_p), L_m)
    t_star = _key_at(xrow, V, has_inf, L - 1, lo, hi, BLOCK)
    n_gt_s, q_unused, n_eq_unused = _count_key(xrow, V, has_inf, t_star, m, BLOCK)
    return _draw_pass(xrow, V, has_inf, seed, pos, t_star, L - n_gt_s, BLOCK, STREAM)


@triton.jit
def _finish_kernel(
    x_ptr,  # [B, V] f32 processed logits
    slot_ptr, pos_ptr,  # [B] i64
    top_k_ptr, top_p_ptr, min_p_ptr, seed_ptr,  # [S] i32, f32, f32, i64
    stat_f_ptr, stat_i_ptr,  # [B, 1] f32 row max, [B, 2] i32 (has +inf, #finite)
    state_ptr,  # [B] i32: 0 = no threshold found (exact path), 1 = candidates, 2 = final
    qt_ptr, nm_ptr,  # [B] i64 whole-row mass, [B] i32 #(exp(x - m) >= min_p)
    cnt_ptr,  # [B] i32 candidates gathered
    cand_ptr,  # [B, CAP] i64 packed candidate keys
    tok_ptr,  # [B] i64 in/out
    V, CAP: tl.constexpr, BLOCK: tl.constexpr, STREAM: tl.constexpr,
):  # fmt: skip
    """Sort the candidates, filter and draw; rows without candidates take the exact path."""
    row = tl.program_id(0)
    r64 = row.to(tl.int64)
    state = tl.load(state_ptr + row)
    if state != 2:
        slot = tl.load(slot_ptr + row)
        pos = tl.load(pos_ptr + row)
        seed = tl.load(seed_ptr + slot)
        top_k = tl.load(top_k_ptr + slot)
        top_p = tl.load(top_p_ptr + slot)
        min_p = tl.load(min_p_ptr + slot)
        m = tl.load(stat_f_ptr + row)
        has_inf = tl.load(stat_i_ptr + r64 * 2) != 0
        n_fin = tl.load(stat_i_ptr + r64 * 2 + 1)
        qt = tl.load(qt_ptr + row)
        xrow = x_ptr + r64 * V
        if state == 1:
            c = tl.arange(0, CAP)
            n = tl.load(cnt_ptr + row)
            keys = tl.load(cand_ptr + r64 * CAP + c, mask=c < n, other=-9223372036854775808)
            keys = tl.sort(keys.reshape(1, CAP), dim=1, descending=True)
            vals, ids = unpack(keys)
            one = tl.zeros([1, 1], dtype=tl.int32)
            ftok, fbest = filter_sorted_draw(
                vals, ids, one + m, one + top_k, one + top_p, one + min_p, one + qt,
                one + seed, one + pos, STREAM,
            )  # fmt: skip
            tok = tl.sum(ftok, axis=0)
        else:
            nm = tl.load(nm_ptr + row)
            tok = _exact_prefix_draw(xrow, V, has_inf, m, n_fin, nm, qt, top_k, top_p, min_p,
                                     seed, pos, BLOCK, STREAM)
        tl.store(tok_ptr + row, tok.to(tl.int64))
