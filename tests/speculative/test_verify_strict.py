"""`verify_drafts` in strict mode (DESIGN.md, "Speculative decoding") on the CPU: offset
j's token is exactly the token `sample_logits` draws at position pos + j with the drafts
before j counted for the penalties, so drafts are accepted while they equal the ordinary
sequence; per-offset grammar bitmasks; zero drafts are ordinary sampling."""

from __future__ import annotations

from tests.interpreter import ensure_interpreter

ensure_interpreter()

import pytest
import torch

import graphexec as gx
from tests.speculative.verify_cases import METHODS, MIXED, P, bits, mixed_inputs, sequential, verify

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


# -------------------------------------------------------- 1. strict equals sequential sampling


@pytest.mark.parametrize("K", [1, 4])
def test_strict_equals_sequential_sampling(K: int) -> None:
    V = 150
    params = MIXED
    B = len(params)
    logits, positions, counts, prompt = mixed_inputs(B, K, V, seed=K)
    seq, outs = sequential(logits, params, positions, counts, prompt)
    assert (seq >= 0).all()
    # the control: without the earlier tokens counted, some penalised row draws otherwise
    if K > 1:
        uncounted = torch.stack(
            [gx.sample_logits(logits[:, j], params, positions + j, token_counts=counts,
                              prompt_mask=prompt, backend="torch").token_ids
             for j in range(K + 1)], dim=1)  # fmt: skip
        assert not torch.equal(uncounted, seq)

    # every draft is the ordinary token: all accepted, the bonus is the ordinary one
    out = verify(logits, seq[:, :K].clone(), params, positions, token_counts=counts,
                 prompt_mask=prompt)  # fmt: skip
    assert out.valid.all()
    assert out.num_accepted.tolist() == [K] * B
    assert out.num_tokens.tolist() == [K + 1] * B
    assert torch.equal(out.token_ids, seq)
    asked = [b for b, p in enumerate(params) if p.logprobs is not None]
    for j in range(K + 1):
        o = outs[j]
        torch.testing.assert_close(out.logprobs[asked, j], o.logprobs[asked], rtol=0, atol=1e-6)
        assert torch.equal(out.ranks[asked, j], o.ranks[asked])
        for b in asked:
            n = params[b].logprobs
            assert torch.equal(out.top_token_ids[b, j, :n], o.top_token_ids[b, :n])
            torch.testing.assert_close(out.top_logprobs[b, j, :n], o.top_logprobs[b, :n],
                                       rtol=0, atol=1e-6)  # fmt: skip

    # a wrong draft at offset c_b: accepted up to c_b, the ordinary token there, -1 after
    drafts = seq[:, :K].clone()
    cut = torch.arange(B) % K
    wrong = (seq[torch.arange(B), cut] + 1 + torch.arange(B)) % V
    drafts[torch.arange(B), cut] = wrong
    drafts[B - 1, cut[B - 1] :] = -1  # a row with fewer drafts: the bonus at its first pad
    out = verify(logits, drafts, params, positions, token_counts=counts, prompt_mask=prompt)
    assert out.valid.all()
    assert out.num_accepted.tolist() == cut.tolist()
    assert out.num_tokens.tolist() == (cut + 1).tolist()
    j = torch.arange(K + 1).unsqueeze(0)
    assert torch.equal(out.token_ids, torch.where(j <= cut.unsqueeze(1), seq, -1))
    for b in asked:
        for jj in range(int(cut[b]) + 1):
            o = outs[jj]
            assert abs(float(out.logprobs[b, jj]) - float(o.logprobs[b])) <= 1e-6
            assert int(out.ranks[b, jj]) == int(o.ranks[b])


def test_strict_with_no_token_counts_counts_the_drafts() -> None:
    """token_counts None with penalised rows: the drafts before an offset still count."""
    V, K = 60, 3
    params = [P(temperature=0.0, frequency_penalty=2.0, seed=1),
              P(presence_penalty=2.0, temperature=0.3, seed=2), P(seed=3)]  # fmt: skip
    B = len(params)
    g = torch.Generator().manual_seed(5)
    logits = (torch.randn(B, 1, V, generator=g) * 0.5).expand(B, K + 1, V).contiguous()
    seq, _ = sequential(logits, params, [0, 10, 20])
    # the greedy row's penalty moves the argmax off the offset-0 token
    assert seq[0, 1] != seq[0, 0]
    out = verify(logits, seq[:, :K].clone(), params, [0, 10, 20])
    assert torch.equal(out.token_ids, seq)
    assert out.num_accepted.tolist() == [K] * B


# ------------------------------------------------------------- 2. per-offset grammar bitmask


