"""Split-row passes of the large-vocabulary sampler: every row is cut into SPLIT slices so
that the whole GPU reads, whatever the batch size.

Slices are fixed by V alone, and partial results are combined with max / min / integer
sums, which do not depend on the order they arrive in: a row's token never depends on the
batch. In order:

1. `_bias_fill_kernel`, `_bias_scatter_kernel`: a dense per-row bias scratch, built (and
   later read) only for rows that have a logit bias.
2. `_row_pass_kernel` in STATS mode (B x SPLIT): processes the raw logits in registers
   (`process._process_cols`) and keeps per slice: max, first argmax, #finite, #(+inf);
   for plain rows also the block stats of the two-level draw.
3. `_stats_combine_kernel` (B): the row max m, the greedy token, validity, and each row's
   state: 2 = final (greedy or nothing samplable), 3 = draw unfiltered, 0 = filter.
4. State-3 rows: `two_level._two_level_draw_kernel` (B) picks a block from the STATS
   pass's block stats and draws the token inside it (no second read of the row).
   `_row_pass_kernel` in DRAW mode processes again and writes y = (collapse(x) - m) * 1/T
   for the rows and passes that need it (filtered rows; logprobs).
5. Filtered rows: `_count_kernel` (B x SPLIT) counts, for D thresholds tau_d = -delta_d,
   the candidates y >= tau_d and their fixed-point mass; `_choose_kernel` (B) picks the
   tightest tau whose candidates hold the kept set and fit in CAP (else it refines the
   deltas for another round); `_gather_kernel` (B x SPLIT) writes the candidates' packed
   keys; `sample._finish_kernel` sorts, filters and draws.
"""

from __future__ import annotations

import triton
import triton.language as tl

