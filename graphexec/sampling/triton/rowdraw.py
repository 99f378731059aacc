"""The draw, one program per row, from the block stats of `blocks._block_pass_kernel`.

Terms: y = (x - m) * s is the scaled row (m the row max, s = 1/T); ym_b = (xm_b - m) * s
the block max of y; a *candidate* is a token with y >= tau for the row's candidate
threshold tau; the kept set is what the filters keep (`reference`, step 5). Per row:

1. From the block stats alone: m, validity, +inf (m = +inf), and for filtered rows the
   top-p total sum_b Q_b * exp(ym_b) (float64, block order: fixed by V).
2. Greedy rows: the first block whose max is m is read again; its first x == m.
3. Rows with no active filter: the two-level draw (a block by L_b + block noise, then a
   token of that block by y + token noise); one block is read again.
4. Filtered rows: a threshold tau whose candidates provably hold the kept set, from the
   block maxes (`thresholds`): top-k's k-th largest block max bounds the k-th token (at
   least k tokens lie at or above it); min-p's is ln(min_p) less a margin (unless top-p
   needs the mass of the whole top-k prefix, which min-p may cut). Top-p without top-k
   has no such bound: it guesses below the point where the block masses reach p * total and
   checks the guess with the exact mass of what it gathered, lowering it in ROUNDS
   (first P_STEP below the guess, then twice as far each round; a first round past the
   row's limit starts over once at 1 below, where a row's set may still fit).
   Only blocks with ym_b >= tau are read again; their candidates are packed into a
   per-row buffer by `gather` (top-p rows without top-k: the first round by
   `split_gather`, across programs, in batches up to launch.SPLIT_MAX_B), sorted (in
   the narrowest of three widths that holds them), filtered exactly and drawn with
   token noise (`sample._sorted_draw`).
5. Rows no threshold serves (k above the number of live blocks, more candidates than CAP
   with top-k or than GCAP without (`band` draws over those without sorting them all), a
   row with +inf, a very flat top-p row) write their y to a scratch row and take the
   exact bisection path (`sample._exact_prefix_draw`): slow, exact, rare.

Every decision above is a function of the row's block stats and values, never of the
batch: the token is the same in any batch, bucket or variant.
"""

from __future__ import annotations

import triton
import triton.language as tl

from graphexec.sampling.triton.band import band_draw
from graphexec.sampling.triton.blocks import bias_tile, neg_zero, row_scale, tile_x
from graphexec.sampling.triton.gather import _keys_mass, gather
from graphexec.sampling.triton.philox import block_bits, group_bits, gumbel
from graphexec.sampling.triton.sample import _exact_prefix_draw, _sorted_draw
from graphexec.sampling.triton.select import collapse_inf
from graphexec.sampling.triton.thresholds import (
    block_y,
    candidate_thresholds,
    min_p_bound,
    top_p_total,
)

INT32_MAX = tl.constexpr(2147483647)


@triton.jit
def _holds(top_k, top_p, use_m, tau, tau_m, n, qs, p_total):
    """Whether the candidates y >= tau (n of them, exact mass qs) provably hold the kept
    set: k of them for top-k, p's mass for top-p alone, min-p's bound, or every token."""
    holds = (
        ((top_k > 0) & (n >= top_k))
        | ((top_k == 0) & (top_p < 1.0) & (qs.to(tl.float64) >= p_total))
        | (use_m & (tau <= tau_m))
        | (tau == float("-inf"))
    )  # fmt: skip
    return holds.to(tl.int32)


