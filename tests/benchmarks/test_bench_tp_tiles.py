"""CPU tests of bench_tp_tiles' candidates: a rank's operand and tiles at each T and split
(its timings need a GPU)."""

import argparse

import bench_tp_tiles as bt
import pytest
from bench_matmul import shapes

from graphexec.kernels.matmul_config import MatmulConfig

ARGS = argparse.Namespace(block_n=[16, 32, 64, 128], warps_stages=["4,4", "8,3"], programs=[2])


@pytest.mark.parametrize("T", [1, 2, 4])
def test_a_ranks_operand_and_tiles_keep_the_whole_weights_split(T) -> None:
    by = {s["layer"]: s for s in shapes("llama-3.1-8b")}
    assert bt.rank_operand(by["qkv"], T) == (6144 // T, 4096, False)
    assert bt.rank_operand(by["gate_up+silu"], T) == (2 * 14336 // T, 4096, False)
    assert bt.rank_operand(by["down"], T) == (4096, 14336 // T, True)
    gpu = MatmulConfig.gpu()
    for layer, S in (("qkv", 4), ("down", 8)):
        s = by[layer]
        row = layer == "down"
        base = gpu.tile(s["N"], s["K"])
        rank_base = base.__class__(**{**vars(base), "split": S // T if row else S})
        tiles = bt.tiles_for(s, T, rank_base, ARGS)
        parts = S // T if row else S
        assert tiles and all(t.split == parts and t.block_k == base.block_k for t in tiles)
        progs = {t.programs for t in tiles}
        assert {0, 1, parts} <= progs and all(p == 0 or parts % p == 0 for p in progs)
        n = s["N"] if row else s["N"] // T
        assert all(n // t.block_n >= 4 for t in tiles)
