"""The residual add + RMS norm of a decoder layer, with a mean square exact in any order.

    _residual_rms_norm_kernel  grid (N,): new_residual = x + residual (rounded to the
        dtype), then weight * rms_norm(new_residual): one program per row.

A row's bits must not depend on the warp count or the layout of the threads that hold
it (a config's choice), and a float sum of squares does: its order follows that layout.
So the sum of squares is exact: every square v_i^2 (float32) becomes an integer multiple
of 2^(E - 173), E the largest exponent among the row's squares (its 24-bit significand
shifted left 23, then right by its exponent's distance below E: a truncation that
depends on v_i and E alone), and the int64 sum of those is the same in any order. mean =
float32(float64(sum) * 2^(E - 173) / D) and 1 / rms = rsqrt(mean + eps) in float32; a
row with an inf or NaN square gets that value as its mean. The sum keeps 47 bits below
the largest square, so it is closer to the true sum than a float32 sum;
`mean_square_reference` is the same computation in torch, bit for bit. (A norm inside
the GEMM before or after it, sharing these bits, measured slower on an H200 than this
kernel under dependent launch: the next GEMM prefetches its weights while it runs.)

Rounding as torch's ops do (`fused`): the add rounded to the dtype, v * rstd rounded,
then weight * that rounded. rsqrt is the device's float32 function: the result may
differ from torch's (`residual_rms_norm_reference`, transformers' order) by one unit in
the dtype's last place.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from graphexec.kernels.dependent_launch import dependent_start, kernel_options
from graphexec.kernels.fused import DEFAULT, FusedConfig, _rounded
from graphexec.runtime.triton_import import tl, triton

MAX_D = 1 << 16  # the int64 sum holds this many squares of 47 bits


@triton.jit
def _square_bits(v):
    """The bits of v * v with the sign cleared: as integers in the order of the floats
    (NaN above inf above every finite square)."""
    return (v * v).to(tl.int32, bitcast=True) & 0x7FFFFFFF


@triton.jit
def _fixed_squares(b, E):
    """Squares (bits b) as int64 multiples of 2^(E - 173), E >= 1 the row's largest
    biased exponent: exact integers, truncated by their value and E alone."""
    e = b >> 23
    f = (b & 0x7FFFFF) | tl.where(e > 0, 0x800000, 0)
    shift = tl.minimum(E - tl.maximum(e, 1), 63)
    return (f.to(tl.int64) << 23) >> shift.to(tl.int64)


@triton.jit
def _rstd(total, top, D, eps):
    """1 / rms from the int64 sum `total` of `_fixed_squares` and the row's largest square
    bits `top`."""
    E = tl.maximum(top >> 23, 1)
    unit = ((E - 173 + 1023).to(tl.int64) << 52).to(tl.float64, bitcast=True)  # 2^(E-173)
    mean = (total.to(tl.float64) * unit / D).to(tl.float32)
    mean = tl.where(top >= 0x7F800000, top.to(tl.float32, bitcast=True), mean)
    return tl.rsqrt(mean + eps)


@triton.jit
def _residual_rms_norm_kernel(
    X,  # [N, D] dtype (row stride sx, last dim contiguous)
    RES,  # [N, D] dtype (row stride sr); read only with HAS_RES
    W,  # [D] dtype
    OUT,  # [N, D] dtype contiguous: the normed rows
    RES_OUT,  # [N, D] dtype contiguous: x + residual; written only with HAS_RES
    sx, sr, D, eps,
    BLOCK_D: tl.constexpr, HAS_RES: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    mask = d < D
    dt = OUT.dtype.element_ty
    w = tl.load(W + d, mask=mask, other=0.0).to(tl.float32)  # never written by a step
    dependent_start(PDL)
    v = tl.load(X + row * sx + d, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:  # the add in float32, rounded to the dtype (torch's x + residual)
        v = _rounded(tl.load(RES + row * sr + d, mask=mask, other=0.0).to(tl.float32) + v, dt)
        tl.store(RES_OUT + row * D + d, v.to(dt), mask=mask)
    b = _square_bits(v)
    top = tl.max(b, 0)
    rstd = _rstd(tl.sum(_fixed_squares(b, tl.maximum(top >> 23, 1)), 0), top, D, eps)
    n = _rounded(v * rstd, dt)  # normalised in float32, cast back, then * weight
    tl.store(OUT + row * D + d, _rounded(w * n, dt).to(dt), mask=mask)


def _norm_args(x, residual, weight) -> None:
    if x.dim() != 2 or weight.shape != (x.shape[1],):
        raise ValueError(f"residual_rms_norm takes x [N, D] and weight [D], got "
                         f"{list(x.shape)} and {list(weight.shape)}")  # fmt: skip
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"residual {list(residual.shape)} must match x {list(x.shape)}")
    if weight.dtype != x.dtype or (residual is not None and residual.dtype != x.dtype):
        raise ValueError("x, residual and weight must have one dtype")
    if x.shape[1] > MAX_D:
        raise ValueError(f"residual_rms_norm takes rows of at most {MAX_D} values, got "
                         f"{x.shape[1]}")  # fmt: skip


def residual_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    *,
    config: FusedConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(normed, new_residual): new_residual = residual + x in x's dtype (x itself when
    residual is None), normed = weight * rms_norm(new_residual.float()).to(dtype), each
    [N, D]. One program per row, the mean square exact (module docstring) (Triton)."""
    _norm_args(x, residual, weight)
    cfg = config or DEFAULT
    N, D = x.shape
    out = torch.empty((N, D), dtype=x.dtype, device=x.device)
    new = x if residual is None else torch.empty_like(out)
    if N == 0:
        return out, new
    if x.stride(1) != 1 or (residual is not None and residual.stride(1) != 1):
        raise ValueError("residual_rms_norm needs x and residual contiguous in their last dim")
    res = x if residual is None else residual
    block = triton.next_power_of_2(D)
    _residual_rms_norm_kernel[(N,)](
        x, res, weight.contiguous(), out, new, x.stride(0), res.stride(0), D, float(eps),
        BLOCK_D=block, HAS_RES=residual is not None,
        num_warps=cfg.norm_warps_for(block), **kernel_options(cfg.pdl, x.device),
    )  # fmt: skip
    return out, new


def mean_square_reference(v: torch.Tensor) -> torch.Tensor:
    """The kernels' mean square of each row of v [N, D] (float32 values), float32 [N, 1]:
    the exact sum of the module docstring, in torch, bit for bit."""
    b = (v.float() * v.float()).view(torch.int32) & 0x7FFFFFFF
    top = b.amax(dim=1, keepdim=True)
    E = (top >> 23).clamp(min=1)
    e = b >> 23
    f = ((b & 0x7FFFFF) | torch.where(e > 0, 0x800000, 0)).long()
    total = ((f << 23) >> (E - e.clamp(min=1)).clamp(max=63).long()).sum(1, keepdim=True)
    unit = ((E.long() - 173 + 1023) << 52).view(torch.float64)
    mean = (total.double() * unit / v.shape[1]).float()
    return torch.where(top >= 0x7F800000, top.view(torch.float32), mean)


def residual_rms_norm_reference(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    *,
    config: FusedConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`residual_rms_norm` in torch, as transformers computes it (`config` unused)."""
    _norm_args(x, residual, weight)
    new = x if residual is None else residual + x
    normed = F.rms_norm(new.float(), (x.shape[1],), eps=eps).to(x.dtype)
    return weight * normed, new
