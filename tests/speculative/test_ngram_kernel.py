"""The n-gram match kernel against its torch reference (`NgramHistory.write_last` +
`NgramHistory.drafts`), value for value."""

from __future__ import annotations

from tests.interpreter import ensure_interpreter

ensure_interpreter()

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from graphexec.speculative.ngram_device import NgramHistory  # noqa: E402

# the CPU under the interpreter in CI; CUDA with `pytest -m gpu`
DEVICES = [pytest.param("cpu", marks=pytest.mark.skipif(torch.cuda.is_available(),
                                                        reason="kernels compile for CUDA")),
           pytest.param("cuda", marks=pytest.mark.gpu)]  # fmt: skip


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("window, ngram_max, ngram_min, k", [
    (64, 4, 1, 3),  # the usual shape: histories longer and shorter than the window
    (5, 4, 2, 4),  # a window shorter than ngram_max + 1: runs capped at W - 1
    (1100, 3, 1, 2),  # a window of two blocks: a later block wins a tie
    (64, 2, 1, 0),  # a spec_k = 0 step: the count alone (would it have drafted)
])  # fmt: skip
def test_kernel_equals_torch(device, window, ngram_max, ngram_min, k):
    rng = np.random.default_rng(window + k)
    slots, max_len, b = 10, 1300, 8
    ref = NgramHistory(slots, max_len, torch.device(device), ngram_max, ngram_min, window)
    ker = NgramHistory(slots, max_len, torch.device(device), ngram_max, ngram_min, window,
                       kernels=True)  # fmt: skip
    # stale tokens everywhere, then histories of 1 to 1,300 tokens from small alphabets
    ref.tokens.copy_(torch.from_numpy(rng.integers(0, 3, ref.tokens.shape)).to(torch.int32))
    for s in range(slots - 1):
        n = int(rng.choice([1, 2, 3, 6, 40, 700, 1250]))
        h = rng.integers(0, int(rng.integers(1, 4)), size=n)
        if s % 3 == 0:  # a repeat far back: only a wide window finds it
            h[: n // 2] = 7
            h[-2:] = 7
        ref.tokens[s, :n] = torch.from_numpy(h).to(torch.int32)
    ker.tokens.copy_(ref.tokens)
    slot_ids = torch.from_numpy(rng.permutation(slots - 1)[:b])
    slot_ids[-1] = slots - 1  # a padding row: model position -1
    lens = torch.from_numpy(rng.integers(1, max_len, size=b))
    model_pos = torch.where(slot_ids == slots - 1, -1, lens - 1)
    last = torch.from_numpy(rng.integers(0, 3, size=b))
    allow = torch.from_numpy(rng.integers(0, k + 1, size=b))
    args = [x.to(device) for x in (slot_ids, model_pos, last)]
    a_ref, a_ker = allow.to(device), allow.to(device)
    d_ref = ref.match(*args, a_ref, k)
    d_ker = ker.match(*args, a_ker, k)
    assert torch.equal(d_ker.cpu(), d_ref.cpu())
    assert torch.equal(a_ker.cpu(), a_ref.cpu())
    assert torch.equal(ker.tokens.cpu(), ref.tokens.cpu())  # the last tokens written alike
    if k:
        assert (a_ref > 0).any()  # the cases do draft
