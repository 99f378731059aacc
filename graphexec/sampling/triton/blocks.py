"""The one full read of the logits: per-block stats of every row (`_block_pass_kernel`).

A row is cut into blocks of DB consecutive token ids (`reference.DRAW_BLOCK`). Programs
(row, slice) read their slice as [R, DB] tiles, one block per tile row, so each block's
reductions stay inside one warp. For every block b the pass processes the raw logits in
registers (bitmask, logit bias, penalties: `process._process_cols`) and stores

    xm_b   the block max of x (+inf where the block holds +inf, -inf where nothing is live)
    Q_b    sum of trunc(exp((x_i - xm_b) * s) * 2**32) over its finite x_i (int64, exact)

with s the row's 1/T (1 for greedy rows). That is all the sampler reads from HBM in full:
the row max, validity, the two-level draw's block masses, the top-p total and the
candidate thresholds of the filters all come from these stats (`rowdraw`), and only the
few blocks that can hold the token are read again. Q_b is an integer sum and a block never
straddles two programs, so no split of the row changes a stat: the split may follow B.

Logit bias without a dense scratch: a slot's bias ids are sorted (`SamplingTensors`), so
`bias_tile` finds the entries that fall inside a tile's token range with two vector
counts and puts each one in with a select; rows without a bias take a loop that never
looks.
"""

from __future__ import annotations

import triton
import triton.language as tl

from graphexec.sampling.triton.process import _process_cols


@triton.jit
def neg_zero(shape: tl.constexpr):
    """-0.0, the exact additive identity, from its bits (a literal -0.0 may become +0.0)."""
    return tl.full(shape, -(2**31), tl.int32).to(tl.float32, bitcast=True)


@triton.jit
def row_scale(slot_ptr, temp_ptr, inv_temp_ptr, row):
    """(slot, greedy, s) of the program's row: its table slot (i64), whether T == 0, and the
    scale s = 1/T of its y (1 for greedy rows)."""
    slot = tl.load(slot_ptr + row).to(tl.int64)
    greedy = tl.load(temp_ptr + slot) == 0.0
    return slot, greedy, tl.where(greedy, 1.0, tl.load(inv_temp_ptr + slot))


@triton.jit
def bias_tile(ids, ids_row_ptr, vals_row_ptr, offs, t_lo, t_hi, bias):
    """`bias` with the slot's logit-bias entries whose id lies in [t_lo, t_hi) put in at
    their token (where offs holds it).

    ids: [NB_P2] the slot's ids, ascending, -1 padded; ids_row_ptr / vals_row_ptr: the
    slot's rows of the [S, NB] id / value tables; offs: token ids of the tile."""
    first = tl.sum(((ids >= 0) & (ids < t_lo)).to(tl.int32), axis=0)
    n = tl.sum(((ids >= t_lo) & (ids < t_hi)).to(tl.int32), axis=0)
    for e in range(first, first + n):
        bias = tl.where(offs == tl.load(ids_row_ptr + e), tl.load(vals_row_ptr + e), bias)
    return bias


@triton.jit
def tile_x(
    logits_ptr, stride_lb, stride_lv, slot_ptr, rep_ptr, inv_rep_ptr, freq_ptr, pres_ptr,
    bitmask_ptr, stride_mb, stride_mw, counts_ptr, stride_cs, stride_cv,
    prompt_ptr, stride_ps, stride_pv, row, offs, bias, B, V,
    HAS_BITMASK: tl.constexpr, HAS_COUNTS: tl.constexpr, HAS_PROMPT: tl.constexpr,
    BF16_BITS: tl.constexpr,
):  # fmt: skip
    """Processed x at the 2-D tile of token ids offs of one row (-inf past V)."""
    ok = offs < V
    x = _process_cols(
        logits_ptr, stride_lb, stride_lv, slot_ptr,
        rep_ptr, inv_rep_ptr, freq_ptr, pres_ptr,
        bitmask_ptr, stride_mb, stride_mw, counts_ptr, stride_cs, stride_cv,
        prompt_ptr, stride_ps, stride_pv,
        tl.zeros([1], dtype=tl.int32) + row, offs, ok, bias, B,
        HAS_BITMASK, HAS_COUNTS, HAS_PROMPT, BF16_BITS,
    )  # fmt: skip
    return tl.where(ok, x, float("-inf"))


