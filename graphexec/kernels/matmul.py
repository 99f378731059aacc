"""Batch-invariant matrix products: a row's bits never depend on the other rows of the call.

cuBLAS chooses its GEMM kernel (tile shape, split-K, stream-K) by the number of rows M,
so one row of activations is rounded differently alone, in a batch of 7 and in a batch
of 256: a seeded request's logits, and so its tokens, would depend on what runs beside
it. Here the reduction order is fixed by the weight's shape alone
(`matmul_kernel._linear_kernel`): K is split into S parts (S a power of two), each part
summed in one K loop in float32, the parts added in a fixed binary tree
((p0 + p1) + (p2 + p3)) ..., then rounded once.

The tile (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) and the split S are
`MatmulConfig.tile(N, K)`: a function of the weight's shape, never of M. M is a runtime
argument the compiler never specialises on; how many programs share a tile's S parts is
a launch choice by M that does not change a bit (the tree's subtrees are its nodes). So
a row's sum is the same sequence of the same instructions whatever rows share its tile,
whichever tile it sits in, and whether the call is a decode, a verify over K + 1 tokens
or a prefill chunk. Small M fills the GPU by tiling N finely and by giving the parts of
K to separate programs; a tensor-parallel row-parallel layer gives them to ranks.

`linear_reference` is the tests' definition (the models' CPU route is `cpu_route.RowMM`,
whose call sizes are measured rather than fixed): torch.mm over chunks of
a fixed number of rows, so every call has one shape and a row's bits are a function of
that row (and of torch's intra-op thread count, which the process fixes). The kernel
and the reference agree to rounding (different summation orders), not bit for bit.
`tree_sum` is the tree in torch, for the partial sums of a split.
"""

from __future__ import annotations

import dataclasses
import logging

import torch
import torch.nn.functional as F

from graphexec.kernels import dependent_launch, fused, matmul_tma
from graphexec.kernels.matmul_config import MatmulConfig, MatmulTile
from graphexec.kernels.matmul_kernel import _linear_kernel, launch_shape
from graphexec.runtime.triton_env import interpreter_enabled

logger = logging.getLogger(__name__)


def _check(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, silu_mul: bool) -> None:
    name = "linear_silu_mul" if silu_mul else "linear"
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"{name} takes x [M, K] and w [N, K], got {list(x.shape)} and "
                         f"{list(w.shape)}")  # fmt: skip
    if silu_mul and w.shape[0] % 2:
        raise ValueError(f"linear_silu_mul takes w [2 I, K] (gate rows, then up), got "
                         f"{list(w.shape)}")  # fmt: skip
    if bias is not None and tuple(bias.shape) != (w.shape[0],):
        raise ValueError(f"bias must be [{w.shape[0]}], got {list(bias.shape)}")
    if w.dtype != x.dtype or (bias is not None and bias.dtype != x.dtype):
        raise ValueError(f"x ({x.dtype}), w ({w.dtype}) and bias must have one dtype")


MAX_TILES = 4096  # counters per device: a call spreads parts over programs up to this


def _counters(device: torch.device) -> torch.Tensor:
    """The persistent per-tile counters of `device` (zero between calls: the last program
    of a tile resets its own), made once, before any graph capture uses them."""
    key = (device.type, device.index)
    if key not in _COUNTER_BUFFERS:
        _COUNTER_BUFFERS[key] = torch.zeros(MAX_TILES, dtype=torch.int32, device=device)
    return _COUNTER_BUFFERS[key]


_COUNTER_BUFFERS: dict[tuple[str, int | None], torch.Tensor] = {}


