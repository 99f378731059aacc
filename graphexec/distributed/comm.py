"""The collectives both methods use, over a `torch.distributed` group, static shapes only
(so NCCL can record them in a CUDA graph); gloo (CPU tests) gets the list forms."""

from __future__ import annotations

import torch
import torch.distributed as dist


def _nccl(group) -> bool:
    return dist.get_backend(group) == "nccl"


def all_gather(x: torch.Tensor, group) -> torch.Tensor:
    """[T, *x.shape]: every rank's `x`, in rank order."""
    world = dist.get_world_size(group)
    out = torch.empty((world, *x.shape), dtype=x.dtype, device=x.device)
    if _nccl(group):
        dist.all_gather_into_tensor(out, x.contiguous(), group=group)
    else:
        dist.all_gather(list(out.unbind(0)), x.contiguous(), group=group)
    return out


def all_reduce(x: torch.Tensor, op: str, group) -> torch.Tensor:
    """`x` reduced over the ranks ("sum" / "max"), in place; returned for chaining.
    Booleans reduce as int32 (max = any)."""
    ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}
    if x.dtype == torch.bool:
        y = x.to(torch.int32)
        dist.all_reduce(y, ops[op], group=group)
        x.copy_(y > 0)
        return x
    dist.all_reduce(x, ops[op], group=group)
    return x


def all_to_all(x: torch.Tensor, out_sizes: list[int], in_sizes: list[int], group) -> torch.Tensor:
    """1-D all-to-all: chunk j of `x` (in_sizes[j] elements) goes to rank j; returns the
    chunks received, in rank order (out_sizes[j] from rank j)."""
    out = torch.empty(sum(out_sizes), dtype=x.dtype, device=x.device)
    dist.all_to_all_single(out, x.contiguous(), out_sizes, in_sizes, group=group)
    return out


def value_at(x: torch.Tensor, tokens: torch.Tensor, tp) -> torch.Tensor:
    """float32 like `tokens`: x's value at each global id (-1 read as 0), where x [..., w]
    is this rank's slice (`tp.slice`) with tokens' leading dims. The id's owner reads it,
    every rank gets it (one all-reduce max over -inf elsewhere)."""
    lo, hi = tp.slice
    t = tokens.clamp(min=0)
    at = x.gather(-1, (t - lo).clamp(0, hi - lo - 1).unsqueeze(-1)).squeeze(-1).float()
    return all_reduce(torch.where((t >= lo) & (t < hi), at, -torch.inf), "max", tp.group)


def f32_bits(x: torch.Tensor) -> torch.Tensor:
    """float32 -> int64 carrying its bits (to ride in an int64 collective)."""
    return x.to(torch.float32).contiguous().view(torch.int32).to(torch.int64)


def bits_f32(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.int32).view(torch.float32)


def sum_in_rank_order(x: torch.Tensor, group) -> torch.Tensor:
    """The sum of every rank's `x` (any shape, e.g. a row-parallel layer's partial [N, D]),
    the same bits on every rank and for every row whatever the batch: the tensor-parallel
    model's one all-reduce.

    Algorithm: all-gather the partials into [T, *x.shape] (a copy: every rank then holds
    the same T tensors, bit for bit), then add them in rank order, elementwise, in float32
    ((x_0 + x_1) + x_2 ...), and round once to x's dtype. Element i of the result is a
    function of the T values at i alone, added in an order fixed by T: it cannot depend
    on the message size, the number of rows, a row's position or the run. NCCL's own
    all-reduce can: ring and tree algorithms cut the buffer into chunks by its size, and
    which rank's partial an element's sum starts from follows the chunk it falls in (and
    the protocol chosen by size), so a row's bits could change with B.

    Cost: each rank receives (T - 1) * x.numel() elements, against 2 (T - 1) / T for a
    ring all-reduce: the same at T = 2, more for larger T; decode's messages are small
    (B x D), where the collective's latency, not its bytes, is the cost. Static shapes,
    no host sync (NCCL: all_gather_into_tensor): capturable in a CUDA graph."""
    world = dist.get_world_size(group)
    if world == 1:
        return x
    parts = all_gather(x, group)
    if world == 2:  # torch adds half types in float32 and rounds once: the same bits, 1 kernel
        return parts[0] + parts[1]
    acc = parts[0].float()
    for r in range(1, world):
        acc.add_(parts[r])  # float32 += the exact upcast of parts[r]
    return acc.to(x.dtype)
