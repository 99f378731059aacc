"""The first gather of top-p rows without top-k, split across programs.

The row program (`rowdraw`) needs its candidates: the tokens with y >= tau for the row's
first threshold tau. Read by the row's one program, a flat top-p row (candidates in most
blocks) took 85-125 us on an H100 whatever the batch: one program leaves its SM idle
most of the time. Here two launches between the block pass and the row program do it,
for the rows with top-p and no top-k (top-k and min-p rows have few candidate blocks:
their own program reads them sooner than two more launches), in batches up to
`launch.SPLIT_MAX_B` (128): their two launches add 3-5 us to a batch without such rows,
and save 20-85 us where one has them (H100; the numbers are there):

1. `_thresholds_kernel` (one program per row) computes the row's (cert, guess) from its
   block stats (`thresholds`) and stores them with tau = max(cert, guess - P_STEP) and the
   row max m; it sets the row's candidate counter to 0. Other rows (invalid, greedy,
   +inf, top-k on or top-p off) get tau = NaN: nothing compares true with it, so they
   read nothing. A row with more candidate blocks than GCAP (each holds one at least)
   counts GCAP + 1 candidates and reads nothing, as `gather` does.
2. `_split_gather_kernel` (B x SPLIT programs, each a slice of the row's blocks) reads
   the blocks of its slice with ym_b >= tau, packed GR to a tile, and appends the tokens
   with y >= tau to the row's buffer as packed keys (those past GCAP are counted, not
   stored). Each key's slot comes from the row's counter: one atomic add per tile and a
   scan inside it.

The keys land in an order that depends on the scheduling; everything that reads them
(the sorts, `band`, the exact integer mass sums) is order-independent, and the set and
its count are the same for any split. (cert, guess) are computed once per row, by code
that sees nothing of the batch: the same numbers in any batch, bucket or variant.
"""

from __future__ import annotations

import triton
import triton.language as tl

from graphexec.sampling.triton.blocks import row_scale
from graphexec.sampling.triton.gather import _load_blocks, tile_slots
from graphexec.sampling.triton.select import pack
from graphexec.sampling.triton.thresholds import block_y, candidate_thresholds


