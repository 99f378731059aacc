"""Vocabulary-parallel sampling: each rank keeps its slice of the logits; the ranks
exchange a few values per row and reach the token `graphexec.sampling.reference` draws
from the whole row, bit for bit (its definition, step by step, on a slice):

  1. process    the slice (mask words, bias ids, counts, prompt mask: full-vocabulary
                state every rank holds, read at the slice's columns)
  2. +inf, max  any +inf in the row (all-reduce max), the row max m (all-reduce max)
  3. blocks     the draw's DRAW_BLOCK-id blocks: block maxima xm_b (all-reduce max over a
                [B, nblocks] array: a block may straddle two slices), then each block's
                exact int64 mass Q_b (all-reduce sum): every rank holds the same arrays,
                so the top-p total and the block draw are computed identically everywhere
  4. top-k      the k-th of the order (y desc, id asc) by a radix selection over the
                float bits: 4 rounds of a [B, 256] count histogram (all-reduce sum),
                then ties at the threshold split over the ranks in id order
  5. top-p      the same selection with a mass histogram beside the counts, the exact
                int64 fixed point of the definition; the boundary group's kept count is
                exact integer arithmetic; min-p needs only y
  6. draw       the candidate: the block b* from Q_b and the block noise (the same on
                every rank); each rank's best score in b* and its id (one all-gather of
                [B, 2]): the winner of winners, ties to the lower id. Filtered rows: the
                candidate's owner says whether it is kept (all-reduce max); kept block
                masses K_b (all-reduce sum) and the same draw on the fallback streams
  7. logprobs   max and sum of exp (all-reduce), the token's value from its owner, its
                rank (all-reduce sum of counts), top-N by merging each rank's top-N

Bytes a rank sends per row (all-reduce / all-gather payloads, before the collective's own
factor): no_filter 12 * nblocks + 16 (nblocks = ceil(V / 128)); filtered rows add
8 * nblocks (K_b) + 4 rounds x 256 x 8 (top-k counts) + 4 x 256 x 16 (top-p counts and
masses) + 3 x 8 (tie counts); logprobs add 24 + 16 N. At V = 128256: 12 KB (no_filter),
~36 KB (everything), against 2 * V * (T - 1) / T bytes of bf16 logits for all_to_all.
Every shape is static and nothing waits on the host: capturable with NCCL.
"""

from __future__ import annotations

import torch

from graphexec.distributed.comm import all_gather, all_reduce, bits_f32, f32_bits, value_at
from graphexec.params import SamplerVariant
from graphexec.rng import Stream, philox4x32
from graphexec.sampling.flags import INF_TOKEN
from graphexec.sampling.reference import (
    CANDIDATE,
    DRAW_BLOCK,
    FALLBACK,
    MASS_SCALE,
    effective_inv_t,
    first_argmax,
    mass_total,
    order_key,
    plain_rows,
    process_logits,
    row_gumbel_stream,
    sanitize,
)
from graphexec.sampling.tensors import SamplerOutput, SamplingTensors

_INF = float("inf")


def gumbel_range(seed: torch.Tensor, pos: torch.Tensor, lo: int, hi: int,
                 stream: int = Stream.TOKEN) -> torch.Tensor:  # fmt: skip
    """[B, hi - lo] token noise of ids lo..hi-1: `row_gumbel_stream`'s columns, bit for bit."""
    g0, g1 = lo // 4, (hi + 3) // 4
    groups = torch.arange(g0, g1, device=seed.device, dtype=torch.int64)
    s = seed.to(torch.int64).unsqueeze(1)
    zero = torch.zeros((), dtype=torch.int64, device=seed.device)
    words = philox4x32(groups.unsqueeze(0), pos.to(torch.int64).unsqueeze(1),
                       zero + int(stream), zero, s & 0xFFFFFFFF, s >> 32)  # fmt: skip
    bits = torch.stack(torch.broadcast_tensors(*words), dim=-1).reshape(seed.shape[0], -1)
    bits = bits[:, lo - 4 * g0 : lo - 4 * g0 + hi - lo]
    u = ((bits >> 8) | 1).to(torch.float32) * 2.0**-24
    return -torch.log(-torch.log(u))


def key_value(key: torch.Tensor) -> torch.Tensor:
    """The float32 value of an `order_key`."""
    u = torch.where(key >= 2**31, key - 2**31, 0xFFFFFFFF - key)
    return torch.where(u >= 2**31, u - 2**32, u).to(torch.int32).view(torch.float32)


