"""Row-parallel layers on the GPU route (the Triton kernel, under the interpreter on the
CPU): a rank's float32 subtree sum, gathered and finished in the tree, gives the bits of
the whole weight at T = 1, 2, 4; the kernel's parts are the torch reference's."""

from tests.interpreter import ensure_interpreter

ensure_interpreter()

import dataclasses

import pytest
import torch

from graphexec.kernels import matmul as mm
from graphexec.kernels import row_parallel as rp

N, K = 24, 64


def operands(dtype, seed: int = 0, integers: bool = False):
    g = torch.Generator().manual_seed(seed)
    if integers:  # every product and sum exact in float32: any order gives these bits
        ints = lambda *s: torch.randint(-3, 4, s, generator=g).float()  # noqa: E731
        return ints(5, K).to(dtype), ints(N, K).to(dtype)
    return torch.randn(5, K, generator=g).to(dtype), torch.randn(N, K, generator=g).to(dtype)


def shard(t: torch.Tensor, r: int, T: int) -> torch.Tensor:
    c = t.shape[1] // T
    return t[:, r * c : (r + 1) * c].contiguous()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tile_split", [None, 8])
def test_kernel_subtree_sums_finish_to_the_whole_bits(dtype, tile_split) -> None:
    """The whole weight's product (S parts, bias and rounding in the kernel) equals the
    T = 2 and T = 4 shards' float32 subtree sums (f32_out: the kernel's accumulator),
    finished by tree_sum, bias in float32 and one rounding; S is the tile's split raised
    to ROW_SPLIT (None: the rule's split of 2 for this shape; 8: a tuned tile's)."""
    cfg = mm.MatmulConfig.interpreter()
    if tile_split:
        cfg = cfg.replace(tiles=((N, K, mm.MatmulTile(16, 16, 16, 1, 1, tile_split)),))
    x, w = operands(dtype)
    b = torch.randn(N, generator=torch.Generator().manual_seed(1)).to(dtype)
    one = rp.row_split_gpu(N, K, 1, config=cfg)
    assert one.parts == max(rp.ROW_SPLIT, cfg.tile(N, K).split) and one.tile.split == one.parts
    whole = rp.row_linear_gpu(x, w, one, b, config=cfg)
    assert whole.dtype == dtype
    root = rp.row_linear_gpu(x, w, one, f32=True, config=cfg)
    assert root.dtype == torch.float32 and torch.equal((root + b.float()).to(dtype), whole)
    for T in (2, 4):
        split = rp.row_split_gpu(N, K, T, config=cfg)
        assert split.local == one.parts // T and split.tile == one.tile
        # a rank's narrower verified tile (more programs when it holds few parts)
        wide = dataclasses.replace(split, tile=dataclasses.replace(split.tile, block_n=32))
        narrow = rp.verify_rank_tile(wide, shard(w, 0, T), cfg.replace(shard_programs=64))
        assert narrow.rank_tile is not None and narrow.rank_tile.block_n == 16
        for s in (split, wide, narrow):
            subs = [rp.row_linear_gpu(shard(x, r, T), shard(w, r, T), s, f32=True, config=cfg)
                    for r in range(T)]  # fmt: skip
            assert torch.equal((mm.tree_sum(subs) + b.float()).to(dtype), whole), T
    torch.testing.assert_close(whole.float(), (x.float() @ w.float().T + b.float()),
                               rtol=2e-2, atol=2e-2)  # fmt: skip


def test_kernel_parts_are_the_reference_parts() -> None:
    """On exact (small integer) operands, a rank's float32 subtree sum from the kernel and
    from the torch reference agree bit for bit, at every world; on random operands they
    agree to rounding (different orders inside a part)."""
    cfg = mm.MatmulConfig.interpreter()
    for integers in (True, False):
        x, w = operands(torch.bfloat16, seed=2, integers=integers)
        for T in (1, 2):
            split = rp.row_split_gpu(N, K, T, config=cfg)
            got = rp.row_linear_gpu(shard(x, 0, T), shard(w, 0, T), split, f32=True, config=cfg)
            want = rp.row_linear_reference(shard(x, 0, T), shard(w, 0, T), split, f32=True)
            if integers:
                assert torch.equal(got, want), T
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_bad_splits_are_refused() -> None:
    cfg = mm.MatmulConfig.interpreter()
    assert rp.row_split_gpu(N, K, 3, config=cfg) is None  # T = 3 does not divide S
    assert rp.row_split_gpu(N, 66, 1, config=cfg) is None  # S does not divide K
    x, w = operands(torch.float32)
    two = rp.row_split_gpu(N, K, 2, config=cfg)
    with pytest.raises(ValueError, match="f32=True"):
        rp.row_linear_gpu(shard(x, 0, 2), shard(w, 0, 2), two, config=cfg)
    with pytest.raises(ValueError, match="with a tile"):
        rp.row_linear_gpu(x, w, dataclasses.replace(two, tile=None), f32=True, config=cfg)
    with pytest.raises(ValueError, match="f32_out"):
        mm._launch(x, w, torch.zeros(N), False, cfg, f32_out=True)
