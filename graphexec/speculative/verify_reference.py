"""Rejection-mode verification in torch: the definition (and, for now, the only backend
of its probability step; the ordinary draw it builds on runs on the caller's backend).

For offset j of row b (p_j: the processed, filtered target distribution of that offset's
row, the distribution the ordinary sampler draws from; q_j: the draft's, one-hot at d_j
when draft_probs is None):

    accept d_j   iff  u * q_j(d_j) < p_j(d_j),  u = u(seed, pos + j, d_j, SPEC_ACCEPT)
    recovered    argmax over r = max(0, p_j - q_j) > 0 of log r + g(seed, pos + j, i,
                 SPEC_RECOVER), ties to the lower id (the ordinary token if r is all 0)
    bonus        the ordinary token t_j (TOKEN stream), where the drafts end

Each use has its own stream, so the coin never correlates with the token it tests
(Leviathan et al. 2023, Chen et al. 2023: the emitted tokens are distributed as p).
"""

from __future__ import annotations

import torch

from graphexec.params import SamplerVariant
from graphexec.rng import Stream, uniform
from graphexec.sampling import processing
from graphexec.sampling import reference as ref
from graphexec.sampling.tensors import SamplingTensors


def target_probs(xc: torch.Tensor, slot_ids: torch.Tensor, table: SamplingTensors,
                 variant: SamplerVariant,
                 draw_block: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(p [R, V] float64, y [R, V]) of collapsed processed rows xc: the distribution the
    sampler draws from (greedy rows one-hot at the first argmax; rows with nothing
    samplable all zero)."""
    y = processing.scale(xc, slot_ids, table)
    live = y > -torch.inf
    if variant is SamplerVariant.NO_FILTER:
        kept = live
    else:
        inv_t = ref.effective_inv_t(slot_ids, table)
        total = ref.row_mass(xc, inv_t, draw_block or ref.DRAW_BLOCK)
        kept = ref.filter_mask(y, slot_ids, table, total)
        kept = torch.where(ref.plain_rows(slot_ids, table).unsqueeze(1), live, kept)
    greedy = (table.temperature[slot_ids] == 0).unsqueeze(1)
    top = ref.first_argmax(xc).unsqueeze(1)
    onehot = torch.arange(xc.shape[1], device=xc.device).unsqueeze(0) == top
    kept = torch.where(greedy, onehot & live, kept)
    w = torch.where(kept, torch.exp(y.to(torch.float64)), 0.0)
    return w / w.sum(dim=1, keepdim=True).clamp_min(torch.finfo(torch.float64).tiny), y


def rejection(flat, drafts, rows_slot, rows_pos, count_ids, table, bitmask, draft_probs,
              variant, out, draw_block: int | None = None) -> None:  # fmt: skip
    """Steps 3-5 of `verify.verify_step` in rejection mode; out.sampled holds the ordinary
    draw of every offset already."""

    B, K = drafts.shape
    T, V = K + 1, flat.shape[1]
    xc = processing.collapse_inf(
        processing.process_logits(flat, rows_slot, table, bitmask, count_ids)
    )
    p, y = target_probs(xc, rows_slot, table, variant, draw_block)
    p = p.view(B, T, V)
    tok = out.sampled.token_ids.view(B, T)
    if K:
        seed = table.seed[rows_slot].view(B, T)[:, :K]
        pos = rows_pos.view(B, T)[:, :K]
        has = drafts >= 0
        d = drafts.clamp(min=0)
        pk = p[:, :K]
        px = pk.gather(2, d.unsqueeze(2)).squeeze(2)
        if draft_probs is None:
            q = torch.zeros_like(pk).scatter_(2, d.unsqueeze(2), 1.0)
        else:
            q = draft_probs.to(torch.float64)
        qx = q.gather(2, d.unsqueeze(2)).squeeze(2)
        u = uniform(seed, pos, d, Stream.SPEC_ACCEPT).to(torch.float64)
        accepted = has & (u * qx < px)
        r = (pk - q).clamp(min=0)
        # gumbel(seed, pos, ids 0..V-1) per draft, one Philox call per 4 ids
        g = ref.row_gumbel_stream(seed.reshape(-1), pos.reshape(-1), V, Stream.SPEC_RECOVER)
        g = g.view(B, K, V)
        score = torch.where(r > 0, torch.log(r) + g.to(torch.float64), -torch.inf)
        rec = ref.first_argmax(score.view(B * K, V)).view(B, K)
        rec = torch.where((r > 0).any(dim=2), rec, tok[:, :K])
        cand = torch.cat([torch.where(has, rec, tok[:, :K]), tok[:, K:]], dim=1)
    else:
        accepted = drafts >= 0
        cand = tok
    emit(drafts, accepted, cand, out)
    if out.logprobs is not None:
        ref.write_logprobs(processing.sanitize(flat), y, rows_slot, table,
                           out.token_ids.reshape(-1), out.sampled)  # fmt: skip


def emit(drafts: torch.Tensor, accepted: torch.Tensor, cand: torch.Tensor, out) -> None:
    """Step 4: from drafts [B, K], accepted [B, K] (per offset, not yet cumulative) and
    cand [B, T] (the token each offset emits if the run stops there, -1 if nothing is
    samplable), write tokens, counts and validity into `out` (a `VerifyOutput`)."""
    B, K = drafts.shape
    T = K + 1
    n_acc = torch.cumprod(accepted.to(torch.int64), dim=1).sum(dim=1) if K else cand.new_zeros(B)
    last = cand.gather(1, n_acc.unsqueeze(1)).squeeze(1)
    ok = last >= 0
    n_tok = n_acc + ok.to(torch.int64)
    j = torch.arange(T, device=cand.device).unsqueeze(0)
    padded = torch.cat([drafts, drafts.new_full((B, 1), -1)], dim=1)
    at_end = (j == n_acc.unsqueeze(1)) & ok.unsqueeze(1)
    tokens = torch.where(j < n_acc.unsqueeze(1), padded, torch.where(at_end, last.unsqueeze(1), -1))
    out.token_ids.copy_(tokens)
    out.num_tokens.copy_(n_tok)
    out.num_accepted.copy_((n_tok - 1).clamp(min=0))
    out.valid.copy_(n_tok > 0)
