"""Processing: logits -> processed fp32 logits x, at any tile of one row's token ids.

Steps 1-2 of `graphexec.sampling.reference` (sanitise, grammar bitmask, logit bias,
repetition / frequency / presence penalties; temperature comes later), bit for bit equal
to `processing.process_logits`:

- `process_value` is the element-wise definition, with the reference's order of
  operations and its arithmetic (multiplications by the fp32 reciprocals stored in the
  table, never divisions). Kernels are launched with `enable_fp_fusion=False`:
  `x - freq * count` must be a rounded multiply then a rounded subtract, as in torch.
- `tile_x` processes a tile of token ids of one row. A slot's bias ids are sorted
  (`SamplingTensors`): the entries inside the tile's id range are found with two counts.

Every kernel takes the batch's inputs as one named tuple P (`Inputs`, built by `proc_args`)
and a constexpr FL = BF16 | HAS_BITMASK << 1 | HAS_COUNTS << 2 | HAS_PROMPT << 3 |
HAS_EXTRA << 4 (per-row ids counted once more each, on top of the slot's counts): absent
inputs cost nothing in the tile loops (a masked-off load still costs address arithmetic per token).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import num_threads

from graphexec.sampling.tensors import SamplingTensors
from graphexec.sampling.triton.keys import _INTERP
from graphexec.sampling.triton.store import put_here


class Inputs(NamedTuple):
    """The batch's inputs as every sampler kernel takes them (`proc_args`): named
    pointers and their strides (`_sb` / `_ss`: per batch row / per table slot, `_sv` /
    `_sw`: per token / per bitmask word). Absent optional tensors are stood in for by
    table columns, never read (the FL flags say which are present)."""

    logits: torch.Tensor  # [B, V] f32 / f16, or bf16 held as its i16 bits
    logits_sb: int
    logits_sv: int
    vocab: int  # V
    slots: torch.Tensor  # [B] i64: the row's table slot
    positions: torch.Tensor  # [B] i64: output position of the token drawn
    rep: torch.Tensor  # [S] f32 repetition penalty
    inv_rep: torch.Tensor  # [S] f32 its reciprocal, as torch stored it
    freq: torch.Tensor  # [S] f32 frequency penalty
    pres: torch.Tensor  # [S] f32 presence penalty
    bitmask: torch.Tensor  # [B, ceil(V/32)] i32 xgrammar bitmask
    bitmask_sb: int
    bitmask_sw: int
    counts: torch.Tensor  # [S, V] i32 generated-token counts
    counts_ss: int
    counts_sv: int
    prompt: torch.Tensor  # [S, V] u8: token in the prompt
    prompt_ss: int
    prompt_sv: int
    bias_ids: torch.Tensor  # [S, NB] i32 ascending, -1 padded
    bias_vals: torch.Tensor  # [S, NB] f32
    bias_ids_ss: int
    bias_vals_ss: int
    nbias: int  # NB
    temperature: torch.Tensor  # [S] f32 (0: greedy)
    inv_temperature: torch.Tensor  # [S] f32
    top_k: torch.Tensor  # [S] i32 (0: off)
    top_p: torch.Tensor  # [S] f32 (1: off)
    log_min_p: torch.Tensor  # [S] f32 ln(min_p) (-inf: off)
    seed: torch.Tensor  # [S] i64
    lp_processed: torch.Tensor  # [S] u8: logprobs of the processed row
    extra: torch.Tensor  # [B, NE] i64 ids counted once more (drafts before an offset)
    extra_sb: int
    nextra: int  # NE


@triton.jit
def process_value(raw, allowed, bias, count, in_prompt, rep, inv_rep, freq, pres):
    """Processed fp32 logit of one token (broadcasting tensors), as in the reference."""
    x = raw.to(tl.float32)
    if _INTERP:  # NaN -> -inf
        x = tl.where(x != x, float("-inf"), x)
    else:  # max.f32 returns the non-NaN operand: one instruction (numpy's max keeps NaN)
        x = tl.maximum(x, float("-inf"))
    x = tl.where(allowed, x, float("-inf"))
    x = x + bias
    seen = (count > 0) | in_prompt
    x = tl.where(seen, tl.where(x > 0, x * inv_rep, x * rep), x)
    x = x - freq * count.to(tl.float32)
    x = x - tl.where(count > 0, pres, 0.0)
    return x


@triton.jit
def row_params(P, row):
    """(slot, greedy, s, seed, pos) of a batch row: its table slot (i64), whether T == 0,
    the scale s = 1/T of its y (1 for greedy rows), and its noise keys."""
    slot = tl.load(P.slots + row).to(tl.int64)
    greedy = tl.load(P.temperature + slot) == 0.0
    s = tl.where(greedy, 1.0, tl.load(P.inv_temperature + slot))
    return slot, greedy, s, tl.load(P.seed + slot), tl.load(P.positions + row)


@triton.jit
def row_inputs(P, row, NB_P2: tl.constexpr):
    """(slot, greedy, s, seed, pos, ids, top_k, top_p, log_min_p) of a batch row:
    `row_params`, its bias ids (`bias_ids`) and its filters. No sampler kernel writes them,
    so a row kernel reads them before its wait for the kernel before it: a dependent
    launch starts only once every program of that kernel has waited for its own
    predecessors, whose writes are then visible. Their chain of loads (slot, then the
    rest) then overlaps the kernel before instead of following it."""
    slot, greedy, s, seed, pos = row_params(P, row)
    return (slot, greedy, s, seed, pos, bias_ids(P, slot, NB_P2), tl.load(P.top_k + slot),
            tl.load(P.top_p + slot), tl.load(P.log_min_p + slot))


@triton.jit
def bias_ids(P, slot, NB_P2: tl.constexpr):
    """[NB_P2] the slot's bias ids, ascending, -1 padded."""
    j = tl.arange(0, NB_P2)
    return tl.load(P.bias_ids + slot * P.bias_ids_ss + j, mask=j < P.nbias, other=-1)


