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
  whole number of blocks): stores xm_b, Q_b and #(+inf) of each block in it.
- `_two_level_draw_kernel` (one program per row in state 3): picks the block, processes
  its DB tokens again from the raw logits, and draws the token.

A row holding +inf is collapsed (uniform over its +inf entries): its blocks are then
xm_b = 0 if they hold any +inf (else -inf) and Q_b = #(+inf) * 2**32, with m = 0, exactly
what the reference computes on the collapsed row.
"""

from __future__ import annotations

import triton
import triton.language as tl

from graphexec.sampling.triton.philox import block_bits, group_bits, gumbel
from graphexec.sampling.triton.process import _process_chunk
from graphexec.sampling.triton.select import collapse_inf

INT32_MAX = tl.constexpr(2147483647)


@triton.jit
def block_stats(
    x, start, inv_t, r64, NBLK,
    xm_ptr,  # [B, NBLK] f32 out: block max of x
    q_ptr,  # [B, NBLK] i64 out: Q_b
    n_ptr,  # [B, NBLK] i32 out: #(+inf) in the block
    BLOCK: tl.constexpr, DB: tl.constexpr,
):  # fmt: skip
    """x: processed [BLOCK // 4, 4] chunk of tokens start .. start + BLOCK - 1."""
    NB: tl.constexpr = BLOCK // DB
    xb = tl.reshape(x, [NB, DB])
    xm = tl.max(xb, axis=1)
    fin = (xb > float("-inf")) & (xb < float("inf")) & (xm[:, None] < float("inf"))
    # z is taken only where fin; the safe max keeps -inf - -inf out of the arithmetic
    xs = tl.where((xm > float("-inf")) & (xm < float("inf")), xm, 0.0)
    z = tl.where(fin, (xb - xs[:, None]) * inv_t, float("-inf"))
    q = tl.where(fin, (tl.exp(z) * 4294967296.0).to(tl.int64), 0)
    b = start // DB + tl.arange(0, NB)
    ok = b < NBLK
    tl.store(xm_ptr + r64 * NBLK + b, xm, mask=ok)
    tl.store(q_ptr + r64 * NBLK + b, tl.sum(q, axis=1), mask=ok)
    tl.store(n_ptr + r64 * NBLK + b, tl.sum((xb == float("inf")).to(tl.int32), axis=1), mask=ok)


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
    xm_ptr, q_ptr, n_ptr,  # [B, NBLK] block stats of `block_stats`
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
    n_inf = tl.load(n_ptr + r64 * NBLK + b, mask=ok, other=0)
    xm = tl.where(has_inf, tl.where(n_inf > 0, 0.0, float("-inf")), xm)
    q = tl.where(has_inf, n_inf.to(tl.int64) << 32, q)
    logmass = (xm - m) * inv_t + tl.log(q.to(tl.float32))
    key = tl.where(ok, logmass + gumbel(block_bits(seed, pos, 0, NB_P2, BLOCK_STREAM)),
                   float("-inf"))  # fmt: skip
    top = tl.max(key, axis=0)
    chosen = tl.min(tl.where(key == top, b, NB_P2), axis=0)

    G: tl.constexpr = DB // 4
    start = chosen * DB
    offs = start + 4 * tl.arange(0, G)[:, None] + tl.arange(0, 4)[None, :]
    has_bias = tl.load(bias_ids_ptr + slot * stride_is) >= 0
    x = _process_chunk(
        logits_ptr, stride_lb, stride_lv, slot_ptr, rep_ptr, inv_rep_ptr, freq_ptr, pres_ptr,
        bitmask_ptr, stride_mb, stride_mw, counts_ptr, stride_cs, stride_cv,
        prompt_ptr, stride_ps, stride_pv, dense_ptr, has_bias, row, offs, B, V,
        HAS_BITMASK, HAS_COUNTS, HAS_PROMPT, BF16_BITS,
    )  # fmt: skip
    y = (collapse_inf(x, has_inf) - m) * inv_t
    s = y + gumbel(group_bits(seed, pos, start, G, TOKEN_STREAM))
    best = tl.max(tl.max(s, axis=1), axis=0)
    tok = tl.min(tl.min(tl.where(s == best, offs, INT32_MAX), axis=1), axis=0)
    tl.store(tok_ptr + row, tok.to(tl.int64))


def num_blocks(V: int, draw_block: int) -> int:
    return triton.cdiv(V, draw_block)
