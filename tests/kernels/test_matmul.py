"""The batch-invariant GEMM: a row's bits are the same in any call, the kernel agrees with
its torch reference, and bad arguments are named."""

from tests.interpreter import ensure_interpreter

ensure_interpreter()

import pytest
import torch
import torch.nn.functional as F

from graphexec.kernels import matmul as mm
from graphexec.kernels import matmul_config
from graphexec.kernels.fused import silu_mul

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2),
       torch.float16: dict(rtol=2e-3, atol=2e-3)}  # fmt: skip


def operands(M: int, N: int, K: int, dtype, seed: int = 0, bias: bool = False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g).to(dtype)
    w = (torch.randn(N, K, generator=g) / K**0.5).to(dtype)
    b = torch.randn(N, generator=g).to(dtype) if bias else None
    return x, w, b


def assert_rows_invariant(fn, x: torch.Tensor, sizes=(1, 2, 7, 16, 37)) -> None:
    """fn(x[rows]) row by row equals fn(x) for calls of every size in `sizes`, the rows
    taken at other places (a permutation) so each sits beside other rows."""
    full = fn(x)
    g = torch.Generator().manual_seed(1)
    for m in sizes:
        pick = torch.randperm(x.shape[0], generator=g)[:m]
        got = fn(x[pick])
        bad = (got != full[pick]).any(dim=1).nonzero().flatten().tolist()
        assert bad == [], f"M={m}: rows {bad} differ from the same rows in a call of {len(x)}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(48, 40), (100, 64), (33, 130), (16, 16)])
def test_kernel_matches_reference(shape, dtype) -> None:
    N, K = shape
    x, w, b = operands(21, N, K, dtype, bias=True)
    for bias in (None, b):
        got, want = mm.linear(x, w, bias), mm.linear_reference(x, w, bias)
        assert got.dtype == dtype and got.shape == (21, N)
        torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])
        torch.testing.assert_close(want.float(), F.linear(x.float(), w.float(), None if bias is
                                   None else bias.float()), **TOL[dtype])  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_kernel_matches_the_two_steps(dtype) -> None:
    x, w, _ = operands(19, 2 * 40, 48, dtype)
    got = mm.linear_silu_mul(x, w)
    # the same tile and split for the [2 I, K] weight as for its gate/up output
    tile = mm.MatmulConfig.interpreter().tile(40, 48)
    assert tile.split > 1
    both = mm.MatmulConfig.interpreter().replace(tiles=((40, 48, tile), (80, 48, tile)))
    torch.testing.assert_close(got.float(), silu_mul(mm.linear(x, w, config=both)).float(),
                               rtol=0, atol=0)  # fmt: skip
    want = mm.linear_silu_mul_reference(x, w)
    torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_rows_do_not_depend_on_the_call(dtype) -> None:
    """Under the interpreter: a row's bits alone, in calls of 2..37 rows and at any place
    (the tiles hold 16 rows, so rows cross tile boundaries)."""
    x, w, b = operands(40, 72, 80, dtype, bias=True)
    assert_rows_invariant(lambda t: mm.linear(t, w, b), x)
    assert_rows_invariant(lambda t: mm.linear_silu_mul(t, w), x, sizes=(1, 9, 33))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("split", [2, 4, 16])
def test_a_split_gives_the_same_bits_whoever_sums_its_subtrees(split, dtype) -> None:
    """K in `split` parts: one program summing all parts in registers (P = 1), or P
    programs each summing an aligned run of parts and the last one adding the P subtree
    sums: bitwise the same, for linear with bias and for gate/up + SwiGLU; and close to
    an unsplit product."""
    N, K = 40, 64 if split < 16 else 128
    x, w, b = operands(23, 2 * N, K, dtype, seed=split, bias=True)
    tile = mm.MatmulTile(16, 16, 16, 1, 1, split)
    cfg = mm.MatmulConfig.interpreter().replace(tiles=((2 * N, K, tile), (N, K, tile)))
    for fn, args in ((mm.linear, (b,)), (mm.linear_silu_mul, ())):
        outs = [mm._launch(x, w, *(args or (None,)), fn is mm.linear_silu_mul, cfg,
                           programs_per_tile=P) for P in (1, 2, split)]  # fmt: skip
        for o in outs[1:]:
            assert torch.equal(o, outs[0])
    one = mm.MatmulConfig.interpreter().replace(max_split=1)
    assert one.tile(2 * N, K).split == 1
    torch.testing.assert_close(outs[0].float(), mm.linear_silu_mul(x, w, config=one).float(),
                               **TOL[dtype])  # fmt: skip


