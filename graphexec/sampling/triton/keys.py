"""Order keys and fixed-point masses. A row's order is (value desc, token id asc):

okey(y)   int32 whose signed order is the float order (-0.0 folded into +0.0)
pack      (okey << 32) | (0xFFFFFFFF - id): distinct, larger where a token comes
          earlier; a kept set is {pack >= C}, C its last element's pack
mass      trunc(exp(z) * 2**32), z <= 0, as int32 halves (exact 32-bit block sums)
"""

from __future__ import annotations

import triton
import triton.language as tl

from graphexec.runtime.triton_env import interpreter_enabled

PAD_KEY = tl.constexpr(-9223372036854775808)  # below every pack; unpacks to -inf
BIG_KEY = tl.constexpr(9223372036854775807)  # above every pack
INT32_MAX = tl.constexpr(2147483647)
_INTERP = tl.constexpr(interpreter_enabled())


@triton.jit
def okey(x):
    """fp32 -> int32 with the same order (as signed ints); -0.0 and +0.0 share a key."""
    x = tl.where(x == 0.0, 0.0, x)
    b = x.to(tl.int32, bitcast=True)
    return tl.where(b >= 0, b, b ^ 0x7FFFFFFF)


@triton.jit
def okey_to_float(k):
    b = tl.where(k >= 0, k, k ^ 0x7FFFFFFF)
    return b.to(tl.float32, bitcast=True)


@triton.jit
def pack(x, ids):
    """int64 sort key of (value desc, id asc) for fp32 values x and int32 ids."""
    return (okey(x).to(tl.int64) << 32) | (0xFFFFFFFF - ids.to(tl.int64))


@triton.jit
def unpack(key):
    """(values fp32, ids int32) of packed keys; PAD_KEY gives -inf."""
    vals = okey_to_float((key >> 32).to(tl.int32))
    ids = (0xFFFFFFFF - (key & 0xFFFFFFFF)).to(tl.int32)
    return tl.where(key == PAD_KEY, float("-inf"), vals), ids


@triton.jit
def exp_ftz(z):
    """exp(z) for z <= 0 (-inf gives 0): on the GPU the multiply by log2(e) and one
    ex2.approx.ftz, what tl.exp compiles to but for its denormal fix-up, which changes only
    results below 2**-126 (their mass is 0 either way); numpy's exp under the interpreter."""
    if _INTERP:
        return tl.exp(z)
    else:
        return tl.inline_asm_elementwise(
            "{ .reg .f32 t; mul.ftz.f32 t, $1, 0f3FB8AA3B; ex2.approx.ftz.f32 $0, t; }",
            "=r,r", [z], dtype=tl.float32, is_pure=True, pack=1)  # fmt: skip


@triton.jit
def mass_hi_lo(z):
    """int32 (hi, lo) with trunc(exp(z) * 2**32) = hi * 2**16 + lo exactly, for z <= 0
    (-inf gives 0), from one conversion: e * 2**32 is exact (a power-of-two scaling), below
    2**32 for e < 1, and truncates to u32 as the mass; e = 1 (2**32, past u32) is (2**16,
    0), and so is a NaN z (the stats pass's +inf entries). `tests/sampling/test_triton_stats.py`
    checks it against the two-conversion form."""
    t = exp_ftz(z) * 4294967296.0
    one = (t < 4294967296.0) == 0
    u = tl.where(one, 0.0, t).to(tl.uint32)
    return tl.where(one, 65536, (u >> 16).to(tl.int32)), (u & 0xFFFF).to(tl.int32)


@triton.jit
def mass_bits(w):
    """GPU: (2**39 + hi * 2**16, 2**23 + lo) as int32 bits, hi * 2**16 + lo the mass of
    `mass_hi_lo` at w = z log2(e), in fp32 arithmetic: e = min(2**w, 1) (NaN w: 1), then
    2**39 + t rounded down is 2**39 + hi * 2**16 (t = e * 2**32 exact inside the fma, ulp
    2**16 there), and 2**23 + (t - hi * 2**16) rounded down is 2**23 + lo (ulp 1): three
    fp32 operations, no conversion. `tests/sampling/test_triton_stats.py` emulates them."""
    return tl.inline_asm_elementwise(
        "{ .reg .f32 e, d; ex2.approx.ftz.f32 e, $2; "
        "min.f32 e, e, 0f3F800000; fma.rm.f32 $0, e, 0f4F800000, 0f53000000; "
        "sub.f32 d, 0f53000080, $0; fma.rm.f32 $1, e, 0f4F800000, d; }",
        "=f,=f,r", [w], dtype=(tl.float32, tl.float32), is_pure=True, pack=1)  # fmt: skip


