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
