"""Triton kernels of the sampler, and the route map: which kernels serve a row, and how
many times each reads the row's logits (a *pass*) in the worst case, for any logits.

`graphexec.sampling.reference` is the definition; every kernel family here has a torch
reference and tests of its own (`tests/sampling/test_triton_*.py`). Kernels run on CUDA,
and on the CPU under TRITON_INTERPRET=1 (set before triton is imported). The knobs are one
frozen `sampler_config.SamplerConfig`, passed explicitly; none changes a token. Kernels take
the batch's inputs as one named tuple P (`process.Inputs`: P.logits, P.top_p, ...) and their
scratch as another, W (`sampler_config.Workspace`: W.xm, W.rowi, ...).

Terms. A *pass* reads a row's V logits once; a *block* is DRAW_BLOCK consecutive token
ids; y = (x - max) / T is the scaled processed row; Q_b a block's exact mass relative to
its max, K_b its kept mass; *lo* a proven lower bound of the kept values (top-k's k-th
largest block max, top-p's bound from the block masses, ln(min_p)); the *listed* blocks
are those whose max reaches lo, the *candidates* their tokens with y >= lo; a *cut* is the
order key (pack) of the last kept token; a *bracket* the histogram bins that hold a cut.

Launches per variant (grids of B x S programs, S programs per row, or B row programs; a
row's last program of a later pass serves what follows it, through an acq_rel counter per
row):

    no_filter             stats, tail (the stats pass streams only: the row tail has a
                          launch of its own, so the streaming loop keeps its registers low)
    top_k_top_p           stats, topk (one program a row serves it whole: top-k first)
    default               stats, tail, check, short, select, kept, finish, then round 2's
                          select, kept, finish (rows not in a launch's route leave at once;
                          select and kept serve a row list, the short kernel's, then round
                          2's, whose rows share the launch's late_programs programs); with
                          SamplerConfig.topk_launch, topk before the tail for the top-k-first
                          rows (the tail then holds no top-k-first code); with
                          SamplerConfig.late_queue, stats, tail, check, late: the seven launches
                          after the check as items of one (`late`), behind a gate the tail and
                          check fill, so a batch they drew whole costs one launch reading it
    + logprobs            raw logprobs, then the general writer for the rows it leaves

Draw first, filter second (`reference`, step 6): a filtered row's token is its candidate
(the two-level draw over the whole row, as no_filter draws) when the kept set holds it,
else a draw from the kept set on the fallback streams. Routes, one per row, and what
serves it (kernels are `file:function` in this package; passes are reads of the row,
worst case, then the draw's one block):

| route | rows | kernels | passes | set by |
|---|---|---|---|---|
| done | invalid, greedy, no active filter, all live tokens tied (+inf too) | stats:_stats_kernel, tail:_tail_kernel | 1 (2 for ties) | tail:_tail_kernel |
| top-k first | filtered rows with top-k on: top_k_top_p's, and default's up to top_k_first (the row tail): the candidates (y >= the k-th largest block max, to 16 key bits) gathered from the blocks that reach it, sorted, cut; past gather_cap narrowed to the histogram bins that hold the k-th; a run of ties past it: the exact search | stats:_stats_kernel, tail:_topk_kernel or tail:_tail_kernel | 1 + those blocks (at most 1 more), + 2 reads of them when narrowed; the exact search: + 31 | topk:topk_first |
| candidate | a filtered row whose candidate is kept: min-p by its value; top-k / top-p by the count and exact mass of the tokens ranked above it, read from the blocks whose max reaches it (at most check_blocks: the tail itself; more: the check pass) | + stats:_check_kernel (more than check_blocks blocks) | 1 + those blocks (at most 1 more) | candidate:decide_in_tail, stats:_check_kernel |
| short | candidate out; top-k / top-p with at most short_blocks listed blocks and short_tokens candidates; min-p alone with at most short_blocks / 4 cut blocks | + short:_short_kernel | 2 + the listed blocks | short:_short_kernel |
| cut | candidate out; min-p alone, more cut blocks | + kept:_kept_kernel, kept:_finish_kernel | 3 (only the blocks min-p cuts) | stats:_plan |
| select | candidate out or undecided (top-k with top-p between its bounds); more listed blocks or candidates | + select:_select_kernel, kept:_kept_kernel, kept:_finish_kernel | 4 | stats:_plan |
| round2 | a select row whose bracket missed its cut or overflowed the gather cap | + the same three again (round 2's rows share the launch's programs as round 1's do) | 6 | select:_bracket, kept:_finish |
| exact | a round2 row whose second bracket failed (runs of equal values wider than gather_cap) | + kept:_finish_kernel via exact:exact_cut (one program) | 6 + 31 | kept:_finish |
| + logprobs | rows asking for logprobs (any route) | logprobs:_raw_logprobs_kernel; rows it cannot serve: logprobs:write_logprobs | 1 (block stats from the stats pass), + 1-2 for the general writer | launch:sample |

A row of the last four routes ends in `draw.fallback_draw`: its candidate if it was left
undecided and the cut keeps it, else the fallback draw. The candidate route is how most
rows end: a kept set of mass m keeps the candidate with probability m (top-p 0.9: about
nine rows in ten), and on a peaked row its check reads a few blocks. Each later pass
reads only the listed blocks: peaked rows a few dozen (the short route), flat ones most of
the row. The draw reads one block again (`reference`, step 6: a block by its exact kept
mass K_b, then a token inside it, whatever the filters kept): greedy, the first block
holding the max; else the block the two-level draw picks (ties also read the block of
their last kept id). A fallback whose whole kept set the short route or top-k first has
gathered (at most short_tokens tokens) is drawn over those tokens instead
(`draw.gathered_fallback`: the same draw, no block read again).

Why it is bounded: the kept set of a filtered row is a prefix of the row's order, so its
cut is found by counting, never by sorting a set whose size depends on the data. min-p's
cut is y >= ln(min_p), known once the row max is, so min-p alone reads again only the
blocks it cuts (a block it keeps whole keeps its Q_b). The short route reads at most
short_blocks blocks and sorts a vector of short_tokens slots (its candidates, padded), a
size fixed by the config. For top-k and top-p the select pass counts the row into `bins`
bins between lo and the max (exact counts; masses estimated) and places a bracket of bins
around each cut; the kept pass sums the exact integer masses outside the brackets and
gathers the bracket's tokens (at most gather_cap), and the finish resolves the cut among
them by counting: pairwise up to 64 gathered tokens, else by 16-way searches over their
keys. Every decision is checked against exact counts and masses. A bracket that does not
hold the cut (top-p's crossing is estimated from bin edges: the largest tokens' masses are
known to a bin's width) sends the row to round 2, the same passes over the bins that surely
hold every cut, binned anew (hundreds of times finer) with the mass above them counted
exactly; round 2's rows share `late_programs` programs (as round 1's do), so one such row
costs the batch two parallel passes over that row, not a serial search. Only a row
whose second bracket fails too (more than gather_cap tokens of one value at the cut) takes
the exact search (`exact`: 16-way searches over the 64-bit order keys by one program,
bounded at 31 passes but serial, so milliseconds for such a row). No estimate changes a token.
"""
