"""The Triton backend of `sample_step`: process -> draw -> logprobs, launches only.

Buffers are allocated per call with shapes fixed by (B, V); under CUDA-graph capture they
come from the graph's pool, so replays reuse them. No host sync and no branch on tensor
values: everything data-dependent happens inside the kernels.
"""

from __future__ import annotations

import functools

import torch
import triton

from graphexec.params import SamplerVariant
from graphexec.rng import Stream
from graphexec.sampling.reference import DRAW_BLOCK
from graphexec.sampling.tensors import SamplerOutput, SamplingTensors
from graphexec.sampling.triton import interpreter_enabled
from graphexec.sampling.triton.logprobs import write_logprobs
from graphexec.sampling.triton.passes import (
    _bias_fill_kernel,
    _bias_scatter_kernel,
    _choose_kernel,
    _count_kernel,
    _gather_kernel,
    _row_pass_kernel,
    _stats_combine_kernel,
)
from graphexec.sampling.triton.process import process, process_args
from graphexec.sampling.triton.sample import _finish_kernel, _sample_tile_kernel
from graphexec.sampling.triton.two_level import _two_level_draw_kernel

TILE_V = 1024 if not interpreter_enabled() else 256  # rows this short are sorted whole
# candidates gathered and sorted per row on the large-V path (the interpreter sorts in
# O(CAP^2), so it keeps fewer and leaves more rows to the exact path)
CAP = 4096 if not interpreter_enabled() else 256
SMALL_CAP = (
    256 if not interpreter_enabled() else 32
)  # rows with at most this many candidates sort a narrower tile
DELTAS = 8  # thresholds tried per counting pass
SEARCH_ROUNDS = 3  # counting passes before a row falls back to the exact slow path
ROW_WARPS = 4


def draw_large(
    logits: torch.Tensor,
    slot_ids: torch.Tensor,
    positions: torch.Tensor,
    table: SamplingTensors,
    out: SamplerOutput,
    bitmask: torch.Tensor | None,
    variant: SamplerVariant,
    need_y: bool,
    *,
    cap: int = CAP,
    split: int | None = None,
    block: int | None = None,
    draw_block: int = DRAW_BLOCK,
) -> torch.Tensor | None:
    """The split-row route (see `passes`); returns the scaled rows y when it wrote them."""
    B, V = logits.shape
    dev = logits.device
    filters = variant is not SamplerVariant.NO_FILTER
    write_y = filters or need_y
    blk = block or max(draw_block, 4096 if interpreter_enabled() else 512)
    if blk % draw_block:
        raise ValueError(f"block ({blk}) must be a multiple of draw_block ({draw_block})")
    # enough programs to fill the GPU: partials combine by max / min / integer sums, so
    # the split changes no result and may follow B (2048 row slices in all: measured best
    # on an H100 for the no-filter pass, see benchmarks/tune_two_level.py)
    sp = split or min(128, triton.next_power_of_2(triton.cdiv(2048, B)))
    while sp > 1 and (sp - 1) * blk >= V:  # every slice holds tokens
        sp //= 2
    slice_len = triton.cdiv(triton.cdiv(V, sp), blk) * blk
    f32, i32 = torch.float32, torch.int32
    y = torch.empty((B, V) if write_y else (1, 1), dtype=f32, device=dev)
    dense = torch.empty((B, V), dtype=f32, device=dev)
    _bias_fill_kernel[(B,)](slot_ids, table.bias_ids, table.bias_ids.stride(0), dense, V, BLOCK=blk)
    nb = table.bias_ids.shape[1]
    _bias_scatter_kernel[(B,)](
        slot_ids, table.bias_ids, table.bias_ids.stride(0), table.bias_values,
        table.bias_values.stride(0), dense, V, nb, BLOCK_NB=triton.next_power_of_2(nb),
    )  # fmt: skip
    common, flags = process_args(logits, slot_ids, table, bitmask, dummy=dense)
    part_f = torch.empty((B, sp), dtype=f32, device=dev)
    part_i = torch.empty((B, sp, 3), dtype=i32, device=dev)
    stat_f = torch.empty(B, dtype=f32, device=dev)
    stat_i = torch.empty((B, 2), dtype=i32, device=dev)
    state = torch.empty(B, dtype=i32, device=dev)
    deltas = torch.empty((B, DELTAS), dtype=f32, device=dev)
    n_part = torch.empty((B, sp, DELTAS), dtype=i32, device=dev)
    q_part = torch.empty((B, sp, DELTAS + 1), dtype=torch.int64, device=dev)
    nm_part = torch.empty((B, sp), dtype=i32, device=dev)
    nblk = triton.cdiv(V, draw_block)
    blk_xm = torch.empty((B, nblk), dtype=f32, device=dev)
    blk_q = torch.empty((B, nblk), dtype=torch.int64, device=dev)
    stream = int(Stream.TOKEN)
    row_pass = functools.partial(
        _row_pass_kernel[(B, sp)],
        *common, table.bias_ids, table.bias_ids.stride(0), dense, table.temperature,
        table.inv_temperature, table.top_k, table.top_p, table.min_p,
        stat_f, stat_i, state, deltas, y, part_f, part_i, n_part, q_part, nm_part,
        blk_xm, blk_q, B, V, slice_len, nblk, **flags, WRITE_Y=write_y,
        FILTERS=filters, D=DELTAS, SPLIT=sp, BLOCK=blk, DB=draw_block,
        enable_fp_fusion=False, num_warps=ROW_WARPS,
    )  # fmt: skip
    row_pass(DRAW=False)
    _stats_combine_kernel[(B,)](
        part_f, part_i, slot_ids, table.temperature, table.top_k, table.top_p, table.min_p,
        stat_f, stat_i, out.token_ids, out.valid, state, deltas,
        FILTERS=filters, D=DELTAS, SPLIT=sp,
    )  # fmt: skip
    _two_level_draw_kernel[(B,)](
        *common, table.bias_ids, table.bias_ids.stride(0), dense, table.inv_temperature,
        table.seed, positions, stat_f, stat_i, state, blk_xm, blk_q, out.token_ids,
        B, V, nblk, **flags, NB_P2=max(4, triton.next_power_of_2(nblk)), DB=draw_block,
        TOKEN_STREAM=stream, BLOCK_STREAM=int(Stream.BLOCK), enable_fp_fusion=False,
        num_warps=ROW_WARPS,
    )  # fmt: skip
    if write_y:
        row_pass(DRAW=True)
    if not filters:
        return y if need_y else None
    chosen = torch.empty(B, dtype=f32, device=dev)
    qt = torch.zeros(B, dtype=torch.int64, device=dev)
    nm = torch.zeros(B, dtype=i32, device=dev)
    for round_ in range(SEARCH_ROUNDS):
        if round_:  # the first round's counts came with the DRAW pass
            _count_kernel[(B, sp)](
                y, deltas, state, slot_ids, table.top_k, table.top_p, table.min_p,
                n_part, q_part, nm_part, V, slice_len, D=DELTAS, SPLIT=sp, BLOCK=blk,
                num_warps=ROW_WARPS,
            )  # fmt: skip
        _choose_kernel[(B,)](
            n_part, q_part, nm_part, stat_i, slot_ids, table.top_k, table.top_p, table.min_p,
            deltas, state, chosen, qt, nm,
            # early rounds hold out for a set that fits the narrow sort; the last takes any
            cap if round_ == SEARCH_ROUNDS - 1 else min(cap, SMALL_CAP), D=DELTAS, SPLIT=sp,
        )  # fmt: skip
    cnt = torch.zeros(B, dtype=i32, device=dev)
    cand = torch.empty((B, cap), dtype=torch.int64, device=dev)
    _gather_kernel[(B, sp)](y, state, chosen, cnt, cand, V, slice_len, CAP=cap, BLOCK=blk)
    _finish_kernel[(B,)](
        y, slot_ids, positions, table.top_k, table.top_p, table.min_p, table.seed, stat_i,
        state, qt, nm, cnt, cand, out.token_ids, V, CAP=cap, SMALL=min(cap, SMALL_CAP), BLOCK=blk,
        STREAM=stream, INTERP=interpreter_enabled(),
        num_warps=8 if not interpreter_enabled() else 4,
    )  # fmt: skip
    return y


