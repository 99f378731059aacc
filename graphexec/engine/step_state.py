"""A decode step's gathered slot state, and its bookkeeping in torch: the CPU route and
the definition that `step_kernels` (one CUDA launch each side) computes bit for bit."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from graphexec.sampling.flags import flag_inf
from graphexec.sampling.tensors import SamplerOutput


@dataclass
class StepInputs:
    """The gathered state of a decode step's b rows: pos [b] i64 (output position),
    model_pos [b] i64, last [b] i64 (the input token), masks [b, W] i32."""

    pos: torch.Tensor
    model_pos: torch.Tensor
    last: torch.Tensor
    masks: torch.Tensor


def gather_inputs_reference(slots, slot_ids: torch.Tensor) -> StepInputs:
    """The decode rows' state from `slots` (a SlotTable) for rows `slot_ids` [b]: steps
    1 and 4's mask of `step.py` (`step_kernels.gather_inputs` on CUDA)."""
    pos = slots.positions[slot_ids]
    model_pos = slots.prompt_lens[slot_ids] + pos - 1
    bm = slots.bitmask
    masks = bm[slot_ids, 0] if bm.dim() == 3 else bm[slot_ids]
    return StepInputs(pos, model_pos, slots.last_token[slot_ids],
                      slots.min_token_masks(masks, slot_ids, pos))  # fmt: skip


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