@triton.jit
def mass_terms(x, xm, inv_t):
    """int32 (hi, lo) with trunc(exp((x - xm) * inv_t) * 2**32) = hi * 2**16 + lo, exactly
    (e * 2**16 and its fraction are exact in fp32); 0 where x or xm is not finite. Two
    int32 sums per block replace 64-bit conversions and adds per token."""
    fin = (x > float("-inf")) & (x < float("inf")) & (xm < float("inf"))
    # the safe max keeps -inf - -inf out of the arithmetic (z is used only where fin)
    xs = tl.where((xm > float("-inf")) & (xm < float("inf")), xm, 0.0)
    z = tl.where(fin, (x - xs) * inv_t, float("-inf"))
    e16 = tl.exp(z) * 65536.0
    hi_f = tl.floor(e16)
    return hi_f.to(tl.int32), ((e16 - hi_f) * 65536.0).to(tl.int32)


@triton.jit
def raw_tile(logits_ptr, stride_lb, stride_lv, row, offs, V, BF16_BITS: tl.constexpr):
    """The raw logits at the 2-D tile offs of one row as fp32, NaN -> -inf, -inf past V
    (the source of default, "raw", logprobs)."""
    ok = offs < V
    ptrs = logits_ptr + row.to(tl.int64) * stride_lb + offs.to(tl.int64) * stride_lv
    if BF16_BITS:
        v = (tl.load(ptrs, mask=ok, other=0).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    else:
        v = tl.load(ptrs, mask=ok, other=0).to(tl.float32)
    return tl.where(ok & (v == v), v, float("-inf"))


@triton.jit
def _store_raw_stats(v, first_block, r64, NBLK, rxm_ptr, rs_ptr, R: tl.constexpr):
    """Raw block max and sum(exp(v - max)) (fp32; 0 where the max is not finite)."""
    vm = tl.max(v, axis=1)
    fin = (vm > float("-inf")) & (vm < float("inf"))
    e = tl.exp(tl.where(fin[:, None] & (v > float("-inf")), v - tl.where(fin, vm, 0.0)[:, None],
                        float("-inf")))  # fmt: skip
    b = first_block + tl.arange(0, R)
    tl.store(rxm_ptr + r64 * NBLK + b, vm, mask=b < NBLK)
    tl.store(rs_ptr + r64 * NBLK + b, tl.sum(e, axis=1), mask=b < NBLK)


@triton.jit
def _store_stats(x, first_block, inv_t, r64, NBLK, xm_ptr, q_ptr, R: tl.constexpr):
    """Block stats of an [R, DB] tile x whose tile row i is block first_block + i."""
    xm = tl.max(x, axis=1)
    hi, lo = mass_terms(x, xm[:, None], inv_t)
    q = tl.sum(hi, axis=1).to(tl.int64) * 65536 + tl.sum(lo, axis=1).to(tl.int64)
    b = first_block + tl.arange(0, R)
    tl.store(xm_ptr + r64 * NBLK + b, xm, mask=b < NBLK)
    tl.store(q_ptr + r64 * NBLK + b, q, mask=b < NBLK)


@triton.jit(do_not_specialize=["B", "NB"])  # SLICE % 16 aligns the loads
def _block_pass_kernel(
    logits_ptr, stride_lb, stride_lv,  # [B, V] f32 / f16, or bf16 as i16 bits
    slot_ptr,  # [B] i64: row b reads table row slot_ids[b]
    rep_ptr, inv_rep_ptr, freq_ptr, pres_ptr,  # [S] f32
    bitmask_ptr, stride_mb, stride_mw,  # [B, ceil(V/32)] i32
    counts_ptr, stride_cs, stride_cv,  # [S, V] i32
    prompt_ptr, stride_ps, stride_pv,  # [S, V] u8
    bias_ids_ptr, bias_val_ptr, stride_is, stride_vs,  # [S, NB] i32 (sorted, -1 pads), f32
    temp_ptr, inv_temp_ptr,  # [S] f32
    lp_proc_ptr,  # [S] bool: logprobs of the processed row
    xm_ptr,  # [B, NBLK] f32 out: block max of x
    q_ptr,  # [B, NBLK] i64 out: Q_b
    rxm_ptr, rs_ptr,  # [B, NBLK] f32 out (RAW_LP, raw-mode rows): raw max, sum exp
    B, V, NB, NBLK, SLICE,
    HAS_BITMASK: tl.constexpr, HAS_COUNTS: tl.constexpr, HAS_PROMPT: tl.constexpr,
    BF16_BITS: tl.constexpr, RAW_LP: tl.constexpr, NB_P2: tl.constexpr, R: tl.constexpr,
    DB: tl.constexpr,
):  # fmt: skip
    """Grid (B, SPLIT): program (row, sp) writes the stats of the blocks of tokens
    [sp * SLICE, (sp + 1) * SLICE), SLICE a multiple of R * DB."""
    row = tl.program_id(0)
    r64 = row.to(tl.int64)
    slot, greedy, inv_t = row_scale(slot_ptr, temp_ptr, inv_temp_ptr, row)
    j = tl.arange(0, NB_P2)
    ids = tl.load(bias_ids_ptr + slot * stride_is + j, mask=j < NB, other=-1)
    tile = tl.arange(0, R)[:, None] * DB + tl.arange(0, DB)[None, :]
    lo = tl.program_id(1) * SLICE
    args = (
        logits_ptr, stride_lb, stride_lv, slot_ptr, rep_ptr, inv_rep_ptr, freq_ptr, pres_ptr,
        bitmask_ptr, stride_mb, stride_mw, counts_ptr, stride_cs, stride_cv,
        prompt_ptr, stride_ps, stride_pv, row,
    )  # fmt: skip
    raw_lp = tl.zeros([], dtype=tl.int1)
    if RAW_LP:
        raw_lp = tl.load(lp_proc_ptr + slot).to(tl.int32) == 0
    # separate loops, so the common ones have no data-dependent branch (that would stop
    # Triton from pipelining their loads)
    if tl.max(ids, axis=0) >= 0:
        for start in range(lo, lo + SLICE, R * DB):
            offs = start + tile
            bias = bias_tile(ids, bias_ids_ptr + slot * stride_is, bias_val_ptr + slot * stride_vs,
                             offs, start, start + R * DB, neg_zero([R, DB]))  # fmt: skip
            x = tile_x(*args, offs, bias, B, V, HAS_BITMASK, HAS_COUNTS, HAS_PROMPT, BF16_BITS)
            _store_stats(x, start // DB, inv_t, r64, NBLK, xm_ptr, q_ptr, R)
            if raw_lp:
                v = raw_tile(logits_ptr, stride_lb, stride_lv, row, offs, V, BF16_BITS)
                _store_raw_stats(v, start // DB, r64, NBLK, rxm_ptr, rs_ptr, R)
    elif raw_lp:
        for start in range(lo, lo + SLICE, R * DB):
            offs = start + tile
            x = tile_x(*args, offs, neg_zero([R, DB]), B, V, HAS_BITMASK, HAS_COUNTS,
                       HAS_PROMPT, BF16_BITS)  # fmt: skip
            _store_stats(x, start // DB, inv_t, r64, NBLK, xm_ptr, q_ptr, R)
            v = raw_tile(logits_ptr, stride_lb, stride_lv, row, offs, V, BF16_BITS)
            _store_raw_stats(v, start // DB, r64, NBLK, rxm_ptr, rs_ptr, R)
    else:
        for start in range(lo, lo + SLICE, R * DB):
            offs = start + tile
            x = tile_x(*args, offs, neg_zero([R, DB]), B, V, HAS_BITMASK, HAS_COUNTS,
                       HAS_PROMPT, BF16_BITS)  # fmt: skip
            _store_stats(x, start // DB, inv_t, r64, NBLK, xm_ptr, q_ptr, R)