@triton.jit
def raw_load(P, row, offs, ok):
    """The raw logits at offs (int32 token ids) as stored (bf16 as its int16 bits), 0
    where not ok (None: every offs is inside V, no mask)."""
    ptrs = P.logits + row.to(tl.int64) * P.logits_sb + offs.to(tl.int64) * P.logits_sv
    if ok is None:
        return tl.load(ptrs)
    return tl.load(ptrs, mask=ok, other=0)


@triton.jit
def widen(raw, FL: tl.constexpr, PAIRS: tl.constexpr = False):
    """`raw_load`'s values as fp32 (bf16 widened exactly from its bits). PAIRS: raw's
    layout gives each thread an even number of values (a tile read a vector a thread)."""
    if (FL & 1) == 0:
        return raw.to(tl.float32)
    elif PAIRS and not _INTERP and raw.numel >= 2 * num_threads():
        # a thread's pair of values in one register: one instruction a value (the
        # compiler's split of the pair takes two for the high half)
        w = tl.inline_asm_elementwise("{ shl.b32 $0, $2, 16; and.b32 $1, $2, 0xFFFF0000; }",
                                      "=r,=r,r", [raw], dtype=tl.int32, is_pure=True, pack=2)
        return w.to(tl.float32, bitcast=True)
    else:
        return (raw.to(tl.int32) << 16).to(tl.float32, bitcast=True)


@triton.jit
def raw_x(P, row, offs, FL: tl.constexpr):
    """The raw logits at offs as fp32 (bf16 widened exactly from its bits), 0 past V."""
    return widen(raw_load(P, row, offs, offs < P.vocab), FL)


@triton.jit
def tile_x(P, row, slot, ids, offs, lo, hi, FL: tl.constexpr, BIAS: tl.constexpr = True):
    """Processed x at token ids offs (any shape) of one row, -inf past V. ids: the slot's
    bias ids (`bias_ids`); [lo, hi): a range holding offs, where bias entries are looked
    for (BIAS False: a row without any, so a tile loop has no data-dependent branch)."""
    ok = offs < P.vocab
    x = process_raw(P, row, slot, ids, offs, raw_x(P, row, offs, FL), ok, lo, hi, FL, BIAS)
    return tl.where(ok, x, float("-inf"))


