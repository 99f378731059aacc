"""Triton twin of `graphexec.rng`: the counter-based noise u(seed, pos, token_id, stream),
bit-identical to the torch reference (`graphexec.rng` holds the definition).

`philox4x32` is the raw generator on uint32 tensors; `block_bits` the words of a run of
consecutive tokens, one Philox call per 4 tokens whose 4 outputs are put back in token
order (the draw's block noise and token noise); `token_bits` the same words of any ids;
`to_uniform` / `gumbel` the exact integer-to-float map and the Gumbel transform.
"""

from __future__ import annotations

import triton
import triton.language as tl

from graphexec import rng

# graphexec.rng's constants; literals >= 2**31 are typed uint32 by Triton
PHILOX_M0: tl.constexpr = tl.constexpr(rng.PHILOX_M0)
PHILOX_M1: tl.constexpr = tl.constexpr(rng.PHILOX_M1)
PHILOX_W0: tl.constexpr = tl.constexpr(rng.PHILOX_W0)
PHILOX_W1: tl.constexpr = tl.constexpr(rng.PHILOX_W1)
PHILOX_ROUNDS: tl.constexpr = tl.constexpr(rng.PHILOX_ROUNDS)
U_SCALE: tl.constexpr = tl.constexpr(rng.U_SCALE)


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
def block_bits(seed, pos, start, BLOCK: tl.constexpr, STREAM: tl.constexpr):
    """[BLOCK] uint32 words of tokens start .. start+BLOCK-1 of one row (seed, pos: int64
    scalars; start: a multiple of 4), keyed on the seed's low and high 32 bits."""
    G: tl.constexpr = BLOCK // 4
    tl.static_assert(BLOCK % 4 == 0, "BLOCK must be a multiple of 4")
    seed = seed.to(tl.int64)
    k0, k1 = seed.to(tl.uint32), (seed >> 32).to(tl.uint32)
    c0 = (start // 4 + tl.arange(0, G)).to(tl.uint32)
    c1 = tl.full((G,), 0, tl.uint32) + pos.to(tl.int64).to(tl.uint32)
    c2 = tl.full((G,), STREAM, tl.uint32)
    c3 = tl.zeros((G,), tl.uint32)
    r0, r1, r2, r3 = philox4x32(c0, c1, c2, c3, c3 + k0, c3 + k1)
    return tl.reshape(tl.join(tl.join(r0, r2), tl.join(r1, r3)), (BLOCK,))


@triton.jit
def token_bits(seed, pos, ids, STREAM: tl.constexpr):
    """The words `block_bits` gives tokens ids (int32, any shape, any order): word ids % 4
    of the Philox call at counter ids // 4."""
    seed = seed.to(tl.int64)
    c0 = (ids // 4).to(tl.uint32)
    z = c0 * 0
    r0, r1, r2, r3 = philox4x32(c0, z + pos.to(tl.int64).to(tl.uint32), z + STREAM, z,
                                z + seed.to(tl.uint32), z + (seed >> 32).to(tl.uint32))  # fmt: skip
    w = ids % 4
    return tl.where(w == 0, r0, tl.where(w == 1, r1, tl.where(w == 2, r2, r3)))


@triton.jit
def to_uniform(bits):
    """float32 in [2**-24, 1 - 2**-24]: ((bits >> 8) | 1) * 2**-24, exact."""
    return ((bits.to(tl.uint32) >> 8) | 1).to(tl.float32) * U_SCALE


@triton.jit
def gumbel(bits):
    """float32 standard Gumbel noise -log(-log(u)); finite because u is inside (0, 1)."""
    u = to_uniform(bits)
    return -tl.log(-tl.log(u))