@pytest.mark.parametrize("method", METHODS)
def test_per_offset_bitmask(method: str) -> None:
    V, K = 100, 3
    params = [P(temperature=0.0, seed=1), P(top_k=5, seed=2), P(top_p=0.7, seed=3),
              P(seed=4, temperature=1.5), P(min_p=0.2, seed=5),
              P(presence_penalty=1.5, frequency_penalty=1.0, seed=6, temperature=0.8),
              P(top_k=2, temperature=0.0, logit_bias={9: 5.0}, seed=7)]  # fmt: skip
    B = len(params)
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(B, K + 1, V, generator=g) * 2
    allowed = torch.rand(B, K + 1, V, generator=g) < 0.25
    allowed[..., 9] |= torch.rand(B, K + 1, generator=g) < 0.5
    # each offset's best token is disallowed there: the mask must take effect
    best = logits.argmax(dim=2)
    allowed.scatter_(2, best.unsqueeze(2), False)
    positions = torch.arange(B) * 5
    seq, _ = sequential(logits, params, positions, allowed=allowed)
    assert torch.gather(allowed, 2, seq.unsqueeze(2)).all()
    unmasked, _ = sequential(logits, params, positions)
    assert not torch.equal(unmasked, seq)

    bm = bits(allowed)
    if method == "strict":
        out = verify(logits, seq[:, :K].clone(), params, positions, bitmask=bm)
        assert torch.equal(out.token_ids, seq)
        assert out.num_accepted.tolist() == [K] * B
    # drafts anywhere, mostly disallowed: emitted tokens lie in their offset's allowed set
    # (rejection: one-hot drafts and draft_probs spread over the whole vocabulary)
    for trial in range(4):
        drafts = seq[:, :K].clone()
        noise = torch.randint(0, V, (B, K), generator=g)
        drafts = torch.where(torch.rand(B, K, generator=g) < 0.5, noise, drafts)
        q = None
        if method == "rejection" and trial % 2:
            q = torch.softmax(torch.randn(B, K, V, generator=g) * 2, dim=2)
        out = verify(logits, drafts, params, positions + trial * 100, bitmask=bm, draft_probs=q,
                     method=method)  # fmt: skip
        assert out.valid.all()
        n = out.num_tokens
        j = torch.arange(K + 1).unsqueeze(0)
        emitted = j < n.unsqueeze(1)
        tok = out.token_ids.clamp(min=0)
        assert torch.gather(allowed, 2, tok.unsqueeze(2)).squeeze(2)[emitted].all()
        assert (out.token_ids[~emitted] == -1).all()
        if method == "strict":
            # the emitted tokens are the sequential ones with that offset's mask (the
            # drafts before the stop are the sequence's, so the counts agree)
            pos_t = positions + trial * 100
            ref, _ = sequential(logits, params, pos_t, allowed=allowed)
            assert torch.equal(out.token_ids, torch.where(emitted, ref, -1))
            lead = torch.cumprod((drafts == ref[:, :K]).to(torch.int64), dim=1).sum(dim=1)
            assert out.num_accepted.tolist() == lead.tolist()


# ---------------------------------------------------------------------- 3. zero drafts


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("K", [0, 1, 3])
def test_zero_drafts_equal_ordinary_sampling(method: str, K: int) -> None:
    V = 120
    params = MIXED
    B = len(params)
    logits, positions, counts, prompt = mixed_inputs(B, K, V, seed=30 + K)
    drafts = torch.full((B, K), -1, dtype=torch.int64)
    q = torch.full((B, K, V), 1.0 / V) if method == "rejection" else None
    out = verify(logits, drafts, params, positions, token_counts=counts, prompt_mask=prompt,
                 draft_probs=q, method=method)  # fmt: skip
    ref = gx.sample_logits(logits[:, 0], params, positions, token_counts=counts,
                           prompt_mask=prompt, backend="torch")  # fmt: skip
    assert out.valid.all()
    assert out.num_tokens.tolist() == [1] * B
    assert out.num_accepted.tolist() == [0] * B
    assert torch.equal(out.token_ids[:, 0], ref.token_ids)
    assert (out.token_ids[:, 1:] == -1).all()
    asked = [b for b, p in enumerate(params) if p.logprobs is not None]
    torch.testing.assert_close(out.logprobs[asked, 0], ref.logprobs[asked], rtol=0, atol=1e-6)
    assert torch.equal(out.ranks[asked, 0], ref.ranks[asked])
    assert torch.equal(out.top_token_ids[asked, 0], ref.top_token_ids[asked])


def test_empty_batch() -> None:
    for method in METHODS:
        out = verify(torch.zeros(0, 3, 10), torch.zeros(0, 2, dtype=torch.int64), [], [],
                     method=method)  # fmt: skip
        assert out.token_ids.shape == (0, 3) and out.num_tokens.shape == (0,)
