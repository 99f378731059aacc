"""The invariant GEMM's tiles: `MatmulConfig.tile(N, K)` picks a weight's tile and its split
of K from the weight's shape alone (tuned tiles first, then a rule), never from the rows of
a call; large-M tiles with the same split serve big calls once verified on the device."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from graphexec.kernels.matmul_kernel import MAX_SPLIT
from graphexec.runtime.triton_env import interpreter_enabled
from graphexec.runtime.triton_import import triton


@dataclass(frozen=True)
class MatmulTile:
    """One compiled kernel's tiling: rows x columns of a program, K per step, launch;
    split: the parts of K summed in the tree (a power of two dividing K); tma: loads by
    tensor descriptors (`matmul_tma`, Hopper), for large-M tiles; programs: programs per
    output tile, each summing an aligned run of split / programs parts (a power of two
    dividing split; 0: `launch_shape`'s rule by M); ws: with tma, the K loop warp
    specialised (Triton's producer / consumer warps). A launch choice: never a bit."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    split: int = 1
    tma: bool = False
    programs: int = 0
    ws: bool = False

    def __post_init__(self) -> None:
        p = self.programs
        if p < 0 or (p and (p & (p - 1) or self.split % p)):
            raise ValueError(f"MatmulTile.programs must be 0 or a power of two dividing the "
                             f"split ({self.split}), got {p}")  # fmt: skip
        if self.ws and not self.tma:
            raise ValueError("MatmulTile.ws needs tma: only the TMA kernel warp-specialises")


# (N, K, (block_m, block_n, block_k, num_warps, num_stages, split)); gate/up's N is I (its
# output). The decode tiles: every M runs them unless a verified large tile takes over.
GPU_TILES = (
    (1152, 896, (64, 16, 128, 4, 4, 1)),  # Qwen2.5-0.5B q/k/v
    (896, 896, (64, 16, 128, 4, 4, 1)),  # o
    (4864, 896, (64, 64, 128, 4, 4, 1)),  # gate/up + SwiGLU
    (896, 4864, (64, 32, 128, 4, 4, 4)),  # down
    (151936, 896, (64, 128, 64, 8, 3, 1)),  # LM head
    (3072, 2048, (64, 32, 128, 4, 6, 1)),  # Llama-3.2-1B q/k/v
    (2048, 2048, (64, 64, 64, 4, 6, 4)),  # o
    (8192, 2048, (64, 64, 128, 4, 4, 1)),  # gate/up + SwiGLU
    (2048, 8192, (64, 64, 128, 4, 4, 4)),  # down
    (128256, 2048, (64, 128, 64, 4, 4, 1)),  # LM head
    (6144, 4096, (64, 64, 128, 4, 4, 1)),  # Llama-3.1-8B q/k/v
    (4096, 4096, (64, 64, 64, 4, 6, 4)),  # o
    (14336, 4096, (64, 64, 64, 4, 6, 1)),  # gate/up + SwiGLU
    (4096, 14336, (64, 64, 128, 4, 3, 4)),  # down
    (128256, 4096, (64, 128, 64, 4, 4, 1)),  # LM head
)

# Tiles for calls of `large_m` rows up to `wide_m` (last fields: TMA loads, programs per
# tile), each with the split the model runs the shape with (o and down: row-parallel, 4
# parts), so the same reduction order: used only once `verified` on the device
# (`verify_large_tiles`). (bench_matmul.py --large-sweep --tma on an H200, every
# candidate bit-identical there: the fastest at 128 rows)
GPU_LARGE_TILES = (
    (1152, 896, (64, 64, 64, 4, 6, 1, True, 0)),  # Qwen2.5-0.5B q/k/v
    (896, 896, (64, 64, 32, 4, 4, 4, True, 0)),  # o (row-parallel: 4 parts)
    (4864, 896, (64, 64, 64, 4, 4, 1, True, 0)),  # gate/up + SwiGLU
    (896, 4864, (64, 64, 64, 4, 8, 4, True, 4)),  # down
    (151936, 896, (128, 128, 64, 8, 3, 1, True, 0)),  # LM head
    (3072, 2048, (64, 64, 64, 4, 8, 1, True, 0)),  # Llama-3.2-1B q/k/v
    (2048, 2048, (64, 64, 64, 4, 6, 4, True, 0)),  # o
    (8192, 2048, (128, 64, 64, 4, 6, 1, True, 0)),  # gate/up + SwiGLU
    (2048, 8192, (64, 64, 64, 4, 6, 4, True, 4)),  # down
    (128256, 2048, (128, 128, 64, 8, 5, 1, True, 0)),  # LM head
    (6144, 4096, (64, 128, 64, 4, 6, 1, True, 0)),  # Llama-3.1-8B q/k/v
    (4096, 4096, (64, 64, 64, 4, 6, 4, True, 2)),  # o
    (14336, 4096, (128, 128, 64, 8, 4, 1, True, 0)),  # gate/up + SwiGLU
    (4096, 14336, (64, 64, 64, 4, 6, 4, True, 2)),  # down
    (128256, 4096, (128, 128, 64, 8, 3, 1, True, 0)),  # LM head
)

# Tiles for calls of `wide_m` rows up to `long_m`, where the same sweep's fastest at 256
# rows differs from its fastest at 128 (the large tile); verified the same way.
GPU_WIDE_TILES = (
    (896, 896, (64, 64, 32, 4, 4, 4, True, 2)),  # Qwen2.5-0.5B o
    (4864, 896, (128, 128, 64, 8, 4, 1, True, 0)),  # gate/up + SwiGLU
    (896, 4864, (64, 64, 64, 4, 6, 4, True, 4)),  # down
    (3072, 2048, (64, 64, 64, 4, 6, 1, True, 0)),  # Llama-3.2-1B q/k/v
    (2048, 2048, (64, 64, 64, 4, 6, 4, True, 2)),  # o
    (8192, 2048, (128, 128, 64, 8, 4, 1, True, 0)),  # gate/up + SwiGLU
    (2048, 8192, (64, 64, 64, 4, 6, 4, True, 2)),  # down
    (6144, 4096, (128, 128, 64, 8, 5, 1, True, 0)),  # Llama-3.1-8B q/k/v
    (4096, 4096, (64, 64, 64, 4, 6, 4, True, 1)),  # o
    (4096, 14336, (128, 128, 64, 8, 5, 4, True, 2)),  # down
)

# Tiles for calls of at least `long_m` rows (prefill chunks), where the same sweep's
# fastest at 4,096 rows differs from the large tile; verified the same way.
GPU_LONG_TILES = (
    (1152, 896, (64, 128, 64, 4, 4, 1, True, 0)),  # Qwen2.5-0.5B q/k/v
    (896, 896, (64, 64, 32, 4, 4, 4, True, 1)),  # o
    (4864, 896, (128, 128, 64, 8, 3, 1, True, 0)),  # gate/up + SwiGLU
    (896, 4864, (128, 128, 64, 8, 5, 4, True, 2)),  # down
    (3072, 2048, (128, 128, 64, 8, 3, 1, True, 0)),  # Llama-3.2-1B q/k/v
    (2048, 2048, (64, 64, 64, 4, 4, 4, True, 0)),  # o
    (8192, 2048, (128, 128, 64, 8, 3, 1, True, 0)),  # gate/up + SwiGLU
    (2048, 8192, (128, 128, 64, 8, 5, 4, True, 2)),  # down
    (6144, 4096, (128, 128, 64, 8, 3, 1, True, 0)),  # Llama-3.1-8B q/k/v
    (4096, 4096, (128, 128, 64, 8, 5, 4, True, 2)),  # o
    (4096, 14336, (128, 256, 64, 8, 3, 4, True, 4)),  # down
    (128256, 4096, (128, 128, 64, 8, 5, 1, True, 0)),  # LM head
)


@dataclass(frozen=True)
class MatmulConfig:
    """How `linear` tiles a weight of shape [N, K]; `tile(N, K)` depends on nothing else.

    block_m: rows per program (a power of two >= 16).
    block_k: K per step of the loop, for K of at least `long_k`; `short_block_k` below.
    min_programs: block_n is the largest power of two in [16, max_block_n] that still
        gives at least this many column tiles (so a one-row call fills the GPU), 16
        where none does; then the split of K doubles (up to max_split, each part at
        least block_k long and K divisible by it) while tiles x split is below it. At
        run time, a call with fewer programs than this spreads a tile's parts over up
        to `split` programs.
    num_warps, num_stages: of every tile.
    tiles: tuned tiles by weight shape, ((N, K, tile), ...), taken before the rule.
    large_tiles: ((N, K, tile), ...) for calls of at least `large_m` rows. A call runs
        one only where its split is the call's (that of `tile(N, K)`, or a row-parallel
        layer's, `row_parallel`): the same parts and the same K order, in a tile that
        may differ in rows, columns, K per step and loads (TMA). Used only where
        `verified` lists the shape: `verify_large_tiles` checked, on the device, that it
        gives the bits of the decode tile with its split (the tensor cores sum each
        output over K in steps of 16 whatever the tile, but that is the hardware's
        property, so it is measured, not assumed).
    wide_tiles, wide_m, verified_wide: the same for calls of at least `wide_m` rows,
        where they take the place of the large tile (on an H200 the fastest tile at 128
        rows was up to 1.5 x slower at 256, and the reverse);
    long_tiles, long_m, verified_long: and for calls of at least `long_m` rows (prefill
        chunks), in the place of both: the fastest tile at 256 rows is not the fastest
        at 4,096.
    shard_programs: a tensor-parallel rank's tiles (`shard_tile`, a row-parallel rank's
        `row_parallel.verify_rank_tile`) take the widest columns (<= max_block_n) that
        still give this many programs at one row: on an H200, Llama-3.1-8B's shards at
        T = 2 and 4 ran fastest at 96-128 programs, and 16-column tiles (what
        min_programs asked for) cost 1.2-2 x.
    pdl: programmatic dependent launch where the device has it (`dependent_launch`),
        for calls of fewer than `large_m` rows (at 128-256 rows it slowed a Llama
        forward by 4-5% on an H200: those calls are not launch-bound).
    prefetch_k: with pdl, each program asks L2 for the first prefetch_k columns of each
        of its parts' weight rows before it waits for the kernel before it (0: none).
    """

    block_m: int = 64
    max_block_n: int = 128
    block_k: int = 128
    short_block_k: int = 64
    long_k: int = 1024
    min_programs: int = 264
    num_warps: int = 4
    num_stages: int = 4
    max_split: int = MAX_SPLIT
    tiles: tuple[tuple[int, int, MatmulTile], ...] = ()
    large_tiles: tuple[tuple[int, int, MatmulTile], ...] = ()
    large_m: int = 128
    verified: frozenset[tuple[int, int]] = frozenset()
    wide_tiles: tuple[tuple[int, int, MatmulTile], ...] = ()
    wide_m: int = 256
    verified_wide: frozenset[tuple[int, int]] = frozenset()
    long_tiles: tuple[tuple[int, int, MatmulTile], ...] = ()
    long_m: int = 1024
    verified_long: frozenset[tuple[int, int]] = frozenset()
    shard_programs: int = 96
    pdl: bool = True
    prefetch_k: int = 512

    def __post_init__(self) -> None:
        for name in ("block_m", "max_block_n", "block_k", "short_block_k"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"MatmulConfig.{name} must be a power of two >= 16, got {v}")
        for name in ("long_k", "min_programs", "shard_programs", "num_warps", "num_stages"):
            if getattr(self, name) < 1:
                raise ValueError(f"MatmulConfig.{name} must be positive")
        if self.prefetch_k < 0:
            raise ValueError(f"MatmulConfig.prefetch_k must be >= 0, got {self.prefetch_k}")
        for split in [self.max_split] + [t.split for _, _, t in self.tiles]:
            if not 1 <= split <= MAX_SPLIT or split & (split - 1):
                raise ValueError(f"MatmulConfig: a split must be a power of two in 1.."
                                 f"{MAX_SPLIT}, got {split}")  # fmt: skip
        for n, k, t in self.large_tiles + self.wide_tiles + self.long_tiles:
            if not 1 <= t.split <= MAX_SPLIT or t.split & (t.split - 1):
                raise ValueError(f"MatmulConfig: the large tile of [{n}, {k}] splits K into "
                                 f"{t.split} parts, not a power of two in 1..{MAX_SPLIT}")
        if not self.large_m <= self.wide_m <= self.long_m:
            raise ValueError(f"MatmulConfig needs large_m <= wide_m <= long_m, got "
                             f"{self.large_m}, {self.wide_m}, {self.long_m}")  # fmt: skip

    @classmethod
    def gpu(cls) -> MatmulConfig:
        """The rule, and tuned tiles for the weights of Qwen2.5-0.5B, Llama-3.2-1B and
        Llama-3.1-8B (benchmarks/bench_matmul.py --sweep: the tile of least worst ratio to
        cuBLAS over the rows it serves; the Llama tiles from an H200 with --keep-split,
        over M = 1..64, since a verified large tile serves M >= large_m)."""
        return cls(
            tiles=tuple((n, k, MatmulTile(*t)) for n, k, t in GPU_TILES),
            large_tiles=tuple((n, k, MatmulTile(*t)) for n, k, t in GPU_LARGE_TILES),
            wide_tiles=tuple((n, k, MatmulTile(*t)) for n, k, t in GPU_WIDE_TILES),
            long_tiles=tuple((n, k, MatmulTile(*t)) for n, k, t in GPU_LONG_TILES),
        )

    @classmethod
    def interpreter(cls) -> MatmulConfig:
        """Small tiles: the CPU interpreter pays per element and per program."""
        return cls(block_m=16, max_block_n=32, block_k=32, short_block_k=16, long_k=64,
                   min_programs=4, shard_programs=4, num_warps=1, num_stages=1)  # fmt: skip

    @classmethod
    def default(cls) -> MatmulConfig:
        return cls.interpreter() if interpreter_enabled() else cls.gpu()

    def replace(self, **kw) -> MatmulConfig:
        return dataclasses.replace(self, **kw)

    def tuned(self, N: int, K: int) -> MatmulTile | None:
        """The tuned tile of weight [N, K] (`tiles`), or None."""
        return next((t for n, k, t in self.tiles if (n, k) == (N, K)), None)

    def tile(self, N: int, K: int) -> MatmulTile:
        """The tile of every call with a [N, K] weight (shapes only: never M)."""
        tuned = self.tuned(N, K)
        if tuned is not None:
            return tuned
        bn = 16
        while bn < self.max_block_n and triton.cdiv(N, 2 * bn) >= self.min_programs:
            bn *= 2
        bk = self.block_k if K >= self.long_k else self.short_block_k
        split, tiles_n = 1, triton.cdiv(N, bn)
        while (split < self.max_split and tiles_n * split < self.min_programs
               and K % (2 * split) == 0 and K // (2 * split) >= bk):  # fmt: skip
            split *= 2
        return MatmulTile(self.block_m, bn, bk, self.num_warps, self.num_stages, split)

    def shard_tile(self, N: int, K: int, n: int) -> MatmulTile:
        """The candidate tile of a column shard [n, K] of a whole weight [N, K] (a
        tensor-parallel rank's rows of q/k/v, gate/up or the LM head): the whole weight's
        split, so each output sums K in the whole's parts and order; K per step that of
        `tile(n, K)`, columns `rank_columns`. The model runs it only once verified
        bit-identical to the whole's tile (`matmul.verify_shard_tiles`); otherwise the
        whole's tile."""
        split = self.tile(N, K).split
        tuned = self.tuned(n, K)
        if tuned is not None:  # its own columns
            return dataclasses.replace(tuned, split=split)
        bn = self.rank_columns(n, split, self.max_block_n)
        return dataclasses.replace(self.tile(n, K), block_n=bn, split=split)

    def rank_columns(self, n: int, parts: int, widest: int) -> int:
        """A rank's block_n for n output columns whose K is in `parts` parts: the widest
        power of two <= `widest` that gives `shard_programs` programs at one row (tiles
        x parts), 16 where none does."""
        bn = widest
        while bn > 16 and triton.cdiv(n, bn) * parts < self.shard_programs:
            bn //= 2
        return bn

    def tile_for(self, N: int, K: int, M: int, split: int | None = None) -> MatmulTile:
        """The tile a call of M rows runs with K in `split` parts (None: that of
        `tile(N, K)`): its verified long tile of that split (M >= long_m), else its
        verified wide tile (M >= wide_m), else its verified large tile (M >= large_m),
        else `tile(N, K)` with it."""
        base = self.tile(N, K)
        split = split or base.split
        for least, tiles, verified in ((self.long_m, self.long_tiles, self.verified_long),
                                       (self.wide_m, self.wide_tiles, self.verified_wide),
                                       (self.large_m, self.large_tiles, self.verified)):
            if M >= least and (N, K) in verified:
                for n, k, tile in tiles:
                    if (n, k) == (N, K) and tile.split == split:
                        return tile
        return base if base.split == split else dataclasses.replace(base, split=split)
