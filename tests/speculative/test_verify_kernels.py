"""verify_kernels (Triton, interpreted on the CPU) against their torch references."""

from tests.interpreter import ensure_interpreter

ensure_interpreter()

import pytest  # noqa: E402
import torch  # noqa: E402

from graphexec.speculative import verify_kernels  # noqa: E402
from graphexec.speculative.verify import (  # noqa: E402
    VerifyOutput,
    clean_drafts,
    emit,
    flatten_rows,
)


def _drafts(B: int, K: int, V: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    d = torch.randint(-1, V, (B, K), generator=g)
    d[::3] = torch.randint(0, V, (d[::3].shape[0], K), generator=g)
    if K:
        d[1::5, -1] = V + 3  # an out-of-range id ends the row's drafts
    return d


@pytest.mark.parametrize("K", [0, 1, 3, 5])
@pytest.mark.parametrize("B", [1, 7])
def test_flatten_matches_torch(B, K):
    V = 50
    d = _drafts(B, K, V, seed=B * 10 + K)
    slots = torch.randperm(20)[:B]
    pos = torch.randint(0, 1000, (B,))
    drafts, rs, rp, ci = verify_kernels.flatten(slots, pos, d, V)
    ref_d = clean_drafts(d, V)
    ref = flatten_rows(slots, pos, ref_d)
    assert torch.equal(drafts, ref_d)
    assert torch.equal(rs, ref[0]) and torch.equal(rp, ref[1])
    assert (ci is None) == (ref[2] is None)
    if ci is not None:
        assert torch.equal(ci, ref[2])


def test_flatten_of_strided_inputs_matches_torch():
    """A transposed draft tensor and slot ids / positions read out of wider tensors: the
    kernel indexes rows contiguously, so `flatten` must copy such views."""
    B, K, V = 7, 3, 50
    d = _drafts(B, K, V, seed=3).t().contiguous().t()
    assert d.stride() == (1, B)
    table = torch.stack([torch.randperm(20)[:B], torch.randint(0, 1000, (B,))], dim=1)
    slots, pos = table[:, 0], table[:, 1]
    drafts, rs, rp, ci = verify_kernels.flatten(slots, pos, d, V)
    ref_d = clean_drafts(d, V)
    ref = flatten_rows(slots, pos, ref_d)
    assert torch.equal(drafts, ref_d)
    assert torch.equal(rs, ref[0]) and torch.equal(rp, ref[1]) and torch.equal(ci, ref[2])


@pytest.mark.parametrize("strict", [True, False])
@pytest.mark.parametrize("K", [0, 1, 4])
def test_emit_matches_torch(K, strict):
    B, V = 40, 6  # a small V: drafts often equal the candidates
    g = torch.Generator().manual_seed(K + 10 * strict)
    drafts = clean_drafts(torch.randint(-1, V, (B, K), generator=g), V)
    cand = torch.randint(-1, V, (B, K + 1), generator=g)
    cand[::4, :K] = torch.where(drafts[::4] >= 0, drafts[::4], cand[::4, :K])
    acc = (drafts >= 0) & (drafts == cand[:, :K])
    if not strict:
        acc = acc | (torch.rand(B, K, generator=g) < 0.3) & (drafts >= 0)
    a = VerifyOutput.allocate(B, K, "cpu", None)
    b = VerifyOutput.allocate(B, K, "cpu", None)
    emit(drafts, acc, cand, a)
    verify_kernels.emit(drafts, cand, b, None if strict else acc)
    for f in ("token_ids", "num_tokens", "num_accepted", "valid"):
        assert torch.equal(getattr(a, f), getattr(b, f)), f
    assert int(a.num_tokens.min()) >= 0 and bool((a.valid == (a.num_tokens > 0)).all())
