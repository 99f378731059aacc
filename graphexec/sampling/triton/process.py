"""Processing stage as Triton kernels: logits -> processed fp32 logits x [B, V].

Steps 1-2 of `graphexec.sampling.reference` (sanitise, grammar bitmask, logit bias,
repetition / frequency / presence penalties; temperature comes later), bit for bit equal to
`reference.process_logits`:

- `process_value` is the element-wise definition, shared by both kernels, with the
  reference's order of operations and its arithmetic (multiplications by the fp32
  reciprocals torch stored in the table, never divisions).
- `_process_kernel` writes x for every token with no bias. A neutral bias of -0.0 is
  added there, which is the exact additive identity (x + -0.0 == x, also for x = -0.0).
- `_bias_kernel` runs after it and recomputes `process_value` for exactly the ids of the
  slot's sparse bias list, with their bias, overwriting x there.

Both kernels are launched with `enable_fp_fusion=False`: `x - freq * count` must be a
rounded multiply then a rounded subtract, as in torch, not one fused multiply-add.

`process` only launches kernels on the given buffers: no host sync, no allocation when
`out_x` is given, no branch on tensor values, so it can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from graphexec.sampling.tensors import SamplingTensors
from graphexec.sampling.triton import interpreter_enabled

NEG_INF: tl.constexpr = tl.constexpr(float("-inf"))


@triton.jit
def process_value(raw, allowed, bias, count, in_prompt, rep, inv_rep, freq, pres):
    """Processed fp32 logit of one token (broadcasting tensors), as in the reference.

    raw: logit (any float dtype); allowed: bitmask bit (bool); bias: f32 logit bias
    (-0.0 for none); count: i32 times generated; in_prompt: bool; rep / inv_rep / freq /
    pres: the row's f32 parameters. Temperature comes later, after the row max is known
    (`reference.scale`).
    """
    x = raw.to(tl.float32)
    x = tl.where(x != x, NEG_INF, x)  # NaN -> -inf
    x = tl.where(allowed, x, NEG_INF)
    x = x + bias
    seen = (count > 0) | in_prompt
    x = tl.where(seen, tl.where(x > 0, x * inv_rep, x * rep), x)
    x = x - freq * count.to(tl.float32)
    x = x - tl.where(count > 0, pres, 0.0)
    return x


@triton.jit
def _process_cols(
    logits_ptr, stride_lb, stride_lv,
    slot_ptr,
    rep_ptr, inv_rep_ptr, freq_ptr, pres_ptr,
    bitmask_ptr, stride_mb, stride_mw,
    counts_ptr, stride_cs, stride_cv,
    prompt_ptr, stride_ps, stride_pv,
    rows, cols, m, bias, B,
    HAS_BITMASK: tl.constexpr, HAS_COUNTS: tl.constexpr, HAS_PROMPT: tl.constexpr,
    BF16_BITS: tl.constexpr,
):  # fmt: skip
    """process_value at [BLOCK_R, N] (row, token) positions; m masks invalid entries.

    Pointer arguments are those of `_process_kernel`; rows [BLOCK_R] i32, cols
    [BLOCK_R, N] token ids, bias [BLOCK_R, N] f32.
    """
    row_ok = rows < B
    r64 = rows.to(tl.int64)
    c64 = cols.to(tl.int64)
    slot = tl.load(slot_ptr + r64, mask=row_ok, other=0).to(tl.int64)
    raw = tl.load(logits_ptr + r64[:, None] * stride_lb + c64 * stride_lv, mask=m, other=0)
    if BF16_BITS:
        # bf16 logits arrive as their int16 bits: bf16 is the top half of an fp32, so the
        # shift is the exact conversion (the interpreter's bf16 cast flushes subnormals)
        raw = (raw.to(tl.int32) << 16).to(tl.float32, bitcast=True)
    if HAS_BITMASK:
        w_offs = r64[:, None] * stride_mb + (c64 // 32) * stride_mw
        word = tl.load(bitmask_ptr + w_offs, mask=m, other=-1)
        allowed = ((word >> (cols & 31).to(tl.int32)) & 1) != 0
    else:
        allowed = tl.full(cols.shape, 1, tl.int1)
    if HAS_COUNTS or HAS_PROMPT:
        rep = tl.load(rep_ptr + slot, mask=row_ok, other=1.0)
        inv_rep = tl.load(inv_rep_ptr + slot, mask=row_ok, other=1.0)
        freq = tl.load(freq_ptr + slot, mask=row_ok, other=0.0)
        pres = tl.load(pres_ptr + slot, mask=row_ok, other=0.0)
        # Rows with every penalty off read no counts / prompt bits: with count = 0 the
        # result is the same, except for presence -0.0 (x - -0.0 turns -0.0 into +0.0),
        # hence its bit pattern, not its value, decides.
        need_rep = rep != 1.0
        need_counts = need_rep | (freq != 0.0) | (pres.to(tl.int32, bitcast=True) != 0)
        slot2 = slot[:, None]
        if HAS_COUNTS:
            cm = m & need_counts[:, None]
            count = tl.load(counts_ptr + slot2 * stride_cs + c64 * stride_cv, mask=cm, other=0)
        else:
            count = tl.zeros(cols.shape, tl.int32)
        if HAS_PROMPT:
            pm = m & need_rep[:, None]
            bits = tl.load(prompt_ptr + slot2 * stride_ps + c64 * stride_pv, mask=pm, other=0)
            in_prompt = bits != 0
        else:
            in_prompt = tl.zeros(cols.shape, tl.int1)
        x = process_value(
            raw, allowed, bias, count, in_prompt,
            rep[:, None], inv_rep[:, None], freq[:, None], pres[:, None],
        )  # fmt: skip
    else:
        # The reference skips the penalty block without counts or prompt mask; with
        # count = 0 and freq = pres = +0.0 process_value leaves x bit-identical.
        count = tl.zeros(cols.shape, tl.int32)
        none = count != 0
        x = process_value(raw, allowed, bias, count, none, 1.0, 1.0, 0.0, 0.0)
    return x


@triton.jit
def _process_kernel(
    logits_ptr, stride_lb, stride_lv,  # [B, V] f32 / f16, or bf16 as i16 bits
    slot_ptr,  # [B] i64 / i32: row b reads table row slot_ids[b]
    rep_ptr, inv_rep_ptr, freq_ptr, pres_ptr,  # [S] f32
    bitmask_ptr, stride_mb, stride_mw,  # [B, ceil(V/32)] i32 (dummy if not HAS_BITMASK)
    counts_ptr, stride_cs, stride_cv,  # [S, V] i32 (dummy if not HAS_COUNTS)
    prompt_ptr, stride_ps, stride_pv,  # [S, V] u8 (bool viewed; dummy if not HAS_PROMPT)
    x_ptr, stride_xb,  # [B, V] f32 out, unit column stride
    B, V,
    HAS_BITMASK: tl.constexpr, HAS_COUNTS: tl.constexpr, HAS_PROMPT: tl.constexpr,
    BF16_BITS: tl.constexpr,  # logits_ptr holds bf16 logits as i16 bits
    BLOCK_R: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """x for a [BLOCK_R, BLOCK] tile of (rows, tokens), no logit bias. Grid
    (cdiv(B, BLOCK_R), cdiv(V, BLOCK))."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.broadcast_to(
        (tl.program_id(1) * BLOCK + tl.arange(0, BLOCK))[None, :], (BLOCK_R, BLOCK)
    )
    m = (rows < B)[:, None] & (cols < V)
    # -0.0, the exact additive identity, made from its bits: some Triton versions turn a
    # literal -0.0 (== 0) into a null constant, i.e. +0.0
    bias = tl.full((BLOCK_R, BLOCK), -(2**31), tl.int32).to(tl.float32, bitcast=True)
    x = _process_cols(
        logits_ptr, stride_lb, stride_lv, slot_ptr,
        rep_ptr, inv_rep_ptr, freq_ptr, pres_ptr,
        bitmask_ptr, stride_mb, stride_mw, counts_ptr, stride_cs, stride_cv,
        prompt_ptr, stride_ps, stride_pv,
        rows, cols, m, bias, B, HAS_BITMASK, HAS_COUNTS, HAS_PROMPT, BF16_BITS,
    )  # fmt: skip
    tl.store(x_ptr + rows.to(tl.int64)[:, None] * stride_xb + cols, x, mask=m)


