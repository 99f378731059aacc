"""`rms_norm`: the mean square is exact, so a row's norm has the same bits in its own
kernel and inside a GEMM (`matmul.linear_*(..., norm=)`), in any layout or column order."""

from tests.interpreter import ensure_interpreter

ensure_interpreter()

from fractions import Fraction

import pytest
import torch

from graphexec.kernels import matmul as mm
from graphexec.kernels.fused import pair_rotary_rows
from graphexec.kernels.matmul_config import MatmulTile
from graphexec.kernels.rms_norm import (
    mean_square_reference,
    residual_rms_norm,
    residual_rms_norm_reference,
)  # fmt: skip


def rows(M, D, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, D, generator=g)
    x[:, ::7] *= 300.0  # a spread of exponents, as a residual stream has
    x[:, 1::11] *= 1e-4
    r = torch.randn(M, D, generator=g)
    return x.to(dtype), r.to(dtype), (1 + torch.randn(D, generator=g) / 4).to(dtype)


def test_mean_square_is_the_exact_sum_truncated_47_bits_below_the_largest() -> None:
    x, _, _ = rows(6, 50, torch.float32)
    x[1] = 0.0
    x[2, 3:] = 1e-30  # squares far below the largest: truncated to nothing
    x[3] = torch.tensor(2.0**-140)  # subnormal squares
    got = mean_square_reference(x)
    for i in range(6):
        sq = [Fraction(float(v)) ** 2 for v in x[i].tolist()]
        sq = [Fraction(float(torch.tensor(float(s), dtype=torch.float32))) for s in sq]
        true = sum(sq) / 50
        top = max(sq)
        assert Fraction(float(got[i])) <= true * (1 + Fraction(1, 2**23))
        assert true - Fraction(float(got[i])) <= top * Fraction(50, 2**46) + true / 2**23


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_norm_does_not_depend_on_its_column_order(dtype) -> None:
    """Permuted columns (x, residual and weight alike) give the permuted outputs, bit for
    bit: a float sum of squares in another order would not."""
    x, r, w = rows(16, 300, dtype)
    perm = torch.randperm(300, generator=torch.Generator().manual_seed(3))
    out, new = residual_rms_norm(x, r, w, 1e-6)
    pout, pnew = residual_rms_norm(x[:, perm], r[:, perm], w[perm], 1e-6)
    assert torch.equal(pout, out[:, perm]) and torch.equal(pnew, new[:, perm])
    want, _ = residual_rms_norm_reference(x, r, w, 1e-6)
    torch.testing.assert_close(out.float(), want.float(), rtol=2e-2 if dtype != torch.float32
                               else 1e-6, atol=1e-6)  # fmt: skip


def test_bad_rows_stay_in_their_row() -> None:
    x, r, w = rows(4, 64, torch.float32)
    x[1, 5], x[2, 9] = float("inf"), float("nan")
    out, _ = residual_rms_norm(x, r, w, 1e-6)
    good, _ = residual_rms_norm(x[[0, 3]], r[[0, 3]], w, 1e-6)
    assert torch.equal(out[[0, 3]], good)
    assert out[2].isnan().all() and out[1, 5].isnan()


# M = 6: past norm_rows (4), the norm's own kernel; whole: a row read at once, else in
# blocks of 32 columns (rows longer than NORM_WHOLE_ROW)
@pytest.mark.parametrize("M,programs,dtype,whole", [
    (1, 2, torch.bfloat16, True), (3, 1, torch.float32, True), (4, 2, torch.float32, False),
    (2, 1, torch.bfloat16, False), (6, 1, torch.bfloat16, True)])  # fmt: skip
def test_a_norm_inside_the_gemm_is_the_norms_kernel_then_the_gemm(M, programs, dtype, whole,
                                                                  monkeypatch) -> None:  # fmt: skip
    """linear_silu_mul and linear_rope with norm= (residual or none) equal
    residual_rms_norm, then the GEMM: outputs, the new residual and the cache bitwise."""
    if not whole:
        monkeypatch.setattr(mm, "NORM_WHOLE_ROW", 32)
    H, KV, hd, K = 2, 1, 8, 96
    x, r, lnw = rows(M, K, dtype, seed=M)
    g = torch.Generator().manual_seed(1)
    w_gu = (torch.randn(64, K, generator=g) / K**0.5).to(dtype)
    w_qkv = (torch.randn((H + 2 * KV) * hd, K, generator=g) / K**0.5).to(dtype)
    tile = MatmulTile(16, 16, 16, 1, 1, split=2)
    cfg = mm.MatmulConfig.interpreter().replace(
        tiles=((32, K, tile), (w_qkv.shape[0], K, tile)), norm_rows=4)  # fmt: skip
    T = 8
    cos, sin = torch.rand(T, hd).to(dtype), torch.rand(T, hd).to(dtype)
    pos, slots = torch.arange(M) % T, torch.arange(M) // T
    for res in (r, None):
        h, new = residual_rms_norm(x, res, lnw, 1e-5)
        got, got_new = mm._launch(x, w_gu, None, True, cfg, programs, norm=(res, lnw, 1e-5))
        assert torch.equal(got, mm._launch(h, w_gu, None, True, cfg, programs))
        assert torch.equal(got_new, new)
        kv = torch.zeros(2, 2, T, KV, hd, dtype=dtype)
        kv_two = kv.clone()
        paired = pair_rotary_rows(w_qkv, H, KV)
        q, q_new = mm._launch(x, paired, None, False, cfg, programs, norm=(res, lnw, 1e-5),
                              rope=(pos, slots, cos, sin, kv, H))  # fmt: skip
        q_two = mm._launch(h, paired, None, False, cfg, programs,
                           rope=(pos, slots, cos, sin, kv_two, H))  # fmt: skip
        assert torch.equal(q, q_two) and torch.equal(kv, kv_two) and torch.equal(q_new, new)


@pytest.mark.gpu
@pytest.mark.parametrize("D,inter", [(2048, 8192), (4096, 14336), (896, 4864)])
def test_cuda_a_norm_inside_the_gemm_is_the_norms_kernel_then_the_gemm(D, inter) -> None:
    """bf16 at the real models' shapes (Llama-3.2-1B, -3.1-8B, Qwen2.5-0.5B gate/up): the
    fused norm equals its own kernel then the GEMM, at every row count up to norm_rows
    and past it."""
    g = torch.Generator(device="cuda").manual_seed(D)
    w = torch.randn(2 * inter, D, device="cuda", generator=g, dtype=torch.bfloat16) * D**-0.5
    lnw = 1 + torch.randn(D, device="cuda", generator=g, dtype=torch.bfloat16) / 4
    cfg = mm.MatmulConfig.gpu().replace(norm_rows=4)
    for M in range(1, cfg.norm_rows + 3):
        x = torch.randn(M, D, device="cuda", generator=g, dtype=torch.bfloat16) * 3
        r = torch.randn(M, D, device="cuda", generator=g, dtype=torch.bfloat16) * 30
        for res in (r, None):
            h, new = residual_rms_norm(x, res, lnw, 1e-5)
            got, got_new = mm.linear_silu_mul(x, w, config=cfg, norm=(res, lnw, 1e-5))
            assert torch.equal(got, mm.linear_silu_mul(h, w, config=cfg)), M
            assert torch.equal(got_new, new), M