def _select(key, cand, need, group, mass=None):
    """Radix selection over the ranks' candidates, 8 bits a round from the top.

    Without `mass`: (t, above) with t the key of the need-th largest candidate and
    `above` how many candidates exceed it. With `mass` [B, w] int64 and `need` a float64
    target: t is the smallest key whose mass strictly above is < need, `above` that mass.
    """
    B = key.shape[0]
    prefix = torch.zeros(B, dtype=torch.int64, device=key.device)
    above = torch.zeros(B, dtype=mass.dtype if mass is not None else torch.int64,
                        device=key.device)  # fmt: skip
    digits = torch.arange(256, device=key.device)
    for shift in (24, 16, 8, 0):
        inr = cand & ((key >> (shift + 8)) == prefix.unsqueeze(1))
        d = torch.where(inr, (key >> shift) & 255, 0)
        h = torch.zeros((B, 2 if mass is not None else 1, 256), dtype=torch.int64,
                        device=key.device)  # fmt: skip
        h[:, 0].scatter_add_(1, d, inr.to(torch.int64))
        if mass is not None:
            h[:, 1].scatter_add_(1, d, torch.where(inr, mass, 0))
        all_reduce(h, "sum", group)
        cnt = h[:, 0]
        if mass is None:
            ge = above.unsqueeze(1) + cnt.flip(1).cumsum(1).flip(1)  # candidates >= digit
            dig = torch.where(ge >= need.unsqueeze(1), digits, -1).max(1).values.clamp(min=0)
            at = dig.unsqueeze(1)
            above = (ge.gather(1, at) - cnt.gather(1, at)).squeeze(1)
        else:
            m = h[:, 1]
            gt = above.unsqueeze(1) + m.flip(1).cumsum(1).flip(1) - m  # mass above the digit
            ok = (gt.to(torch.float64) < need.unsqueeze(1)) & (cnt > 0)
            dig = torch.where(ok, digits, 256).min(1).values.clamp(max=255)
            above = gt.gather(1, dig.unsqueeze(1)).squeeze(1)
        prefix = prefix * 256 + dig
    return prefix, above


def _tie_rank(eq: torch.Tensor, group, rank: int) -> torch.Tensor:
    """[B, w] each tied entry's index among the row's ties over all ranks, in id order."""
    counts = all_gather(eq.sum(1), group)  # [T, B]
    before = counts[:rank].sum(0) if rank else torch.zeros_like(counts[0])
    return eq.to(torch.int64).cumsum(1) - 1 + before.unsqueeze(1)


def _filters(y, key, slot_ids, table, total, tp) -> torch.Tensor:
    """Step 5 on this slice: [B, w] the kept mask `reference.filter_mask` gives there."""
    g, rank = tp.group, tp.rank
    cand = y > -_INF
    k = table.top_k[slot_ids].to(torch.int64)
    n_fin = all_reduce(cand.sum(1), "sum", g)
    k_on = (k > 0) & (k < n_fin)
    t, above = _select(key, cand, torch.where(k_on, k, 1), g)
    eq = cand & (key == t.unsqueeze(1))
    keep_eq = eq & (_tie_rank(eq, g, rank) < (k - above).unsqueeze(1))
    kept = torch.where(k_on.unsqueeze(1), cand & ((key > t.unsqueeze(1)) | keep_eq), cand)
    q = torch.where(kept, (torch.exp(y) * MASS_SCALE).to(torch.int64), 0)
    tot_k = all_reduce(q.sum(1), "sum", g).to(torch.float64)
    tot = torch.where(k == 0, total, tot_k)
    p = table.top_p[slot_ids].to(torch.float64)
    target = p * tot
    t, m_gt = _select(key, kept, target, g, mass=q)
    grp = kept & (key == t.unsqueeze(1))
    q_t = (torch.exp(key_value(t)) * MASS_SCALE).to(torch.int64)
    cnt = all_reduce(grp.sum(1), "sum", g)
    # n kept in the group: the first n whose mass before (m_gt + i q_t) stays below target
    est = ((target - m_gt.to(torch.float64)) / q_t.clamp(min=1).to(torch.float64)).ceil()
    n = est.clamp(0, 2**62).to(torch.int64)
    for _ in range(2):
        n = torch.where((n > 0) & ((m_gt + (n - 1) * q_t).to(torch.float64) >= target), n - 1, n)
        n = torch.where((m_gt + n * q_t).to(torch.float64) < target, n + 1, n)
    n = torch.where(q_t == 0, cnt, n.clamp(max=cnt))
    keep_g = grp & (_tie_rank(grp, g, rank) < n.unsqueeze(1))
    p_on = (p < 1.0).unsqueeze(1)
    kept = torch.where(p_on, kept & ((key > t.unsqueeze(1)) | keep_g), kept)
    return kept & (y >= table.log_min_p[slot_ids].unsqueeze(1))


