"""The row program's re-read: the candidates of a threshold, packed into a per-row buffer.

A filtered row (`rowdraw`, step 4) has a candidate threshold tau on its scaled values y;
the blocks whose max lies below tau hold no candidate and are not read again. `gather`
appends the tokens with tau <= y < tau_prev (tau_prev: the previous round's threshold, so
a lowered guess appends only what is new) as packed order keys (`select.pack`) and adds
their exact int64 mass. Keys land in an order that depends on the tiling, never on the
batch; everything that reads them (sort, band, integer sums) is order-independent.
"""

from __future__ import annotations

import triton
import triton.language as tl

from graphexec.sampling.triton.blocks import bias_tile, neg_zero, tile_x
from graphexec.sampling.triton.select import mass, pack, unpack


@triton.jit
def _load_blocks(
    logits_ptr, stride_lb, stride_lv, slot_ptr, rep_ptr, inv_rep_ptr, freq_ptr, pres_ptr,
    bitmask_ptr, stride_mb, stride_mw, counts_ptr, stride_cs, stride_cv,
    prompt_ptr, stride_ps, stride_pv, row, bid, has_bias, ids, ids_row, vals_row, B, V,
    HAS_BITMASK: tl.constexpr, HAS_COUNTS: tl.constexpr, HAS_PROMPT: tl.constexpr,
    BF16_BITS: tl.constexpr, GR: tl.constexpr, DB: tl.constexpr,
):  # fmt: skip
    """Processed x of the GR blocks bid, [GR, DB] (block ids past V read nothing). Only a
    row with a logit bias looks for its entries: `bias_tile`'s counts are reductions, and
    its loop runs over the entries up to the last block that holds tokens."""
    offs = bid[:, None] * DB + tl.arange(0, DB)[None, :]
    bias = neg_zero([GR, DB])
    if has_bias:
        last = tl.max(tl.where(bid * DB < V, bid, 0), axis=0)
        bias = bias_tile(ids, ids_row, vals_row, offs, tl.min(bid, axis=0) * DB,
                         (last + 1) * DB, bias)  # fmt: skip
    return tile_x(logits_ptr, stride_lb, stride_lv, slot_ptr, rep_ptr, inv_rep_ptr, freq_ptr,
                  pres_ptr, bitmask_ptr, stride_mb, stride_mw, counts_ptr, stride_cs, stride_cv,
                  prompt_ptr, stride_ps, stride_pv, row, offs, bias, B, V,
                  HAS_BITMASK, HAS_COUNTS, HAS_PROMPT, BF16_BITS)  # fmt: skip


@triton.jit
def tile_slots(sel):
    """Slots of the selected entries of a [R, N] tile, counted from 0 in row-major order
    (a per-row count, its exclusive scan, a scan inside each row), and their number. Where
    the slots start (a running count, an atomic add) is the caller's."""
    cnt = tl.sum(sel.to(tl.int32), axis=1)
    slots = (tl.cumsum(cnt, axis=0) - cnt)[:, None] + tl.cumsum(sel.to(tl.int32), axis=1) - 1
    return slots, tl.sum(cnt, axis=0)


@triton.jit
def _append(x, bid, bsel, tau, tau_prev, n, m, inv_t, cand_row, CAP: tl.constexpr,
            DB: tl.constexpr):  # fmt: skip
    """Append the tokens of x (the blocks bid where bsel) with tau <= y < tau_prev to the
    n candidates at cand_row (those past CAP are counted, not stored); returns the count."""
    offs = bid[:, None] * DB + tl.arange(0, DB)[None, :]
    y = (x - m) * inv_t
    sel = bsel[:, None] & (y >= tau) & (y < tau_prev) & (y > float("-inf"))
    slots, cnt = tile_slots(sel)
    idx = n + slots
    tl.store(cand_row + idx, pack(y, offs), mask=sel & (idx < CAP))
    return n + cnt


@triton.jit
def _keys_mass(cand_row, lo, hi, CH: tl.constexpr):
    """Exact int64 mass of the packed candidate keys [lo, hi)."""
    qs = tl.zeros([], dtype=tl.int64)
    for start in range(lo, hi, CH):
        c = start + tl.arange(0, CH)
        y, ids_unused = unpack(tl.load(cand_row + c, mask=c < hi, other=-9223372036854775808))
        qs += tl.sum(tl.where(c < hi, mass(y, 0.0), 0), axis=0)
    return qs


