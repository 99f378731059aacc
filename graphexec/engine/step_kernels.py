"""The step's bookkeeping in a launch each instead of ~20 small torch kernels.

Around the model and the sampler a decode step (T = 1) gathers each row's state from
the slot table and, after the draw, writes it back; a speculative step writes back runs
of up to K + 1 tokens. In torch that is a dozen gathers, compares and scatters on each
side, each its own kernel in the captured graph. Here:

    _inputs_kernel  grid (b, T): steps 1 and 4's mask of `step.py` for one row and
        offset j: (j = 0) its output position pos, the model position of its last token
        (prompt_len + pos - 1) and the last token; its token mask row of offset j copied
        from the slot table with the min_tokens bits cleared while pos + j < min_tokens.
    _advance_kernel grid (b,): steps 5 and 6: a row that drew a token whose raw logit is
        +inf gets INF_TOKEN and valid = False (unless the draw already flags them); a
        real row (not the padding slot, valid) advances: position + 1, last token, and
        its token count + 1.
    _runs_kernel    grid (b,): steps 5 and 6 of a speculative step: a run holding a
        token whose raw logit is +inf emits nothing (INF_TOKEN at offset 0, invalid, no
        tokens); a real row with a valid run advances past its n tokens: position + n,
        last token, each token's count + 1 (atomic: a run may repeat a token), and the
        tokens into its n-gram history after its model position.

Each has a torch reference (`step_state.*_reference`, the CPU route and the tests'
definition); all are integer work (and a compare with +inf), so they give the same
values, bit for bit. They launch with programmatic dependent launch where the device has
it (each waits for the kernel before it before touching anything). A row touches only
its own slot (real rows hold distinct slots; padding rows write nothing).
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
    BITMASK,  # [S, (T,) W] i32: each slot's rows (slot stride s_bm, offset stride s_off)
    MIN_TOKENS,  # [S] i64
    MIN_WORDS,  # [S, M] i64: words holding held-back ids (entries may repeat)
    MIN_BITS,  # [S, M] i32
    POS_OUT, MODEL_POS_OUT, LAST_OUT,  # [b] i64
    MASK_OUT,  # [b, T, W] i32 contiguous
    s_bm, s_off, W, M,
    BLOCK: tl.constexpr, M_PAD: tl.constexpr,
    PDL: tl.constexpr = False,  # programmatic dependent launch (`dependent_launch`)
):  # fmt: skip
    dependent_start(PDL)
    r = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    slot = tl.load(SLOT + r)
    pos = tl.load(POSITIONS + slot)
    if j == 0:
        tl.store(POS_OUT + r, pos)
        tl.store(MODEL_POS_OUT + r, tl.load(PROMPT_LENS + slot) + pos - 1)
        tl.store(LAST_OUT + r, tl.load(LAST_TOKEN + slot))
    src = BITMASK + slot * s_bm + j * s_off
    dst = MASK_OUT + (r * tl.num_programs(1) + j) * W
    for w0 in range(0, W, BLOCK):
        c = w0 + tl.arange(0, BLOCK)
        row = tl.load(src + c, mask=c < W)
        tl.store(dst + c, row, mask=c < W)
    # then only the M held-back words are rewritten: comparing each word with the M entries
    # inside the copy loop made W x M compares a row (~25 us a step on an H200)
    m = tl.arange(0, M_PAD)
    # the held-back entries while pos < min_tokens (pos as a vector: the interpreter
    # refuses a scalar in a vector mask)
    live = (m < M) & (m * 0 + pos + j < tl.load(MIN_TOKENS + slot))
    words = tl.load(MIN_WORDS + slot * M + m, mask=live, other=-1)
    bits = tl.load(MIN_BITS + slot * M + m, mask=live, other=0)
    # a word may repeat (the row format pads with the first entry): each entry clears the
    # OR of its word's bits, so repeats store the same value
    clear = tl.reduce(tl.where(words[:, None] == words[None, :], bits[None, :], 0), 1, _or)
    held = tl.load(src + words, mask=live, other=0)
    tl.debug_barrier()  # the copy's stores of these words land first
    tl.store(dst + words, held & ~clear, mask=live)


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


@triton.jit
def _runs_kernel(
    SLOT,  # [b] i64
    TOKEN,  # [b, T] i64 (row stride s_tok): the runs (-1 past them); offset 0 flagged
    VALUE,  # [b, T] float (row stride s_val): the raw logits at the tokens
    NUM_TOKENS, NUM_ACCEPTED,  # [b] i64: zeroed when flagged
    VALID,  # [b] bool
    POSITIONS, LAST_TOKEN,  # [S] i64
    COUNTS,  # [S, V] i32; written only with HAS_COUNTS
    HISTORY,  # [S, L + 1] i32 (row stride s_hist, L = hist_len); written with HAS_HISTORY
    MODEL_POS,  # [b] i64: sequence index of each row's last token; read with HAS_HISTORY
    s_tok, s_val, s_hist, hist_len, V, padding_slot,
    T: tl.constexpr, T_PAD: tl.constexpr, HAS_COUNTS: tl.constexpr,
    HAS_HISTORY: tl.constexpr, INF: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    dependent_start(PDL)
    r = tl.program_id(0).to(tl.int64)
    slot = tl.load(SLOT + r)
    n = tl.load(NUM_TOKENS + r)
    valid = tl.load(VALID + r) != 0
    j = tl.arange(0, T_PAD)
    run = (j < T) & (j < n)
    value = tl.load(VALUE + r * s_val + j, mask=run, other=0).to(tl.float32)
    hit = (tl.max((value == float("inf")).to(tl.int32), 0) > 0) & valid
    if hit:
        tl.store(TOKEN + r * s_tok, INF)
        tl.store(NUM_TOKENS + r, 0)
        tl.store(NUM_ACCEPTED + r, 0)
        tl.store(VALID + r, False)
    if valid & (hit == 0) & (slot != padding_slot):
        tok = tl.load(TOKEN + r * s_tok + j, mask=run, other=0)
        tl.store(POSITIONS + slot, tl.load(POSITIONS + slot) + n)
        tl.store(LAST_TOKEN + slot, tl.sum(tl.where(j == n - 1, tok, 0), 0))
        if HAS_COUNTS:
            tl.atomic_add(COUNTS + slot * V + tok, tl.full([T_PAD], 1, tl.int32), mask=run)
        if HAS_HISTORY:
            # past the sequence (never, for a row within its limits): the dump column
            at = tl.minimum(tl.load(MODEL_POS + r) + 1 + j, hist_len)
            tl.store(HISTORY + slot * s_hist + at, tok.to(tl.int32), mask=run)


def gather_inputs(slots, slot_ids: torch.Tensor, t: int | None = None) -> StepInputs:
    """`_inputs_kernel` over `slots` (a SlotTable) for rows `slot_ids` [b] (Triton): t None,
    a decode's masks [b, W]; t, a speculative step's [b, t, W]
    (`step_state.gather_inputs_reference`)."""
    b, bm = slot_ids.shape[0], slots.bitmask
    W, M = bm.shape[-1], slots.min_words.shape[1]
    dev = slot_ids.device
    pos, model_pos, last = (torch.empty(b, dtype=torch.int64, device=dev) for _ in range(3))
    masks = torch.empty((b, t or 1, W), dtype=torch.int32, device=dev)
    if b:
        _inputs_kernel[(b, t or 1)](
            slot_ids, slots.positions, slots.prompt_lens, slots.last_token, bm,
            slots.min_tokens, slots.min_words, slots.min_bits, pos, model_pos, last, masks,
            bm.stride(0), bm.stride(1) if bm.dim() == 3 else 0, W, M,
            BLOCK=min(1024, triton.next_power_of_2(W)), M_PAD=triton.next_power_of_2(M),
            num_warps=4, **kernel_options(True, dev),
        )  # fmt: skip
    return StepInputs(pos, model_pos, last, masks if t else masks.view(b, W))


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


def advance_runs(slots, slot_ids: torch.Tensor, values: torch.Tensor, out, history=None,
                 model_pos: torch.Tensor | None = None) -> None:  # fmt: skip
    """`_runs_kernel` (Triton): `step_state.advance_runs_reference`'s values. out: the
    step's `VerifyOutput` [b, T] (flagged rows rewritten in place); values [b, T] the raw
    logits at its tokens; history: an `NgramHistory` or None."""
    b, t = out.token_ids.shape
    if not b:
        return
    counts = slots.tensors.token_counts
    hist = history.tokens if history is not None else slot_ids
    _runs_kernel[(b,)](
        slot_ids, out.token_ids, values, out.num_tokens, out.num_accepted, out.valid,
        slots.positions, slots.last_token, counts if counts is not None else slot_ids, hist,
        model_pos if history is not None else slot_ids, out.token_ids.stride(0),
        values.stride(0), hist.stride(0), hist.shape[-1] - 1, slots.vocab_size,
        slots.padding_slot, T=t,
        T_PAD=triton.next_power_of_2(t), HAS_COUNTS=counts is not None,
        HAS_HISTORY=history is not None, INF=INF_TOKEN, num_warps=1,
        **kernel_options(True, slot_ids.device),
    )  # fmt: skip
