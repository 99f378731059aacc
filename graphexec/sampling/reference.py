"""Pure-torch sampler: the definition every other backend is tested against.

Per batch row b (slot s = slot_ids[b], output position positions[b]):

1. **Sanitise.** raw = float32(logits[b]); NaN -> -inf.
2. **Process** (`process_logits`), in this order: grammar bitmask (disallowed -> -inf);
   logit bias (x += bias); repetition penalty on tokens seen in the prompt or the output
   (x > 0: x * fp32(1/rep), else x * rep); frequency then presence penalty
   (x -= freq * count; x -= presence where count > 0).
3. **Collapse +inf** (`collapse_inf`): if any entry is +inf, the row becomes 0 at its
   +inf entries and -inf elsewhere, so it samples uniformly among them.
4. **Temperature** (`scale`): y = (x - max x) * fp32(1/T) (1/T clamped to the largest
   float32; greedy rows use 1). Shifting by the max first keeps y <= 0 with its maximum
   exactly 0, so no temperature overflows and tied maxima stay exact ties for the noise.
5. **Filter.** Order the row by (y descending, token id ascending). The kept set is a
   prefix of that order: top-k keeps the first k; top-p then keeps the shortest prefix of
   those whose mass reaches p times their total mass; min-p keeps y >= log_min_p (the
   table's fp32 ln(min_p), so every backend compares the same bits). Mass is exact
   integer fixed point, q = trunc(exp(y) * 2**32) (int64, summed exactly, so no split of
   the row changes a decision), compared in float64: keep position j iff
   sum(q before j) < p * total. With top-k on, total is the exact sum of q over the top-k
   prefix; with top-k off it is the row's mass from its block stats (step 6), each
   block's term truncated to 2**-8 of a unit and summed exactly in int64, so no order or
   layout of the sum changes it:
       total = 2**-8 * sum over blocks b of trunc(float64(Q_b) * exp(float64(ym_b)) * 2**8)
   with ym_b = (xm_b - m) * s the block's max of y, so the sampler gets it from one
   read of the row without knowing m in advance.
6. **Draw.** Greedy rows take the argmax of x. A row whose maximum is -inf has nothing
   to sample: valid = False, token -1. Every other row draws first and filters second:
   a. **Candidate.** c = the **two-level draw** over every live token (the row
      unfiltered), with the noise streams TOKEN and BLOCK.
   b. **Membership.** If c is in the kept set of step 5, c is the token.
   c. **Fallback.** Otherwise the token is the two-level draw over the kept set, with
      the independent streams FALLBACK_TOKEN and FALLBACK_BLOCK.
   With kept set K of mass m (under the unfiltered distribution p) this is exact:
   P(x) = p_x + (1 - m) p_x / m = p_x / m for x in K. Rows with no active filter keep
   every live token, so their token is always the candidate.
   The two-level draw reads the row once and draws token noise for one block only. Cut
   the row into blocks of DRAW_BLOCK consecutive token ids; with g(seed, pos, i, stream)
   the Gumbel noise of `graphexec.rng` and ties always to the lower index:
       L_b = ym_b + log(fp32(K_b))         (-inf where K_b = 0)
       b*  = argmax of L_b + g(seed, pos, b, block stream)
       token = argmax of y + g(seed, pos, token, token stream) over the drawn-from
               tokens of block b*
   K_b is the block's mass over the tokens drawn from, relative to its max, an exact
   int64 sum
       K_b = sum over those i of trunc(exp((x_i - xm_b) * s) * 2**32)
   with xm_b the block max of the collapsed x, so the first read of the row gives it
   without knowing m. For the candidate (every finite x_i) K_b = Q_b, the block stats.
   P(b) is the block's share of the mass and P(token | b) its share within the block, so
   the draw is exact up to the 2**-32 fixed point (per token, relative to its block
   max); every block holding a drawn-from token holds one of mass 2**32 (its max).
7. **Logprobs** of the raw row (default) or of the processed row y before the filters
   (`logprobs_mode="processed"`), both +inf-collapsed: lp = (v - m) - log(sum
   exp(v - m)); rank = 1 + #(v_j > v_token); the top-N by (v desc, id asc).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from graphexec.params import TOP_K_FIRST_MAX, SamplerVariant
from graphexec.rng import Stream, philox4x32
from graphexec.sampling.processing import (
    collapse_inf,
    effective_inv_t,
    process_logits,
    row_max,
    sanitize,
    scale,
)
from graphexec.sampling.tensors import SamplerOutput, SamplingTensors

MASS_SCALE = 2.0**32  # fixed-point scale of probability mass relative to the row max
DRAW_BLOCK = 128  # token ids per block of the two-level draw (part of the definition)
TOTAL_SCALE = 2.0**8  # fixed point of the top-p total's per-block terms (step 5)


def first_argmax(x: torch.Tensor) -> torch.Tensor:
    """Row-wise argmax with ties to the lowest index (explicitly, for any torch build)."""
    m = x.max(dim=-1, keepdim=True).values
    idx = torch.arange(x.shape[-1], device=x.device).expand_as(x)
    return torch.where(x == m, idx, x.shape[-1]).min(dim=-1).values


def row_gumbel_stream(seed: torch.Tensor, pos: torch.Tensor, n: int, stream: int) -> torch.Tensor:
    """[B, n] Gumbel noise of indices 0..n-1 of each row: one Philox call per 4 indices."""
    groups = torch.arange((n + 3) // 4, device=seed.device, dtype=torch.int64)
    s = seed.to(torch.int64).unsqueeze(1)
    zero = torch.zeros((), dtype=torch.int64, device=seed.device)
    words = philox4x32(groups.unsqueeze(0), pos.to(torch.int64).unsqueeze(1), zero + int(stream),
                       zero, s & 0xFFFFFFFF, s >> 32)  # fmt: skip
    bits = torch.stack(torch.broadcast_tensors(*words), dim=-1).reshape(seed.shape[0], -1)
    u = ((bits[:, :n] >> 8) | 1).to(torch.float32) * 2.0**-24
    return -torch.log(-torch.log(u))


def filter_mask(x: torch.Tensor, slot_ids: torch.Tensor, table: SamplingTensors,
                total: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """Step 5 on scaled rows y: [B, V] bool, True where a token survives the filters.

    total: [B] float64 top-p total for rows with top-k off (`row_mass`); None sums q
    over the row instead (tests of other backends use that approximation)."""
    sv, si = torch.sort(x, dim=-1, descending=True, stable=True)
    kept = _prefix_kept(sv, slot_ids, table, total)
    return torch.zeros_like(kept).scatter(1, si, kept)


def order_key(y: torch.Tensor) -> torch.Tensor:
    """int64 in [0, 2**32) ordered as the float32 values (-0.0 read as +0.0)."""
    u = (y + 0.0).contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    return torch.where(u >= 2**31, 0xFFFFFFFF - u, u + 2**31)


def filter_top_k_first(x: torch.Tensor, slot_ids: torch.Tensor, table: SamplingTensors,
                       k_max: int = TOP_K_FIRST_MAX) -> torch.Tensor:  # fmt: skip
    """`filter_mask` of rows whose top-k is on, at most k_max (`SamplerVariant.TOP_K_TOP_P`),
    from the first k_max tokens of each row's order alone (a top-k of the order keys, no
    sort of the row). Rows with top-k off must have no active filter."""
    ids = torch.arange(x.shape[1], device=x.device, dtype=torch.int64)
    # (value, id) in one int64, larger where earlier in the order: distinct
    packs = ((order_key(x) - 2**31) << 32) | (0xFFFFFFFF - ids)
    si = torch.topk(packs, min(k_max, x.shape[1]), dim=-1).indices
    kept = _prefix_kept(x.gather(1, si), slot_ids, table, None)
    return torch.zeros_like(x, dtype=torch.bool).scatter(1, si, kept)


def _prefix_kept(sv: torch.Tensor, slot_ids: torch.Tensor, table: SamplingTensors,
                 total: torch.Tensor | None) -> torch.Tensor:  # fmt: skip
    """[B, n] bool: which of the first n tokens of each row's order (values sv, in order)
    the filters keep (`filter_mask`)."""
    m = sv[:, :1]
    kept = sv > -torch.inf
    rank = torch.arange(sv.shape[1], device=sv.device).unsqueeze(0)
    k = table.top_k[slot_ids].to(torch.int64).unsqueeze(1)
    kept &= (k == 0) | (rank < k)
    rel = torch.exp(sv - torch.where(m > -torch.inf, m, 0.0))
    q = torch.where(kept, (rel * MASS_SCALE).to(torch.int64), 0)
    before = torch.cumsum(q, dim=-1) - q
    tot = q.sum(dim=-1, keepdim=True).to(torch.float64)
    if total is not None:
        tot = torch.where(k == 0, total.to(torch.float64).unsqueeze(1), tot)
    p = table.top_p[slot_ids].to(torch.float64).unsqueeze(1)
    kept &= (p >= 1.0) | (before.to(torch.float64) < p * tot)
    return kept & (sv >= table.log_min_p[slot_ids].unsqueeze(1))


def plain_rows(slot_ids: torch.Tensor, table: SamplingTensors) -> torch.Tensor:
    """[B] bool: rows with no active filter (they take the two-level draw)."""
    off_k = table.top_k[slot_ids] == 0
    return off_k & (table.top_p[slot_ids] >= 1.0) & (table.min_p[slot_ids] <= 0.0)


def block_stats(xc: torch.Tensor, inv_t: torch.Tensor, draw_block: int,
                kept: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """([B, nblocks] f32 block max xm_b, [B, nblocks] int64 Q_b) of collapsed rows xc: Q_b
    = sum of trunc(exp((x_i - xm_b) * s) * 2**32) over the finite x_i of the block; with a
    mask `kept` of filtered rows, over the kept ones only (K_b)."""
    B, V = xc.shape
    nb = -(-V // draw_block)
    pad = nb * draw_block - V
    xb = torch.cat([xc, xc.new_full((B, pad), -torch.inf)], 1).view(B, nb, draw_block)
    xm = xb.max(dim=-1).values
    fin = torch.isfinite(xb) & torch.isfinite(xm).unsqueeze(-1)
    if kept is not None:
        fin &= torch.cat([kept, kept.new_zeros((B, pad))], 1).view(B, nb, draw_block)
    xs = torch.where(torch.isfinite(xm), xm, 0.0).unsqueeze(-1)
    z = torch.where(fin, (xb - xs) * inv_t.view(B, 1, 1), -torch.inf)
    return xm, torch.where(fin, (torch.exp(z) * MASS_SCALE).to(torch.int64), 0).sum(-1)


def row_mass(xc: torch.Tensor, inv_t: torch.Tensor, draw_block: int,
             stats: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:  # fmt: skip
    """[B] float64 total of step 5 (top-k off) of collapsed rows xc (stats: the rows'
    `block_stats`, when already computed)."""
    xm, q = stats if stats is not None else block_stats(xc, inv_t, draw_block)
    return mass_total(q, block_ymax(xc, xm, inv_t))


def mass_total(q: torch.Tensor, ym: torch.Tensor) -> torch.Tensor:
    """[B] float64 sum_b Q_b * exp(ym_b) of blocks' masses q [B, nblocks] (int64) and
    maxes ym (y scale): each term truncated to 2**-8 and summed in int64, exact in any
    order (at most V * 2**40 < 2**63 for V <= MAX_VOCAB)."""
    terms = q.to(torch.float64) * torch.exp(ym.to(torch.float64)) * TOTAL_SCALE
    fixed = torch.where(q > 0, terms, 0.0).to(torch.int64)
    return fixed.sum(dim=-1).to(torch.float64) * (1.0 / TOTAL_SCALE)


def block_ymax(xc: torch.Tensor, xm: torch.Tensor, inv_t: torch.Tensor) -> torch.Tensor:
    """[B, nblocks] ym_b: the block maxes xm_b of collapsed rows xc on the scale of y
    (-inf for dead blocks)."""
    return torch.where(xm > -torch.inf, (xm - row_max(xc)) * inv_t.view(-1, 1), -torch.inf)


def two_level(y: torch.Tensor, ym: torch.Tensor, mass: torch.Tensor, among: torch.Tensor,
              seed: torch.Tensor, positions: torch.Tensor, streams: tuple[int, int],
              draw_block: int) -> torch.Tensor:  # fmt: skip
    """[B] the two-level draw of step 6 over the tokens `among` [B, V] (block masses
    `mass` [B, nblocks] over them), with noise streams (token, block)."""
    V = y.shape[1]
    lm = torch.where(mass > 0, ym + torch.log(mass.to(torch.float32)), -torch.inf)
    bg = row_gumbel_stream(seed, positions, lm.shape[1], streams[1])
    chosen = first_argmax(lm + bg)
    in_block = (torch.arange(V, device=y.device) // draw_block).unsqueeze(0) == chosen.unsqueeze(1)
    g = row_gumbel_stream(seed, positions, V, streams[0])
    return first_argmax(torch.where(in_block & among, y + g, -torch.inf))


CANDIDATE = (Stream.TOKEN, Stream.BLOCK)
FALLBACK = (Stream.FALLBACK_TOKEN, Stream.FALLBACK_BLOCK)


@dataclass
class Draw:
    """Step 6 per row: the token, whether the row had one, and how it was reached
    (`candidate` [B]: the unfiltered draw; `kept` [B]: whether the token is it)."""

    token_ids: torch.Tensor
    valid: torch.Tensor
    candidate: torch.Tensor
    kept: torch.Tensor


def draw_rows(xc: torch.Tensor, y: torch.Tensor, slot_ids: torch.Tensor,
              positions: torch.Tensor, table: SamplingTensors, kept: torch.Tensor | None,
              draw_block: int = DRAW_BLOCK,
              stats: tuple[torch.Tensor, torch.Tensor] | None = None) -> Draw:  # fmt: skip
    """Step 6 from scaled rows y (xc: collapsed y's source, for greedy rows and the block
    masses; stats: its `block_stats`, if known; kept: the filters' mask, None when no row
    has an active filter)."""
    seed = table.seed[slot_ids]
    inv_t = effective_inv_t(slot_ids, table)
    xm, q = stats if stats is not None else block_stats(xc, inv_t, draw_block)
    ym = block_ymax(xc, xm, inv_t)
    live = y > -torch.inf
    cand = two_level(y, ym, q, live, seed, positions, CANDIDATE, draw_block)
    tok, in_kept = cand, torch.ones_like(cand, dtype=torch.bool)
    if kept is not None:
        kept = torch.where(plain_rows(slot_ids, table).unsqueeze(1), live, kept)
        in_kept = kept.gather(1, cand.unsqueeze(1)).squeeze(1)
        kb = block_stats(xc, inv_t, draw_block, kept)[1]
        fallback = two_level(y, ym, kb, kept, seed, positions, FALLBACK, draw_block)
        tok = torch.where(in_kept, cand, fallback)
    greedy = table.temperature[slot_ids] == 0
    tok = torch.where(greedy, first_argmax(xc), tok)
    valid = xc.max(dim=-1).values > -torch.inf
    return Draw(torch.where(valid, tok, -1), valid, cand, in_kept | greedy)


def block_ordered_sum(e: torch.Tensor, block: int = DRAW_BLOCK) -> torch.Tensor:
    """[B] sums of the rows of e [B, V]: each block of `block` columns summed, then the
    blocks. torch splits one long row's sum across threads when the batch is small and
    gives each thread whole rows when it is large; short sums over many rows are summed
    the same way at any B, so a row's bits do not depend on the batch."""
    B, V = e.shape
    pad = -V % block
    if pad:
        e = torch.cat([e, e.new_zeros(B, pad)], dim=1)
    return e.view(B, -1, block).sum(dim=-1).sum(dim=-1)


