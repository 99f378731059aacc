"""Split-row passes of the large-vocabulary sampler: every row is cut into SPLIT slices so
that the whole GPU reads, whatever the batch size.

Slices are fixed by V alone, and their partial results are combined with max / min /
integer sums, which do not depend on the order they arrive in: a row's token never
depends on the batch.

1. `_first_pass_kernel` (B x SPLIT): processes the raw logits in registers
   (`process._process_cols`, the logit bias read from a dense per-row scratch that
   `_bias_fill_kernel` / `_bias_scatter_kernel` build for rows that have one), writes x
   when the filters need it again, and per slice: max, first argmax, #finite, #(+inf),
   and the Gumbel-max of x and of the +inf-collapsed x.
2. `_first_combine_kernel` (B): the row's max, greedy / unfiltered token, validity.
3. Filtered rows: `_count_kernel` (B x SPLIT) counts, for D thresholds tau_d = m - delta_d,
   the candidates x >= tau_d and their fixed-point mass; `_choose_kernel` (B) picks the
   tightest tau whose candidates hold the kept set and fit in CAP (or refines the deltas
   for one more round); `_gather_kernel` (B x SPLIT) writes the candidates' packed keys.
   The final sort, filter and draw are `sample._finish_kernel`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from graphexec.sampling.triton.philox import block_bits, gumbel
from graphexec.sampling.triton.process import _process_cols
from graphexec.sampling.triton.select import collapse_inf, mass, pack

INT32_MAX = tl.constexpr(2147483647)


@triton.jit
def _bias_fill_kernel(
    slot_ptr,  # [B] i64
    bias_ids_ptr, stride_is,  # [S, NB] i32, -1 = padding (ids sorted: [0] < 0 = no bias)
    dense_ptr,  # [B, V] f32 scratch, written only for rows with a bias
    V, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    slot = tl.load(slot_ptr + row).to(tl.int64)
    if tl.load(bias_ids_ptr + slot * stride_is) >= 0:
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        # -0.0 is the exact additive identity (see process.py)
        neg_zero = tl.full([BLOCK], -(2**31), tl.int32).to(tl.float32, bitcast=True)
        tl.store(dense_ptr + row.to(tl.int64) * V + offs, neg_zero, mask=offs < V)


@triton.jit
def _bias_scatter_kernel(
    slot_ptr,  # [B] i64
    bias_ids_ptr, stride_is,  # [S, NB] i32
    bias_val_ptr, stride_vs,  # [S, NB] f32
    dense_ptr,  # [B, V] f32 scratch
    V, NB, BLOCK_NB: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    slot = tl.load(slot_ptr + row).to(tl.int64)
    j = tl.arange(0, BLOCK_NB)
    ids = tl.load(bias_ids_ptr + slot * stride_is + j, mask=j < NB, other=-1)
    vals = tl.load(bias_val_ptr + slot * stride_vs + j, mask=j < NB, other=0.0)
    ok = (ids >= 0) & (ids < V)
    tl.store(dense_ptr + row.to(tl.int64) * V + tl.where(ok, ids, 0), vals, mask=ok)


@triton.jit
def _first_pass_kernel(
    logits_ptr, stride_lb, stride_lv,  # [B, V] f32 / bf16 / f16
    slot_ptr,  # [B] i64
    temp_ptr, inv_temp_ptr, rep_ptr, inv_rep_ptr, freq_ptr, pres_ptr,  # [S] f32
    bitmask_ptr, stride_mb, stride_mw,  # [B, W] i32
    counts_ptr, stride_cs, stride_cv,  # [S, V] i32
    prompt_ptr, stride_ps, stride_pv,  # [S, V] u8
    bias_ids_ptr, stride_is,  # [S, NB] i32
    dense_ptr,  # [B, V] f32 bias scratch
    pos_ptr, seed_ptr,  # [B] i64, [S] i64
    x_ptr,  # [B, V] f32 out (if WRITE_X)
    part_f_ptr,  # [B, SPLIT, 3] f32 out: max, best score, best collapsed score
    part_i_ptr,  # [B, SPLIT, 5] i32 out: argmax, #finite, #(+inf), best id, best collapsed id
    B, V, SLICE,
    HAS_BITMASK: tl.constexpr, HAS_COUNTS: tl.constexpr, HAS_PROMPT: tl.constexpr,
    BF16_BITS: tl.constexpr, WRITE_X: tl.constexpr, DRAW: tl.constexpr, STREAM: tl.constexpr,
    SPLIT: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    sp = tl.program_id(1)
    r64 = row.to(tl.int64)
    slot = tl.load(slot_ptr + row).to(tl.int64)
    has_bias = tl.load(bias_ids_ptr + slot * stride_is) >= 0
    greedy = tl.load(temp_ptr + slot) == 0.0
    seed = tl.load(seed_ptr + slot)
    pos = tl.load(pos_ptr + row)
    rows = tl.zeros([1], dtype=tl.int32) + row
    m = tl.full([], float("-inf"), tl.float32)
    am = tl.zeros([], dtype=tl.int32)
    n_live = tl.zeros([], dtype=tl.int32)
    n_pinf = tl.zeros([], dtype=tl.int32)
    best = tl.full([], float("-inf"), tl.float32)
    bi = tl.full([], -1, tl.int32)
    best_c = tl.full([], float("-inf"), tl.float32)
    bi_c = tl.full([], -1, tl.int32)
    lo = sp * SLICE
    for start in range(lo, lo + SLICE, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        ok = offs < V
        cols = offs[None, :]
        # rows without a bias read nothing and add -0.0, the exact additive identity
        hb = (tl.zeros([1, BLOCK], dtype=tl.int32) + has_bias.to(tl.int32)) != 0
        bias = tl.load(dense_ptr + r64 * V + cols, mask=ok[None, :] & hb, other=0.0)
        bias = tl.where(hb, bias, tl.full([1, BLOCK], -(2**31), tl.int32).to(tl.float32, bitcast=True))
        x2 = _process_cols(
            logits_ptr, stride_lb, stride_lv, slot_ptr,
            temp_ptr, inv_temp_ptr, rep_ptr, inv_rep_ptr, freq_ptr, pres_ptr,
            bitmask_ptr, stride_mb, stride_mw, counts_ptr, stride_cs, stride_cv,
            prompt_ptr, stride_ps, stride_pv,
            rows, cols, ok[None, :], bias, B, HAS_BITMASK, HAS_COUNTS, HAS_PROMPT, BF16_BITS,
        )  # fmt: skip
        x = tl.where(ok, tl.reshape(x2, (BLOCK,)), float("-inf"))
        if WRITE_X:
            tl.store(x_ptr + r64 * V + offs, x, mask=ok)
        cm = tl.max(x, axis=0)
        am = tl.where(cm > m, tl.min(tl.where(x == cm, offs, INT32_MAX), axis=0), am)
        m = tl.maximum(m, cm)
        n_live += tl.sum((x > float("-inf")).to(tl.int32))
        n_pinf += tl.sum((x == float("inf")).to(tl.int32))
        if DRAW:
            if greedy == 0:
                g = gumbel(block_bits(seed, pos, start, BLOCK, STREAM))
                s = x + g
                cs = tl.max(s, axis=0)
                bi = tl.where(cs > best, tl.min(tl.where(s == cs, offs, INT32_MAX), axis=0), bi)
                best = tl.maximum(best, cs)
                # the same draw over the +inf-collapsed row: only +inf entries compete
                sc = tl.where(x == float("inf"), g, float("-inf"))
                cc = tl.max(sc, axis=0)
                bi_c = tl.where(cc > best_c, tl.min(tl.where(sc == cc, offs, INT32_MAX), axis=0), bi_c)
                best_c = tl.maximum(best_c, cc)
    pf = part_f_ptr + (r64 * SPLIT + sp) * 3
    tl.store(pf, m)
    tl.store(pf + 1, best)
    tl.store(pf + 2, best_c)
    pi = part_i_ptr + (r64 * SPLIT + sp) * 5
    tl.store(pi, am)
    tl.store(pi + 1, n_live)
    tl.store(pi + 2, n_pinf)
    tl.store(pi + 3, bi)
    tl.store(pi + 4, bi_c)


@triton.jit
def _first_combine_kernel(
    part_f_ptr,  # [B, SPLIT, 3] f32
    part_i_ptr,  # [B, SPLIT, 5] i32
    slot_ptr, temp_ptr,  # [B] i64, [S] f32
    top_k_ptr, top_p_ptr, min_p_ptr,  # [S] i32, f32, f32
    stat_f_ptr,  # [B, 1] f32 out: the (collapsed) row max
    stat_i_ptr,  # [B, 2] i32 out: has +inf, #finite (collapsed)
    tok_ptr,  # [B] i64 out: greedy / unfiltered token
    valid_ptr,  # [B] bool out
    state_ptr,  # [B] i32 out: 0 = search a threshold, 2 = token final (greedy, no filter)
    delta_ptr,  # [B, D] f32 out: first thresholds to try, tau_d = m - delta_d
    FILTERS: tl.constexpr, D: tl.constexpr, SPLIT: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    r64 = row.to(tl.int64)
    s = tl.arange(0, SPLIT)
    pf = part_f_ptr + (r64 * SPLIT + s) * 3
    pi = part_i_ptr + (r64 * SPLIT + s) * 5
    ms = tl.load(pf)
    m = tl.max(ms, axis=0)
    am = tl.min(tl.where(ms == m, tl.load(pi), INT32_MAX), axis=0)
    n_live = tl.sum(tl.load(pi + 1), axis=0)
    n_pinf = tl.sum(tl.load(pi + 2), axis=0)
    has_inf = m == float("inf")
    bs = tl.where(has_inf, tl.load(pf + 2), tl.load(pf + 1))
    bids = tl.where(has_inf, tl.load(pi + 4), tl.load(pi + 3))
    best = tl.max(bs, axis=0)
    bi = tl.min(tl.where(bs == best, bids, INT32_MAX), axis=0)
    slot = tl.load(slot_ptr + row)
    greedy = tl.load(temp_ptr + slot) == 0.0
    valid = m > float("-inf")
    tok = tl.where(greedy, am, bi)
    tl.store(tok_ptr + row, tl.where(valid, tok, -1).to(tl.int64))
    tl.store(valid_ptr + row, valid)
    tl.store(stat_f_ptr + row, tl.where(has_inf, 0.0, tl.where(valid, m, 0.0)))
    tl.store(stat_i_ptr + r64 * 2, has_inf.to(tl.int32))
    tl.store(stat_i_ptr + r64 * 2 + 1, tl.where(has_inf, n_pinf, n_live))
    final = greedy | (valid == 0)
    if FILTERS:
        plain = (
            (tl.load(top_k_ptr + slot) == 0)
            & (tl.load(top_p_ptr + slot) >= 1.0)
            & (tl.load(min_p_ptr + slot) <= 0.0)
        )
        final = final | plain
        di = tl.arange(0, D)
        tl.store(delta_ptr + r64 * D + di, 0.5 * tl.exp2(di.to(tl.float32)))
    else:
        final = final | True
    tl.store(state_ptr + row, tl.where(final, 2, 0))


@triton.jit
def _count_kernel(
    x_ptr,  # [B, V] f32
    stat_f_ptr, stat_i_ptr,  # [B, 1] f32, [B, 2] i32 (from _first_combine_kernel)
    delta_ptr,  # [B, D] f32 thresholds tau_d = m - delta_d
    state_ptr,  # [B] i32: 0 = searching, 1 = done, 2 = no search needed
    slot_ptr, min_p_ptr,  # [B] i64, [S] f32
    n_ptr,  # [B, SPLIT, D] i32 out: #(finite x >= tau_d)
    q_ptr,  # [B, SPLIT, D + 1] i64 out: their mass; [D]: the slice's whole mass
    nm_ptr,  # [B, SPLIT] i32 out: #(exp(x - m) >= min_p)
    V, SLICE,
    D: tl.constexpr, SPLIT: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    sp = tl.program_id(1)
    r64 = row.to(tl.int64)
    if tl.load(state_ptr + row) == 0:
        m = tl.load(stat_f_ptr + row)
        has_inf = tl.load(stat_i_ptr + r64 * 2) != 0
        min_p = tl.load(min_p_ptr + tl.load(slot_ptr + row))
        d = tl.arange(0, D)
        tau = m - tl.load(delta_ptr + r64 * D + d)
        n = tl.zeros([D], dtype=tl.int32)
        qc = tl.zeros([D], dtype=tl.int64)
        qt = tl.zeros([], dtype=tl.int64)
        nm = tl.zeros([], dtype=tl.int32)
        lo = sp * SLICE
        for start in range(lo, lo + SLICE, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            x = collapse_inf(tl.load(x_ptr + r64 * V + offs, mask=offs < V, other=float("-inf")), has_inf)
            live = x > float("-inf")
            q = tl.where(live, mass(x, m), 0)
            sel = live[:, None] & (x[:, None] >= tau[None, :])
            n += tl.sum(sel.to(tl.int32), axis=0)
            qc += tl.sum(tl.where(sel, q[:, None], 0), axis=0)
            qt += tl.sum(q, axis=0)
            nm += tl.sum((live & (tl.exp(x - m) >= min_p)).to(tl.int32), axis=0)
        base = r64 * SPLIT + sp
        tl.store(n_ptr + base * D + d, n)
        tl.store(q_ptr + base * (D + 1) + d, qc)
        tl.store(q_ptr + base * (D + 1) + D, qt)
        tl.store(nm_ptr + base, nm)


@triton.jit
def _choose_kernel(
    n_ptr, q_ptr, nm_ptr,  # partials of _count_kernel
    stat_i_ptr,  # [B, 2] i32
    slot_ptr, top_k_ptr, top_p_ptr,  # [B] i64, [S] i32, [S] f32
    delta_ptr,  # [B, D] f32 in/out
    state_ptr,  # [B] i32 in/out
    tau_ptr,  # [B] f32 out: chosen delta (the gather uses m - delta)
    qt_ptr,  # [B] i64 out: the row's whole mass
    nm_out_ptr,  # [B] i32 out
    CAP, D: tl.constexpr, SPLIT: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    r64 = row.to(tl.int64)
    if tl.load(state_ptr + row) == 0:
        s = tl.arange(0, SPLIT)[:, None]
        d = tl.arange(0, D)[None, :]
        n = tl.sum(tl.load(n_ptr + (r64 * SPLIT + s) * D + d), axis=0)
        qc = tl.sum(tl.load(q_ptr + (r64 * SPLIT + s) * (D + 1) + d), axis=0)
        qt = tl.sum(tl.load(q_ptr + (r64 * SPLIT + tl.arange(0, SPLIT)) * (D + 1) + D), axis=0)
        nm = tl.sum(tl.load(nm_ptr + r64 * SPLIT + tl.arange(0, SPLIT)), axis=0)
        n_fin = tl.load(stat_i_ptr + r64 * 2 + 1)
        slot = tl.load(slot_ptr + row)
        # broadcast the row's scalars to [D] (the interpreter mixes scalar and vector bools badly)
        top_k = tl.zeros([D], dtype=tl.int32) + tl.load(top_k_ptr + slot)
        top_p = tl.zeros([D], dtype=tl.float32) + tl.load(top_p_ptr + slot)
        covers = (
            ((top_k > 0) & (n >= top_k))
            | ((top_k == 0) & (top_p < 1.0) & (qc.to(tl.float64) >= top_p.to(tl.float64) * qt.to(tl.float64)))
            | (n >= nm)  # nm = n_fin when min-p is off
            | (n >= n_fin)
        )  # fmt: skip
        enough = covers & ((top_p >= 1.0) | (top_k == 0) | (n >= top_k))
        ok = enough & (n <= CAP)
        deltas = tl.load(delta_ptr + r64 * D + tl.arange(0, D))
        di = tl.arange(0, D)
        first_ok = tl.min(tl.where(ok, di, D), axis=0)
        tl.store(qt_ptr + row, qt)
        tl.store(nm_out_ptr + row, nm)
        if first_ok < D:
            tl.store(tau_ptr + row, tl.sum(tl.where(di == first_ok, deltas, 0.0), axis=0))
            tl.store(state_ptr + row, 1)
        else:
            # refine between the widest "not enough" and the narrowest "enough" delta
            last_short = tl.max(tl.where(enough, -1, di), axis=0)
            first_enough = tl.min(tl.where(enough, di, D), axis=0)
            d_lo = tl.sum(tl.where(di == last_short, deltas, 0.0), axis=0)
            d_hi = tl.sum(tl.where(di == first_enough, deltas, 0.0), axis=0)
            d_lo = tl.where(last_short < 0, 0.0, d_lo)
            d_hi = tl.where(first_enough >= D, 4.0 * d_lo + 64.0, d_hi)
            step = (d_hi - d_lo) / (D + 1)
            tl.store(delta_ptr + r64 * D + di, d_lo + step * (di + 1).to(tl.float32))


@triton.jit
def _gather_kernel(
    x_ptr,  # [B, V] f32
    stat_f_ptr, stat_i_ptr,  # [B, 1] f32, [B, 2] i32
    state_ptr, tau_ptr,  # [B] i32, [B] f32 (chosen delta)
    cnt_ptr,  # [B] i32 zeroed: candidates written so far
    cand_ptr,  # [B, CAP] i64 out: packed keys, in no particular order (sorted later)
    V, SLICE, CAP: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    sp = tl.program_id(1)
    r64 = row.to(tl.int64)
    if tl.load(state_ptr + row) == 1:
        m = tl.load(stat_f_ptr + row)
        has_inf = tl.load(stat_i_ptr + r64 * 2) != 0
        tau = m - tl.load(tau_ptr + row)
        lo = sp * SLICE
        for start in range(lo, lo + SLICE, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            x = collapse_inf(tl.load(x_ptr + r64 * V + offs, mask=offs < V, other=float("-inf")), has_inf)
            sel = (x >= tau) & (x > float("-inf"))
            k = tl.sum(sel.to(tl.int32), axis=0)
            if k > 0:
                base = tl.atomic_add(cnt_ptr + row, k)
                idx = base + tl.cumsum(sel.to(tl.int32), axis=0) - 1
                tl.store(cand_ptr + r64 * CAP + idx, pack(x, offs), mask=sel & (idx < CAP))
