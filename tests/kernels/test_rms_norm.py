"""`rms_norm`: the mean square is exact (checked against rational sums), so a row's norm
has the same bits in any column order."""

from tests.interpreter import ensure_interpreter

ensure_interpreter()

from fractions import Fraction

import pytest
import torch

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


@pytest.mark.gpu
@pytest.mark.parametrize("D", [896, 2048, 4096])
def test_cuda_norm_bits_do_not_depend_on_the_warp_count(D) -> None:
    """Every warp count (each a different layout of the row's threads and reduction
    tree) gives the bits of the default launch, with and without a residual; and the
    rows the torch reference computes, within a unit of the last place."""
    from graphexec.kernels.fused import FusedConfig

    x, r, w = (t.cuda() for t in rows(33, D, torch.bfloat16, seed=D))
    for res in (None, r):
        want, new = residual_rms_norm(x, res, w, 1e-5)
        for warps in (1, 2, 4, 8, 16, 32):
            got, got_new = residual_rms_norm(x, res, w, 1e-5, config=FusedConfig(norm_warps=warps))
            assert torch.equal(got, want) and torch.equal(got_new, new), warps
        ref, _ = residual_rms_norm_reference(x, res, w, 1e-5)
        assert ((want.float() - ref.float()).abs() <= ref.float().abs() * 2**-7 + 1e-6).all()
