"""Raw logprobs from the block pass: no full read of the row beyond the one it made.

For rows in the raw mode (the default) of a batch with logprobs on, the block pass also
stores, per block of DB tokens, the raw max rxm_b and rs_b = sum exp(v - rxm_b) (v the raw
logits, NaN -> -inf). One program per row then computes, as in
`reference.write_logprobs`:

    lse    log(sum_b rs_b * exp(rxm_b - m)), m = max rxm_b; a sum in block order, fixed
           by V, so the value does not depend on the batch
    rank   1 + #(v > v_token): only blocks whose max exceeds v_token can hold such a v
    top-N  the N-th largest block max bounds the N-th value from below: only the blocks
           at or above that bound can hold the top N; their candidates are sorted, the
           first N kept

Both sets of blocks are read again in one pass over their union, GR blocks a tile (two
passes of 8 blocks a tile took 12.1 us of an H100 at B = 1, this 11.4), and the row is
marked done. Rows it does not serve (a raw +inf, fewer live blocks than N,
more candidates than CAP, processed mode) are left to `logprobs._logprobs_kernel`, which
handles every case in passes over the row.

Rows in the processed mode get their y written here (`rowdraw.materialize_y`), for that
writer to read; the row program is then one kernel with logprobs on or off (fewer
compiles). It was moved for a slowdown it did not cause: with logprobs on, the row
program of top_k_top_p took 23 us of an H100 at B = 1 instead of 16, and still does. The
cause is the instruction cache (`benchmarks/icache_evict.py`): without logprobs the row
program ran back to back with its code warm; in an engine it is always cold.
"""

from __future__ import annotations

import triton
import triton.language as tl

from graphexec.sampling.triton.blocks import raw_tile, row_scale
from graphexec.sampling.triton.gather import tile_slots
from graphexec.sampling.triton.rowdraw import materialize_y
from graphexec.sampling.triton.select import pack, sort_desc, unpack
from graphexec.sampling.triton.thresholds import _grid_delta


@triton.jit
def _block_list(sel_b, cblk_row, NBLK_P2: tl.constexpr):
    """Write the ids of the selected blocks, ascending, to cblk_row; returns their count."""
    tl.debug_barrier()  # an earlier list may still be being read
    b = tl.arange(0, NBLK_P2)
    tl.store(cblk_row + tl.cumsum(sel_b.to(tl.int32), axis=0) - 1, b, mask=sel_b)
    tl.debug_barrier()
    return tl.sum(sel_b.to(tl.int32), axis=0)


