"""The two-level draw of rows with no active filter: one read of the row, noise for one
block.

Definition (`graphexec.sampling.reference`, step 6): the row is cut into blocks of DB
consecutive token ids; block b has max xm_b and integer mass
Q_b = sum trunc(exp((x_i - xm_b) * s) * 2**32) over its finite x_i, so
L_b = (xm_b - m) * s + log(fp32(Q_b)) is its log-mass up to a shared constant. The block
is the Gumbel-max of L_b (noise stream BLOCK, keyed on b), the token the Gumbel-max of
y = (x - m) * s over that block (stream TOKEN). Exact, and Q_b is an integer sum, so no
split of the row or summation order changes a decision.

- `block_stats`: called by the STATS pass on each processed chunk of BLOCK tokens (a
  whole number of blocks): stores xm_b and Q_b of each block in it.
- `_two_level_draw_kernel` (one program per row in state 3): picks the block, processes
  its DB tokens again from the raw logits, and draws the token.

A row holding +inf is collapsed (uniform over its +inf entries): its blocks are then
xm_b = 0 if they hold any +inf (else -inf) and Q_b = #(+inf) * 2**32, with m = 0, exactly
what the reference computes on the collapsed row. The draw kernel counts those +inf
itself (re-reading only the blocks whose max is +inf), so the STATS pass need not.
"""

from __future__ import annotations

import triton
import triton.language as tl

from graphexec.sampling.triton.philox import block_bits, group_bits, gumbel
from graphexec.sampling.triton.process import _process_chunk
from graphexec.sampling.triton.select import collapse_inf

INT32_MAX = tl.constexpr(2147483647)


@triton.jit
def _mass_terms(x, xm, inv_t):
    """int32 (hi, lo) with trunc(exp((x - xm) * inv_t) * 2**32) = hi * 2**16 + lo, exactly
    (e * 2**16 and its fraction are exact in fp32); 0 where x or xm is not finite. Two
    int32 sums replace 64-bit conversions and adds per token."""
    fin = (x > float("-inf")) & (x < float("inf")) & (xm < float("inf"))
    # the safe max keeps -inf - -inf out of the arithmetic (z is used only where fin)
    xs = tl.where((xm > float("-inf")) & (xm < float("inf")), xm, 0.0)
    z = tl.where(fin, (x - xs) * inv_t, float("-inf"))
    e16 = tl.exp(z) * 65536.0
    hi_f = tl.floor(e16)
    return hi_f.to(tl.int32), ((e16 - hi_f) * 65536.0).to(tl.int32)


@triton.jit
def block_stats(
    x, start, inv_t, r64, NBLK,
    xm_ptr,  # [B, NBLK] f32 out: block max of x (+inf where the block holds +inf)
    q_ptr,  # [B, NBLK] i64 out: Q_b
    BLOCK: tl.constexpr, DB: tl.constexpr,
):  # fmt: skip
    """x: processed [BLOCK // 4, 4] chunk of tokens start .. start + BLOCK - 1."""
    NB: tl.constexpr = BLOCK // DB
    if NB == 1:  # the chunk is one block: no reshape (a layout change on the GPU)
        xm = tl.max(tl.max(x, axis=1), axis=0)
        # as a [1, 1] tensor: the interpreter combines scalar and tensor bools badly
        hi, lo = _mass_terms(x, tl.zeros([1, 1], tl.float32) + xm, inv_t)
        hi_s = tl.sum(tl.sum(hi, axis=1), axis=0).to(tl.int64)
        q = hi_s * 65536 + tl.sum(tl.sum(lo, axis=1), axis=0).to(tl.int64)
        b = start // DB
        tl.store(xm_ptr + r64 * NBLK + b, xm, mask=b < NBLK)
        tl.store(q_ptr + r64 * NBLK + b, q, mask=b < NBLK)
    else:
        xb = tl.reshape(x, [NB, DB])
        xm = tl.max(xb, axis=1)
        hi, lo = _mass_terms(xb, xm[:, None], inv_t)
        q = tl.sum(hi, axis=1).to(tl.int64) * 65536 + tl.sum(lo, axis=1).to(tl.int64)
        b = start // DB + tl.arange(0, NB)
        tl.store(xm_ptr + r64 * NBLK + b, xm, mask=b < NBLK)
        tl.store(q_ptr + r64 * NBLK + b, q, mask=b < NBLK)


