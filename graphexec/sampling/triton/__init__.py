"""Triton kernels of the sampler, and the route map: which kernels serve a row, and how
many times each reads the row's logits (a *pass*) in the worst case, for any logits.

`graphexec.sampling.reference` is the definition; every kernel family here has a torch
reference and tests of its own (`tests/sampling/test_triton_*.py`). Kernels run on CUDA,
and on the CPU under TRITON_INTERPRET=1 (set before triton is imported). The knobs are one
frozen `config.SamplerConfig`, passed explicitly; none changes a token.

Launches per variant (grids of B x S programs, S programs per row, or B row programs; a
row's last program of a pass serves what follows it, through an acq_rel counter per row):

    no_filter           stats (the row tail runs in its last program per row)
    default, top_k_top_p  stats, tail, select, kept, finish, then round 2's select, kept,
                        finish (grids of late_programs and B; rows not in it leave at once)
    + logprobs          raw_logprobs, logprobs

Routes, decided per row by the tail (`stats._row_tail`), the select and the finish:

    route   rows                                 kernels that read it     passes, worst
    done    invalid, greedy, no active filter,   stats, tail              1, then 1 block
            all live tokens tied (+inf too)                               (2 for ties)
    cut     min-p alone                          stats, tail, kept,       2 (only blocks
                                                 finish                   min-p cuts), 1 block
    select  top-k and / or top-p                 stats, tail, select,     3, then 1 block
                                                 kept, finish
    round2  a select row whose first bracket     + select, kept, finish   5, then 1 block
            missed its cut or overflowed the     of round 2 (its rows
            gather cap                           share late_programs)
    exact   a round2 row whose second bracket    + finish (one program)   5 + 31, 1 block
            did not resolve: runs of equal
            values wider than gather_cap

Each later pass reads only the blocks whose max reaches lo, a proven lower bound of the
kept values (top-k's k-th largest block max, top-p's bound from the block masses,
ln(min_p)): peaked rows read a few dozen blocks again, flat ones most of the row. The draw
reads one block again: greedy, the first block holding the max; else the block the
two-level draw picks (ties also read the block of their last kept id).

Why it is bounded: the kept set of a filtered row is a prefix of the row's order, so its
cut is found by counting, never by sorting a set whose size depends on the data. min-p's
cut is y >= ln(min_p), known once the row max is, so min-p alone reads again only the
blocks it cuts (a block it keeps whole keeps its Q_b). For top-k and top-p the select pass
counts the row into `bins` bins between lo and the max (exact counts; masses estimated)
and places a bracket of bins around each cut; the kept pass sums the exact integer masses
outside the brackets and gathers the bracket's tokens (at most gather_cap), and the finish
resolves the cut among them by counting: pairwise up to 64 gathered tokens, else by 16-way
searches over their keys. Every decision is checked against exact counts and masses. A
bracket that does not hold the cut (top-p's crossing is estimated from bin edges, so the
few largest tokens' masses are known to a bin's width: randn3 rows at temperature 1 missed
by a few bins) sends the row to round 2, the same passes over the bins that surely hold
every cut, binned anew (hundreds of times finer) with the mass above them counted
exactly; round 2's rows share `late_programs` programs whatever B is, so one such row costs
the batch two parallel passes over that row, not a serial search. Only a row whose second
bracket fails too (more than gather_cap tokens of one value at the cut) takes the exact
search (`exact`: 16-way searches over the 64-bit order keys by one program, bounded at 31
passes but serial, so milliseconds for such a row). No estimate changes a token.

Why the two-level draw: a block by its exact kept mass K_b, then a token inside it, so
noise is drawn for the block maxes and one block, and the draw reads one block again
whatever the filters kept (`reference`, step 6).
"""

import os


def interpreter_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
