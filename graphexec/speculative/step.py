"""The speculative decode step: the function a `GraphKey` with spec_k = K records.

Steps, in order (all on the device, no host sync, static shapes):
  1. gather     each row's output position pos (the noise counter), model position P of
                its last token, and its draft allowance (how many of the K drafts it may
                use: fewer near max_tokens or the model's length, 0 for rows that cannot
                speculate this step)
  2. draft      n-gram: the drafts the host wrote into the step's input buffer; a draft
                model: K+1 `decode` calls on its own cache (inputs: the last token, then
                each draft), drawing draft j at position pos + j with the request's own
                parameters, penalties counting the drafts before it, and its noise (strict:
                the TOKEN stream, so an equal model drafts exactly the target's tokens;
                rejection: the SPEC_DRAFT stream, passing its distributions as q). The
                last call only writes the cache entry of the last draft.
  3. verify     target `verify` over [last token, d_0 .. d_{K-1}] at P .. P+K -> logits
                [b, K+1, W] (checked; padding columns past V dropped); `verify_step` with
                the slots' per-offset token masks, min_tokens applied at pos + j.
  4. flag       a run holding a token whose raw logit is +inf emits nothing: token -2,
                invalid (the model's fault, reported as an error)
  5. advance    for real rows: position += tokens emitted, last token = the last one,
                token counts += each emitted token. The KV entries of rejected offsets are
                overwritten by later steps. Padding rows change nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from graphexec.batch import INF_TOKEN
from graphexec.graphs import GraphKey
from graphexec.models.protocol import check_logits
from graphexec.params import MAX_TOP_LOGPROBS
from graphexec.rng import Stream
from graphexec.sampling.tensors import SamplerOutput
from graphexec.speculative.verify import VerifyOutput, clean_drafts
from graphexec.state import SlotTable


@dataclass
class SpecBuffers:
    """Static inputs and outputs of the speculative step, sized for the largest bucket.

    spec_in: i64 [N, 1+K], per row: the draft allowance, then K host drafts (-1 padded).
    out: `VerifyOutput` [N, K+1]; a key of bucket b uses the first b rows.
    """

    spec_in: torch.Tensor
    out: VerifyOutput

    @classmethod
    def allocate(cls, rows: int, k: int, device: torch.device) -> SpecBuffers:
        spec_in = torch.zeros((rows, 1 + k), dtype=torch.int64, device=device)
        spec_in[:, 1:] = -1
        return cls(spec_in, VerifyOutput.allocate(rows, k, device, MAX_TOP_LOGPROBS))

    def view(self, key: GraphKey) -> tuple[torch.Tensor, VerifyOutput]:
        b = key.bucket
        out = self.out.rows(b)
        if not key.logprobs:
            s = out.sampled
            out.sampled = SamplerOutput(s.token_ids, s.valid)
            out.logprobs = out.ranks = out.top_logprobs = out.top_token_ids = None
        return self.spec_in[:b, : 1 + key.spec_k], out


def draft_model_tokens(draft, slots: SlotTable, slot_ids, pos, model_pos, k: int, sampler,
                       key: GraphKey, method: str, masks=None):  # fmt: skip
    """Step 2 with a draft model: ([b, K] drafts, [b, K, V] q or None). `masks` [b, K+1, W]:
    the token masks per offset (strict drafts are drawn under them, so a draft model
    equal to the target still drafts the target's tokens)."""
    b = slot_ids.shape[0]
    inp = slots.last_token[slot_ids]
    drafts, probs = [], []
    out = SamplerOutput.allocate(b, slot_ids.device, None)
    for j in range(k + 1):
        logits = draft.decode(inp, model_pos + j, slot_ids)
        if j == k:
            break  # this call only wrote the cache entry of the last draft
        logits = check_logits(logits, (b, draft.vocab_size), draft, "decode")
        logits = logits[:, : slots.vocab_size]
        before = torch.stack(drafts, dim=1) if drafts else None
        if method == "strict":
            m = None if masks is None else masks[:, j]
            sampler(logits, slot_ids, pos + j, slots.tensors, out, m, key.variant,
                    count_ids=before)  # fmt: skip
            d = out.token_ids.clone()
        else:
            d, q = _draw_q(logits, slot_ids, pos + j, slots, key, before)
            probs.append(q)
        drafts.append(d)
        inp = d.clamp(min=0)
    return torch.stack(drafts, dim=1), (torch.stack(probs, dim=1) if probs else None)


def _draw_q(logits, slot_ids, pos, slots: SlotTable, key: GraphKey, before):
    """A rejection-mode draft: its distribution q (the draft's processed, filtered
    probabilities, as the sampler defines them) and a draw from it on SPEC_DRAFT."""
    from graphexec.rng import gumbel
    from graphexec.sampling import reference as ref
    from graphexec.speculative.reference import target_probs

    xc = ref.collapse_inf(ref.process_logits(logits, slot_ids, slots.tensors, None, before))
    q, _ = target_probs(xc, slot_ids, slots.tensors, key.variant)
    ids = torch.arange(q.shape[1], device=q.device).unsqueeze(0)
    seed = slots.tensors.seed[slot_ids].unsqueeze(1)
    g = gumbel(seed, pos.unsqueeze(1), ids, Stream.SPEC_DRAFT).to(torch.float64)
    score = torch.where(q > 0, torch.log(q) + g, -torch.inf)
    d = torch.where((q > 0).any(dim=1), ref.first_argmax(score), -1)
    return d, q.to(torch.float32)


def spec_step(model, slots: SlotTable, slot_ids: torch.Tensor, spec_in: torch.Tensor,
              out: VerifyOutput, key: GraphKey, sampler, draft=None,
              method: str = "strict") -> None:  # fmt: skip
    """One speculative step for the rows `slot_ids` [b] into `out` (module docstring)."""
    k = key.spec_k
    pos = slots.positions[slot_ids]
    model_pos = slots.prompt_lens[slot_ids] + pos - 1
    allow = spec_in[:, 0]
    masks = run_masks(slots, slot_ids, pos, k + 1)
    q = None
    if draft is None:
        drafts = spec_in[:, 1 : 1 + k]
    else:
        drafts, q = draft_model_tokens(draft, slots, slot_ids, pos, model_pos, k, sampler, key,
                                       method, masks)  # fmt: skip
    j = torch.arange(k, device=slot_ids.device).unsqueeze(0)
    drafts = clean_drafts(torch.where(j < allow.unsqueeze(1), drafts, -1), slots.vocab_size)
    inputs = torch.cat([slots.last_token[slot_ids].unsqueeze(1), drafts.clamp(min=0)], dim=1)
    raw = model.verify(inputs, model_pos, slot_ids)
    b = slot_ids.shape[0]
    logits = check_logits(raw, (b, k + 1, sampler.width(model)), model, "verify")
    logits = sampler.clip(logits, slots.vocab_size)
    sampler.verify(logits, drafts, slot_ids, pos, slots.tensors, out, masks, q, method,
                   key.variant)  # fmt: skip
    flag_inf_runs(logits, out, sampler.tp)
    advance_run(slots, slot_ids, out)


def run_masks(slots: SlotTable, slot_ids, pos, t: int) -> torch.Tensor:
    """The rows' token masks per offset [b, t, W] (a gathered copy), min_tokens applied
    at output position pos + j for offset j."""
    b = slot_ids.shape[0]
    masks = slots.bitmask[slot_ids, :t]  # [b, t, W]
    j = torch.arange(t, device=pos.device)
    rows = slot_ids.unsqueeze(1).expand(b, t).reshape(-1)
    flat = masks.view(b * t, -1)
    slots.min_token_masks(flat, rows, (pos.unsqueeze(1) + j).reshape(-1))
    return masks


def flag_inf_runs(logits: torch.Tensor, out: VerifyOutput, tp=None) -> None:
    """Step 4: a run holding a token whose raw logit is +inf emits nothing (token -2).
    With `tp`, `logits` is this rank's vocabulary slice: its owner reads each token."""
    t = out.token_ids
    emitted = torch.arange(t.shape[1], device=t.device).unsqueeze(0) < out.num_tokens.unsqueeze(1)
    if tp is None:
        inf = torch.isposinf(logits.gather(2, t.clamp(min=0).unsqueeze(2)).squeeze(2))
    else:
        from graphexec.distributed.comm import value_at

        inf = torch.isposinf(value_at(logits, t, tp))
    hit = (inf & emitted).any(dim=1) & out.valid
    t[:, 0] = torch.where(hit, INF_TOKEN, t[:, 0])
    out.num_tokens.copy_(torch.where(hit, 0, out.num_tokens))
    out.num_accepted.copy_(torch.where(hit, 0, out.num_accepted))
    out.valid &= ~hit


def advance_run(slots: SlotTable, slot_ids: torch.Tensor, out: VerifyOutput) -> None:
    """Step 4: move each real row's decode state past the tokens it emitted."""
    b, t = out.token_ids.shape
    real = (slot_ids != slots.padding_slot) & out.valid
    n = torch.where(real, out.num_tokens, 0)
    slots.positions.index_add_(0, slot_ids, n)
    last = out.token_ids.gather(1, (n - 1).clamp(min=0).unsqueeze(1)).squeeze(1)
    slots.last_token[slot_ids] = torch.where(real, last, slots.last_token[slot_ids])
    counts = slots.tensors.token_counts
    if counts is not None:
        emitted = torch.arange(t, device=n.device).unsqueeze(0) < n.unsqueeze(1)
        rows = slot_ids.unsqueeze(1).expand(b, t).reshape(-1)
        toks = out.token_ids.clamp(min=0).reshape(-1)
        counts.index_put_((rows, toks), emitted.reshape(-1).to(counts.dtype), accumulate=True)