def test_tree_sum_of_subtree_sums_is_the_tree_sum() -> None:
    """tree_sum over S parts equals, bit for bit, the per-subtree sums (any aligned power
    of two) combined in tree order; a different order of the same parts does not."""
    g = torch.Generator().manual_seed(0)
    parts = [torch.randn(512, generator=g) * 10.0 ** float(i % 5) for i in range(16)]
    whole = mm.tree_sum(parts)
    for size in (1, 2, 4, 8, 16):
        subs = [mm.tree_sum(parts[i : i + size]) for i in range(0, 16, size)]
        assert torch.equal(mm.tree_sum(subs), whole), size
    assert torch.equal(mm.tree_sum(torch.stack(parts)), whole)  # stacked: the same tree
    serial = parts[0]
    for p in parts[1:]:
        serial = serial + p
    assert not torch.equal(serial, whole)  # the order matters: the tree is the definition
    with pytest.raises(ValueError, match="power-of-two"):
        mm.tree_sum(parts[:3])
    with pytest.raises(ValueError, match="power-of-two"):
        mm.tree_sum(torch.stack(parts[:3]))


# the weight shapes of the CPU-test models (tests/engine/test_batch_invariance.py) and
# TinyLM's at the cl100k vocabulary
REFERENCE_SHAPES = [(300, 64), (128, 64), (64, 64), (256, 64), (64, 128), (100277, 128),
                    (384, 128), (512, 128), (128, 512), (97, 48)]  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 2])
def test_reference_rows_do_not_depend_on_the_call(dtype, threads, restore_threads) -> None:
    """The CPU route: a row's bits do not depend on the rows beside it or its place in
    the fixed-size chunks, at every shape the CPU tests run."""
    torch.set_num_threads(threads)
    for N, K in REFERENCE_SHAPES:
        x, w, b = operands(24 if N > 50_000 else 40, N, K, dtype, seed=N + K, bias=True)
        assert_rows_invariant(lambda t, w=w, b=b: mm.linear_reference(t, w, b), x,
                              sizes=(1, 3, 8, 13))  # fmt: skip


def test_tile_depends_on_the_weight_shape_only() -> None:
    """The rule: block_n the largest power of two that keeps min_programs column tiles,
    block_k by K; a tuned tile of the table wins for its shape only."""
    rule = mm.MatmulConfig(max_block_n=128, min_programs=264, block_k=128, short_block_k=64,
                           long_k=1024)  # fmt: skip
    assert (rule.tile(151936, 896).block_n, rule.tile(151936, 896).block_k) == (128, 64)
    assert (rule.tile(896, 4864).block_n, rule.tile(896, 4864).block_k) == (16, 128)
    assert rule.tile(16896, 2048).block_n == 64  # 264 tiles of 64; 132 of 128 would be too few
    # the split: doubles while tiles x split < min_programs, parts >= block_k, dividing K
    assert rule.tile(151936, 896).split == 1  # 1187 column tiles fill the GPU
    assert rule.tile(896, 4864).split == 8  # 56 tiles x 8 = 448 >= 264; parts of 608
    assert rule.tile(2048, 2048).split == 4  # 128 tiles (16 columns) x 4 = 512
    assert rule.tile(896, 896).split == 8  # 56 x 8 = 448; parts of 112 >= block_k 64
    assert rule.tile(2048, 8192).split == 4  # 128 x 4 = 512
    assert rule.replace(max_split=2).tile(896, 4864).split == 2
    tuned = mm.MatmulTile(32, 64, 256, 8, 3)
    assert rule.replace(tiles=((896, 4864, tuned),)).tile(896, 4864) == tuned
    assert rule.replace(tiles=((896, 4864, tuned),)).tile(896, 896) == rule.tile(896, 896)
    gpu = mm.MatmulConfig.gpu()
    assert {(n, k) for n, k, _ in gpu.tiles} == {(n, k) for n, k, _ in matmul_config.GPU_TILES}
    tuned = {(n, k): t for n, k, t in matmul_config.GPU_TILES}
    assert gpu.tile(151936, 896) == mm.MatmulTile(*tuned[151936, 896])