@triton.jit
def _raw_logprobs_kernel(
    logits_ptr, stride_lb, stride_lv,  # [B, V] f32 / f16, or bf16 as i16 bits
    slot_ptr,  # [B] i64
    rep_ptr, inv_rep_ptr, freq_ptr, pres_ptr,  # [S] f32
    bitmask_ptr, stride_mb, stride_mw,  # [B, ceil(V/32)] i32
    counts_ptr, stride_cs, stride_cv,  # [S, V] i32
    prompt_ptr, stride_ps, stride_pv,  # [S, V] u8
    bias_ids_ptr, bias_val_ptr, stride_is, stride_vs,  # [S, NB] i32 (sorted, -1 pads), f32
    temp_ptr, inv_temp_ptr,  # [S] f32
    lp_proc_ptr,  # [S] bool processed mode
    tok_ptr,  # [B] i64 sampled tokens (-1 = invalid row)
    xm_ptr,  # [B, NBLK] f32 block maxes of x
    rxm_ptr, rs_ptr,  # [B, NBLK] f32 raw block max, sum exp(v - max)
    y_ptr,  # [B, V] f32 out: y of processed-mode rows
    cblk_ptr,  # [B, NBLK_P2] i32 scratch
    cand_ptr,  # [B, CAP] i64 scratch
    lp_out_ptr,  # [B] f32 out
    rank_ptr,  # [B] i64 out
    top_lp_ptr, top_id_ptr,  # [B, N] f32 / i64 out
    done_ptr,  # [B] i32 out: 1 where this kernel wrote the row's logprobs
    B, V, NB, NBLK,
    HAS_BITMASK: tl.constexpr, HAS_COUNTS: tl.constexpr, HAS_PROMPT: tl.constexpr,
    BF16_BITS: tl.constexpr, N: tl.constexpr, N_POW2: tl.constexpr, NBLK_P2: tl.constexpr,
    NBIAS_P2: tl.constexpr, GR: tl.constexpr, DB: tl.constexpr, CAP: tl.constexpr,
    YB: tl.constexpr,
    INTERP: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    r64 = row.to(tl.int64)
    slot, greedy, inv_t = row_scale(slot_ptr, temp_ptr, inv_temp_ptr, row)
    served = tl.zeros([], dtype=tl.int32)
    # every raw-mode row, asked or not: the reference writes them all
    raw_mode = tl.load(lp_proc_ptr + slot).to(tl.int32) == 0
    b = tl.arange(0, NBLK_P2)
    rxm = tl.load(rxm_ptr + r64 * NBLK + b, mask=b < NBLK, other=float("-inf"))
    mr = tl.max(rxm, axis=0)
    if raw_mode & (mr < float("inf")):
        rs = tl.load(rs_ptr + r64 * NBLK + b, mask=b < NBLK, other=0.0)
        m = tl.where(mr > float("-inf"), mr, 0.0)
        total = tl.sum(tl.where(rs > 0.0, rs * tl.exp(rxm - m), 0.0), axis=0)
        lse = tl.log(total)
        tok = tl.load(tok_ptr + row)
        t_col = tl.maximum(tok, 0) + tl.arange(0, 1)[None, :]
        v_tok = tl.sum(tl.sum(raw_tile(logits_ptr, stride_lb, stride_lv, row, t_col, V,
                                       BF16_BITS), axis=1), axis=0)  # fmt: skip
        live = b < NBLK
        # rank: a v above v_tok lies in a block whose max is above it
        sel_b = live & (rxm > v_tok)
        delta = tl.full([], float("inf"), tl.float32)
        top_ok = tl.zeros([], dtype=tl.int1)
        # candidates: v >= m - d_sel; d_sel = -inf selects none
        d_sel = tl.full([], float("-inf"), tl.float32)
        if N > 0:
            # the N-th largest block max bounds the N-th value: the blocks at or above it
            # hold the top N; each holds a candidate at least, so more than CAP cannot fit
            ym = tl.where(live, rxm - m, float("-inf"))
            delta = _grid_delta(ym, tl.full([NBLK_P2], 1.0, tl.float32), N * 1.0)
            top_b = (ym >= -delta) & (ym > float("-inf"))
            top_ok = tl.sum(top_b.to(tl.int32), axis=0) <= CAP
            d_sel = tl.where(top_ok, delta, float("-inf"))
            sel_b = sel_b | ((ym >= -d_sel) & (ym > float("-inf")))
        # one pass over both sets of blocks: a block of one set only adds nothing to the
        # other's count or candidates
        cblk_row = cblk_ptr + r64 * NBLK_P2
        nbc = _block_list(sel_b, cblk_row, NBLK_P2)
        cols = tl.arange(0, DB)[None, :]
        crow = cand_ptr + r64 * CAP
        above = tl.zeros([], dtype=tl.int32)
        n = tl.zeros([], dtype=tl.int32)
        for i in range(0, nbc, GR):
            jj = i + tl.arange(0, GR)
            bid = tl.load(cblk_row + jj, mask=jj < nbc, other=NBLK)
            offs = bid[:, None] * DB + cols
            v = raw_tile(logits_ptr, stride_lb, stride_lv, row, offs, V, BF16_BITS)
            above += tl.sum(tl.sum((v > v_tok).to(tl.int32), axis=1), axis=0)
            if N > 0:
                sel = (v - m >= -d_sel) & (v > float("-inf"))
                slots, cnt = tile_slots(sel)
                idx = n + slots
                tl.store(crow + idx, pack(v, offs), mask=sel & (idx < CAP))
                n += cnt
        valid = tok >= 0
        tl.store(lp_out_ptr + row, tl.where(valid, (v_tok - m) - lse, float("nan")))
        tl.store(rank_ptr + row, tl.where(valid, above + 1, 0).to(tl.int64))
        served = 1
        if N > 0:
            if top_ok & (n <= CAP) & (delta < float("inf")):
                tl.debug_barrier()
                c = tl.arange(0, CAP)
                keys = tl.load(crow + c, mask=c < n, other=-9223372036854775808)
                keys = tl.reshape(sort_desc(tl.reshape(keys, (1, CAP)), INTERP), (CAP,))
                j = tl.arange(0, N_POW2)
                top = tl.sum(tl.where(c[None, :] == j[:, None], keys[None, :], 0), axis=1)
                vals, ids = unpack(top)
                tl.store(top_lp_ptr + r64 * N + j, (vals - m) - lse, mask=j < N)
                tl.store(top_id_ptr + r64 * N + j, ids.to(tl.int64), mask=j < N)
            else:
                served = 0
    tl.store(done_ptr + row, served)
    if raw_mode == 0:
        # y as the row program scales it: m the row max of x (0 where none is finite)
        xm = tl.load(xm_ptr + r64 * NBLK + b, mask=b < NBLK, other=float("-inf"))
        mx = tl.max(xm, axis=0)
        has_inf = mx == float("inf")
        m = tl.where((mx > float("-inf")) & (has_inf == 0), mx, 0.0)
        jb = tl.arange(0, NBIAS_P2)
        ids_row = bias_ids_ptr + slot * stride_is
        ids = tl.load(ids_row + jb, mask=jb < NB, other=-1)
        materialize_y(logits_ptr, stride_lb, stride_lv, slot_ptr, rep_ptr, inv_rep_ptr,
                      freq_ptr, pres_ptr, bitmask_ptr, stride_mb, stride_mw, counts_ptr,
                      stride_cs, stride_cv, prompt_ptr, stride_ps, stride_pv, row, m, has_inf,
                      inv_t, 0.0, ids, ids_row, bias_val_ptr + slot * stride_vs, y_ptr + r64 * V,
                      B, V, HAS_BITMASK, HAS_COUNTS, HAS_PROMPT, BF16_BITS, YB)  # fmt: skip