@triton.jit
def process_raw(P, row, slot, ids, offs, raw, ok, lo, hi, FL: tl.constexpr,
                BIAS: tl.constexpr):  # fmt: skip
    """`tile_x` of raw logits already widened, without its -inf past V: ok says where offs
    lies inside V (None: everywhere, a full tile)."""
    if ok is None:
        ok = tl.full(offs.shape, 1, tl.int1)
    c64 = offs.to(tl.int64)
    if (FL & 2) != 0:
        word = tl.load(P.bitmask + row.to(tl.int64) * P.bitmask_sb + (c64 // 32) * P.bitmask_sw,
                       mask=ok, other=-1)  # fmt: skip
        allowed = ((word >> (offs & 31).to(tl.int32)) & 1) != 0
    else:
        allowed = tl.full(offs.shape, 1, tl.int1)
    # -0.0 from its bits (a literal -0.0 may become +0.0)
    bias = tl.full(offs.shape, -(2**31), tl.int32).to(tl.float32, bitcast=True)
    if BIAS:
        first = tl.sum(((ids >= 0) & (ids < lo)).to(tl.int32), axis=0)
        n = tl.sum(((ids >= lo) & (ids < hi)).to(tl.int32), axis=0)
        for e in range(first, first + n):
            b_id = tl.load(P.bias_ids + slot * P.bias_ids_ss + e)
            bias = tl.where(offs == b_id, tl.load(P.bias_vals + slot * P.bias_vals_ss + e), bias)
    if (FL & 12) != 0:
        rep = tl.load(P.rep + slot)
        freq = tl.load(P.freq + slot)
        pres = tl.load(P.pres + slot)
        # rows with every penalty off read nothing (presence -0.0 is not off: its bits decide)
        need_rep = rep != 1.0
        need = need_rep | (freq != 0.0) | (pres.to(tl.int32, bitcast=True) != 0)
        count = tl.zeros(offs.shape, tl.int32)
        in_prompt = offs < 0
        # masks as vectors: the interpreter turns (vector & scalar) bools into int32
        if (FL & 4) != 0:
            count = tl.load(P.counts + slot * P.counts_ss + c64 * P.counts_sv,
                            mask=tl.where(need, ok, False), other=0)  # fmt: skip
            if (FL & 16) != 0:
                counted = tl.where(need, ok, False)
                for e in range(P.nextra):
                    d = tl.load(P.extra + row.to(tl.int64) * P.extra_sb + e)
                    count += tl.where(counted & (offs == d), 1, 0)
        if (FL & 8) != 0:
            bits = tl.load(P.prompt + slot * P.prompt_ss + c64 * P.prompt_sv,
                           mask=tl.where(need_rep, ok, False), other=0)  # fmt: skip
            in_prompt = bits != 0
        x = process_value(raw, allowed, bias, count, in_prompt, rep, tl.load(P.inv_rep + slot),
                          freq, pres)  # fmt: skip
    else:
        # no counts or prompt: the reference skips its penalties; with count 0 and
        # freq = pres = +0.0 process_value leaves x bit-identical
        zero = tl.zeros(offs.shape, tl.int32)
        x = process_value(raw, allowed, bias, zero, zero != 0, 1.0, 1.0, 0.0, 0.0)
    return x


@triton.jit
def list_blocks(W, row, sel, NBLK, NBLK_P2: tl.constexpr):
    """Store the ids of the selected blocks (sel [NBLK_P2]), ascending, as the row's block
    list (`list_tile` reads it); returns how many."""
    b = tl.arange(0, NBLK_P2)
    put_here(W.blocks + row * NBLK + tl.cumsum(sel.to(tl.int32), axis=0) - 1, b, sel)
    return tl.sum(sel.to(tl.int32), axis=0)


@triton.jit
def list_ids(W, row, e0, n_list, NBLK, R: tl.constexpr):
    """Block ids [R] of list entries e0 .. e0 + R - 1 (NBLK past n_list: past V, all -inf)."""
    e = e0 + tl.arange(0, R)
    return tl.load(W.blocks + row * NBLK + e, mask=e < n_list, other=NBLK)


@triton.jit
def list_tile(P, W, row, slot, ids, e0, n_list, NBLK, R: tl.constexpr, DB: tl.constexpr,
              FL: tl.constexpr, BIAS: tl.constexpr, bid=None):  # fmt: skip
    """(x [R, DB], token ids [R, DB], block ids [R]) of list entries e0 .. e0 + R - 1 of the
    row's block list (entries past n_list read block NBLK: past V, all -inf); bid: their
    ids, when already loaded (`list_ids`)."""
    e = e0 + tl.arange(0, R)
    if bid is None:
        bid = list_ids(W, row, e0, n_list, NBLK, R)
    offs = bid[:, None] * DB + tl.arange(0, DB)[None, :]
    lo = tl.min(bid, axis=0) * DB
    hi = (tl.max(tl.where(e < n_list, bid, 0), axis=0) + 1) * DB
    return tile_x(P, row, slot, ids, offs, lo, hi, FL, BIAS), offs, bid


def proc_args(logits: torch.Tensor, slot_ids: torch.Tensor, positions: torch.Tensor,
              table: SamplingTensors, bitmask: torch.Tensor | None,
              count_ids: torch.Tensor | None = None) -> tuple[Inputs, int]:  # fmt: skip
    """(P, FL) for `logits` [B, V]: the tuple every kernel takes, and its flags. count_ids
    [B, NE] counts for the penalties only where the table has token counts."""
    mask = table.top_k if bitmask is None else bitmask
    if bitmask is not None and bitmask.dtype != torch.int32:
        mask = bitmask.view(torch.int32) if bitmask.element_size() == 4 else bitmask.to(torch.int32)
    counts = table.token_counts if table.token_counts is not None else table.top_k
    prompt = table.prompt_mask if table.prompt_mask is not None else table.logprobs_processed
    if prompt.dtype == torch.bool:
        prompt = prompt.view(torch.uint8)
    bf16 = logits.dtype == torch.bfloat16
    lg = logits.view(torch.int16) if bf16 else logits  # widened exactly in the kernel
    fl = (int(bf16) | int(bitmask is not None) << 1 | int(table.token_counts is not None) << 2
          | int(table.prompt_mask is not None) << 3)  # fmt: skip
    extra = count_ids is not None and table.token_counts is not None and count_ids.shape[1] > 0
    ex = count_ids if extra else slot_ids.view(-1, 1)
    fl |= int(extra) << 4
    P = Inputs(
        logits=lg, logits_sb=lg.stride(0), logits_sv=lg.stride(1), vocab=logits.shape[1],
        slots=slot_ids, positions=positions,
        rep=table.repetition_penalty, inv_rep=table.inv_repetition_penalty,
        freq=table.frequency_penalty, pres=table.presence_penalty,
        bitmask=mask, bitmask_sb=mask.stride(0), bitmask_sw=mask.stride(-1),
        counts=counts, counts_ss=counts.stride(0), counts_sv=counts.stride(-1),
        prompt=prompt, prompt_ss=prompt.stride(0), prompt_sv=prompt.stride(-1),
        bias_ids=table.bias_ids, bias_vals=table.bias_values,
        bias_ids_ss=table.bias_ids.stride(0), bias_vals_ss=table.bias_values.stride(0),
        nbias=table.bias_ids.shape[1],
        temperature=table.temperature, inv_temperature=table.inv_temperature,
        top_k=table.top_k, top_p=table.top_p, log_min_p=table.log_min_p, seed=table.seed,
        lp_processed=table.logprobs_processed.view(torch.uint8),
        extra=ex, extra_sb=ex.stride(0), nextra=ex.shape[1],
    )  # fmt: skip
    return P, fl
