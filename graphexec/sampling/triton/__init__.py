"""Triton kernels of the sampler, and the route map: which kernels serve a row, and how
many times each reads the row's logits (a *pass*) in the worst case, for any logits.

`graphexec.sampling.reference` is the definition; every kernel family here has a torch
reference and tests of its own (`tests/sampling/test_triton_*.py`). Kernels run on CUDA,
and on the CPU under TRITON_INTERPRET=1 (set before triton is imported). The knobs are one
frozen `config.SamplerConfig`, passed explicitly; none changes a token.

Launches per variant (each a grid of B x S programs, S = programs per row; the last of a
row's programs to finish a launch serves the row's next step, an acq_rel counter per row):

    no_filter     stats
    top_k_top_p   stats, select, kept          (default: the same three)
    + logprobs    raw_logprobs, logprobs

Routes, decided per row by the stats pass's last program (`stats._row_tail`):

    route   rows                                     kernels             passes, worst case
    done    invalid, greedy, no active filter,       stats               1, then 1 block (2
            all live tokens tied (+inf rows too)                         for ties)
    cut     min-p alone                              stats, kept         2, then 1 block
    select  top-k and / or top-p                     stats, select,      3, then gather_cap^2
                                                     kept                compares, 1 block
    exact   a select row whose bracket did not       (kept's last        3 + 31, then 1 block
            resolve: more than gather_cap bracket    program)
            tokens (wide runs of equal values), an
            estimate off

Each later pass reads only the blocks whose max reaches lo, a proven lower bound of the
kept values (top-k's k-th largest block max, top-p's bound from the block masses,
ln(min_p)): peaked rows read a few dozen blocks again, flat ones most of the row. A
block re-read by the draw: greedy, the first block holding the max; else the block the
two-level draw picks (ties also read the block of their last kept id). The exact search
(`exact`): two searches over the 64-bit order keys, 16 candidates a pass, then one pass
for the kept masses, by one program.

Why it is bounded: the kept set of a filtered row is a prefix of the row's order, so its
cut is found by counting, never by sorting a set whose size depends on the data. min-p's
cut is y >= ln(min_p), known once the row max is. For top-k and top-p, the select pass
counts the row into `bins` bins between lo and the max (exact counts; masses estimated
from the bins' middles) and places a bracket of bins around the cut; the kept pass sums
the exact integer masses above the bracket and gathers the bracket's tokens, and the row
resolves the cut among them by comparing every pair (their positions and the exact mass
before each). Every decision is checked against exact counts and masses; a bracket that
does not hold the cut sends the row to the exact search, so no estimate changes a token.

Why the two-level draw: a block by its exact kept mass, then a token inside it, so noise
is drawn for the block maxes and one block, and the draw reads one block again whatever
the filters kept (`reference`, step 6).
"""

import os


def interpreter_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
