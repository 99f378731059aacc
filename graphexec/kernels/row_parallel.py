"""Row-parallel layers (o, down) whose bits are the same on 1, 2 and 4 tensor-parallel ranks.

A row-parallel layer splits its weight's K (input) columns over the ranks. If each rank
rounded its partial product and the ranks added those, T = 2 would round where T = 1
does not, and the logits would differ in the last bits. Instead the layer's K is split
into S parts (S >= ROW_SPLIT, a power of two, so every T in 1, 2, 4 divides it): each
part a float32 dot over K / S columns from zero, the parts added in the fixed tree
((p0 + p1) + (p2 + p3)) ... of `matmul.tree_sum`, then the bias in float32, then one
rounding to the dtype. Rank r of T holds parts r S/T .. (r + 1) S/T - 1 (its column
shard of o / down is exactly those columns), sums that aligned subtree in float32
(`row_linear(..., f32=True)`), and `TPShard.reduce_tree` gathers the T subtree sums and
finishes the tree in rank order. A subtree of aligned parts is a node of the tree, so
the root, and the rounded output, are the same bits at every T; at T = 1 the layer
computes all S parts and the same tree.

`row_split(N, K, world)` decides, from the whole weight's shape [N, K] alone, the split
and (on CUDA) the tile: the invariant GEMM's tile for [N, K] with its split raised to
at least ROW_SPLIT. None where no such split exists (K not divisible by S, or a world
that does not divide S, e.g. T = 3): the model then reduces rounded partials in rank
order (`TPShard.reduce`), close to T = 1 but not bitwise.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch

from graphexec.kernels.matmul import _launch, _measurable, _same_bits
from graphexec.kernels.matmul_config import MatmulConfig, MatmulTile
from graphexec.kernels.matmul_kernel import MAX_SPLIT

logger = logging.getLogger(__name__)

ROW_SPLIT = 4  # at least this many parts: T = 1, 2 and 4 each hold whole subtrees


@dataclass(frozen=True)
class RowSplit:
    """A row-parallel layer's split: `parts` (S) parts of the whole K, `parts / world` of
    them on each rank; `tile` (CUDA) the kernel's tile for the whole weight, split S."""

    parts: int
    world: int
    tile: MatmulTile | None = None
    rank_tile: MatmulTile | None = None  # world > 1: narrower columns, verified (verify_rank_tile)

    @property
    def local(self) -> int:
        """Parts on one rank: an aligned subtree of the S-part tree."""
        return self.parts // self.world

    def local_tile(self) -> MatmulTile:
        """The tile a rank runs its `local` parts with: `rank_tile` once verified, else
        the whole weight's tile with the rank's split (the same K loop per part)."""
        assert self.tile is not None
        return self.rank_tile or dataclasses.replace(self.tile, split=self.local)


def split_of(K: int, world: int, parts: int) -> RowSplit | None:
    """RowSplit(parts, world) if `parts` divides K and `world` divides `parts`, else None."""
    if parts > MAX_SPLIT or K % parts or parts % world:
        return None
    return RowSplit(parts, world)


def row_split_cpu(N: int, K: int, world: int) -> RowSplit | None:
    """The CPU route's split of a whole weight [N, K]: ROW_SPLIT parts (the fewest that
    serve T = 1, 2, 4: each part costs a GEMM call)."""
    return split_of(K, world, ROW_SPLIT)


def row_split_gpu(N: int, K: int, world: int, *,
                  config: MatmulConfig | None = None) -> RowSplit | None:  # fmt: skip
    """The CUDA route's split of a whole weight [N, K]: `config.tile(N, K)` (shapes only,
    never M) with its split raised to ROW_SPLIT. On one rank a call of many rows may run
    a verified large tile of that split (`MatmulConfig.tile_for`)."""
    t = (config or MatmulConfig.default()).tile(N, K)
    split = split_of(K, world, max(ROW_SPLIT, t.split))
    if split is None:
        return None
    return dataclasses.replace(split, tile=dataclasses.replace(t, split=split.parts))


