"""The Triton backend of `sample_step`: process -> draw -> logprobs, launches only.

Buffers are allocated per call with shapes fixed by (B, V); under CUDA-graph capture they
come from the graph's pool, so replays reuse them. No host sync and no branch on tensor
values: everything data-dependent happens inside the kernels.
"""

from __future__ import annotations

import torch
import triton

from graphexec.params import SamplerVariant
from graphexec.rng import Stream
from graphexec.sampling.tensors import SamplerOutput, SamplingTensors
from graphexec.sampling.triton import interpreter_enabled
from graphexec.sampling.triton.logprobs import write_logprobs
from graphexec.sampling.triton.passes import (
    _bias_fill_kernel,
    _bias_scatter_kernel,
    _choose_kernel,
    _count_kernel,
    _first_combine_kernel,
    _first_pass_kernel,
    _gather_kernel,
)
from graphexec.sampling.triton.process import process, process_args
from graphexec.sampling.triton.sample import _finish_kernel, _sample_tile_kernel

TILE_V = 1024  # rows up to this many tokens are sorted whole in registers
CAP = 2048  # candidates gathered and sorted per row on the large-V path
DELTAS = 8  # thresholds tried per counting pass
SEARCH_ROUNDS = 2  # counting passes before a row falls back to the exact slow path


def draw_large(
    logits: torch.Tensor,
    slot_ids: torch.Tensor,
    positions: torch.Tensor,
    table: SamplingTensors,
    out: SamplerOutput,
    bitmask: torch.Tensor | None,
    variant: SamplerVariant,
    need_x: bool,
    *,
    cap: int = CAP,
    split: int | None = None,
    block: int | None = None,
) -> torch.Tensor | None:
    """The split-row path (see `passes`); returns x when the filters or `need_x` wrote it."""
    B, V = logits.shape
    dev = logits.device
    filters = variant is not SamplerVariant.NO_FILTER
    write_x = filters or need_x
    blk = block or (4096 if interpreter_enabled() else 2048)
    sp = split or max(1, min(32, triton.next_power_of_2(triton.cdiv(V, 8 * blk))))
    slice_len = triton.cdiv(triton.cdiv(V, sp), blk) * blk
    x = torch.empty((B, V) if write_x else (1, 1), dtype=torch.float32, device=dev)
    nb = table.bias_ids.shape[1]
    dense = torch.empty((B, V) if nb else (1, 1), dtype=torch.float32, device=dev)
    _bias_fill_kernel[(B, triton.cdiv(V, blk))](
        slot_ids, table.bias_ids, table.bias_ids.stride(0), dense, V, BLOCK=blk
    )
    _bias_scatter_kernel[(B,)](
        slot_ids, table.bias_ids, table.bias_ids.stride(0), table.bias_values,
        table.bias_values.stride(0), dense, V, nb, BLOCK_NB=triton.next_power_of_2(nb),
    )  # fmt: skip
    common, flags = process_args(logits, slot_ids, table, bitmask, dummy=x)
    part_f = torch.empty((B, sp, 3), dtype=torch.float32, device=dev)
    part_i = torch.empty((B, sp, 5), dtype=torch.int32, device=dev)
    stream = int(Stream.TOKEN)
    _first_pass_kernel[(B, sp)](
        *common, table.bias_ids, table.bias_ids.stride(0), dense, positions, table.seed, x,
        part_f, part_i, B, V, slice_len, **flags, WRITE_X=write_x, DRAW=True, STREAM=stream,
        SPLIT=sp, BLOCK=blk, enable_fp_fusion=False,
    )  # fmt: skip
    stat_f = torch.empty((B, 1), dtype=torch.float32, device=dev)
    stat_i = torch.empty((B, 2), dtype=torch.int32, device=dev)
    state = torch.empty(B, dtype=torch.int32, device=dev)
    deltas = torch.empty((B, DELTAS), dtype=torch.float32, device=dev)
    _first_combine_kernel[(B,)](
        part_f, part_i, slot_ids, table.temperature, table.top_k, table.top_p, table.min_p,
        stat_f, stat_i, out.token_ids, out.valid, state, deltas,
        FILTERS=filters, D=DELTAS, SPLIT=sp,
    )  # fmt: skip
    if not filters:
        return x if need_x else None
    n_part = torch.empty((B, sp, DELTAS), dtype=torch.int32, device=dev)
    q_part = torch.empty((B, sp, DELTAS + 1), dtype=torch.int64, device=dev)
    nm_part = torch.empty((B, sp), dtype=torch.int32, device=dev)
    chosen = torch.empty(B, dtype=torch.float32, device=dev)
    qt = torch.zeros(B, dtype=torch.int64, device=dev)
    nm = torch.zeros(B, dtype=torch.int32, device=dev)
    for _ in range(SEARCH_ROUNDS):
        _count_kernel[(B, sp)](
            x, stat_f, stat_i, deltas, state, slot_ids, table.min_p, n_part, q_part, nm_part,
            V, slice_len, D=DELTAS, SPLIT=sp, BLOCK=blk,
        )  # fmt: skip
        _choose_kernel[(B,)](
            n_part, q_part, nm_part, stat_i, slot_ids, table.top_k, table.top_p, deltas, state,
            chosen, qt, nm, cap, D=DELTAS, SPLIT=sp,
        )  # fmt: skip
    cnt = torch.zeros(B, dtype=torch.int32, device=dev)
    cand = torch.empty((B, cap), dtype=torch.int64, device=dev)
    _gather_kernel[(B, sp)](
        x, stat_f, stat_i, state, chosen, cnt, cand, V, slice_len, CAP=cap, BLOCK=blk
    )
    _finish_kernel[(B,)](
        x, slot_ids, positions, table.top_k, table.top_p, table.min_p, table.seed, stat_f,
        stat_i, state, qt, nm, cnt, cand, out.token_ids, V, CAP=cap, BLOCK=blk, STREAM=stream,
        num_warps=8 if not interpreter_enabled() else 4,
    )  # fmt: skip
    return x


def draw_tile(
    x: torch.Tensor,
    slot_ids: torch.Tensor,
    positions: torch.Tensor,
    table: SamplingTensors,
    out: SamplerOutput,
    variant: SamplerVariant,
) -> None:
    """Whole rows in registers, for V <= TILE_V."""
    B, V = x.shape
    bv = max(16, triton.next_power_of_2(V))
    br = max(1, min(triton.next_power_of_2(B), (16384 if interpreter_enabled() else 2048) // bv))
    _sample_tile_kernel[(triton.cdiv(B, br),)](
        x, x.stride(0), slot_ids, positions, table.temperature, table.top_k, table.top_p,
        table.min_p, table.seed, out.token_ids, out.valid, B, V,
        FILTERS=variant is not SamplerVariant.NO_FILTER, STREAM=int(Stream.TOKEN),
        BLOCK_R=br, BLOCK_V=bv,
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
    **large_kw,
) -> SamplerOutput:
    B, V = logits.shape
    need_x = out.logprobs is not None
    if V <= tile_v:
        x = process(logits, slot_ids, table, bitmask)
        draw_tile(x, slot_ids, positions, table, out, variant)
    else:
        x = draw_large(logits, slot_ids, positions, table, out, bitmask, variant, need_x,
                       **large_kw)
    if need_x:
        write_logprobs(logits, x, slot_ids, table, out)
    return out