@triton.jit
def gather(
    logits_ptr, stride_lb, stride_lv, slot_ptr, rep_ptr, inv_rep_ptr, freq_ptr, pres_ptr,
    bitmask_ptr, stride_mb, stride_mw, counts_ptr, stride_cs, stride_cv,
    prompt_ptr, stride_ps, stride_pv, row,
    yb, tau, tau_prev, n, qs, m, inv_t, ids, ids_row, vals_row, xm_row, cblk_row, cand_row,
    B, V, NBLK,
    HAS_BITMASK: tl.constexpr, HAS_COUNTS: tl.constexpr, HAS_PROMPT: tl.constexpr,
    BF16_BITS: tl.constexpr, NBLK_P2: tl.constexpr, GR: tl.constexpr, DB: tl.constexpr,
    CAP: tl.constexpr, DENSE_DIV: tl.constexpr, CH: tl.constexpr,
):  # fmt: skip
    """Append the tokens with tau <= y < tau_prev to the candidates (n so far, their
    exact mass qs); reads the blocks with ym_b >= tau, GR at a time: from a packed list of
    them when they are few, else every block in block order with the others masked off
    (no load waits on a loaded block id or block max: a flat row's blocks stream). The
    mass is summed afterwards over the appended keys: per tile it cost an exp, a 64-bit
    conversion and a 64-bit reduction of every token read. With the streamed loads and
    no bias counts, a flat row's round went from 123 to 85 us on an H100."""
    b = tl.arange(0, NBLK_P2)
    sel_b = (b < NBLK) & (yb >= tau) & (yb > float("-inf"))
    nbc = tl.sum(sel_b.to(tl.int32), axis=0)
    # every block read holds a candidate at least: more blocks than CAP cannot fit
    if nbc > CAP:
        n = CAP + 1
        nbc = 0
    n0 = n
    has_bias = tl.max(ids, axis=0) >= 0
    g = tl.arange(0, GR)
    if nbc * DENSE_DIV > NBLK:
        for start in range(0, NBLK, GR):
            bid = start + g
            x = _load_blocks(logits_ptr, stride_lb, stride_lv, slot_ptr, rep_ptr, inv_rep_ptr,
                             freq_ptr, pres_ptr, bitmask_ptr, stride_mb, stride_mw, counts_ptr,
                             stride_cs, stride_cv, prompt_ptr, stride_ps, stride_pv, row, bid,
                             has_bias, ids, ids_row, vals_row, B, V, HAS_BITMASK, HAS_COUNTS,
                             HAS_PROMPT, BF16_BITS, GR, DB)  # fmt: skip
            xmb = tl.load(xm_row + bid, mask=bid < NBLK, other=float("-inf"))
            ybt = tl.where(xmb > float("-inf"), (xmb - m) * inv_t, float("-inf"))
            bsel = (bid < NBLK) & (ybt >= tau) & (ybt > float("-inf"))
            n = _append(x, bid, bsel, tau, tau_prev, n, m, inv_t, cand_row, CAP, DB)
    else:
        tl.debug_barrier()  # an earlier round may still be reading the block list
        tl.store(cblk_row + tl.cumsum(sel_b.to(tl.int32), axis=0) - 1, b, mask=sel_b)
        tl.debug_barrier()
        for i in range(0, nbc, GR):
            jj = i + g
            bid = tl.load(cblk_row + jj, mask=jj < nbc, other=NBLK)  # block NBLK: past V
            x = _load_blocks(logits_ptr, stride_lb, stride_lv, slot_ptr, rep_ptr, inv_rep_ptr,
                             freq_ptr, pres_ptr, bitmask_ptr, stride_mb, stride_mw, counts_ptr,
                             stride_cs, stride_cv, prompt_ptr, stride_ps, stride_pv, row, bid,
                             has_bias, ids, ids_row, vals_row, B, V, HAS_BITMASK, HAS_COUNTS,
                             HAS_PROMPT, BF16_BITS, GR, DB)  # fmt: skip
            n = _append(x, bid, jj < nbc, tau, tau_prev, n, m, inv_t, cand_row, CAP, DB)
    tl.debug_barrier()  # the keys were stored by other threads
    qs += _keys_mass(cand_row, n0, tl.minimum(n, CAP), CH)
    return n, qs
