"""Triton kernels of the sampler, and the route map: which kernels serve a row, and how
many times each reads the row's logits (a *pass*) in the worst case, for any logits.

`graphexec.sampling.reference` is the definition; every kernel family here has a torch
reference and tests of its own (`tests/sampling/test_triton_*.py`). Kernels run on CUDA,
and on the CPU under TRITON_INTERPRET=1 (set before triton is imported). The knobs are one
frozen `config.SamplerConfig`, passed explicitly; none changes a token.

Launches per variant (grids of B x S programs, S programs per row, or B row programs; a
row's last program of a pass serves what follows it, through an acq_rel counter per row):

    no_filter           stats (the row tail runs in its last program per row)
    default, top_k_top_p  stats, tail, select, kept, finish
    + logprobs          raw_logprobs, logprobs

Routes, decided per row by the tail (`stats._row_tail`):

    route   rows                                 kernels that read it     passes, worst
    done    invalid, greedy, no active filter,   stats, tail              1, then 1 block
            all live tokens tied (+inf too)                               (2 for ties)
    cut     min-p alone                          stats, tail, kept,       2 (only blocks
                                                 finish                   min-p cuts), 1 block
    select  top-k and / or top-p                 stats, tail, select,     3, then 1 block
                                                 kept, finish
    exact   a select row whose bracket did not   finish (one program)     3 + 31, 1 block
            resolve: more than gather_cap
            bracket tokens, an estimate off

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
searches over their keys. Every decision is checked against exact counts and masses; a
bracket that does not hold the cut sends the row to the exact search (`exact`: 16-way
searches over the 64-bit order keys by one program, bounded at 31 passes but serial, so
milliseconds for such a row: the bins are sized so that the benchmark's shapes never take
it), so no estimate changes a token.

Why the two-level draw: a block by its exact kept mass K_b, then a token inside it, so
noise is drawn for the block maxes and one block, and the draw reads one block again
whatever the filters kept (`reference`, step 6).
"""

import os


def interpreter_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