@triton.jit
def _bias_kernel(
    logits_ptr, stride_lb, stride_lv,  # [B, V] f32 / f16, or bf16 as i16 bits
    slot_ptr,  # [B] i64 / i32
    rep_ptr, inv_rep_ptr, freq_ptr, pres_ptr,  # [S] f32
    bitmask_ptr, stride_mb, stride_mw,  # [B, ceil(V/32)] i32
    counts_ptr, stride_cs, stride_cv,  # [S, V] i32
    prompt_ptr, stride_ps, stride_pv,  # [S, V] u8
    bias_ids_ptr, stride_is,  # [S, NB] i32, -1 = padding
    bias_val_ptr, stride_vs,  # [S, NB] f32
    x_ptr, stride_xb,  # [B, V] f32, written by _process_kernel; overwritten at bias ids
    B, V, NB,
    HAS_BITMASK: tl.constexpr, HAS_COUNTS: tl.constexpr, HAS_PROMPT: tl.constexpr,
    BF16_BITS: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_NB: tl.constexpr,
):  # fmt: skip
    """Recompute x at each row's biased ids, with the bias. Grid (cdiv(B, BLOCK_R),).

    Must run after `_process_kernel` (same stream): it overwrites those entries. The ids
    of one slot are distinct (a dict in SamplingParams), so no two lanes store to one x.
    """
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    j = tl.arange(0, BLOCK_NB)
    row_ok = rows < B
    slot = tl.load(slot_ptr + rows.to(tl.int64), mask=row_ok, other=0).to(tl.int64)
    lm = row_ok[:, None] & (j < NB)[None, :]
    ids = tl.load(bias_ids_ptr + slot[:, None] * stride_is + j[None, :], mask=lm, other=-1)
    bias = tl.load(bias_val_ptr + slot[:, None] * stride_vs + j[None, :], mask=lm, other=0.0)
    m = lm & (ids >= 0) & (ids < V)  # -1 pads; out-of-range ids are dropped, never stored
    cols = tl.where(m, ids, 0)
    x = _process_cols(
        logits_ptr, stride_lb, stride_lv, slot_ptr,
        rep_ptr, inv_rep_ptr, freq_ptr, pres_ptr,
        bitmask_ptr, stride_mb, stride_mw, counts_ptr, stride_cs, stride_cv,
        prompt_ptr, stride_ps, stride_pv,
        rows, cols, m, bias, B, HAS_BITMASK, HAS_COUNTS, HAS_PROMPT, BF16_BITS,
    )  # fmt: skip
    tl.store(x_ptr + rows.to(tl.int64)[:, None] * stride_xb + cols.to(tl.int64), x, mask=m)


