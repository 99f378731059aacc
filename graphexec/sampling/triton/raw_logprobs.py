"""Raw logprobs from the block pass: no full read of the row beyond the one it made.

For rows in the raw mode (the default) of a batch with logprobs on, the block pass also
stores, per block of DB tokens, the raw max rxm_b and rs_b = sum exp(v - rxm_b) (v the raw
logits, NaN -> -inf). One program per row then computes, as in
`reference.write_logprobs`:

    lse    log(sum_b rs_b * exp(rxm_b - m)), m = max rxm_b; a sum in block order, fixed
           by V, so the value does not depend on the batch
    rank   1 + #(v > v_token): only blocks whose max exceeds v_token can hold such a v,
           and only those are read again
    top-N  the N-th largest block max bounds the N-th value from below: the blocks at or
           above that bound are read again, their candidates sorted, the first N kept

and marks the row done. Rows it does not serve (a raw +inf, fewer live blocks than N,
more candidates than CAP, processed mode) are left to `logprobs._logprobs_kernel`, which
handles every case in passes over the row.
"""

from __future__ import annotations

import triton
import triton.language as tl

from graphexec.sampling.triton.blocks import raw_tile
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
    lp_proc_ptr,  # [S] bool processed mode
    tok_ptr,  # [B] i64 sampled tokens (-1 = invalid row)
    rxm_ptr, rs_ptr,  # [B, NBLK] f32 raw block max, sum exp(v - max)
    cblk_ptr,  # [B, NBLK_P2] i32 scratch
    cand_ptr,  # [B, CAP] i64 scratch
    lp_out_ptr,  # [B] f32 out
    rank_ptr,  # [B] i64 out
    top_lp_ptr, top_id_ptr,  # [B, N] f32 / i64 out
    done_ptr,  # [B] i32 out: 1 where this kernel wrote the row's logprobs
    V, NBLK,
    BF16_BITS: tl.constexpr, N: tl.constexpr, N_POW2: tl.constexpr, NBLK_P2: tl.constexpr,
    R: tl.constexpr, DB: tl.constexpr, CAP: tl.constexpr, INTERP: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    r64 = row.to(tl.int64)
    slot = tl.load(slot_ptr + row)
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
        cblk_row = cblk_ptr + r64 * NBLK_P2
        cols = tl.arange(0, DB)[None, :]
        # rank: a v above v_tok lies in a block whose max is above it
        nbc = _block_list((b < NBLK) & (rxm > v_tok), cblk_row, NBLK_P2)
        above = tl.zeros([], dtype=tl.int32)
        for i in range(0, nbc, R):
            jj = i + tl.arange(0, R)
            bid = tl.load(cblk_row + jj, mask=jj < nbc, other=NBLK)
            v = raw_tile(logits_ptr, stride_lb, stride_lv, row, bid[:, None] * DB + cols, V,
                         BF16_BITS)  # fmt: skip
            above += tl.sum(tl.sum((v > v_tok).to(tl.int32), axis=1), axis=0)
        valid = tok >= 0
        tl.store(lp_out_ptr + row, tl.where(valid, (v_tok - m) - lse, float("nan")))
        tl.store(rank_ptr + row, tl.where(valid, above + 1, 0).to(tl.int64))
        served = 1
        if N > 0:
            # the N-th largest block max bounds the N-th value: gather what lies above it
            ym = tl.where(b < NBLK, rxm - m, float("-inf"))
            delta = _grid_delta(ym, tl.full([NBLK_P2], 1.0, tl.float32), N * 1.0)
            nbc = _block_list((ym >= -delta) & (ym > float("-inf")), cblk_row, NBLK_P2)
            crow = cand_ptr + r64 * CAP
            n = tl.zeros([], dtype=tl.int32)
            if nbc > CAP:
                nbc = 0
                n = CAP + 1
            for i in range(0, nbc, R):
                jj = i + tl.arange(0, R)
                bid = tl.load(cblk_row + jj, mask=jj < nbc, other=NBLK)
                offs = bid[:, None] * DB + cols
                v = raw_tile(logits_ptr, stride_lb, stride_lv, row, offs, V, BF16_BITS)
                sel = (v - m >= -delta) & (v > float("-inf"))
                cnt = tl.sum(sel.to(tl.int32), axis=1)
                within = tl.cumsum(sel.to(tl.int32), axis=1) - 1
                idx = n + (tl.cumsum(cnt, axis=0) - cnt)[:, None] + within
                tl.store(crow + idx, pack(v, offs), mask=sel & (idx < CAP))
                n += tl.sum(cnt, axis=0)
            if (n <= CAP) & (delta < float("inf")):
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
