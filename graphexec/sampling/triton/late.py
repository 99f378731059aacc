"""The late queue: a filtered row's passes after the check (the short route, then round
1's and round 2's selection, kept pass and finish) in one persistent launch instead of
seven (`SamplerConfig.late_queue`).

The programs of `_late_kernel` drain a queue of *items* held in `W.queue`, phase by phase:

    phase       items                                  an item serves
    0 short     B                                      row k: `short.short_row`
    1 select    max(G1, rows) while round 1 lists      a slice of a listed row (k as
                rows, else none                        `select.list_entry`'s program)
    2 kept      as select                              likewise, `kept.kept_entry`
    3 finish    B while round 1 lists rows, else none  row k: `kept.finish_row`
    4-5         round 2's select and kept over its     as 1-2 (G2 programs' slices)
                list (max(G2, rows), or none)
    6 finish 2  one per row on round 2's list          that row: `kept.finish_refined`

A program claims the next item number and learns how many are published in one atomic
(the ticket), waits only if its item's phase is not yet published, serves it and counts
it done. Whoever completes a phase's last item publishes the next phase that has items,
or marks the queue finished: a phase with no rows costs nothing. The gate, Q_NEED, counts
the rows the tail and check kernels left to plan or to pass over again; a batch they drew
whole costs one launch that reads it.

Why it cannot deadlock, whatever the grid: only a running program claims an item, and a
phase is published by the program that completes the previous phase's last item, which is
running too. Under the interpreter, programs run one after another: program 0 serves every
item (it completes each phase's last one) and the others find the queue finished. The
slices are those of the separate launches and the passes sum integers, so no token changes.
The last program to leave resets the queue (the gate too) for the next call.
"""

from __future__ import annotations

import triton
import triton.language as tl

from graphexec.kernels.dependent_launch import dependent_start
from graphexec.sampling.triton import sampler_config as cf
from graphexec.sampling.triton.kept import finish_refined, finish_row, kept_entry
from graphexec.sampling.triton.process import row_inputs
from graphexec.sampling.triton.select import list_entry, select_entry
from graphexec.sampling.triton.short import short_row

# W.queue's words (i64), the hot ones a cache line apart: the ticket, claims in its low 32
# bits and the items published past phase 0 above them (+ FIN once no phase is left), so
# that one atomic both claims an item and says whether it is published; each phase's first
# item, then its size (0: not published), read as one vector; items done per phase;
# programs gone
TICKET, START, SIZE, DONE, EXIT = (tl.constexpr(i) for i in (0, 16, 24, 32, 48))
PUB1 = tl.constexpr(1 << 32)  # one item published
FIN = tl.constexpr(1 << 62)


