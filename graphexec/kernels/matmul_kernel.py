"""The batch-invariant GEMM kernel: K split into S parts, summed in a fixed binary tree.

    _linear_kernel  grid (cdiv(M, BLOCK_M) * cdiv(N, BLOCK_N), P): out = x @ w.T (+ bias)
        for one [BLOCK_M, BLOCK_N] tile. K is cut into S = P * PARTS parts of K / S
        columns each (S a power of two fixed by the weight's shape). Program (tile, q)
        computes parts q * PARTS .. (q + 1) * PARTS - 1, each from a zero float32
        accumulator with one K loop (k = part start, + BLOCK_K, ...), and adds them in
        the tree; with P > 1 it writes that subtree's sum to PARTIAL, and the tile's
        last program to arrive (a counter per tile) adds the P subtree sums in the same
        tree. Then bias in float32, one rounding to the dtype (with SILU_MUL: gate and up
        tiles of the same columns, silu(gate) * up rounded as `fused.silu_mul` rounds it).

The tree over S parts p_0 .. p_{S-1} is ((p0 + p1) + (p2 + p3)) + ...: each internal node
the sum of its two halves. Every subtree of 2^l consecutive parts is itself a node, so a
program may sum any aligned run of parts and hand the sum on; the root is the same bits
whichever programs (or, for tensor parallelism, whichever ranks) summed the subtrees.
So P is a launch choice by M (many programs at small M to stream the weights at
bandwidth, one at large M to keep partials in registers) and never changes a bit. The
counter is a persistent workspace the last program resets to zero (no memset per call,
capturable); which program arrives last decides only who adds, not the order.
"""

from __future__ import annotations

from graphexec.kernels.dependent_launch import dependent_start, prefetch_rows
from graphexec.kernels.fused import _rounded
from graphexec.runtime.triton_import import tl, triton

MAX_SPLIT = 16  # parts of K at most: the tree's pending sums s0..s3 hold 16 leaves