def verify_rank_tile(split: RowSplit | None, w: torch.Tensor,
                     config: MatmulConfig | None = None) -> RowSplit | None:  # fmt: skip
    """`split` with a `rank_tile` for this rank's weight w [N, K_r] (world > 1, CUDA):
    the whole's tile with columns narrowed (`MatmulConfig.rank_columns`, down to 16)
    until the rank's parts make `shard_programs` programs at one row (at T = 4 the
    whole's 4 parts leave a rank one, so a 64-column tile would run N / 64 programs),
    used where it gives the float32 subtree sums of the whole's tile bit for bit on this
    device."""
    if split is None or split.world == 1 or split.tile is None or not _measurable(w):
        return split
    cfg = config or MatmulConfig.default()
    base = split.local_tile()
    cand = dataclasses.replace(base, block_n=cfg.rank_columns(w.shape[0], split.local,
                                                               base.block_n))  # fmt: skip
    gen = torch.Generator(device=w.device).manual_seed(0)
    same = cand != base and _same_bits(w, False, cfg, cand, base, (1, 7, 64), gen, f32=True)
    tile = f"{cand.block_n} columns a tile" if same else "the whole weight's tile"
    logger.info("row-parallel [%d, %d] on a rank: %s", w.shape[0], w.shape[1], tile)
    return dataclasses.replace(split, rank_tile=cand) if same else split


def finish(acc: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """The tree's root (float32) + bias in float32, rounded once to `dtype`."""
    if bias is not None:
        acc = acc + bias.float()
    return acc.to(dtype)


def row_linear_gpu(x: torch.Tensor, w: torch.Tensor, split: RowSplit,
                   bias: torch.Tensor | None = None, *, f32: bool = False,
                   config: MatmulConfig | None = None,
                   out: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """x [M, K_r] @ w [N, K_r].T, K_r = K / world: the rank's `split.local` parts in the
    tile of the whole weight (the same K loop per part as at T = 1). f32: the subtree's
    float32 sum [M, N] (no bias, no rounding: the kernel stores its float32 accumulator),
    for `TPShard.reduce_tree`, into `out` if given (a symmetric buffer). Otherwise (world
    1 only) the whole tree, bias and the one rounding in the kernel's epilogue: the bits
    of `f32` then bias, then `.to(dtype)`."""
    if split.tile is None:
        raise ValueError("row_linear_gpu needs a RowSplit with a tile (row_split_gpu)")
    if not f32 and split.world != 1:
        raise ValueError("a rank's row-parallel product is its float32 subtree sum "
                         "(f32=True); only world 1 rounds in the kernel")  # fmt: skip
    cfg = config or MatmulConfig.default()
    tile = split.local_tile()
    if split.world == 1:  # the whole weight: its verified large tile of this split, if any
        tile = cfg.tile_for(w.shape[0], w.shape[1], x.shape[0], split.parts)
    if f32:
        return _launch(x, w, None, False, cfg, tile=tile, f32_out=True, out=out)
    return _launch(x, w, bias, False, cfg, tile=tile)


def row_linear_reference(x: torch.Tensor, w: torch.Tensor, split: RowSplit,
                         bias: torch.Tensor | None = None, *, f32: bool = False,
                         mm=torch.mm) -> torch.Tensor:  # fmt: skip
    """`row_linear_gpu` in torch (the CPU route passes its `RowMM.mm`): each of the
    rank's `split.local` parts a float32 product over K_r / local columns (inputs
    upcast exactly), the parts added in the tree; `f32` as in `row_linear_gpu`. `w` may
    be stored K-major (the CPU route's layout) and in float32 already."""
    from graphexec.kernels.matmul import tree_sum

    M, K = x.shape
    k = K // split.local
    # each part contiguous: a part's call sees the same operand layout at every world
    xs = x.float().view(M, split.local, k).transpose(0, 1).contiguous()
    wt = w.t() if w.dtype == torch.float32 else w.t().float()
    acc = tree_sum([mm(xs[j], wt[j * k : (j + 1) * k]) for j in range(split.local)])
    return acc if f32 else finish(acc, bias, x.dtype)
