"""Triton twin of `graphexec.rng`: the counter-based noise u(seed, pos, token_id, stream).

Bit-identical to the torch reference (see `graphexec.rng` for the definition):

    key     = (seed & 0xFFFFFFFF, seed >> 32)
    counter = (token_id >> 2, pos, stream, 0)
    x       = Philox4x32-10(counter, key)[token_id & 3]
    u       = ((x >> 8) | 1) * 2**-24

The building blocks are `@triton.jit` device functions that the sampler kernels inline:

- `philox4x32`: the raw generator on uint32 tensors.
- `block_bits` / `tile_bits`: the words of a contiguous run of tokens (one row, or a
  [BLOCK_R, BLOCK] tile whose rows have their own seed and position), with ONE Philox
  call per 4 tokens whose 4 outputs are interleaved back into token order.
- `gather_bits`: the words of arbitrary token ids (one Philox call per token, then a lane
  select); for small candidate sets such as a top-k list.
- `to_uniform` / `gumbel`: the exact integer-to-float map and the Gumbel transform.

`philox_bits` is a tiny test-only launcher that writes the words of every token of each
row, so the tests can compare with `graphexec.rng.random_bits`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Same constants as graphexec.rng; literals >= 2**31 are typed uint32 by Triton.
PHILOX_M0: tl.constexpr = tl.constexpr(0xD2511F53)
PHILOX_M1: tl.constexpr = tl.constexpr(0xCD9E8D57)
PHILOX_W0: tl.constexpr = tl.constexpr(0x9E3779B9)
PHILOX_W1: tl.constexpr = tl.constexpr(0xBB67AE85)
PHILOX_ROUNDS: tl.constexpr = tl.constexpr(10)
U_SCALE: tl.constexpr = tl.constexpr(2.0**-24)


@triton.jit
def philox4x32(c0, c1, c2, c3, k0, k1):
    """Philox4x32-10 on uint32 tensors of one shape; returns the 4 output words (uint32)."""
    for _ in tl.static_range(PHILOX_ROUNDS):
        _c0 = c0
        _c2 = c2
        # 32x32 -> 64 products as (umulhi, wrapping uint32 multiply)
        c0 = tl.umulhi(_c2, PHILOX_M1) ^ c1 ^ k0
        c2 = tl.umulhi(_c0, PHILOX_M0) ^ c3 ^ k1
        c1 = _c2 * PHILOX_M1
        c3 = _c0 * PHILOX_M0
        k0 = k0 + PHILOX_W0
        k1 = k1 + PHILOX_W1
    return c0, c1, c2, c3


@triton.jit
def _key(seed):
    """(k0, k1) uint32 from an int64 seed (any shape): low and high 32 bits."""
    seed = seed.to(tl.int64)
    return seed.to(tl.uint32), (seed >> 32).to(tl.uint32)


@triton.jit
def tile_bits(seed, pos, start, BLOCK_R: tl.constexpr, BLOCK: tl.constexpr, STREAM: tl.constexpr):
    """[BLOCK_R, BLOCK] uint32 words of tokens start .. start+BLOCK-1 for BLOCK_R rows.

    seed, pos: [BLOCK_R] int64 (row r uses seed[r], pos[r]); start: a multiple of 4.
    One Philox call per 4 tokens (counter c0 = token >> 2); its 4 words are the tokens
    4g, 4g+1, 4g+2, 4g+3, put back in token order by join/reshape.
    """
    G: tl.constexpr = BLOCK // 4
    tl.static_assert(BLOCK % 4 == 0, "BLOCK must be a multiple of 4")
    k0, k1 = _key(seed)
    groups = (start // 4 + tl.arange(0, G)).to(tl.uint32)
    shape: tl.constexpr = (BLOCK_R, G)
    c0 = tl.broadcast_to(groups[None, :], shape)
    c1 = tl.broadcast_to(pos.to(tl.int64).to(tl.uint32)[:, None], shape)
    c2 = tl.full(shape, STREAM, tl.uint32)
    c3 = tl.zeros(shape, tl.uint32)
    r0, r1, r2, r3 = philox4x32(
        c0, c1, c2, c3, tl.broadcast_to(k0[:, None], shape), tl.broadcast_to(k1[:, None], shape)
    )
    # join(join(r0, r2), join(r1, r3)) has [r, g, i, j] = r_{2j+i}; row-major flattening
    # of (i, j) gives r0, r1, r2, r3 per group, i.e. token order.
    return tl.reshape(tl.join(tl.join(r0, r2), tl.join(r1, r3)), (BLOCK_R, BLOCK))


@triton.jit
def block_bits(seed, pos, start, BLOCK: tl.constexpr, STREAM: tl.constexpr):
    """[BLOCK] uint32 words of tokens start .. start+BLOCK-1 for one row.

    seed, pos: int64 scalars; start: a multiple of 4. One Philox call per 4 tokens.
    """
    G: tl.constexpr = BLOCK // 4
    tl.static_assert(BLOCK % 4 == 0, "BLOCK must be a multiple of 4")
    k0, k1 = _key(seed)
    c0 = (start // 4 + tl.arange(0, G)).to(tl.uint32)
    c1 = tl.full((G,), 0, tl.uint32) + pos.to(tl.int64).to(tl.uint32)
    c2 = tl.full((G,), STREAM, tl.uint32)
    c3 = tl.zeros((G,), tl.uint32)
    r0, r1, r2, r3 = philox4x32(c0, c1, c2, c3, c3 + k0, c3 + k1)
    return tl.reshape(tl.join(tl.join(r0, r2), tl.join(r1, r3)), (BLOCK,))


@triton.jit
def group_bits(seed, pos, start, G: tl.constexpr, STREAM: tl.constexpr):
    """[G, 4] uint32 words of tokens start .. start+4G-1 laid out as [token // 4, token % 4].

    The 2-D layout keeps each group's four words where its Philox call produced them, so
    no data moves between threads (block_bits' join/reshape interleave does move it)."""
    k0, k1 = _key(seed)
    c0 = (start // 4 + tl.arange(0, G)).to(tl.uint32)
    c1 = tl.full((G,), 0, tl.uint32) + pos.to(tl.int64).to(tl.uint32)
    c2 = tl.full((G,), STREAM, tl.uint32)
    c3 = tl.zeros((G,), tl.uint32)
    r0, r1, r2, r3 = philox4x32(c0, c1, c2, c3, c3 + k0, c3 + k1)
    lane = tl.arange(0, 4)[None, :]
    return tl.where(
        lane == 0,
        r0[:, None],
        tl.where(lane == 1, r1[:, None], tl.where(lane == 2, r2[:, None], r3[:, None])),
    )


@triton.jit
def gather_bits(seed, pos, token_ids, STREAM: tl.constexpr):
    """uint32 words of arbitrary token ids (any shape, broadcast with seed and pos).

    One Philox call per token, then the lane token & 3 is selected.
    """
    # broadcast the ids to the common shape of (seed, pos, token_ids) first
    tok = token_ids.to(tl.int64) + tl.zeros_like(seed.to(tl.int64) + pos.to(tl.int64))
    zero = tl.zeros_like(tok).to(tl.uint32)
    k0, k1 = _key(seed)
    c0 = (tok >> 2).to(tl.uint32)
    c1 = zero + pos.to(tl.int64).to(tl.uint32)
    r0, r1, r2, r3 = philox4x32(c0, c1, zero + STREAM, zero, zero + k0, zero + k1)
    lane = tok & 3
    return tl.where(lane == 0, r0, tl.where(lane == 1, r1, tl.where(lane == 2, r2, r3)))


@triton.jit
def to_uniform(bits):
    """float32 in [2**-24, 1 - 2**-24]: ((bits >> 8) | 1) * 2**-24, exact."""
    return ((bits.to(tl.uint32) >> 8) | 1).to(tl.float32) * U_SCALE


@triton.jit
def gumbel(bits):
    """float32 standard Gumbel noise -log(-log(u)); finite because u is inside (0, 1)."""
    u = to_uniform(bits)
    return -tl.log(-tl.log(u))


# ---------------------------------------------------------------------------------------
# Test-only kernels: write the noise of a whole row / of given token ids.

OUT_BITS = 0
OUT_UNIFORM = 1
OUT_GUMBEL = 2


@triton.jit
def _finish(bits, OUT: tl.constexpr):
    if OUT == 1:
        return to_uniform(bits)
    elif OUT == 2:
        return gumbel(bits)
    else:
        return bits.to(tl.int64)


@triton.jit
def _philox_row_kernel(
    seed_ptr,  # [R] i64
    pos_ptr,  # [R] i64
    out_ptr,  # [R, V] i64 (uint32 values) or f32, contiguous
    V,
    BLOCK_R: tl.constexpr,
    BLOCK: tl.constexpr,
    STREAM: tl.constexpr,
    TILE: tl.constexpr,  # True: tile_bits over BLOCK_R rows; False: block_bits, one row
    OUT: tl.constexpr,
):
    start = tl.program_id(1) * BLOCK
    cols = start + tl.arange(0, BLOCK)
    if TILE:
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        seed = tl.load(seed_ptr + rows)  # launcher pads R to a multiple of BLOCK_R
        pos = tl.load(pos_ptr + rows)
        bits = tile_bits(seed, pos, start, BLOCK_R, BLOCK, STREAM)
        offs = rows.to(tl.int64)[:, None] * V + cols[None, :]
        tl.store(out_ptr + offs, _finish(bits, OUT), mask=(cols < V)[None, :])
    else:
        row = tl.program_id(0).to(tl.int64)
        bits = block_bits(tl.load(seed_ptr + row), tl.load(pos_ptr + row), start, BLOCK, STREAM)
        tl.store(out_ptr + row * V + cols, _finish(bits, OUT), mask=cols < V)


@triton.jit
def _philox_gather_kernel(
    seed_ptr,  # [R] i64
    pos_ptr,  # [R] i64
    ids_ptr,  # [R, N] i64, contiguous
    out_ptr,  # [R, N] i64 (uint32 values) or f32, contiguous
    R,
    N,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    STREAM: tl.constexpr,
    OUT: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_N)
    rm = rows < R
    m = rm[:, None] & (cols < N)[None, :]
    offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
    ids = tl.load(ids_ptr + offs, mask=m, other=0)
    seed = tl.load(seed_ptr + rows, mask=rm, other=0)[:, None]  # broadcast over the ids
    pos = tl.load(pos_ptr + rows, mask=rm, other=0)[:, None]
    tl.store(out_ptr + offs, _finish(gather_bits(seed, pos, ids, STREAM), OUT), mask=m)


def _out_dtype(out: int) -> torch.dtype:
    return torch.int64 if out == OUT_BITS else torch.float32


def philox_bits(
    seed: torch.Tensor,
    pos: torch.Tensor,
    vocab: int,
    stream: int = 0,
    *,
    block_r: int | None = None,
    block: int = 64,
    out: int = OUT_BITS,
) -> torch.Tensor:
    """Test-only: [R, vocab] noise of every token of each row (seed[r], pos[r]).

    Returns int64 holding the uint32 words (out=OUT_BITS), or float32 uniforms / Gumbel
    noise (OUT_UNIFORM / OUT_GUMBEL). block_r=None runs `block_bits` (one row per
    program); an int runs `tile_bits` on [block_r, block] tiles.
    """
    R = seed.shape[0]
    seed = seed.to(torch.int64)
    pos = pos.to(torch.int64)
    tile = block_r is not None
    br = block_r if tile else 1
    pad = -R % br
    if pad:  # the tile kernel loads whole row blocks; pad with copies of row 0
        seed = torch.cat([seed, seed[:1].expand(pad)])
        pos = torch.cat([pos, pos[:1].expand(pad)])
    res = torch.empty((R + pad, vocab), dtype=_out_dtype(out), device=seed.device)
    grid = ((R + pad) // br, triton.cdiv(vocab, block))
    _philox_row_kernel[grid](
        seed.contiguous(), pos.contiguous(), res, vocab, br, block, stream, tile, out
    )
    return res[:R]


def philox_gather(
    seed: torch.Tensor,
    pos: torch.Tensor,
    token_ids: torch.Tensor,
    stream: int = 0,
    *,
    out: int = OUT_BITS,
) -> torch.Tensor:
    """Test-only: [R, N] noise of token_ids[r, n] for row r (seed[r], pos[r]), through
    `gather_bits` with [BLOCK_R, 1] seeds and positions broadcast against [BLOCK_R, N] ids."""
    R, N = token_ids.shape
    res = torch.empty((R, N), dtype=_out_dtype(out), device=seed.device)
    block_r = min(triton.next_power_of_2(max(R, 1)), 32)
    _philox_gather_kernel[(triton.cdiv(R, block_r),)](
        seed.to(torch.int64).contiguous(),
        pos.to(torch.int64).contiguous(),
        token_ids.to(torch.int64).contiguous(),
        res,
        R,
        N,
        block_r,
        triton.next_power_of_2(max(N, 1)),
        stream,
        out,
    )
    return res


__all__ = [
    "philox4x32",
    "block_bits",
    "tile_bits",
    "gather_bits",
    "to_uniform",
    "gumbel",
    "philox_bits",
    "philox_gather",
]