def _blocks(B: int, V: int) -> tuple[int, int]:
    """(BLOCK_R, BLOCK) for `_process_kernel`: one row per program on a GPU (a row is
    long; memory bound), many rows per program in the interpreter (per-program cost)."""
    block = min(triton.next_power_of_2(V), 2048 if not interpreter_enabled() else 4096)
    if not interpreter_enabled():
        return 1, block
    return min(triton.next_power_of_2(B), max(1, 16384 // block)), block


def process_args(
    logits: torch.Tensor,
    slot_ids: torch.Tensor,
    table: SamplingTensors,
    bitmask: torch.Tensor | None,
    dummy: torch.Tensor,
) -> tuple[tuple, dict[str, bool]]:
    """The leading arguments and HAS_* flags of every kernel that calls `_process_cols`.

    `dummy` stands in for absent optional tensors (never read: its HAS_* flag is False).
    """
    mask = bitmask if bitmask is not None else dummy
    if bitmask is not None and bitmask.dtype != torch.int32:
        mask = bitmask.view(torch.int32) if bitmask.element_size() == 4 else bitmask.to(torch.int32)
    counts = table.token_counts if table.token_counts is not None else dummy
    prompt = table.prompt_mask if table.prompt_mask is not None else dummy
    if prompt.dtype == torch.bool:
        prompt = prompt.view(torch.uint8)  # same bytes; loads as 0/1
    flags = dict(
        HAS_BITMASK=bitmask is not None,
        HAS_COUNTS=table.token_counts is not None,
        HAS_PROMPT=table.prompt_mask is not None,
        BF16_BITS=logits.dtype == torch.bfloat16,
    )
    if logits.dtype == torch.bfloat16:
        logits = logits.view(torch.int16)  # same bytes and strides; see _process_cols
    common = (
        logits, logits.stride(0), logits.stride(1),
        slot_ids,
        table.repetition_penalty, table.inv_repetition_penalty,
        table.frequency_penalty, table.presence_penalty,
        mask, mask.stride(0), mask.stride(-1),
        counts, counts.stride(0), counts.stride(-1),
        prompt, prompt.stride(0), prompt.stride(-1),
    )  # fmt: skip
    return common, flags


def process(
    logits: torch.Tensor,
    slot_ids: torch.Tensor,
    table: SamplingTensors,
    bitmask: torch.Tensor | None = None,
    out_x: torch.Tensor | None = None,
    *,
    block_r: int | None = None,
    block: int | None = None,
) -> torch.Tensor:
    """Processed fp32 logits x [B, V], equal to `reference.process_logits` bit for bit.

    Args:
        logits: [B, V] float32 / bfloat16 / float16, any strides (read as is).
        slot_ids: [B] int64 / int32, row b uses table row slot_ids[b].
        table: the per-slot parameters (`token_counts` / `prompt_mask` optional).
        bitmask: optional [B, ceil(V/32)] int32 (bit j of word w = token 32w + j).
        out_x: optional [B, V] float32 workspace with unit column stride; allocated if None.
        block_r, block: tile shape override (rows, tokens per program); tests use it.

    Launch only: no host sync, nothing decided by tensor values (CUDA-graph capturable).
    """
    if logits.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"logits must be float32, bfloat16 or float16, got {logits.dtype}")
    B, V = logits.shape
    dev = logits.device
    x = out_x if out_x is not None else torch.empty((B, V), dtype=torch.float32, device=dev)
    if x.dtype != torch.float32 or x.shape != (B, V) or (V > 1 and x.stride(1) != 1):
        raise ValueError("out_x must be a [B, V] float32 tensor with unit column stride")
    if B == 0 or V == 0:
        return x
    br_default, bl_default = _blocks(B, V)
    br = block_r or br_default
    bl = block or bl_default

    common, flags = process_args(logits, slot_ids, table, bitmask, dummy=x)
    # enable_fp_fusion=False: no FMA, so every multiply and add rounds as in torch.
    grid = (triton.cdiv(B, br), triton.cdiv(V, bl))
    _process_kernel[grid](
        *common, x, x.stride(0), B, V, **flags, BLOCK_R=br, BLOCK=bl, enable_fp_fusion=False
    )
    nb = table.bias_ids.shape[1]
    bias_br = block_r or (1 if not interpreter_enabled() else min(triton.next_power_of_2(B), 64))
    _bias_kernel[(triton.cdiv(B, bias_br),)](
        *common,
        table.bias_ids, table.bias_ids.stride(0),
        table.bias_values, table.bias_values.stride(0),
        x, x.stride(0), B, V, nb, **flags,
        BLOCK_R=bias_br, BLOCK_NB=triton.next_power_of_2(nb), enable_fp_fusion=False,
    )  # fmt: skip
    return x


__all__ = ["process", "process_value"]