@triton.jit
def _two_level_draw_kernel(
    logits_ptr, stride_lb, stride_lv,  # [B, V] f32 / bf16 / f16
    slot_ptr,  # [B] i64
    rep_ptr, inv_rep_ptr, freq_ptr, pres_ptr,  # [S] f32
    bitmask_ptr, stride_mb, stride_mw,  # [B, W] i32
    counts_ptr, stride_cs, stride_cv,  # [S, V] i32
    prompt_ptr, stride_ps, stride_pv,  # [S, V] u8
    bias_ids_ptr, stride_is,  # [S, NB] i32
    dense_ptr,  # [B, V] f32 bias scratch
    inv_temp_ptr, seed_ptr,  # [S] f32, i64
    pos_ptr,  # [B] i64
    stat_f_ptr, stat_i_ptr, state_ptr,  # [B] f32 row max, [B, 2] i32 (has +inf), [B] i32
    xm_ptr, q_ptr,  # [B, NBLK] block stats of `block_stats`
    tok_ptr,  # [B] i64 out, for rows in state 3
    B, V, NBLK,
    HAS_BITMASK: tl.constexpr, HAS_COUNTS: tl.constexpr, HAS_PROMPT: tl.constexpr,
    BF16_BITS: tl.constexpr, NB_P2: tl.constexpr, DB: tl.constexpr,
    TOKEN_STREAM: tl.constexpr, BLOCK_STREAM: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    if tl.load(state_ptr + row) != 3:
        return
    r64 = row.to(tl.int64)
    slot = tl.load(slot_ptr + row).to(tl.int64)
    seed = tl.load(seed_ptr + slot)
    pos = tl.load(pos_ptr + row)
    m = tl.load(stat_f_ptr + row)
    has_inf = tl.load(stat_i_ptr + r64 * 2) != 0
    inv_t = tl.load(inv_temp_ptr + slot)

    b = tl.arange(0, NB_P2)
    ok = b < NBLK
    xm = tl.load(xm_ptr + r64 * NBLK + b, mask=ok, other=float("-inf"))
    q = tl.load(q_ptr + r64 * NBLK + b, mask=ok, other=0)
    G: tl.constexpr = DB // 4
    lane = 4 * tl.arange(0, G)[:, None] + tl.arange(0, 4)[None, :]
    has_bias = tl.load(bias_ids_ptr + slot * stride_is) >= 0
    args = (
        logits_ptr, stride_lb, stride_lv, slot_ptr, rep_ptr, inv_rep_ptr, freq_ptr, pres_ptr,
        bitmask_ptr, stride_mb, stride_mw, counts_ptr, stride_cs, stride_cv,
        prompt_ptr, stride_ps, stride_pv, dense_ptr, has_bias, row,
    )  # fmt: skip
    if has_inf:
        # bad data, rare: count the +inf of the blocks that hold one (xm_b = +inf)
        n_inf = tl.zeros([NB_P2], dtype=tl.int64)
        for blk in range(0, NBLK):
            if tl.load(xm_ptr + r64 * NBLK + blk) == float("inf"):
                xi = _process_chunk(*args, blk * DB + lane, B, V, HAS_BITMASK, HAS_COUNTS,
                                    HAS_PROMPT, BF16_BITS)  # fmt: skip
                c = tl.sum(tl.sum((xi == float("inf")).to(tl.int64), axis=1), axis=0)
                n_inf = tl.where(b == blk, c, n_inf)
        xm = tl.where(n_inf > 0, 0.0, float("-inf"))
        q = n_inf << 32
    logmass = (xm - m) * inv_t + tl.log(q.to(tl.float32))
    key = tl.where(ok, logmass + gumbel(block_bits(seed, pos, 0, NB_P2, BLOCK_STREAM)),
                   float("-inf"))  # fmt: skip
    top = tl.max(key, axis=0)
    chosen = tl.min(tl.where(key == top, b, NB_P2), axis=0)

    start = chosen * DB
    offs = start + lane
    x = _process_chunk(*args, offs, B, V, HAS_BITMASK, HAS_COUNTS, HAS_PROMPT, BF16_BITS)
    y = (collapse_inf(x, has_inf) - m) * inv_t
    s = y + gumbel(group_bits(seed, pos, start, G, TOKEN_STREAM))
    best = tl.max(tl.max(s, axis=1), axis=0)
    tok = tl.min(tl.min(tl.where(s == best, offs, INT32_MAX), axis=1), axis=0)
    tl.store(tok_ptr + row, tok.to(tl.int64))