@triton.jit
def _greedy_token(
    logits_ptr, stride_lb, stride_lv, slot_ptr, rep_ptr, inv_rep_ptr, freq_ptr, pres_ptr,
    bitmask_ptr, stride_mb, stride_mw, counts_ptr, stride_cs, stride_cv,
    prompt_ptr, stride_ps, stride_pv, row,
    xm, mraw, ids, ids_row, vals_row, B, V,
    HAS_BITMASK: tl.constexpr, HAS_COUNTS: tl.constexpr, HAS_PROMPT: tl.constexpr,
    BF16_BITS: tl.constexpr, NBLK_P2: tl.constexpr, DB: tl.constexpr,
):  # fmt: skip
    """First token with x == mraw: the first block whose max is mraw, read again."""
    gb = tl.min(tl.where(xm == mraw, tl.arange(0, NBLK_P2), NBLK_P2), axis=0)
    offs = gb * DB + tl.arange(0, DB)[None, :]
    bias = bias_tile(ids, ids_row, vals_row, offs, gb * DB, gb * DB + DB, neg_zero([1, DB]))
    x = tile_x(logits_ptr, stride_lb, stride_lv, slot_ptr, rep_ptr, inv_rep_ptr, freq_ptr,
               pres_ptr, bitmask_ptr, stride_mb, stride_mw, counts_ptr, stride_cs, stride_cv,
               prompt_ptr, stride_ps, stride_pv, row, offs, bias, B, V,
               HAS_BITMASK, HAS_COUNTS, HAS_PROMPT, BF16_BITS)  # fmt: skip
    return tl.min(tl.min(tl.where(x == mraw, offs, INT32_MAX), axis=1), axis=0)


@triton.jit
def _two_level_token(
    logits_ptr, stride_lb, stride_lv, slot_ptr, rep_ptr, inv_rep_ptr, freq_ptr, pres_ptr,
    bitmask_ptr, stride_mb, stride_mw, counts_ptr, stride_cs, stride_cv,
    prompt_ptr, stride_ps, stride_pv, row,
    xm, q, m, has_inf, inv_t, seed, pos, xm_row, ids, ids_row, vals_row, B, V, NBLK,
    HAS_BITMASK: tl.constexpr, HAS_COUNTS: tl.constexpr, HAS_PROMPT: tl.constexpr,
    BF16_BITS: tl.constexpr, NBLK_P2: tl.constexpr, DB: tl.constexpr,
    TOKEN_STREAM: tl.constexpr, BLOCK_STREAM: tl.constexpr,
):  # fmt: skip
    """Step 6 of the reference for a row with no active filter."""
    b = tl.arange(0, NBLK_P2)
    G: tl.constexpr = DB // 4
    # [G, 4] tiles, token = start + 4g + j: one Philox call per g, no shuffles
    lane = 4 * tl.arange(0, G)[:, None] + tl.arange(0, 4)[None, :]
    if has_inf:
        # bad data, rare: a collapsed block's mass is its count of +inf entries
        n_inf = tl.zeros([NBLK_P2], dtype=tl.int64)
        for blk in range(0, NBLK):
            if tl.load(xm_row + blk) == float("inf"):
                offs = blk * DB + lane
                bias = bias_tile(ids, ids_row, vals_row, offs, blk * DB, blk * DB + DB,
                                 neg_zero([G, 4]))  # fmt: skip
                xi = tile_x(logits_ptr, stride_lb, stride_lv, slot_ptr, rep_ptr, inv_rep_ptr,
                            freq_ptr, pres_ptr, bitmask_ptr, stride_mb, stride_mw, counts_ptr,
                            stride_cs, stride_cv, prompt_ptr, stride_ps, stride_pv, row, offs,
                            bias, B, V, HAS_BITMASK, HAS_COUNTS, HAS_PROMPT, BF16_BITS)  # fmt: skip
                c = tl.sum(tl.sum((xi == float("inf")).to(tl.int64), axis=1), axis=0)
                n_inf = tl.where(b == blk, c, n_inf)
        xm = tl.where(n_inf > 0, 0.0, float("-inf"))
        q = n_inf << 32
    logmass = (xm - m) * inv_t + tl.log(q.to(tl.float32))
    key = tl.where(b < NBLK, logmass + gumbel(block_bits(seed, pos, 0, NBLK_P2, BLOCK_STREAM)),
                   float("-inf"))  # fmt: skip
    top = tl.max(key, axis=0)
    start = tl.min(tl.where(key == top, b, NBLK_P2), axis=0) * DB
    offs = start + lane
    bias = bias_tile(ids, ids_row, vals_row, offs, start, start + DB, neg_zero([G, 4]))
    x = tile_x(logits_ptr, stride_lb, stride_lv, slot_ptr, rep_ptr, inv_rep_ptr, freq_ptr,
               pres_ptr, bitmask_ptr, stride_mb, stride_mw, counts_ptr, stride_cs, stride_cv,
               prompt_ptr, stride_ps, stride_pv, row, offs, bias, B, V,
               HAS_BITMASK, HAS_COUNTS, HAS_PROMPT, BF16_BITS)  # fmt: skip
    y = (collapse_inf(x, has_inf) - m) * inv_t
    s = y + gumbel(group_bits(seed, pos, start, G, TOKEN_STREAM))
    best = tl.max(tl.max(s, axis=1), axis=0)
    return tl.min(tl.min(tl.where(s == best, offs, INT32_MAX), axis=1), axis=0)