@triton.jit
def _published(t):
    """Items published past phase 0, from a ticket's value."""
    return (t >> 32) & (FIN // PUB1 - 1)


@triton.jit
def _size(W, ph, B, G1, G2):
    """Items of phase ph > 0 (none past 6), from the row lists as the earlier phases left
    them. Round 1's finish has none when round 1 lists no row: every row is then drawn
    (the short kernel leaves a row either drawn or on the list)."""
    n1 = tl.load(W.listed, cache_modifier=".cg")
    n2 = tl.load(W.refine, cache_modifier=".cg")
    pass1 = tl.where(n1 > 0, tl.maximum(G1, n1), 0)
    pass2 = tl.where(n2 > 0, tl.maximum(G2, n2), 0)
    n = tl.where(ph <= 2, pass1, tl.where(ph == 3, tl.where(n1 > 0, B, 0),
                                          tl.where(ph == 6, n2, pass2)))
    return tl.where(ph > 6, 0, n)


@triton.jit
def _publish(W, q, ph, B, G1, G2):
    """Phase ph is done: publish the next phase with items, or finish the queue."""
    nxt = ph + 1
    n = _size(W, nxt, B, G1, G2)
    while (nxt < 6) & (n == 0):
        nxt += 1
        n = _size(W, nxt, B, G1, G2)
    if n > 0:
        tl.store(q + START + nxt, B + _published(tl.load(q + TICKET, cache_modifier=".cg")))
        tl.store(q + SIZE + nxt, n.to(tl.int64))
        tl.debug_barrier()
        tl.atomic_add(q + TICKET, n.to(tl.int64) * PUB1, sem="release")
    else:
        tl.atomic_add(q + TICKET, FIN, sem="release")


@triton.jit
def _phase_of(q, i, B):
    """(phase, index in it, its items) of published item i: one load of the phase table."""
    j = tl.arange(0, 16)
    t = tl.load(q + START + j, mask=((j >= 1) & (j <= 6)) | (j >= 9), other=0,
                cache_modifier=".cg")  # fmt: skip
    ph = tl.max(tl.where((j <= 6) & (t > 0) & (t <= i), j, 0), axis=0)
    start = tl.sum(tl.where(j == ph, t, 0), axis=0)
    size = tl.where(ph == 0, B, tl.sum(tl.where(j == ph + 8, t, 0), axis=0))
    return ph, (i - start).to(tl.int32), size


@triton.jit(noinline=True)
def _serve(P, W, tok_ptr, valid_ptr, ph, k, G1, G2, NBLK, NB_P2: tl.constexpr,
           NBLK_P2: tl.constexpr, DB: tl.constexpr, RSH: tl.constexpr, RS: tl.constexpr,
           RK: tl.constexpr, SB: tl.constexpr, ST: tl.constexpr, NBINS: tl.constexpr,
           WCAP: tl.constexpr, WAYS: tl.constexpr, ITA: tl.constexpr, ITB: tl.constexpr,
           SSB: tl.constexpr, FL: tl.constexpr, INTERP: tl.constexpr):  # fmt: skip
    """Item k of phase ph. Not inlined: the compiler would hoist the phases' constant
    vectors out of the queue's loop, where they would all stay live (and spill)."""
    if ph == 0:  # (a drawn row: nothing to do, so not even its inputs read)
        if tl.load(W.rowi + k * cf.NUM_I + cf.I_ROUTE, cache_modifier=".cg") != cf.R_DONE:
            short_row(P, W, tok_ptr, valid_ptr, k, row_inputs(P, k, NB_P2), NBLK, NBLK_P2,
                      DB, RSH, SB, ST, WCAP, FL, INTERP, NBINS)  # fmt: skip
    elif ph == 1:
        e, sp, n_sp = list_entry(W.listed, k, G1)
        if e >= 0:
            select_entry(P, W, W.listed, e, sp, n_sp, NBLK, NB_P2, RS, DB, NBINS, WCAP,
                         FL, False)  # fmt: skip
    elif ph == 2:
        e, sp, n_sp = list_entry(W.listed, k, G1)
        if e >= 0:
            kept_entry(P, W, W.listed, e, sp, n_sp, NBLK, NB_P2, RK, DB, NBINS, WCAP,
                       FL, False)  # fmt: skip
    elif ph == 3:
        route = tl.load(W.rowi + k * cf.NUM_I + cf.I_ROUTE, cache_modifier=".cg")
        if route != cf.R_DONE:
            finish_row(P, W, tok_ptr, valid_ptr, k, row_inputs(P, k, NB_P2), route,
                       NBLK, NBLK_P2, DB, NBINS, WCAP, WAYS, ITA, ITB, SSB, FL,
                       False)  # fmt: skip
    elif ph == 4:
        e, sp, n_sp = list_entry(W.refine, k, G2)
        select_entry(P, W, W.refine, e, sp, n_sp, NBLK, NB_P2, RS, DB, NBINS, WCAP, FL,
                     True)  # fmt: skip
    elif ph == 5:
        e, sp, n_sp = list_entry(W.refine, k, G2)
        kept_entry(P, W, W.refine, e, sp, n_sp, NBLK, NB_P2, RK, DB, NBINS, WCAP, FL,
                   True)  # fmt: skip
    else:
        finish_refined(P, W, tok_ptr, valid_ptr, k, NBLK, NB_P2, NBLK_P2, DB, NBINS, WCAP, WAYS,
                       ITA, ITB, SSB, FL)  # fmt: skip


@triton.jit(do_not_specialize=["B", "G1", "G2", "NBLK"])
def _late_kernel(
    P, W,
    tok_ptr, valid_ptr,  # [B] i64 / bool out: the filtered rows' tokens
    B, G1, G2,  # rows; programs round 1's and round 2's passes slice the listed rows over
    NBLK, NB_P2: tl.constexpr, NBLK_P2: tl.constexpr, DB: tl.constexpr, RSH: tl.constexpr,
    RS: tl.constexpr, RK: tl.constexpr, SB: tl.constexpr, ST: tl.constexpr,
    NBINS: tl.constexpr, WCAP: tl.constexpr, WAYS: tl.constexpr, ITA: tl.constexpr,
    ITB: tl.constexpr, SSB: tl.constexpr, FL: tl.constexpr, INTERP: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    """Any grid: the queue's items (module docstring). RSH, RS, RK: the short route's,
    selection's and kept pass's tile blocks; SB, ST: short_blocks and short_tokens; SSB:
    the exact search's blocks."""
    dependent_start(PDL)
    q = W.queue
    # rows the tail and check kernels left a pass to (none: nothing to serve, no counter
    # touched)
    if tl.load(q + cf.Q_NEED, cache_modifier=".cg") > 0:
        go = B > 0
        while go:
            t = tl.atomic_add(q + TICKET, 1, sem="acquire")
            i = t & (PUB1 - 1)
            while (i >= B + _published(t)) & (t < FIN):
                t = tl.atomic_add(q + TICKET, 0, sem="acquire")
            go = i < B + _published(t)
            if go:
                ph, k, size = _phase_of(q, i, B)
                _serve(P, W, tok_ptr, valid_ptr, ph, k, G1, G2, NBLK, NB_P2, NBLK_P2, DB, RSH, RS,
                       RK, SB, ST, NBINS, WCAP, WAYS, ITA, ITB, SSB, FL, INTERP)  # fmt: skip
                tl.debug_barrier()
                if tl.atomic_add(q + DONE + ph, 1, sem="acq_rel") == size - 1:
                    _publish(W, q, ph, B, G1, G2)
        tl.debug_barrier()
        if tl.atomic_add(q + EXIT, 1, sem="acq_rel") == tl.num_programs(0) - 1:
            w = tl.arange(0, 128)
            tl.store(q + w, tl.zeros([128], dtype=tl.int64), mask=w < cf.QUEUE_WORDS)

