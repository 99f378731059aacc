"""A step's gathered slot state, and its bookkeeping in torch (decode and speculative):
the CPU route and the definition that `step_kernels` (one CUDA launch each) computes bit
for bit."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from graphexec.sampling.flags import flag_inf, flag_inf_runs
from graphexec.sampling.tensors import SamplerOutput


@dataclass
class StepInputs:
    """The gathered state of a step's b rows: pos [b] i64 (output position), model_pos
    [b] i64, last [b] i64 (the input token), masks [b, W] i32 (a speculative step's: [b,
    K+1, W], one per offset)."""

    pos: torch.Tensor
    model_pos: torch.Tensor
    last: torch.Tensor
    masks: torch.Tensor


def gather_inputs_reference(slots, slot_ids: torch.Tensor, t: int | None = None) -> StepInputs:
    """The rows' state from `slots` (a SlotTable) for rows `slot_ids` [b]: steps 1 and 4's
    mask of `step.py` (`step_kernels.gather_inputs` on CUDA). t None: a decode's masks [b,
    W] (offset 0); t: a speculative step's [b, t, W], offset j's min_tokens applied at
    output position pos + j. The masks are a gathered copy: the slot rows stay as the
    host wrote them."""
    pos = slots.positions[slot_ids]
    model_pos = slots.prompt_lens[slot_ids] + pos - 1
    bm = slots.bitmask
    if t is None or t == 1:
        masks = slots.min_token_masks(bm[slot_ids, 0] if bm.dim() == 3 else bm[slot_ids],
                                      slot_ids, pos)  # fmt: skip
        masks = masks if t is None else masks.unsqueeze(1)
    else:
        b = slot_ids.shape[0]
        masks = bm[slot_ids, :t]
        j = torch.arange(t, device=pos.device)
        rows = slot_ids.unsqueeze(1).expand(b, t).reshape(-1)
        slots.min_token_masks(masks.view(b * t, -1), rows, (pos.unsqueeze(1) + j).reshape(-1))
    return StepInputs(pos, model_pos, slots.last_token[slot_ids], masks)


def advance_decode_reference(slots, slot_ids: torch.Tensor, logits: torch.Tensor,
                             token_ids: torch.Tensor, valid: torch.Tensor,
                             flag: bool) -> None:  # fmt: skip
    """Steps 5 and 6 for T = 1 (`step_kernels.advance_decode` on CUDA): `flag` marks
    rows that drew a +inf token (`flags.flag_inf`), then real rows advance."""
    if flag:
        flag_inf(logits, SamplerOutput(token_ids, valid))
    real = (slot_ids != slots.padding_slot) & valid
    tok = torch.where(real, token_ids, 0)
    slots.positions.index_add_(0, slot_ids, real.to(torch.int64))
    slots.last_token[slot_ids] = torch.where(real, tok, slots.last_token[slot_ids])
    counts = slots.tensors.token_counts
    if counts is not None:
        counts.index_put_((slot_ids, tok), real.to(counts.dtype), accumulate=True)


def advance_runs_reference(slots, slot_ids: torch.Tensor, values: torch.Tensor, out,
                           history=None, model_pos=None) -> None:  # fmt: skip
    """Steps 5 and 6 of a speculative step, runs of T = K + 1 (on CUDA
    `step_kernels.advance_runs`): a run holding a +inf token emits nothing
    (`flags.flag_inf_runs`; values [b, T]: the raw logits at its tokens), then each real
    row with a valid run moves past the tokens it emitted: position += them, last token =
    the last, token counts += each, and with an n-gram `history` (an `NgramHistory`) they
    go into it after `model_pos` [b]. Padding rows (the padding slot) and invalid rows
    change nothing."""
    flag_inf_runs(values, out)
    b, t = out.token_ids.shape
    real = (slot_ids != slots.padding_slot) & out.valid
    n = torch.where(real, out.num_tokens, 0)
    slots.positions.index_add_(0, slot_ids, n)
    last = out.token_ids.gather(1, (n - 1).clamp(min=0).unsqueeze(1)).squeeze(1)
    # padding rows write back the value already there, so duplicates agree
    slots.last_token[slot_ids] = torch.where(real, last, slots.last_token[slot_ids])
    counts = slots.tensors.token_counts
    if counts is not None:
        emitted = torch.arange(t, device=n.device).unsqueeze(0) < n.unsqueeze(1)
        rows = slot_ids.unsqueeze(1).expand(b, t).reshape(-1)
        toks = out.token_ids.clamp(min=0).reshape(-1)
        counts.index_put_((rows, toks), emitted.reshape(-1).to(counts.dtype), accumulate=True)
    if history is not None:
        history.write_runs(slot_ids, model_pos, out.token_ids, n)
