"""Order keys and the filter over a sorted prefix, shared by the sampler's kernels.

A row's "sorted order" is (value descending, token id ascending). Kernels find the part of
that order they need (a whole small row, or the candidates above a threshold of a large
one), sort it as packed int64 keys, and apply top-k / top-p / min-p on the sorted tile
exactly as `graphexec.sampling.reference.filter_mask` does:

    okey(x)  int32 whose signed order is the float order (-0.0 folded into +0.0)
    pack     (okey << 32) | (0xFFFFFFFF - id): one descending sort gives the row's order
"""

from __future__ import annotations

import triton
import triton.language as tl

from graphexec.sampling.triton.philox import gather_bits, gumbel

MASS_SCALE = 4294967296.0  # 2**32, fixed-point probability mass relative to the max
PAD_KEY = -(2**63)  # sorts last; unpacks to -inf, never kept


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
    hi = okey(x).to(tl.int64) << 32
    lo = 0xFFFFFFFF - ids.to(tl.int64)
    return hi | lo


@triton.jit
def unpack(key):
    """(values fp32, ids int32) of packed keys; PAD_KEY gives -inf."""
    vals = okey_to_float((key >> 32).to(tl.int32))
    ids = (0xFFFFFFFF - (key & 0xFFFFFFFF)).to(tl.int32)
    return tl.where(key == -9223372036854775808, float("-inf"), vals), ids


@triton.jit
def sort_desc(keys, INTERP: tl.constexpr):
    """Sort each row of [R, C] int64 keys in descending order.

    Compiled: tl.sort. Under the CPU interpreter, whose tl.sort runs element by element in
    Python, the same order by ranks (keys are distinct but for the padding): O(C^2) work
    in a few vectorised numpy operations."""
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


@triton.jit
def mass(x, m):
    """int64 fixed-point mass trunc(exp(x - m) * 2**32); 0 for -inf."""
    rel = tl.exp(x - m)
    return (rel * 4294967296.0).to(tl.int64)


@triton.jit
def filter_sorted_draw(vals, ids, m, top_k, top_p, min_p, qtot, seed, pos, STREAM: tl.constexpr):
    """Filter a sorted tile and draw from what survives.

    vals: [R, C] f32, each row sorted by (value desc, id asc) and holding a prefix of its
        row's order (-inf pads the tail).   ids: [R, C] int32 token ids of vals.
    m: [R, 1] row max. top_k: [R, 1] int32 (0 off). top_p, min_p: [R, 1] f32.
    qtot: [R, 1] float64 total mass for top-p when top_k is off (the whole row's), else
        ignored (the top-k prefix's own mass is used).
    seed, pos: [R, 1] int64 noise keys.
    Returns (token [R] int32, -1 where nothing is kept; best score [R] f32).
    """
    C: tl.constexpr = vals.shape[1]
    rank = tl.arange(0, C)[None, :]
    finite = vals > float("-inf")
    kept = finite & ((top_k == 0) | (rank < top_k))
    rel = tl.exp(vals - m)
    q = tl.where(kept, (rel * 4294967296.0).to(tl.int64), 0)
    before = tl.cumsum(q, axis=1) - q
    total = tl.where(top_k == 0, qtot, tl.sum(q, axis=1)[:, None].to(tl.float64))
    thresh = top_p.to(tl.float64) * total
    kept = kept & ((top_p >= 1.0) | (before.to(tl.float64) < thresh))
    kept = kept & (rel >= min_p)
    g = gumbel(gather_bits(seed, pos, ids, STREAM))
    score = tl.where(kept, vals + g, float("-inf"))
    best = tl.max(score, axis=1)
    tok = tl.min(tl.where(score == best[:, None], ids, 2147483647), axis=1)
    tok = tl.where(best > float("-inf"), tok, -1)
    return tok, best