@triton.jit
def materialize_y(
    logits_ptr, stride_lb, stride_lv, slot_ptr, rep_ptr, inv_rep_ptr, freq_ptr, pres_ptr,
    bitmask_ptr, stride_mb, stride_mw, counts_ptr, stride_cs, stride_cv,
    prompt_ptr, stride_ps, stride_pv, row,
    m, has_inf, inv_t, min_p, ids, ids_row, vals_row, y_row, B, V,
    HAS_BITMASK: tl.constexpr, HAS_COUNTS: tl.constexpr, HAS_PROMPT: tl.constexpr,
    BF16_BITS: tl.constexpr, YB: tl.constexpr,
):  # fmt: skip
    """Write the row's y (collapsed, scaled); returns (#live, #(exp(y) >= min_p))."""
    n_fin = tl.zeros([], dtype=tl.int32)
    nm = tl.zeros([], dtype=tl.int32)
    for start in range(0, V, YB):
        offs = start + tl.arange(0, YB)[None, :]
        bias = bias_tile(ids, ids_row, vals_row, offs, start, start + YB, neg_zero([1, YB]))
        x = tile_x(logits_ptr, stride_lb, stride_lv, slot_ptr, rep_ptr, inv_rep_ptr, freq_ptr,
                   pres_ptr, bitmask_ptr, stride_mb, stride_mw, counts_ptr, stride_cs,
                   stride_cv, prompt_ptr, stride_ps, stride_pv, row, offs, bias, B, V,
                   HAS_BITMASK, HAS_COUNTS, HAS_PROMPT, BF16_BITS)  # fmt: skip
        y = (collapse_inf(x, has_inf) - m) * inv_t
        tl.store(y_row + offs, y, mask=offs < V)
        live = y > float("-inf")
        n_fin += tl.sum(tl.sum(live.to(tl.int32), axis=1), axis=0)
        nm += tl.sum(tl.sum((live & (tl.exp(y) >= min_p)).to(tl.int32), axis=1), axis=0)
    return n_fin, nm


