"""The check pass: the candidate's membership (`candidate`) for R_CHECK rows, whose list
of blocks is longer than check_blocks. Each program sums its share of the list into the
row's I_CCNT / I_CMASS with int64 atomics (exact, in any order); the row's last program
decides: kept, the candidate is the token; else the row is planned (`stats.plan_row`)
for the cut's passes, its candidate marked out (-1) or left to be tested against the cut.
"""

from __future__ import annotations

import triton
import triton.language as tl

from graphexec.sampling.triton import sampler_config as cf
from graphexec.sampling.triton.candidate import KEPT, OUT, count_above, decide
from graphexec.sampling.triton.keys import pack
from graphexec.sampling.triton.process import bias_ids
from graphexec.sampling.triton.stats import arrive, plan_row


@triton.jit(do_not_specialize=["S", "NBLK"])
def _check_kernel(
    P, W,
    tok_ptr, valid_ptr,  # [B] i64 / bool out: the rows whose candidate is kept
    S,  # programs per row
    NBLK, NB_P2: tl.constexpr, NBLK_P2: tl.constexpr, R: tl.constexpr, DB: tl.constexpr,
    NBINS: tl.constexpr, FL: tl.constexpr,
):  # fmt: skip
    """Grid (B * S,): program (row, sp) = divmod(pid, S) counts slice sp of an R_CHECK
    row's listed blocks; the row's last program decides (module docstring)."""
    row = tl.program_id(0) // S
    sp = tl.program_id(0) % S
    ri = W.rowi + row * cf.NUM_I
    if tl.load(ri + cf.I_ROUTE) == cf.R_CHECK:
        slot = tl.load(P.slots + row).to(tl.int64)
        ids = bias_ids(P, slot, NB_P2)
        n_list = tl.load(ri + cf.I_NLIST).to(tl.int32)
        per = tl.cdiv(tl.cdiv(n_list, R), S) * R
        e0 = sp * per
        e1 = tl.minimum(e0 + per, n_list)
        if e0 < e1:
            m = tl.load(W.rowf + row * 8 + cf.F_M)
            s = tl.load(W.rowf + row * 8 + cf.F_S)
            yc = tl.load(W.rowf + row * 8 + cf.F_YC)
            pk_c = pack(yc, tl.load(ri + cf.I_CAND).to(tl.int32))
            if tl.max(ids, axis=0) >= 0:
                cnt, before = count_above(P, W, row, slot, ids, e0, e1, n_list, pk_c, m, s,
                                          NBLK, R, DB, FL, True)  # fmt: skip
            else:
                cnt, before = count_above(P, W, row, slot, ids, e0, e1, n_list, pk_c, m, s,
                                          NBLK, R, DB, FL, False)  # fmt: skip
            tl.atomic_add(ri + cf.I_CCNT, cnt, sem="relaxed")
            tl.atomic_add(ri + cf.I_CMASS, before, sem="relaxed")
        if arrive(W, row, 2, S):  # the row's last program decides
            top_k = tl.load(P.top_k + slot)
            top_p = tl.load(P.top_p + slot)
            yc = tl.load(W.rowf + row * 8 + cf.F_YC)
            cnt = tl.load(ri + cf.I_CCNT, cache_modifier=".cg")
            before = tl.load(ri + cf.I_CMASS, cache_modifier=".cg")
            state = decide(cnt, before, yc, top_k, top_p, tl.load(W.total + row))
            if state == KEPT:
                tok = tl.load(ri + cf.I_CAND)
                tl.store(ri + cf.I_ROUTE, tl.zeros([], dtype=tl.int64))
                tl.store(tok_ptr + row, tok)
                tl.store(valid_ptr + row, tok >= 0)
            else:
                if state == OUT:
                    tl.store(ri + cf.I_CAND, tl.full([], -1, tl.int64))
                plan_row(W, row, top_k, top_p, tl.load(P.log_min_p + slot), NBLK, NBLK_P2, DB,
                         NBINS)  # fmt: skip