from graphexec.sampling.triton.process import _process_chunk
from graphexec.sampling.triton.select import collapse_inf, pack
from graphexec.sampling.triton.two_level import block_stats

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
        # -0.0 is the exact additive identity (see process.py)
        neg_zero = tl.full([BLOCK], -(2**31), tl.int32).to(tl.float32, bitcast=True)
        for start in range(0, V, BLOCK):
            offs = start + tl.arange(0, BLOCK)
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
def _count_slice(y_ptr, r64, V, lo, hi, tau, min_p, NEED_MASS, NEED_NM, D: tl.constexpr,
                 BLOCK: tl.constexpr):  # fmt: skip
    """Over y[lo:hi] of a row: (#(y >= tau_d) [D], their mass [D] i64, the slice's mass,
    #(exp(y) >= min_p)); masses only when NEED_MASS, the last only when NEED_NM."""
    n = tl.zeros([D], dtype=tl.int32)
    qc = tl.zeros([D], dtype=tl.int64)
    qt = tl.zeros([], dtype=tl.int64)
    nm = tl.zeros([], dtype=tl.int32)
    if NEED_MASS | NEED_NM:
        for start in range(lo, hi, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            y = tl.load(y_ptr + r64 * V + offs, mask=offs < V, other=float("-inf"))
            live = y > float("-inf")
            sel = live[:, None] & (y[:, None] >= tau[None, :])
            n += tl.sum(sel.to(tl.int32), axis=0)
            rel = tl.exp(y)
            q = tl.where(live, (rel * 4294967296.0).to(tl.int64), 0)
            qc += tl.sum(tl.where(sel, q[:, None], 0), axis=0)
            qt += tl.sum(q, axis=0)
            nm += tl.sum((live & (rel >= min_p)).to(tl.int32), axis=0)
    else:
        for start in range(lo, hi, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            y = tl.load(y_ptr + r64 * V + offs, mask=offs < V, other=float("-inf"))
            sel = (y > float("-inf"))[:, None] & (y[:, None] >= tau[None, :])
            n += tl.sum(sel.to(tl.int32), axis=0)
    return n, qc, qt, nm


@triton.jit
def _store_counts(n_ptr, q_ptr, nm_ptr, base, n, qc, qt, nm, D: tl.constexpr):
    d = tl.arange(0, D)
    tl.store(n_ptr + base * D + d, n)
    tl.store(q_ptr + base * (D + 1) + d, qc)
    tl.store(q_ptr + base * (D + 1) + D, qt)
    tl.store(nm_ptr + base, nm)


@triton.jit
def _search_needs(slot, top_k_ptr, top_p_ptr, min_p_ptr):
    """(needs masses, needs the min-p count, min_p) of a row that searches a threshold."""
    min_p = tl.load(min_p_ptr + slot)
    need_mass = (tl.load(top_k_ptr + slot) == 0) & (tl.load(top_p_ptr + slot) < 1.0)
    return need_mass, min_p > 0.0, min_p


@triton.jit
def _row_pass_kernel(
    logits_ptr, stride_lb, stride_lv,  # [B, V] f32 / bf16 / f16
    slot_ptr,  # [B] i64
    rep_ptr, inv_rep_ptr, freq_ptr, pres_ptr,  # [S] f32
    bitmask_ptr, stride_mb, stride_mw,  # [B, W] i32
    counts_ptr, stride_cs, stride_cv,  # [S, V] i32
    prompt_ptr, stride_ps, stride_pv,  # [S, V] u8
    bias_ids_ptr, stride_is,  # [S, NB] i32
    dense_ptr,  # [B, V] f32 bias scratch
    temp_ptr, inv_temp_ptr,  # [S] f32
    top_k_ptr, top_p_ptr, min_p_ptr,  # [S] i32, f32, f32
    stat_f_ptr, stat_i_ptr, state_ptr,  # [B] f32 row max, [B, 2] i32, [B] i32 (DRAW mode)
    delta_ptr,  # [B, D] f32 first thresholds (DRAW mode, rows in state 0)
    y_ptr,  # [B, V] f32 out: scaled rows y (DRAW mode, if WRITE_Y)
    part_f_ptr,  # [B, SPLIT] f32 out: slice max (STATS) / best score (DRAW)
    part_i_ptr,  # [B, SPLIT, 3] i32 out: first argmax, #finite, #(+inf) / best id
    n_ptr, q_ptr, nm_ptr,  # threshold counts out (DRAW mode), as in _count_kernel
    bxm_ptr, bq_ptr,  # [B, NBLK] out: two-level block stats (STATS mode, plain rows)
    B, V, SLICE, NBLK,
    HAS_BITMASK: tl.constexpr, HAS_COUNTS: tl.constexpr, HAS_PROMPT: tl.constexpr,
    BF16_BITS: tl.constexpr, DRAW: tl.constexpr, WRITE_Y: tl.constexpr, FILTERS: tl.constexpr,
    D: tl.constexpr, SPLIT: tl.constexpr, BLOCK: tl.constexpr, DB: tl.constexpr,
):  # fmt: skip
    """One slice of one row, processed from the raw logits in registers.

    STATS mode (DRAW False): the slice's max, first argmax, #finite and #(+inf); for
    plain rows (not greedy, no active filter) also the two-level block stats of every
    block in the slice (`two_level.block_stats`).
    DRAW mode: y = (collapse(x) - m) * inv_t, stored when WRITE_Y; for rows in state 0
    the counts of the first threshold round.
    Each case has its own branch-free loop (a branch inside a loop stops Triton from
    pipelining its loads). Maxima and argmaxes are kept per lane across the chunks and
    reduced once at the end (a lane sees increasing ids: strict > keeps its first maximum).
    """
    row = tl.program_id(0)
    sp = tl.program_id(1)
    r64 = row.to(tl.int64)
    slot = tl.load(slot_ptr + row).to(tl.int64)
    has_bias = tl.load(bias_ids_ptr + slot * stride_is) >= 0
    G: tl.constexpr = BLOCK // 4
    # chunks are [G, 4] tiles, token = start + 4g + j: one Philox call per g, no shuffles
    lane = 4 * tl.arange(0, G)[:, None] + tl.arange(0, 4)[None, :]
    best = tl.full([G, 4], float("-inf"), tl.float32)
    bi = tl.zeros([G, 4], dtype=tl.int32)
    n_live = tl.zeros([G, 4], dtype=tl.int32)
    n_pinf = tl.zeros([G, 4], dtype=tl.int32)
    lo = sp * SLICE
    hi = lo + SLICE
    args = (
        logits_ptr, stride_lb, stride_lv, slot_ptr, rep_ptr, inv_rep_ptr, freq_ptr, pres_ptr,
        bitmask_ptr, stride_mb, stride_mw, counts_ptr, stride_cs, stride_cv,
        prompt_ptr, stride_ps, stride_pv, dense_ptr, has_bias, row,
    )  # fmt: skip
    if DRAW:
        m = tl.load(stat_f_ptr + row)
        has_inf = tl.load(stat_i_ptr + r64 * 2) != 0
        greedy = tl.load(temp_ptr + slot) == 0.0
        inv_t = tl.where(greedy, 1.0, tl.load(inv_temp_ptr + slot))
        state = tl.load(state_ptr + row)
        if state == 0:
            need_mass, need_nm, min_p = _search_needs(slot, top_k_ptr, top_p_ptr, min_p_ptr)
            tau = -tl.load(delta_ptr + r64 * D + tl.arange(0, D))
            qc = tl.zeros([D], dtype=tl.int64)
            qt = tl.zeros([], dtype=tl.int64)
            nm = tl.zeros([], dtype=tl.int32)
            # per-lane counts of thresholds passed, reduced once after the loop
            n_lane = tl.zeros([G, 4, D], dtype=tl.int32)
            for start in range(lo, hi, BLOCK):
                offs = start + lane
                x = _process_chunk(*args, offs, B, V, HAS_BITMASK, HAS_COUNTS, HAS_PROMPT,
                                   BF16_BITS)  # fmt: skip
                y = (collapse_inf(x, has_inf) - m) * inv_t
                tl.store(y_ptr + r64 * V + offs, y, mask=offs < V)
                live = (y > float("-inf"))[:, :, None]
                n_lane += (live & (y[:, :, None] >= tau[None, None, :])).to(tl.int32)
            n = tl.sum(tl.sum(n_lane, axis=0), axis=0)
            if need_mass | need_nm:
                # masses: a second look at the row just written (rare: top-p without top-k)
                n, qc, qt, nm = _count_slice(y_ptr, r64, V, lo, hi, tau, min_p, need_mass,
                                             need_nm, D, BLOCK)  # fmt: skip
            _store_counts(n_ptr, q_ptr, nm_ptr, r64 * SPLIT + sp, n, qc, qt, nm, D)
        elif WRITE_Y:
            for start in range(lo, hi, BLOCK):
                offs = start + lane
                x = _process_chunk(*args, offs, B, V, HAS_BITMASK, HAS_COUNTS, HAS_PROMPT,
                                   BF16_BITS)  # fmt: skip
                tl.store(y_ptr + r64 * V + offs, (collapse_inf(x, has_inf) - m) * inv_t,
                         mask=offs < V)  # fmt: skip
    else:
        plain = tl.load(temp_ptr + slot) != 0.0
        if FILTERS:
            plain = plain & (
                (tl.load(top_k_ptr + slot) == 0)
                & (tl.load(top_p_ptr + slot) >= 1.0)
                & (tl.load(min_p_ptr + slot) <= 0.0)
            )
        if plain:
            inv_t = tl.load(inv_temp_ptr + slot)
            for start in range(lo, hi, BLOCK):
                offs = start + lane
                x = _process_chunk(*args, offs, B, V, HAS_BITMASK, HAS_COUNTS, HAS_PROMPT,
                                   BF16_BITS)  # fmt: skip
                # only the max: the argmax (greedy) and the counts (filters) are not needed
                best = tl.maximum(best, x)
                block_stats(x, start, inv_t, r64, NBLK, bxm_ptr, bq_ptr, BLOCK, DB)
        else:
            for start in range(lo, hi, BLOCK):
                offs = start + lane
                x = _process_chunk(*args, offs, B, V, HAS_BITMASK, HAS_COUNTS, HAS_PROMPT,
                                   BF16_BITS)  # fmt: skip
                bi = tl.where(x > best, offs, bi)
                best = tl.maximum(best, x)
                n_live += (x > float("-inf")).to(tl.int32)
                n_pinf += (x == float("inf")).to(tl.int32)
    top = tl.max(tl.max(best, axis=1), axis=0)
    base = r64 * SPLIT + sp
    first = tl.min(tl.min(tl.where(best == top, bi, INT32_MAX), axis=1), axis=0)
    tl.store(part_f_ptr + base, top)
    tl.store(part_i_ptr + base * 3, first)
    tl.store(part_i_ptr + base * 3 + 1, tl.sum(tl.sum(n_live, axis=1), axis=0))
    tl.store(part_i_ptr + base * 3 + 2, tl.sum(tl.sum(n_pinf, axis=1), axis=0))


@triton.jit
def _stats_combine_kernel(
    part_f_ptr,  # [B, SPLIT] f32 slice max
    part_i_ptr,  # [B, SPLIT, 3] i32 first argmax, #finite, #(+inf)
    slot_ptr, temp_ptr,  # [B] i64, [S] f32
    top_k_ptr, top_p_ptr, min_p_ptr,  # [S] i32, f32, f32
    stat_f_ptr,  # [B] f32 out: the collapsed row max (0 where nothing is samplable)
    stat_i_ptr,  # [B, 2] i32 out: has +inf, #finite (collapsed)
    tok_ptr,  # [B] i64 out: the greedy token (-1 where nothing is samplable)
    valid_ptr,  # [B] bool out
    state_ptr,  # [B] i32 out: 0 = search a threshold, 2 = token final, 3 = draw unfiltered
    delta_ptr,  # [B, D] f32 out: first thresholds to try, tau_d = -delta_d
    FILTERS: tl.constexpr, D: tl.constexpr, SPLIT: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    r64 = row.to(tl.int64)
    s = tl.arange(0, SPLIT)
    pi = part_i_ptr + (r64 * SPLIT + s) * 3
    ms = tl.load(part_f_ptr + r64 * SPLIT + s)
    m = tl.max(ms, axis=0)
    am = tl.min(tl.where(ms == m, tl.load(pi), INT32_MAX), axis=0)
    n_live = tl.sum(tl.load(pi + 1), axis=0)
    n_pinf = tl.sum(tl.load(pi + 2), axis=0)
    has_inf = m == float("inf")
    slot = tl.load(slot_ptr + row)
    greedy = tl.load(temp_ptr + slot) == 0.0
    valid = m > float("-inf")
    tl.store(tok_ptr + row, tl.where(valid, am, -1).to(tl.int64))
    tl.store(valid_ptr + row, valid)
    tl.store(stat_f_ptr + row, tl.where(has_inf, 0.0, tl.where(valid, m, 0.0)))
    tl.store(stat_i_ptr + r64 * 2, has_inf.to(tl.int32))
    tl.store(stat_i_ptr + r64 * 2 + 1, tl.where(has_inf, n_pinf, n_live))
    plain = valid & (greedy == 0)
    if FILTERS:
        plain = plain & (
            (tl.load(top_k_ptr + slot) == 0)
            & (tl.load(top_p_ptr + slot) >= 1.0)
            & (tl.load(min_p_ptr + slot) <= 0.0)
        )
        di = tl.arange(0, D)
        tl.store(delta_ptr + r64 * D + di, 0.5 * tl.exp2(di.to(tl.float32)))
    search = valid & (greedy == 0) & (plain == 0)
    tl.store(state_ptr + row, tl.where(plain, 3, tl.where(search, 0, 2)))


@triton.jit
def _count_kernel(
    y_ptr,  # [B, V] f32 scaled rows
    delta_ptr,  # [B, D] f32 thresholds tau_d = -delta_d
    state_ptr,  # [B] i32: only rows in state 0 count
    slot_ptr, top_k_ptr, top_p_ptr, min_p_ptr,  # [B] i64, [S] i32, f32, f32
    n_ptr,  # [B, SPLIT, D] i32 out: #(finite y >= tau_d)
    q_ptr,  # [B, SPLIT, D + 1] i64 out: their mass; [D]: the slice's whole mass
    nm_ptr,  # [B, SPLIT] i32 out: #(exp(y) >= min_p)
    V, SLICE,
    D: tl.constexpr, SPLIT: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """Another threshold round over the stored y, for rows still searching."""
    row = tl.program_id(0)
    sp = tl.program_id(1)
    r64 = row.to(tl.int64)
    if tl.load(state_ptr + row) == 0:
        slot = tl.load(slot_ptr + row)
        need_mass, need_nm, min_p = _search_needs(slot, top_k_ptr, top_p_ptr, min_p_ptr)
        tau = -tl.load(delta_ptr + r64 * D + tl.arange(0, D))
        lo = sp * SLICE
        n, qc, qt, nm = _count_slice(y_ptr, r64, V, lo, lo + SLICE, tau, min_p, need_mass,
                                     need_nm, D, BLOCK)  # fmt: skip
        _store_counts(n_ptr, q_ptr, nm_ptr, r64 * SPLIT + sp, n, qc, qt, nm, D)


@triton.jit
def _choose_kernel(
    n_ptr, q_ptr, nm_ptr,  # partials of _count_kernel
    stat_i_ptr,  # [B, 2] i32
    slot_ptr, top_k_ptr, top_p_ptr, min_p_ptr,  # [B] i64, [S] i32, f32, f32
    delta_ptr,  # [B, D] f32 in/out
    state_ptr,  # [B] i32 in/out
    tau_ptr,  # [B] f32 out: chosen delta (the gather keeps y >= -delta)
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
        min_p = tl.zeros([D], dtype=tl.float32) + tl.load(min_p_ptr + slot)
        qt_f = qt.to(tl.float64)
        covers = (
            ((top_k > 0) & (n >= top_k))
            | ((top_k == 0) & (top_p < 1.0) & (qc.to(tl.float64) >= top_p.to(tl.float64) * qt_f))
            | ((min_p > 0.0) & (n >= nm))
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
            # the last new delta is d_hi itself: "enough" there, so a later round that
            # allows a wider sort can still take it
            step = (d_hi - d_lo) / D
            tl.store(delta_ptr + r64 * D + di, d_lo + step * (di + 1).to(tl.float32))


@triton.jit
def _gather_kernel(
    y_ptr,  # [B, V] f32 scaled rows
    state_ptr, tau_ptr,  # [B] i32, [B] f32 (chosen delta)
    cnt_ptr,  # [B] i32 zeroed: candidates written so far
    cand_ptr,  # [B, CAP] i64 out: packed keys, in no particular order (sorted later)
    V, SLICE, CAP: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    sp = tl.program_id(1)
    r64 = row.to(tl.int64)
    if tl.load(state_ptr + row) == 1:
        tau = -tl.load(tau_ptr + row)
        lo = sp * SLICE
        for start in range(lo, lo + SLICE, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            y = tl.load(y_ptr + r64 * V + offs, mask=offs < V, other=float("-inf"))
            sel = (y >= tau) & (y > float("-inf"))
            k = tl.sum(sel.to(tl.int32), axis=0)
            # the order candidates land in does not matter: _finish_kernel sorts them
            base = tl.atomic_add(cnt_ptr + row, k, sem="relaxed")
            idx = base + tl.cumsum(sel.to(tl.int32), axis=0) - 1
            tl.store(cand_ptr + r64 * CAP + idx, pack(y, offs), mask=sel & (idx < CAP))