@triton.jit
def _thresholds_kernel(
    slot_ptr,  # [B] i64
    temp_ptr, inv_temp_ptr, top_k_ptr, top_p_ptr, min_p_ptr,  # [S] f32, f32, i32, f32, f32
    xm_ptr, q_ptr,  # [B, NBLK] f32, i64 block stats
    thr_ptr,  # [B, 4] f32 out: cert, guess, tau (NaN: no split gather), m
    cnt_ptr,  # [B] i32 out: 0, or GCAP + 1 for a row with too many candidate blocks
    NBLK,
    NBLK_P2: tl.constexpr, GCAP: tl.constexpr, P_STEP: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    r64 = row.to(tl.int64)
    slot, greedy, inv_t = row_scale(slot_ptr, temp_ptr, inv_temp_ptr, row)
    b = tl.arange(0, NBLK_P2)
    xm = tl.load(xm_ptr + r64 * NBLK + b, mask=b < NBLK, other=float("-inf"))
    q = tl.load(q_ptr + r64 * NBLK + b, mask=b < NBLK, other=0)
    mraw = tl.max(xm, axis=0)
    live = (mraw > float("-inf")) & (mraw < float("inf")) & (greedy == 0)
    m = tl.where(live, mraw, 0.0)
    top_k = tl.load(top_k_ptr + slot)
    top_p = tl.load(top_p_ptr + slot)
    min_p = tl.load(min_p_ptr + slot)
    live = live & (top_k == 0) & (top_p < 1.0)
    cert = tl.full([], float("-inf"), tl.float32)
    guess = tl.full([], float("-inf"), tl.float32)
    tau = tl.full([], float("nan"), tl.float32)
    n = tl.zeros([], dtype=tl.int32)
    if live:
        yb = block_y(xm, m, inv_t, NBLK, NBLK_P2)
        cert, guess = candidate_thresholds(yb, q, top_k, top_p, min_p, NBLK_P2)
        # without any threshold (k above the live blocks) every live token is one
        tau = tl.maximum(cert, guess - P_STEP)
        nbc = tl.sum(((yb >= tau) & (yb > float("-inf"))).to(tl.int32), axis=0)
        if nbc > GCAP:
            n = tl.full([], GCAP + 1, tl.int32)
            tau = tl.full([], float("nan"), tl.float32)
    tl.store(thr_ptr + 4 * r64, cert)
    tl.store(thr_ptr + 4 * r64 + 1, guess)
    tl.store(thr_ptr + 4 * r64 + 2, tau)
    tl.store(thr_ptr + 4 * r64 + 3, m)
    tl.store(cnt_ptr + row, n)


@triton.jit
def _append(cand_row, cnt_ptr, x, offs, bsel, m, inv_t, tau, GCAP: tl.constexpr):
    """Append the tokens of the tile x (token ids offs, [R, N]; blocks where bsel) with
    y >= tau to the row's keys: one atomic add for the tile's slots, a scan inside it."""
    y = (x - m) * inv_t
    sel = bsel & (y >= tau) & (y > float("-inf"))
    slots, tot = tile_slots(sel)
    if tot > 0:
        idx = tl.atomic_add(cnt_ptr, tot) + slots
        tl.store(cand_row + idx, pack(y, offs), mask=sel & (idx < GCAP))


@triton.jit(do_not_specialize=["B", "NB", "PER"])
def _split_gather_kernel(
    logits_ptr, stride_lb, stride_lv,  # [B, V] f32 / f16, or bf16 as i16 bits
    slot_ptr,  # [B] i64
    rep_ptr, inv_rep_ptr, freq_ptr, pres_ptr,  # [S] f32
    bitmask_ptr, stride_mb, stride_mw,  # [B, ceil(V/32)] i32
    counts_ptr, stride_cs, stride_cv,  # [S, V] i32
    prompt_ptr, stride_ps, stride_pv,  # [S, V] u8
    bias_ids_ptr, bias_val_ptr, stride_is, stride_vs,  # [S, NB] i32 (sorted, -1 pads), f32
    temp_ptr, inv_temp_ptr,  # [S] f32
    xm_ptr,  # [B, NBLK] f32 block maxes
    thr_ptr,  # [B, 4] f32 (`_thresholds_kernel`)
    cnt_ptr,  # [B] i32 in/out: candidates so far
    cand_ptr,  # [B, CAND_W] i64 out: packed candidate keys
    B, V, NB, NBLK, PER, CAND_W,
    HAS_BITMASK: tl.constexpr, HAS_COUNTS: tl.constexpr, HAS_PROMPT: tl.constexpr,
    BF16_BITS: tl.constexpr, NBIAS_P2: tl.constexpr, GR: tl.constexpr, DB: tl.constexpr,
    SLICE: tl.constexpr, GCAP: tl.constexpr,
):  # fmt: skip
    """Grid (B, SPLIT): program (row, sp) reads blocks [sp * PER, (sp + 1) * PER), PER at
    most SLICE. The slice's block maxes are loaded at once and its selected blocks packed
    GR to a tile (a one-hot reduction, no memory), so a row whose candidates lie in a few
    scattered blocks costs one tile per program, not one per block: each tile is a chain
    of two waits (its loads, then its slot's atomic add)."""
    row = tl.program_id(0)
    r64 = row.to(tl.int64)
    tau = tl.load(thr_ptr + 4 * r64 + 2)
    if tau == tau:  # not NaN
        m = tl.load(thr_ptr + 4 * r64 + 3)
        slot, greedy, inv_t = row_scale(slot_ptr, temp_ptr, inv_temp_ptr, row)
        cand_row = cand_ptr + r64 * CAND_W
        ids_row = bias_ids_ptr + slot * stride_is
        vals_row = bias_val_ptr + slot * stride_vs
        jb = tl.arange(0, NBIAS_P2)
        ids = tl.load(ids_row + jb, mask=jb < NB, other=-1)
        has_bias = tl.max(ids, axis=0) >= 0
        lo = tl.program_id(1) * PER
        bv = lo + tl.arange(0, SLICE)
        ok = (bv < NBLK) & (bv < lo + PER)
        xmv = tl.load(xm_ptr + r64 * NBLK + bv, mask=ok, other=float("-inf"))
        selv = ok & (xmv > float("-inf")) & ((xmv - m) * inv_t >= tau)
        rank = tl.where(selv, tl.cumsum(selv.to(tl.int32), axis=0) - 1, -1)
        nsel = tl.sum(selv.to(tl.int32), axis=0)
        g = tl.arange(0, GR)
        for j in range(0, nsel, GR):
            # the selected blocks of ranks j .. j + GR - 1; block NBLK (past V, nothing
            # loaded) where fewer are left
            hit = rank[None, :] == (j + g)[:, None]
            bid = tl.sum(tl.where(hit, bv[None, :] + 1, 0), axis=1) - 1
            bid = tl.where(bid >= 0, bid, NBLK)
            x = _load_blocks(logits_ptr, stride_lb, stride_lv, slot_ptr, rep_ptr, inv_rep_ptr,
                             freq_ptr, pres_ptr, bitmask_ptr, stride_mb, stride_mw, counts_ptr,
                             stride_cs, stride_cv, prompt_ptr, stride_ps, stride_pv, row, bid,
                             has_bias, ids, ids_row, vals_row, B, V, HAS_BITMASK, HAS_COUNTS,
                             HAS_PROMPT, BF16_BITS, GR, DB)  # fmt: skip
            offs = bid[:, None] * DB + tl.arange(0, DB)[None, :]
            _append(cand_row, cnt_ptr + row, x, offs, offs < V, m, inv_t, tau, GCAP)
