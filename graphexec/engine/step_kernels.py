"""The decode step's bookkeeping in two launches instead of ~20 small torch kernels.

Around the model and the sampler a decode step (T = 1) gathers each row's state from
the slot table and, after the draw, writes it back. In torch that is a dozen gathers,
compares and scatters on each side, each its own kernel in the captured graph. Here:

    _inputs_kernel  grid (b,): steps 1 and 4's mask of `step.py` for one row: its
        output position pos, the model position of its last token (prompt_len + pos -
        1), the last token, and its token mask row copied from the slot table with the
        min_tokens bits cleared while pos < min_tokens.
    _advance_kernel grid (b,): steps 5 and 6: a row that drew a token whose raw logit is
        +inf gets INF_TOKEN and valid = False (unless the draw already flags them); a
        real row (not the padding slot, valid) advances: position + 1, last token, and
        its token count + 1.

Each has a torch reference (`step_state.*_reference`, the CPU route and the tests'
definition); both are integer work, so the two give the same values, bit for bit. Both
launch with programmatic dependent launch where the device has it (each waits for the
kernel before it before touching anything). A row touches
only its own slot (real rows hold distinct slots; padding rows write nothing).
"""

from __future__ import annotations

import torch

from graphexec.engine.step_state import StepInputs
from graphexec.kernels.dependent_launch import dependent_start, kernel_options
from graphexec.runtime.triton_import import tl, triton
from graphexec.sampling.flags import INF_TOKEN


@triton.jit
def _or(a, b):
    return a | b


@triton.jit
def _inputs_kernel(
    SLOT,  # [b] i64: slot of each row
    POSITIONS,  # [S] i64: output position per slot
    PROMPT_LENS,  # [S] i64
    LAST_TOKEN,  # [S] i64
    BITMASK,  # [S, ..., W] i32: offset 0 of each slot's row (slot stride s_bm)
    MIN_TOKENS,  # [S] i64
    MIN_WORDS,  # [S, M] i64: words holding held-back ids (entries may repeat)
    MIN_BITS,  # [S, M] i32
    POS_OUT, MODEL_POS_OUT, LAST_OUT,  # [b] i64
    MASK_OUT,  # [b, W] i32 contiguous
    s_bm, W, M,
    BLOCK: tl.constexpr, M_PAD: tl.constexpr,
    PDL: tl.constexpr = False,  # programmatic dependent launch (`dependent_launch`)
):  # fmt: skip
    dependent_start(PDL)
    r = tl.program_id(0).to(tl.int64)
    slot = tl.load(SLOT + r)
    pos = tl.load(POSITIONS + slot)
    tl.store(POS_OUT + r, pos)
    tl.store(MODEL_POS_OUT + r, tl.load(PROMPT_LENS + slot) + pos - 1)
    tl.store(LAST_OUT + r, tl.load(LAST_TOKEN + slot))
    for w0 in range(0, W, BLOCK):
        c = w0 + tl.arange(0, BLOCK)
        row = tl.load(BITMASK + slot * s_bm + c, mask=c < W)
        tl.store(MASK_OUT + r * W + c, row, mask=c < W)
    # then only the M held-back words are rewritten: comparing each word with the M entries
    # inside the copy loop made W x M compares a row (~25 us a step on an H200)
    m = tl.arange(0, M_PAD)
    # the held-back entries while pos < min_tokens (pos as a vector: the interpreter
    # refuses a scalar in a vector mask)
    live = (m < M) & (m * 0 + pos < tl.load(MIN_TOKENS + slot))
    words = tl.load(MIN_WORDS + slot * M + m, mask=live, other=-1)
    bits = tl.load(MIN_BITS + slot * M + m, mask=live, other=0)
    # a word may repeat (the row format pads with the first entry): each entry clears the
    # OR of its word's bits, so repeats store the same value
    clear = tl.reduce(tl.where(words[:, None] == words[None, :], bits[None, :], 0), 1, _or)
    held = tl.load(BITMASK + slot * s_bm + words, mask=live, other=0)
    tl.debug_barrier()  # the copy's stores of these words land first
    tl.store(MASK_OUT + r * W + words, held & ~clear, mask=live)