def _blocks(x: torch.Tensor, lo: int, hi: int, nb: int, fill):
    """x [B, w] as its draw blocks [B, nbl, D] (pad `fill`) and their first index."""
    b0, b1 = lo // DRAW_BLOCK, (hi - 1) // DRAW_BLOCK + 1
    left, right = lo - b0 * DRAW_BLOCK, b1 * DRAW_BLOCK - hi
    B = x.shape[0]
    xb = torch.cat([x.new_full((B, left), fill), x, x.new_full((B, right), fill)], 1)
    return xb.view(B, b1 - b0, DRAW_BLOCK), b0


def _block_mass(xb, xm_mine, inv_t, keep_b=None) -> torch.Tensor:
    """[B, nbl] the slice's part of each block's int64 mass (relative to the global xm_b)."""
    fin = torch.isfinite(xb) & torch.isfinite(xm_mine).unsqueeze(-1)
    if keep_b is not None:
        fin &= keep_b
    xs = torch.where(torch.isfinite(xm_mine), xm_mine, 0.0).unsqueeze(-1)
    z = torch.where(fin, (xb - xs) * inv_t.view(-1, 1, 1), -_INF)
    return torch.where(fin, (torch.exp(z) * MASS_SCALE).to(torch.int64), 0).sum(-1)


