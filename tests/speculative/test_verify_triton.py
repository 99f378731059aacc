"""`verify_drafts` on the Triton backend (interpreter) gives the torch backend's tokens:
mixed batches, one row, bad rows and pads, strided inputs, count ids."""

from __future__ import annotations

from tests.interpreter import ensure_interpreter

ensure_interpreter()

import pytest
import torch

from graphexec.sampling.pipeline import sample_step
from graphexec.sampling.tensors import SamplerOutput, SamplingTensors
from tests.speculative.verify_cases import (
    METHODS,
    MIXED,
    NAN,
    NINF,
    P,
    assert_same_output,
    mixed_inputs,
    sequential,
    verify,
)

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


# ---------------------------------------------------------------- 10. Triton (interpreter)


@pytest.mark.parametrize("method", METHODS)
def test_triton_equals_torch(method: str) -> None:
    V, K = 130, 2  # two draw blocks
    params = MIXED
    B = len(params)
    logits, positions, counts, prompt = mixed_inputs(B, K, V, seed=101)
    seq, _ = sequential(logits, params, positions, counts, prompt)
    drafts = seq[:, :K].clone()
    drafts[1::3, 1] = (drafts[1::3, 1] + 3) % V
    drafts[2, 1] = -1
    g = torch.Generator().manual_seed(102)
    q = torch.softmax(torch.randn(B, K, V, generator=g), dim=2) if method == "rejection" else None
    kw = dict(token_counts=counts, prompt_mask=prompt, draft_probs=q, method=method)
    ref = verify(logits, drafts, params, positions, backend="torch", **kw)
    tri = verify(logits, drafts, params, positions, backend="triton", **kw)
    assert_same_output(tri, ref)
    assert torch.equal(tri.sampled.token_ids, ref.sampled.token_ids)
    if method == "strict":
        assert int(ref.num_accepted.sum()) > B  # the drafts do get accepted
        # and the tokens are the ordinary ones at every emitted offset
        j = torch.arange(K + 1).unsqueeze(0)
        assert torch.equal(ref.token_ids, torch.where(j < ref.num_tokens.unsqueeze(1), seq, -1))


def test_triton_single_row_equals_torch() -> None:
    """B = 1: the flattened offsets' slot ids and positions must be real rows for the
    kernels (an expanded view would read out of bounds)."""
    V, K = 130, 3
    for b in (5, 9, 11):  # penalised and biased rows
        logits, positions, counts, prompt = mixed_inputs(len(MIXED), K, V, seed=103)
        sub = torch.tensor([b])
        seq, _ = sequential(logits[sub], [MIXED[b]], positions[sub], counts[sub], prompt[sub])
        kw = dict(token_counts=counts[sub], prompt_mask=prompt[sub])
        args = (logits[sub], seq[:, :K].clone(), [MIXED[b]], positions[sub])
        ref = verify(*args, backend="torch", **kw)
        tri = verify(*args, backend="triton", **kw)
        assert torch.equal(ref.token_ids, seq)
        assert_same_output(tri, ref)


@pytest.mark.parametrize("K", [0, 3])
def test_triton_bad_rows_and_pads_equal_torch(K: int) -> None:
    """The Triton flatten / emit on rows with nothing samplable (at offset 0, at offset 2),
    pads, out-of-range-free drafts of every run length, in both methods."""
    V, B = 40, 6
    g = torch.Generator().manual_seed(31)
    logits = torch.randn(B, K + 1, V, generator=g)
    params = [P(temperature=0.0, seed=1), P(seed=2, top_k=4), P(seed=3, logprobs=2),
              P(temperature=0.0, seed=4, presence_penalty=1.0), P(seed=5, top_p=0.5),
              P(temperature=0.0, seed=6)]  # fmt: skip
    logits[1, 0] = NAN
    positions = torch.arange(B) * 3
    seq, _ = sequential(logits, params, positions)
    drafts = seq[:, :K].clone()
    if K:
        logits[4, 2] = NINF
        drafts[1] = torch.tensor([3, 4, 5])  # row 1 has no sequence: drafts anyway
        drafts[2, 1:] = -1
        drafts[5, 0] = (drafts[5, 0] + 1) % V
    for method in METHODS:
        ref = verify(logits, drafts, params, positions, method=method)
        tri = verify(logits, drafts, params, positions, method=method, backend="triton")
        assert_same_output(tri, ref)
        assert ref.valid.tolist() == [True, False, True, True, True, True]


