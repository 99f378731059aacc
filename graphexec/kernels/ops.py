"""The route map of a model's forward: which kernel runs each op, and why a row's bits
never depend on the batch.

`ForwardOps.select(device, batch_invariant)` binds, once, the functions HFTransformer
and TinyLM call for every op of a forward over N token rows (each row: a token, its
position, its slot):

    op              CUDA, invariant (default)   CUDA, batch_invariant=False   CPU
    linear          matmul.linear (Triton)      cuBLAS (F.linear)             cpu_route.RowMM
    o, down         row_parallel.row_linear_gpu as linear                     RowMM.row_linear
                    (S >= 4 parts, tree shared
                    by tensor-parallel ranks)
    gate/up + SwiGLU matmul.linear_silu_mul     cuBLAS, fused.silu_mul        the two
                                                                              references
    norm (+ add)    rms_norm.residual_rms_norm  same                          cpu_route.residual_
                                                                              rms_norm
    q/k/v + rotary  matmul.linear_rope (the     linear, then                  linear, then
    + cache write   GEMM's epilogue rotates;    fused.rope_kv_write           cpu_route.rope_kv
                    rows paired at bind)                                      (its reference's
                                                                              bits)
    attention       attention.decode_attention  same                          RowMM.attend
    prefill         token rows                  token rows                    token rows
                                                                              (padded SDPA if
                                                                              not invariant)

Why a row's result is the same in any call (invariant routes):
- GEMMs: the split of K, its tree and the K loop's order are functions of the weight's
  shape (N, K) alone (`matmul.MatmulConfig.tile`); a call of 128 rows or more may run a
  larger tile of the same split, only where the device verified it bit-identical at
  bind (`matmul.verify_large_tiles`); on the CPU every row its own GEMV (one batched
  call), or else torch.mm in calls of sizes measured to round every row alike
  (`cpu_route.RowMM`), weights stored K-major.
- Norms, rotary embeddings, cache writes and SwiGLU work on one row at a time (in a
  GEMM's epilogue or a kernel of their own: the same rounding, so the same bits; a
  norm's mean square is exact, so its bits do not depend on its launch either).
- Attention: a row reads keys 0..pos of its own slot (within its window) in splits
  whose size depends on the cache length T alone, combined in one fixed order. On the
  CPU (`cpu_attention.KeyBlockAttention.attend`), rows grouped by slot over fixed blocks
  of 256 keys up to the slot's furthest position (a step's cost follows the live tokens, not T); a
  block past a row's position leaves its sums untouched.
- Decode, verify and prefill are the same forward over token rows. A decode row is one
  token per request; verify is B x (K + 1) rows in one call (row t of a request at
  pos + t); a prefill chunk is one row per prompt token. Each layer writes every row's
  K/V before any row attends, so row t sees rows 0..t of its request through the cache,
  exactly the keys that t + 1 successive decodes would have written: verify's logits
  are bitwise those of K + 1 decodes, and a prompt prefilled in chunks of any budget
  writes the same cache as the whole prompt.

The bits still depend on the device, the dtype, the model's shapes and the config
(tiles, splits), and on the CPU on torch's thread count: all fixed for a process.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F

from graphexec.kernels import attention, cpu_route, fused, matmul, rms_norm, row_parallel


def _linear_then_silu_mul(x: torch.Tensor, w: torch.Tensor, linear: Callable,
                          silu_mul: Callable) -> torch.Tensor:  # fmt: skip
    return silu_mul(linear(x, w))


def _linear_then_rope(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None,
                      positions: torch.Tensor, slots: torch.Tensor, cos: torch.Tensor,
                      sin: torch.Tensor, kv: torch.Tensor, heads: int, *, linear: Callable,
                      rope_kv: Callable) -> torch.Tensor:  # fmt: skip
    return rope_kv(linear(x, w, bias), positions, slots, cos, sin, kv, heads)


def _k_major(w: torch.Tensor) -> torch.Tensor:
    """w [N, K] stored K-major (w.t() contiguous): a row's GEMV x @ w.t() then reads the
    weight row by row (SmolLM2's LM head on a 2-core EPYC: 5.5 ms, 9.6 ms from [N, K]),
    and as a GEMM (where rows cannot run alone, `cpu_route`) it is MKL's no-transpose
    one: faster at 4..64 rows, one bit class from 2 to 256 rows on a Xeon."""
    return w.t().contiguous().t()


def _k_major_f32(w: torch.Tensor) -> torch.Tensor:
    """A row-parallel weight on the CPU: its parts are float32 products (exact upcasts of
    bf16 / fp16), so it is kept in float32 once rather than upcast every call."""
    return _k_major(w.float())


def _row_major(w: torch.Tensor) -> torch.Tensor:
    return w.contiguous()  # (a no-op unless a CPU bind left it K-major)


@dataclass(frozen=True)
class ForwardOps:
    """The functions of one forward route (module docstring). Signatures:

    linear(x [M, K], w [N, K], bias [N] | None) -> [M, N] (column_pieces: also pieces=,
        ranges of w's rows a product each)
    linear_silu_mul(x [M, K], w_gate_up [2 I, K]) -> silu(gate) * up [M, I]
    norm(x [M, D], residual [M, D] | None, weight [D], eps) -> (normed, x + residual)
    rope_kv(qkv [M, (H + 2 KV) hd], positions [M], slots [M], cos, sin, kv, H) -> q
    qkv_rope(x [M, D], w_qkv, bias, positions, slots, cos, sin, kv, H) -> q [M, H, hd]:
        linear then rope_kv (one launch on CUDA, `matmul.linear_rope`, where w_qkv and
        its bias are in `fused.pair_rotary_rows`' order: `paired_qkv`)
    attend(q [M, H, hd], kv, slots [M], positions [M], scale, window, config=) -> [M, H, hd]
    row_split(N, K, world) -> row_parallel.RowSplit | None: a row-parallel layer's split
        of K by its whole weight's shape (None on the routes that are not invariant)
    row_linear(x [M, K_r], w [N, K_r], split, bias=None, f32=False) -> [M, N]: the rank's
        parts of that split (`row_parallel`), w stored by `row_weight`
    """

    linear: Callable
    linear_silu_mul: Callable
    norm: Callable
    rope_kv: Callable
    qkv_rope: Callable
    attend: Callable
    batch_invariant: bool
    token_rows: bool  # prefill as token rows of the decode forward (else a padded SDPA)
    paired_qkv: bool = False  # qkv_rope takes q/k/v in pair_rotary_rows' order
    weight: Callable = _row_major  # a [N, K] weight as this route's linear reads it fastest
    row_split: Callable | None = None
    row_linear: Callable | None = None
    row_weight: Callable = _row_major  # an o / down weight as row_linear reads it
    column_pieces: bool = False  # linear takes pieces= (the CPU route: `RowMM.linear`)

    @classmethod
    def select(
        cls,
        device: torch.device,
        batch_invariant: bool = True,
        fused_kernels: bool | None = None,
        matmul_config: matmul.MatmulConfig | None = None,
    ) -> ForwardOps:
        """The route for `device` (module docstring). `fused_kernels`: the Triton norm,
        rotary and SwiGLU kernels (True) or their torch references (False); None = on
        CUDA only. Off CUDA, True needs TRITON_INTERPRET=1 (for tests)."""
        cuda = device.type == "cuda"
        kernels = cuda if fused_kernels is None else fused_kernels
        if cuda and batch_invariant and not kernels:
            raise ValueError(
                "batch_invariant=True on CUDA needs the fused kernels (fused=None "
                "or True): torch's CUDA norm picks its launch by the batch"
            )
        ref = "" if kernels else "_reference"
        norm = getattr(rms_norm, "residual_rms_norm" + ref)
        rope_kv = getattr(fused, "rope_kv_write" + ref)
        silu_mul = getattr(fused, "silu_mul" + ref)
        weight = row_weight = _row_major
        row_split = row_linear = None
        if cuda:
            attend = attention.decode_attention
            if batch_invariant:
                lin = partial(matmul.linear, config=matmul_config)
                lin_silu = partial(matmul.linear_silu_mul, config=matmul_config)
                row_split = partial(row_parallel.row_split_gpu, config=matmul_config)
                row_linear = partial(row_parallel.row_linear_gpu, config=matmul_config)
        else:
            rows = cpu_route.RowMM()  # its measured call sizes live as long as the route
            attend = rows.attend
            if not kernels:
                rope_kv = cpu_route.rope_kv  # the reference's bits in fewer ops
                norm = cpu_route.residual_rms_norm
            if batch_invariant:
                lin, weight = rows.linear, _k_major
                row_split, row_linear = row_parallel.row_split_cpu, rows.row_linear
                row_weight = _k_major_f32
        if not batch_invariant:
            lin = F.linear
        paired = cuda and batch_invariant
        if paired:
            qkv_rope = partial(matmul.linear_rope, config=matmul_config)
        else:
            lin_silu = partial(_linear_then_silu_mul, linear=lin, silu_mul=silu_mul)
            qkv_rope = partial(_linear_then_rope, linear=lin, rope_kv=rope_kv)
        return cls(linear=lin, linear_silu_mul=lin_silu, norm=norm, rope_kv=rope_kv,
                   qkv_rope=qkv_rope, paired_qkv=paired, attend=attend,
                   batch_invariant=batch_invariant, token_rows=cuda or batch_invariant,
                   weight=weight, row_split=row_split, row_linear=row_linear,
                   row_weight=row_weight, column_pieces=batch_invariant and not cuda)  # fmt: skip