@triton.jit
def block_mass(d, s):
    """Exact int64 sum along axis 1 (at most 255 terms) of the masses of z = d * s (d <= 0,
    s > 0 a scalar). The interpreter: `mass_hi_lo`'s. The GPU: `mass_bits` at d times s
    log2(e) (rounded once, held below the float max: one multiply a value, not two);
    the int32 sums of its biased halves, wrapped, keep each half's sum (below 2**24) in
    their low 24 bits, the biases being multiples of 2**24."""
    if _INTERP:
        hi, lo = mass_hi_lo(d * s)
        return sum_halves(hi, lo, 1)
    else:
        tl.static_assert(d.shape[1] <= 255)
        hb, lb = mass_bits(d * tl.minimum(s * 1.4426950408889634, 3.4028234663852886e38))
        hs = tl.sum(hb.to(tl.int32, bitcast=True), axis=1) & 0xFFFFFF
        ls = tl.sum(lb.to(tl.int32, bitcast=True), axis=1) & 0xFFFFFF
        return hs.to(tl.int64) * 65536 + ls.to(tl.int64)


@triton.jit
def mass(z):
    """int64 trunc(exp(z) * 2**32), z <= 0 (-inf gives 0)."""
    hi, lo = mass_hi_lo(z)
    return hi.to(tl.int64) * 65536 + lo.to(tl.int64)


@triton.jit
def sum_mass(sel, z, axis: tl.constexpr):
    """Exact int64 sum of trunc(exp(z) * 2**32) where sel, along axis (at most 2**15
    terms: the halves sum in int32)."""
    hi, lo = mass_hi_lo(tl.where(sel, z, float("-inf")))
    return sum_halves(hi, lo, axis)


@triton.jit
def sum_halves(hi, lo, axis: tl.constexpr):
    """Exact int64 sum of `mass_hi_lo` halves along axis (at most 2**15 terms)."""
    return tl.sum(hi, axis=axis).to(tl.int64) * 65536 + tl.sum(lo, axis=axis).to(tl.int64)


@triton.jit
def tile_total(acc):
    """The int64 sum of a pass's [R, DB] per-token int32 accumulator, once after the loop."""
    return tl.sum(tl.sum(acc.to(tl.int64), axis=1), axis=0)


@triton.jit
def tile_mass(hi, lo):
    """The exact int64 mass of [R, DB] per-token accumulators of `mass_hi_lo` halves."""
    return tile_total(hi) * 65536 + tile_total(lo)


@triton.jit
def first_argmax(v, idx, N: tl.constexpr):
    """(max, the smallest idx holding it) of a vector (N where v is empty)."""
    top = tl.max(v, axis=0)
    return top, tl.min(tl.where(v == top, idx, N), axis=0)


@triton.jit
def sort_desc(keys, INTERP: tl.constexpr):
    """Sort each row of [R, C] int64 keys in descending order (the interpreter, whose
    tl.sort runs element by element, ranks the keys instead: distinct but for padding)."""
    if INTERP:
        C: tl.constexpr = keys.shape[1]
        idx = tl.arange(0, C)
        ki = keys[:, :, None]
        kj = keys[:, None, :]
        ahead = (kj > ki) | ((kj == ki) & (idx[None, None, :] < idx[None, :, None]))
        rank = tl.sum(ahead.to(tl.int32), axis=2)
        onehot = rank[:, :, None] == idx[None, None, :]
        return tl.sum(tl.where(onehot, ki, 0), axis=1)
    else:
        return tl.sort(keys, dim=1, descending=True)


@triton.jit
def collapse_inf(x, has_inf):
    """Rows holding +inf sample uniformly among their +inf entries (has_inf broadcasts)."""
    return tl.where(has_inf, tl.where(x == float("inf"), 0.0, float("-inf")), x)