def test_a_ranks_columns_are_the_widest_that_keep_shard_programs() -> None:
    """A shard's tile (and a row-parallel rank's, `rank_columns`): the whole weight's split,
    columns as wide as keeps `shard_programs` programs at one row, never below 16."""
    cfg = mm.MatmulConfig(max_block_n=128, shard_programs=96)
    for n, parts in ((3072, 1), (1536, 1), (7168, 1), (4096, 2), (4096, 1), (64128, 1), (64, 1)):
        bn = cfg.rank_columns(n, parts, 128)
        assert 16 <= bn <= 128 and bn & (bn - 1) == 0
        if bn > 16:
            assert -(-n // bn) * parts >= 96  # enough programs ...
        if bn < 128:
            assert -(-n // (2 * bn)) * parts < 96  # ... and no wider tile keeps them
    assert cfg.rank_columns(64, 1, 128) == 16  # none does: the narrowest
    assert cfg.rank_columns(4096, 2, 32) == 32  # never wider than the whole's tile
    whole = cfg.tile(6144, 4096)
    shard = cfg.shard_tile(6144, 4096, 3072)
    assert shard.split == whole.split and shard.block_n == cfg.rank_columns(3072, whole.split, 128)
    with pytest.raises(ValueError, match="shard_programs"):
        mm.MatmulConfig(shard_programs=0)


@pytest.mark.parametrize("silu", [False, True])
def test_column_shards_sum_k_as_the_whole_weight(silu) -> None:
    """A tensor-parallel rank's rows of a column-parallel weight (q/k/v, gate/up, the LM
    head) give the bits of the same columns of the whole weight: `verify_shard_tiles`
    gives the shard the whole's split of K (the rule alone would split this shard's K in
    2 where the whole takes 1, and the bits differ)."""
    cfg = mm.MatmulConfig.interpreter()
    N, K, T = 128, 256, 4
    assert cfg.tile(N // T, K).split != cfg.tile(N, K).split  # the bug this guards
    x, w, _ = operands(8, 2 * N if silu else N, K, torch.float32, seed=3)  # no rounding
    fn = mm.linear_silu_mul if silu else mm.linear
    whole = fn(x, w, config=cfg)
    for r in (0, T - 1):
        cols = slice(r * N // T, (r + 1) * N // T)
        part = torch.cat([w[cols], w[N:][cols]]) if silu else w[cols]
        sharded = mm.verify_shard_tiles(cfg, [(N, part, silu)])
        assert sharded.tile(N // T, K).split == cfg.tile(N, K).split
        assert torch.equal(fn(x, part, config=sharded), whole[:, cols])
        if r == 0:  # unfixed, the shard's own split rounds differently
            assert not torch.equal(fn(x, part, config=cfg), whole[:, cols])


def test_bad_arguments_are_named() -> None:
    x, w, b = operands(4, 8, 16, torch.float32, bias=True)
    with pytest.raises(ValueError, match=r"x \[M, K\] and w \[N, K\]"):
        mm.linear(x, w.t())
    with pytest.raises(ValueError, match=r"bias must be \[8\]"):
        mm.linear(x, w, b[:4])
    with pytest.raises(ValueError, match="one dtype"):
        mm.linear(x, w.double())
    with pytest.raises(ValueError, match=r"\[2 I, K\]"):
        mm.linear_silu_mul(x, w[:7])
    with pytest.raises(ValueError, match="contiguous"):
        mm.linear(x.t().contiguous().t(), w)
    with pytest.raises(ValueError, match="block_m"):
        mm.MatmulConfig(block_m=24)
    with pytest.raises(ValueError, match="min_programs"):
        mm.MatmulConfig(min_programs=0)
    assert mm.linear(x[:0], w).shape == (0, 8)


# ---------------------------------------------------------------------------------- GPU

QWEN_05B = [(1152, 896, True), (896, 896, False), (896, 4864, False), (151936, 896, False)]
LLAMA_1B = [(3072, 2048, False), (2048, 2048, False), (2048, 8192, False), (128256, 2048, False)]
LLAMA_8B = [(6144, 4096, False), (4096, 4096, False), (4096, 14336, False)]


@pytest.mark.gpu
@pytest.mark.parametrize("N,K,bias", QWEN_05B + LLAMA_1B + LLAMA_8B)
def test_cuda_rows_are_the_bits_of_the_row_alone(N, K, bias) -> None:
    """bf16 at the real models' shapes, with the large-M tiles as a model binds them
    (`verify_large_tiles`: used where this GPU gives them the decode tiles' bits): row r
    of a call of M rows equals the same row computed alone (M = 1), for M = 1, 7, 64,
    127, 128, 255, 256, 1023, 1100 (both sides of large_m, wide_m and long_m) and every
    row; the values are cuBLAS's to bf16 rounding."""
    g = torch.Generator(device="cuda").manual_seed(N)
    x = torch.randn(1100, K, device="cuda", generator=g, dtype=torch.bfloat16)
    w = torch.randn(N, K, device="cuda", generator=g, dtype=torch.bfloat16) * K**-0.5
    b = torch.randn(N, device="cuda", generator=g, dtype=torch.bfloat16) if bias else None
    cfg = mm.verify_large_tiles(mm.MatmulConfig.gpu(), [(w, False)])
    print(f"[{N}, {K}]: large / wide / long tile verified: {(N, K) in cfg.verified} / "
          f"{(N, K) in cfg.verified_wide} / {(N, K) in cfg.verified_long}")  # fmt: skip

    def lin(t):
        return mm.linear(t, w, b, config=cfg)

    alone = torch.cat([lin(x[i : i + 1]) for i in range(0, 1100, 37)])
    for M in (1, 7, 64, 127, 128, 255, 256, 1023, 1100):
        got = lin(x[:M])
        idx = torch.arange(0, M, 37, device="cuda")
        assert torch.equal(got[idx], alone[: idx.numel()]), M
        if M > 1:  # every row, not only the sampled ones: against a call of 1100 rows
            assert torch.equal(got, lin(x)[:M]), M
    want = F.linear(x.float(), w.float(), None if b is None else b.float())
    err = (lin(x).float() - want).norm() / want.norm()
    assert err < 1e-2


@pytest.mark.gpu
def test_cuda_silu_mul_rows_are_the_bits_of_the_row_alone() -> None:
    for inter, K in ((4864, 896), (8192, 2048)):
        g = torch.Generator(device="cuda").manual_seed(inter)
        x = torch.randn(300, K, device="cuda", generator=g, dtype=torch.bfloat16)
        w = torch.randn(2 * inter, K, device="cuda", generator=g, dtype=torch.bfloat16) * K**-0.5
        full = mm.linear_silu_mul(x, w)
        for M in (1, 7, 64, 256):
            assert torch.equal(mm.linear_silu_mul(x[:M], w), full[:M]), M
        assert torch.equal(full, silu_mul(mm.linear(x, w)))


@pytest.mark.gpu
@pytest.mark.parametrize("split", [2, 4, 8, 16])
def test_cuda_a_split_gives_the_same_bits_whoever_sums_it(split) -> None:
    """bf16 on the GPU, Llama-3.1-8B's down shape: P = 1 (parts summed in registers) and
    P = 2 .. split programs per tile (subtree sums through the scratch and the tile's
    counter, the last program adding them) give the same bits, for linear and SwiGLU,
    over 20 repeated calls each (a race in the counter would show as a difference)."""
    g = torch.Generator(device="cuda").manual_seed(split)
    N, K = 4096, 14336
    x = torch.randn(33, K, device="cuda", generator=g, dtype=torch.bfloat16)
    w = torch.randn(2 * N, K, device="cuda", generator=g, dtype=torch.bfloat16) * K**-0.5
    tile = mm.MatmulTile(64, 64, 128, 4, 4, split)
    cfg = mm.MatmulConfig.gpu().replace(tiles=((N, K, tile), (2 * N, K, tile)), large_tiles=())
    for silu in (False, True):
        want = mm._launch(x, w, None, silu, cfg, programs_per_tile=1)
        for P in (2, split):
            for _ in range(10):
                assert torch.equal(mm._launch(x, w, None, silu, cfg, programs_per_tile=P),
                                   want), (silu, P)  # fmt: skip


def test_warp_specialisation_is_a_tma_choice() -> None:
    assert mm.MatmulTile(128, 128, 64, 8, 3, 1, tma=True, ws=True).ws
    with pytest.raises(ValueError, match="ws needs tma"):
        mm.MatmulTile(128, 128, 64, 8, 3, 1, ws=True)