def draw_tile(
    x: torch.Tensor,
    slot_ids: torch.Tensor,
    positions: torch.Tensor,
    table: SamplingTensors,
    out: SamplerOutput,
    variant: SamplerVariant,
) -> None:
    """Whole rows in registers, for V <= TILE_V; x [B, V] is overwritten with y."""
    B, V = x.shape
    bv = max(16, triton.next_power_of_2(V))
    br = max(1, min(triton.next_power_of_2(B), (16384 if interpreter_enabled() else 2048) // bv))
    _sample_tile_kernel[(triton.cdiv(B, br),)](
        x, x.stride(0), slot_ids, positions, table.temperature, table.inv_temperature,
        table.top_k, table.top_p,
        table.min_p, table.seed, out.token_ids, out.valid, B, V,
        FILTERS=variant is not SamplerVariant.NO_FILTER, STREAM=int(Stream.TOKEN),
        BLOCK_R=br, BLOCK_V=bv, INTERP=interpreter_enabled(),
    )  # fmt: skip


def sample(
    logits: torch.Tensor,
    slot_ids: torch.Tensor,
    positions: torch.Tensor,
    table: SamplingTensors,
    out: SamplerOutput,
    bitmask: torch.Tensor | None = None,
    variant: SamplerVariant = SamplerVariant.DEFAULT,
    *,
    tile_v: int = TILE_V,
    draw_block: int = DRAW_BLOCK,
    **large_kw,
) -> SamplerOutput:
    B, V = logits.shape
    need_y = out.logprobs is not None
    # the tile kernel draws over the whole row: exact only where the row is one block
    if V <= min(tile_v, draw_block):
        y = process(logits, slot_ids, table, bitmask)
        draw_tile(y, slot_ids, positions, table, out, variant)
    else:
        y = draw_large(
            logits, slot_ids, positions, table, out, bitmask, variant, need_y,
            draw_block=draw_block, **large_kw,
        )  # fmt: skip
    if need_y:
        write_logprobs(logits, y, slot_ids, table, out)
    return out