def _two_level(y, xc, ym, mass, among, greedy, seed, positions, streams, cols, V, g):
    """[B] the two-level draw over the tokens `among` of the slices (`reference.two_level`;
    greedy rows: the first argmax of xc): the block from the block noise (the same on
    every rank), each rank's best score in it and its id (one all-gather of [B, 2]), the
    winner of winners, ties to the lower id."""
    lo, hi = cols
    lm = torch.where(mass > 0, ym + torch.log(mass.to(torch.float32)), -_INF)
    chosen = first_argmax(lm + row_gumbel_stream(seed, positions, lm.shape[1], streams[1]))
    ids = torch.arange(lo, hi, device=y.device)
    in_block = (ids // DRAW_BLOCK).unsqueeze(0) == chosen.unsqueeze(1)
    noise = gumbel_range(seed, positions, lo, hi, streams[0])
    score = torch.where(in_block & among, y + noise, -_INF)
    score = torch.where(greedy, xc, score)
    best = score.max(1).values
    mine = torch.where(best > -_INF, first_argmax(score) + lo, V)
    both = all_gather(torch.stack([f32_bits(best), mine], 1), g)  # [T, B, 2]
    s_all, id_all = bits_f32(both[..., 0]), both[..., 1]
    top = s_all.max(0).values
    return torch.where(s_all == top.unsqueeze(0), id_all, V).min(0).values


def sample(shard: torch.Tensor, slot_ids, positions, table: SamplingTensors, out: SamplerOutput,
           bitmask=None, variant=SamplerVariant.DEFAULT, *, tp, count_ids=None,
           flag_inf: bool = False) -> SamplerOutput:  # fmt: skip
    """Sample the rows whose vocabulary slice [lo, hi) this rank holds (`tp.slice`) into
    `out` (every rank writes the same outputs); see the module docstring."""
    g, (lo, hi), V = tp.group, tp.slice, tp.vocab_size
    B, w = shard.shape
    nb = -(-V // DRAW_BLOCK)
    x = process_logits(shard, slot_ids, table, bitmask, count_ids, lo=lo)
    has_inf = all_reduce((x == _INF).any(1), "max", g).unsqueeze(1)
    xc = torch.where(has_inf, torch.where(x == _INF, 0.0, -_INF), x)
    xmax = all_reduce(xc.max(1).values, "max", g)
    valid = xmax > -_INF
    m = torch.where(valid, xmax, 0.0).unsqueeze(1)
    inv_t = effective_inv_t(slot_ids, table)
    y = (xc - m) * inv_t.unsqueeze(1)
    xb, b0 = _blocks(xc, lo, hi, nb, -_INF)
    xm = torch.full((B, nb), -_INF, device=x.device)
    xm[:, b0 : b0 + xb.shape[1]] = xb.max(-1).values
    all_reduce(xm, "max", g)
    xm_mine = xm[:, b0 : b0 + xb.shape[1]]
    q = torch.zeros((B, nb), dtype=torch.int64, device=x.device)
    q[:, b0 : b0 + xb.shape[1]] = _block_mass(xb, xm_mine, inv_t)
    all_reduce(q, "sum", g)
    ym = torch.where(xm > -_INF, (xm - m) * inv_t.view(-1, 1), -_INF)
    live = y > -_INF
    seed = table.seed[slot_ids]
    greedy = (table.temperature[slot_ids] == 0).unsqueeze(1)
    # the candidate: the two-level draw over every live token
    tok = _two_level(y, xc, ym, q, live, greedy, seed, positions, CANDIDATE, (lo, hi), V, g)
    if variant is not SamplerVariant.NO_FILTER:
        kept = _filters(y, order_key(y), slot_ids, table, mass_total(q, ym), tp)
        plain = plain_rows(slot_ids, table).unsqueeze(1)
        kept = torch.where(plain, live, kept)
        kb, _ = _blocks(kept, lo, hi, nb, False)
        k_mass = torch.zeros_like(q)
        k_mass[:, b0 : b0 + xb.shape[1]] = _block_mass(xb, xm_mine, inv_t, kb)
        all_reduce(k_mass, "sum", g)
        # kept where the candidate's owner says so; else the fallback draw over the kept set
        mine = (tok >= lo) & (tok < hi)
        at = (tok - lo).clamp(0, hi - lo - 1).unsqueeze(1)
        in_kept = all_reduce((mine & kept.gather(1, at).squeeze(1)).to(torch.int32), "max", g)
        fb = _two_level(y, xc, ym, k_mass, kept, greedy, seed, positions, FALLBACK, (lo, hi),
                        V, g)  # fmt: skip
        tok = torch.where((in_kept > 0) | greedy.squeeze(1), tok, fb)
    tok = torch.where(valid, tok, -1)
    if flag_inf:  # as `step.flag_inf`: an invalid row reads id 0
        hit = torch.isposinf(value_at(shard, tok, tp))
        tok = torch.where(hit, INF_TOKEN, tok)
        valid = valid & ~hit
    out.token_ids.copy_(tok)
    out.valid.copy_(valid)
    if out.logprobs is not None:
        _logprobs(sanitize(shard), y, slot_ids, table, tok, out, tp)
    return out


def _logprobs(raw, y, slot_ids, table, tok, out: SamplerOutput, tp) -> None:
    """Step 7 across the slices (`reference.write_logprobs`' values)."""
    g, lo = tp.group, tp.slice[0]
    w = raw.shape[1]
    v = torch.where(table.logprobs_processed[slot_ids].unsqueeze(1), y, raw)
    has_inf = all_reduce((v == _INF).any(1), "max", g).unsqueeze(1)
    v = torch.where(has_inf, torch.where(v == _INF, 0.0, -_INF), v)
    m = all_reduce(v.max(1).values, "max", g).unsqueeze(1)
    shifted = v - m
    lse = torch.log(all_reduce(torch.exp(shifted).sum(1), "sum", g)).unsqueeze(1)
    valid = tok >= 0
    tok_v = value_at(v, tok, tp).unsqueeze(1)
    out.logprobs.copy_(torch.where(valid, ((tok_v - m) - lse).squeeze(1), torch.nan))
    above = all_reduce((v > tok_v).sum(1), "sum", g)
    out.ranks.copy_(torch.where(valid, above + 1, 0))
    n = out.num_top
    if n:
        sv, si = torch.sort(v, dim=-1, descending=True, stable=True)
        k = min(n, w)
        vals = torch.full((v.shape[0], n), -_INF, device=v.device)
        idx = torch.full((v.shape[0], n), tp.vocab_size, dtype=torch.int64, device=v.device)
        vals[:, :k], idx[:, :k] = sv[:, :k], si[:, :k] + lo
        both = all_gather(torch.stack([f32_bits(vals), idx], 2), g)  # [T, B, n, 2]
        cat = both.permute(1, 0, 2, 3).reshape(v.shape[0], -1, 2)  # rank order = id order
        cv = bits_f32(cat[..., 0])
        order = torch.sort(cv, dim=1, descending=True, stable=True).indices[:, :n]
        out.top_token_ids.copy_(cat[..., 1].gather(1, order))
        out.top_logprobs.copy_((cv.gather(1, order) - m) - lse)