@triton.jit
def _tree_push(J: tl.constexpr, cur, s0, s1, s2, s3):
    """Leaf J (J = 0, 1, ...) of the tree: s_l holds the pending sum of 2^l leaves. Returns
    (cur, s0..s3); after the last leaf of a power-of-two count, cur is the root."""
    if J % 2 == 0:
        s0 = cur
    else:
        cur = s0 + cur
        if (J // 2) % 2 == 0:
            s1 = cur
        else:
            cur = s1 + cur
            if (J // 4) % 2 == 0:
                s2 = cur
            else:
                cur = s2 + cur
                if (J // 8) % 2 == 0:
                    s3 = cur
                else:
                    cur = s3 + cur
    return cur, s0, s1, s2, s3


@triton.jit
def _part_dot(x_ptr, w_ptr, k_lo, part_k, K, mmask, nmask, rk,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
              PRECISION: tl.constexpr, INTERPRETED: tl.constexpr):  # fmt: skip
    """One part's [BLOCK_M, BLOCK_N] float32 sum over K columns k_lo .. k_lo + part_k."""
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    x_ptr += k_lo
    w_ptr += k_lo
    for k0 in range(0, part_k, BLOCK_K):  # one order for every M and every P
        kmask = rk[None, :] < tl.minimum(part_k, K - k_lo) - k0
        x = tl.load(x_ptr, mask=mmask[:, None] & kmask, other=0.0)
        w = tl.load(w_ptr, mask=nmask[:, None] & kmask, other=0.0)
        if INTERPRETED:
            # the interpreter's dot is numpy's BLAS, which sums a row differently by its
            # place in the tile (and multiplies bf16 as raw bits): exact float32 products,
            # each output summed on its own
            prod = x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
            acc = acc + tl.sum(prod, axis=2)
        else:
            acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
        x_ptr += BLOCK_K
        w_ptr += BLOCK_K
    return acc


@triton.jit
def _epilogue(acc, acc_up, BIAS, OUT, rm, rn, mmask, nmask, N,
              HAS_BIAS: tl.constexpr, SILU_MUL: tl.constexpr):  # fmt: skip
    dt = OUT.dtype.element_ty
    if HAS_BIAS:
        acc += tl.load(BIAS + rn, mask=nmask, other=0.0).to(tl.float32)[None, :]
        if SILU_MUL:
            acc_up += tl.load(BIAS + N + rn, mask=nmask, other=0.0).to(tl.float32)[None, :]
    y = _rounded(acc, dt)
    if SILU_MUL:  # as fused.silu_mul on the rounded gate and up: F.silu(g) * u
        a = _rounded(y / (1.0 + tl.exp(-y)), dt)
        y = _rounded(a * _rounded(acc_up, dt), dt)
    tl.store(OUT + rm[:, None] * N + rn[None, :], y.to(dt), mask=mmask[:, None] & nmask[None, :])


@triton.jit
def _rope_epilogue(acc, BIAS, Q, rm, rn, mmask, N, HAS_BIAS: tl.constexpr, POS, SLOT, COS,
                   SIN, KVC, s_kv, s_s, s_t, s_h, T, H: tl.constexpr,
                   KV_HEADS: tl.constexpr, HD: tl.constexpr):  # fmt: skip
    """The q/k/v tile (columns in `fused.pair_rotary_rows`' order) rounded, rotated and
    stored as `fused.rope_kv_write` does it: q to Q [M, H, HD], k and v into the cache."""
    dt = Q.dtype.element_ty
    BM: tl.constexpr = acc.shape[0]
    BN: tl.constexpr = acc.shape[1]
    if HAS_BIAS:
        acc += tl.load(BIAS + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    x0, x1 = tl.split(tl.reshape(_rounded(acc, dt), [BM, BN // 2, 2]))  # a pair's dims
    c0, _ = tl.split(tl.reshape(rn, [BN // 2, 2]))  # the pair's first column
    j = c0 // HD  # head of the fused projection: q, then k, then v
    e = c0 % HD
    rotated = (j < H + KV_HEADS)[None, :]
    d0 = tl.where(j < H + KV_HEADS, e // 2, e)[None, :]
    d1 = tl.where(j < H + KV_HEADS, e // 2 + HD // 2, e + 1)[None, :]
    pos = tl.minimum(tl.maximum(tl.load(POS + rm, mask=mmask, other=0).to(tl.int64), 0), T - 1)
    slot = tl.load(SLOT + rm, mask=mmask, other=0).to(tl.int64)
    trig = pos[:, None] * HD
    cos0 = tl.load(COS + trig + d0).to(tl.float32)
    sin0 = tl.load(SIN + trig + d0).to(tl.float32)
    cos1 = tl.load(COS + trig + d1).to(tl.float32)
    sin1 = tl.load(SIN + trig + d1).to(tl.float32)
    # x * cos + rotate_half(x) * sin, each product and the sum rounded as torch rounds them
    y0 = _rounded(_rounded(x0 * cos0, dt) + _rounded(-x1 * sin0, dt), dt)
    y1 = _rounded(_rounded(x1 * cos1, dt) + _rounded(x0 * sin1, dt), dt)
    y0, y1 = tl.where(rotated, y0, x0), tl.where(rotated, y1, x1)  # v as it is
    is_v = (j >= H + KV_HEADS)[None, :]
    head = tl.where(is_v, j[None, :] - H - KV_HEADS, j[None, :] - H).to(tl.int64)
    kv_row = KVC + is_v.to(tl.int64) * s_kv + slot[:, None] * s_s + pos[:, None] * s_t + head * s_h
    q_row = Q + (rm[:, None] * H + j[None, :]) * HD
    is_q = (j < H)[None, :]
    mask = mmask[:, None] & (c0 < N)[None, :]
    tl.store(tl.where(is_q, q_row + d0, kv_row + d0), y0.to(dt), mask=mask)
    tl.store(tl.where(is_q, q_row + d1, kv_row + d1), y1.to(dt), mask=mask)


@triton.jit
def _finish(acc, up, BIAS, OUT, rm, rn, mmask, nmask, N, HAS_BIAS: tl.constexpr,
            SILU_MUL: tl.constexpr, ROPE: tl.constexpr, POS, SLOT, COS, SIN, KVC, s_kv, s_s,
            s_t, s_h, T, H: tl.constexpr, KV_HEADS: tl.constexpr, HD: tl.constexpr):  # fmt: skip
    if ROPE:
        _rope_epilogue(acc, BIAS, OUT, rm, rn, mmask, N, HAS_BIAS, POS, SLOT, COS, SIN, KVC,
                       s_kv, s_s, s_t, s_h, T, H, KV_HEADS, HD)  # fmt: skip
    else:
        _epilogue(acc, up, BIAS, OUT, rm, rn, mmask, nmask, N, HAS_BIAS, SILU_MUL)


@triton.jit(do_not_specialize=["M"])
def _linear_kernel(
    X,  # [M, K] dtype (row stride sx, last dim contiguous)
    W,  # [N_W, K] dtype (row stride sw, last dim contiguous); SILU_MUL: gate rows, then up
    BIAS,  # [N_W] dtype; read only with HAS_BIAS
    OUT,  # [M, N] dtype contiguous (N = N_W, or N_W / 2 with SILU_MUL); ROPE: q [M, H, HD]
    PARTIAL,  # [P, 1 + SILU_MUL, M, N] float32 subtree sums; used only with P > 1
    COUNTER,  # [>= tiles] int32, zero between calls; used only with P > 1
    POS, SLOT,  # ROPE: [M] int positions (clamped into [0, T - 1]) and cache slots
    COS, SIN,  # ROPE: [T, HD] dtype contiguous
    KVC,  # ROPE: [2, S, T, KV_HEADS, HD] dtype (strides s_kv, s_s, s_t, s_h, 1)
    M, N, K, sx, sw, s_kv, s_s, s_t, s_h, T,
    part_k,  # K / S: columns of one part
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PARTS: tl.constexpr,  # parts per program (S / P)
    P: tl.constexpr,  # programs per tile
    HAS_BIAS: tl.constexpr, SILU_MUL: tl.constexpr,
    ROPE: tl.constexpr,  # W is q/k/v in pair_rotary_rows' order: rotary + cache write
    H: tl.constexpr, KV_HEADS: tl.constexpr, HD: tl.constexpr,  # ROPE's heads
    PRECISION: tl.constexpr, INTERPRETED: tl.constexpr,
    PDL: tl.constexpr,  # dependent launch (dependent_launch.py)
    LINE: tl.constexpr,  # weight elements per 128-byte line
    LINES: tl.constexpr,  # lines of each part's weight rows to prefetch before the wait
):  # fmt: skip
    pid = tl.program_id(0)
    q = tl.program_id(1)
    tiles_m = tl.cdiv(M, BLOCK_M)
    # the programs of one column tile run side by side: its weights are read once from HBM
    pid_m, pid_n = pid % tiles_m, pid // tiles_m
    rm = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    rn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    rk = tl.arange(0, BLOCK_K)
    mmask, nmask = rm < M, rn < N
    x_ptr = X + rm[:, None] * sx + rk[None, :]  # [BLOCK_M, BLOCK_K]
    w_ptr = W + rn[:, None] * sw + rk[None, :]  # [BLOCK_N, BLOCK_K]
    up_ptr = w_ptr + N * sw
    if PDL and LINES > 0:  # weights are never written by a step: read ahead of the wait
        for j in tl.static_range(PARTS):
            k_lo = (q * PARTS + j) * part_k
            prefetch_rows(W, rn, nmask, sw, k_lo, part_k, LINE, LINES)
            if SILU_MUL:
                prefetch_rows(W, rn + N, nmask, sw, k_lo, part_k, LINE, LINES)
    dependent_start(PDL)
    z = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc, s0, s1, s2, s3 = z, z, z, z, z
    up, u0, u1, u2, u3 = z, z, z, z, z
    for j in tl.static_range(PARTS):
        k_lo = (q * PARTS + j) * part_k
        acc = _part_dot(x_ptr, w_ptr, k_lo, part_k, K, mmask, nmask, rk,
                        BLOCK_M, BLOCK_N, BLOCK_K, PRECISION, INTERPRETED)  # fmt: skip
        acc, s0, s1, s2, s3 = _tree_push(j, acc, s0, s1, s2, s3)
        if SILU_MUL:
            up = _part_dot(x_ptr, up_ptr, k_lo, part_k, K, mmask, nmask, rk,
                           BLOCK_M, BLOCK_N, BLOCK_K, PRECISION, INTERPRETED)  # fmt: skip
            up, u0, u1, u2, u3 = _tree_push(j, up, u0, u1, u2, u3)
    _store_tile(acc, up, BIAS, OUT, PARTIAL, COUNTER, pid, q, rm, rn, mmask, nmask, M, N,
                P, HAS_BIAS, SILU_MUL, ROPE, POS, SLOT, COS, SIN, KVC, s_kv, s_s, s_t, s_h,
                T, H, KV_HEADS, HD)  # fmt: skip


@triton.jit
def _store_tile(acc, up, BIAS, OUT, PARTIAL, COUNTER, pid, q, rm, rn, mmask, nmask, M, N,
                P: tl.constexpr, HAS_BIAS: tl.constexpr, SILU_MUL: tl.constexpr,
                ROPE: tl.constexpr, POS, SLOT, COS, SIN, KVC, s_kv, s_s, s_t, s_h, T,
                H: tl.constexpr, KV_HEADS: tl.constexpr, HD: tl.constexpr):  # fmt: skip
    """Program q's subtree sum (acc; up with SILU_MUL) of tile `pid`: the epilogue if it is
    the tile's only program, else stored to PARTIAL, and the tile's last program to
    arrive adds the P subtree sums in the tree and runs the epilogue."""
    if P == 1:
        _finish(acc, up, BIAS, OUT, rm, rn, mmask, nmask, N, HAS_BIAS, SILU_MUL, ROPE, POS,
                SLOT, COS, SIN, KVC, s_kv, s_s, s_t, s_h, T, H, KV_HEADS, HD)  # fmt: skip
    else:
        G: tl.constexpr = 2 if SILU_MUL else 1
        tile_mask = mmask[:, None] & nmask[None, :]
        offs = rm[:, None] * N + rn[None, :]  # [BLOCK_M, BLOCK_N] within one [M, N] slab
        slab = M * N
        tl.store(PARTIAL + (q * G) * slab + offs, acc, mask=tile_mask)
        if SILU_MUL:
            tl.store(PARTIAL + (q * G + 1) * slab + offs, up, mask=tile_mask)
        tl.debug_barrier()  # the partial stores are ordered before the counter's release
        arrived = tl.atomic_add(COUNTER + pid, 1, sem="acq_rel")
        if arrived == P - 1:  # the tile's last program: every subtree sum is written
            s0, s1, s2, s3 = acc, acc, acc, acc  # pending sums: each written before read
            u0, u1, u2, u3 = up, up, up, up
            for j in tl.static_range(P):
                t = tl.load(PARTIAL + (j * G) * slab + offs, mask=tile_mask, other=0.0,
                            cache_modifier=".cg")  # fmt: skip
                acc, s0, s1, s2, s3 = _tree_push(j, t, s0, s1, s2, s3)
                if SILU_MUL:
                    t = tl.load(PARTIAL + (j * G + 1) * slab + offs, mask=tile_mask, other=0.0,
                                cache_modifier=".cg")  # fmt: skip
                    up, u0, u1, u2, u3 = _tree_push(j, t, u0, u1, u2, u3)
            _finish(acc, up, BIAS, OUT, rm, rn, mmask, nmask, N, HAS_BIAS, SILU_MUL, ROPE, POS,
                    SLOT, COS, SIN, KVC, s_kv, s_s, s_t, s_h, T, H, KV_HEADS, HD)  # fmt: skip
            tl.store(COUNTER + pid, 0)


def launch_shape(M: int, N: int, block_m: int, block_n: int, split: int,
                 min_programs: int, max_tiles: int) -> tuple[int, int]:  # fmt: skip
    """(tiles, P): the grid of a call. P, the programs per tile, doubles (up to the
    split) while the grid has fewer than `min_programs` programs; a launch choice only
    (the bits do not depend on it)."""
    tiles = triton.cdiv(M, block_m) * triton.cdiv(N, block_n)
    p = 1
    while p < split and tiles * p < min_programs and tiles <= max_tiles:
        p *= 2
    return tiles, p
