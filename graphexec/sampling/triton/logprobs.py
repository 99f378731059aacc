"""The logprobs writer: the sampled token's logprob and rank, and the top-N.

Per row, over v = the raw logits (default) or the scaled processed row y
(`logprobs_processed`; the sampler's y = (x - max) / T, already collapsed),
both NaN-free and +inf-collapsed as in `graphexec.sampling.reference.write_logprobs`:

    lp(t) = (v_t - m) - log(sum_j exp(v_j - m))      m = max v, sum in a fixed order
    rank  = 1 + #(v_j > v_token)
    top-N = the first N of the row's (value desc, id asc) order

One program per row, in passes: max and +inf count; the sum, the rank; top-N over
candidates v >= m - delta (N <= their count <= CAP, delta bisected), or where ties make
that impossible, exactly N located by bisection over the order keys.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from graphexec.sampling.tensors import SamplerOutput, SamplingTensors
from graphexec.sampling.triton import interpreter_enabled
from graphexec.sampling.triton.keys import collapse_inf, okey, pack, sort_desc, unpack


@triton.jit
def _load_v(raw_row, x_row, offs, V, processed, has_inf, BF16_BITS: tl.constexpr):
    """The logprob source v at offs: raw (NaN -> -inf) or processed, +inf-collapsed."""
    mask = offs < V
    if processed:
        v = tl.load(x_row + offs, mask=mask, other=float("-inf"))
    else:
        if BF16_BITS:
            # bf16 held as i16 bits: the exact widening (the interpreter's cast flushes
            # subnormals)
            bits = tl.load(raw_row + offs, mask=mask, other=-128).to(tl.int32) << 16
            v = bits.to(tl.float32, bitcast=True)
        else:
            v = tl.load(raw_row + offs, mask=mask, other=float("-inf")).to(tl.float32)
        v = tl.where(v != v, float("-inf"), v)
    return collapse_inf(v, has_inf)


@triton.jit
def _logprobs_kernel(
    raw_ptr,  # [B, V] logits (f32 / bf16 / f16)
    stride_raw,
    x_ptr,  # [B, V] f32 processed logits
    stride_x,
    slot_ptr,  # [B] i64
    proc_ptr,  # [S] bool: logprobs of the processed row
    tok_ptr,  # [B] i64 sampled tokens (-1 = invalid row)
    cand_ptr,  # [B, CAP] i64 scratch
    lp_ptr,  # [B] f32 out
    rank_ptr,  # [B] i64 out
    top_lp_ptr,  # [B, N] f32 out
    top_id_ptr,  # [B, N] i64 out
    done_ptr,  # [B] i32: rows already written (`raw_logprobs`) are skipped
    V,
    BF16_BITS: tl.constexpr,
    N: tl.constexpr,
    N_POW2: tl.constexpr,
    CAP: tl.constexpr,
    BLOCK: tl.constexpr,
    ROUNDS: tl.constexpr,
    INTERP: tl.constexpr,
    SKIP_DONE: tl.constexpr,
):
    row = tl.program_id(0)
    if SKIP_DONE:
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
        m = tl.maximum(
            m, tl.max(_load_v(raw_row, x_row, offs, V, processed, no, BF16_BITS), axis=0)
        )
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
        tl.debug_barrier()
        c = tl.arange(0, CAP)
        keys = tl.load(crow + c, mask=c < base, other=-9223372036854775808)
        keys = tl.reshape(sort_desc(tl.reshape(keys, (1, CAP)), INTERP), (CAP,))
        # keep the first N_POW2 sorted keys: a rank-select with a one-hot sum
        j = tl.arange(0, N_POW2)
        sel_keys = tl.sum(tl.where(c[None, :] == j[:, None], keys[None, :], 0), axis=1)
        vals, ids = unpack(sel_keys)
        vals = tl.where(j < base, vals, float("-inf"))
        jm = j < N
        tl.store(top_lp_ptr + row * N + j, (vals - m) - lse, mask=jm)
        tl.store(top_id_ptr + row * N + j, ids.to(tl.int64), mask=jm)


def write_logprobs(
    logits: torch.Tensor,
    y: torch.Tensor,
    slot_ids: torch.Tensor,
    table: SamplingTensors,
    out: SamplerOutput,
    *,
    cap: int,
    block: int | None = None,
    done: torch.Tensor | None = None,
) -> None:
    """Fill out.logprobs / ranks / top_logprobs / top_token_ids for sampled out.token_ids
    (done: optional [B] int32, rows already written are skipped)."""
    B, V = y.shape
    n = out.num_top or 0
    if cap < n:
        raise ValueError(f"cap ({cap}) must be >= the top-N width ({n})")
    cand = torch.empty((B, cap), dtype=torch.int64, device=y.device)
    blk = block or min(triton.next_power_of_2(V), 4096 if interpreter_enabled() else 2048)
    top_lp = out.top_logprobs if n else out.logprobs
    top_id = out.top_token_ids if n else out.ranks
    bf16 = logits.dtype == torch.bfloat16
    if bf16:
        logits = logits.view(torch.int16)  # same bytes; widened exactly in the kernel
    _logprobs_kernel[(B,)](
        logits, logits.stride(0), y, y.stride(0), slot_ids, table.logprobs_processed,
        out.token_ids, cand, out.logprobs, out.ranks, top_lp, top_id,
        done if done is not None else out.ranks, V, BF16_BITS=bf16, N=n,
        N_POW2=max(1, triton.next_power_of_2(n)), CAP=cap, BLOCK=blk, ROUNDS=16,
        INTERP=interpreter_enabled(), SKIP_DONE=done is not None,
        num_warps=8 if not interpreter_enabled() else 4,
    )  # fmt: skip
