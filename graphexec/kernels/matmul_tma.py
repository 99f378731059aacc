"""The invariant GEMM's large-M kernel on Hopper: operands through the tensor memory
accelerator (TMA), the same parts, K order and tree as `matmul_kernel._linear_kernel`.

    _linear_tma_kernel  grid (cdiv(M, BLOCK_M) * cdiv(N, BLOCK_N), P): as _linear_kernel,
        but x and w tiles are loaded by tensor descriptors (one TMA copy per operand and
        K step, into shared memory, pipelined by the compiler; rows past M come back
        zero), and with SILU_MUL the gate and up products share each loaded x tile.

A part is K / S columns summed from a zero float32 accumulator in steps of BLOCK_K; the
steps never cross a part's end (the launcher requires BLOCK_K to divide K / S), so no K
mask is needed and a part's sum is the same sequence of MMAs as in the pointer kernel.
Whether the two kernels give the same bits on a device is still checked there, at bind
(`matmul.verify_large_tiles`): a shape that differs keeps its decode tile.
"""

from __future__ import annotations

import torch

from graphexec.kernels.dependent_launch import dependent_start
from graphexec.kernels.matmul_kernel import _store_tile, _tree_push
from graphexec.runtime.triton_import import tl, triton

try:  # Triton >= 3.4 on the host side
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover
    TensorDescriptor = None


@triton.jit(do_not_specialize=["M"])
def _linear_tma_kernel(
    X_DESC,  # descriptor of x [M, K] dtype, block [BLOCK_M, BLOCK_K]
    W_DESC,  # descriptor of w [N_W, K] dtype, block [BLOCK_N, BLOCK_K]; SILU_MUL: gate, up
    BIAS,  # [N_W] dtype; read only with HAS_BIAS
    OUT,  # [M, N] dtype contiguous
    PARTIAL,  # [P, 1 + SILU_MUL, M, N] float32 subtree sums; used only with P > 1
    COUNTER,  # [>= tiles] int32, zero between calls; used only with P > 1
    M, N, part_k,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PARTS: tl.constexpr, P: tl.constexpr,
    HAS_BIAS: tl.constexpr, SILU_MUL: tl.constexpr, PDL: tl.constexpr,
    PRECISION: tl.constexpr,
    WS: tl.constexpr,  # warp specialisation of the K loop (producer warps for the TMA loads)
):  # fmt: skip
    pid = tl.program_id(0)
    q = tl.program_id(1)
    tiles_m = tl.cdiv(M, BLOCK_M)
    pid_m, pid_n = pid % tiles_m, pid // tiles_m  # a column tile's programs side by side
    off_m, off_n = pid_m * BLOCK_M, pid_n * BLOCK_N
    rm = (off_m + tl.arange(0, BLOCK_M)).to(tl.int64)
    rn = (off_n + tl.arange(0, BLOCK_N)).to(tl.int64)
    dependent_start(PDL)
    z = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc, s0, s1, s2, s3 = z, z, z, z, z
    up, u0, u1, u2, u3 = z, z, z, z, z
    for j in tl.static_range(PARTS):
        k_lo = (q * PARTS + j) * part_k
        part = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        part_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in tl.range(0, part_k, BLOCK_K, warp_specialize=WS):  # one order at any M, P
            x = X_DESC.load([off_m, k_lo + k0])
            part = tl.dot(x, W_DESC.load([off_n, k_lo + k0]).T, part, input_precision=PRECISION)
            if SILU_MUL:
                w_up = W_DESC.load([N + off_n, k_lo + k0])
                part_up = tl.dot(x, w_up.T, part_up, input_precision=PRECISION)
        acc, s0, s1, s2, s3 = _tree_push(j, part, s0, s1, s2, s3)
        if SILU_MUL:
            up, u0, u1, u2, u3 = _tree_push(j, part_up, u0, u1, u2, u3)
    _store_tile(acc, up, BIAS, OUT, PARTIAL, COUNTER, pid, q, rm, rn, rm < M, rn < N, M, N,
                P, HAS_BIAS, SILU_MUL, False, OUT, OUT, OUT, OUT, OUT, 0, 0, 0, 0, 1, 1, 1,
                2)  # fmt: skip  (no rotary epilogue: `matmul.linear_rope` rotates after)


def usable(x, w, block_m: int, block_n: int, block_k: int, split: int) -> bool:
    """Whether a call can take the TMA kernel: Triton has host descriptors, the operands
    are 16-byte aligned with 16-byte row strides, and BLOCK_K divides a part."""
    K, es = x.shape[1], x.element_size()
    return (TensorDescriptor is not None and x.device.type == "cuda"
            and (K // split) % block_k == 0
            and x.data_ptr() % 16 == 0 and w.data_ptr() % 16 == 0
            and (x.stride(0) * es) % 16 == 0 and (w.stride(0) * es) % 16 == 0)  # fmt: skip


def launch(x, w, bias, out, partial, counter, tiles: int, P: int, part_k: int, tile,
           silu_mul: bool, pdl: bool, options: dict) -> None:  # fmt: skip
    """One launch of `_linear_tma_kernel` for `tile` (a MatmulTile) with P programs per
    output tile; descriptors made here (a captured call keeps its own)."""
    M, K = x.shape
    x_desc = TensorDescriptor(x, [M, K], [x.stride(0), 1], [tile.block_m, tile.block_k])
    w_desc = TensorDescriptor(w, list(w.shape), [w.stride(0), 1], [tile.block_n, tile.block_k])
    _linear_tma_kernel[(tiles, P)](
        x_desc, w_desc, x if bias is None else bias, out, partial, counter,
        M, out.shape[1], part_k,
        BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
        PARTS=tile.split // P, P=P, HAS_BIAS=bias is not None, SILU_MUL=silu_mul, PDL=pdl,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32", WS=tile.ws,
        num_warps=tile.num_warps, num_stages=tile.num_stages, **options,
    )  # fmt: skip
