"""The logprobs writers: the sampled token's logprob and rank, and the top-N, as
`reference.write_logprobs` defines them (step 7), over the raw logits or, for
`logprobs_processed` rows, the sampler's scaled row y.

`_raw_logprobs_kernel` serves raw rows from the stats pass's raw block stats (rxm_b, the
raw max; rs_b = sum exp(v - rxm_b), v the raw logits, NaN -> -inf), a program per row:

    lse    log(sum_b rs_b * exp(rxm_b - m)), m = max rxm_b; a sum in block order, fixed
           by V, so the value does not depend on the batch
    rank   only blocks whose max exceeds v_token can hold a v above it
    top-N  the N-th largest block max bounds the N-th value from below: only the blocks
           at or above that bound can hold the top N; their candidates are sorted, the
           first N kept

Both sets of blocks are read again in one pass over their union. The rows it does not
serve (a raw +inf, fewer live blocks than N, more candidates than CAP, processed mode:
their y is written for it) are left to the general writer, `_logprobs_kernel`, one program
per row, in passes: max and +inf count; the sum, the rank; top-N over candidates v >= m -
delta (N <= their count <= CAP, delta bisected), or where ties make that impossible,
exactly N located by bisection over the order keys.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from graphexec.kernels.dependent_launch import dependent_start, launch_options
from graphexec.runtime.triton_env import interpreter_enabled
from graphexec.sampling.tensors import SamplerOutput, SamplingTensors
from graphexec.sampling.triton.keys import collapse_inf, okey, pack, sort_desc, unpack
from graphexec.sampling.triton.process import bias_ids, raw_x, row_params, tile_x
from graphexec.sampling.triton.stats import grid_delta


@triton.jit
def _store_top(crow, n, m, lse, top_lp_row, top_id_row, N: tl.constexpr, N_POW2: tl.constexpr,
               CAP: tl.constexpr, INTERP: tl.constexpr):  # fmt: skip
    """The top N of the n candidate packs at crow (at most CAP), sorted: their logprobs
    (v - m) - lse and ids (past n: -inf and -1)."""
    tl.debug_barrier()
    c = tl.arange(0, CAP)
    keys = tl.load(crow + c, mask=c < n, other=-9223372036854775808)
    keys = tl.reshape(sort_desc(tl.reshape(keys, (1, CAP)), INTERP), (CAP,))
    # keep the first N_POW2 sorted keys: a rank-select with a one-hot sum
    j = tl.arange(0, N_POW2)
    vals, ids = unpack(tl.sum(tl.where(c[None, :] == j[:, None], keys[None, :], 0), axis=1))
    tl.store(top_lp_row + j, (vals - m) - lse, mask=j < N)
    tl.store(top_id_row + j, ids.to(tl.int64), mask=j < N)


@triton.jit
def _load_v(raw_row, x_row, offs, V, processed, has_inf, BF16_BITS: tl.constexpr):
    """The logprob source v at offs: raw (NaN -> -inf) or processed, +inf-collapsed."""
    mask = offs < V
    if processed:
        v = tl.load(x_row + offs, mask=mask, other=float("-inf"))
    else:
        if BF16_BITS:
            # bf16 held as i16 bits, widened exactly (the interpreter's cast flushes subnormals)
            bits = tl.load(raw_row + offs, mask=mask, other=-128).to(tl.int32) << 16
            v = bits.to(tl.float32, bitcast=True)
        else:
            v = tl.load(raw_row + offs, mask=mask, other=float("-inf")).to(tl.float32)
        v = tl.where(v != v, float("-inf"), v)
    return collapse_inf(v, has_inf)


@triton.jit
def _logprobs_kernel(  # one program per row
    raw_ptr, stride_raw,  # [B, V] logits (f32 / bf16 / f16)
    x_ptr, stride_x,  # [B, V] f32 processed logits
    slot_ptr,  # [B] i64
    proc_ptr,  # [S] bool: logprobs of the processed row
    tok_ptr,  # [B] i64 sampled tokens (-1 = invalid row)
    cand_ptr,  # [B, CAP] i64 scratch
    lp_ptr, rank_ptr,  # [B] f32 / i64 out
    top_lp_ptr, top_id_ptr,  # [B, N] f32 / i64 out
    done_ptr,  # [B] i32: rows already written (`_raw_logprobs_kernel`) are skipped
    V, BF16_BITS: tl.constexpr, N: tl.constexpr, N_POW2: tl.constexpr, CAP: tl.constexpr,
    BLOCK: tl.constexpr, ROUNDS: tl.constexpr, INTERP: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    dependent_start(PDL)
    row = tl.program_id(0)
    if tl.load(done_ptr + row) != 0:
        return
    slot = tl.load(slot_ptr + row)
    processed = tl.load(proc_ptr + slot).to(tl.int32) != 0
    raw_row = raw_ptr + row.to(tl.int64) * stride_raw
    x_row = x_ptr + row.to(tl.int64) * stride_x
    tok = tl.load(tok_ptr + row)
    no = tl.zeros([], dtype=tl.int1)

    m = tl.full([], float("-inf"), tl.float32)
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        m = tl.maximum(m, tl.max(_load_v(raw_row, x_row, offs, V, processed, no, BF16_BITS), 0))
    has_inf = m == float("inf")
    m = tl.where(has_inf, 0.0, m)

    t_off = tl.maximum(tok, 0) + tl.arange(0, 1)
    v_tok = tl.sum(_load_v(raw_row, x_row, t_off, V, processed, has_inf, BF16_BITS), axis=0)
    total = tl.zeros([], dtype=tl.float32)
    above = tl.zeros([], dtype=tl.int32)
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        v = _load_v(raw_row, x_row, offs, V, processed, has_inf, BF16_BITS)
        total += tl.sum(tl.exp(v - m), axis=0)
        above += tl.sum((v > v_tok).to(tl.int32), axis=0)
    lse = tl.log(total)
    valid = tok >= 0
    tl.store(lp_ptr + row, tl.where(valid, (v_tok - m) - lse, float("nan")))
    tl.store(rank_ptr + row, tl.where(valid, above + 1, 0).to(tl.int64))

    if N > 0:
        # candidates {v >= tau}; tau = -inf takes every entry, -inf ones included
        delta = tl.full([], 8.0, tl.float32)
        d_lo = tl.zeros([], dtype=tl.float32)
        d_hi = tl.full([], float("inf"), tl.float32)
        done = tl.zeros([], dtype=tl.int32)
        tau = m - delta
        need = tl.minimum(V, N)
        for _ in range(ROUNDS):
            if done == 0:
                tau = m - delta
                n = tl.zeros([], dtype=tl.int32)
                for start in range(0, V, BLOCK):
                    offs = start + tl.arange(0, BLOCK)
                    v = _load_v(raw_row, x_row, offs, V, processed, has_inf, BF16_BITS)
                    n += tl.sum(((v >= tau) & (offs < V)).to(tl.int32), axis=0)
                done = ((n >= need) & (n <= CAP)).to(tl.int32)
                if done == 0:
                    if n >= need:
                        d_hi = delta
                        delta = 0.5 * (d_lo + delta)
                    else:
                        d_lo = delta
                        delta = tl.where(d_hi == float("inf"), 2.0 * delta, 0.5 * (delta + d_hi))
        # without a serving tau: the key of the N-th entry, then exactly N gathered
        t_n = okey(tau).to(tl.int64)
        r_n = tl.full([], CAP, tl.int32)
        if done == 0:
            lo = okey(tl.full([], float("-inf"), tl.float32)).to(tl.int64)
            hi = okey(m).to(tl.int64)
            for _ in range(33):
                if lo < hi:
                    mid = lo + (hi - lo + 1) // 2
                    cnt = tl.zeros([], dtype=tl.int32)
                    for start in range(0, V, BLOCK):
                        offs = start + tl.arange(0, BLOCK)
                        v = _load_v(raw_row, x_row, offs, V, processed, has_inf, BF16_BITS)
                        cnt += tl.sum(((okey(v).to(tl.int64) >= mid) & (offs < V)).to(tl.int32))
                    if cnt >= need:
                        lo = mid
                    else:
                        hi = mid - 1
            t_n = lo
            n_gt = tl.zeros([], dtype=tl.int32)
            for start in range(0, V, BLOCK):
                offs = start + tl.arange(0, BLOCK)
                v = _load_v(raw_row, x_row, offs, V, processed, has_inf, BF16_BITS)
                n_gt += tl.sum(((okey(v).to(tl.int64) > t_n) & (offs < V)).to(tl.int32))
            r_n = need - n_gt
        crow = cand_ptr + row.to(tl.int64) * CAP
        base = tl.zeros([], dtype=tl.int32)
        seen_eq = tl.zeros([], dtype=tl.int32)
        for start in range(0, V, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            v = _load_v(raw_row, x_row, offs, V, processed, has_inf, BF16_BITS)
            k = okey(v).to(tl.int64)
            live = offs < V
            eq = live & (k == t_n)
            tie_rank = seen_eq + tl.cumsum(eq.to(tl.int32), axis=0) - 1
            sel = live & ((k > t_n) | (eq & (tie_rank < r_n)))
            seen_eq += tl.sum(eq.to(tl.int32))
            idx = base + tl.cumsum(sel.to(tl.int32), axis=0) - 1
            tl.store(crow + idx, pack(v, offs), mask=sel & (idx < CAP))
            base += tl.sum(sel.to(tl.int32))
        _store_top(crow, base, m, lse, top_lp_ptr + row * N, top_id_ptr + row * N, N, N_POW2, CAP,
                   INTERP)  # fmt: skip


def write_logprobs(logits: torch.Tensor, y: torch.Tensor, slot_ids: torch.Tensor,
                   table: SamplingTensors, out: SamplerOutput, *, cap: int,
                   done: torch.Tensor, pdl: bool = False) -> None:  # fmt: skip
    """Fill out.logprobs / ranks / top_logprobs / top_token_ids for sampled out.token_ids,
    but for the rows the raw writer served (done [B] int32, nonzero there); `pdl`: launch
    with programmatic dependent launch (already checked enabled on this device)."""
    B, V = y.shape
    n = out.num_top or 0
    if cap < n:
        raise ValueError(f"cap ({cap}) must be >= the top-N width ({n})")
    cand = torch.empty((B, cap), dtype=torch.int64, device=y.device)
    blk = min(triton.next_power_of_2(V), 4096 if interpreter_enabled() else 2048)
    top_lp = out.top_logprobs if n else out.logprobs
    top_id = out.top_token_ids if n else out.ranks
    bf16 = logits.dtype == torch.bfloat16
    if bf16:
        logits = logits.view(torch.int16)  # same bytes; widened exactly in the kernel
    _logprobs_kernel[(B,)](
        logits, logits.stride(0), y, y.stride(0), slot_ids, table.logprobs_processed,
        out.token_ids, cand, out.logprobs, out.ranks, top_lp, top_id,
        done, V, BF16_BITS=bf16, N=n, N_POW2=max(1, triton.next_power_of_2(n)), CAP=cap,
        BLOCK=blk, ROUNDS=16, INTERP=interpreter_enabled(),
        num_warps=8 if not interpreter_enabled() else 4, PDL=pdl, **launch_options(pdl),
    )  # fmt: skip


@triton.jit
def _raw_logprobs_kernel(  # one program per row
    P, W,  # W.xm, W.raw_max, W.raw_sum: the stats pass's; W.blocks: scratch
    y_ptr,  # [B, V] f32 out: y of processed-mode rows
    cand_ptr,  # [B, CAP] i64 scratch
    tok_ptr,  # [B] i64 sampled tokens (-1 = invalid row)
    lp_out_ptr, rank_ptr,  # [B] f32 / i64 out
    top_lp_ptr, top_id_ptr,  # [B, N] f32 / i64 out
    done_ptr,  # [B] i32 out: 1 where this kernel wrote the row's logprobs
    NBLK,
    N: tl.constexpr, N_POW2: tl.constexpr, NBLK_P2: tl.constexpr, NB_P2: tl.constexpr,
    GR: tl.constexpr, DB: tl.constexpr, CAP: tl.constexpr, YB: tl.constexpr,
    INTERP: tl.constexpr, FL: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    row = tl.program_id(0)
    r64 = row.to(tl.int64)
    # the row's parameters before the wait (`process.row_inputs` says why that is safe)
    slot, greedy, inv_t, seed_unused, pos_unused = row_params(P, row)
    served = tl.zeros([], dtype=tl.int32)
    # every raw-mode row, asked or not: the reference writes them all
    raw_mode = tl.load(P.lp_processed + slot).to(tl.int32) == 0
    dependent_start(PDL)
    b = tl.arange(0, NBLK_P2)
    rxm = tl.load(W.raw_max + r64 * NBLK + b, mask=b < NBLK, other=float("-inf"))
    mr = tl.max(rxm, axis=0)
    if raw_mode & (mr < float("inf")):
        rs = tl.load(W.raw_sum + r64 * NBLK + b, mask=b < NBLK, other=0.0)
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
        cblk_row = W.blocks + r64 * NBLK  # the selected blocks' ids, ascending
        tl.store(cblk_row + tl.cumsum(sel_b.to(tl.int32), axis=0) - 1, b, mask=sel_b)
        tl.debug_barrier()
        nbc = tl.sum(sel_b.to(tl.int32), axis=0)
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
                # slots of the selected entries, counted from n in row-major order
                cnt = tl.sum(sel.to(tl.int32), axis=1)
                before = n + tl.cumsum(cnt, axis=0) - cnt
                idx = before[:, None] + tl.cumsum(sel.to(tl.int32), axis=1) - 1
                tl.store(crow + idx, pack(v, offs), mask=sel & (idx < CAP))
                n += tl.sum(cnt, axis=0)
        valid = tok >= 0
        tl.store(lp_out_ptr + row, tl.where(valid, (v_tok - m) - lse, float("nan")))
        tl.store(rank_ptr + row, tl.where(valid, above + 1, 0).to(tl.int64))
        served = 1
        if N > 0:
            # tied rows store their first CAP candidates by id: the top N among them
            if top_ok & ((n <= CAP) | tied) & (delta < float("inf")):
                _store_top(crow, n, m, lse, top_lp_ptr + r64 * N, top_id_ptr + r64 * N, N, N_POW2,
                           CAP, INTERP)  # fmt: skip
            else:
                served = 0
    tl.store(done_ptr + row, served)
    if raw_mode == 0:
        # the general writer's y, as the sampler scales it: m the row max of x (0 where none
        # is finite)
        xm = tl.load(W.xm + r64 * NBLK + b, mask=b < NBLK, other=float("-inf"))
        mx = tl.max(xm, axis=0)
        has_inf = mx == float("inf")
        m = tl.where((mx > float("-inf")) & (has_inf == 0), mx, 0.0)
        ids = bias_ids(P, slot, NB_P2)
        for start in range(0, P.vocab, YB):
            offs = start + tl.arange(0, YB)
            x = collapse_inf(tile_x(P, row, slot, ids, offs, start, start + YB, FL), has_inf)
            tl.store(y_ptr + r64 * P.vocab + offs, (x - m) * inv_t, mask=offs < P.vocab)


@triton.jit
def _raw(P, row, offs, FL: tl.constexpr):
    """The raw logits at offs as fp32, NaN -> -inf, -inf past V."""
    v = raw_x(P, row, offs, FL)
    return tl.where((offs < P.vocab) & (v == v), v, float("-inf"))
