"""Fused elementwise kernels of `HFTransformer.decode`: fewer, larger launches per layer.

A decode step at small batch is bound by kernel launches, not by bytes: the torch path
launches ~35 small kernels a layer for its norms, rotary embeddings, cache writes,
residual adds and SwiGLU. Triton kernels replace them (the residual add + RMS norm in
`rms_norm`):

    _rope_kv_write_kernel      grid (B,): the fused q/k/v projection of one row: rotates
        q and k, writes q to an output buffer and k, v into the cache at (slot, pos).
        (The same rotation runs in the q/k/v GEMM's epilogue: `matmul.linear_rope`.)
    _silu_mul_kernel           grid (N, I / block): silu(gate) * up.

Each has a torch reference with the same signature (`*_reference`): the computation the
torch path does, op for op, and the CPU route. The kernels round as those torch ops do:
low-precision inputs are widened to float32, and each op's result is rounded to the
dtype where torch rounds it (torch computes a bf16 / fp16 elementwise op in float32 and
rounds its result). So the rotary embedding and the cache write are bitwise the
reference's; silu's exp is a float32 function whose last bit may differ from torch's,
so it may differ by one unit in the last place of the dtype where the float32 value
lies near a rounding boundary.

Every launch has a grid and outputs fixed by shapes alone, no host sync and no branch on
tensor values: capturable in a CUDA graph. A row's result depends on that row only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from graphexec.kernels.dependent_launch import dependent_start, kernel_options
from graphexec.runtime.triton_import import tl, triton


@dataclass(frozen=True)
class FusedConfig:
    """Launch settings of the fused kernels; none changes what they compute.

    norm_warps, rope_warps, silu_warps: warps per program of each kernel; norm_warps
        None = by the row's width (4 up to 1,024 values, then one warp per 256 values up
        to 16: wider rows measured faster on an H200 with more warps, narrower alike).
    silu_block: columns of the [N, I] output per silu_mul program (a power of two).
    pdl: launch with programmatic dependent launch where the device has it
        (`dependent_launch`): a kernel is scheduled while its predecessor finishes.
    """

    norm_warps: int | None = None
    rope_warps: int = 4
    silu_warps: int = 4
    silu_block: int = 1024
    pdl: bool = True

    def __post_init__(self) -> None:
        if self.silu_block < 16 or self.silu_block & (self.silu_block - 1):
            raise ValueError(f"FusedConfig.silu_block must be a power of two >= 16, got "
                             f"{self.silu_block}")  # fmt: skip
        for name in ("norm_warps", "rope_warps", "silu_warps"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ValueError(f"FusedConfig.{name} must be positive")

    def norm_warps_for(self, block: int) -> int:
        """The norm's warps for rows padded to `block` values (`norm_warps`)."""
        return self.norm_warps if self.norm_warps is not None else min(16, max(4, block // 256))


DEFAULT = FusedConfig()


@triton.jit
def _rounded(x, DT: tl.constexpr):
    """float32 x rounded to DT (to nearest, ties to even, as torch rounds), as float32.
    bf16 by integer arithmetic: the same bits compiled and under the interpreter (whose
    float32 -> bf16 cast truncates)."""
    if DT == tl.bfloat16:
        b = x.to(tl.uint32, bitcast=True)
        b = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) << 16
        y = tl.where(x != x, x, b.to(tl.float32, bitcast=True))
    else:
        y = x.to(DT).to(tl.float32)
    return y


@triton.jit
def _rope_kv_write_kernel(
    QKV,  # [B, (H + 2 KV) * HD] dtype (row stride s_qkv, last dim contiguous): q | k | v
    POS,  # [B] int: positions, clamped into [0, T - 1] here
    SLOT,  # [B] int: cache rows
    COS,  # [T, HD] dtype contiguous
    SIN,  # [T, HD] dtype contiguous
    KV,  # [2, S, T, KV_HEADS, HD] dtype (strides s_kv, s_s, s_t, s_h, 1)
    Q,  # [B, H, HD] dtype contiguous: the rotated queries
    s_qkv, s_kv, s_s, s_t, s_h, T,
    H: tl.constexpr, KV_HEADS: tl.constexpr, HD: tl.constexpr,
    NH_PAD: tl.constexpr, HD_PAD: tl.constexpr, PDL: tl.constexpr,
    PAIRED: tl.constexpr,  # q and k heads in `pair_rotary_rows`' column order
):  # fmt: skip
    dependent_start(PDL)
    b = tl.program_id(0).to(tl.int64)
    pos = tl.minimum(tl.maximum(tl.load(POS + b).to(tl.int64), 0), T - 1)
    slot = tl.load(SLOT + b).to(tl.int64)
    j = tl.arange(0, NH_PAD)[:, None]  # head of the fused projection: q, then k, then v
    d = tl.arange(0, HD_PAD)[None, :]
    dmask = d < HD
    mask = (j < H + 2 * KV_HEADS) & dmask
    row = QKV + b * s_qkv + j * HD
    dt = Q.dtype.element_ty
    if PAIRED:
        _rope_paired(row, COS, SIN, KV, Q, b, pos, slot, j, d, mask, s_kv, s_s, s_t, s_h, H,
                     KV_HEADS, HD, NH_PAD, HD_PAD, dt)  # fmt: skip
    else:
        lower = d < HD // 2
        partner = tl.where(lower, d + HD // 2, d - HD // 2)  # rotate_half: [-x2, x1]
        x = tl.load(row + d, mask=mask, other=0.0).to(tl.float32)
        xp = tl.load(row + partner, mask=mask, other=0.0).to(tl.float32)
        rot = tl.where(lower, -xp, xp)
        c = tl.load(COS + pos * HD + d, mask=dmask, other=0.0).to(tl.float32)
        s = tl.load(SIN + pos * HD + d, mask=dmask, other=0.0).to(tl.float32)
        # x * cos + rotate_half(x) * sin, each product and the sum rounded as torch does
        y = _rounded(_rounded(x * c, dt) + _rounded(rot * s, dt), dt).to(dt)
        is_v = j >= H + KV_HEADS
        y = tl.where(is_v, x.to(dt), y)  # v is written as it is
        tl.store(Q + (b * H + j) * HD + d, y, mask=mask & (j < H))
        head = tl.where(is_v, j - H - KV_HEADS, j - H).to(tl.int64)
        dst = KV + is_v.to(tl.int64) * s_kv + slot * s_s + pos * s_t + head * s_h + d
        tl.store(dst, y, mask=mask & (j >= H))


@triton.jit
def _rope_paired(row, COS, SIN, KV, Q, b, pos, slot, j, d, mask, s_kv, s_s, s_t, s_h,
                 H: tl.constexpr, KV_HEADS: tl.constexpr, HD: tl.constexpr,
                 NH_PAD: tl.constexpr, HD_PAD: tl.constexpr, dt: tl.constexpr):  # fmt: skip
    """The kernel's row with q and k in `pair_rotary_rows`' order (dim i at column 2 i,
    i + HD / 2 at 2 i + 1): read whole, split into the pairs' halves, rotated as above
    (the same roundings), each half stored contiguously; v stored as read."""
    xr = tl.load(row + d, mask=mask, other=0.0)
    x0, x1 = tl.split(tl.reshape(xr.to(tl.float32), [NH_PAD, HD_PAD // 2, 2]))
    i = tl.arange(0, HD_PAD // 2)[None, :]
    imask = i < HD // 2
    c0 = tl.load(COS + pos * HD + i, mask=imask, other=0.0).to(tl.float32)
    s0 = tl.load(SIN + pos * HD + i, mask=imask, other=0.0).to(tl.float32)
    c1 = tl.load(COS + pos * HD + i + HD // 2, mask=imask, other=0.0).to(tl.float32)
    s1 = tl.load(SIN + pos * HD + i + HD // 2, mask=imask, other=0.0).to(tl.float32)
    y0 = _rounded(_rounded(x0 * c0, dt) + _rounded(-x1 * s0, dt), dt).to(dt)
    y1 = _rounded(_rounded(x1 * c1, dt) + _rounded(x0 * s1, dt), dt).to(dt)
    qk = imask & (j < H + KV_HEADS)
    kdst = KV + slot * s_s + pos * s_t + (j - H).to(tl.int64) * s_h
    dst = tl.where(j < H, Q + (b * H + j) * HD, kdst)  # q rows, then k rows
    tl.store(dst + i, y0, mask=qk)
    tl.store(dst + i + HD // 2, y1, mask=qk)
    vdst = KV + s_kv + slot * s_s + pos * s_t + (j - H - KV_HEADS).to(tl.int64) * s_h + d
    tl.store(vdst, xr, mask=mask & (j >= H + KV_HEADS))


def _rope_args(qkv, positions, slot_ids, cos, sin, kv, heads) -> None:
    if kv.dim() != 5 or kv.shape[0] != 2 or qkv.dim() != 2:
        raise ValueError(f"rope_kv_write takes qkv [B, (H + 2 KV) * hd] and kv [2, S, T, KV, "
                         f"hd], got {list(qkv.shape)} and {list(kv.shape)}")  # fmt: skip
    B, (T, KVH, hd) = qkv.shape[0], kv.shape[2:]
    if qkv.shape[1] != (heads + 2 * KVH) * hd or hd % 2:
        raise ValueError(f"qkv {list(qkv.shape)} does not hold {heads} q and {KVH} k, v heads "
                         f"of even head_dim {hd}")  # fmt: skip
    if cos.shape != (T, hd) or sin.shape != (T, hd):
        raise ValueError(f"cos and sin must be [{T}, {hd}], got {list(cos.shape)}")
    if len({qkv.dtype, cos.dtype, sin.dtype, kv.dtype}) != 1:
        raise ValueError("qkv, cos, sin and kv must have one dtype")
    if tuple(positions.shape) != (B,) or tuple(slot_ids.shape) != (B,):
        raise ValueError(f"positions and slot_ids must be [{B}]")


def rope_kv_write(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    slot_ids: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv: torch.Tensor,
    heads: int,
    *,
    config: FusedConfig | None = None,
    paired: bool = False,
) -> torch.Tensor:
    """Rotary embeddings and the cache write of one decode token per row (Triton).

    qkv [B, (H + 2 KV) * hd]: the fused projection (bias added); positions, slot_ids [B]
    int (positions clamped into [0, T - 1]); cos, sin [T, hd] tables in the dtype; kv
    [2, S, T, KV, hd] one layer's cache. Writes rotated k to kv[0, slot, pos] and v to
    kv[1, slot, pos]; returns rotated q [B, H, hd]. Rows sharing a slot must differ in
    position (two writes to one cache entry race, as with torch's index_put).
    paired: qkv's q and k heads are in `pair_rotary_rows`' column order."""
    _rope_args(qkv, positions, slot_ids, cos, sin, kv, heads)
    cfg = config or DEFAULT
    B, (T, KVH, hd) = qkv.shape[0], kv.shape[2:]
    q = torch.empty((B, heads, hd), dtype=qkv.dtype, device=qkv.device)
    if B == 0:
        return q
    if qkv.stride(1) != 1 or kv.stride(4) != 1 or not (cos.is_contiguous() and sin.is_contiguous()):
        raise ValueError("rope_kv_write needs qkv and kv contiguous in their last dim, cos "
                         "and sin contiguous")  # fmt: skip
    _rope_kv_write_kernel[(B,)](
        qkv, positions, slot_ids, cos, sin, kv, q,
        qkv.stride(0), kv.stride(0), kv.stride(1), kv.stride(2), kv.stride(3), T,
        H=heads, KV_HEADS=KVH, HD=hd, NH_PAD=triton.next_power_of_2(heads + 2 * KVH),
        HD_PAD=triton.next_power_of_2(hd), PAIRED=paired, num_warps=cfg.rope_warps,
        **kernel_options(cfg.pdl, qkv.device),
    )  # fmt: skip
    return q


def pair_rotary_rows(w: torch.Tensor, heads: int, kv_heads: int,
                     inverse: bool = False) -> torch.Tensor:  # fmt: skip
    """The fused q/k/v weight [(H + 2 KV) * hd, K] (or its bias [(H + 2 KV) * hd]) with
    each q and k head's rows reordered so the two dims that rotary embeddings rotate
    together are neighbours: dim i at row 2 i, dim i + hd / 2 at row 2 i + 1; v as it is
    (`inverse`: back to the checkpoint's order). A GEMM tile of an even number of columns
    then holds whole pairs, so the rotation can run in its epilogue
    (`matmul.linear_rope`); every output is the same dot product."""
    n = w.shape[0]
    hd = n // (heads + 2 * kv_heads)
    if hd * (heads + 2 * kv_heads) != n or hd % 2:
        raise ValueError(f"q/k/v rows {n} are not {heads} + 2 x {kv_heads} heads of an even "
                         "head_dim")  # fmt: skip
    rot = (heads + kv_heads) * hd
    half = torch.arange(hd // 2)
    within = torch.stack([half, half + hd // 2], dim=1).reshape(-1)  # 0, h, 1, h + 1, ...
    order = (torch.arange(heads + kv_heads)[:, None] * hd + within).reshape(-1)
    order = torch.cat([order, torch.arange(rot, n)])
    if inverse:
        order = torch.argsort(order)
    return w.index_select(0, order.to(w.device)).contiguous()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, heads, hd] * cos + rotate_half(x) * sin, cos and sin [N, 1, hd]."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def rope_kv_write_reference(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    slot_ids: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv: torch.Tensor,
    heads: int,
    *,
    config: FusedConfig | None = None,
) -> torch.Tensor:
    """`rope_kv_write` in torch (`config` unused): gathers, `rotate`, an index_put."""
    _rope_args(qkv, positions, slot_ids, cos, sin, kv, heads)
    B, (T, KVH, hd) = qkv.shape[0], kv.shape[2:]
    pos = positions.clamp(0, T - 1)
    q, k, v = qkv.split((heads * hd, KVH * hd, KVH * hd), dim=-1)
    c, s = cos[pos].unsqueeze(1), sin[pos].unsqueeze(1)
    q, k = rotate(q.view(B, heads, hd), c, s), rotate(k.view(B, KVH, hd), c, s)
    kv[:, slot_ids, pos] = torch.stack([k, v.reshape(B, KVH, hd)])
    return q


@triton.jit
def _silu_mul_kernel(
    GU,  # [N, 2 I] dtype (row stride s_gu, last dim contiguous): gate | up
    OUT,  # [N, I] dtype contiguous
    s_gu, inter,
    BLOCK: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    dependent_start(PDL)
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = c < inter
    dt = OUT.dtype.element_ty
    g = tl.load(GU + row * s_gu + c, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(GU + row * s_gu + inter + c, mask=mask, other=0.0).to(tl.float32)
    a = _rounded(g / (1.0 + tl.exp(-g)), dt)  # F.silu: float32, then rounded
    tl.store(OUT + row * inter + c, _rounded(a * u, dt).to(dt), mask=mask)


def silu_mul(gate_up: torch.Tensor, *, config: FusedConfig | None = None) -> torch.Tensor:
    """silu(gate) * up of gate_up [N, 2 I] (gate first), [N, I] in its dtype (Triton)."""
    if gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"silu_mul takes gate_up [N, 2 I], got {list(gate_up.shape)}")
    cfg = config or DEFAULT
    N, I2 = gate_up.shape
    out = torch.empty((N, I2 // 2), dtype=gate_up.dtype, device=gate_up.device)
    if N == 0 or I2 == 0:
        return out
    if gate_up.stride(1) != 1:
        raise ValueError("silu_mul needs gate_up contiguous in its last dim")
    block = min(cfg.silu_block, triton.next_power_of_2(I2 // 2))
    _silu_mul_kernel[(N, triton.cdiv(I2 // 2, block))](
        gate_up, out, gate_up.stride(0), I2 // 2, BLOCK=block, num_warps=cfg.silu_warps,
        **kernel_options(cfg.pdl, gate_up.device),
    )  # fmt: skip
    return out


def silu_mul_reference(gate_up: torch.Tensor, *, config: FusedConfig | None = None) -> torch.Tensor:
    """`silu_mul` in torch (`config` unused)."""
    if gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"silu_mul takes gate_up [N, 2 I], got {list(gate_up.shape)}")
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