@triton.jit
def _filtered_token(
    logits_ptr, stride_lb, stride_lv, slot_ptr, rep_ptr, inv_rep_ptr, freq_ptr, pres_ptr,
    bitmask_ptr, stride_mb, stride_mw, counts_ptr, stride_cs, stride_cv,
    prompt_ptr, stride_ps, stride_pv, row,
    xm, q, m, has_inf, inv_t, top_k, top_p, min_p, seed, pos,
    ids, ids_row, vals_row, xm_row, thr_row, cnt_row, split_on, cblk_row, cand_row, y_row, B, V,
    NBLK,
    HAS_BITMASK: tl.constexpr, HAS_COUNTS: tl.constexpr, HAS_PROMPT: tl.constexpr,
    BF16_BITS: tl.constexpr, NBLK_P2: tl.constexpr, GR: tl.constexpr, DB: tl.constexpr,
    CAP: tl.constexpr, GCAP: tl.constexpr, SMALL: tl.constexpr, MID: tl.constexpr,
    ROUNDS: tl.constexpr,
    DENSE_DIV: tl.constexpr, BAND_CH: tl.constexpr, YB: tl.constexpr, STREAM: tl.constexpr,
    INTERP: tl.constexpr, P_STEP: tl.constexpr,
):  # fmt: skip
    """Steps 4-5 of the module docstring for a valid row with an active filter."""
    yb = block_y(xm, m, inv_t, NBLK, NBLK_P2)
    total = top_p_total(yb, q)
    p_total = top_p.to(tl.float64) * total
    tok = tl.full([], -1, tl.int32)
    served = tl.zeros([], dtype=tl.int32)
    if has_inf == 0:
        # top-p rows without top-k: (cert, guess) and the first round's candidates come
        # from `split_gather` when it ran (split_on); the others find their own
        from_split = (split_on != 0) & (top_k == 0) & (top_p < 1.0)
        if from_split:
            cert = tl.load(thr_row)
            guess = tl.load(thr_row + 1)
            n = tl.load(cnt_row)
        else:
            cert, guess = candidate_thresholds(yb, q, top_k, top_p, min_p, NBLK_P2)
            n = tl.zeros([], dtype=tl.int32)
        use_m, tau_m = min_p_bound(top_k, top_p, min_p)
        # top-k's candidates are sorted (CAP wide); the others go to `band`, which takes more
        lim = tl.where(top_k > 0, CAP, GCAP)
        qs = tl.zeros([], dtype=tl.int64)
        tau_prev = tl.full([], float("inf"), tl.float32)
        done = tl.zeros([], dtype=tl.int32)
        step = tl.full([], P_STEP, tl.float32)
        retry = tl.zeros([], dtype=tl.int32)
        if P_STEP > 1.0:
            retry = (guess - P_STEP > cert).to(tl.int32)
        for rnd in range(ROUNDS):
            if (done == 0) & ((n <= lim) | (rnd == 0)):
                tau = tl.maximum(cert, guess - step)
                # the split's round gathers nothing here (threshold +inf) and takes the mass
                # of the split's keys; the gather itself stays unconditional, as it was
                # before the split gather existed
                split_round = from_split & (rnd == 0)
                n, qs = gather(logits_ptr, stride_lb, stride_lv, slot_ptr, rep_ptr, inv_rep_ptr,
                                freq_ptr, pres_ptr, bitmask_ptr, stride_mb, stride_mw,
                                counts_ptr, stride_cs, stride_cv, prompt_ptr, stride_ps,
                                stride_pv, row, yb, tl.where(split_round, float("inf"), tau),
                                tau_prev, n, qs, m, inv_t, ids, ids_row, vals_row, xm_row,
                                cblk_row, cand_row, B, V, NBLK, HAS_BITMASK, HAS_COUNTS,
                                HAS_PROMPT, BF16_BITS, NBLK_P2, GR, DB, GCAP, DENSE_DIV,
                                BAND_CH)  # fmt: skip
                if split_round & (n <= lim):  # past lim the row is not served: no mass
                    qs = _keys_mass(cand_row, 0, n, BAND_CH)
                tau_prev = tau
                done = _holds(top_k, top_p, use_m, tau, tau_m, n, qs, p_total)
                step = step * 2.0
                # a first guess-led round past the limit starts over once at guess - 1: a
                # row whose set fits there is still served
                if (retry != 0) & (n > lim):
                    n = tl.zeros([], dtype=tl.int32)
                    qs = tl.zeros([], dtype=tl.int64)
                    tau_prev = tl.full([], float("inf"), tl.float32)
                    done = tl.zeros([], dtype=tl.int32)
                    step = tl.full([], 1.0, tl.float32)
                retry = tl.zeros([], dtype=tl.int32)
        served = done & (n <= lim).to(tl.int32)
        if served != 0:
            tl.debug_barrier()
            tok = tl.full([], -2, tl.int32)  # not drawn yet
            if n <= SMALL:
                tok = _sorted_draw(cand_row, n, top_k, top_p, min_p, total, seed, pos, SMALL,
                                   STREAM, INTERP)  # fmt: skip
            elif top_k == 0:
                tok = band_draw(cand_row, cand_row + GCAP, n, tau_prev, qs, top_p, min_p, total,
                                seed, pos, SMALL, BAND_CH, STREAM, INTERP)  # fmt: skip
            if tok == -2:
                if n <= MID:
                    tok = _sorted_draw(cand_row, n, top_k, top_p, min_p, total, seed, pos, MID,
                                       STREAM, INTERP)  # fmt: skip
                elif n <= CAP:
                    tok = _sorted_draw(cand_row, n, top_k, top_p, min_p, total, seed, pos, CAP,
                                       STREAM, INTERP)  # fmt: skip
                else:  # a band too wide over more candidates than the widest sort
                    served = tl.zeros([], dtype=tl.int32)
    if served == 0:
        n_fin, nm = materialize_y(logits_ptr, stride_lb, stride_lv, slot_ptr, rep_ptr,
                                  inv_rep_ptr, freq_ptr, pres_ptr, bitmask_ptr, stride_mb,
                                  stride_mw, counts_ptr, stride_cs, stride_cv, prompt_ptr,
                                  stride_ps, stride_pv, row, m, has_inf, inv_t, min_p, ids,
                                  ids_row, vals_row, y_row, B, V, HAS_BITMASK, HAS_COUNTS,
                                  HAS_PROMPT, BF16_BITS, YB)  # fmt: skip
        # a collapsed row's mass is 2**32 per +inf entry
        tot = tl.where(has_inf, n_fin.to(tl.float64) * 4294967296.0, total)
        tl.debug_barrier()
        tok = _exact_prefix_draw(y_row, V, n_fin, nm, tot, top_k, top_p, min_p, seed, pos, YB,
                                 STREAM)  # fmt: skip
    return tok