def log_softmax_rows(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logprobs, row max [B, 1], log-sum-exp [B, 1]) of float32 rows v [B, V] whose infs
    are collapsed: v - max - log(the block-ordered sum of exp(v - max)), the order the
    logprobs writers use, so every caller gets the same bits for the same row."""
    m = v.max(dim=-1, keepdim=True).values
    shifted = v - m
    lse = torch.log(block_ordered_sum(torch.exp(shifted))).unsqueeze(1)
    return shifted - lse, m, lse


def write_logprobs(raw: torch.Tensor, y: torch.Tensor, slot_ids: torch.Tensor,
                   table: SamplingTensors, tokens: torch.Tensor,
                   out: SamplerOutput) -> None:  # fmt: skip
    """Step 7, into out.logprobs / ranks / top_logprobs / top_token_ids."""
    processed = table.logprobs_processed[slot_ids].unsqueeze(1)
    v = collapse_inf(torch.where(processed, y, raw))
    lp, m, lse = log_softmax_rows(v)
    valid = tokens >= 0
    safe = tokens.clamp(min=0).unsqueeze(1)
    tok_v = v.gather(1, safe)
    out.logprobs.copy_(torch.where(valid, lp.gather(1, safe).squeeze(1), torch.nan))
    out.ranks.copy_(torch.where(valid, (v > tok_v).sum(dim=1) + 1, 0))
    n = out.num_top
    if n:
        sv, si = torch.sort(v, dim=-1, descending=True, stable=True)
        out.top_token_ids.copy_(si[:, :n])
        out.top_logprobs.copy_((sv[:, :n] - m) - lse)


def draw_batch(logits: torch.Tensor, slot_ids: torch.Tensor, positions: torch.Tensor,
               table: SamplingTensors, bitmask: torch.Tensor | None = None,
               variant: SamplerVariant = SamplerVariant.DEFAULT, *, draw_block: int = DRAW_BLOCK,
               count_ids: torch.Tensor | None = None) -> tuple[Draw, torch.Tensor]:  # fmt: skip
    """Steps 1-6 of raw logits [B, V]: (the `Draw`, the scaled rows y)."""
    xc = collapse_inf(process_logits(logits, slot_ids, table, bitmask, count_ids))
    y = scale(xc, slot_ids, table)
    # block stats serve both the top-p total and the two-level draw: computed once
    inv_t = effective_inv_t(slot_ids, table)
    stats = block_stats(xc, inv_t, draw_block)
    kept = None
    if variant is SamplerVariant.TOP_K_TOP_P:
        kept = filter_top_k_first(y, slot_ids, table)
    elif variant is not SamplerVariant.NO_FILTER:
        kept = filter_mask(y, slot_ids, table, row_mass(xc, inv_t, draw_block, stats))
    return draw_rows(xc, y, slot_ids, positions, table, kept, draw_block, stats), y


def sample(logits: torch.Tensor, slot_ids: torch.Tensor, positions: torch.Tensor,
           table: SamplingTensors, out: SamplerOutput, bitmask: torch.Tensor | None = None,
           variant: SamplerVariant = SamplerVariant.DEFAULT, *, draw_block: int = DRAW_BLOCK,
           count_ids: torch.Tensor | None = None) -> SamplerOutput:  # fmt: skip
    """The torch backend of `graphexec.sampling.pipeline.sample_step` (`draw_block` is
    for tests only: the library always uses DRAW_BLOCK)."""
    d, y = draw_batch(logits, slot_ids, positions, table, bitmask, variant,
                      draw_block=draw_block, count_ids=count_ids)  # fmt: skip
    out.token_ids.copy_(d.token_ids)
    out.valid.copy_(d.valid)
    if out.logprobs is not None:
        write_logprobs(sanitize(logits), y, slot_ids, table, d.token_ids, out)
    return out