def _launch(x, w, bias, silu_mul: bool, config: MatmulConfig | None,
            programs_per_tile: int | None = None, *, tile: MatmulTile | None = None,
            f32_out: bool = False, out: torch.Tensor | None = None,
            rope: tuple | None = None):  # fmt: skip
    """One launch; `tile` overrides the config's (row_parallel: a rank's parts of the
    whole weight's tile); `f32_out`: the tree's float32 root, no bias, no rounding (the
    epilogue's rounding to float32 is the identity), into `out` [M, N] (contiguous
    float32, e.g. a symmetric buffer) if given; `rope`: `linear_rope`'s (positions,
    slot_ids, cos, sin, kv, heads), the q [M, H, hd] returned."""
    _check(x, w, bias, silu_mul)
    if rope is not None:  # (a meta tensor: shapes only)
        fused._rope_args(torch.empty((x.shape[0], w.shape[0]), dtype=x.dtype, device="meta"),
                         *rope)  # fmt: skip
    if f32_out and (bias is not None or silu_mul):
        raise ValueError("f32_out gives the bare float32 sum: no bias, no SwiGLU")
    M, K = x.shape
    N = w.shape[0] // 2 if silu_mul else w.shape[0]
    dtype = torch.float32 if f32_out else x.dtype
    if out is None:
        out = torch.empty((M, N), dtype=dtype, device=x.device)
    elif not f32_out or out.shape != (M, N) or out.dtype != dtype or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous float32 [{M}, {N}] with f32_out")
    if M == 0 or N == 0:
        return out
    if K == 0:
        raise ValueError("linear needs K >= 1")
    if x.stride(1) != 1 or w.stride(1) != 1:
        raise ValueError("linear needs x and w contiguous in their last dim")
    cfg = config or MatmulConfig.default()
    t = tile or cfg.tile_for(N, K, M)
    if K % t.split:
        raise ValueError(f"the tile of weight [{N}, {K}] splits K into {t.split} parts, "
                         "which must divide K")  # fmt: skip
    tiles, P = launch_shape(M, N, t.block_m, t.block_n, t.split, cfg.min_programs, MAX_TILES)
    if t.programs and tiles <= MAX_TILES:  # a tuned tile's own choice
        P = t.programs
    if programs_per_tile is not None:  # tests: every P gives the same bits
        P = programs_per_tile
    interpreted = interpreter_enabled()
    pdl = dependent_launch.enabled(cfg.pdl, x.device) and M < cfg.large_m
    line = 128 // x.element_size()
    lines = 1 << max(0, (cfg.prefetch_k // line).bit_length() - 1) if cfg.prefetch_k >= line else 0
    if P > 1:
        partial = torch.empty((P, 2 if silu_mul else 1, M, N), dtype=torch.float32,
                              device=x.device)  # fmt: skip
        counter = _counters(x.device)
    else:
        partial = counter = out  # not read
    tma = t.tma and matmul_tma.usable(x, w, t.block_m, t.block_n, t.block_k, t.split)
    if tma:
        matmul_tma.launch(x, w, bias, out, partial, counter, tiles, P, K // t.split, t,
                          silu_mul, pdl, dependent_launch.launch_options(pdl))  # fmt: skip
        if rope is not None:  # the same rounding and rotation, in a kernel of their own:
            # in the TMA kernel's epilogue it measured slower on an H200 (Llama-3.1-8B's
            # forward at 128 / 256 rows: 6,801 / 10,000 us against 6,511 / 9,160)
            return fused.rope_kv_write(out, *rope, paired=True)
        return out
    if rope is not None:
        pos, slots, cos, sin, kv, heads = rope
        kv_heads, hd = kv.shape[3], kv.shape[4]
        out = torch.empty((M, heads, hd), dtype=x.dtype, device=x.device)
        trig = (pos, slots, cos, sin, kv, *kv.stride()[:4], kv.shape[2])
    else:
        heads = kv_heads = hd = 1
        trig = (out, out, out, out, out, 0, 0, 0, 0, 1)
    _linear_kernel[(tiles, P)](
        x, w, x if bias is None else bias, out, partial, counter, *trig[:5], M, N, K,
        x.stride(0), w.stride(0), *trig[5:], K // t.split,
        BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k,
        PARTS=t.split // P, P=P, HAS_BIAS=bias is not None, SILU_MUL=silu_mul,
        ROPE=rope is not None, H=heads, KV_HEADS=kv_heads, HD=hd,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32", INTERPRETED=interpreted,
        PDL=pdl, LINE=line, LINES=lines, num_warps=t.num_warps, num_stages=t.num_stages,
        **dependent_launch.launch_options(pdl),
    )  # fmt: skip
    return out


def linear(
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    config: MatmulConfig | None = None,
) -> torch.Tensor:
    """``x @ w.T + bias`` with a row's bits independent of the batch (Triton).

    Parameters
    ----------
    x : torch.Tensor
        ``[M, K]`` activations (float32 / bfloat16 / float16; last dim contiguous).
    w : torch.Tensor
        ``[N, K]`` weight in ``x``'s dtype (``nn.Linear``'s layout; last dim contiguous).
    bias : torch.Tensor, optional
        ``[N]`` in ``x``'s dtype, added in float32 before the one rounding.
    config : MatmulConfig, optional
        Tiling by ``(N, K)``; None = ``MatmulConfig.default()``.

    Returns
    -------
    torch.Tensor
        ``[M, N]`` in ``x``'s dtype: products accumulated in float32 (IEEE for float32
        inputs, no TF32), over K in one order fixed by ``(N, K)``.

    Example
    -------
    >>> w = torch.randn(1152, 896, dtype=torch.bfloat16, device="cuda")
    >>> x = torch.randn(256, 896, dtype=torch.bfloat16, device="cuda")
    >>> y = linear(x, w)  # [256, 1152]
    >>> torch.equal(y[7:8], linear(x[7:8], w))  # the row alone: the same bits
    True

    Note
    ----
    CUDA graphs: one launch, grid and output fixed by shapes, no host sync; a call that
    spreads K's parts over programs takes a float32 scratch [P, M, N] from the caching
    allocator and per-tile counters the kernel leaves at zero. Row ``r``'s result is
    bitwise the same for any M and any other rows (`MatmulConfig.tile` reads only N and
    K, M is never specialised on, and the split's tree does not depend on who sums it).
    """
    return _launch(x, w, bias, False, config)


def linear_rope(
    x: torch.Tensor,
    w_qkv: torch.Tensor,
    bias: torch.Tensor | None,
    positions: torch.Tensor,
    slot_ids: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv: torch.Tensor,
    heads: int,
    *,
    config: MatmulConfig | None = None,
) -> torch.Tensor:
    """The q/k/v projection, rotary embeddings and the cache write in one launch:
    `fused.rope_kv_write(linear(x, w, bias), ...)` for a weight (and bias) in
    `fused.pair_rotary_rows`' order, so a tile holds whole rotated pairs and rotates them
    in its epilogue. Returns rotated q [M, H, hd]; writes k and v to kv[0 / 1, slot, pos]
    (`fused.rope_kv_write`'s operands). The bits are those of the two steps: the same
    dot products, rounded once, then rotated and rounded as the rotary kernel does
    (a call that takes the TMA tile runs those two kernels).

    CUDA graphs: one launch (two with a TMA tile), shapes fixed, no host sync."""
    return _launch(x, w_qkv, bias, False, config, rope=(positions, slot_ids, cos, sin, kv,
                                                        heads))  # fmt: skip


def linear_silu_mul(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    *,
    config: MatmulConfig | None = None,
) -> torch.Tensor:
    """``silu(x @ gate.T) * (x @ up.T)`` for ``w_gate_up`` = [gate; up] ``[2 I, K]``:
    `linear` and `fused.silu_mul` in one launch, [M, I] in x's dtype, each product
    rounded to the dtype before the SwiGLU (so the bits are those of the two steps)."""
    return _launch(x, w_gate_up, None, True, config)


REFERENCE_ROWS = 8  # rows per torch.mm call of linear_reference


def linear_reference(
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    config: MatmulConfig | None = None,
) -> torch.Tensor:
    """`linear` in torch (the CPU route; `config` unused): the rows in chunks of exactly
    REFERENCE_ROWS (the last padded with zero rows), one torch.mm (addmm) per chunk.

    torch's CPU GEMM picks its kernel, blocking and threading by the shape, M included,
    so a row computed in a batch is not the row computed alone. With every call of one
    shape [REFERENCE_ROWS, K] x [K, N] the BLAS takes one path, and a row's result does
    not depend on its place in the chunk or on the rows beside it (the tests check it at
    every place, for each model shape, dtype and thread count they run)."""
    _check(x, w, bias, False)
    M, R = x.shape[0], REFERENCE_ROWS
    pad = -M % R
    if pad:
        x = torch.cat([x, x.new_zeros(pad, x.shape[1])])
    out = torch.empty((M + pad, w.shape[0]), dtype=x.dtype, device=x.device)
    wt = w.t()
    for i in range(0, M + pad, R):
        if bias is None:
            torch.mm(x[i : i + R], wt, out=out[i : i + R])
        else:
            torch.addmm(bias, x[i : i + R], wt, out=out[i : i + R])
    return out[:M] if pad else out


def linear_silu_mul_reference(
    x: torch.Tensor, w_gate_up: torch.Tensor, *, config: MatmulConfig | None = None
) -> torch.Tensor:
    """`linear_silu_mul` in torch: `linear_reference`, then silu(gate) * up."""
    _check(x, w_gate_up, None, True)
    gate, up = linear_reference(x, w_gate_up).chunk(2, dim=-1)
    return F.silu(gate) * up


def tree_sum(parts: list[torch.Tensor] | torch.Tensor) -> torch.Tensor:
    """The split's tree over float32 partial sums p_0 .. p_{S-1} (S a power of two; a
    list, or a tensor stacked [S, ...], summed a level per op): ((p0 + p1) + (p2 + p3))
    + ...; a subtree of aligned consecutive parts is a node, so tree_sum of the subtree
    sums equals tree_sum of the parts, bit for bit."""
    if len(parts) & (len(parts) - 1) or not len(parts):
        raise ValueError(f"tree_sum takes a power-of-two number of parts, got {len(parts)}")
    while len(parts) > 1:
        if isinstance(parts, torch.Tensor):
            parts = parts[0::2] + parts[1::2]
        else:
            parts = [parts[i] + parts[i + 1] for i in range(0, len(parts), 2)]
    return parts[0]


def _measurable(w: torch.Tensor) -> bool:
    """Whether the kernel runs where `w` lives (CUDA, or the CPU under the interpreter),
    so a tile's bits can be measured there."""
    return w.device.type == "cuda" or interpreter_enabled()


def _same_bits(w: torch.Tensor, silu: bool, config: MatmulConfig, a: MatmulTile,
               b: MatmulTile, rows: tuple[int, ...], gen: torch.Generator,
               f32: bool = False) -> bool:  # fmt: skip
    """Whether tiles `a` and `b` give the same bits on weight `w` for activations of each
    row count in `rows` at three scales (normal, x 1e3, x 1e-3, with outliers); f32: of
    the bare float32 sums (`f32_out`)."""
    K = w.shape[1]
    for m in rows:
        for scale in (1.0, 1e3, 1e-3):
            x = torch.randn(m, K, device=w.device, generator=gen)
            x[::17, ::13] *= 64.0  # outliers, as activations have
            x = (x * scale).to(w.dtype)
            if not torch.equal(_launch(x, w, None, silu, config, tile=a, f32_out=f32),
                               _launch(x, w, None, silu, config, tile=b, f32_out=f32)):  # fmt: skip
                return False
    return True


def verify_shard_tiles(config: MatmulConfig, shards: list[tuple[int, torch.Tensor, bool]],
                       seed: int = 0) -> MatmulConfig:  # fmt: skip
    """`config` with a tile for each column shard (N, w [n, K] or [2 n, K], silu_mul) of a
    whole weight of N output columns: `shard_tile(N, K, n)` where, on this device, it
    gives the bits of the whole's tile (same split) at 1, 7 and 64 rows; else the whole's
    tile itself. Either way each output of the shard sums K as the whole weight's does,
    so a sharded model computes the bits of one device."""
    tiles: dict[tuple[int, int], MatmulTile] = {}
    gen = None
    for N, w, silu in shards:
        n, K = (w.shape[0] // 2 if silu else w.shape[0]), w.shape[1]
        whole, cand = config.tile(N, K), config.shard_tile(N, K, n)
        if cand != whole:
            if not _measurable(w):
                cand = whole  # no kernel runs here to measure it
            else:
                gen = gen or torch.Generator(device=w.device).manual_seed(seed)
                if not _same_bits(w, silu, config, cand, whole, (1, 7, 64), gen):
                    cand = whole
        logger.info("column shard [%d, %d] of [%d, %d]: %s tile %s", n, K, N, K,
                    "its own" if cand != whole else "the whole weight's", cand)  # fmt: skip
        if tiles.get((n, K), cand).split != cand.split:
            raise ValueError(f"two weights shard to [{n}, {K}] with different splits of K")
        tiles[(n, K)] = cand
    return config.replace(tiles=tuple((n, k, t) for (n, k), t in tiles.items()) + config.tiles)


def verify_large_tiles(config: MatmulConfig, weights: list[tuple[torch.Tensor, bool]],
                       rows: int = 256, seed: int = 0) -> MatmulConfig:  # fmt: skip
    """`config` with `verified` (`verified_wide`, `verified_long`) = the weight shapes whose
    large (wide, long) tile gives, on this device, the bits of the decode tile with the
    same split: for each (w [N, K] or [2 I, K], silu_mul), three activations of `rows`
    rows (normal, scaled by 1e3 and 1e-3, with outliers) through both tiles, compared bit
    for bit. A shape that differs anywhere keeps its decode tile at those M. Shapes
    without such a tile are skipped; nothing runs on the CPU."""
    found = {"verified": set(), "verified_wide": set(), "verified_long": set()}
    gen = None
    for w, silu in weights:
        N, K = (w.shape[0] // 2 if silu else w.shape[0]), w.shape[1]
        for name, tiles in (("verified", config.large_tiles),
                            ("verified_wide", config.wide_tiles),
                            ("verified_long", config.long_tiles)):  # fmt: skip
            large = [t for n, k, t in tiles if (n, k) == (N, K)]
            if w.device.type != "cuda" or not large:
                continue
            if gen is None:
                gen = torch.Generator(device=w.device).manual_seed(seed)
            decode = dataclasses.replace(config.tile(N, K), split=large[0].split)
            try:
                same = _same_bits(w, silu, config, large[0], decode,
                                  (max(rows, config.large_m),), gen)  # fmt: skip
            except Exception as e:  # noqa: BLE001 (e.g. a tile this device cannot hold)
                logger.warning("%s tile of [%d, %d] not usable here: %s", name, N, K, e)
                same = False
            if same:
                found[name].add((N, K))
    return config.replace(**{k: frozenset(v) for k, v in found.items()})
