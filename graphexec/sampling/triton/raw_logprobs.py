"""Raw logprobs from the stats pass's raw block stats (rxm_b, the raw max; rs_b =
sum exp(v - rxm_b), v the raw logits, NaN -> -inf), one program per row, as in
`reference.write_logprobs`:

    lse    log(sum_b rs_b * exp(rxm_b - m)), m = max rxm_b; a sum in block order, fixed
           by V, so the value does not depend on the batch
    rank   1 + #(v > v_token): only blocks whose max exceeds v_token can hold such a v
    top-N  the N-th largest block max bounds the N-th value from below: only the blocks
           at or above that bound can hold the top N; their candidates are sorted, the
           first N kept

Both sets of blocks are read again in one pass over their union. Rows it does not serve
(a raw +inf, fewer live blocks than N, more candidates than CAP, processed mode) are left
to `logprobs._logprobs_kernel`; processed-mode rows get their y written here for it.
"""

from __future__ import annotations

import triton
import triton.language as tl

from graphexec.sampling.triton.keys import collapse_inf, pack, sort_desc, unpack
from graphexec.sampling.triton.process import bias_ids, raw_x, row_params, tile_x
from graphexec.sampling.triton.stats import grid_delta


@triton.jit
def tile_slots(sel):
    """Slots of the selected entries of a [R, N] tile, counted from 0 in row-major order,
    and their number."""
    cnt = tl.sum(sel.to(tl.int32), axis=1)
    slots = (tl.cumsum(cnt, axis=0) - cnt)[:, None] + tl.cumsum(sel.to(tl.int32), axis=1) - 1
    return slots, tl.sum(cnt, axis=0)


@triton.jit
def _block_list(sel_b, cblk_row, NBLK_P2: tl.constexpr):
    """Write the ids of the selected blocks, ascending, to cblk_row; returns their count."""
    b = tl.arange(0, NBLK_P2)
    tl.store(cblk_row + tl.cumsum(sel_b.to(tl.int32), axis=0) - 1, b, mask=sel_b)
    tl.debug_barrier()
    return tl.sum(sel_b.to(tl.int32), axis=0)


@triton.jit
def _write_y(P, row, slot, ids, m, has_inf, s, y_row, YB: tl.constexpr, FL: tl.constexpr):
    """The row's y = (collapsed x - m) * s, for the general writer's processed rows."""
    for start in range(0, P.vocab, YB):
        offs = start + tl.arange(0, YB)
        x = collapse_inf(tile_x(P, row, slot, ids, offs, start, start + YB, FL), has_inf)
        tl.store(y_row + offs, (x - m) * s, mask=offs < P.vocab)


@triton.jit
def _raw_logprobs_kernel(  # one program per row
    P,
    xm_ptr,  # [B, NBLK] f32 block maxes of x (the stats pass)
    rxm_ptr, rs_ptr,  # [B, NBLK] f32 raw block max, sum exp(v - max)
    y_ptr,  # [B, V] f32 out: y of processed-mode rows
    cblk_ptr,  # [B, NBLK] i32 scratch
    cand_ptr,  # [B, CAP] i64 scratch
    tok_ptr,  # [B] i64 sampled tokens (-1 = invalid row)
    lp_out_ptr,  # [B] f32 out
    rank_ptr,  # [B] i64 out
    top_lp_ptr, top_id_ptr,  # [B, N] f32 / i64 out
    done_ptr,  # [B] i32 out: 1 where this kernel wrote the row's logprobs
    NBLK,
    N: tl.constexpr, N_POW2: tl.constexpr, NBLK_P2: tl.constexpr, NB_P2: tl.constexpr,
    GR: tl.constexpr, DB: tl.constexpr, CAP: tl.constexpr, YB: tl.constexpr,
    INTERP: tl.constexpr, FL: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    r64 = row.to(tl.int64)
    slot, greedy, inv_t, seed_unused, pos_unused = row_params(P, row)
    served = tl.zeros([], dtype=tl.int32)
    # every raw-mode row, asked or not: the reference writes them all
    raw_mode = tl.load(P.lp_processed + slot).to(tl.int32) == 0
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
        v_tok = tl.sum(tl.sum(_raw(P, row, t_col, FL), axis=1), axis=0)
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
            delta = grid_delta(ym, tl.full([NBLK_P2], 1.0, tl.float32), N * 1.0, 0.0, 0)
            top_b = (ym >= -delta) & (ym > float("-inf"))
            # N blocks or more hold the max: the top N are its first N tokens by id, in
            # the first N of those blocks (rows of ties)
            at_max = live & (rxm == mr)
            tied = (tl.sum(at_max.to(tl.int32), axis=0) >= N) & (mr > float("-inf"))
            top_b = tl.where(tied, at_max & (tl.cumsum(at_max.to(tl.int32), axis=0) <= N), top_b)
            delta = tl.where(tied, 0.0, delta)
            top_ok = tl.sum(top_b.to(tl.int32), axis=0) <= CAP
            d_sel = tl.where(top_ok, delta, float("-inf"))
            sel_b = sel_b | tl.where(top_ok, top_b, False)
        # one pass over both sets of blocks: a block of one set only adds nothing to the
        # other's count or candidates
        cblk_row = cblk_ptr + r64 * NBLK
        nbc = _block_list(sel_b, cblk_row, NBLK_P2)
        cols = tl.arange(0, DB)[None, :]
        crow = cand_ptr + r64 * CAP
        above = tl.zeros([], dtype=tl.int32)
        n = tl.zeros([], dtype=tl.int32)
        for i in range(0, nbc, GR):
            jj = i + tl.arange(0, GR)
            bid = tl.load(cblk_row + jj, mask=jj < nbc, other=NBLK)
            offs = bid[:, None] * DB + cols
            v = _raw(P, row, offs, FL)
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
            # tied rows store their first CAP candidates by id: the top N among them
            if top_ok & ((n <= CAP) | tied) & (delta < float("inf")):
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
        # y as the sampler scales it: m the row max of x (0 where none is finite)
        xm = tl.load(xm_ptr + r64 * NBLK + b, mask=b < NBLK, other=float("-inf"))
        mx = tl.max(xm, axis=0)
        has_inf = mx == float("inf")
        m = tl.where((mx > float("-inf")) & (has_inf == 0), mx, 0.0)
        _write_y(P, row, slot, bias_ids(P, slot, NB_P2), m, has_inf, inv_t, y_ptr + r64 * P.vocab,
                 YB, FL)  # fmt: skip


@triton.jit
def _raw(P, row, offs, FL: tl.constexpr):
    """The raw logits at offs as fp32, NaN -> -inf, -inf past V."""
    v = raw_x(P, row, offs, FL)
    return tl.where((offs < P.vocab) & (v == v), v, float("-inf"))