@triton.jit
def _advance_kernel(
    SLOT,  # [b] i64
    TOKEN,  # [b] i64 (stride s_tok): the drawn token, rewritten when flagged
    VALID,  # [b] bool (stride s_val)
    LOGITS,  # [b, >= V] raw logits (row stride s_lg); read only with FLAG_INF
    POSITIONS, LAST_TOKEN,  # [S] i64
    COUNTS,  # [S, V] i32; written only with HAS_COUNTS
    s_tok, s_val, s_lg, V, padding_slot,
    FLAG_INF: tl.constexpr, HAS_COUNTS: tl.constexpr, INF: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    dependent_start(PDL)
    r = tl.program_id(0).to(tl.int64)
    slot = tl.load(SLOT + r)
    tok = tl.load(TOKEN + r * s_tok)
    valid = tl.load(VALID + r * s_val) != 0
    if FLAG_INF:  # an invalid row (-1) reads column 0, as the reference does
        hit = tl.load(LOGITS + r * s_lg + tl.maximum(tok, 0)).to(tl.float32) == float("inf")
        tok = tl.where(hit, INF, tok)
        valid = valid & (hit == 0)
        tl.store(TOKEN + r * s_tok, tok)
        tl.store(VALID + r * s_val, valid)
    if valid & (slot != padding_slot):
        tl.store(POSITIONS + slot, tl.load(POSITIONS + slot) + 1)
        tl.store(LAST_TOKEN + slot, tok)
        if HAS_COUNTS:
            tl.store(COUNTS + slot * V + tok, tl.load(COUNTS + slot * V + tok) + 1)


def gather_inputs(slots, slot_ids: torch.Tensor) -> StepInputs:
    """`_inputs_kernel` over `slots` (a SlotTable) for rows `slot_ids` [b] (Triton)."""
    b, bm = slot_ids.shape[0], slots.bitmask
    W, M = bm.shape[-1], slots.min_words.shape[1]
    dev = slot_ids.device
    pos, model_pos, last = (torch.empty(b, dtype=torch.int64, device=dev) for _ in range(3))
    masks = torch.empty((b, W), dtype=torch.int32, device=dev)
    if b:
        _inputs_kernel[(b,)](
            slot_ids, slots.positions, slots.prompt_lens, slots.last_token, bm,
            slots.min_tokens, slots.min_words, slots.min_bits, pos, model_pos, last, masks,
            bm.stride(0), W, M, BLOCK=min(1024, triton.next_power_of_2(W)),
            M_PAD=triton.next_power_of_2(M), num_warps=4, **kernel_options(True, dev),
        )  # fmt: skip
    return StepInputs(pos, model_pos, last, masks)


def advance_decode(slots, slot_ids: torch.Tensor, logits: torch.Tensor, token_ids: torch.Tensor,
                   valid: torch.Tensor, flag: bool) -> None:  # fmt: skip
    """`_advance_kernel` (Triton): token_ids [b] i64 and valid [b] bool are the draw's
    (views; flagged rows rewritten in place); logits [b, >= V] the raw rows, read only
    with `flag`."""
    b = slot_ids.shape[0]
    if not b:
        return
    counts = slots.tensors.token_counts
    _advance_kernel[(b,)](
        slot_ids, token_ids, valid, logits, slots.positions, slots.last_token,
        counts if counts is not None else slot_ids,
        token_ids.stride(0), valid.stride(0), logits.stride(0), slots.vocab_size,
        slots.padding_slot, FLAG_INF=flag, HAS_COUNTS=counts is not None, INF=INF_TOKEN,
        num_warps=1, **kernel_options(True, slot_ids.device),
    )  # fmt: skip
