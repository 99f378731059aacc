"""The one-kernel tree all-reduce over symmetric memory (`distributed.tree_reduce`) on
T = the visible GPUs (2 or 4): the bits of the NCCL path (all-gather, the tree, bias,
one rounding), eager and replayed, at every row count up to its cap, and through many
back-to-back reductions whose inputs change each time, where a rank that overwrote a
buffer a peer had not read yet would show."""

from __future__ import annotations

import pytest
import torch

from graphexec.models.hf_shard import TPShard
from tests.distributed.ranks import WithNccl, run_ranks

pytestmark = [pytest.mark.gpu, pytest.mark.multigpu]
D = 4096


def _nccl_path(tp: TPShard, part: torch.Tensor, dtype, bias=None) -> torch.Tensor:
    return tp.reduce_tree(part.clone(), dtype, bias)  # a copy: not a symmetric buffer


def _compare(rank: int, world: int, group=None) -> list[str]:
    dev = torch.device("cuda", rank)
    cfg = {"hidden_size": D, "num_attention_heads": 32, "num_key_value_heads": 8,
           "intermediate_size": 14336, "vocab_size": 1024}  # fmt: skip
    tp = TPShard.of(cfg, rank, world, group).bind(dev, 64, D)
    assert tp.tree is not None, "symmetric memory unavailable"
    bad = []
    g = torch.Generator(device=dev).manual_seed(100 + rank)
    for dtype in (torch.bfloat16, torch.float16):
        bias = torch.randn(D, device=dev, generator=g).to(dtype)
        for M in (1, 7, 32, 64):
            for which, b in ((0, None), (1, bias)):
                part = tp.partial_out(which, M)
                part.copy_(torch.randn(M, D, device=dev, generator=g) * 10)
                want = _nccl_path(tp, part, dtype, b)
                got = tp.reduce_tree(part, dtype, b)
                if not torch.equal(got, want):
                    bad.append(f"eager {dtype} M={M} buffer {which}")
    if tp.partial_out(0, 65) is not None:
        bad.append("a call above the row cap got a symmetric buffer")
    # replayed: 40 reductions in one graph, alternating buffers, each input new (a copy
    # from a per-step source, as the GEMM writes it), every output kept
    steps, M = 40, 32
    src = torch.randn(steps, M, D, device=dev, generator=g)
    outs = []

    def run() -> None:
        outs.clear()
        for i in range(steps):
            part = tp.partial_out(i % 2, M)
            part.copy_(src[i])
            outs.append(tp.reduce_tree(part, torch.bfloat16))

    run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    for rep in range(3):
        src.mul_(-1.5)  # new sources; each step must give the NCCL path over them
        want = [_nccl_path(tp, src[i], torch.bfloat16) for i in range(steps)]
        graph.replay()
        torch.cuda.synchronize()
        for i in range(steps):
            if not torch.equal(outs[i], want[i]):
                bad.append(f"replay {rep}: reduction {i} differs from the NCCL path")
                break
    return bad


def test_tree_reduce_is_the_nccl_path_bit_for_bit() -> None:
    world = min(torch.cuda.device_count(), 8)
    for r, bad in enumerate(run_ranks(world, WithNccl(_compare), timeout=300)):
        assert bad == [], f"rank {r}: {bad}"
