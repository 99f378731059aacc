"""Data-parallel sampling of vocabulary-sharded logits: one all-to-all turns the T
vocabulary slices of B rows into full rows of B/T requests per rank (B padded to a
multiple of T), each rank samples its rows with the ordinary sampler, and one all-gather
of the packed outputs (token, logprob, rank, top-N) gives every rank every row.

Bytes a rank sends per row: (T - 1) / T * w * itemsize of logits (w its slice), then
8 * (2 + 2N) / T of outputs. Static shapes (the split sizes depend on B, V and T only):
capturable with NCCL.
"""

from __future__ import annotations

import torch

from graphexec.distributed.comm import all_gather, all_to_all, bits_f32, f32_bits
from graphexec.params import SamplerVariant
from graphexec.sampling.flags import flag_inf as flag_rows
from graphexec.sampling.pipeline import sample_step
from graphexec.sampling.tensors import SamplerOutput, SamplingTensors


def _pad(x: torch.Tensor | None, rows: int, fill) -> torch.Tensor | None:
    if x is None or x.shape[0] == rows:
        return x
    extra = x.new_full((rows - x.shape[0], *x.shape[1:]), fill)
    return torch.cat([x, extra])


def sample(shard: torch.Tensor, slot_ids, positions, table: SamplingTensors, out: SamplerOutput,
           bitmask=None, variant=SamplerVariant.DEFAULT, backend=None, *, tp, count_ids=None,
           config=None, workspace=None, flag_inf: bool = False) -> SamplerOutput:  # fmt: skip
    """Sample B vocabulary-sharded rows (this rank's slice `shard` [B, w]) into `out` on
    every rank; see the module docstring."""
    T, r, g = tp.world, tp.rank, tp.group
    B, w = shard.shape
    b = -(-B // T)  # rows per rank
    Bp = b * T
    widths = [hi - lo for lo, hi in tp.slices]
    send = _pad(shard, Bp, 0.0)
    if tp.wire is not None:  # exact in it (`TensorParallel.wire`): half float32's bytes
        send = send.to(tp.wire)
    recv = all_to_all(send.reshape(-1), [b * wj for wj in widths], [b * w] * T, g)
    recv = recv.to(shard.dtype)
    parts = torch.split(recv, [b * wj for wj in widths])
    rows = torch.cat([p.view(b, wj) for p, wj in zip(parts, widths, strict=True)], dim=1)
    mine = slice(r * b, (r + 1) * b)
    slots = _pad(slot_ids, Bp, 0)[mine]
    pos = _pad(positions, Bp, 0)[mine]
    bm = None if bitmask is None else _pad(bitmask, Bp, -1)[mine]
    ci = None if count_ids is None else _pad(count_ids, Bp, -1)[mine]
    local = SamplerOutput.allocate(b, shard.device, out.num_top)
    sample_step(rows, slots, pos, table, local, bm, variant, backend, config=config,
                workspace=workspace, count_ids=ci)  # fmt: skip
    if flag_inf:
        flag_rows(rows, local)
    cols = [local.token_ids.unsqueeze(1)]
    if out.logprobs is not None:
        cols += [f32_bits(local.logprobs).unsqueeze(1), local.ranks.unsqueeze(1)]
        if out.num_top:
            cols += [f32_bits(local.top_logprobs), local.top_token_ids]
    packed = all_gather(torch.cat(cols, dim=1), g).reshape(Bp, -1)[:B]
    out.token_ids.copy_(packed[:, 0])
    out.valid.copy_(packed[:, 0] >= 0)
    if out.logprobs is not None:
        out.logprobs.copy_(bits_f32(packed[:, 1]))
        out.ranks.copy_(packed[:, 2])
        n = out.num_top
        if n:
            out.top_logprobs.copy_(bits_f32(packed[:, 3 : 3 + n]))
            out.top_token_ids.copy_(packed[:, 3 + n : 3 + 2 * n])
    return out