@pytest.mark.parametrize("layout", ["drafts", "positions"])
def test_triton_strided_inputs_equal_torch(layout: str) -> None:
    """Views are valid arguments: a transposed drafts tensor, every other position."""
    V, K, B = 50, 3, 4
    g = torch.Generator().manual_seed(21)
    logits = torch.randn(B, K + 1, V, generator=g)
    params = [P(seed=i, temperature=0.0 if i % 2 else 1.0) for i in range(B)]
    seq, _ = sequential(logits, params, torch.arange(B) * 10)
    drafts, positions = seq[:, :K].clone(), (torch.arange(2 * B) * 5)[::2]
    if layout == "drafts":
        positions = positions.clone()
        drafts = drafts.T.contiguous().T
        assert drafts.stride(1) != 1
    ref = verify(logits, drafts, params, positions, backend="torch")
    tri = verify(logits, drafts, params, positions, backend="triton")
    assert torch.equal(ref.token_ids, verify(logits, drafts.contiguous(), params,
                                             positions.contiguous()).token_ids)  # fmt: skip
    assert_same_output(tri, ref)


def test_triton_count_ids_equal_torch() -> None:
    """sample_step's count_ids: triton = torch = the same ids added to token_counts."""
    V = 130
    params = [P(temperature=0.0, frequency_penalty=2.0, seed=1),
              P(presence_penalty=2.0, temperature=0.5, seed=2, logprobs=2,
                logprobs_mode="processed"),
              P(repetition_penalty=3.0, frequency_penalty=1.0, top_k=8, seed=3),
              P(seed=4, top_p=0.8, frequency_penalty=-1.5, logit_bias={0: 2.0}),
              P(seed=5, temperature=0.3),  # no penalties: count_ids change nothing
              P(temperature=0.0, presence_penalty=-2.0, min_p=0.1, seed=6)]  # fmt: skip
    B = len(params)
    g = torch.Generator().manual_seed(12)
    logits = torch.randn(B, V, generator=g) * 0.7
    top = logits.argsort(dim=1, descending=True)
    ids = torch.stack([top[:, 0], top[:, 0], top[:, 1], top[:, 2]], dim=1)
    ids[1, 3] = -1
    ids[3, 2:] = -1
    counts = torch.zeros(B, V, dtype=torch.int32)
    counts[:, 5] = 1
    prompt = torch.zeros(B, V, dtype=torch.bool)
    prompt[:, 9] = True
    added = counts.clone()
    for b in range(B):
        for i in ids[b].tolist():
            if i >= 0:
                added[b, i] += 1
    pos = torch.arange(B) * 13 + 2

    def run(backend, count_ids, tc):
        table = SamplingTensors.from_params(params, V, "cpu", tc, prompt)
        out = SamplerOutput.allocate(B, "cpu", 2)
        return sample_step(logits, torch.arange(B), pos, table, out, backend=backend,
                           count_ids=count_ids)  # fmt: skip

    ref = run("torch", ids, counts)
    tri = run("triton", ids, counts)
    assert torch.equal(tri.token_ids, ref.token_ids)
    torch.testing.assert_close(tri.logprobs, ref.logprobs, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(tri.top_logprobs, ref.top_logprobs, rtol=1e-5, atol=1e-5)
    assert torch.equal(tri.top_token_ids, ref.top_token_ids)
    by_counts = run("torch", None, added)
    assert torch.equal(by_counts.token_ids, ref.token_ids)
    torch.testing.assert_close(by_counts.logprobs, ref.logprobs, rtol=0, atol=1e-6)
    assert torch.equal(run("triton", None, added).token_ids, ref.token_ids)
    # the control: the ids do change the penalised rows (greedy rows leave their argmax)
    plain = run("torch", None, counts)
    assert ref.token_ids[0] != plain.token_ids[0]
    assert ref.token_ids[4] == plain.token_ids[4]
