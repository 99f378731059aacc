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
from graphexec.sampling.triton.process import process
from graphexec.sampling.triton.sample import _sample_row_kernel, _sample_tile_kernel

TILE_V = 1024  # rows up to this many tokens are sorted whole in registers
CAP = 1024  # candidates gathered and sorted per row on the large-V path
ROUNDS = 16  # threshold tries before the exact slow path


def draw(
    x: torch.Tensor,
    slot_ids: torch.Tensor,
    positions: torch.Tensor,
    table: SamplingTensors,
    out: SamplerOutput,
    variant: SamplerVariant,
    *,
    tile_v: int = TILE_V,
    cap: int = CAP,
    block: int | None = None,
) -> None:
    """Tokens and validity for processed logits x [B, V] f32 into out.token_ids / out.valid."""
    B, V = x.shape
    filters = variant is not SamplerVariant.NO_FILTER
    common = (
        slot_ids, positions, table.temperature, table.top_k, table.top_p, table.min_p,
        table.seed,
    )
    if V <= tile_v:
        bv = max(16, triton.next_power_of_2(V))
        br = max(1, min(triton.next_power_of_2(B), (16384 if interpreter_enabled() else 2048) // bv))
        _sample_tile_kernel[(triton.cdiv(B, br),)](
            x, x.stride(0), *common, out.token_ids, out.valid, B, V,
            FILTERS=filters, STREAM=int(Stream.TOKEN), BLOCK_R=br, BLOCK_V=bv,
        )
        return
    blk = block or (4096 if interpreter_enabled() else 2048)
    cand = torch.empty((B, cap), dtype=torch.int64, device=x.device)
    _sample_row_kernel[(B,)](
        x, x.stride(0), *common, cand, out.token_ids, out.valid, V,
        FILTERS=filters, STREAM=int(Stream.TOKEN), CAP=cap, BLOCK=blk, ROUNDS=ROUNDS,
        num_warps=8 if not interpreter_enabled() else 4,
    )


def sample(
    logits: torch.Tensor,
    slot_ids: torch.Tensor,
    positions: torch.Tensor,
    table: SamplingTensors,
    out: SamplerOutput,
    bitmask: torch.Tensor | None = None,
    variant: SamplerVariant = SamplerVariant.DEFAULT,
) -> SamplerOutput:
    x = process(logits, slot_ids, table, bitmask)
    draw(x, slot_ids, positions, table, out, variant)
    if out.logprobs is not None:
        from graphexec.sampling.triton.logprobs import write_logprobs

        write_logprobs(logits, x, slot_ids, table, out)
    return out
