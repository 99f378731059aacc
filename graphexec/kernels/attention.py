"""Decode attention over a slot-indexed KV cache that reads only each row's live keys.

One query token per row attends over keys 0..pos of its slot's cache row (or, with a
sliding window w, over pos - w < j <= pos). The cache row is [T] long, but a row reads
only its live keys: a split-KV ("flash-decoding") kernel whose programs cover fixed key
ranges, each loading only the part of its range that is live, the last of a row's splits
to finish merging the partial softmaxes. `decode_attention_reference` is the same
computation in torch (SDPA with a mask over the whole row), the tests' definition. The
CPU route of the models is `cpu_attention.KeyBlockAttention.attend` (torch over the live
key blocks only).

Kernels (grids are fixed by shapes alone):

    _decode_attention_kernel  grid (B, KV, NUM_SPLITS): the G = H / KV query heads of one
        KV head against split s, keys [s * SPLIT, (s + 1) * SPLIT) clipped to the row's
        live range; fp32 online softmax over BLOCK_N-key tiles; writes (m, l, acc).
        A split that holds no live key loads nothing and writes m = -inf, l = 0 (no acc).
        The last split of a (row, KV head) to finish (a counter per pair, reset by it)
        merges the pair's splits in split order and writes the output: one launch. With
        one split the program writes its own normalised output.
Which program arrives last decides only who merges, never the order of the merge.

Why results do not depend on the batch: a program's work and its reduction order are
functions of its own row (position, window, slot's keys) and of T and the config, never
of B or of the other rows, so a row's output is the same bits in any batch, bucket or
replay. NUM_SPLITS depends on T only (`AttentionConfig.splits`), not on B.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from graphexec.kernels.dependent_launch import dependent_start, enabled, launch_options
from graphexec.runtime.triton_env import interpreter_enabled
from graphexec.runtime.triton_import import tl, triton


@dataclass(frozen=True)
class AttentionConfig:
    """How the decode-attention kernel cuts its work; no setting changes what it computes
    beyond rounding (the split boundaries order the fp32 sums).

    block_n: keys per tile of the inner loop (a power of two, >= 16: `tl.dot`'s minimum).
    split_size: keys per split (a multiple of block_n); T / split_size programs per
        (row, KV head), at most max_splits (split_size grows for longer T).
    max_splits: most splits of a row (the merge holds them in one tile).
    num_warps, num_stages: of the split kernel.
    pdl: programmatic dependent launch where the device has it (`dependent_launch`).
    """

    block_n: int = 64
    split_size: int = 256
    max_splits: int = 64
    num_warps: int = 4
    num_stages: int = 2
    pdl: bool = True

    def __post_init__(self) -> None:
        if self.block_n < 16 or self.block_n & (self.block_n - 1):
            raise ValueError(f"AttentionConfig.block_n must be a power of two >= 16, got "
                             f"{self.block_n}")  # fmt: skip
        if self.split_size < self.block_n or self.split_size % self.block_n:
            raise ValueError(f"AttentionConfig.split_size ({self.split_size}) must be a "
                             f"positive multiple of block_n ({self.block_n})")  # fmt: skip
        for name in ("max_splits", "num_warps", "num_stages"):
            if getattr(self, name) < 1:
                raise ValueError(f"AttentionConfig.{name} must be positive")

    @classmethod
    def gpu(cls) -> AttentionConfig:
        return cls()

    @classmethod
    def interpreter(cls) -> AttentionConfig:
        """Small tiles: the CPU interpreter pays per element and per program."""
        return cls(block_n=16, split_size=32, max_splits=64, num_warps=1, num_stages=1)

    @classmethod
    def default(cls) -> AttentionConfig:
        return cls.interpreter() if interpreter_enabled() else cls.gpu()

    def replace(self, **kw) -> AttentionConfig:
        return dataclasses.replace(self, **kw)

    def splits(self, T: int) -> tuple[int, int]:
        """(keys per split, number of splits) for cache rows of T keys: shapes only."""
        per = triton.cdiv(triton.cdiv(T, self.max_splits), self.block_n) * self.block_n
        split = max(self.split_size, per)
        return split, triton.cdiv(T, split)


@triton.jit
def _decode_attention_kernel(
    Q,  # [B, H, HD] q dtype (strides sq_b, sq_h, 1)
    KV,  # [2, S, T, KV_HEADS, HD] q dtype (strides s_kv, s_s, s_t, s_h, 1)
    SLOT,  # [B] int: each row's slot
    POS,  # [B] int: each row's query position (clamped into [0, T - 1] here)
    STATS,  # f32 [2, B, H, NS]: m (running max) then l (sum of exp), per split
    ACC,  # f32 [B, H, NS, HD]: unnormalised output per split (live splits only)
    OUT,  # [B, H, HD] q dtype (strides so_b, so_h, 1)
    COUNTER,  # i32 [>= B * KV_HEADS], zero between calls; used with NS > 1
    sq_b, sq_h, s_kv, s_s, s_t, s_h, so_b, so_h,
    B, T, H, NS, KV_HEADS, scale, window,
    G: tl.constexpr, G_PAD: tl.constexpr, HD: tl.constexpr, HD_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, HAS_WINDOW: tl.constexpr,
    PRECISION: tl.constexpr, F32_DOT: tl.constexpr, PDL: tl.constexpr,
    DIRECT: tl.constexpr,  # one split: it writes the output itself
    NS_PAD: tl.constexpr,
):  # fmt: skip
    dependent_start(PDL)
    b = tl.program_id(0)
    kh = tl.program_id(1)
    sp = tl.program_id(2)
    pos = tl.minimum(tl.maximum(tl.load(POS + b).to(tl.int32), 0), T - 1)
    slot = tl.load(SLOT + b).to(tl.int64)
    lo = sp * SPLIT
    if HAS_WINDOW:
        lo = tl.maximum(lo, pos - window + 1)
    hi = tl.minimum(sp * SPLIT + SPLIT, pos + 1)

    g = tl.arange(0, G_PAD)
    d = tl.arange(0, HD_PAD)
    heads = kh * G + g  # [G_PAD]
    gmask, dmask = g < G, d < HD
    q = tl.load(Q + b * sq_b + heads[:, None] * sq_h + d[None, :],
                mask=gmask[:, None] & dmask[None, :], other=0.0)  # fmt: skip
    if F32_DOT:  # the interpreter multiplies bf16 as raw bits: exact fp32 products instead
        q = q.to(tl.float32)
    k_base = KV + slot * s_s + kh * s_h  # this row's slot, this KV head: keys
    v_base = k_base + s_kv  # and values
    m = tl.full([G_PAD], float("-inf"), dtype=tl.float32)
    denom = tl.zeros([G_PAD], dtype=tl.float32)
    acc = tl.zeros([G_PAD, HD_PAD], dtype=tl.float32)
    for start in range(lo, hi, BLOCK_N):  # no iteration where the split holds no live key
        n = start + tl.arange(0, BLOCK_N)  # [BLOCK_N] key positions
        nmask = n < hi
        kv_off = n[:, None] * s_t + d[None, :]
        kv_mask = nmask[:, None] & dmask[None, :]
        k = tl.load(k_base + kv_off, mask=kv_mask, other=0.0)  # [BLOCK_N, HD_PAD]
        if F32_DOT:
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [G_PAD, BLOCK_N]
        s = tl.where(nmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        denom = denom * alpha + tl.sum(p, 1)
        v = tl.load(v_base + kv_off, mask=kv_mask, other=0.0)  # [BLOCK_N, HD_PAD]
        p = p.to(v.dtype)  # as flash attention: p rounded to the cache dtype for the dot
        if F32_DOT:
            p, v = p.to(tl.float32), v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
        m = m_new

    row = b * H + heads  # [G_PAD] rows of [B, H]
    gd_mask = gmask[:, None] & dmask[None, :]
    out_ptr = OUT + b * so_b + heads[:, None] * so_h + d[None, :]
    if DIRECT:  # one split: its softmax is the row's (the merge's weight would be 1)
        tl.store(out_ptr, (acc / denom[:, None]).to(OUT.dtype.element_ty), mask=gd_mask)
    else:
        tl.store(STATS + row * NS + sp, m, mask=gmask)
        tl.store(STATS + (B * H + row) * NS + sp, denom, mask=gmask)
        if lo < hi:  # the merge reads acc of live splits only
            acc_ptr = ACC + (row[:, None] * NS + sp) * HD + d[None, :]
            tl.store(acc_ptr, acc, mask=gd_mask)
        tl.debug_barrier()  # the stores are ordered before the counter's release
        arrived = tl.atomic_add(COUNTER + b * KV_HEADS + kh, 1, sem="acq_rel")
        if arrived == NS - 1:  # every split of this row and KV head is written: merge
            _merge(STATS, ACC, out_ptr, row, gmask, d, dmask, B, H, NS, HD, NS_PAD)
            tl.store(COUNTER + b * KV_HEADS + kh, 0)


@triton.jit
def _merge(STATS, ACC, out_ptr, row, gmask, d, dmask, B, H, NS,
           HD: tl.constexpr, NS_PAD: tl.constexpr):  # fmt: skip
    """The live splits of rows `row` [R] (heads of [B, H]) merged in one [R, NS_PAD, HD]
    tile, in split order, stored through out_ptr [R, HD_PAD]."""
    s = tl.arange(0, NS_PAD)
    smask = gmask[:, None] & (s[None, :] < NS)
    m = tl.load(STATS + row[:, None] * NS + s[None, :], mask=smask, other=float("-inf"),
                cache_modifier=".cg")  # fmt: skip
    denom = tl.load(STATS + (B * H + row[:, None]) * NS + s[None, :], mask=smask, other=0.0,
                    cache_modifier=".cg")  # fmt: skip
    live = m != float("-inf")  # the row's position is live, so one split at least is
    m_all = tl.max(m, 1)
    w = tl.where(live, tl.exp(m - m_all[:, None]), 0.0)  # [R, NS_PAD]
    acc = tl.load(ACC + (row[:, None, None] * NS + s[None, :, None]) * HD + d[None, None, :],
                  mask=live[:, :, None] & dmask[None, None, :], other=0.0,
                  cache_modifier=".cg")  # fmt: skip
    out = tl.sum(w[:, :, None] * acc, 1) / tl.sum(w * denom, 1)[:, None]
    tl.store(out_ptr, out.to(out_ptr.dtype.element_ty), mask=gmask[:, None] & dmask[None, :])


MAX_COUNTERS = 1 << 20  # (row, KV head) pairs a call may hold (4 MiB of counters)


def _counters(device: torch.device) -> torch.Tensor:
    """The persistent per-(row, KV head) counters of `device` (zero between calls: the
    last split of each pair resets its own), made once, before a capture uses them."""
    key = (device.type, device.index)
    if key not in _COUNTER_BUFFERS:
        _COUNTER_BUFFERS[key] = torch.zeros(MAX_COUNTERS, dtype=torch.int32, device=device)
    return _COUNTER_BUFFERS[key]


_COUNTER_BUFFERS: dict[tuple[str, int | None], torch.Tensor] = {}


def _check(q: torch.Tensor, kv: torch.Tensor, slot_ids, positions, window) -> None:
    if q.dim() != 3 or kv.dim() != 5 or kv.shape[0] != 2:
        raise ValueError(f"decode_attention takes q [B, H, hd] and kv [2, S, T, KV, hd], got "
                         f"{list(q.shape)} and {list(kv.shape)}")  # fmt: skip
    (B, H, hd), KV = q.shape, kv.shape[3]
    if kv.shape[4] != hd or H % KV:
        raise ValueError(f"q {list(q.shape)} does not fit kv {list(kv.shape)}: head_dim must "
                         "match and H must be a multiple of the KV heads")  # fmt: skip
    if q.dtype != kv.dtype:
        raise ValueError(f"q ({q.dtype}) and kv ({kv.dtype}) must have one dtype")
    if tuple(slot_ids.shape) != (B,) or tuple(positions.shape) != (B,):
        raise ValueError(f"slot_ids and positions must be [{B}], got {list(slot_ids.shape)} "
                         f"and {list(positions.shape)}")  # fmt: skip
    if window is not None and window < 1:
        raise ValueError(f"window must be None or >= 1, got {window}")


def decode_attention(
    q: torch.Tensor,
    kv: torch.Tensor,
    slot_ids: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
    window: int | None = None,
    *,
    config: AttentionConfig | None = None,
) -> torch.Tensor:
    """Attention of one query token per row over its slot's live keys (Triton).

    Parameters
    ----------
    q : torch.Tensor
        ``[B, H, head_dim]`` queries (float32 / bfloat16 / float16; last dim contiguous).
    kv : torch.Tensor
        ``[2, num_slots, T, KV, head_dim]``, one layer's cache, same dtype as ``q``:
        keys at ``kv[0]``, values at ``kv[1]``; last dim contiguous. ``H % KV == 0``
        (grouped-query attention: query head h reads KV head ``h // (H / KV)``).
    slot_ids : torch.Tensor
        ``[B]`` int64: the cache row of each query (in ``[0, num_slots)``; rows may share
        a slot).
    positions : torch.Tensor
        ``[B]`` int64: each query's position; keys ``0..pos`` are live (the caller has
        written key ``pos``). Clamped into ``[0, T - 1]``, so a bad position never indexes
        outside the cache.
    scale : float
        Softmax scale (``head_dim ** -0.5`` for Llama-family models).
    window : int or None
        Sliding window: key ``j`` is visible to the query at ``p`` iff
        ``p - window < j <= p``. None: every key up to ``p``.
    config : AttentionConfig, optional
        Tile and split sizes; None = ``AttentionConfig.default()``.

    Returns
    -------
    torch.Tensor
        ``[B, H, head_dim]`` in ``q``'s dtype. Scores, softmax and accumulation are in
        float32; the probabilities are rounded to the cache dtype for the product with V
        (as flash attention does).

    Example
    -------
    >>> kv = torch.randn(2, 8, 4096, 2, 64, dtype=torch.bfloat16, device="cuda")
    >>> q = torch.randn(32, 14, 64, dtype=torch.bfloat16, device="cuda")
    >>> slots = torch.arange(32, device="cuda") % 8
    >>> pos = torch.randint(0, 4096, (32,), device="cuda")
    >>> out = decode_attention(q, kv, slots, pos, 64 ** -0.5)  # [32, 14, 64] bf16

    Note
    ----
    CUDA graphs: one kernel launch with a grid and scratch sizes that depend on shapes
    only (scratch comes from the caching allocator, the graph's pool when captured;
    per-device counters are made at the first call, before any capture uses them); no
    host sync and no branch on tensor values, so a captured call replays with new
    positions and slots. A row reads its live keys (in ``block_n`` tiles per split), not
    the whole row of ``T``: keys past its position (or before its window) are never
    loaded, so stale or NaN cache entries there cannot reach its output. Programs whose
    split holds no live key only write two scalars per head.

    Route: this Triton kernel runs on CUDA (and on the CPU under ``TRITON_INTERPRET=1``,
    for tests). `HFTransformer` and `TinyLM` call it on CUDA and
    `cpu_attention.KeyBlockAttention.attend` (torch over the live key blocks, the same
    signature) on the CPU; both agree with `decode_attention_reference` to rounding. A row's output
    is bitwise the same in any batch: no program's work depends on the other rows or B.
    """
    _check(q, kv, slot_ids, positions, window)
    cfg = config or AttentionConfig.default()
    B, H, hd = q.shape
    T, KV = kv.shape[2], kv.shape[3]
    split, ns = cfg.splits(T)
    out = torch.empty((B, H, hd), dtype=q.dtype, device=q.device)
    if B == 0:
        return out
    if q.stride(2) != 1 or kv.stride(4) != 1:
        raise ValueError("decode_attention needs q and kv contiguous in their last dim")
    stats = torch.empty((2, B, H, ns), dtype=torch.float32, device=q.device)
    acc = torch.empty((B, H, ns, hd), dtype=torch.float32, device=q.device)
    G = H // KV
    hd_pad = max(16, triton.next_power_of_2(hd))
    ns_pad = triton.next_power_of_2(ns)
    f32_dot = interpreter_enabled() and q.dtype == torch.bfloat16
    pdl = enabled(cfg.pdl, q.device)
    if B * KV > MAX_COUNTERS:
        raise ValueError(f"decode_attention: {B} rows x {KV} KV heads is more than the "
                         f"{MAX_COUNTERS} counters of one call")  # fmt: skip
    _decode_attention_kernel[(B, KV, ns)](
        q, kv, slot_ids, positions, stats, acc, out, _counters(q.device),
        q.stride(0), q.stride(1), kv.stride(0), kv.stride(1), kv.stride(2), kv.stride(3),
        out.stride(0), out.stride(1), B, T, H, ns, KV, float(scale), int(window or 0),
        G=G, G_PAD=max(16, triton.next_power_of_2(G)), HD=hd, HD_PAD=hd_pad,
        BLOCK_N=cfg.block_n, SPLIT=split, HAS_WINDOW=window is not None,
        PRECISION="ieee" if q.dtype == torch.float32 or f32_dot else "tf32", F32_DOT=f32_dot,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, PDL=pdl, DIRECT=ns == 1,
        NS_PAD=ns_pad, **launch_options(pdl),
    )  # fmt: skip
    return out


def decode_attention_reference(
    q: torch.Tensor,
    kv: torch.Tensor,
    slot_ids: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
    window: int | None = None,
    *,
    config: AttentionConfig | None = None,
) -> torch.Tensor:
    """`decode_attention` in torch (its definition, for tests): SDPA over each row's
    whole cache row [T] with the live keys as the mask. Keys and values outside the mask
    are zeroed first, so stale or NaN entries there cannot reach the output either.
    Static shapes, no host sync. `config` is accepted for the same signature and unused."""
    _check(q, kv, slot_ids, positions, window)
    T = kv.shape[2]
    pos = positions.clamp(0, T - 1)[:, None]  # [B, 1]
    j = torch.arange(T, device=q.device)
    live = j <= pos  # [B, T]
    if window is not None:
        live &= j > pos - window
    keys, vals = kv.index_select(1, slot_ids).unbind(0)  # [B, T, KV, hd]
    zero = torch.zeros((), dtype=kv.dtype, device=kv.device)
    keys = torch.where(live[:, :, None, None], keys, zero).transpose(1, 2)  # [B, KV, T, hd]
    vals = torch.where(live[:, :, None, None], vals, zero).transpose(1, 2)
    out = F.scaled_dot_product_attention(q.unsqueeze(2), keys, vals, attn_mask=live[:, None, None],
                                         scale=scale, enable_gqa=True)  # fmt: skip
    return out.squeeze(2)