@triton.jit(do_not_specialize=["B", "NB", "split_on"])
def _row_draw_kernel(
    logits_ptr, stride_lb, stride_lv,  # [B, V] f32 / f16, or bf16 as i16 bits
    slot_ptr,  # [B] i64
    rep_ptr, inv_rep_ptr, freq_ptr, pres_ptr,  # [S] f32
    bitmask_ptr, stride_mb, stride_mw,  # [B, ceil(V/32)] i32
    counts_ptr, stride_cs, stride_cv,  # [S, V] i32
    prompt_ptr, stride_ps, stride_pv,  # [S, V] u8
    bias_ids_ptr, bias_val_ptr, stride_is, stride_vs,  # [S, NB] i32 (sorted, -1 pads), f32
    temp_ptr, inv_temp_ptr, top_k_ptr, top_p_ptr, min_p_ptr,  # [S] f32, f32, i32, f32, f32
    seed_ptr,  # [S] i64
    pos_ptr,  # [B] i64
    xm_ptr, q_ptr,  # [B, NBLK] f32, i64 block stats
    thr_ptr,  # [B, 4] f32: cert, guess, ... of top-p rows without top-k (`split_gather`)
    cnt_ptr,  # [B] i32: their first round's candidates (`split_gather`)
    cblk_ptr,  # [B, NBLK_P2] i32 scratch: candidate blocks
    cand_ptr,  # [B, GCAP + SMALL] i64: packed candidate keys (`split_gather`, then more
    #            rounds), then a band's
    y_ptr,  # [B, V] f32 out: y of rows on the exact path
    tok_ptr,  # [B] i64 out (-1 where nothing is samplable)
    valid_ptr,  # [B] bool out
    B, V, NB, NBLK,
    split_on,  # 1: `split_gather` ran (top-p rows without top-k take its first round)
    HAS_BITMASK: tl.constexpr, HAS_COUNTS: tl.constexpr, HAS_PROMPT: tl.constexpr,
    BF16_BITS: tl.constexpr, FILTERS: tl.constexpr,
    NBIAS_P2: tl.constexpr, NBLK_P2: tl.constexpr, GR: tl.constexpr, DB: tl.constexpr,
    CAP: tl.constexpr, GCAP: tl.constexpr, SMALL: tl.constexpr, MID: tl.constexpr,
    ROUNDS: tl.constexpr,
    DENSE_DIV: tl.constexpr, BAND_CH: tl.constexpr, YB: tl.constexpr, TOKEN_STREAM: tl.constexpr,
    BLOCK_STREAM: tl.constexpr,
    INTERP: tl.constexpr, P_STEP: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    r64 = row.to(tl.int64)
    slot, greedy, inv_t = row_scale(slot_ptr, temp_ptr, inv_temp_ptr, row)
    seed = tl.load(seed_ptr + slot)
    pos = tl.load(pos_ptr + row)
    b = tl.arange(0, NBLK_P2)
    xm = tl.load(xm_ptr + r64 * NBLK + b, mask=b < NBLK, other=float("-inf"))
    q = tl.load(q_ptr + r64 * NBLK + b, mask=b < NBLK, other=0)
    mraw = tl.max(xm, axis=0)
    valid = mraw > float("-inf")
    has_inf = mraw == float("inf")
    m = tl.where(valid & (has_inf == 0), mraw, 0.0)
    jb = tl.arange(0, NBIAS_P2)
    ids_row = bias_ids_ptr + slot * stride_is
    vals_row = bias_val_ptr + slot * stride_vs
    ids = tl.load(ids_row + jb, mask=jb < NB, other=-1)
    y_row = y_ptr + r64 * V
    args = (
        logits_ptr, stride_lb, stride_lv, slot_ptr, rep_ptr, inv_rep_ptr, freq_ptr, pres_ptr,
        bitmask_ptr, stride_mb, stride_mw, counts_ptr, stride_cs, stride_cv,
        prompt_ptr, stride_ps, stride_pv, row,
    )  # fmt: skip
    tok = tl.full([], -1, tl.int32)
    if valid:
        top_k = tl.load(top_k_ptr + slot)
        top_p = tl.load(top_p_ptr + slot)
        min_p = tl.load(min_p_ptr + slot)
        plain = (top_k == 0) & (top_p >= 1.0) & (min_p <= 0.0)
        if not FILTERS:
            plain = tl.full([], 1, tl.int1)
        if greedy:
            tok = _greedy_token(*args, xm, mraw, ids, ids_row, vals_row, B, V, HAS_BITMASK,
                                HAS_COUNTS, HAS_PROMPT, BF16_BITS, NBLK_P2, DB)  # fmt: skip
        elif plain:
            tok = _two_level_token(*args, xm, q, m, has_inf, inv_t, seed, pos, xm_ptr + r64 * NBLK,
                                   ids, ids_row, vals_row, B, V, NBLK, HAS_BITMASK, HAS_COUNTS,
                                   HAS_PROMPT, BF16_BITS, NBLK_P2, DB, TOKEN_STREAM,
                                   BLOCK_STREAM)  # fmt: skip
        elif FILTERS:  # constexpr: the no-filter variant compiles none of it
            tok = _filtered_token(*args, xm, q, m, has_inf, inv_t, top_k, top_p, min_p, seed, pos,
                                  ids, ids_row, vals_row, xm_ptr + r64 * NBLK,
                                  thr_ptr + 4 * r64, cnt_ptr + row, split_on,
                                  cblk_ptr + r64 * NBLK_P2,
                                  cand_ptr + r64 * (GCAP + SMALL),
                                  y_row, B, V, NBLK, HAS_BITMASK, HAS_COUNTS, HAS_PROMPT,
                                  BF16_BITS, NBLK_P2, GR, DB, CAP, GCAP, SMALL, MID, ROUNDS,
                                  DENSE_DIV, BAND_CH, YB, TOKEN_STREAM, INTERP,
                                  P_STEP)  # fmt: skip
    tl.store(tok_ptr + row, tok.to(tl.int64))
    tl.store(valid_ptr + row, valid)
